"""The frontier ladder: frontier transitions from the ledger, compounding per slot, a plot per slot.

Each slot is its own series with its own axis: multiplying a decode gain by a prefill gain is the gain of
no metric, and decode (~100 tok/s) next to prefill (~5000 tok/s) on one linear axis is a flat line. A
step is read from the ledger; the round's receipt (seal checked first) adds what the ledger does not
carry: the step's tier, what the candidate measured for the slot's metric in that round (a round that moved
nothing measured something else than the frontier it left standing) and the reference engine's value for the
same metric in the same round. The plot draws the held frontier as its own step line and every round at what
it measured, beside the reference as measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from . import svg
from .svg import fmt as _fmt
from .svg import nice_ticks as _nice_ticks

if TYPE_CHECKING:
    from .depth import Curve
    from .history.receipt import Receipt
    from .history.trust import Trust

UNIT = "tok/s"
REBASE = "frontier-rebase"
MOVES = ("frontier-raise", "frontier-lower", REBASE)  # ledger lines that change frontier slots
NOT_COMPLIANT = ("REJECT", "regression")  # as history.receipt.NOT_COMPLIANT: drawn red


@dataclass(frozen=True)
class Step:
    round_id: str
    date: str
    slot: str
    commit: str
    before: float
    after: float
    # "frontier-raise" | "frontier-lower" | "frontier-rebase" | "held" (a main round that moved nothing: none,
    # regression, REJECT, inconclusive, aborted)
    kind: str
    tier: str = ""  # the round's verdict label ("" when the receipt is missing or fails its seal)
    reference: float | None = None  # the reference arm's value for this metric in the same round, tok/s
    measured: float | None = None  # the candidate arm's value for this metric in that round, tok/s (None: no speed)
    metric: str = ""  # e.g. "decode 32 tok @ depth 512"
    receipt_problem: str = ""  # non-empty: the backing receipt is missing, unsealed or edited

    @property
    def ratio(self) -> float | None:
        """The frontier's step (after / before); None for a BASELINE, a held round and a re-base (a new basis, not
        a gain: the compounding restarts there)."""
        return self.after / self.before if self.before > 0 and self.kind not in ("held", REBASE) else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def ladder_steps(lines: list[dict[str, Any]], target: str | None = None, held: bool = False) -> list[Step]:
    """Every frontier slot change on the ledger (raises, and the logged lowers and re-bases), in ledger order. A
    step's date is its round's for a raise (the receipt's created_at, on the round line), and when the slots were
    written for a logged hatch.

    `held`: also every main round that moved nothing on its scored slot (none, REJECT, aborted), as a "held"
    step at the frontier it left standing: the tiers as they came, failures included."""
    rounds = ("round", "round-late")  # a round-late line records a round re-chained after later lines
    round_dates = {ln.get("round_id"): ln.get("date", "") for ln in lines if ln.get("kind") in rounds}
    moved = {(ln.get("round_id"), ch.get("slot")) for ln in lines if ln.get("kind") == "frontier-raise"
             for ch in ln.get("changes", []) if ch.get("kind") == "frontier"}
    steps = []
    for ln in lines:
        if target and ln.get("target") != target:
            continue
        if held and ln.get("kind") in rounds and ln.get("is_main") and (ln.get("round_id"), ln.get("slot")) not in moved:
            before = float(ln.get("frontier_before") or 0.0)
            if before > 0:  # before a BASELINE there is no frontier to hold
                steps.append(Step(ln.get("round_id", ""), ln.get("date", ""), ln.get("slot", ""),
                                  ln.get("candidate_commit", ""), before, before, "held",
                                  tier=str(ln.get("verdict") or ln.get("status") or "")))
            continue
        if ln.get("kind") not in MOVES:
            continue
        for ch in ln.get("changes", []):
            if ch.get("kind") != "frontier":
                continue
            date = ln.get("date", "") if ln["kind"] != "frontier-raise" else \
                round_dates.get(ln.get("round_id"), ln.get("date", ""))
            steps.append(Step(ln.get("round_id", ""), date, ch["slot"], ch.get("commit", ""),
                              float(ch["before"]), float(ch["after"]), ln["kind"]))
    return steps


def _receipt_facts(path: Path, trust: Trust) -> tuple[Receipt | None, str]:
    """(receipt, problem): the receipt only when its seal holds and a pinned key vouches for it — an edited or
    untrusted one lends the ladder nothing."""
    from .history.sealed import inspect_receipt

    if not path.is_file():
        return None, f"{path.name}: receipt missing"
    f = inspect_receipt(path, trust)
    if f.sealed is not None:
        return f.sealed.receipt, ""
    if f.raw is None:
        return None, f"{path.name}: not readable JSON ({f.problems[0][1]})"
    if f.state in ("UNREADABLE", "UNTRUSTED"):  # the reason itself: who sealed it, or what cannot be read
        return None, f"{path.name}: {f.state} ({f.problems[0][1].splitlines()[0]})"
    return None, f"{path.name}: {f.state} ({', '.join(fld for fld, _ in f.problems)})"


def _slot_metric(receipt: Receipt, slot: str) -> tuple[str, float | None, float | None]:
    """(metric name, the reference arm's value, the candidate arm's value) for the candidate slot `slot`."""
    from .history.receipt import arm_value, metric_label

    for m in receipt.speed.metrics if receipt.speed else []:
        if m.slot == slot:
            values: list[float | None] = []
            for arm in ("reference", "candidate"):
                try:
                    values.append(arm_value(m, arm))
                except (KeyError, ValueError):
                    values.append(None)
            return metric_label(m), values[0], values[1]
    return "", None, None


def ladder_from_history(rounds_dir: str | Path, target: str | None = None, held: bool = True,
                        trust: Trust | None = None) -> list[Step]:
    """The ladder with each step's tier and same-round reference value from its (seal-checked) receipt, judged by
    `trust` (default: the pins of the checkout's own reference.lock, `trust.near`); `held` (the default): main
    rounds that moved nothing are steps too (ladder_steps)."""
    from .history.ledger import read_ledger
    from .history.trust import near

    rounds = Path(rounds_dir)
    trust = trust if trust is not None else near(rounds)
    out = []
    cache: dict[str, tuple[Receipt | None, str]] = {}
    for s in ladder_steps(read_ledger(rounds), target, held):
        if s.round_id not in cache:
            cache[s.round_id] = _receipt_facts(rounds / f"{s.round_id}.json", trust)
        rec, problem = cache[s.round_id]
        if rec is None:
            out.append(Step(**{**asdict(s), "receipt_problem": problem}))
            continue
        metric, ref, cand = _slot_metric(rec, s.slot)
        out.append(Step(**{**asdict(s), "tier": rec.verdict.label if rec.verdict else "", "reference": ref,
                           "metric": metric, "measured": cand}))
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
    step over exactly those `steps` ratios. Slots are never multiplied together. A re-base starts the slot
    afresh (its value was measured on another box, or against another basis): only the steps after the last
    one compound, from the re-based value."""
    by: dict[str, list[Step]] = {}
    for s in steps:
        if s.kind == REBASE:
            by[s.slot] = [s]
        elif s.kind != "held":  # a round that moved nothing multiplies nothing
            by.setdefault(s.slot, []).append(s)
    out = {}
    for slot, ss in by.items():
        nonzero = [s for s in ss if s.after > 0]
        ratios = tuple(s.ratio for s in ss if s.ratio is not None)
        first = ss[0].after if ss[0].kind == REBASE else \
            next((s.before for s in ss if s.ratio is not None), nonzero[0].after if nonzero else 0.0)
        out[slot] = SlotCompounding(slot, first, ss[-1].after, ratios)
    return out


# ----------------------------------------------------------------------------------------------
# plot: one panel per slot, no plotting dependencies

_W, _PANEL_H, _LEFT, _RIGHT, _TOP, _BOTTOM = 820, 300, 78, 24, 56, 62
_CAND, _REF, _LOWER, _FRONTIER = svg.CAND, svg.REF, svg.BAD, svg.FRONTIER
_WORDS = {"frontier-lower": "lowered", REBASE: "re-based"}


def _point(s: Step) -> float:
    """Where a round is drawn: what it measured (a held round's own number), else the frontier it set."""
    return s.measured if s.measured is not None and s.measured > 0 else s.after


def _frontier_line(steps: list[Step], x, y, px0: float, px1: float) -> str:
    """The frontier as a step line: it holds until a step moves it, to the right edge."""
    pts: list[tuple[float, float]] = []
    prev = steps[0].before if steps[0].before > 0 else None
    for i, s in enumerate(steps):
        if prev is not None:
            pts += [(x(i - 1) if i else px0, y(prev)), (x(i), y(prev))]
        pts.append((x(i), y(s.after)))
        prev = s.after
    pts.append((px1, y(steps[-1].after)))
    return svg.polyline(pts, _FRONTIER, 2.0, "2 3")


def _round_marks(steps: list[Step], x, y, py1: float) -> list[str]:
    """Each round at what it measured: filled when it moved the frontier, hollow when it held; its tier above."""
    out = []
    for i, s in enumerate(steps):
        cx, cy = x(i), y(_point(s))
        color = _LOWER if s.kind == "frontier-lower" or s.tier in NOT_COMPLIANT else _CAND
        tier = _WORDS.get(s.kind, s.tier or "?")
        if s.receipt_problem:
            tier, color = "UNVERIFIED", _LOWER
        fill = "white" if s.kind == "held" else color
        held = f"; frontier held at {_fmt(s.after)}" if s.kind == "held" else ""
        out.append(f'<circle class="measured" data-round="{escape(s.round_id)}" cx="{cx:.1f}" cy="{cy:.1f}" r="5" '
                   f'fill="{fill}" stroke="{color}" stroke-width="2"><title>{escape(s.round_id)}: measured '
                   f'{_fmt(_point(s))} {UNIT} ({escape(tier)}){held}</title></circle>')
        out.append(f'<text x="{cx:.1f}" y="{cy - 10:.1f}" text-anchor="middle" font-weight="bold" '
                   f'fill="{color}">{escape(tier)} {_fmt(_point(s))}</text>')
        out.append(f'<text x="{cx:.1f}" y="{py1 + 16}" text-anchor="middle">{escape(s.commit[:8] or "-")}</text>'
                   f'<text x="{cx:.1f}" y="{py1 + 30}" text-anchor="middle" fill="#555">{escape(s.date[:10])}</text>')
    return out


def slot_panel_svg(slot: str, steps: list[Step], y0: int = 0, standalone: bool = True) -> str:
    """One slot's ladder: every round at what its candidate measured (filled: it moved the frontier; hollow: it
    held), the frontier it left standing as its own dotted step line, the same-round reference as measured
    (dashed), x in round order labelled with commit and date, axis titles with units."""
    w, h = _W, _PANEL_H
    px0, px1, py0, py1 = _LEFT, w - _RIGHT, y0 + _TOP, y0 + h - _BOTTOM
    values = [s.after for s in steps] + [s.before for s in steps if s.before > 0] + \
             [s.reference for s in steps if s.reference] + [_point(s) for s in steps]
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
    p.append(svg.legend(px1 - 470, y0 + 34, [("candidate, measured", _CAND, ""), ("frontier held", _FRONTIER, "2 3"),
                                             ("reference, same round", _REF, "6 4")]))
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
        p.append(_frontier_line(steps, x, y, px0, px1))
        p.append(svg.polyline([(x(i), y(_point(s))) for i, s in enumerate(steps)], _CAND, 1.5))
        refs = [(x(i), y(ref)) for i, s in enumerate(steps) if (ref := s.reference)]
        if refs:
            p.append(svg.polyline(refs, _REF, 2.0, "6 4"))
            for a, b in refs:
                p.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{_REF}"/>')
        p += _round_marks(steps, x, y, py1)
    p.append("</g>")
    if standalone:
        p.append("</svg>")
    return "\n".join(p)


def depth_curves(rounds_dir: str | Path, steps: list[Step], trust: Trust | None = None) -> list[Curve]:
    """Decode tok/s against depth for the ladder's rounds (seal-checked receipts a pinned key vouches for only):
    every round's candidate, older ones fainter, and the latest round's every arm in full."""
    from .depth import receipt_curves
    from .history.trust import near

    trust = trust if trust is not None else near(Path(rounds_dir))
    ids = list(dict.fromkeys(s.round_id for s in steps if not s.receipt_problem))
    receipts = [r for r in (_receipt_facts(Path(rounds_dir) / f"{rid}.json", trust)[0] for rid in ids)
                if r is not None]
    receipts = [r for r in receipts if r.speed and any(m.phase == "decode" for m in r.speed.metrics)]
    out: list[Curve] = []
    for k, r in enumerate(receipts[:-1]):
        fade = 0.2 + 0.5 * (k + 1) / max(len(receipts), 1)
        out += [c for c in receipt_curves(r, f"{r.candidate.commit[:8]} ", fade) if c.arm == "candidate"]
    if receipts:
        last = receipts[-1]
        out += receipt_curves(last, f"{last.candidate.commit[:8]} ")
    return out


def ladder_svg(steps: list[Step], title: str, depth: list[Curve] | None = None) -> str:
    """Every slot's panel stacked in one SVG document (each panel with its own y axis), then the rounds' decode
    throughput against depth when `depth` curves are given."""
    from .depth import profile_svg

    slots = list(dict.fromkeys(s.slot for s in steps))
    head = 36
    extra = _PANEL_H if depth else 0
    height = head + _PANEL_H * max(len(slots), 1) + extra
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" '
             'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="12" y="24" font-size="16" font-weight="bold">{escape(title)}</text>']
    for k, slot in enumerate(slots):
        parts.append(slot_panel_svg(slot, [s for s in steps if s.slot == slot], head + k * _PANEL_H, False))
    if not slots:
        parts.append(f'<text x="12" y="{head + 30}">no frontier has moved yet</text>')
    if depth:
        parts.append(profile_svg(depth, "decode throughput against depth, per round",
                                 "the latest round's every arm; earlier rounds' candidate fainter",
                                 head + _PANEL_H * max(len(slots), 1), False))
    parts.append("</svg>")
    return "\n".join(parts)


def write_svg(steps: list[Step], path: Path, title: str, depth: list[Curve] | None = None) -> Path:
    """Write `ladder_svg` atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(ladder_svg(steps, title, depth), encoding="utf-8")
    tmp.replace(path)
    return path
