"""Domain errors. Raised inside the package; translated to a message + hint + exit code by the CLI only."""

from __future__ import annotations


class ScoreboardError(Exception):
    """Bad input or a failed step: exit 1. `hint` is the next command or fix to try."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class InputError(ScoreboardError):
    """A file, field or option the user supplied is wrong."""


class LockError(InputError):
    """reference.lock failed validation; `problems` holds every error with its path."""

    def __init__(self, problems: list[str], path: str = "reference.lock", hint: str | None = None):
        self.problems = list(problems)
        msg = f"{path}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems)
        super().__init__(msg, hint or f"fix the fields named above in {path}, then run `scoreboard verify`")


class EngineError(ScoreboardError):
    """An engine failed (build, load, run). Not retried."""


class TransientError(EngineError):
    """A failure that may succeed on retry (out of memory at load, device lost, driver hiccup)."""


class PinError(ScoreboardError):
    """A pin does not hold (force-pushed ref, wrong hash). Exit 1 when met while running a round."""


class NonCompliant(ScoreboardError):
    """The command ran fine but the result is not compliant (REJECT, drift, tampered history): exit 2."""

    exit_code = 2
