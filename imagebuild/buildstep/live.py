"""The live build display on a terminal (``--progress tty``), drawn with rich's ``Live``.

One line per stage (done ones collapsed to their result and time), under the running stage one
line per running step with its timer and its last output lines, and a total on top::

    Building 1m42s, stage 2/3
     ✔ first     built        3.1s
     ⠹ napper    1m38s
         #5 [2/2] RUN echo start-napping-$SLEEP && sleep $SLEEP …      1m38s
            start-napping-100
            (last output 1m38s ago)
       runner    waiting

After a failure the total names the stage and says that the release was not reached
(``Failed in 3.1s at stage check (2/3); the release was not reached``), and the failed stage's line
names its step and its RUN's exit code; the step's output is in the run's error below the view.

Only ``progress.Progress`` imports this module (and hands it its model and its clock), only in
tty mode: rich costs the other commands nothing. The view is redrawn four times a second from the progress model (timers move
while a step prints nothing); the run's own log lines are printed above it.
"""

from __future__ import annotations

import logging
import re
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
MARKS = {"built": ("✔", "green"), "pulled": ("✔", "green"), "skipped": ("·", "dim"), "reused": ("·", "dim"),
         "failed": ("✘", "bold red"), "waiting": (" ", "dim"), "interrupted": ("✘", "yellow")}
SHOWN_DONE_STEPS = 2  # the last finished steps of the running stage, shown under it
SILENT_S = 10.0  # a running step silent this long gets a "last output 1m45s ago" line
_EXIT = re.compile(r"exit code: (\d+)")


class LiveView:
    def __init__(self, progress, *, clock, tail: int = 3):
        self.p = progress  # progress.Progress: its rows, their decoders, its lock
        self.clock = clock
        self.tail = tail
        self.console = Console(file=sys.stderr, force_terminal=True, highlight=False, soft_wrap=False)
        self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4,
                         transient=False, redirect_stdout=False, redirect_stderr=True)
        self._handlers: list[tuple[logging.StreamHandler, object]] = []

    def start(self) -> None:
        self.live.start()
        # the logger's handler holds the stderr it was made with: point it at the live view's proxy
        # (sys.stderr now), so the run's lines print above the view, not through it
        for h in logging.getLogger("imagebuild").handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is self.console.file:
                self._handlers.append((h, h.stream))
                h.setStream(sys.stderr)

    def stop(self) -> None:
        for h, stream in self._handlers:
            h.setStream(stream)
        self._handlers.clear()
        try:
            self.live.refresh()
        finally:
            self.live.stop()

    # drawing

    def render(self):
        with self.p.lock:
            return Group(*self._lines())

    def _lines(self) -> list[Text]:
        p = self.p
        now = time.monotonic()
        width = max(40, self.console.width)
        rows = p.rows
        stages = [r for r in rows if not r.extra]
        total = len(stages)
        current = next((i for i, r in enumerate(stages, 1) if r.state == "running"), None)
        done = sum(1 for r in stages if r.state not in ("waiting", "running"))
        head = Text()
        if p.outcome is None:
            head.append(f"Building {self.clock(p.elapsed())}", style="bold")
            head.append(f", stage {current or min(done + 1, total)}/{total}")
        else:
            failed = next((r for r in rows if r.state == "failed"), None)
            stopped = next((r for r in rows if r.state == "interrupted"), None)
            word = "Failed" if failed else ("Stopped" if p.outcome == "interrupted" else "Built")
            head.append(f"{word} in {self.clock(p.elapsed())}",
                        style="bold red" if failed else "bold")
            at = failed or stopped
            if at is not None and at.extra:  # the release step itself
                head.append(f" at the {at.name} step")
            elif at is not None:  # never "3/3 stages", which reads as all done
                head.append(f" at stage {at.name} ({stages.index(at) + 1}/{total}); the release was not reached")
            elif p.outcome == "done":
                head.append(f", {done}/{total} stages")
        out = [head]
        namew = max([len(r.name) for r in rows] + [4])
        frame = SPINNER[int(now * 8) % len(SPINNER)]
        for r in rows:
            line = Text(" ")
            if r.state == "running":
                line.append(frame, style="cyan")
                line.append(f" {r.name:<{namew}}  ", style="bold")
                line.append(self.clock(now - (r.t0 or now)), style="cyan")
                if r.label:
                    line.append(f"  {r.label}", style="dim")
                out.append(line)
                out.extend(self._steps(r, now, width))
                continue
            mark, style = MARKS.get(r.state, (" ", ""))
            line.append(mark, style=style)
            line.append(f" {r.name:<{namew}}  ")
            # once the run ended, a stage still waiting was never reached (not "waiting" for anything)
            line.append("not reached" if r.state == "waiting" and p.outcome not in (None, "done") else f"{r.state:<8}",
                        style=style)
            if r.seconds is not None and r.state in ("built", "pulled", "failed"):
                line.append(f" {self.clock(r.seconds):>7}")
            if r.note:
                line.append(f"  {r.note}", style="dim")
            if r.state == "failed" and r.decoder is not None:
                bad = r.decoder.error()
                if bad is not None:  # which step, and its RUN's exit code: its output is in the error below
                    code = _EXIT.search(bad.error or "")
                    out.append(self._fit(line, width))
                    out.append(self._fit(Text(f"     {'RUN exit ' + code.group(1) + ' at ' if code else ''}"
                                              f"#{bad.number} {' '.join(bad.name.split())}", style="red"), width))
                    continue
            out.append(self._fit(line, width))
        return out

    def _steps(self, r, now: float, width: int) -> list[Text]:
        dec = r.decoder
        if dec is None:
            return []
        out = []
        steps = [s for s in dec.order if s.shown]
        finished = [s for s in steps if s.done]
        if len(finished) > SHOWN_DONE_STEPS:
            cached = sum(1 for s in finished if s.cached)
            out.append(Text(f"     {len(finished) - SHOWN_DONE_STEPS} earlier step(s) done"
                            + (f" ({cached} cached)" if cached else ""), style="dim"))
        for s in finished[-SHOWN_DONE_STEPS:]:
            res = "CACHED" if s.cached else ("ERROR" if s.error else self.clock(s.seconds()))
            out.append(self._step_line(f"✔ #{s.number} {s.name}", res, width, "dim"))
        running = [s for s in dec.order if s.running]
        for s in running:
            label = f"{SPINNER[int(now * 8) % len(SPINNER)]} #{s.number} {s.name}"
            out.append(self._step_line(label, self.clock(s.seconds(now)), width, ""))
            if s.status:
                out.append(self._fit(Text(f"        {s.status}", style="dim"), width))
            tail = list(s.lines)
            if s.partial.strip():
                tail = (tail + [s.partial.strip()])[-self.tail:]
            out.extend(self._fit(Text(f"        {ln}", style="dim"), width) for ln in tail)
            if s.silent(now) >= SILENT_S:  # a link step prints nothing for minutes: say for how long
                out.append(self._fit(Text(f"        ({s.quiet_words(now)})", style="yellow"), width))
        return out

    def _step_line(self, label: str, right: str, width: int, style: str) -> Text:
        room = width - len(right) - 8
        label = " ".join(label.split())
        if len(label) > room:
            label = label[: max(1, room - 1)] + "…"
        t = Text("     ")
        t.append(f"{label:<{room}}", style=style)
        t.append(f"  {right}", style="cyan" if not style else style)
        return t

    @staticmethod
    def _fit(t: Text, width: int) -> Text:
        t.truncate(width, overflow="ellipsis")
        t.no_wrap = True
        return t
