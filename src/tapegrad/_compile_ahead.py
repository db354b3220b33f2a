"""A second process that compiles PoCL's kernels ahead of the device's own worker, when its
caches are cold.

PoCL compiles a CPU kernel's work-group function at the kernel's first launch for each local
size (its "code generation", an external `ld` among it), on the worker thread that runs it,
and under one compiler lock per process: a first training step or a first `tg.jit` call with
empty caches spends most of its time there, on one core, while the others wait. The
enqueuing thread has usually enqueued the whole step long before (docs/BENCHMARKS.md,
session 34).

A helper process (`tapegrad._compile_worker`) sharing PoCL's disk cache takes the same
launches, newest first, and runs each on scratch buffers of zeros: its PoCL compiles the
kernel and writes it to the cache, where the device's worker finds it when it comes to it
(PoCL writes an entry whole or not at all). The two meet in the middle. Nothing the helper
computes is read; results and their bits are the device's own. A kernel the helper has not
reached yet, or that failed there, the device compiles itself, as without it.

Program builds are shared too: at the device's first build of one of a dtype's two core
programs the helper builds the other (`CompileAhead.build`), and the device then waits for it
and reads it from the cache (`await_build`), or takes it back if the helper has not begun.

The helper starts when the device's context is made with PoCL's cache empty
(`pocl_cache_empty`), or else at the first program build that compiled (that added an entry
to PoCL's cache: `pocl_cache_stamp`; caches warm: never), and leaves once idle; it runs only
for PoCL CPU devices with two cores or more, PoCL's kernel cache on, and
TAPEGRAD_COMPILE_AHEAD not "0".
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyopencl as cl

# PoCL specializes a work-group function to grids whose every dimension is below this.
SMALL_GRID = 65535

# Buffers the helper's scratch may hold at most: a launch over a larger one is left to the
# device (its compile is a small part of its run).
SCRATCH_BYTES = 256 << 20

# The helper leaves after this long without work.
IDLE_SECONDS = 20.0

ENV = "TAPEGRAD_COMPILE_AHEAD"

# An argument of a launch as the helper makes it: a buffer of so many bytes, a null pointer,
# or a number.
ArgSpec = tuple[str, Any]


def wanted() -> bool:
    """Whether this process may start a helper at all (the device asks the rest: its kind,
    and whether it is one of several ranks, `_device.launched_size`)."""
    if os.environ.get(ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    if getattr(sys, "frozen", False) or not sys.executable:
        return False  # a bundled app's executable is the app, not a Python to run -m with
    if os.environ.get("POCL_KERNEL_CACHE", "1").strip() == "0":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2


def _pocl_cache_root() -> str:
    """Where PoCL 3.0 keeps its disk cache: POCL_CACHE_DIR, else XDG_CACHE_HOME/pocl/kcache,
    else ~/.cache/pocl/kcache. A program's entry is a folder two levels down (its hash split
    after two letters); PoCL's own temporary files lie at the top."""
    return os.environ.get("POCL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pocl", "kcache")


def pocl_cache_stamp() -> dict[str, int]:
    """The top folders of PoCL's disk cache and when each last changed: a build that adds a
    program's entry (a build that compiled) changes it."""
    try:
        with os.scandir(_pocl_cache_root()) as entries:
            return {entry.name: entry.stat().st_mtime_ns for entry in entries
                    if entry.is_dir()}
    except OSError:
        return {}


def pocl_cache_empty() -> bool:
    """Whether PoCL's disk cache holds no program yet: a first run on this machine, whose
    every build compiles."""
    return not pocl_cache_stamp()


def arg_specs(args: Sequence[Any], pointers: tuple[int, ...]) -> list[ArgSpec] | None:
    """How the helper makes `args`: buffers by their bytes, numbers as they are; None where a
    buffer is larger than SCRATCH_BYTES or an argument is of another kind."""
    specs: list[ArgSpec] = []
    for i, a in enumerate(args):
        if i in pointers:
            if a is None:
                specs.append(("null", 0))
                continue
            size = getattr(a, "size", None)
            if not isinstance(size, int) or size > SCRATCH_BYTES:
                return None
            specs.append(("buffer", size))
        elif isinstance(a, (int, float)):
            specs.append(("number", a))
        else:
            item = getattr(a, "item", None)  # a numpy scalar
            if item is None:
                return None
            specs.append(("number", item()))
    return specs


class CompileAhead:
    """The main process's end of one helper. Programs and first launches are told to it over
    its stdin by a thread of this end (a write never holds up a launch); it answers a line
    per launch it ran (counted in `compiled`), per lane warmed and per program built, on a pipe
    of its own (its stdout is where PoCL's kernels would printf)."""

    def __init__(self, platform_index: int, device_index: int) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env[ENV] = "0"  # the helper starts none of its own
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root, *filter(None, [env.get("PYTHONPATH")])])
        answers, answering = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tapegrad._compile_worker", str(platform_index),
                 str(device_index), str(answering)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(answering,), env=env)
        except BaseException:
            os.close(answers)
            raise
        finally:
            os.close(answering)
        self._answers_from = os.fdopen(answers, "rb")
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._told: set[tuple[Any, ...]] = set()
        self.alive = True
        self.compiled = 0  # launches the helper ran (its PoCL compiled those not cached)
        self._lock = threading.Lock()
        # The helper's answers awaited, by token: lanes to warm and programs to build.
        self._answers: list[threading.Event] = []
        self._started: set[int] = set()  # the programs it began to build
        self._building: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {}
        for target in (self._write, self._read):
            threading.Thread(target=target, name="tapegrad compile ahead", daemon=True).start()
        atexit.register(self.close)
        _LIVE.add(self)

    def _write(self) -> None:
        # A write to a helper that has died is EPIPE here, never a SIGPIPE that would end the
        # process where its handler is the default (as some command-line tools set it).
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        stdin = self.process.stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):  # the helper left (idle, or failed)
            while (message := self._outbox.get()) is not None:
                pickle.dump(message, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
        self.alive = False
        with contextlib.suppress(OSError):
            stdin.close()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._answers_from:
                word, _, token = line.partition(b" ")
                with self._lock:
                    if word == b"start":
                        self._started.add(int(token))
                    elif word in (b"lane", b"built"):
                        self._answers[int(token)].set()
                    else:
                        self.compiled += 1
        with self._lock:
            self.alive = False
            for done in self._answers:  # no answer will come: nobody waits for one
                done.set()
        self._answers_from.close()
        self.process.wait()  # it has left (its end of the pipe closed): no zombie stays

    def forked(self) -> None:
        """In a child process forked from this one: the helper is the parent's. The child's
        ends of its pipes become /dev/null (so the helper sees its input end when the parent
        closes it, and whatever the child's copies of the files hold goes nowhere) and
        nothing more is sent or awaited."""
        self.alive = False
        self._lock = threading.Lock()  # another thread of the parent may have held it
        for done in self._answers:
            done.set()
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            for end in (self.process.stdin, self._answers_from):
                with contextlib.suppress(OSError, ValueError):
                    if end is not None:
                        os.dup2(devnull, end.fileno())
        finally:
            os.close(devnull)
        atexit.unregister(self.close)

    def _ask(self, message: tuple[Any, ...]) -> tuple[int, threading.Event] | None:
        """Send `message` with a token for its answer appended (None: the helper left)."""
        done = threading.Event()
        with self._lock:
            if not self.alive:
                return None
            token = len(self._answers)
            self._answers.append(done)
        self._outbox.put((*message, token))
        return token, done

    def program(self, key: tuple[str, str], source: str, options: Sequence[str]) -> None:
        """A program the device built (the helper's build reads it from PoCL's cache)."""
        self._outbox.put(("program", key, source, tuple(options)))

    def launch(self, kernel: cl.Kernel, key: tuple[str, str], types: Sequence[Any],
               size: tuple[int, ...], local: tuple[int, ...], args: Sequence[Any],
               pointers: tuple[int, ...], inline: bool) -> None:
        """A launch of `kernel` (of program `key`, its scalar argument `types`; `inline`: small
        enough for the device's inline lane): told to the helper if PoCL would compile a
        work-group function for it that no earlier one had."""
        seen = (kernel, local, max(size, default=0) < SMALL_GRID)
        if seen in self._told:
            return
        self._told.add(seen)
        if not all(size):
            return
        specs = arg_specs(args, pointers)
        if specs is None:
            return
        dtypes = [None if t is None else np.dtype(t).name for t in types]
        self._outbox.put(("launch", key, str(kernel.function_name), dtypes, size, local,
                          specs, inline))

    def warm_lane(self, key: tuple[str, str], timeout: float) -> None:
        """Have the helper run program `key`'s small launches on the inline lane (the main
        process built the program for it), and wait for it to say so, `timeout` seconds at
        most: then their first launches there find their kernels compiled."""
        asked = self._ask(("lane", key))
        if asked is not None:
            asked[1].wait(timeout)

    def build(self, key: tuple[str, str], source: Callable[[], str], options: Sequence[str]
              ) -> None:
        """Have the helper build a program the device will need (into PoCL's cache; `source`
        gives its text), before anything else it has to do, unless it was asked already;
        `await_build` then waits for it, or takes it back."""
        with self._lock:
            if key in self._building:
                return
        asked = self._ask(("build", key, source(), tuple(options)))
        if asked is not None:
            with self._lock:
                self._building[key] = (asked[0], tuple(options))

    def await_build(self, key: tuple[str, str], options: Sequence[str], timeout: float
                    ) -> None:
        """Before the device builds program `key`: if the helper is building it, wait for it
        (`timeout` seconds at most; the device's build then reads it from the cache); if it
        has not begun, take it back (the device builds it now, the helper never)."""
        with self._lock:
            asked = self._building.pop(key, None)
            if asked is None:
                return
            token, built_with = asked
            started = token in self._started
            done = self._answers[token]
        if started and built_with == tuple(options):
            done.wait(timeout)
        else:
            self._outbox.put(("cancel", token))

    def close(self) -> None:
        """End the helper (at exit, or a test's end): it leaves when its stdin closes."""
        self._outbox.put(None)
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.alive = False
        atexit.unregister(self.close)


# The helpers of this process, for a child forked from it (`CompileAhead.forked`).
_LIVE: weakref.WeakSet[CompileAhead] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ahead in list(_LIVE):
        ahead.forked()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
