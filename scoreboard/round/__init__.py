"""`scoreboard round run`: preflight, gate before speed, interleaved timing, verdict, seal, frontier."""
