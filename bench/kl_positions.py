"""KL(llama.cpp || sparkinfer) at positions spread over one long gate prompt, for several sparkinfer arms.

A diagnosis of how the gate's divergence grows with depth. One prompt of N tokens is drawn for a seed exactly as the
round's gate draws its prompt (scoreboard.round.prompt.draw_prompt, then stages.padded: no ubatch shorter than 64
tokens), and every engine gets that one sequence once: the pinned llama.cpp reference of the target (its build from
the lock, through its engine's logits API, as the round runs it) and each sparkinfer arm in this process (the target's
candidate options, each ``--arm`` merging its JSON over them). Rows are taken like the gate's ``gate_positions(depth,
rows)`` at each depth: the ``rows`` positions ending at the depth. Per depth it prints, in float64 over the full
vocabulary as the gate grades (scoreboard.gate): KL(llama.cpp || arm) mean / p99 / max and top-1 agreement for every
arm, and KL(arm || candidate) for every other arm (sparkinfer's own difference, e.g. f32 against the f16 the target
runs), then a table of the KL means by depth.

    python bench/kl_positions.py --target k3-mini-cpu --depths 64 512 1024 --rows 8 --arm f64='{"dtype":"float64"}'
    python bench/kl_positions.py --target k3-gpu-long-h200 --arm f32='{"dtype":"float32"}' --json out.json
    python bench/kl_positions.py --target k3-mini-cpu --arm broken='{"faults":["mla_as_mqa"]}'

Default depths: 8 log-spaced from the target's shallowest gate depth to N, with the gate's own depths added (so the
gate's rows are among them); N defaults to the deepest requested depth (the gate's deepest: 131072 on the long
targets, whose prompt then is exactly the gate's sequence). ``--json`` writes every number, per-row KL included, with
the command, the prompt's identity and both engines' identities. Diagnosis numbers, not a round: nothing is sealed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/kl_positions.py` from anywhere: the harness beside this script
    sys.path.insert(0, str(REPO))

from scoreboard import registry  # noqa: E402
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest  # noqa: E402
from scoreboard.errors import EngineError, InputError, ScoreboardError  # noqa: E402
from scoreboard.gate import gate_positions, grade_depth, kl_rows, top1_agreement  # noqa: E402

BASE = "candidate"  # the arm of the target's own candidate options
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:8.1f} s] {msg}", flush=True)


# -- inputs ------------------------------------------------------------------------------------------------------
def parse_arm(spec: str) -> tuple[str, dict[str, Any]]:
    """``name=json-object`` -> (name, overrides); InputError naming what is wrong."""
    name, sep, text = spec.partition("=")
    name = name.strip()
    if not sep or not ARM_NAME.match(name):
        raise InputError(f"--arm {spec!r}: want NAME=JSON, NAME of letters, digits and _.+- ",
                         """e.g. --arm f32='{"dtype":"float32"}'""")
    try:
        over = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"--arm {name}: options are not JSON ({exc.msg} at character {exc.pos}): {text!r}",
                         """quote the JSON for the shell: --arm f32='{"dtype":"float32"}'""") from None
    if not isinstance(over, dict):
        raise InputError(f"--arm {name}: options must be a JSON object, not {type(over).__name__}: {text!r}",
                         """e.g. --arm broken='{"faults":["mla_as_mqa"]}'""")
    return name, over


def arm_options(engine: str, base: dict[str, Any], arms: list[tuple[str, dict[str, Any]]]) -> dict[str, dict]:
    """Every arm's options: the candidate's own, then each --arm merged over them, checked against the engine's
    typed options model (the one the harness checks a round's options with)."""
    out: dict[str, dict] = {BASE: dict(base)}
    for name, over in arms:
        if name in out:
            raise InputError(f"--arm {name}: the name is taken" + (" (the target's own candidate options)"
                                                                   if name == BASE else ""),
                             "give every arm its own name")
        out[name] = {**base, **over}
    models = registry.options_models(engine)
    if models is not None:
        from pydantic import ValidationError

        for name, opts in out.items():
            try:
                models[1].model_validate(opts)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise InputError(f"--arm {name}: options.{where}: {err['msg']} (got {err.get('input')!r})",
                                 f"{engine} options: {', '.join(models[1].model_fields)}") from None
    return out


def default_depths(gate_depths: tuple[int, ...], n: int | None, count: int) -> list[int]:
    """`count` depths log-spaced from the shallowest gate depth to n (default: the deepest), plus the gate's own."""
    lo, hi = min(gate_depths), n or max(gate_depths)
    grid = {int(round(x)) for x in np.geomspace(lo, hi, count)} if hi > lo and count > 1 else {hi}
    return sorted(grid | {d for d in gate_depths if d <= hi})


def target_of(lock, target_id: str):
    t = lock.targets.get(target_id)
    if t is None:
        raise InputError(f"unknown target {target_id!r} in the lock", f"targets: {', '.join(sorted(lock.targets))}")
    if t.parallel.ranks > 1:
        raise InputError(f"target {target_id!r} runs {t.parallel.ranks} ranks; this script runs sparkinfer in one "
                         "process", "use a one-GPU target (parallel.ranks = 1)")
    return t


def shards_of(lock, t, cache: Path) -> tuple[Path, ...]:
    """The target's weights as the round gets them (stages.weights): generated first where the lock says they are
    generated, every shard re-hashed against the lock."""
    from scoreboard.weights.verify import ensure_generated, verify_weights, weights_dir

    w = lock.weights[t.weights]
    if w.repo == "generated":
        return tuple(ensure_generated(lock, t.weights, cache))
    return tuple(verify_weights(lock, t.weights, weights_dir(t.weights, cache)).paths)


# -- statistics --------------------------------------------------------------------------------------------------
def compare(p_name: str, q_name: str, kind: str, p: np.ndarray, q: np.ndarray, positions: list[int],
            per_depth: dict[int, list[int]], policy) -> dict[str, Any]:
    """KL(p || q) graded per depth (scoreboard.gate.grade_depth: float64, full vocabulary), and every row's."""
    row = {pos: i for i, pos in enumerate(positions)}
    depths = []
    for d, ps in per_depth.items():
        sel = [row[x] for x in ps]
        g = grade_depth(d, ps, p[sel], q[sel], policy).as_dict()
        if kind == "self":  # the gate's bars judge a candidate against the reference only
            g = {k: v for k, v in g.items() if k not in ("pass", "flagged", "reasons", "ratchet_baseline",
                                                         "ratchet_ok")}
        depths.append(g)
    kl, t1 = kl_rows(p, q), top1_agreement(p, q)
    return {"p": p_name, "q": q_name, "kind": kind, "depths": depths,
            "all": {"rows": int(kl.size), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                    "kl_max": float(kl.max()), "top1": float(t1.mean())},
            "rows": {"positions": list(positions), "kl": [float(x) for x in kl], "top1": [float(x) for x in t1]}}


# -- the run -----------------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict[str, Any]:
    from scoreboard.cache import cache_dir
    from scoreboard.lockfile import load_lock
    from scoreboard.round.prompt import draw_prompt
    from scoreboard.round.stages import padded
    from scoreboard.weights.tokenizer import Tokenizer

    if not a.lock.is_file():
        raise InputError(f"--lock {a.lock}: no such file", "point --lock at a reference.lock")
    lock = load_lock(a.lock)
    t = target_of(lock, a.target)
    arms = arm_options(t.candidate_engine, dict(t.candidate_options or {}), [parse_arm(s) for s in a.arm])
    g = t.geometry
    geom = Geometry(g["n_ctx"], g["n_batch"], g["n_ubatch"], g.get("n_threads", 0))
    pol = t.gate
    depths = sorted(set(a.depths)) if a.depths else default_depths(pol.depths, a.n_tokens, a.n_depths)
    n = a.n_tokens or max(depths)
    bad = [d for d in depths if not a.rows <= d <= n]
    if bad or a.rows < 1:
        raise InputError(f"depths {bad or depths} with --rows {a.rows}: every depth must hold its rows and be <= N={n}",
                         "give --rows >= 1, depths >= --rows, and -n at least the deepest depth")
    if n > geom.n_ctx:
        raise InputError(f"N={n} tokens exceed the target's n_ctx {geom.n_ctx}", "ask for less depth")
    per_depth = {d: gate_positions(d, a.rows) for d in depths}
    positions = sorted({x for ps in per_depth.values() for x in ps})
    cache = cache_dir(a.cache_dir)

    log(f"target {a.target} ({t.device}): weights {t.weights}")
    shards = shards_of(lock, t, cache)
    tok = Tokenizer.from_gguf(shards[0])
    need = max([max(pol.depths), n] + [m.depth + m.n_tokens for m in t.metrics])  # GateStage.need
    prompt = draw_prompt(tok, need, a.seed)
    ids = padded(prompt.token_ids[:n], geom.n_ubatch, geom.n_ctx, prompt.token_ids)  # GateStage.rows
    log(f"prompt seed {a.seed}: {len(ids)} token ids ({n} + {len(ids) - n} padding); {len(positions)} rows at "
        f"{len(depths)} depths {depths}")
    request = LogitsRequest(ids, tuple(positions), geom)
    ident = ",".join(map(str, ids)).encode()
    out: dict[str, Any] = {
        "command": [sys.executable, *sys.argv], "target": a.target, "device": t.device, "lock": str(a.lock),
        "lock_sha256": hashlib.sha256(a.lock.read_bytes()).hexdigest(), "seed": a.seed, "n": n,
        "n_ids": len(ids), "ids_sha256": hashlib.sha256(ident).hexdigest(), "prompt": prompt.describe(),
        "depths": depths, "rows": a.rows, "positions": positions, "geometry": geom.as_dict(),
        "bars": pol.model_dump(), "weights": {"id": t.weights, "shards": [str(s) for s in shards]},
        "host": {"node": platform.node(), "python": platform.python_version(), "numpy": np.__version__},
        "engines": {}, "comparisons": []}

    # the reference first: llama.cpp's own process, before torch holds device memory
    ref_opts: dict[str, Any] = {"split_mode": t.parallel.reference_split_mode, "reference_id": t.reference}
    if t.device == "cuda":
        from scoreboard.worker.distributed import visible_devices

        ref_opts["visible_devices"] = visible_devices(t.parallel.ranks)
    if a.flash_attn is not None:
        ref_opts["flash_attn"] = a.flash_attn

    def target(options: dict[str, Any], reference: Any = None) -> EngineTarget:
        return EngineTarget(a.target, shards[0], shards, t.device, geom, reference=reference, options=options)

    def progress(msg: str, frac: float | None = None) -> None:
        log(f"  {t.reference_engine}: {msg}")

    ref_engine = registry.load(t.reference_engine)
    t1 = time.perf_counter()
    ref_prep = ref_engine.prepare(target(ref_opts, lock.references[t.reference]), cache, progress)
    prep_s = time.perf_counter() - t1
    log(f"{t.reference_engine} prepared ({t.reference}) in {prep_s:.1f} s")
    t1 = time.perf_counter()
    res = ref_engine.logits(ref_prep, request)
    dt = time.perf_counter() - t1
    ref = res.logits
    log(f"{t.reference_engine} logits: {ref.shape[0]} rows x {ref.shape[1]} vocab over {len(ids)} tokens in {dt:.1f} s")
    out["engines"][t.reference_engine] = {
        "role": "reference", "reference": t.reference, "options": ref_opts, "identity": ref_prep.identity.as_dict(),
        "notes": ref_prep.notes, "command": list(res.command), "geometry": res.geometry.as_dict(),
        "prepare_s": prep_s, "logits_s": dt}
    if a.save_logits:
        a.save_logits.mkdir(parents=True, exist_ok=True)
        np.save(a.save_logits / "positions.npy", np.asarray(positions, dtype=np.int64))
        np.save(a.save_logits / f"{t.reference_engine}.npy", ref)

    t1 = time.perf_counter()
    cand_engine = registry.load(t.candidate_engine)
    log(f"{t.candidate_engine} loaded in {time.perf_counter() - t1:.1f} s (in this process)")
    rows: dict[str, np.ndarray] = {}
    out["arms"] = {}
    for name, opts in arms.items():
        t1 = time.perf_counter()
        prep = cand_engine.prepare(target(opts), cache)
        prep_s = time.perf_counter() - t1
        log(f"{t.candidate_engine} arm {name} {json.dumps(opts, sort_keys=True)} prepared in {prep_s:.1f} s "
            f"(kernels: {prep.identity.extra.get('kernels')})")
        t1 = time.perf_counter()
        res = cand_engine.logits(prep, request)
        _synchronize(cand_engine, prep)
        dt = time.perf_counter() - t1
        rows[name] = np.ascontiguousarray(res.logits, dtype=np.float32)
        log(f"{t.candidate_engine} arm {name} logits: {rows[name].shape[0]} rows over {len(ids)} tokens in {dt:.1f} s")
        out["arms"][name] = {"options": opts, "identity": prep.identity.as_dict(), "notes": prep.notes,
                             "geometry": res.geometry.as_dict(), "prepare_s": prep_s, "logits_s": dt}
        cand_engine.close(prep)
        del prep
        _free_device(t.device)
        if a.save_logits:
            np.save(a.save_logits / f"{name}.npy", rows[name])
        if rows[name].shape != ref.shape:
            raise EngineError(f"arm {name}: logits of shape {rows[name].shape}, the reference's {ref.shape}",
                              "one row per requested position over the full vocabulary")
    out["host"].update(_torch_host(t.device))

    for name in arms:
        out["comparisons"].append(compare(t.reference_engine, name, "reference", ref, rows[name], positions,
                                          per_depth, pol))
    for name in arms:
        if name != BASE:
            out["comparisons"].append(compare(name, BASE, "self", rows[name], rows[BASE], positions, per_depth, pol))
    out["elapsed_s"] = time.perf_counter() - T0
    return out


def _synchronize(engine, prep) -> None:
    sync = getattr(engine, "synchronize", None)
    if sync is not None:
        sync(prep)


def _free_device(device: str) -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if device == "cuda" and torch is not None:
        torch.cuda.empty_cache()


def _torch_host(device: str) -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    d: dict[str, Any] = {"torch": torch.__version__}
    if device == "cuda" and torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
        d["cuda"] = torch.version.cuda
    return d


# -- the report --------------------------------------------------------------------------------------------------
def label(c: dict[str, Any]) -> str:
    return f"KL({c['p']} || {c['q']})"


def report(res: dict[str, Any]) -> None:
    bars = res["bars"]
    print(f"\n== target {res['target']} ({res['device']})  seed {res['seed']}  N {res['n']} ({res['n_ids']} ids)  "
          f"{res['rows']} rows at each of {len(res['depths'])} depths  geometry {res['geometry']}")
    print(f"   gate bars: mean KL <= {bars['kl_max']}, p99 KL <= {bars['kl_p99_max']}, top-1 >= {bars['top1_min']} "
          f"(the gate takes {bars['rows_per_depth']} rows per depth; these take {res['rows']})")
    for name, arm in res["arms"].items():
        print(f"   arm {name}: {json.dumps(arm['options'], sort_keys=True)}  logits {arm['logits_s']:.1f} s")
    for c in res["comparisons"]:
        what = "sparkinfer's own difference" if c["kind"] == "self" else "against the reference"
        print(f"-- {label(c)}  ({what})")
        for d in c["depths"]:
            verdict = ("  PASS" if d["pass"] else "  FAIL") if "pass" in d else ""
            print(f"   depth {d['depth']:>7}: KL mean {d['kl_mean']:.3e} p99 {d['kl_p99']:.3e} max {d['kl_max']:.3e} "
                  f"top-1 {d['top1']:.4f}{verdict}")
        a = c["all"]
        print(f"   all {a['rows']:>4} rows: KL mean {a['kl_mean']:.3e} p99 {a['kl_p99']:.3e} max {a['kl_max']:.3e} "
              f"top-1 {a['top1']:.4f}")
    names = [label(c) for c in res["comparisons"]]
    width = max(12, *(len(x) for x in names))
    print("== KL mean by depth (nats)")
    print("   " + f"{'depth':>7}  " + "  ".join(f"{x:>{width}}" for x in names))
    for i, d in enumerate(res["depths"]):
        print("   " + f"{d:>7}  " + "  ".join(f"{c['depths'][i]['kl_mean']:>{width}.3e}" for c in res["comparisons"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="k3-mini-cpu", help="lock target: device, geometry, weights, reference, "
                                                          "candidate options, gate bars (default k3-mini-cpu)")
    ap.add_argument("--lock", type=Path, default=REPO / "reference.lock")
    ap.add_argument("--depths", type=int, nargs="+", help="depths to take rows at (default: log-spaced, see above)")
    ap.add_argument("--n-depths", type=int, default=8, help="log-spaced default depths (before the gate's are added)")
    ap.add_argument("--rows", type=int, default=8, help="rows per depth: the positions depth-rows .. depth-1")
    ap.add_argument("-n", "--n-tokens", type=int, default=None, help="prompt length N (default: the deepest depth)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (the gate's draw)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                    help="a sparkinfer arm: JSON options merged over the target's candidate options (repeatable)")
    ap.add_argument("--flash-attn", type=int, default=None, help="reference flash_attn (engine default if unset)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="scoreboard cache (default: $SCOREBOARD_CACHE or "
                                                                 "~/.cache/scoreboard)")
    ap.add_argument("--save-logits", type=Path, help="also save every engine's rows as .npy in this directory")
    ap.add_argument("--json", type=Path, help="write every number here")
    a = ap.parse_args(argv)
    try:
        res = run(a)
    except ScoreboardError as exc:
        print(f"error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 1
    report(res)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1, default=_jsonable))
        log(f"wrote {a.json}")
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
