"""`python -m scoreboard.worker REQUEST.json RESULT.json`: one engine worker (scoreboard.worker.serve)."""
import sys

from .serve import main

sys.exit(main(sys.argv[1:]))
