"""llama.cpp reference engine: pinned source -> clean cached build -> llama-bench timing + logits dumper."""
