"""Is the reference build independent of where its cache lies? Build one plan (same build key) under two cache
roots and compare every file and link under build/bin, file by file.

    python bench/build_reproducible.py /tmp/bA /tmp/bB [--reference ID] [--device cpu|cuda] [--source SPEC]

A round compares the reference's build files with the sealed anchor for its build key
(scoreboard/round/evidence.py), so two boxes, or one box with two values of SCOREBOARD_CACHE, must build the
same bytes for the same key (a CUDA build is known not to yet: docs/reference-pin.md). Each root gets a full build unless it already holds a good one of this key (then it
is re-hashed only): clear the roots first for a from-scratch check. --source is the reference's transport
(a .tar.gz sdist, a directory, git+URL@rev; default $SCOREBOARD_REFERENCE_SOURCE, else the pin's own), e.g. an
sdist already downloaded, to spare the network. A CPU build took 4-8 minutes per root on a 2-core box.

Prints one line per path (sha256 in each root, "same" or "DIFFERS"), then the verdict. Exit 0 when every file
and link is identical, 1 when one differs, 2 on a usage or build error. Where files differ,
`cmp -l A B | wc -l` and `strings -a A | grep <root>` show which bytes and whether a path leaked.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from engines.llamacpp import build
    from scoreboard.errors import ScoreboardError
    from scoreboard.lockfile import GitReference, SdistReference, load_lock

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs=2, type=Path, help="two cache roots (SCOREBOARD_CACHE values)")
    ap.add_argument("--reference", default="", help="reference id in the lock (default: the first pypi-sdist one)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--source", default="", help="the reference source (transport) spec")
    ap.add_argument("--lock", type=Path, default=REPO / "reference.lock")
    args = ap.parse_args(argv)
    a_root, b_root = (r.expanduser().absolute() for r in args.roots)
    if a_root == b_root:
        print("the two roots are the same directory: nothing to compare", file=sys.stderr)
        return 2
    try:
        lock = load_lock(args.lock)
        refs = lock.references
        rid = args.reference or next((k for k, r in refs.items() if isinstance(r, SdistReference)), "")
        ref = refs.get(rid)
        if not isinstance(ref, (GitReference, SdistReference)):
            print(f"no git or pypi-sdist reference {rid!r} in {args.lock} (have: {', '.join(refs)})", file=sys.stderr)
            return 2
        plan = dataclasses.replace(build.plan_build(ref, args.device, rid), source_spec=args.source)
        print(f"reference {rid}, device {args.device}, build key {plan.key()} (key format {build.KEY_FORMAT})",
              flush=True)
        builds = []
        for root in (a_root, b_root):
            t0 = time.monotonic()
            b = build.ensure_build(plan, root, lambda msg, frac: None)
            how = "built" if b.rebuilt else "cached (re-hashed)"
            print(f"{root}: {how} in {time.monotonic() - t0:.1f} s -> {b.root}", flush=True)
            builds.append(b)
    except ScoreboardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scans = [build.scan_build(b.bin_dir) for b in builds]
    differ = 0
    for kind in ("files", "links"):
        in_a, in_b = scans[0][kind], scans[1][kind]
        for rel in sorted(set(in_a) | set(in_b)):
            va, vb = in_a.get(rel, "(missing)"), in_b.get(rel, "(missing)")
            same = va == vb
            differ += not same
            print(f"{'same   ' if same else 'DIFFERS'} {kind[:-1]:4} {rel}: {va}" + ("" if same else f" != {vb}"))
    digests = [build.files_digest(s) for s in scans]
    n = len(scans[0]["files"]) + len(scans[0]["links"])
    if differ:
        print(f"NOT REPRODUCIBLE: {differ} of {n} paths differ between {a_root} and {b_root}")
        return 1
    print(f"REPRODUCIBLE: all {len(scans[0]['files'])} files and {len(scans[0]['links'])} links identical; "
          f"files digest {digests[0]}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
