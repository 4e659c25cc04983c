"""A sealed receipt's speed as rows (for `round show --format csv|md`) and its decode throughput by depth (a table
on the console, an SVG with --plot): the numbers recomputed from the raw samples, one estimator named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from ..history.receipt import Receipt
from .console import console

SPEED_COLUMNS = ("metric", "role", "arm", "value tok/s (geomean of block medians)", "median of all reps", "MAD", "CV",
                 "reps", "candidate/reference", "ci low", "ci high")


def speed_rows(r: Receipt) -> list[list[Any]]:
    """One row per metric and arm; the candidate/reference ratio (paired blocks of this round) on the first."""
    from ..tiers import receipt_target, summarize_speed

    rows: list[list[Any]] = []
    for ms in summarize_speed(r, receipt_target(r)) if r.speed else []:
        for k, (arm, st) in enumerate(ms.arms.items()):
            c = ms.vs_reference if k == 0 else None
            rows.append([ms.name, ms.role, arm, round(st.value, 4), round(st.median, 4), round(st.mad, 4),
                         round(st.cv, 4), st.n, None if c is None else round(c.point, 4),
                         None if c is None else round(c.low, 4), None if c is None else round(c.high, 4)])
    return rows


def verdict_line(r: Receipt) -> str:
    v = r.verdict
    if v is None:
        return f"round {r.round_id}: aborted at {r.aborted.stage if r.aborted else '?'}"
    gain = "" if v.gain is None else f", gain {v.gain * 100:+.2f}%"
    ci = "" if v.gain_ci is None else f" (CI {v.gain_ci[0] * 100:+.2f}% to {v.gain_ci[1] * 100:+.2f}%)"
    return f"round {r.round_id} ({r.target}, {r.candidate.label} {r.candidate.commit[:12]}): verdict **{v.label}**" \
           f"{gain}{ci}, basis {v.basis}"


def depth_table(r: Receipt) -> None:
    """Decode tok/s by depth, one column per arm (printed only when the receipt holds a decode metric). With the
    receipt's sealed ceiling: the bandwidth bound at each depth (weights plus the f16 cache rows one token reads, at
    the node class's bandwidth) and the share of it each arm reached."""
    from ..ceiling import max_tok_s_at
    from ..depth import profile_rows

    keys, table = profile_rows(r)
    if not keys:
        return
    ceiling = (r.speed.ceiling if r.speed else None) or {}
    bw = float(ceiling.get("memory_bandwidth_gbs") or 0)  # a receipt without one (older) shows the arms alone
    bound = {k: max_tok_s_at(ceiling, k[0], f16_kv=True) for k in keys} if bw > 0 else {}
    if not all(v > 0 for v in bound.values()):
        bound = {}
    title = "decode by depth (tok/s, geomean of block medians)"
    if bound:
        title += (f"; bound: weights + f16 cache rows read per token at {bw:,.0f} GB/s x "
                  f"{int(ceiling.get('devices') or 1)} (the node class's bandwidth, sealed in the receipt)")
    t = Table(title=title, title_justify="left")
    t.add_column("depth", justify="right")
    t.add_column("tokens", justify="right")
    for arm in table:
        t.add_column(arm, justify="right")
    if bound:
        t.add_column("bound", justify="right")
        for arm in table:
            t.add_column(f"{arm} / bound", justify="right")
    for k in keys:
        cells = [f"{table[a][k]:.4g}" if k in table[a] else "-" for a in table]
        if bound:
            cells.append(f"{bound[k]:.4g}")
            cells += [f"{table[a][k] / bound[k]:.1%}" if k in table[a] else "-" for a in table]
        t.add_row(str(k[0]), str(k[1]), *cells)
    console.print(t)


def write_depth_plot(r: Receipt, plot: Path) -> Path:
    from ..depth import receipt_curves, write_profile

    return write_profile(receipt_curves(r), plot, f"{r.round_id}: decode throughput against depth",
                         f"target {r.target}, candidate {r.candidate.label} {r.candidate.commit[:12]}")
