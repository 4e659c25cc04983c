"""The frontier ladder: frontier transitions from the ledger, compounding per slot, a plot per slot.

Each slot is its own series with its own axis: multiplying a decode gain by a prefill gain is the gain of
no metric, and decode (~100 tok/s) next to prefill (~5000 tok/s) on one linear axis is a flat line. A
step is read from the ledger; the round's receipt (seal checked first) adds what the ledger does not
carry: the step's tier and the reference engine's value for the same metric in the same round.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from .history.receipt import Receipt

UNIT = "tok/s"
NOT_COMPLIANT = ("REJECT", "regression")  # as history.receipt.NOT_COMPLIANT: drawn red


@dataclass(frozen=True)
class Step:
    round_id: str
    date: str
    slot: str
    commit: str
    before: float
    after: float
    kind: str  # "frontier-raise" | "frontier-lower" | "held" (a main round that moved nothing: none, REJECT, aborted)
    tier: str = ""  # the round's verdict label ("" when the receipt is missing or fails its seal)
    reference: float | None = None  # the reference arm's value for this metric in the same round, tok/s
    metric: str = ""  # e.g. "decode 32 tok @ depth 512"
    receipt_problem: str = ""  # non-empty: the backing receipt is missing, unsealed or edited

    @property
    def ratio(self) -> float | None:
        return self.after / self.before if self.before > 0 and self.kind != "held" else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def ladder_steps(lines: list[dict[str, Any]], target: str | None = None, held: bool = False) -> list[Step]:
    """Every frontier slot change on the ledger (raises, and the logged lowers), in ledger order. A step's
    date is its round's (the receipt's created_at, on the round line), not when the slots were written.

    `held`: also every main round that moved nothing on its scored slot (none, REJECT, aborted), as a "held"
    step at the frontier it left standing: the tiers as they came, failures included."""
    round_dates = {ln.get("round_id"): ln.get("date", "") for ln in lines if ln.get("kind") == "round"}
    moved = {(ln.get("round_id"), ch.get("slot")) for ln in lines if ln.get("kind") == "frontier-raise"
             for ch in ln.get("changes", []) if ch.get("kind") == "frontier"}
    steps = []
    for ln in lines:
        if target and ln.get("target") != target:
            continue
        if held and ln.get("kind") == "round" and ln.get("is_main") and (ln.get("round_id"), ln.get("slot")) not in moved:
            before = float(ln.get("frontier_before") or 0.0)
            if before > 0:  # before a BASELINE there is no frontier to hold
                steps.append(Step(ln.get("round_id", ""), ln.get("date", ""), ln.get("slot", ""),
                                  ln.get("candidate_commit", ""), before, before, "held",
                                  tier=str(ln.get("verdict") or ln.get("status") or "")))
            continue
        if ln.get("kind") not in ("frontier-raise", "frontier-lower"):
            continue
        for ch in ln.get("changes", []):
            if ch.get("kind") != "frontier":
                continue
            date = ln.get("date", "") if ln["kind"] == "frontier-lower" else \
                round_dates.get(ln.get("round_id"), ln.get("date", ""))
            steps.append(Step(ln.get("round_id", ""), date, ch["slot"], ch.get("commit", ""),
                              float(ch["before"]), float(ch["after"]), ln["kind"]))
    return steps


def _receipt_facts(path: Path) -> tuple[Receipt | None, str]:
    """(receipt, problem): the receipt only when its seal holds — an edited one lends the ladder nothing."""
    from .history.sealed import inspect_receipt

    if not path.is_file():
        return None, f"{path.name}: receipt missing"
    f = inspect_receipt(path)
    if f.sealed is not None:
        return f.sealed.receipt, ""
    if f.raw is None:
        return None, f"{path.name}: not readable JSON ({f.problems[0][1]})"
    if f.state == "UNREADABLE":
        return None, f"{path.name}: UNREADABLE ({f.problems[0][1].splitlines()[0]})"
    return None, f"{path.name}: {f.state} ({', '.join(fld for fld, _ in f.problems)})"


def _slot_metric(receipt: Receipt, slot: str) -> tuple[str, float | None]:
    """(metric name, the reference arm's value) for the candidate slot `slot` in this receipt."""
    from .history.receipt import arm_value, metric_label

    for m in receipt.speed.metrics if receipt.speed else []:
        if m.slot == slot:
            try:
                return metric_label(m), arm_value(m, "reference")
            except (KeyError, ValueError):
                return metric_label(m), None
    return "", None


def ladder_from_history(rounds_dir: str | Path, target: str | None = None, held: bool = True) -> list[Step]:
    """The ladder with each step's tier and same-round reference value from its (seal-checked) receipt;
    `held` (the default): main rounds that moved nothing are steps too (ladder_steps)."""
    from .history.ledger import read_ledger

    rounds = Path(rounds_dir)
    out = []
    cache: dict[str, tuple[Receipt | None, str]] = {}
    for s in ladder_steps(read_ledger(rounds), target, held):
        if s.round_id not in cache:
            cache[s.round_id] = _receipt_facts(rounds / f"{s.round_id}.json")
        rec, problem = cache[s.round_id]
        if rec is None:
            out.append(Step(**{**asdict(s), "receipt_problem": problem}))
            continue
        metric, ref = _slot_metric(rec, s.slot)
        out.append(Step(**{**asdict(s), "tier": rec.verdict.label if rec.verdict else "", "reference": ref,
                           "metric": metric}))
    return out


@dataclass(frozen=True)
class SlotCompounding:
    slot: str
    first: float  # the first non-zero frontier (the BASELINE), tok/s
    last: float  # the current frontier, tok/s
    ratios: tuple[float, ...] = field(default_factory=tuple)  # one per step after the baseline

    @property
    def steps(self) -> int:
        return len(self.ratios)

    @property
    def total_ratio(self) -> float | None:
        return math.prod(self.ratios) if self.ratios else None

    @property
    def geomean_step(self) -> float | None:
        t = self.total_ratio
        return t ** (1 / len(self.ratios)) if t is not None else None

    def as_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "first": self.first, "last": self.last, "steps": self.steps,
                "total_ratio": self.total_ratio, "geomean_step": self.geomean_step}


def compounding(steps: Iterable[Step]) -> dict[str, SlotCompounding]:
    """Per slot: product of its step ratios (last / first non-zero frontier) and the geometric mean per
    step over exactly those `steps` ratios. Slots are never multiplied together."""
    by: dict[str, list[Step]] = {}
    for s in steps:
        if s.kind != "held":  # a round that moved nothing multiplies nothing
            by.setdefault(s.slot, []).append(s)
    out = {}
    for slot, ss in by.items():
        nonzero = [s for s in ss if s.after > 0]
        ratios = tuple(s.ratio for s in ss if s.ratio is not None)
        first = next((s.before for s in ss if s.ratio is not None), nonzero[0].after if nonzero else 0.0)
        out[slot] = SlotCompounding(slot, first, ss[-1].after, ratios)
    return out


# ----------------------------------------------------------------------------------------------
# plot: one panel per slot, no plotting dependencies

_W, _PANEL_H, _LEFT, _RIGHT, _TOP, _BOTTOM = 820, 300, 78, 24, 56, 62
_CAND, _REF, _LOWER = "#1f5fa8", "#8a8a8a", "#c0392b"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
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


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def slot_panel_svg(slot: str, steps: list[Step], y0: int = 0, standalone: bool = True) -> str:
    """One slot's ladder: frontier after each step (step line), the same-round reference (dashed), x in
    round order labelled with commit and date, each point's tier, axis titles with units."""
    w, h = _W, _PANEL_H
    px0, px1, py0, py1 = _LEFT, w - _RIGHT, y0 + _TOP, y0 + h - _BOTTOM
    values = [s.after for s in steps] + [s.before for s in steps if s.before > 0] + \
             [s.reference for s in steps if s.reference]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (hi - lo) * 0.12 or max(hi * 0.05, 1e-9)
    lo, hi = max(lo - pad, 0.0), hi + pad
    ticks = _nice_ticks(lo, hi)
    lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    n = len(steps)

    def x(i: int) -> float:
        return px0 + (px1 - px0) * ((i + 0.5) / max(n, 1))

    def y(v: float) -> float:
        return py1 - (py1 - py0) * ((v - lo) / (hi - lo) if hi > lo else 0.5)

    metric = next((s.metric for s in steps if s.metric), "")
    p = []
    if standalone:
        p.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
                 'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">')
    p.append(f'<g class="slot-panel" data-slot="{escape(slot)}">')
    p.append(f'<rect x="0" y="{y0}" width="{w}" height="{h}" fill="white"/>')
    p.append(f'<text x="{px0}" y="{y0 + 20}" font-size="14" font-weight="bold">{escape(slot)}</text>')
    if metric:
        p.append(f'<text x="{px0}" y="{y0 + 38}" fill="#444">{escape(metric)}</text>')
    # legend above the plot area, right-aligned: never on the data
    lx = px1 - 350
    p.append(f'<line x1="{lx}" y1="{y0 + 34}" x2="{lx + 24}" y2="{y0 + 34}" stroke="{_CAND}" stroke-width="2.5"/>'
             f'<text x="{lx + 30}" y="{y0 + 38}">candidate frontier</text>'
             f'<line x1="{lx + 160}" y1="{y0 + 34}" x2="{lx + 184}" y2="{y0 + 34}" stroke="{_REF}" '
             f'stroke-width="2" stroke-dasharray="6 4"/><text x="{lx + 190}" y="{y0 + 38}">reference, same round</text>')
    for t in ticks:
        ty = y(t)
        p.append(f'<line x1="{px0}" y1="{ty:.1f}" x2="{px1}" y2="{ty:.1f}" stroke="#e6e6e6"/>'
                 f'<text x="{px0 - 6}" y="{ty + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    p.append(f'<line x1="{px0}" y1="{py1}" x2="{px1}" y2="{py1}" stroke="black"/>'
             f'<line x1="{px0}" y1="{py0}" x2="{px0}" y2="{py1}" stroke="black"/>')
    p.append(f'<text transform="translate({18},{(py0 + py1) / 2:.0f}) rotate(-90)" text-anchor="middle">'
             f'throughput ({UNIT}, higher is better)</text>')
    p.append(f'<text x="{(px0 + px1) / 2:.0f}" y="{y0 + h - 6}" text-anchor="middle">'
             'round, in ledger order (candidate commit, date)</text>')
    if steps:
        pts: list[tuple[float, float]] = []  # a step plot: the frontier holds until the next step moves it
        prev = steps[0].before if steps[0].before > 0 else None
        for i, s in enumerate(steps):
            if prev is not None:
                pts += [(x(i - 1) if i else px0, y(prev)), (x(i), y(prev))]
            pts.append((x(i), y(s.after)))
            prev = s.after
        pts.append((px1, y(steps[-1].after)))  # the last step's value holds to the right edge
        p.append(f'<polyline fill="none" stroke="{_CAND}" stroke-width="2.5" points="'
                 + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        refs = [(x(i), y(ref)) for i, s in enumerate(steps) if (ref := s.reference)]
        if refs:
            p.append(f'<polyline fill="none" stroke="{_REF}" stroke-width="2" stroke-dasharray="6 4" points="'
                     + " ".join(f"{a:.1f},{b:.1f}" for a, b in refs) + '"/>')
            for a, b in refs:
                p.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{_REF}"/>')
        for i, s in enumerate(steps):
            cx, cy = x(i), y(s.after)
            color = _LOWER if s.kind == "frontier-lower" or s.tier in NOT_COMPLIANT else _CAND
            tier = "lowered" if s.kind == "frontier-lower" else (s.tier or "?")
            if s.receipt_problem:
                tier, color = "UNVERIFIED", _LOWER
            fill = "white" if s.kind == "held" else color  # hollow: the frontier held, this round moved nothing
            p.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{fill}" stroke="{color}" stroke-width="2">'
                     f'<title>{escape(s.round_id)}: {_fmt(s.after)} {UNIT} ({escape(tier)})</title></circle>')
            p.append(f'<text x="{cx:.1f}" y="{cy - 10:.1f}" text-anchor="middle" font-weight="bold" '
                     f'fill="{color}">{escape(tier)} {_fmt(s.after)}</text>')
            p.append(f'<text x="{cx:.1f}" y="{py1 + 16}" text-anchor="middle">{escape(s.commit[:8] or "-")}</text>'
                     f'<text x="{cx:.1f}" y="{py1 + 30}" text-anchor="middle" fill="#555">'
                     f'{escape(s.date[:10])}</text>')
    p.append("</g>")
    if standalone:
        p.append("</svg>")
    return "\n".join(p)


def ladder_svg(steps: list[Step], title: str) -> str:
    """Every slot's panel stacked in one SVG document (each panel with its own y axis)."""
    slots = list(dict.fromkeys(s.slot for s in steps))
    head = 36
    height = head + _PANEL_H * max(len(slots), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" '
             'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="12" y="24" font-size="16" font-weight="bold">{escape(title)}</text>']
    for k, slot in enumerate(slots):
        parts.append(slot_panel_svg(slot, [s for s in steps if s.slot == slot], head + k * _PANEL_H, False))
    if not slots:
        parts.append(f'<text x="12" y="{head + 30}">no frontier has moved yet</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_svg(steps: list[Step], path: Path, title: str) -> Path:
    """Write `ladder_svg` atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(ladder_svg(steps, title), encoding="utf-8")
    tmp.replace(path)
    return path
