"""Pick the ladder's next step from a kernel grid timed on the box while the reference builds: a diagnosis that
chooses which round a lease spends its time on, never a result (no gate, no seal; the round that follows scores it).

bench/mla_depth.py's JSON holds, per preset, decode_grid rows (the split's constants and its device microseconds at
one span). Each --step names a grid row by its constants and the commit that sets them (a step prepared before the
lease, its own commit). The fastest of those rows that beats the row the engine runs now (--current) by at least
--min-gain is chosen: the replan file gets PHASES="ladder" and STEPS=<its commit>, which bench/h200_ladder.sh reads
after the build. Otherwise it gets --else-phases (by default "round": at the lease's BASE, an A/A round).

    python bench/pick_split.py grid.json --preset k3-wide-long --current 16,64,4,2,264,0 \\
        --step 32,64,8,2,264,1=abc1234 --step 64,64,8,2,264,1=def5678 --replan /root/job/replan
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def row_key(rec: dict[str, Any]) -> tuple[int, ...]:
    """(heads per program, rows per step, warps, stages, programs, form) of a decode_grid row."""
    rows = int(rec.get("MLA_ROWS_FORM_HEADS", 0)) > 0
    name = "mla_split_rows" if rows else "mla_split"
    bh = rec["MLA_ROWS_BH"] if rows else rec["MLA_BH"]
    return (int(bh), int(rec["MLA_BT"]), int(rec[f"WARPS.{name}"]), int(rec[f"STAGES.{name}"]),
            int(rec["MLA_PROGRAMS"]), int(rows))


def parse_key(text: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 6:
        raise ValueError(f"{text!r}: six numbers, BH,BT,WARPS,STAGES,PROGRAMS,FORM")
    return parts


def choose(grid: list[dict[str, Any]], current: tuple[int, ...], steps: dict[tuple[int, ...], str],
           min_gain: float) -> tuple[str | None, str]:
    """(the chosen step's commit or None, why)."""
    timed = {row_key(r): float(r["us"]) for r in grid if "us" in r}
    if current not in timed:
        return None, f"the current tile {current} was not timed"
    base = timed[current]
    cands = sorted((timed[k], k) for k in steps if k in timed)
    if not cands:
        return None, "no step's tile was timed"
    us, key = cands[0]
    gain = base / us - 1
    why = f"current {current} {base:.1f} us; fastest step {key} {us:.1f} us ({gain:+.1%})"
    return (steps[key], why) if gain >= min_gain else (None, why + f", below the {min_gain:.0%} asked")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid", type=Path, help="bench/mla_depth.py's --out JSON")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--current", required=True, help="the engine's tile now: BH,BT,WARPS,STAGES,PROGRAMS,FORM")
    ap.add_argument("--step", action="append", default=[], help="TILE=COMMIT (repeatable)")
    ap.add_argument("--min-gain", type=float, default=0.05)
    ap.add_argument("--else-phases", default="round")
    ap.add_argument("--replan", type=Path, required=True, help="where to write PHASES and STEPS")
    args = ap.parse_args(argv)
    try:
        current = parse_key(args.current)
        steps = {}
        for item in args.step:
            tile, sep, commit = item.partition("=")
            if not sep or not commit.isalnum():
                raise ValueError(f"--step {item!r}: TILE=COMMIT")
            steps[parse_key(tile)] = commit
        res = json.loads(args.grid.read_text())
        grid = res["presets"][args.preset]["decode_grid"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"pick_split: {exc}; nothing written (the plan stands)", file=sys.stderr)
        return 1
    commit, why = choose(grid, current, steps, args.min_gain)
    text = f'PHASES="ladder"\nSTEPS="{commit}"\n' if commit else f'PHASES="{args.else_phases}"\nSTEPS=""\n'
    args.replan.write_text(text)
    print(f"pick_split: {why} -> {' '.join(text.split())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
