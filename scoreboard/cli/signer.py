"""`scoreboard signer new|pin|list`: make a box's signing key, pin its public key in the lock, list the pins."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..lockfile import load_lock
from .console import console, print_json

app = typer.Typer(help="Signing keys: make a box's key, pin its public key in reference.lock, list the pins "
                       "(docs/signing.md).", no_args_is_help=True)

_LOCK = typer.Option(Path("reference.lock"), "--lock", help="path of reference.lock")


@app.command("new")
def new(path: Path = typer.Argument(..., help="where the private key goes, outside every checkout, e.g. "
                                                 "~/.config/scoreboard/signing.key")) -> None:
    """Write a new Ed25519 key (PEM, mode 0600) and PATH.pub; print the public key to pin."""
    from ..history.seal import SIGNING_KEY_ENV, generate_keypair, load_public_key, public_key_b64
    from ..round.candidate import HARNESS_ROOT

    priv, pub = generate_keypair(path.expanduser(), forbidden_roots=[Path.cwd(), HARNESS_ROOT])
    raw = public_key_b64(load_public_key(pub))
    console.print(f"private key: {priv} (mode 0600; never copy it into a checkout)\npublic key:  {pub}\n"
                  f"  {raw}", highlight=False)
    console.print(f"next: export {SIGNING_KEY_ENV}={priv}; pin it by a reviewed commit: `scoreboard signer pin "
                  f"--id <box> --public-key {pub}`", highlight=False)


@app.command("pin")
def pin(
    signer_id: str = typer.Option(..., "--id", help="a name for the box, e.g. h200-1"),
    public_key: str = typer.Option(..., "--public-key", help="the .pub file `signer new` wrote, or its base64"),
    note: str = typer.Option("", "--note", help="where the private key is kept (never the key)"),
    lock: Path = _LOCK,
) -> None:
    """Pin a public key as the table signers.ID in the lock: a reviewed change, like any other pin."""
    from ..history.trust import pin_signer

    pin_signer(lock, signer_id, public_key, note)
    s = load_lock(lock).signers[signer_id]
    console.print(f"pinned signers.{escape(signer_id)} = {s.public_key} (added {s.added}) in {lock}; commit it, and "
                  "`scoreboard verify --base <main>` lists it as a policy change for review", highlight=False)


@app.command("list")
def list_cmd(lock: Path = _LOCK, json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """The pinned signers and the number of records listed as sealed before the signer pin."""
    lk = load_lock(lock)
    rows = [{"id": sid, "public_key": s.public_key, "added": s.added, "note": s.note} for sid, s in lk.signers.items()]
    pre = {"rounds": len(lk.sealed_before_pin.rounds), "calibrations": len(lk.sealed_before_pin.calibrations)}
    if json_out:
        print_json({"lock": str(lock), "signers": rows, "sealed_before_pin": pre})
        return
    table = Table("id", "public key", "added", "note", title=f"{lock}: pinned signers")
    for r in rows:
        table.add_row(escape(r["id"]), r["public_key"], r["added"], escape(r["note"]))
    console.print(table)
    console.print(f"sealed before the signer pin: {pre['rounds']} receipt(s), {pre['calibrations']} calibration(s)",
                  highlight=False)
