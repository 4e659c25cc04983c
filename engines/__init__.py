"""Engine plugins shipped with scoreboard (llamacpp reference, sparkinfer candidate)."""
