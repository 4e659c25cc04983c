"""`python -m scoreboard`: the same entry point as the `scoreboard` console script."""

from .cli.main import run

if __name__ == "__main__":
    run()
