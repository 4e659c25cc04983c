"""Pin audit: typed findings for every external pin in reference.lock (git refs, Hub weights, sdists, CI actions).

A finding is one observation about one pin. Its ``kind``:

* ``ok``       — the pin holds (or is local and checked elsewhere);
* ``drift``    — the source was reached and answered, and what it answered differs from the pin;
* ``error``    — the check could not complete (network, timeout, HTTP 5xx/429, auth): **never drift**;
* ``unpinned`` — the lock declares the pin but has not recorded it yet (not drift, not an error).

Exit code of a report: 1 if any error (an incomplete audit is not a clean bill of health; drift that
was observed is still listed), else 2 if any drift, else 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["ok", "drift", "error", "unpinned"]
KINDS: tuple[Kind, ...] = ("drift", "error", "unpinned", "ok")  # report order

REPORT_FORMAT = 1  # version of AuditReport.to_dict(); 1 — first version


def short(sha: str, n: int = 12) -> str:
    """`efc8bc38f0a9…` for display; full values stay in `was`/`now` and the JSON."""
    return sha[:n] + "…" if len(sha) > n else sha


def human_bytes(n: float) -> str:
    """1536 -> `1.5 KiB`; binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Finding:
    """One observation. `was`/`now`: the pinned and the observed value ("" when not applicable)."""

    kind: Kind
    pin: str  # path into the lock or the repo: "references.llamacpp-k3-pr48", ".github/workflows/ci.yml"
    subject: str  # what was checked: "ref refs/pull/48/head", "UD-IQ1_S/x-00001-of-00014.gguf sha256"
    message: str  # what happened, one sentence
    action: str = ""  # what to do next ("" for ok)
    was: str = ""
    now: str = ""
    targets: tuple[str, ...] = ()  # targets whose baseline depends on this pin

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


@dataclass(frozen=True)
class AuditReport:
    """All findings of one audit run, in check order."""

    findings: tuple[Finding, ...]
    lock_path: str = ""
    lock_sha256: str = ""
    checked_at: str = ""  # ISO 8601 UTC
    scope: tuple[str, ...] = field(default=())  # target ids, or ("all",)

    def of(self, kind: Kind) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.kind == kind)

    def counts(self) -> dict[str, int]:
        return {k: len(self.of(k)) for k in KINDS}

    @property
    def exit_code(self) -> int:
        if self.of("error"):
            return 1
        if self.of("drift"):
            return 2
        return 0

    @property
    def status(self) -> str:
        return {0: "clean", 1: "error", 2: "drift"}[self.exit_code]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "status": self.status,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "lock": {"path": self.lock_path, "sha256": self.lock_sha256},
            "checked_at": self.checked_at,
            "scope": list(self.scope),
            "findings": [f.to_dict() for f in self.findings],
        }
