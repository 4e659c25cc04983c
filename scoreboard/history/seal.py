"""Canonical JSON bytes, the receipt seal (sha256), per-field digests, and detached Ed25519 signatures.

Canonical bytes: ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
allow_nan=False)`` encoded as UTF-8. The seal is sha256 of the canonical bytes of the receipt without
its ``seal`` key. The optional signature is Ed25519 over ``signed_message(sha256, prev_ledger_sha256)``
so it binds the content *and* the receipt's place in the ledger chain.

The private key lives OUTSIDE any working tree the candidate can read (a candidate build runs on the
box; a key it can read signs anything). `load_private_key` refuses a key under a forbidden root or
readable by group/others.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import InputError, NonCompliant

SIGNING_KEY_ENV = "SCOREBOARD_SIGNING_KEY"  # path of a PEM (PKCS#8) Ed25519 private key
PUBLIC_KEY_ENV = "SCOREBOARD_PUBLIC_KEY"  # path of a PEM (SubjectPublicKeyInfo) Ed25519 public key
SIGNATURE_ALGORITHM = "ed25519"
FIELD_DIGEST_HEX = 16  # per-field digests are diagnostics (which field changed), not the seal itself


# ----------------------------------------------------------------------------------------------
# canonical JSON

def _check_json(obj: Any, path: str) -> None:
    """Refuse anything whose canonical bytes would not round-trip to the same value."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise InputError(f"{path or '<root>'}: {obj!r} is not allowed in canonical JSON (NaN/inf)",
                             "record a missing measurement as null, never as NaN")
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise InputError(f"{path or '<root>'}: key {k!r} is not a string; canonical JSON keys are strings")
            _check_json(v, f"{path}.{k}" if path else k)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{path}[{i}]")
        return
    raise InputError(f"{path or '<root>'}: {type(obj).__name__} is not a JSON value")


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, compact separators, UTF-8, NaN/inf refused (InputError naming the path)."""
    _check_json(obj, "")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------------------------
# seal

def unsealed(receipt: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in receipt.items() if k != "seal"}


def seal_sha256(receipt: Mapping[str, Any]) -> str:
    """sha256 hex of the canonical bytes of everything but the ``seal`` block."""
    return sha256_hex(canonical_bytes(unsealed(receipt)))


def field_digests(receipt: Mapping[str, Any]) -> dict[str, str]:
    """Path -> truncated sha256 of each top-level value and, for dict values, each child value.

    Stored in ``seal.fields`` so `scoreboard verify` can name the edited field (``verdict.label``).
    """
    out: dict[str, str] = {}
    for key, value in unsealed(receipt).items():
        out[key] = sha256_hex(canonical_bytes(value))[:FIELD_DIGEST_HEX]
        if isinstance(value, Mapping):
            for child, cvalue in value.items():
                out[f"{key}.{child}"] = sha256_hex(canonical_bytes(cvalue))[:FIELD_DIGEST_HEX]
    return out


def changed_fields(receipt: Mapping[str, Any], recorded: Mapping[str, str]) -> list[str]:
    """Fields whose digest differs from the recorded one (most specific path first), plus added/removed."""
    now = field_digests(receipt)
    changed = sorted(p for p in set(now) | set(recorded) if now.get(p) != recorded.get(p))
    # report `verdict.label`, not also `verdict`, when a child explains the change
    return [p for p in changed if not any(q.startswith(p + ".") for q in changed)]


def signed_message(sha256: str, prev_ledger_sha256: str) -> bytes:
    """The bytes the Ed25519 signature covers: domain tag, seal digest, previous ledger line hash."""
    return f"scoreboard-seal-v1\n{sha256}\n{prev_ledger_sha256}\n".encode("ascii")


def make_seal(receipt: Mapping[str, Any], prev_ledger_sha256: str, private_key: Any = None) -> dict[str, Any]:
    """The ``seal`` block for a receipt (its ``seal`` key, if any, is ignored)."""
    digest = seal_sha256(receipt)
    seal: dict[str, Any] = {"sha256": digest, "prev_ledger_sha256": prev_ledger_sha256,
                            "fields": field_digests(receipt), "algorithm": None, "signature": None,
                            "public_key": None}
    if private_key is not None:
        seal["algorithm"] = SIGNATURE_ALGORITHM
        seal["signature"] = base64.b64encode(private_key.sign(signed_message(digest, prev_ledger_sha256))).decode()
        seal["public_key"] = public_key_b64(private_key.public_key())
    return seal


def check_seal(receipt: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems with a receipt's seal as (field, message); empty = the content is what was sealed."""
    seal = receipt.get("seal")
    if not isinstance(seal, Mapping) or not isinstance(seal.get("sha256"), str):
        return [("seal", "missing (the receipt was never sealed)")]
    if seal_sha256(receipt) == seal["sha256"]:
        return []
    fields = seal.get("fields")
    names = changed_fields(receipt, fields) if isinstance(fields, Mapping) else []
    msg = f"does not match seal.sha256 {seal['sha256'][:12]}… (edited after sealing)"
    return [(n, msg) for n in names] or [("seal.sha256", msg + "; seal.fields cannot name the field")]


def verify_sealed(receipt: Mapping[str, Any], what: str = "receipt") -> None:
    """Raise NonCompliant unless the receipt is sealed and its content matches the seal."""
    problems = check_seal(receipt)
    if problems:
        raise NonCompliant(f"{what}: " + "; ".join(f"{f}: {m}" for f, m in problems),
                           "an edited or unsealed receipt is a claim, not a measurement; run `scoreboard verify`")


# ----------------------------------------------------------------------------------------------
# Ed25519 keys and signatures

def _ed25519():
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def check_key_location(path: Path, forbidden_roots: Iterable[Path]) -> None:
    for root in forbidden_roots:
        if _inside(path, Path(root)):
            raise InputError(
                f"{path}: signing key is inside {root}, a tree the candidate can read",
                "keep the key outside every checkout, e.g. ~/.config/scoreboard/signing.key, and strip "
                f"{SIGNING_KEY_ENV} from the candidate's environment")


def generate_keypair(path: str | os.PathLike[str], forbidden_roots: Iterable[Path] = ()) -> tuple[Path, Path]:
    """Write a new Ed25519 private key (PEM, mode 0600) at `path` and its public key at `path`.pub."""
    from cryptography.hazmat.primitives import serialization

    priv_path = Path(path)
    check_key_location(priv_path, forbidden_roots)
    if priv_path.exists():
        raise InputError(f"{priv_path}: already exists; refusing to overwrite a signing key")
    key = _ed25519().Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    priv_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub_path = priv_path.with_name(priv_path.name + ".pub")
    pub_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv_path, pub_path


def load_private_key(path: str | os.PathLike[str] | None = None, forbidden_roots: Iterable[Path] = ()) -> Any:
    """The Ed25519 private key at `path` (or $SCOREBOARD_SIGNING_KEY); None when neither is set."""
    from cryptography.hazmat.primitives import serialization

    raw = path if path is not None else os.environ.get(SIGNING_KEY_ENV)
    if not raw:
        return None
    p = Path(raw)
    check_key_location(p, forbidden_roots)
    if not p.is_file():
        raise InputError(f"{p}: signing key not found", f"create one with scoreboard.history.seal.generate_keypair or unset "
                                                        f"{SIGNING_KEY_ENV}")
    if os.name == "posix" and p.stat().st_mode & 0o077:
        raise InputError(f"{p}: signing key is readable by group/others", f"chmod 600 {p}")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{p}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, _ed25519().Ed25519PrivateKey):
        raise InputError(f"{p}: not an Ed25519 key ({type(key).__name__})")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Any:
    """An Ed25519 public key from a PEM file, or from a file holding the base64 raw 32 bytes."""
    from cryptography.hazmat.primitives import serialization

    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: public key not found", f"pass --public-key PATH or set {PUBLIC_KEY_ENV}")
    data = p.read_bytes()
    try:
        if b"-----BEGIN" in data:
            key = serialization.load_pem_public_key(data)
        else:
            key = _ed25519().Ed25519PublicKey.from_public_bytes(base64.b64decode(data.strip(), validate=True))
    except (ValueError, TypeError) as exc:
        raise InputError(f"{p}: not an Ed25519 public key ({exc})") from None
    if not isinstance(key, _ed25519().Ed25519PublicKey):
        raise InputError(f"{p}: not an Ed25519 public key ({type(key).__name__})")
    return key


def public_key_b64(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def check_signature(receipt: Mapping[str, Any], trusted_key: Any = None) -> list[tuple[str, str]]:
    """Problems with the signature. With `trusted_key` a signature by that key is required;
    without it a present signature is checked against the embedded key (integrity, not trust)."""
    from cryptography.exceptions import InvalidSignature

    seal = receipt.get("seal") or {}
    sig, embedded = seal.get("signature"), seal.get("public_key")
    if not sig:
        return [("seal.signature", "missing (receipt is not signed)")] if trusted_key is not None else []
    try:
        if trusted_key is not None:
            key = trusted_key
            if embedded and embedded != public_key_b64(trusted_key):
                return [("seal.public_key", "signed by a key other than the trusted public key")]
        else:
            key = _ed25519().Ed25519PublicKey.from_public_bytes(base64.b64decode(embedded or "", validate=True))
        key.verify(base64.b64decode(sig, validate=True),
                   signed_message(str(seal.get("sha256")), str(seal.get("prev_ledger_sha256"))))
    except (InvalidSignature, ValueError, TypeError):
        return [("seal.signature", "does not verify over seal.sha256 + seal.prev_ledger_sha256")]
    return []
