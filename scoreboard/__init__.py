"""scoreboard: sealed-round benchmark and scoreboard harness for LLM inference engines."""

__version__ = "0.1.0"
