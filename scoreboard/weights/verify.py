"""Weight shards against their pins: parallel sha256, size checks, and generate-if-absent for generated weights.

Every shard is re-hashed (a size+mtime fingerprint is not a hash); problems are reported all
at once, each naming its shard. hashlib releases the GIL on large updates, so threads hash in parallel.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock as _Mutex
from typing import Callable

from ..cache import cache_dir
from ..errors import InputError, PinError

CHUNK = 8 << 20  # bytes per read
# (bytes done, bytes total, shard just advanced) — the CLI draws a progress bar from it
ByteProgress = Callable[[int, int, str], None]


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of a file's bytes, read in chunks; `on_bytes(n)` after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()


def hash_files(paths: list[Path], progress: ByteProgress | None = None, workers: int | None = None) -> dict[Path, str]:
    """sha256 of every path, hashed in parallel threads; one progress stream over all bytes."""
    total = sum(p.stat().st_size for p in paths)
    done = [0]
    mutex = _Mutex()

    def one(p: Path) -> tuple[Path, str]:
        def tick(n: int) -> None:
            with mutex:
                done[0] += n
                if progress:
                    progress(done[0], total, p.name)
        return p, sha256_file(p, tick)

    n = workers or min(len(paths), max(1, os.cpu_count() or 1), 8) or 1
    with ThreadPoolExecutor(max_workers=n) as pool:
        return dict(pool.map(one, paths))


def default_cache() -> Path:
    """$SCOREBOARD_CACHE, default ~/.cache/scoreboard (scoreboard.cache's rule)."""
    return cache_dir()


def weights_dir(weights_id: str, cache: Path | None = None) -> Path:
    """Where a weights entry's files live by default: $SCOREBOARD_CACHE/weights/<weights-id>/."""
    return (cache or default_cache()) / "weights" / weights_id


@dataclass
class VerifyReport:
    """Result of re-hashing one weights entry's shards."""

    weights_id: str
    root: Path
    paths: list[Path]
    hashes: dict[str, str] = field(default_factory=dict)  # lock path -> sha256 measured
    unpinned: list[str] = field(default_factory=list)  # lock paths with no size/sha256 pinned yet
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def fully_pinned(self) -> bool:
        return not self.unpinned


def check_weights(lock, weights_id: str, root: Path | None = None, progress: ByteProgress | None = None,
                  workers: int | None = None) -> VerifyReport:
    """Re-hash every shard of `weights_id` under `root`; report (never raise on) mismatches."""
    if weights_id not in lock.weights:
        raise InputError(f"unknown weights {weights_id!r} in the lock", f"weights: {', '.join(sorted(lock.weights))}")
    w = lock.weights[weights_id]
    root = Path(root) if root is not None else weights_dir(weights_id)
    rep = VerifyReport(weights_id, root, [root / f.path for f in w.files])
    present = []
    for f, p in zip(w.files, rep.paths):
        if not p.is_file():
            rep.problems.append(f"shard {f.path}: missing (expected at {p})")
        elif f.size and p.stat().st_size != f.size:
            rep.problems.append(f"shard {f.path}: size {p.stat().st_size} bytes, pinned {f.size}")
        else:
            present.append((f, p))
    hashes = hash_files([p for _, p in present], progress, workers) if present else {}
    for f, p in present:
        rep.hashes[f.path] = hashes[p]
        if not f.pinned:
            rep.unpinned.append(f.path)
        elif hashes[p] != f.sha256:
            rep.problems.append(f"shard {f.path}: sha256 {hashes[p]}, pinned {f.sha256}")
    return rep


def verify_weights(lock, weights_id: str, root: Path | None = None, progress: ByteProgress | None = None,
                   workers: int | None = None) -> VerifyReport:
    """Like :func:`check_weights`, but refuse (PinError naming every bad shard) on any mismatch."""
    rep = check_weights(lock, weights_id, root, progress, workers)
    if rep.problems:
        hint = (f"regenerate: `scoreboard weights generate {lock.weights[weights_id].spec} --out {rep.root}`"
                if lock.weights[weights_id].repo == "generated" else
                f"re-download the named shard(s) of {lock.weights[weights_id].repo} into {rep.root}")
        raise PinError(f"weights {weights_id}: {len(rep.problems)} shard problem(s) under {rep.root}\n"
                       + "\n".join(f"  {p}" for p in rep.problems), hint)
    return rep


def ensure_generated(lock, weights_id: str, cache: Path | None = None,
                     progress: ByteProgress | None = None) -> list[Path]:
    """Generated weights: generate into the cache if absent, then verify every shard against the lock.

    An existing copy that does not match is refused, not silently replaced (something changed it).
    """
    from .generate import generate, shard_names
    from .presets import get_spec

    w = lock.weights.get(weights_id)
    if w is None:
        raise InputError(f"unknown weights {weights_id!r} in the lock", f"weights: {', '.join(sorted(lock.weights))}")
    if w.repo != "generated":
        raise InputError(f"weights {weights_id} come from {w.repo}, not the generator",
                         "fetch them, then `scoreboard weights verify` with --dir")
    spec = get_spec(w.spec)
    want = [f.path for f in w.files]
    if shard_names(spec) != want:
        raise InputError(f"weights.{weights_id}.files: spec {spec.name} writes {shard_names(spec)}, "
                         f"the lock lists {want}",
                         "fix the file list in reference.lock")
    if w.quant and w.quant.lower() != spec.weight_type:
        raise InputError(f"weights.{weights_id}.quant: {w.quant!r}, but spec {spec.name} writes {spec.weight_type}",
                         "fix quant in reference.lock")
    root = weights_dir(weights_id, cache)
    if not all((root / p).is_file() for p in want):
        generate(spec, root, w.seed)
    return verify_weights(lock, weights_id, root, progress).paths
