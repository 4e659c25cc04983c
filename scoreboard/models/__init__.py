"""Model families the harness understands: typed configs read from GGUF metadata, with their checks."""

from .k3 import ARCH, K3Config, load_k3_config

__all__ = ["ARCH", "K3Config", "load_k3_config"]
