"""llamacpp's typed options (engines/llamacpp/options.py): the engine and the lock refuse unknown or mistyped
options by path, and the engine reads its settings only through the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engines.llamacpp import options as llama_options
from engines.llamacpp.engine import LlamaCppEngine, run_settings
from scoreboard import registry
from scoreboard.cache import CACHE_ENV
from scoreboard.errors import InputError


def _target(**options):
    from llamacpp_fixtures import tiny_target

    return tiny_target(Path("/nonexistent/k3-tiny.gguf"), **options)


def test_the_round_s_options_parse_and_reach_the_settings():
    t = _target(split_mode="row", visible_devices="4,5", flash_attn=0, n_gpu_layers=7, pip_args=["-q"])
    o = llama_options.parse(t.options)
    assert (o.split_mode, o.visible_devices, o.flash_attn, o.n_gpu_layers, o.pip_args) == ("row", "4,5", 0, 7, ("-q",))
    s = run_settings(t)
    assert (s.split_mode, s.visible_devices, s.flash_attn, s.n_gpu_layers, s.threads) == ("row", "4,5", 0, 7, 2)
    d = run_settings(_target())  # defaults: flash attention on, layer split, no GPU layers on cpu
    assert (d.split_mode, d.visible_devices, d.flash_attn, d.n_gpu_layers) == ("layer", "", 1, 0)


@pytest.mark.parametrize("options, message", [
    ({"split_mode": "rows"}, "options.split_mode must be none, layer or row, not 'rows'"),
    ({"flash_attn": 2}, "options.flash_attn must be 1, 0 or -1, not 2"),
    ({"n_gpu_layers": "lots"}, "options.n_gpu_layers: Input should be a valid integer"),
    ({"dtype": "float16"}, "options.dtype: Extra inputs are not permitted (got 'float16')"),
])
def test_unknown_or_mistyped_options_are_path_qualified_input_errors(options, message):
    with pytest.raises(InputError) as exc:
        LlamaCppEngine().describe(_target(**options))  # refused before anything is looked up or built
    assert message in exc.value.message
    assert exc.value.hint


def test_every_bad_option_is_named_at_once():
    with pytest.raises(InputError) as exc:
        llama_options.parse({"split_mode": "rows", "bogus": 1})
    assert exc.value.message == ("options.split_mode must be none, layer or row, not 'rows'; "
                                 "options.bogus: Extra inputs are not permitted (got 1)")
    assert exc.value.hint == "set parallel.reference_split_mode in the target"


def test_describe_reads_the_cache_dir_option_else_the_harness_rule(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    engine = LlamaCppEngine()
    ident = engine.describe(_target())
    assert ident.extra["built"] is False  # nothing cached under the rule's directory
    t = dataclasses.replace(_target(), options={**_target().options, "cache_dir": str(tmp_path / "given")})
    assert engine.describe(t).extra["built"] is False


def test_the_lock_s_option_check_knows_llamacpp_s_models():
    """The check a round puts the lock's candidate_options through uses these models: a target may pin none."""
    assert registry.options_models("llamacpp") == (llama_options.LockOptions, llama_options.Options)
    where = "targets.t.candidate_options"
    assert registry.option_problems("llamacpp", {}, where) == []
    assert registry.option_problems("llamacpp", {"bogus": 1}, where) == [
        f"{where}.bogus: unknown llamacpp option (known: none); remove it or check its spelling"]
    assert registry.option_problems("llamacpp", {"split_mode": "row"}, where)[0].startswith(
        f"{where}.split_mode: llamacpp reads this option, but only")
    assert registry.option_problems("llamacpp", {"split_mode": "rows"}, where, in_lock=False)[0].startswith(
        f"{where}.split_mode: ")
