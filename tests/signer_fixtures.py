"""The test session's signing key: made once per session outside every checkout (mode 0600), exported as
$SCOREBOARD_SIGNING_KEY, and pinned in each test lock that starts a fresh history (`receipt_factory.zero_slots`),
as the box's key is pinned in the repository's reference.lock. A record it seals is trusted only by a lock that
pins it: never by the repository's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomlkit

from scoreboard.history.seal import SIGNING_KEY_ENV, generate_keypair, load_public_key, public_key_b64

SIGNER_ID = "test-session"


def make_session_key(directory: Path) -> Path:
    """A fresh key pair in `directory`; $SCOREBOARD_SIGNING_KEY names it for the rest of the session."""
    key, _pub = generate_keypair(directory / "signing.key")
    os.environ[SIGNING_KEY_ENV] = str(key)
    return key


def session_public_key() -> str:
    """base64 raw public key of the session's key ($SCOREBOARD_SIGNING_KEY + '.pub')."""
    return public_key_b64(load_public_key(os.environ[SIGNING_KEY_ENV] + ".pub"))


def pin_signer(doc: Any, public_key: str | None = None, signer_id: str = SIGNER_ID) -> Any:
    """Pin a public key (default: the session's) as [signers.<signer_id>] of a tomlkit lock document."""
    signers = doc.get("signers")
    if signers is None:
        signers = tomlkit.table(is_super_table=True)
        doc["signers"] = signers
    table = tomlkit.table()
    table["public_key"] = public_key or session_public_key()
    table["added"] = "2026-12-02"
    table["note"] = "the test session's key, in the session's temporary directory"
    signers[signer_id] = table
    return doc


def pin_in(lock: Path, public_key: str | None = None, signer_id: str = SIGNER_ID) -> Path:
    """`pin_signer` on a lock file, in place."""
    lock.write_text(tomlkit.dumps(pin_signer(tomlkit.parse(lock.read_text(encoding="utf-8")), public_key, signer_id)),
                    encoding="utf-8")
    return lock
