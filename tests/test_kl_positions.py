"""bench/kl_positions.py on k3-mini's CPU target, reduced (2 depths x 4 rows): the correct arm reads llama.cpp's
logits back, a fault arm does not, and the JSON carries every number with both engines' identities. The H200 call
(k3-gpu-long-h200 at 131072) runs the same code on its target's device and options."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "kl_positions.py"


def _script():
    spec = importlib.util.spec_from_file_location("kl_positions", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_kl_positions_grades_arms_against_llamacpp(tmp_path, capsys):
    out = tmp_path / "kl.json"
    rc = _script().main(["--target", "k3-mini-cpu", "--depths", "64", "512", "--rows", "4",
                         "--arm", 'f32={"dtype":"float32"}', "--arm", 'broken={"faults":["mla_as_mqa"]}',
                         "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads(out.read_text())
    assert res["target"] == "k3-mini-cpu" and res["depths"] == [64, 512] and res["rows"] == 4
    assert res["positions"] == [60, 61, 62, 63, 508, 509, 510, 511]
    assert res["n"] == 512 and res["n_ids"] >= 512 and len(res["ids_sha256"]) == 64
    assert res["prompt"]["seed"] == 0 and res["prompt"]["n_tokens"] >= 512
    ref = res["engines"]["llamacpp"]
    assert ref["role"] == "reference" and ref["identity"]["engine"] == "llamacpp" and ref["command"]
    assert ref["identity"]["extra"]["build_key"] and ref["logits_s"] > 0
    assert list(res["arms"]) == ["candidate", "f32", "broken"]
    assert res["arms"]["candidate"]["options"] == {}  # the target's candidate options: none on k3-mini-cpu
    assert res["arms"]["broken"]["identity"]["extra"]["faults"] == ["mla_as_mqa"]
    assert res["arms"]["f32"]["identity"]["extra"]["dtype"] == "float32"
    by = {(c["p"], c["q"]): c for c in res["comparisons"]}
    assert set(by) == {("llamacpp", "candidate"), ("llamacpp", "f32"), ("llamacpp", "broken"),
                       ("f32", "candidate"), ("broken", "candidate")}
    for c in by.values():
        assert [d["depth"] for d in c["depths"]] == [64, 512]
        assert all(d["rows"] == 4 and len(d["positions"]) == 4 for d in c["depths"])
        assert len(c["rows"]["kl"]) == 8 and c["rows"]["positions"] == res["positions"]
        assert ("pass" in c["depths"][0]) == (c["kind"] == "reference")
        for d in c["depths"]:
            assert 0 <= d["kl_mean"] <= d["kl_max"] and 0 <= d["kl_p99"] <= d["kl_max"]
    for arm in ("candidate", "f32"):
        c = by[("llamacpp", arm)]
        assert all(d["kl_mean"] < 1e-3 and d["kl_max"] < 1e-3 and d["top1"] == 1.0 and d["pass"]
                   for d in c["depths"]), c["depths"]
    assert by[("f32", "candidate")]["all"]["kl_max"] < 1e-9  # the same options: the same rows
    broken = by[("llamacpp", "broken")]
    assert all(d["kl_mean"] > 1e-2 and not d["pass"] for d in broken["depths"]), broken["depths"]
    assert by[("broken", "candidate")]["all"]["kl_mean"] > 1e-2
    assert "KL(llamacpp || broken)" in printed and "KL mean by depth" in printed
    assert printed.count("logits:") == 4  # one progress line per engine call


@pytest.mark.parametrize(("args", "words"), [
    (["--target", "no-such-target"], "unknown target 'no-such-target'"),
    (["--arm", "x={dtype"], "--arm x: options are not JSON"),
    (["--arm", "x=[1]"], "options must be a JSON object"),
    (["--arm", "x"], "want NAME=JSON"),
    (["--arm", 'x={"dtype":"float8"}'], "--arm x: options.dtype"),
    (["--arm", 'x={"faults":["no_such_fault"]}'], "unknown fault"),
    (["--arm", "candidate={}"], "the name is taken"),
    (["--depths", "4096"], "exceed the target's n_ctx"),
])
def test_kl_positions_refuses_bad_input(args, words, capsys):
    assert _script().main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err, err
