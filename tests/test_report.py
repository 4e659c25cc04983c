"""`scoreboard report`: a self-contained static HTML page, checked in a real headless browser (chromium)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from history_factory import build_history

REPO = Path(__file__).resolve().parent.parent


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium (.ci/run installs it)")
        pytest.skip("chromium is not installed (`apt-get install -y chromium`)")
    return exe


def _browser(exe: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-extensions", *args], capture_output=True, timeout=120)


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of raw pixel bytes) of an 8-bit RGB/RGBA PNG (a small reader: no Pillow)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def _report(tmp_path: Path, rounds: Path, lock: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "scoreboard", "report", "--rounds", str(rounds), "--lock", str(lock),
                           "--out", str(tmp_path / "report.html"), *extra], capture_output=True, text=True, env=env,
                          cwd=tmp_path)


def test_the_report_renders_every_slot_and_round_in_a_real_browser(tmp_path):
    exe = _chromium()
    lock, rounds, ids = build_history(tmp_path / "h")
    proc = _report(tmp_path, rounds, lock)
    assert proc.returncode == 0, proc.stderr
    page = tmp_path / "report.html"
    html = page.read_text(encoding="utf-8")
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # self-contained
    dom = _browser(exe, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout.decode()
    for rid in ids:
        assert f'id="{rid}"' in text, rid  # every round has its card
    for slot in ("RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_DECODE_512", "RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_PREFILL_256"):
        assert f'data-slot="{slot}"' in text, slot  # a ladder panel per slot
    assert "5 of 5 receipt(s) match their seal" in text and "history intact" in text
    assert "compounded x1.1200 from 50 to 56 tok/s over 2 step(s)" in text
    assert "correctness gate" in text and "per-block values" in text and "geomean of block medians" in text
    assert text.count('class="label M"') >= 1 and "ABORTED" in text
    shot = tmp_path / "shot.png"
    res = _browser(exe, f"--screenshot={shot}", "--window-size=1200,1800", page.as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    w, h, pixels = png_pixels(shot)
    assert (w, h) == (1200, 1800)
    distinct = set(pixels)
    assert len(distinct) > 200, f"screenshot looks blank: {len(distinct)} distinct colours"
    white = sum(p == b"\xff\xff\xff" for p in pixels) / len(pixels)
    assert white < 0.97, f"{white:.1%} white"


def test_the_report_shows_a_tampered_receipt_as_such_and_exits_2(tmp_path):
    lock, rounds, ids = build_history(tmp_path / "h")
    path = rounds / f"{ids[3]}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["verdict"]["label"] = "XL"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    proc = _report(tmp_path, rounds, lock)
    assert proc.returncode == 2 and "do not match their seal" in proc.stderr
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "4 of 5 receipt(s) match their seal" in html
    card = html[html.index(f'id="{ids[3]}"'):]
    card = card[:card.index("</div>")]
    assert "TAMPERED" in card and "verdict.label" in card and "XL" not in card
    assert "UNVERIFIED" in html  # the ladder step it backs


def _second_target_regression(rounds: Path) -> str:
    """A sealed round of another target, 40% below its pinned slot, sealed as `none` (as rounds were before the
    regression rule): it re-derives as a regression, and the report lists it first."""
    from receipt_factory import make_receipt

    from scoreboard.history.records import write_receipt

    r = make_receipt(label="none", candidate_tps=30.0, created_at="2026-11-28T09:00:00Z", round_hex="000000ee",
                     frontier_at_start=50.0, block_drift=True, blocks=4)
    r["target"] = "rcpt-two"
    r["round_id"] = r["round_id"].replace("rcpt-test", "rcpt-two")
    write_receipt(r, rounds)
    return r["round_id"]


def test_the_report_opens_with_where_each_target_stands_regressions_first(tmp_path):
    lock, rounds, ids = build_history(tmp_path / "h")
    other = _second_target_regression(rounds)
    proc = _report(tmp_path, rounds, lock)
    assert proc.returncode == 0, proc.stderr
    page = tmp_path / "report.html"
    html = page.read_text(encoding="utf-8")
    assert oct(page.stat().st_mode & 0o777) == "0o644"  # a page to publish, not a private file
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in html
    stand = html.index("Where each target stands")
    assert stand < html.index("<h2>Verification") < html.index("Frontier ladder")
    section = html[stand:html.index("<h2>Verification")]
    assert section.index("rcpt-two") < section.index("rcpt-test")  # the regression first
    two = section[section.index('data-target="rcpt-two"'):section.index('data-target="rcpt-test"')]
    assert 'class="label none"' in two and "re-derived today" in two and 'class="label regression"' in two
    assert f'href="#{other}"' in two
    assert "frontier <b>56</b> tok/s vs reference 41: <b>1.366x</b>" in section  # the lock's slots
    assert '<div class="scroll"><table>' in html and "<table>" not in html.replace('<div class="scroll"><table>', "")


@pytest.mark.parametrize("width", [420, 1400])
def test_the_report_is_readable_at_phone_and_desktop_width(tmp_path, width):
    """Nothing is cut at the right edge (a table wider than the phone scrolls inside its box; plots scale): the
    right margin band of the screenshot is page background in every row."""
    exe = _chromium()
    lock, rounds, ids = build_history(tmp_path / "h")
    _second_target_regression(rounds)
    assert _report(tmp_path, rounds, lock).returncode == 0
    shot = tmp_path / f"shot-{width}.png"
    res = _browser(exe, f"--screenshot={shot}", f"--window-size={width},2000", (tmp_path / "report.html").as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    w, h, pixels = png_pixels(shot)
    assert (w, h) == (width, 2000)
    band = [pixels[y * w + x] for y in range(h) for x in range(w - 5, w)]
    white = sum(p == b"\xff\xff\xff" for p in band) / len(band)
    assert white > 0.995, f"{1 - white:.1%} of the right edge is content: the page is cut at {width} px"
    assert len(set(pixels)) > 100  # and it is a page, not a blank
