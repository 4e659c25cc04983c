"""The project's own CI: every third-party action (and reusable workflow) is pinned by a 40-hex commit SHA.

A line scan, not a YAML parse, so the recommended version comment (`uses: a/b@<sha> # v4.2.2`) is seen.
`./local` actions are the repo's own code and are fine; `docker://` images must be pinned by
`@sha256:<64 hex>` digest. A tag or branch (`@v4`, `@main`) can be moved by its owner: drift.
Scanned: `.github/workflows/*.y{a,}ml` and `.github/actions/**/action.y{a,}ml` under the root.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import Finding

_USES = re.compile(r"""^\s*(?:-\s+)?uses:\s*(?P<q>["']?)(?P<spec>[^\s"'#]+)(?P=q)\s*(?:\#\s*(?P<comment>.*?))?\s*$""")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def workflow_files(root: Path) -> list[Path]:
    gh = root / ".github"
    found = [p for pat in ("*.yml", "*.yaml") for p in (gh / "workflows").glob(pat)]
    found += [p for pat in ("action.yml", "action.yaml") for p in (gh / "actions").rglob(pat)]
    return sorted(p for p in found if p.is_file())


def classify(spec: str) -> str | None:
    """None when `spec` is pinned immutably (or local); otherwise why not."""
    if spec.startswith("./"):
        return None
    if spec.startswith("docker://"):
        return None if _DIGEST.search(spec) else "a docker image not pinned by @sha256 digest"
    name, at, ref = spec.rpartition("@")
    if not at or not name:
        return "no @ref at all (the default branch, whatever it is today)"
    if _SHA1.match(ref):
        return None
    if re.fullmatch(r"[0-9a-fA-F]{7,39}", ref):
        return f"a short or non-lowercase SHA {ref!r} (ambiguous; GitHub needs the full 40-hex SHA)"
    return f"a mutable tag or branch {ref!r} (its owner can move it)"


def check_workflows(root: Path) -> list[Finding]:
    """One drift finding per unpinned `uses:`, one ok finding per clean file."""
    out: list[Finding] = []
    for path in workflow_files(root):
        rel = path.relative_to(root).as_posix()
        pinned = uncommented = 0
        bad: list[Finding] = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = _USES.match(line)
            if not m:
                continue
            spec = m["spec"]
            why = classify(spec)
            if why is None:
                if not spec.startswith(("./", "docker://")):
                    pinned += 1
                    uncommented += not (m["comment"] or "").strip()
                continue
            fix = (f"pin it by digest: `uses: {spec.split('@')[0]}@sha256:<digest>`" if spec.startswith("docker://")
                   else f"pin it by commit SHA with the version as a comment: `uses: {spec.rpartition('@')[0] or spec}"
                        f"@<40-hex sha of the release> # <version>` (check that the SHA is the tag's commit)")
            bad.append(Finding("drift", rel, f"line {n}: uses: {spec}", f"{spec} is {why}", fix, "", spec))
        out += bad
        if not bad:
            note = f"; {uncommented} without a `# vX` version comment (recommended)" if uncommented else ""
            out.append(Finding("ok", rel, "actions", f"{pinned} third-party action(s) pinned by commit SHA{note}"))
    return out
