"""SIGTERM and SIGHUP end a command the way Ctrl-C does (scoreboard/cli/signals.py); the round itself under SIGTERM
is tests/test_nothing_lost.py::test_ctrl_c_at_any_stage_leaves_no_receipt_no_reserve_no_scratch_and_no_mount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A stand-in for a long command: clean-up in a finally, as a round's scratch and reserve are; it prints "ready"
# once the handlers are in, then waits to be signalled; a second SIGTERM arrives while the finally runs.
CHILD = r"""
import os, signal, sys, time
from scoreboard.cli import signals
try:
    caught = signals.install()
    print("ready", ",".join(signal.Signals(s).name for s in caught), flush=True)  # inside: the signal may come next
    time.sleep(60)
except KeyboardInterrupt as exc:
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a second kill during the clean-up
        time.sleep(0.3)
        open(sys.argv[1], "w").write("cleaned")
    finally:
        sys.exit(signals.exit_code(exc))
"""


def _child(tmp_path: Path, ignore_hup: bool = False) -> tuple[subprocess.Popen, str]:
    def pre() -> None:  # as `nohup` starts it, or with the default, whatever this test runner was started with
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL)  # (a suite run under nohup
        # passed its ignored SIGHUP to the child, which then rightly kept it ignored: 2 failures, 2026-12-07)

    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "cleaned")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=pre)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", line
    return proc, line[1] if len(line) > 1 else ""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_termination_signal_runs_the_clean_up_once_and_exits_128_plus_its_number(tmp_path, sig):
    proc, caught = _child(tmp_path)
    assert caught == "SIGTERM,SIGHUP"
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=30)
    assert proc.returncode == 128 + getattr(signal, sig)
    assert (tmp_path / "cleaned").read_text() == "cleaned"  # the second SIGTERM did not cut the clean-up short


def test_a_signal_ignored_at_start_stays_ignored(tmp_path):
    proc, caught = _child(tmp_path, ignore_hup=True)
    assert caught == "SIGTERM"
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None  # nohup's promise kept
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 143 and (tmp_path / "cleaned").exists()


def test_the_message_and_code_of_ctrl_c_are_unchanged():
    from scoreboard.cli import signals

    assert signals.exit_code(KeyboardInterrupt()) == 130 and signals.what(KeyboardInterrupt()) == "interrupted"
    t = signals.Terminated(signal.SIGTERM)
    assert isinstance(t, KeyboardInterrupt) and signals.exit_code(t) == 143 and signals.what(t) == "terminated (SIGTERM)"


def test_the_cli_run_in_process_leaves_the_handlers_as_it_found_them(monkeypatch, capsys):
    from cli_helpers import run_cli

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    code, _, _ = run_cli(monkeypatch, capsys, "--help")
    assert code == 0
    assert {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)} == before
