"""`scoreboard pin`: record external pins in reference.lock deliberately (a reviewed change to the lock)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .console import console, pick_target

def say(text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)


app = typer.Typer(help="Record external pins in reference.lock (a deliberate, reviewed change).",
                  no_args_is_help=True)


@app.command("weights")
def weights(
    target_arg: str = typer.Argument(None, metavar="[TARGET]", help="deprecated positional form of --target"),
    target: str = typer.Option(None, "--target", "-t", help="target id (or weights id) whose weights to pin"),
    revision: str = typer.Option(..., "--revision", help="the Hub commit (40 hex) to pin"),
    accept_file_set: bool = typer.Option(False, "--accept-file-set",
                                         help="take the Hub's file set when it differs from the lock's paths"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the changes, write nothing"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock"),
    timeout: float = typer.Option(30.0, "--timeout", min=0.1, help="seconds per network request"),
    hub_endpoint: Optional[str] = typer.Option(None, "--hub-endpoint", metavar="URL",
                                               help="Hugging Face endpoint (default: $SCOREBOARD_HF_ENDPOINT)"),
) -> None:
    """Record every file's size and LFS sha256 at REVISION from the Hub's metadata (nothing is downloaded)."""
    from ..lockfile import load_lock
    from ..pins import human_bytes

    target = pick_target(target, target_arg, "pin weights")
    from ..pins.hub import apply_weights_pin, plan_weights_pin, resolve_weights_id

    lk = load_lock(lock)
    wid, users = resolve_weights_id(lk, target)
    plan = plan_weights_pin(lk, target, revision, accept_file_set=accept_file_set, endpoint=hub_endpoint,
                            timeout=timeout)
    for p in plan.only_in_lock:
        say(f"  - {p} (in the lock, not on the Hub: removed)")
    for p in plan.only_on_hub:
        say(f"  + {p} (on the Hub, not in the lock: added)")
    if not plan.changes:
        say(f"weights.{wid} already pinned at {revision}: nothing to change")
        return
    for what, old, new in plan.changes:
        say(f"  {what}: {old} -> {new}")
    total = human_bytes(sum(f.size for f in plan.files))
    verb = "would pin" if dry_run else "pinned"
    say(f"weights.{wid}: {verb} {len(plan.files)} file(s), {total}, at {plan.repo}@{revision}")
    if dry_run:
        return
    apply_weights_pin(lock, plan)
    say(f"wrote {lock} (slots untouched). Numbers measured on other weights are not comparable: "
        f"re-measure {', '.join(users) or 'the targets using them'}; then `scoreboard audit-pins --all`.")
