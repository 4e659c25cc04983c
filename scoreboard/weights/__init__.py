"""Model weights: generated presets, deterministic generation, and hash verification against the lock."""
