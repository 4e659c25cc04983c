"""Render an AuditReport: markdown (for the weekly issue / job summary) and plain text (for the terminal)."""

from __future__ import annotations

from . import AuditReport, Finding, short

MARKER = "<!-- scoreboard-audit-pins -->"  # the workflow finds its one issue by this

_TITLES = {
    "drift": "Drift — a pin no longer holds",
    "error": "Errors — the check could not complete (this is not drift)",
    "unpinned": "Unpinned — declared but not yet recorded",
    "ok": "OK",
}
_HEADLINE = {
    "clean": "clean (exit 0)",
    "drift": "DRIFT (exit 2)",
    "error": "ERROR: incomplete audit (exit 1)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\r", " ").replace("\n", "<br>") or " "


def _code(text: str) -> str:
    return f"`{text}`" if text and not text.startswith("(") else _cell(text)


def _summary(r: AuditReport) -> str:
    c = r.counts()
    return ", ".join(f"{c[k]} {k}" for k in ("drift", "error", "unpinned", "ok"))


def render_markdown(r: AuditReport) -> str:
    lines = [MARKER, f"## Pin audit: {_HEADLINE[r.status]}", ""]
    scope = "all pins" if r.scope == ("all",) else "target(s) " + ", ".join(f"`{t}`" for t in r.scope)
    lines.append(f"`scoreboard audit-pins` of {scope} in `{r.lock_path}` (sha256 `{short(r.lock_sha256, 16)}`) "
                 f"at {r.checked_at}: **{_summary(r)}**.")
    lines.append("")
    if r.status == "drift":
        lines += ["Something the baseline depends on but does not control has moved. Any number measured against "
                  "the old state is no longer reproducible: review the change, re-pin deliberately, re-measure "
                  "(see `docs/audit-pins.md`).", ""]
    elif r.status == "error":
        lines += ["Some pins could not be checked (network or API failure). That is not drift; re-run the audit. "
                  "Drift observed by the checks that did complete is listed below.", ""]
    for kind in ("drift", "error", "unpinned"):
        group = r.of(kind)
        if not group:
            continue
        lines += [f"### {_TITLES[kind]}", "", "| pin | what | from | to | what to do |", "|---|---|---|---|---|"]
        for f in group:
            lines.append(f"| `{_cell(f.pin)}` | {_cell(f.subject)}: {_cell(f.message)} | {_code(_cell(f.was))} | "
                         f"{_code(_cell(f.now))} | {_cell(f.action)} |")
        lines.append("")
    ok = r.of("ok")
    if ok:
        lines += [f"### {_TITLES['ok']}", ""]
        lines += [f"- `{f.pin}` {f.subject}: {f.message}" for f in ok]
        lines.append("")
    return "\n".join(lines)


def _text(f: Finding) -> list[str]:
    out = [f"{f.kind.upper():9s} {f.pin}  {f.subject}: {f.message}"]
    if f.kind != "ok" and (f.was or f.now):
        out.append(f"{'':9s}   from {f.was or '-'}\n{'':9s}   to   {f.now or '-'}")
    if f.action:
        out.append(f"{'':9s}   next: {f.action}")
    return out


def render_text(r: AuditReport) -> str:
    lines: list[str] = []
    for kind in ("drift", "error", "unpinned", "ok"):
        for f in r.of(kind):
            lines += _text(f)
    lines.append(f"pin audit: {_HEADLINE[r.status]} — {_summary(r)}")
    return "\n".join(lines)
