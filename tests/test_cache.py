"""One cache-directory rule (scoreboard.cache.cache_dir), and every default that must follow it."""

from __future__ import annotations

from pathlib import Path

from scoreboard.cache import CACHE_ENV, cache_dir
from scoreboard.calibration_run import CalibrationOptions
from scoreboard.round.run import RoundOptions
from scoreboard.weights.verify import default_cache, weights_dir


def test_explicit_then_environment_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "scoreboard"
    monkeypatch.setenv(CACHE_ENV, "")  # set but empty: not a path
    assert cache_dir() == tmp_path / "home" / ".cache" / "scoreboard"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "given") == tmp_path / "given"
    assert cache_dir("") == tmp_path / "env"  # an empty explicit value is no value
    monkeypatch.setenv(CACHE_ENV, "~/c")
    assert cache_dir() == tmp_path / "home" / "c"
    assert cache_dir("~/x") == tmp_path / "home" / "x"


def test_every_default_follows_the_rule(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert RoundOptions(target="t").cache_dir == tmp_path / "env"
    assert CalibrationOptions(target="t").cache_dir == tmp_path / "env"
    assert default_cache() == tmp_path / "env"
    assert weights_dir("k3-mini") == tmp_path / "env" / "weights" / "k3-mini"
    assert RoundOptions(target="t", cache_dir=Path("/elsewhere")).cache_dir == Path("/elsewhere")
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert RoundOptions(target="t").cache_dir == tmp_path / "home" / ".cache" / "scoreboard"


def test_no_other_module_computes_the_default():
    root = Path(__file__).resolve().parent.parent
    own = {root / "scoreboard" / "cache.py"}
    found = [str(p.relative_to(root)) for d in ("scoreboard", "engines", "bench") for p in (root / d).rglob("*.py")
             if p not in own and ('".cache"' in p.read_text() or "'SCOREBOARD_CACHE'" in p.read_text()
                                  or '"SCOREBOARD_CACHE"' in p.read_text())]
    assert found == []
