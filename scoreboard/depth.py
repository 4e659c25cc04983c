"""Decode throughput against context depth, for every arm, from every decode metric a receipt holds.

A target may score decode at several depths in one round (a depth profile: several decode metrics in
`speed.metrics`, at depths such as 1024, 16384, 65536 and 131072, each "scored" or "guard"); a receipt of
today's targets holds one. Everything here is read from a receipt's existing fields only: each metric's
`phase`, `depth`, `n_tokens` and its arms' blocks' raw samples (tok/s = n_tokens / (ns / 1e9), the arm's value
the geometric mean of its block medians, as everywhere). The plot's depth axis is log2 (1K .. 128K are equal
steps); its throughput axis starts at 0, so a fall with depth is seen at its true size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Sequence

from .svg import ARM_COLORS, CAND, fmt, fmt_tokens, legend, log2_ticks, nice_ticks, polyline

if TYPE_CHECKING:
    from .history.receipt import Receipt

ARM_ORDER = ("candidate", "main", "frontier", "reference")  # the order arms are listed and drawn in


@dataclass(frozen=True)
class DepthPoint:
    depth: int  # tokens in the cache before the timed part
    n_tokens: int  # tokens decoded per rep
    value: float  # tok/s: the arm's value (geomean of block medians)
    role: str  # the metric's role: "scored" | "guard"


@dataclass(frozen=True)
class Curve:
    """One arm of one receipt: its decode value at each depth, shallow to deep."""

    label: str  # e.g. "candidate", "A reference"
    arm: str
    points: tuple[DepthPoint, ...]
    dash: str = ""  # "" solid; the reference is drawn dashed
    opacity: float = 1.0


def decode_profile(receipt: Receipt) -> dict[str, list[DepthPoint]]:
    """arm -> its value in every decode metric of the receipt, by depth (then n_tokens); {} without speed."""
    from .history.receipt import arm_value

    out: dict[str, list[DepthPoint]] = {}
    for m in receipt.speed.metrics if receipt.speed else []:
        if m.phase != "decode":
            continue
        for arm in m.arms:
            try:
                value = arm_value(m, arm)
            except ValueError:
                continue
            out.setdefault(arm, []).append(DepthPoint(m.depth, m.n_tokens, value, m.role))
    order = {a: i for i, a in enumerate(ARM_ORDER)}
    return {a: sorted(out[a], key=lambda p: (p.depth, p.n_tokens))
            for a in sorted(out, key=lambda a: (order.get(a, len(order)), a))}


def receipt_curves(receipt: Receipt, prefix: str = "", opacity: float = 1.0, dash: str | None = None) -> list[Curve]:
    """Every arm of the receipt as a curve (`prefix` names the receipt when several are drawn together; `dash`
    draws all of its arms so, else the reference dashed and the rest solid)."""
    return [Curve(f"{prefix}{arm}", arm, tuple(pts), dash if dash is not None else "6 4" if arm == "reference" else "",
                  opacity) for arm, pts in decode_profile(receipt).items()]


def profile_rows(receipt: Receipt) -> tuple[list[tuple[int, int]], dict[str, dict[tuple[int, int], float]]]:
    """(the decode metrics as (depth, n_tokens), shallow first; arm -> metric -> tok/s): the same as a table."""
    prof = decode_profile(receipt)
    keys = sorted({(p.depth, p.n_tokens) for pts in prof.values() for p in pts})
    return keys, {arm: {(p.depth, p.n_tokens): p.value for p in pts} for arm, pts in prof.items()}


_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 820, 300, 78, 24, 56, 52


def _x_domain(depths: Sequence[int]) -> tuple[float, float]:
    """log2 domain with half a step of margin each side; one depth sits in the middle."""
    lo, hi = max(min(depths), 1), max(max(depths), 1)
    return (lo / 2, hi * 2) if lo == hi else (lo / 1.5, hi * 1.5)


def profile_svg(curves: Sequence[Curve], title: str, subtitle: str = "", y0: int = 0, standalone: bool = True) -> str:
    """Decode tok/s (linear, from 0) against depth (log2) for every curve; each point labelled with its value."""
    w, h = _W, _H
    px0, px1, py0, py1 = _LEFT, w - _RIGHT, y0 + _TOP, y0 + h - _BOTTOM
    pts = [p for c in curves for p in c.points]
    p: list[str] = []
    if standalone:
        p.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
                 'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">')
    p.append(f'<g class="depth-profile" data-points="{len(pts)}">')
    p.append(f'<rect x="0" y="{y0}" width="{w}" height="{h}" fill="white"/>')
    p.append(f'<text x="{px0}" y="{y0 + 20}" font-size="14" font-weight="bold">{escape(title)}</text>')
    if subtitle:
        p.append(f'<text x="{px0}" y="{y0 + 38}" fill="#444">{escape(subtitle)}</text>')
    if not pts:
        p.append(f'<text x="{px0}" y="{(py0 + py1) / 2:.0f}">no decode metric in this receipt</text></g>')
        return "\n".join(p + (["</svg>"] if standalone else []))
    xlo, xhi = _x_domain([q.depth for q in pts])
    top = max(q.value for q in pts) * 1.15
    yt = nice_ticks(0.0, top)
    ymax = max(top, yt[-1])

    def x(d: float) -> float:
        return px0 + (px1 - px0) * (math.log2(max(d, 1)) - math.log2(xlo)) / (math.log2(xhi) - math.log2(xlo))

    def y(v: float) -> float:
        return py1 - (py1 - py0) * (v / ymax if ymax > 0 else 0.5)

    for t in yt:
        p.append(f'<line x1="{px0}" y1="{y(t):.1f}" x2="{px1}" y2="{y(t):.1f}" stroke="#e6e6e6"/>'
                 f'<text x="{px0 - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for d in log2_ticks(xlo, xhi):
        p.append(f'<line x1="{x(d):.1f}" y1="{py1}" x2="{x(d):.1f}" y2="{py1 + 5}" stroke="black"/>'
                 f'<text x="{x(d):.1f}" y="{py1 + 18}" text-anchor="middle">{fmt_tokens(d)}</text>')
    p.append(f'<line x1="{px0}" y1="{py1}" x2="{px1}" y2="{py1}" stroke="black"/>'
             f'<line x1="{px0}" y1="{py0}" x2="{px0}" y2="{py1}" stroke="black"/>')
    p.append(f'<text transform="translate(18,{(py0 + py1) / 2:.0f}) rotate(-90)" text-anchor="middle">'
             'decode (tok/s, higher is better)</text>')
    p.append(f'<text x="{(px0 + px1) / 2:.0f}" y="{y0 + h - 8}" text-anchor="middle">'
             'context depth (tokens in the cache, log scale)</text>')
    named = curves if len(curves) <= 4 else [c for c in curves if c.opacity >= 1]  # a ladder's many rounds: the latest
    shown = list(dict.fromkeys((c.label, ARM_COLORS.get(c.arm, CAND), c.dash) for c in named))[:4]
    p.append(legend(max(px1 - sum(36 + 6.6 * len(s[0]) for s in shown), px0 + 160), y0 + 34, shown))
    for c in curves:
        color = ARM_COLORS.get(c.arm, CAND)
        xy = [(x(q.depth), y(q.value)) for q in c.points]
        if len(xy) > 1:
            p.append(polyline(xy, color, 2.5 if c.arm == "candidate" else 2.0, c.dash, c.opacity))
        for q, (a, b) in zip(c.points, xy):
            fill = color if q.role == "scored" else "white"  # hollow: a guard depth
            p.append(f'<circle class="depth-point" data-arm="{escape(c.arm)}" data-depth="{q.depth}" cx="{a:.1f}" '
                     f'cy="{b:.1f}" r="4" fill="{fill}" stroke="{color}" stroke-width="2" '
                     f'fill-opacity="{c.opacity:.2f}" stroke-opacity="{c.opacity:.2f}"><title>{escape(c.label)}: '
                     f'decode {q.n_tokens} tok @ depth {q.depth}: {fmt(q.value)} tok/s ({q.role})</title></circle>')
            if c.opacity >= 1:
                p.append(f'<text x="{a + 7:.1f}" y="{b - 6:.1f}" fill="{color}">{fmt(q.value)}</text>')
    p.append("</g>")
    if standalone:
        p.append("</svg>")
    return "\n".join(p)


def write_profile(curves: Sequence[Curve], path, title: str, subtitle: str = ""):
    """Write `profile_svg` as a standalone file, atomically (temp file + rename)."""
    from pathlib import Path

    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(profile_svg(curves, title, subtitle), encoding="utf-8")
    tmp.replace(path)
    return path
