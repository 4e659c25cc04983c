"""Small SVG building blocks shared by the plots (ladder panels, depth profiles): axis ticks on a linear and a
log2 scale, number labels, legends, the document frame. No plotting dependencies; every plot is a string."""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

FONT = 'font-family="DejaVu Sans, Arial, sans-serif" font-size="12"'
CAND, REF, BAD, FRONTIER = "#1f5fa8", "#8a8a8a", "#c0392b", "#0b7a75"
# one colour per arm, wherever an arm is drawn (candidate blue, reference grey, a same-round basis green)
ARM_COLORS = {"candidate": CAND, "reference": REF, "main": FRONTIER, "frontier": FRONTIER}


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round-numbered ticks (1, 2, 2.5, 5 x 10^k steps) covering [lo, hi]."""
    span = hi - lo if hi > lo else max(abs(hi), 1.0)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 0.5:
        if v >= lo - 1e-9 * span:
            ticks.append(round(v, 10))
        v += step
    return ticks


def log2_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Powers of two within [lo, hi] (every other one, and so on, when there are more than `most`)."""
    first, last = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    exps = list(range(first, last + 1)) or [round(math.log2(lo))]
    stride = max(1, math.ceil(len(exps) / most))
    return [2.0 ** e for e in exps[::stride]]


def fmt(v: float) -> str:
    """A tok/s label: whole numbers with separators from 100, three significant digits below."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_tokens(n: float) -> str:
    """A depth in tokens: 1024 -> 1K, 131072 -> 128K, 3000 -> 3000."""
    n = int(round(n))
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def document(width: int, height: int, body: Sequence[str], title: str = "") -> str:
    """A standalone SVG document with a white background."""
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {FONT}>', '<rect width="100%" height="100%" fill="white"/>']
    if title:
        head.append(f'<text x="12" y="24" font-size="16" font-weight="bold">{escape(title)}</text>')
    return "\n".join([*head, *body, "</svg>"])


def legend(x: float, y: float, entries: Sequence[tuple[str, str, str]]) -> str:
    """One row of (label, colour, dash) swatches starting at (x, y); dash "" is a solid line."""
    out, cx = [], x
    for label, color, dash in entries:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{cx:.0f}" y1="{y:.0f}" x2="{cx + 22:.0f}" y2="{y:.0f}" stroke="{color}" '
                   f'stroke-width="2.5"{d}/><text x="{cx + 27:.0f}" y="{y + 4:.0f}">{escape(label)}</text>')
        cx += 36 + 6.6 * len(label)
    return "".join(out)


def polyline(points: Sequence[tuple[float, float]], color: str, width: float = 2.0, dash: str = "",
             opacity: float = 1.0) -> str:
    d = f' stroke-dasharray="{dash}"' if dash else ""
    o = f' stroke-opacity="{opacity:.2f}"' if opacity < 1 else ""
    return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d}{o} points="'
            + " ".join(f"{a:.1f},{b:.1f}" for a, b in points) + '"/>')
