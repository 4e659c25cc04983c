"""A/A CI width: the same sealed receipt's scored metric judged two ways, from its own block samples.

- paired: the candidate against the frontier's commit re-measured in the same round (the round's basis);
- slot: the candidate against the pinned frontier slot (the basis before same-round frontier arms).
On a steady box the paired interval is wider (two arms' noise); on a drifting box the slot's centre moves
with the box while the paired ratio does not. Numbers from a receipt, not a new measurement.

    python bench/aa_width.py rounds/<A/A round>.json [...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scoreboard.stats import block_value, ci_vs_constant, paired_ratio_ci


def widths(receipt: dict) -> dict:
    m = next(m for m in receipt["speed"]["metrics"] if m["role"] == "scored")
    bv = {a: [block_value(b["samples_ns"], b["n_tokens"]) for b in v["blocks"]] for a, v in m["arms"].items()}
    fa = receipt["speed"].get("frontier_arm") or {}
    out: dict = {"round_id": receipt["round_id"], "target": receipt["target"], "label": receipt["verdict"]["label"],
                 "blocks": {a: [round(x, 2) for x in v] for a, v in bv.items()}}
    for name, ci in (("paired", paired_ratio_ci(bv["candidate"], bv["frontier"]) if "frontier" in bv else None),
                     ("slot", ci_vs_constant(bv["candidate"], fa["slot_value"]) if fa.get("slot_value") else None)):
        if ci is not None:
            out[name] = {"gain": ci.point - 1, "ci": [ci.low - 1, ci.high - 1], "width": ci.high - ci.low}
    if fa.get("slot_value"):
        out["slot_value"] = fa["slot_value"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("receipts", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = [widths(json.loads(p.read_text())) for p in args.receipts]
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
