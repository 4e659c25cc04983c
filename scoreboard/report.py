"""A self-contained static HTML page of the history: the page a team links from a PR.

Contents, in order: where each target stands (per slot the frontier against the reference, the latest
verdict; regressions first: scoreboard/standing.py), which receipts verified (seal per receipt, plus `scoreboard
verify`'s findings when a lock is given), the ladder per slot (inline SVG) with its compounding, and every round:
the gate table, the speed per metric and arm with every block's value, decode tok/s against depth for every arm,
the verdict with its explanation. No scripts, no external resources: one file that renders the same anywhere,
from a phone's width up (a viewport meta tag; wide tables scroll inside their box instead of being cut; plots
scale). A receipt whose seal does not hold is shown as UNSEALED/TAMPERED and its verdict is not rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from . import __version__
from .ladder import Step, compounding, ladder_from_history, slot_panel_svg
from .history.receipt import GateRec, Receipt, metric_label
from .history.records import receipt_files
from .history.sealed import inspect_receipt
from .history.trust import Trust

_CSS = """
body{font-family:"DejaVu Sans",Arial,sans-serif;margin:24px auto;max-width:1100px;color:#1b1b1b;background:#fff;
line-height:1.4;font-size:14px;padding:0 16px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;margin:28px 0 8px;border-bottom:2px solid #1f5fa8}
h3{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #c8c8c8;padding:3px 8px;text-align:right;vertical-align:top;white-space:nowrap}
.scroll{overflow-x:auto;max-width:100%;-webkit-overflow-scrolling:touch}.scroll table{margin:0}
p,li,h3{overflow-wrap:anywhere}
th{background:#eef2f7;white-space:normal}td.l,th.l{text-align:left}
.ok{color:#17703a;font-weight:bold}.bad{color:#b3261e;font-weight:bold}.warn{color:#8a5a00;font-weight:bold}
.card{border:1px solid #c8c8c8;border-radius:6px;padding:10px 14px;margin:14px 0;background:#fcfcfd}
.card.tampered{border:3px solid #b3261e;background:#fff4f3}
.label{display:inline-block;padding:1px 10px;border-radius:10px;background:#1f5fa8;color:#fff;font-weight:bold}
.label.REJECT,.label.regression,.label.TAMPERED,.label.UNSEALED{background:#b3261e}.label.inconclusive{background:#8a5a00}
.label.none{background:#666}.label.BASELINE{background:#0b7a75}.label.aborted{background:#555}
.mono{font-family:"DejaVu Sans Mono",monospace;font-size:12px}.dim{color:#555}
.samples{font-family:"DejaVu Sans Mono",monospace;font-size:12px;text-align:left;white-space:normal}
svg{max-width:100%;height:auto;border:1px solid #ddd;margin:4px 0}
@media (max-width:600px){body{margin:8px auto;padding:0 8px;font-size:13px}h1{font-size:20px}
table{font-size:12px}th,td{padding:2px 5px}}
"""


@dataclass
class RoundView:
    path: Path
    data: dict[str, Any] | None  # the JSON as read (listed even when its seal fails)
    seal: str  # "sealed" | "UNSEALED" | "TAMPERED" | "UNTRUSTED" | "UNREADABLE"
    problems: list[str] = field(default_factory=list)
    receipt: Receipt | None = None  # parsed; set exactly when the seal holds


@dataclass
class Report:
    html: str
    rounds: list[RoundView]
    steps: list[Step]
    verify_problems: list[str]
    trust: Trust = field(default_factory=Trust)  # the pins the receipts were judged by

    @property
    def unverified(self) -> list[RoundView]:
        return [r for r in self.rounds if r.seal != "sealed"]


def _load(path: Path, trust: Trust) -> RoundView:
    f = inspect_receipt(path, trust)
    if f.raw is None:
        return RoundView(path, None, "UNREADABLE", [m for _, m in f.problems])
    if f.sealed is None:
        return RoundView(path, f.raw, f.state, [f"{fld}: {m}" for fld, m in f.problems])
    return RoundView(path, f.raw, "sealed", receipt=f.sealed.receipt)


def _table(rows: list[str], caption: str = "") -> str:
    """A table in a box that scrolls sideways when the page is narrower than the table (never cut)."""
    cap = f"<caption class=l>{caption}</caption>" if caption else ""
    return f'<div class="scroll"><table>{cap}{"".join(rows)}</table></div>'


def _t(*cells: Any, head: bool = False, left: int = 0) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f'<{tag}{" class=l" if i < left else ""}>{c}</{tag}>' for i, c in enumerate(cells)) \
        + "</tr>"


def _gate(gate: GateRec | None) -> str:
    if not gate:
        return '<p class="dim">no gate statistics (the round stopped before the gate finished)</p>'
    rows = [_t("depth", "rows", "KL mean (nats)", "KL p99", "KL max", "top-1", "ratchet basis", "pass", head=True)]
    for d in gate.depths:
        base = d.get("ratchet_baseline")
        rows.append(_t(d["depth"], d["rows"], f"{d['kl_mean']:.3g}", f"{d['kl_p99']:.3g}", f"{d['kl_max']:.3g}",
                       f"{d['top1']:.4f}", "-" if base is None else f"{base:.3g}",
                       '<span class="ok">yes</span>' if d.get("pass") else '<span class="bad">no</span>'))
    greedy = "".join(f"<li>checked decode {escape(g['metric'])}: greedy tokens match the reference's argmax on "
                     f"{g['top1_vs_reference']:.3f} of positions</li>" for g in gate.greedy_check or [])
    return (_table(rows, "correctness gate: KL(ref&#8214;cand), full vocabulary, float64")
            + (f"<ul>{greedy}</ul>" if greedy else ""))


def _speed(r: Receipt) -> str:
    from .lockfile import Target
    from .stats import block_value
    from .tiers import ESTIMATOR, POOLED_MEDIAN, summarize_speed

    if not r.speed:
        return ""
    try:
        target = Target.model_validate(r.lock_target)
        summary = {s.name: s for s in summarize_speed(r, target)}
    except Exception as exc:  # a display must not die on an odd old receipt; say what failed instead
        return f'<p class="bad">speed section could not be summarized: {escape(str(exc))}</p>'
    out = [f"<p class=dim>value = {ESTIMATOR} (the estimator the verdict and the slots use), tok/s recomputed "
           f"from raw ns; {POOLED_MEDIAN} is descriptive only. Ratio: candidate / reference over paired blocks of "
           "this round.</p>"]
    for m in r.speed.metrics:
        name = metric_label(m)
        s = summary.get(name)
        rows = [_t("arm", f"value tok/s ({ESTIMATOR})", POOLED_MEDIAN, "CV", "reps",
                   "per-block values, tok/s (median rep of each block, block order)", head=True, left=1)]
        for arm, a in m.arms.items():
            vals = [block_value(b.samples_ns, b.n_tokens) for b in a.blocks]
            st = s.arms.get(arm) if s else None
            rows.append(_t(escape(arm), f"{st.value:.4g}" if st else "-", f"{st.median:.4g}" if st else "-",
                           f"{st.cv:.1%}" if st else "-", st.n if st else "-",
                           '<span class="samples">' + ", ".join(f"{v:.4g}" for v in vals) + "</span>", left=1))
        ratio = ""
        if s and s.vs_reference is not None:
            c = s.vs_reference
            ratio = (f"<p>candidate / reference (same round, paired blocks): <b>{c.point:.3f}</b> "
                     f"[{c.confidence:.0%} CI {c.low:.3f} &ndash; {c.high:.3f}], {c.n_blocks} blocks</p>")
        out.append(f"<h4>{escape(name)} <span class=dim>({escape(m.role)}, slot "
                   f"<span class=mono>{escape(m.slot)}</span>)</span></h4>{_table(rows)}"
                   + ratio)
    return "".join(out)


def _verdict(r: Receipt) -> str:
    if r.status == "aborted":
        ab = r.aborted
        return (f'<p><span class="label aborted">ABORTED</span> at {escape(str(ab.stage if ab else None))}: '
                f'{escape(str(ab.reason if ab else None))}</p>')
    v = r.verdict
    label = str(v.label if v else None)
    reasons = "".join(f"<li>{escape(str(x))}</li>" for x in (v.reasons if v else []))
    return (f'<p>verdict <span class="label {escape(label)}">{escape(label)}</span> '
            f'<span class=dim>(basis: {escape(str(v.basis if v else None))})</span></p>'
            f'<p>{escape(v.explanation if v else "")}</p>' + (f"<ul>{reasons}</ul>" if reasons else ""))


def _round(rv: RoundView, drift: list[str]) -> str:
    r = rv.receipt
    anchor = escape(rv.path.stem)
    if rv.seal != "sealed" or r is None:
        probs = "".join(f"<li class=mono>{escape(p)}</li>" for p in rv.problems)
        return (f'<div class="card tampered" id="{anchor}"><h3>{escape(rv.path.name)} '
                f'<span class="label {rv.seal}">{rv.seal}</span></h3><p class="bad">This receipt does not match its '
                f"seal: it is shown as a claim, not a measurement, and its verdict is not rendered.</p>"
                f"<ul>{probs}</ul></div>")
    cand = r.candidate
    head = (f'<div class="card" id="{anchor}"><h3>{escape(r.round_id)} <span class="ok">sealed</span></h3>'
            f'<p>{escape(r.created_at)} &middot; target <b>{escape(r.target)}</b> &middot; candidate '
            f'{escape(cand.label)} <span class=mono>{escape(cand.commit[:12])}</span>'
            f'{" (main)" if cand.is_main else ""} &middot; seed {r.seed}</p>')
    warn = "".join(f'<p class="warn">warning: {escape(w)}</p>' for w in drift)
    return head + warn + _verdict(r) + _gate(r.gate) + _speed(r) + _depth(r) + "</div>"


def _depth(r: Receipt) -> str:
    """Decode tok/s against depth for every arm, when the receipt holds a decode metric."""
    from .depth import profile_svg, receipt_curves

    curves = receipt_curves(r)
    if not curves:
        return ""
    return profile_svg(curves, "decode throughput against depth", f"every arm of {r.round_id}")


def _standing(views: list[RoundView], lock: Any) -> str:
    """Where each target stands, one short block per target (read at a phone's width without scrolling): its
    latest verdict, then per slot the frontier against the reference; regressions first."""
    from .standing import standings

    blocks = []
    for st in standings([v.receipt for v in views if v.receipt is not None], lock):
        r, v = st.latest, st.latest.verdict
        gain = "" if v is None or v.gain is None else f" {v.gain * 100:+.2f}%"
        today = "" if st.rederived is None else (
            f' <span class=dim>as sealed; re-derived today by scoreboard tier --receipt:</span> '
            f'<span class="label {escape(st.rederived)}">{escape(st.rederived)}</span>')
        items = []
        for s in st.slots:
            vs = "" if s.reference is None else f" vs reference {_num(s.reference)}" + (
                f": <b>{s.ratio:.3f}x</b>" if s.ratio is not None else "")
            where = (f' <span class="dim">({escape(s.commit[:8])}, <a href="#{escape(s.round_id)}" class=mono>'
                     f'{escape(s.round_id[:16])}</a>)</span>' if s.round_id else "")
            items.append(f"<li>{escape(s.metric)} <span class=dim>({escape(s.role)})</span>: frontier "
                         + (f"<b>{_num(s.frontier)}</b> tok/s" if s.frontier else "none yet") + vs + where + "</li>")
        blocks.append(f'<div class="card standing" data-target="{escape(st.target)}"><h3>{escape(st.target)} '
                      f'<span class="label {escape(st.label)}">{escape(st.label)}</span>{escape(gain)}{today}</h3>'
                      f'<p class=dim>latest round <a href="#{escape(r.round_id)}" class=mono>{escape(r.round_id)}</a>'
                      f" ({escape(r.candidate.label)} {escape(r.candidate.commit[:12])})</p>"
                      + (f"<ul>{''.join(items)}</ul>" if items else "<p>no slot measured yet</p>") + "</div>")
    if not blocks:
        return "<h2>Where each target stands</h2><p>no sealed round yet</p>"
    return ('<h2>Where each target stands</h2><p class=dim>per slot the frontier (raise-only, from sealed main '
            "rounds) against the reference engine's baseline; each target's latest sealed verdict; targets whose "
            "latest verdict is a regression first.</p>" + "".join(blocks))


def _num(v: float) -> str:
    """tok/s for reading: 50,975 and 946.9, never 5.097e+04."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _verification(views: list[RoundView], lock: Any, lock_path: Any, verify_problems: list[str]) -> str:
    n_ok = sum(v.seal == "sealed" for v in views)
    out = [f"<h2>Verification</h2><p>{n_ok} of {len(views)} receipt(s) match their seal.</p>"]
    rows = [_t("receipt", "seal", "target", "status", "verdict", head=True, left=1)]
    for v in views:
        d = v.data or {}
        verdict = (v.receipt.verdict.label if v.receipt.verdict else None) if v.receipt else "not shown"
        cls = "ok" if v.seal == "sealed" else "bad"
        rows.append(_t(f'<a href="#{escape(v.path.stem)}" class=mono>{escape(v.path.name)}</a>',
                       f'<span class="{cls}">{v.seal}</span>', escape(str(d.get("target", ""))),
                       escape(str(d.get("status", ""))), escape(str(verdict or d.get("status", ""))), left=1))
    out.append(_table(rows))
    if lock is not None:
        if verify_problems:
            items = "".join(f"<li class=mono>{escape(p)}</li>" for p in verify_problems)
            out.append(f'<p class="bad">scoreboard verify: {len(verify_problems)} problem(s)</p><ul>{items}</ul>')
        else:
            out.append(f'<p class="ok">scoreboard verify: history intact, every slot in '
                       f'{escape(str(lock_path))} backed by a sealed receipt</p>')
    return "".join(out)


_STEP_WORDS = {"held": "held", "frontier-rebase": "re-based"}


def _ladder(steps: list[Step]) -> str:
    comp = compounding(steps)
    slots = list(dict.fromkeys(s.slot for s in steps))
    out = ["<h2>Frontier ladder, per slot</h2>"]
    if not slots:
        out.append("<p>no frontier has moved yet (a sealed main round sets the BASELINE)</p>")
    for slot in slots:
        ss = [s for s in steps if s.slot == slot]
        c = comp[slot]
        summary = (f"compounded x{c.total_ratio:.4f} from {c.first:.4g} to {c.last:.4g} tok/s over {c.steps} "
                   f"step(s) after the BASELINE; geometric mean per step x{c.geomean_step:.4f} (over those "
                   f"{c.steps})" if c.total_ratio is not None else "BASELINE only: no step to compound yet")
        rows = [_t("round", "date", "commit", "tier", "measured", "frontier before", "after", "step",
                   "reference tok/s, same round", head=True, left=1)]
        for s in ss:
            tier = escape(s.tier) if s.tier else (f'<span title="{escape(s.receipt_problem)}">UNVERIFIED ('
                                                  + escape(s.receipt_problem.split(": ", 1)[-1].split(" ")[0])
                                                  + ")</span>" if s.receipt_problem else "")
            step = _STEP_WORDS.get(s.kind) or (("BASELINE" if s.ratio is None else f"x{s.ratio:.4f}")
                                               + (" (lowered)" if s.kind == "frontier-lower" else ""))
            rows.append(_t(f'<a href="#{escape(s.round_id)}" class=mono>{escape(s.round_id)}</a>', escape(s.date[:10]),
                           f"<span class=mono>{escape(s.commit[:12])}</span>", tier,
                           "-" if s.measured is None else f"{s.measured:.4g}", f"{s.before:.4g}", f"{s.after:.4g}",
                           step, "-" if s.reference is None else f"{s.reference:.4g}", left=1))
        out.append(f'<h3 class="slot">{escape(slot)}</h3>' + slot_panel_svg(slot, ss) + f"<p>{summary}</p>"
                   + _table(rows))
    return "".join(out)


def build_report(rounds_dir: str | Path = "rounds", lock_path: str | Path | None = "reference.lock",
                 target: str | None = None, title: str = "scoreboard history") -> Report:
    from .drift import reference_drift
    from .lockfile import load_lock
    from .history.trust import near
    from .history.verify import verify

    rounds = Path(rounds_dir)
    trust = near(rounds, lock_path if lock_path is not None and Path(lock_path).is_file() else None)
    views = [_load(p, trust) for p in receipt_files(rounds)]
    if target:
        views = [v for v in views if v.data is None or v.data.get("target") == target]
    views.sort(key=lambda v: ((v.data or {}).get("created_at", ""), v.path.name))
    steps = ladder_from_history(rounds, target, trust=trust)
    lock = None
    verify_problems: list[str] = []
    if lock_path is not None and Path(lock_path).is_file():
        lock = load_lock(lock_path)
        verify_problems = [str(p) for p in verify(lock_path, rounds).problems]
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
             '<meta name="viewport" content="width=device-width, initial-scale=1">'
             f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1><p class=dim>rounds directory <span class=mono>{escape(str(rounds))}"
             f"</span>{' &middot; target ' + escape(target) if target else ''} &middot; scoreboard {__version__}</p>",
             _standing(views, lock), _verification(views, lock, lock_path, verify_problems), _ladder(steps),
             f"<h2>Rounds ({len(views)})</h2>"]
    for v in views:
        drift = reference_drift(v.receipt, lock) if v.receipt is not None else []
        parts.append(_round(v, drift))
    parts.append("</body></html>")
    return Report("\n".join(parts), views, steps, verify_problems, trust)
