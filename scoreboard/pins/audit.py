"""Runs every pin check the scope asks for and collects one AuditReport; a failing check never stops the others."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Callable

from ..lockfile import GitReference, Lock, SdistReference, lock_digest
from . import AuditReport, Finding
from .git import check_git_reference
from .hub import check_weights
from .pypi import check_sdist
from .workflows import check_workflows


def _users(lock: Lock, attr: str, key: str) -> tuple[str, ...]:
    return tuple(sorted(t for t, tt in lock.targets.items() if getattr(tt, attr) == key))


def _guard(pin: str, subject: str, fn: Callable[[], list[Finding]]) -> list[Finding]:
    """Run one check; an unexpected exception becomes an error finding so the remaining pins are still checked."""
    try:
        return fn()
    except Exception as exc:  # a bug in a checker must not hide the other pins' results
        return [Finding("error", pin, subject, f"the check crashed: {type(exc).__name__}: {exc}",
                        "report this as a scoreboard bug (this is not drift)")]


def audit(lock: Lock, *, lock_path: str | Path = "reference.lock", targets: list[str] | None = None,
          timeout: float = 30.0, hub_endpoint: str | None = None, cache: Path | None = None,
          workflows_root: Path | None = None) -> AuditReport:
    """Audit the pins of `targets` (None: every pin in the lock, plus the workflows under `workflows_root`)."""
    if targets is not None:
        for t in targets:
            lock.target(t)  # unknown target -> InputError with did-you-mean
        refs = sorted({lock.targets[t].reference for t in targets})
        weights = sorted({lock.targets[t].weights for t in targets})
    else:
        refs, weights = sorted(lock.references), sorted(lock.weights)

    findings: list[Finding] = []
    for rid in refs:
        r, users = lock.references[rid], _users(lock, "reference", rid)
        if isinstance(r, GitReference):
            findings += _guard(f"references.{rid}", f"ref {r.ref}", lambda: check_git_reference(
                rid, r, timeout=timeout, cache=cache, targets=users))
        elif isinstance(r, SdistReference):
            findings += _guard(f"references.{rid}", f"{r.package}=={r.version}", lambda: check_sdist(
                rid, r, timeout=timeout, targets=users))
    for wid in weights:
        w, users = lock.weights[wid], _users(lock, "weights", wid)
        findings += _guard(f"weights.{wid}", w.repo, lambda: check_weights(
            wid, w, endpoint=hub_endpoint, timeout=timeout, targets=users))
    if targets is None and workflows_root is not None:
        findings += _guard(".github/workflows", "uses:", lambda: check_workflows(workflows_root))

    p = Path(lock_path)
    return AuditReport(
        findings=tuple(findings),
        lock_path=str(lock_path),
        lock_sha256=lock_digest(p) if p.is_file() else "",
        checked_at=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        scope=tuple(targets) if targets is not None else ("all",),
    )
