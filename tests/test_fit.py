"""Per-rank fit check with the real Kimi K3 numbers (its public config), and the default CPU target."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cli_helpers import scoreboard_command

from scoreboard.errors import InputError
from scoreboard.fit import GIB, KIMI_K3, check_fit, fit_budget
from scoreboard.lockfile import load_lock

REPO = Path(__file__).resolve().parent.parent
FLAGSHIP = "kimi-k3-h200x8-iq1s"


@pytest.fixture(scope="module")
def lock():
    return load_lock(REPO / "reference.lock")


def _line(rep, item):
    return next(x for x in rep.lines if x.item == item)


def test_k3_architecture_numbers():
    assert KIMI_K3.kv_bytes_per_token() == 27_648  # 24 x (512 + 64) x 2 B
    assert round(KIMI_K3.kda_state_bytes() / GIB, 2) == 0.43  # 69 x (128^2 x 96 + 3 x 3 x 96 x 128) x 4 B


def test_8x_h200_at_128k_fits_iq1s_under_the_sharded_plan(lock):
    rep = check_fit(fit_budget(lock, FLAGSHIP, detect=False))
    assert (rep.ranks, rep.usable_gib, rep.n_ctx) == (8, 139.5, 135168)
    assert _line(rep, "weights").gib == 531 / 8 + 22 == 88.375
    assert _line(rep, "weights").detail == "531 GiB sharded / 8 + 22 GiB replicated"
    assert round(_line(rep, "KV cache").gib, 2) == 3.48  # 135,168 tokens x 27,648 B
    assert _line(rep, "scratch").gib == 24
    assert rep.fits and 116 < rep.need_gib < 117


def test_1m_tokens_prices_the_kv_line_at_27_gib_per_rank(lock):
    rep = fit_budget(lock, FLAGSHIP, n_ctx=1_048_576, detect=False)
    assert _line(rep, "KV cache").gib == 27.0
    assert "27,648 B/token x 1,048,576 tokens" in _line(rep, "KV cache").detail


def test_4x_h200_plan_is_refused_with_the_numbers(lock):
    rep = fit_budget(lock, FLAGSHIP, ranks=4, detect=False)
    assert _line(rep, "weights").gib == 531 / 4 + 22
    with pytest.raises(InputError) as exc:
        check_fit(rep)
    msg = exc.value.message
    assert "needs 182.66 GiB per rank (weights 154.75, KV cache 3.48, KDA state 0.43, scratch 24.00)" in msg
    assert "on 4 rank(s)" in msg and "does not fit by 43.16 GiB per rank" in msg and "Offload is excluded" in msg
    assert "smaller quant" in exc.value.hint


def test_unknown_usable_memory_is_refused(lock):
    with pytest.raises(InputError, match="usable memory per rank is unknown"):
        check_fit(fit_budget(lock, "k3-mini-cpu", detect=False))
    with pytest.raises(InputError, match="no CUDA rank"):
        fit_budget(lock, FLAGSHIP, ranks=0, detect=False)


def test_generated_target_is_priced_from_its_config(lock):
    rep = check_fit(fit_budget(lock, "k3-mini-cpu", usable_gib=2.0, detect=False))
    files = lock.weights["k3-mini"].files
    assert _line(rep, "weights").gib == sum(f.size for f in files) / GIB
    assert _line(rep, "KV cache").gib == 2048 * 2 * (128 + 64) * 2 / GIB  # 2 MLA layers, f16 latent
    assert _line(rep, "KDA state").gib == 4 * (128 ** 2 * 2 + 3 * 3 * 256) * 4 / GIB
    with pytest.raises(InputError, match="does not fit"):
        check_fit(fit_budget(lock, "k3-mini-cpu", usable_gib=0.5, detect=False))


def test_cli_prints_the_budget_table(lock):
    env = dict(os.environ, COLUMNS="200")
    def run(*args):
        return subprocess.run([*scoreboard_command(), "fit", FLAGSHIP, "--node-class", *args], cwd=REPO, capture_output=True,
                              text=True, env=env, timeout=60)

    r = run()
    assert r.returncode == 0, r.stderr
    for text in ("per-rank budget, 8 rank(s)", "weights", "88.38", "KV cache", "3.48", "KDA state", "scratch",
                 "24.00", "total", "139.50", "fits"):
        assert text in r.stdout
    r = run("--ranks", "4")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout and "Offload is excluded" in r.stderr
