"""PyPI sdist pins: the pinned version's sdist still has the pinned sha256 (PyPI JSON API, no download).

`GET <base>/pypi/<package>/<version>/json` -> `urls[]`, the entries with `packagetype == "sdist"` carry
`digests.sha256` (on a 404, `GET <base>/pypi/<package>/json` -> `releases[<version>]` confirms or refutes it).
Base URL: `$SCOREBOARD_PYPI_URL`, else https://pypi.org.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..lockfile import SdistReference
from . import Finding, short

DEFAULT_PYPI = "https://pypi.org"


class PypiUnavailable(Exception):
    """PyPI could not be asked or answered with a failure (network, timeout, 5xx, 429): an error."""


class PypiGone(Exception):
    """PyPI answered that the release does not exist (404): drift."""


def pypi_base() -> str:
    return os.environ.get("SCOREBOARD_PYPI_URL", DEFAULT_PYPI).rstrip("/")


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "scoreboard-audit-pins"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise PypiGone(f"{url}: HTTP 404") from exc
        raise PypiUnavailable(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (socket.timeout, TimeoutError) as exc:
        raise PypiUnavailable(f"{url}: timed out after {timeout:g} s") from exc
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise PypiUnavailable(f"{url}: timed out after {timeout:g} s") from exc
        raise PypiUnavailable(f"{url}: {reason}") from exc
    except (OSError, ValueError) as exc:  # connection reset mid-body, malformed JSON
        raise PypiUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc


def release_files(package: str, version: str, timeout: float) -> list[dict[str, Any]]:
    """The release's file entries (`urls[]`). A 404 of the release document is confirmed through the project
    document's `releases` before it counts as "gone" (some mirrors and proxies serve only the latter)."""
    pkg, ver = urllib.parse.quote(package), urllib.parse.quote(version)
    try:
        return list(_get_json(f"{pypi_base()}/pypi/{pkg}/{ver}/json", timeout).get("urls", []))
    except PypiGone as first:
        project = _get_json(f"{pypi_base()}/pypi/{pkg}/json", timeout)  # PypiGone here: the project is gone
        releases = project.get("releases") or {}
        if version not in releases:
            latest = (project.get("info") or {}).get("version", "?")
            raise PypiGone(f"{first}; the project lists no release {version} (latest: {latest})") from first
        return list(releases[version])


def sdists(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [u for u in files if isinstance(u, dict) and u.get("packagetype") == "sdist"]


def check_sdist(ref_id: str, r: SdistReference, *, timeout: float = 30.0, targets: tuple[str, ...] = ()) -> list[Finding]:
    """All findings for one `[references.<id>]` of kind pypi-sdist."""
    pin = f"references.{ref_id}"
    subject = f"{r.package}=={r.version} sdist"
    repin = (f"a changed sdist is different source: review it, then update {pin}.sha256 (or pin another version) "
             f"deliberately, rebuild and re-measure the baselines")
    try:
        files = sdists(release_files(r.package, r.version, timeout))
    except PypiGone as exc:
        return [Finding("drift", pin, subject, f"the release is gone from PyPI: {exc}", repin, r.sha256, "(missing)",
                        targets)]
    except PypiUnavailable as exc:
        return [Finding("error", pin, subject, f"could not read PyPI: {exc}",
                        "re-run `scoreboard audit-pins`; if it persists check the network or $SCOREBOARD_PYPI_URL "
                        "(this is not drift: nothing was observed to move)", r.sha256, "", targets)]
    if not files:
        return [Finding("drift", pin, subject, "the release has no sdist any more", repin, r.sha256, "(no sdist)",
                        targets)]
    hashes = [str(u.get("digests", {}).get("sha256", "")) for u in files]
    match = [u for u, h in zip(files, hashes) if h == r.sha256]
    if not match:
        names = ", ".join(str(u.get("filename", "?")) for u in files)
        return [Finding("drift", pin, subject, f"the sdist ({names}) has sha256 {short(hashes[0])}, pinned "
                        f"{short(r.sha256)}", repin, r.sha256, ", ".join(hashes), targets)]
    note = ""
    if match[0].get("yanked"):
        note = f"; note: yanked ({match[0].get('yanked_reason') or 'no reason given'}), still installable by =="
    return [Finding("ok", pin, subject, f"{match[0].get('filename', 'sdist')} sha256 {short(r.sha256)} matches{note}",
                    "", r.sha256, r.sha256, targets)]
