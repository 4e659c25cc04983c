"""sparkinfer: the bundled candidate engine, an independent torch implementation of Kimi K3 (kimi-k3).

``model.py`` is the pure math, ``weights.py`` loads GGUF shards, ``faults.py`` holds the named bugs the
gate's own tests inject, ``engine.py`` is the scoreboard plugin (entry point ``sparkinfer``).
"""

import os

__version__ = "0.1.0"

# torch's OpenMP threads spin while waiting (the default): fastest on a quiet box (k3-mini, 2 threads:
# decode ~125 tok/s vs ~60 with OMP_WAIT_POLICY=PASSIVE), but they collapse when the cores are
# oversubscribed (2-34 tok/s with 2 other busy processes on 2 cores; PASSIVE kept ~105). The value in
# force is recorded in describe(); libgomp reads it when torch loads, so set it before importing torch.
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "")
