"""Repository-wide habits: comments stand on their own (no citations of documents the repository lacks)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Design documents kept outside the repository; a comment citing them is unreadable to whoever carries the code.
OUTSIDE_DOCS = re.compile(r"\bLESSONS\b|\bSPEC (step|§)|\bSPEC[:\"]|\bSPEC \"|K3\.md|LLAMACPP\.md|CASE-STUDY"
                          r"|ANTI-GAMING|PEERS\.md|STYLE\.md|SPEC\.md")
CHECKED = (".py", ".md", ".toml", ".lock")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    names = [n for n in out.decode().split("\0") if n]
    return [REPO / n for n in names if n.endswith(CHECKED) and not n.startswith("rounds/")]


def citations(text: str) -> list[str]:
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE_DOCS.search(line)]


def test_the_pattern_sees_each_form_of_citation():
    cited = ["(LESSONS 26)", "Order (SPEC step 6;", 'group (SPEC "Scale")', "(K3.md)", "per LLAMACPP.md",
             "(CASE-STUDY: env -u)", "ANTI-GAMING 3", "see PEERS.md", "STYLE.md habit 4", "(SPEC: gain >= XS)"]
    assert all(citations(c) for c in cited)
    fine = ["scoreboard weights generate SPEC --out DIR", "--reference-source SPEC", "| SPEC | what it is |",
            "Kimi K3 needs 896 experts", "K3_MINI_CPU_X86_64_F32_LLAMACPP_DECODE_1K", "_STYLE = {}"]
    assert not any(citations(f) for f in fine)


def test_no_tracked_file_cites_a_document_outside_the_repository():
    files = tracked_files()
    assert any(p.name == "tiers.py" for p in files)  # the listing itself works
    found = {str(p.relative_to(REPO)): hits for p in files if p.is_file()
             and (hits := citations(p.read_text(encoding="utf-8", errors="replace")))}
    found.pop("tests/test_layout.py", None)  # this file names them to find them
    assert found == {}, "state the reason or link into docs/ instead of citing an outside document"
