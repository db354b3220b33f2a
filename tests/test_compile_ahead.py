"""The compile-ahead helper (`tapegrad._compile_ahead`): a second process that compiles PoCL's
kernels while caches are cold, and changes no result.

Each run that needs a cold start is a fresh process (PoCL reads its settings once, and the
helper starts at the first compiled build): run as a script, this file does the work of a test
there and prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _compile_ahead, _device
from tapegrad._compile_ahead import SCRATCH_BYTES, arg_specs

pytestmark = pytest.mark.skipif(
    not tg.default_device().platform_name.startswith("Portable Computing Language")
    or tg.default_device().is_gpu or not _compile_ahead.wanted(),
    reason="the helper serves PoCL's CPU device on a machine with two cores or more")


def _step() -> dict[str, Any]:
    """A small training step's loss and gradients (as hex floats, for bitwise comparison),
    with what the helper did: whether it started, how many launches it ran (waiting for one at
    most 60 s), and its process id."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 24)).astype(np.float32)
    w1 = rng.standard_normal((24, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 3)).astype(np.float32)

    def loss(tape: tg.Tape, w1: tg.Id, w2: tg.Id, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, h = tg.matmul(tape, x, w1)
        tape, h = tg.tanh(tape, h)
        tape, y = tg.matmul(tape, h, w2)
        tape, y = tg.softmax(tape, y, axis=-1)
        tape, y = tg.mul(tape, y, y)
        return tg.mean(tape, y)

    value, grads = tg.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)
    numbers = [float(v) for a in (value, *grads) for v in a.numpy().ravel()]
    ahead = tg.default_device()._ahead  # pyright: ignore[reportPrivateUsage]
    deadline = time.monotonic() + 60
    while ahead is not None and ahead.compiled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"numbers": [v.hex() for v in numbers],
            "started": ahead is not None,
            "compiled": 0 if ahead is None else ahead.compiled,
            "pid": None if ahead is None else ahead.process.pid}


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TAPEGRAD_", "POCL_", "PYOPENCL_"))}
    env.update(XDG_CACHE_HOME=str(cache), POCL_CACHE_DIR=str(cache / "pocl"), **extra)
    return env


def _run(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (no such process, or one left unreaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_cold_start_compiles_ahead_and_changes_no_bit(tmp_path: Path) -> None:
    cold = _run(_env(tmp_path / "a"))
    assert cold["started"] and cold["compiled"] >= 1
    alone = _run(_env(tmp_path / "b", TAPEGRAD_COMPILE_AHEAD="0"))
    assert not alone["started"]
    assert cold["numbers"] == alone["numbers"]
    # the helper left with the process that started it
    deadline = time.monotonic() + 10
    while not _gone(cold["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(cold["pid"])
    # caches warm: every build is read from them, and no helper starts
    warm = _run(_env(tmp_path / "a"))
    assert not warm["started"]
    assert warm["numbers"] == cold["numbers"]


def test_pocl_cache_is_empty_until_it_holds_a_program(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "pocl"))
    assert _compile_ahead.pocl_cache_empty()  # no folder yet
    (tmp_path / "pocl").mkdir()
    (tmp_path / "pocl" / "tempfile_x1").write_bytes(b"")  # PoCL's own, made at its start
    assert _compile_ahead.pocl_cache_empty()
    (tmp_path / "pocl" / "BG").mkdir()  # a program's folder
    assert not _compile_ahead.pocl_cache_empty()


def test_a_helper_that_cannot_start_leaves_the_device_without_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any) -> None:
        raise PermissionError("no new processes here")

    shared = tg.default_device()
    device = _device.Device(shared.platform_index, shared.device_index, shared.cl_device)
    monkeypatch.setattr(_device, "CompileAhead", refuse)
    assert device._may_compile_ahead()  # pyright: ignore[reportPrivateUsage]
    device._start_ahead()  # pyright: ignore[reportPrivateUsage]
    assert device._ahead is None  # pyright: ignore[reportPrivateUsage]
    assert not device._may_compile_ahead()  # pyright: ignore[reportPrivateUsage]


def test_arg_specs_name_buffers_by_bytes_and_keep_numbers() -> None:
    device = tg.default_device()
    small, large = device.allocate(256), device.allocate(SCRATCH_BYTES + 4096)
    specs = arg_specs([small, None, 3, 2.5, np.int64(7)], (0, 1))
    assert specs == [("buffer", small.size), ("null", 0), ("number", 3), ("number", 2.5),
                     ("number", 7)]
    assert specs is not None and type(specs[4][1]) is int  # a plain number, to pickle
    assert arg_specs([large, 1], (0,)) is None  # left to the device: too large to mirror
    assert arg_specs([object()], ()) is None


_KERNEL = ("__kernel void twice(__global float* x, int n) { int i = get_global_id(0); "
           "if (i < n) x[i] = 2 * x[i]; }\n"
           # a long launch (n steps that no compiler folds), to keep the worker busy
           "__kernel void spin(__global float* x, int n) { float v = x[0]; "
           "for (int i = 0; i < n; ++i) v = v * 1.0000001f + 1e-7f; x[0] = v; }\n"
           # a kernel that prints: its output must not reach the answers
           "__kernel void speak(__global float* x, int n) { if (get_global_id(0) == 0) "
           "printf(\"built 99\\n\"); }\n")


def test_worker_skips_failed_launches_warms_the_lane_and_leaves_when_its_input_closes() -> None:
    device = tg.default_device()
    answers, answering = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "tapegrad._compile_worker", str(device.platform_index),
         str(device.device_index), str(answering)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        pass_fds=(answering,), env={**os.environ, "TAPEGRAD_COMPILE_AHEAD": "0"})
    os.close(answering)
    replies = os.fdopen(answers, "rb")
    assert worker.stdin is not None
    key = ("test", "float32")
    messages = [
        ("program", key, _KERNEL, ()),
        ("launch", key, "twice", [None, "int32"], (128,), (64,),
         [("buffer", 512), ("number", 100)], True),
        ("launch", key, "no_such_kernel", [None], (64,), (64,), [("buffer", 64)], False),
        ("launch", ("unknown", "program"), "twice", [None, "int32"], (64,), (64,),
         [("buffer", 256), ("number", 64)], False),
    ]
    for message in messages:
        pickle.dump(message, worker.stdin)
    worker.stdin.flush()
    # the two that fail are skipped; the good one runs and is answered
    assert replies.readline() == b"twice\n"
    # the small one again, on the inline lane: answered by its token once done
    pickle.dump(("lane", key, 7), worker.stdin)
    worker.stdin.flush()
    assert replies.readline() == b"lane 7\n"
    # programs to build, told while a long launch runs: each said when begun and when done,
    # before the launches; one taken back before it began is dropped
    spin = ("launch", key, "spin", [None, "int32"], (1,), (1,),
            [("buffer", 4), ("number", 400_000_000)], False)
    pickle.dump(spin, worker.stdin)
    worker.stdin.flush()
    time.sleep(0.1)  # the worker is in the spin (a second or so) when the rest arrives
    speak = ("launch", key, "speak", [None, "int32"], (64,), (64,),
             [("buffer", 4), ("number", 0)], False)
    for message in [("build", ("test", "dropped"), _KERNEL + "\n", (), 8), ("cancel", 8),
                    ("build", ("test", "built"), _KERNEL + "\n\n", (), 9), speak, spin]:
        pickle.dump(message, worker.stdin)
    worker.stdin.flush()
    assert [replies.readline() for _ in range(5)] == [
        b"spin\n", b"start 9\n", b"built 9\n", b"spin\n", b"speak\n"]
    worker.stdin.close()
    assert worker.wait(timeout=30) == 0
    assert replies.read() == b""
    replies.close()


_PLUMBING = """
import os, signal, sys, time
import tapegrad as tg
from tapegrad._compile_ahead import CompileAhead
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as command-line tools set it
device = tg.default_device()
ahead = CompileAhead(device.platform_index, device.device_index)
child = os.fork()
if child == 0:  # the helper is the parent's: the child lets its pipes go, and waits nothing
    ahead.warm_lane(("core0", "float32"), 30.0)
    time.sleep(3)
    os._exit(0 if not ahead.alive else 1)
start = time.monotonic()
ahead.close()  # the helper sees its input end although the child lives
closed = time.monotonic() - start
again = CompileAhead(device.platform_index, device.device_index)
again.process.kill()
for _ in range(200):  # writes to a helper that has died: EPIPE, not SIGPIPE
    again.program(("core0", "float32"), "x" * 100_000, ())
time.sleep(0.5)
deadline = time.monotonic() + 10
while again.alive and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
with open(f"/proc/{again.process.pid}/stat") if os.path.exists(f"/proc/{again.process.pid}") \
        else open(os.devnull) as stat:
    state = (stat.read().split(")")[-1].split() or ["gone"])[0]
_, status = os.waitpid(child, 0)
print(round(closed, 2), ahead.process.returncode, again.alive, state, status)
"""


def test_helper_pipes_survive_a_fork_a_dead_helper_and_a_default_sigpipe() -> None:
    done = subprocess.run([sys.executable, "-c", _PLUMBING], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr)  # -13: killed by SIGPIPE
    closed, code, alive, state, child = done.stdout.split()
    assert float(closed) < 1.5 and code == "0"  # left on its own, not killed at the timeout
    assert alive == "False" and state == "gone"  # the dead helper reaped: no zombie left
    assert child == "0"  # the forked child's helper was not alive, and nothing waited


if __name__ == "__main__":
    print(json.dumps(_step()))
