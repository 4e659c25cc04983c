"""The frontier ladder: frontier transitions from the ledger, compounding arithmetic, an SVG plot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Step:
    round_id: str
    date: str
    slot: str
    commit: str
    before: float
    after: float
    kind: str  # "frontier-raise" | "frontier-lower"

    @property
    def ratio(self) -> float | None:
        return self.after / self.before if self.before > 0 else None


def ladder_steps(lines: list[dict[str, Any]], target: str | None = None) -> list[Step]:
    """Every frontier slot change on the ledger (raises, and the logged lowers), in ledger order."""
    steps = []
    for ln in lines:
        if ln.get("kind") not in ("frontier-raise", "frontier-lower") or (target and ln.get("target") != target):
            continue
        for ch in ln.get("changes", []):
            if ch.get("kind") != "frontier":
                continue
            steps.append(Step(ln.get("round_id", ""), ln.get("date", ""), ch["slot"], ch.get("commit", ""),
                              float(ch["before"]), float(ch["after"]), ln["kind"]))
    return steps


def compounding(steps: list[Step]) -> dict[str, float | int | None]:
    """Product of step ratios (first non-zero frontier -> last) and the geometric mean per step."""
    ratios = [s.ratio for s in steps if s.ratio is not None]
    if not ratios:
        return {"steps": len(steps), "total_ratio": None, "geomean_step": None}
    total = math.prod(ratios)
    return {"steps": len(steps), "total_ratio": total, "geomean_step": total ** (1 / len(ratios))}


def write_svg(steps: list[Step], path: Path, title: str) -> Path:
    """A step plot of frontier value over ledger order, one series per slot (no plotting deps)."""
    w, h, pad = 720, 360, 50
    slots = sorted({s.slot for s in steps})
    values = [s.after for s in steps] + [s.before for s in steps if s.before > 0]
    vmax = max(values) if values else 1.0
    n = max(len(steps), 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return pad + (w - 2 * pad) * (i / max(n - 1, 1)), h - pad - (h - 2 * pad) * (v / vmax)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="14">{escape(title)}</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="5" y="{pad}">{vmax:.3g}</text><text x="5" y="{h - pad}">0</text>']
    for k, slot in enumerate(slots):
        pts = [(i, s.after) for i, s in enumerate(steps) if s.slot == slot]
        path_pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in pts))
        c = colors[k % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{path_pts}"/>')
        for i, v in pts:
            x, y = xy(i, v)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{c}"><title>{escape(slot)} {v:.4g}'
                         f'</title></circle>')
        parts.append(f'<text x="{w - pad - 250}" y="{pad + 14 * k}" fill="{c}">{escape(slot)}</text>')
    parts.append("</svg>")
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(path)
    return path
