"""The helper process of `tapegrad._compile_ahead`: `python -m tapegrad._compile_worker P D A`,
A the file descriptor it answers on.

It reads programs and launches from its stdin (pickled by the main process) and runs each
launch, newest first, on zeros, on device P:D, so that its PoCL compiles the kernel into the
disk cache both processes share. Before any launch, it builds the programs it is asked to
build (a core program, while the main process builds the other), saying when it starts and
when it is done; one taken back before it started is dropped. Asked to warm the inline lane
for a program (once the main process built it for the lane), it runs that program's small
launches the same way on the lane, PoCL's basic driver, which would otherwise compile each
kernel at its first launch there on the main process's own thread, mid-step; it answers a
line when done.

Every pointer argument is one scratch buffer, zeroed before each launch (an index read from it
is 0), at least as large as the largest buffer the launch had. It leaves when its stdin
closes, after IDLE_SECONDS without work, or if a launch runs for more than a minute; a failure
of one launch skips it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from typing import Any

import numpy as np
import pyopencl as cl

from ._compile_ahead import IDLE_SECONDS
from ._device import Device, devices

_LONGEST_LAUNCH_SECONDS = 60.0


class _Inbox:
    """What the main process told: program sources by key, and launches not yet run."""

    def __init__(self) -> None:
        self.sources: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self.launches: list[tuple[Any, ...]] = []
        # The small launches of each program (the inline lane's), and the lanes to warm.
        self.small: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        self.lanes: list[tuple[Any, ...]] = []
        self.builds: list[tuple[Any, ...]] = []  # programs to build first, in order
        self.changed = threading.Condition()

    def read(self) -> None:
        """Take messages until the pipe closes, then end the process."""
        stdin = sys.stdin.buffer
        while True:
            try:
                message = pickle.load(stdin)
            except Exception:  # EOF or a torn message: the main process left
                os._exit(0)
            with self.changed:
                if message[0] == "program":
                    self.sources[message[1]] = (message[2], message[3])
                elif message[0] == "build":
                    self.sources[message[1]] = (message[2], message[3])
                    self.builds.append(message)
                elif message[0] == "cancel":
                    self.builds = [b for b in self.builds if b[-1] != message[1]]
                elif message[0] == "lane":
                    self.lanes.append(message)
                else:
                    self.launches.append(message)
                    if message[-1]:
                        self.small.setdefault(message[1], []).append(message)
                self.changed.notify()

    def next(self) -> tuple[Any, ...]:
        """The oldest program to build, else the newest launch not yet run, else the oldest
        lane to warm; ends the process after IDLE_SECONDS without any."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.builds or self.launches or self.lanes,
                                         IDLE_SECONDS):
                os._exit(0)
            if self.builds:
                return self.builds.pop(0)
            return self.launches.pop() if self.launches else self.lanes.pop(0)


class _Runner:
    """Runs launches on zeros on one device or its inline lane, building each program once for
    each."""

    def __init__(self, device: Device, inbox: _Inbox) -> None:
        self.device = device
        self.inbox = inbox
        lane = device.inline_device or device.cl_device
        self.queues = {inline: cl.CommandQueue(device.context, on)
                       for inline, on in ((False, device.cl_device), (True, lane))}
        self.programs: dict[tuple[tuple[str, str], bool], cl.Program] = {}
        self.scratch: cl.Buffer | None = None
        self.started = 0.0  # when the launch under way began (0: none)

    def program(self, key: tuple[str, str], inline: bool) -> cl.Program:
        program = self.programs.get((key, inline))
        if program is None:
            with self.inbox.changed:
                source, options = self.inbox.sources[key]
            program = self.device.build_program(source, options, inline)
            self.programs[key, inline] = program
        return program

    def run(self, launch: tuple[Any, ...], inline: bool = False) -> None:
        _, key, name, dtypes, size, local, specs, _ = launch
        kernel = cl.Kernel(self.program(key, inline), name)
        kernel.set_scalar_arg_dtypes([None if t is None else np.dtype(t) for t in dtypes])
        need = max([v for kind, v in specs if kind == "buffer"], default=0)
        queue = self.queues[inline]
        if self.scratch is None or self.scratch.size < need:
            self.scratch = cl.Buffer(self.device.context, cl.mem_flags.READ_WRITE,
                                     max(need, 4096))
        if need:  # the queue is in order: the kernel runs after the fill
            cl.enqueue_fill_buffer(queue, self.scratch, np.zeros(1, np.uint8), 0, need)
        args = [self.scratch if kind == "buffer" else None if kind == "null" else value
                for kind, value in specs]
        kernel.set_args(*args)
        self.started = time.monotonic()
        try:
            cl.enqueue_nd_range_kernel(queue, kernel, size, local)
            queue.finish()
        finally:
            self.started = 0.0

    def warm_lane(self, key: tuple[str, str]) -> None:
        """Run program `key`'s small launches on the inline lane (each failure skipped)."""
        with self.inbox.changed:
            small = list(self.inbox.small.get(key, []))
        for launch in small:
            with contextlib.suppress(Exception):
                self.run(launch, inline=True)

    def watch(self) -> None:
        """End the process if a launch runs too long (a kernel looping on its zeros)."""
        while True:
            time.sleep(1.0)
            started = self.started
            if started and time.monotonic() - started > _LONGEST_LAUNCH_SECONDS:
                os._exit(1)


def main(argv: list[str]) -> None:
    platform_index, device_index = int(argv[0]), int(argv[1])
    global _answers
    _answers = os.fdopen(int(argv[2]), "w")
    device = next(d for d in devices()
                  if (d.platform_index, d.device_index) == (platform_index, device_index))
    inbox = _Inbox()
    runner = _Runner(device, inbox)
    # PoCL starts its compiler at its first build: paid now, while the main process has not
    # yet asked for anything.
    with contextlib.suppress(Exception):
        device.build_program("__kernel void tg_start(__global int* x) { x[0] = 0; }")
    threading.Thread(target=inbox.read, daemon=True).start()
    threading.Thread(target=runner.watch, daemon=True).start()
    while True:
        work = inbox.next()
        if work[0] == "build":
            _say(f"start {work[-1]}")
            with contextlib.suppress(Exception):  # the device's build says what failed
                runner.program(work[1], inline=False)
            answer = f"built {work[-1]}"
        elif work[0] == "lane":
            runner.warm_lane(work[1])
            answer = f"lane {work[2]}"
        else:
            try:
                runner.run(work)
            except Exception:  # the device compiles this one itself
                continue
            answer = work[2]
        _say(answer)  # a line per launch run, per lane warmed, per program built


# The pipe the main process reads answers from (its stdout is /dev/null: a kernel's printf).
_answers = sys.stdout


def _say(line: str) -> None:
    _answers.write(f"{line}\n")
    _answers.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
