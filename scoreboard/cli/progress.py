"""Progress of a running round (or calibration) on stderr: stage lines, steps, progress with an ETA, heartbeats."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .console import err_console

LONG_S = 60.0  # a stage estimated to take longer than this (seconds, elapsed + left) shows what is left


def eta_text(elapsed_s: float, done: int, left: int) -> str:
    """"~N min M s left" for a task `done` steps in after `elapsed_s` seconds with `left` steps to go, when its
    whole run is estimated longer than LONG_S; "" for a short one, before the first step, or when it is over."""
    if done <= 0 or left <= 0 or elapsed_s <= 0:
        return ""
    remaining = elapsed_s / done * left
    if elapsed_s + remaining <= LONG_S:
        return ""
    m, s = divmod(int(round(remaining)), 60)
    return f"~{m} min {s:02d} s left" if m else f"~{s} s left"


class RichReporter:
    """Turns the round's report events into progress lines (stderr, so --json stays clean).

    On a terminal: a live rich progress bar. Otherwise (output to a file or a CI log) a live bar prints
    nothing until it ends, and the speed stage would be silent for minutes: print a plain line per
    progress event at most every `interval` seconds, and a heartbeat naming the stage and its last step
    whenever nothing else was printed for `interval` seconds.
    """

    def __init__(self, console=None, interval: float | None = None, clock: Callable[[], float] | None = None) -> None:
        import threading

        self.console = console or err_console
        self.clock = clock or time.monotonic  # seconds, for intervals and estimates (a test passes its own)
        self.live = self.console.is_terminal
        self.interval = interval if interval is not None else float(os.environ.get("SCOREBOARD_PROGRESS_EVERY", 5))
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                 TextColumn("{task.fields[eta]}"), console=self.console, transient=False)
        self.tasks: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stage, self._stage_t0, self._last_msg = "", 0.0, ""
        self._last_print = 0.0
        self._started: dict[str, tuple[float, int]] = {}  # progress task -> (monotonic s, done) when first seen
        self._eta = ""  # the running stage's estimate of what is left, "" when none

    def _say(self, text: str, markup: bool = False) -> None:
        with self._lock:
            self.console.print(text, highlight=False, markup=markup)
            self._last_print = self.clock()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            now = self.clock()
            if self._stage and now - self._last_print >= self.interval:
                self._say(f"   ... {self._stage}: {now - self._stage_t0:.0f} s so far"
                          + (f" (last: {self._last_msg})" if self._last_msg else "")
                          + (f", {self._eta}" if self._eta else ""))

    def _estimate(self, task: str, done: int, total: int, now: float) -> str:
        """What is left of `task`, from its own pace since it was first seen (`eta_text`)."""
        t0, done0 = self._started.setdefault(task, (now, done))
        return eta_text(now - t0, done - done0, total - done)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.progress.stop()

    def __call__(self, event: str, **kw: Any) -> None:
        import threading
        if event == "stage":
            self._stage, self._stage_t0, self._last_msg, self._eta = kw["name"], self.clock(), "", ""
            self._say(f"[bold cyan]== {kw['name']}[/]", markup=True)
            if not self.live and self._thread is None:
                self._thread = threading.Thread(target=self._heartbeat, name="scoreboard-progress", daemon=True)
                self._thread.start()
        elif event == "step":
            self._last_msg = kw["message"]
            self._say(f"   {kw['message']}")
        elif event == "retry":
            self._say(f"[yellow]   transient failure in {kw['stage']} (attempt {kw['attempt']}): "
                      f"{kw['error']}[/]", markup=True)
        elif event == "progress":
            name = kw["task"]
            self._eta = self._estimate(name, kw["done"], kw["total"], self.clock())
            self._last_msg = f"{name} {kw['done']}/{kw['total']} {kw.get('message', '')}".strip()
            if not self.live:
                if kw["done"] >= kw["total"] or self.clock() - self._last_print >= self.interval:
                    self._say(f"   {self._last_msg}" + (f" ({self._eta})" if self._eta else ""))
                return
            if name not in self.tasks:
                self.progress.start()
                self.tasks[name] = self.progress.add_task(name, total=kw["total"], eta="")
            self.progress.update(self.tasks[name], completed=kw["done"], description=f"{name}: {kw.get('message', '')}",
                                 eta=self._eta)
            if kw["done"] >= kw["total"]:
                self.progress.stop()
