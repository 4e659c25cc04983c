"""Python side of the logits dumper: write its inputs, run it, read float32 rows back with shape/vocab checks.

File format written by cpp/dump_logits.cpp (little endian), version 1::

    char[8] "SBLOGIT1" | uint32 version | uint32 header_bytes (52)
    int32 n_vocab, n_rows, n_tokens | uint32 n_ctx, n_batch, n_ubatch | int32 n_threads, flash_attn, n_gpu_layers
    int32 positions[n_rows] | float32 logits[n_rows, n_vocab]
"""

from __future__ import annotations

import json
import shlex
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scoreboard.engine import Geometry, LogitsRequest
from scoreboard.errors import EngineError, InputError

from .bench import RunSettings, classify_failure

MAGIC = b"SBLOGIT1"
VERSION = 1
HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("header_bytes", "<u4"), ("n_vocab", "<i4"),
                   ("n_rows", "<i4"), ("n_tokens", "<i4"), ("n_ctx", "<u4"), ("n_batch", "<u4"), ("n_ubatch", "<u4"),
                   ("n_threads", "<i4"), ("flash_attn", "<i4"), ("n_gpu_layers", "<i4")])


@dataclass
class DumpedLogits:
    logits: np.ndarray  # float32 [n_rows, n_vocab], rows in the order of `positions`
    positions: np.ndarray  # int32 [n_rows]
    header: dict[str, Any]
    command: list[str]

    @property
    def geometry(self) -> Geometry:
        h = self.header
        return Geometry(n_ctx=h["n_ctx"], n_batch=h["n_batch"], n_ubatch=h["n_ubatch"], n_threads=h["n_threads"])


def read_logits_file(path: Path, n_vocab: int | None = None) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(header, positions int32 [n_rows], logits float32 [n_rows, n_vocab]) from a dumper file, strictly checked."""
    raw = Path(path).read_bytes()
    if len(raw) < HEADER.itemsize:
        raise EngineError(f"{path}: {len(raw)} bytes, shorter than the {HEADER.itemsize}-byte header")
    h = np.frombuffer(raw[:HEADER.itemsize], HEADER)[0]
    header: dict[str, Any] = {name: (h[name].item() if name != "magic" else bytes(h[name]))
                              for name in HEADER.names or ()}
    if header["magic"] != MAGIC or header["version"] != VERSION or header["header_bytes"] != HEADER.itemsize:
        raise EngineError(f"{path}: not a version-{VERSION} logits file (magic {header['magic']!r}, "
                          f"version {header['version']}, header {header['header_bytes']} bytes)")
    rows, vocab = header["n_rows"], header["n_vocab"]
    if rows <= 0 or vocab <= 0:
        raise EngineError(f"{path}: bad shape [{rows}, {vocab}]")
    if n_vocab is not None and vocab != n_vocab:
        raise EngineError(f"{path}: vocab {vocab} != the model's {n_vocab}")
    want = HEADER.itemsize + 4 * rows + 4 * rows * vocab
    if len(raw) != want:
        raise EngineError(f"{path}: {len(raw)} bytes, expected {want} for [{rows}, {vocab}] float32")
    off = HEADER.itemsize
    positions = np.frombuffer(raw, "<i4", rows, off).copy()
    logits = np.frombuffer(raw, "<f4", rows * vocab, off + 4 * rows).reshape(rows, vocab).astype(np.float32)
    header["magic"] = header["magic"].decode()
    return header, positions, logits


def _check_request(request: LogitsRequest, n_vocab: int | None) -> None:
    n = len(request.token_ids)
    if n == 0 or not request.positions:
        raise InputError("logits request needs at least one token id and one position")
    bad = [p for p in request.positions if not 0 <= p < n]
    if bad:
        raise InputError(f"logits request: positions {bad[:5]} outside the {n} token ids")
    if n > request.geometry.n_ctx:
        raise InputError(f"logits request: {n} token ids exceed geometry n_ctx {request.geometry.n_ctx}")
    bad_ids = [t for t in request.token_ids if t < 0 or (n_vocab is not None and t >= n_vocab)]
    if bad_ids:
        raise InputError(f"logits request: token ids {bad_ids[:5]} outside the vocabulary [0, {n_vocab})")


def dumper_command(dumper: Path, model: Path, geometry: Geometry, settings: RunSettings, tokens: Path,
                   positions: Path, out: Path) -> list[str]:
    return [str(dumper), "--model", str(model), "--tokens", str(tokens), "--positions", str(positions),
            "--out", str(out), "--n-ctx", str(geometry.n_ctx), "--n-batch", str(geometry.n_batch),
            "--n-ubatch", str(geometry.n_ubatch), "--threads", str(settings.threads),
            "--flash-attn", str(settings.flash_attn), "--n-gpu-layers", str(settings.n_gpu_layers),
            "--split-mode", settings.split_mode]


def run_dumper(dumper: Path, model: Path, request: LogitsRequest, settings: RunSettings, log: Path,
               n_vocab: int | None = None, timeout_s: float | None = None) -> DumpedLogits:
    """Run the dumper on `request` and return rows in the order of `request.positions` (duplicates allowed)."""
    _check_request(request, n_vocab)
    wanted = sorted(set(request.positions))
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sb-logits-", dir=log.parent) as tmp:
        t, p, o = Path(tmp) / "tokens.i32", Path(tmp) / "positions.i32", Path(tmp) / "logits.bin"
        np.asarray(request.token_ids, dtype="<i4").tofile(t)
        np.asarray(wanted, dtype="<i4").tofile(p)
        cmd = dumper_command(dumper, model, request.geometry, settings, t, p, o)
        proc = _run(cmd, dumper, settings, log, timeout_s, model)
        header, positions, logits = read_logits_file(o, n_vocab)
    if positions.tolist() != wanted:
        raise EngineError(f"logits dumper returned positions that were not asked for; log: {log}")
    if header["n_tokens"] != len(request.token_ids):
        raise EngineError(f"logits dumper read {header['n_tokens']} tokens, sent {len(request.token_ids)}; log: {log}")
    _check_rows(logits, proc.stdout, header, settings, log)
    index = {pos: i for i, pos in enumerate(wanted)}
    rows = logits[[index[pos] for pos in request.positions]]
    return DumpedLogits(logits=np.ascontiguousarray(rows, dtype=np.float32),
                        positions=np.asarray(request.positions, dtype=np.int32), header=header, command=cmd)


def run_dumper_many(dumper: Path, model: Path, requests: list[LogitsRequest], settings: RunSettings, log: Path,
                    n_vocab: int | None = None, timeout_s: float | None = None) -> list[DumpedLogits]:
    """Several requests of one geometry in one dumper run: the model loads once and the prefix they share is
    decoded once, then restored for each (cpp/dump_logits.cpp, --lengths/--counts); each request's rows are the
    ones run_dumper gives it alone. Rows come back per request in the order of its positions."""
    if len(requests) == 1:
        return [run_dumper(dumper, model, requests[0], settings, log, n_vocab, timeout_s)]
    if not requests or any(r.geometry != requests[0].geometry for r in requests):
        raise InputError("logits requests of one dumper run need one geometry")
    for r in requests:
        _check_request(r, n_vocab)
    wanted = [sorted(set(r.positions)) for r in requests]
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sb-logits-", dir=log.parent) as tmp:
        t, p, o = Path(tmp) / "tokens.i32", Path(tmp) / "positions.i32", Path(tmp) / "logits.bin"
        ln, ct = Path(tmp) / "lengths.i32", Path(tmp) / "counts.i32"
        np.concatenate([np.asarray(r.token_ids, dtype="<i4") for r in requests]).tofile(t)
        np.concatenate([np.asarray(w, dtype="<i4") for w in wanted]).tofile(p)
        np.asarray([len(r.token_ids) for r in requests], dtype="<i4").tofile(ln)
        np.asarray([len(w) for w in wanted], dtype="<i4").tofile(ct)
        cmd = dumper_command(dumper, model, requests[0].geometry, settings, t, p, o) + ["--lengths", str(ln),
                                                                                         "--counts", str(ct)]
        proc = _run(cmd, dumper, settings, log, timeout_s, model)
        header, positions, logits = read_logits_file(o, n_vocab)
    if positions.tolist() != [x for w in wanted for x in w]:
        raise EngineError(f"logits dumper returned positions that were not asked for; log: {log}")
    if header["n_tokens"] != sum(len(r.token_ids) for r in requests):
        raise EngineError(f"logits dumper read {header['n_tokens']} tokens, sent "
                          f"{sum(len(r.token_ids) for r in requests)}; log: {log}")
    _check_rows(logits, proc.stdout, header, settings, log)
    out, row0 = [], 0
    for r, w in zip(requests, wanted):
        block = logits[row0:row0 + len(w)]
        row0 += len(w)
        index = {pos: i for i, pos in enumerate(w)}
        rows = block[[index[pos] for pos in r.positions]]
        out.append(DumpedLogits(logits=np.ascontiguousarray(rows, dtype=np.float32),
                                positions=np.asarray(r.positions, dtype=np.int32), header=header, command=cmd))
    return out


def _run(cmd: list[str], dumper: Path, settings: RunSettings, log: Path, timeout_s: float | None,
         model: Path) -> subprocess.CompletedProcess:
    """The dumper run with its log written; EngineError (classified) when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              env=settings.env(),
                              cwd=dumper.parent,  # the hashed bin dir (RUNPATH's empty entry = the cwd)
                              check=False)
    except subprocess.TimeoutExpired:
        log.write_text(f"$ {shlex.join(cmd)}\n[timed out after {timeout_s} s]\n", encoding="utf-8")
        raise EngineError(f"logits dumper timed out after {timeout_s} s; log: {log}") from None
    log.write_text(f"$ {shlex.join(cmd)}\n[exit {proc.returncode}]\n--- stdout\n{proc.stdout}\n--- stderr\n"
                   f"{proc.stderr}", encoding="utf-8")
    if proc.returncode != 0:
        raise classify_failure("logits dumper", proc.returncode, log, model, proc.stderr + proc.stdout)
    return proc


def _check_rows(logits: np.ndarray, stdout: str, header: dict[str, Any], settings: RunSettings, log: Path) -> None:
    """Finite rows, and the dumper's stdout echo agreeing with its file header and the pinned split mode."""
    if not np.isfinite(logits).all():
        bad = int((~np.isfinite(logits)).any(axis=1).sum())
        raise EngineError(f"logits dumper produced non-finite values in {bad} of {len(logits)} rows; log: {log}",
                          "the model or the build is broken; check the weights and the pin")
    try:
        echoed = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        echoed = {}
    if echoed and any(echoed.get(k) != header[k] for k in ("n_ctx", "n_batch", "n_ubatch", "n_threads")):
        raise EngineError(f"logits dumper: stdout {echoed} disagrees with its file header; log: {log}")
    if echoed.get("split_mode") != settings.split_mode:
        raise EngineError(f"logits dumper ran with split mode {echoed.get('split_mode')!r}, asked "
                          f"{settings.split_mode!r}; log: {log}", "the dumper binary is not the pinned one; prepare again")


def gguf_vocab_size(model: Path) -> int | None:
    """Number of tokens in the GGUF's tokenizer (None when the file has no tokenizer metadata)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(model), "r")
    except (OSError, ValueError, KeyError, IndexError, struct.error) as exc:  # what gguf raises on a bad file
        raise EngineError(f"{model}: cannot read GGUF metadata: {exc}", "check the weights file") from None
    field = reader.fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else None
