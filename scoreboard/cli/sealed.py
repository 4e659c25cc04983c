"""Reading a receipt for display: every command that shows one checks its seal first.

A receipt file is plain JSON anyone can edit; what `round show` or `tier` prints gets pasted into PRs.
So the display path is: parse -> refuse an unknown major format (exit 1, not ours to read) -> check the
seal (and an embedded signature) -> only then render. An unsealed or edited receipt is reported as
such (NonCompliant, exit 2) and its verdict is never printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError, NonCompliant
from ..history.seal import check_seal, check_signature


def read_json_receipt(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InputError(f"{path}: receipt not found", "list sealed receipts with `ls rounds/*.json`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable JSON receipt ({exc})",
                         "run `scoreboard verify` to check history") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a receipt is a JSON object")
    return data


def seal_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) for a missing/mismatched seal or a signature that does not verify."""
    problems = check_seal(data)
    if not problems:
        problems = check_signature(data)
    return problems


def require_sealed(data: dict[str, Any], path: Path | str) -> None:
    """NonCompliant (exit 2) naming the edited fields, unless the receipt is exactly what was sealed."""
    problems = seal_problems(data)
    if not problems:
        return
    unsealed = problems[0][0] == "seal"
    what = "UNSEALED" if unsealed else "TAMPERED"
    fields = ", ".join(f for f, _ in problems)
    detail = problems[0][1] if unsealed else f"changed since sealing: {fields}"
    raise NonCompliant(f"{path}: {what} receipt ({detail}); its verdict is not shown — an unsealed or edited "
                       "receipt is a claim, not a measurement",
                       f"restore it from git (`git checkout -- {path}`) and run `scoreboard verify`")


def load_sealed_receipt(path: Path) -> dict[str, Any]:
    """Read, check the format's major version (exit 1), then the seal (exit 2)."""
    from ..history.receipt import check_format_version

    data = read_json_receipt(path)
    try:
        check_format_version(data.get("format_version"))
    except ValueError as exc:
        raise InputError(f"{path}: {exc}", "upgrade scoreboard to read this receipt") from None
    require_sealed(data, path)
    return data
