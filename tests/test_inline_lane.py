"""The inline lane of a PoCL CPU device: once its programs are built (at once where its
driver shares the queue's builds in PoCL's cache, else after INLINE_AFTER small launches),
small launches run on PoCL's single-threaded basic driver, on the calling thread, while the
threaded queue is idle; the two lanes keep one order and give the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyopencl as cl
import pytest

import tapegrad as tg
from tapegrad import _device, _pocl

DEVICE = tg.default_device()
needs_lane = pytest.mark.skipif(DEVICE.inline_device is None,
                                reason="the default device has no inline lane (not PoCL's CPU)")


@pytest.fixture(autouse=True, scope="module")
def lane_off_after() -> Iterator[None]:
    """This module's tests make the lane ready; the rest of the suite runs without it
    (tests/conftest.py)."""
    yield
    DEVICE.wait_for_inline_builds()
    with DEVICE.lock:
        DEVICE.inline_ready = False
        DEVICE.small_launches = 0
        DEVICE._inline_builders.clear()  # pyright: ignore[reportPrivateUsage]


def _ready() -> None:
    """The lane ready (as after INLINE_AFTER small launches), its builds made."""
    with DEVICE.lock:
        DEVICE.note_small(_device.INLINE_AFTER)
    DEVICE.wait_for_inline_builds()
    assert DEVICE.inline_ready


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts this test's launches by lane ("inline" or "queue"), the lane ready."""
    _ready()
    counts: Counter[str] = Counter()
    enqueue = cl.enqueue_nd_range_kernel

    def counted(queue: cl.CommandQueue, kernel: cl.Kernel, *args: Any, **kwargs: Any
                ) -> cl.Event:
        counts["inline" if queue is DEVICE._inline_queue else "queue"] += 1  # pyright: ignore[reportPrivateUsage]
        return enqueue(queue, kernel, *args, **kwargs)

    DEVICE.finish()
    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", counted)
    yield counts
    DEVICE.finish()


def _tanh(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, y = tg.tanh(tape, xi)
    return tg.value(tape, y).numpy()


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, check=False)


@needs_lane
def test_the_basic_device_is_a_lane_not_a_device() -> None:
    """PoCL lists its basic driver beside the threaded one (tapegrad asks it to); tapegrad
    lists one CPU device, the threaded one, and the basic one is its lane."""
    names = [dev.name for dev in tg.devices() if dev.platform_name == DEVICE.platform_name]
    assert names == [DEVICE.name] and DEVICE.name.startswith("pthread-")
    assert DEVICE.inline_device is not None
    assert DEVICE.inline_device.name.startswith("basic-")


@needs_lane
def test_small_launches_run_inline_and_large_ones_on_the_queue(lanes: Counter[str]) -> None:
    small = np.linspace(-2, 2, 1000).astype(np.float32)
    large = np.linspace(-2, 2, 100_000).astype(np.float32)  # 400 KB, over INLINE_BYTES
    np.testing.assert_allclose(_tanh(small), np.tanh(small), rtol=1e-6)
    DEVICE.wait_for_inline_builds()  # the first may have started a program's build
    lanes.clear()
    np.testing.assert_allclose(_tanh(small), np.tanh(small), rtol=1e-6)
    assert lanes["inline"] >= 1 and lanes["queue"] == 0
    lanes.clear()
    np.testing.assert_allclose(_tanh(large), np.tanh(large), rtol=1e-6)
    assert lanes["queue"] >= 1 and lanes["inline"] == 0


@needs_lane
def test_a_small_launch_after_a_large_one_keeps_the_order(lanes: Counter[str]) -> None:
    """Reading a large launch's result, a small launch runs after it: on the queue behind it
    while it may still run, or inline once it is complete. Values as numpy's, either way."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((300, 400)).astype(np.float32)
    w = rng.standard_normal((400, 8)).astype(np.float32)
    tape = tg.Tape()
    tape, b = tg.leaf(tape, big)
    tape, wi = tg.leaf(tape, w)
    tape, h = tg.tanh(tape, b)              # large: the queue
    tape, y = tg.matmul(tape, h, wi)        # reads h (large): the queue
    tape, s = tg.sum(tape, y, axis=0)       # small, reads y: after y in either lane
    tape, z = tg.mul(tape, s, 0.5)
    expected = 0.5 * (np.tanh(big).astype(np.float64) @ w).sum(axis=0)
    np.testing.assert_allclose(tg.value(tape, z).numpy(), expected, rtol=2e-4, atol=1e-3)
    assert lanes["queue"] >= 2


@needs_lane
def test_the_queue_is_idle_after_a_finish_and_after_its_last_launch_completes() -> None:
    _ready()
    large = tg.AnyTensor.from_numpy(np.ones(100_000, np.float32))
    with DEVICE.lock:
        DEVICE.finish()
        assert DEVICE.queue_idle()
        tape, xi = tg.leaf(tg.Tape(), large)
        tape, y = tg.mul(tape, xi, 2.0)
        _ = tg.value(tape, y).buffer  # a launch on the queue
        event = DEVICE._last_event  # pyright: ignore[reportPrivateUsage]
        assert event is not None
        event.wait()
        assert DEVICE.queue_idle()
        _ = DEVICE.queue  # a user of the queue may enqueue anything: busy until a finish
        assert not DEVICE.queue_idle()
        DEVICE.finish()
        assert DEVICE.queue_idle()


# A child process's start: the default device, and its launches counted by lane (`lanes[True]`
# the inline lane's).
_COUNTED = """
import collections, glob, os
import numpy as np, pyopencl as cl, tapegrad as tg
from tapegrad import _device
device = tg.default_device()
lanes = collections.Counter()
enqueue = cl.enqueue_nd_range_kernel
def counted(queue, *rest):
    lanes[queue is device._inline_queue] += 1
    return enqueue(queue, *rest)
cl.enqueue_nd_range_kernel = counted
"""

_STEPS = _COUNTED + """
_device.INLINE_AFTER = 1  # the lane from the first small launch on
rng = np.random.default_rng(3)
p = {"w1": rng.standard_normal((12, 32)).astype(np.float32) * 0.3,
     "b1": np.zeros(32, np.float32), "w2": rng.standard_normal((32, 4)).astype(np.float32)}
x = rng.standard_normal((16, 12)).astype(np.float32)
y = rng.integers(0, 4, 16)

def loss_fn(tape, p, x, y):
    tape, h = tg.linear(tape, x, p["w1"], p["b1"])
    tape, h = tg.tanh(tape, h)
    tape, o = tg.matmul(tape, h, p["w2"])
    return tg.cross_entropy(tape, o, y)

def step(p, state, x, y):
    loss, g = tg.value_and_grad(loss_fn)(p, x, y)
    p, state = tg.optim.adam(p, g, state, lr=0.01)
    return p, state, loss

def run():
    out = []
    for fn in (step, tg.jit(step)):
        params, state = {k: tg.AnyTensor.from_numpy(v) for k, v in p.items()}, None
        for _ in range(6):
            params, state, loss = fn(params, state, x, y)
            out.append(loss.numpy().tobytes().hex())
        out += [params[k].numpy().tobytes().hex() for k in sorted(params)]
    return out

run()  # every program made and built for the lane (its builds waited for), then counted
device.wait_for_inline_builds()
lanes.clear()
out = run()
print(device.inline_ready and lanes[True] > 2 * lanes[False])
print(" ".join(out))
"""


@needs_lane
def test_both_lanes_give_the_same_bits() -> None:
    """A small model's steps, eager and jitted, with the lane (most of its launches
    inline) and without (TAPEGRAD_INLINE=0: all on the queue): the same losses and
    parameters, bit for bit."""
    # No compile-ahead helper (caches cold): it would hold the lane's builds back until it
    # has compiled their kernels, and this test counts the launches the lane took.
    with_lane = _python(_STEPS, TAPEGRAD_COMPILE_AHEAD="0")
    without = _python(_STEPS, TAPEGRAD_INLINE="0", TAPEGRAD_COMPILE_AHEAD="0")
    assert with_lane.returncode == 0, with_lane.stderr
    assert without.returncode == 0, without.stderr
    lane_on, bits_on = with_lane.stdout.split("\n")[:2]
    lane_off, bits_off = without.stdout.split("\n")[:2]
    assert (lane_on, lane_off) == ("True", "False")
    assert bits_on == bits_off
    assert len(bits_on.split()) == 2 * 6 + 2 * 3


_SHARED = _COUNTED + """
x = np.linspace(-1, 1, 300).astype(np.float32)
def run():
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, y = tg.tanh(tape, xi)
    tape, z = tg.sum(tape, y)
    return float(tg.value(tape, z).numpy())
first = run()  # the queue's builds and launches; the lane's builds start on a thread
device.wait_for_inline_builds()
cache = os.environ["POCL_CACHE_DIR"]
def entries(pattern):
    return sorted(glob.glob(os.path.join(cache, pattern)))
programs, objects = entries("*/*/program.bc"), entries("*/*/*/*/*.so")
queue_launches = lanes[False]
lanes.clear()
again = [run(), run()]
print(device.lane_shares_builds, device.inline_ready, device.builds, device.inline_builds,
      len(programs), programs == entries("*/*/program.bc"), objects == entries("*/*/*/*/*.so"),
      queue_launches, lanes[True], lanes[False], repr(first), repr(again[0]), repr(again[1]))
"""


@needs_lane
def test_the_lane_reads_the_queues_builds_and_runs_its_compiled_kernels(
        tmp_path: Path) -> None:
    """PoCL 3.0's two CPU drivers share their entries in PoCL's cache (`_pocl.share_builds`):
    in a fresh process with an empty cache, the lane is ready from the first program build,
    each of its builds adds no program to the cache (it reads the queue's), and its launches
    compile no kernel: the first launch of each kernel took the queue, and the lane runs
    what the queue compiled. The values are the queue's, bit for bit."""
    if not DEVICE.lane_shares_builds:
        pytest.skip("this PoCL's drivers keep their builds apart (not PoCL 3.0's wheel)")
    done = _python(_SHARED, POCL_CACHE_DIR=str(tmp_path / "pocl"), TAPEGRAD_COMPILE_AHEAD="0")
    assert done.returncode == 0, done.stderr
    (shares, ready, builds, lane_builds, programs, same_programs, same_objects, queue_launches,
     inline, queued, first, *again) = done.stdout.split()
    assert (shares, ready, same_programs, same_objects) == ("True",) * 4
    assert int(builds) >= 1 and lane_builds == builds == programs  # one entry per program
    assert int(queue_launches) >= 2 and int(inline) >= 2 and queued == "0"
    assert again == [first, first]
    np.testing.assert_allclose(float(first), float(np.tanh(np.linspace(-1, 1, 300)).sum()),
                               atol=1e-4)


@needs_lane
def test_a_kernel_takes_the_queue_until_it_ran_there(lanes: Counter[str]) -> None:
    """Where the lane shares the queue's builds, a launch takes it only once the queue ran
    the same kernel at the same sizes: the lane then runs the work-group function the queue
    compiled, and never compiles one on the user's thread."""
    if not DEVICE.lane_shares_builds:
        pytest.skip("this PoCL's drivers keep their builds apart (not PoCL 3.0's wheel)")
    x = np.linspace(-2, 2, 700).astype(np.float32)
    np.testing.assert_allclose(_tanh(x), np.tanh(x), rtol=1e-6)
    DEVICE.wait_for_inline_builds()
    with DEVICE.lock:
        DEVICE._ran.clear()  # pyright: ignore[reportPrivateUsage]
    DEVICE.finish()
    lanes.clear()
    np.testing.assert_allclose(_tanh(x), np.tanh(x), rtol=1e-6)
    DEVICE.finish()
    assert lanes["queue"] >= 1 and lanes["inline"] == 0
    lanes.clear()
    np.testing.assert_allclose(_tanh(x), np.tanh(x), rtol=1e-6)
    DEVICE.finish()
    assert lanes["inline"] >= 1 and lanes["queue"] == 0


def test_builds_are_shared_only_by_pocl_30s_drivers_named_alike() -> None:
    """`share_builds` touches nothing but the wheel's PoCL 3.0, and there only where the two
    devices' CPU was named alike and PoCL keeps its cache; on this machine's PoCL 3.0 wheel
    it is done."""
    def device(version: str, address: int) -> Any:
        return SimpleNamespace(platform=SimpleNamespace(version=version), int_ptr=address)

    assert not _pocl.share_builds(device("OpenCL 3.0 PoCL 5.0+debian", 1),
                                  device("OpenCL 3.0 PoCL 5.0+debian", 2))
    version = "OpenCL 3.0 PoCL 3.0  Linux, Release, RELOC, SPIR, LLVM 14, SLEEF, DISTRO"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_pocl._NAMED, 1, "haswell")  # pyright: ignore[reportPrivateUsage]
        assert not _pocl.share_builds(device(version, 1), device(version, 2))
    if DEVICE.inline_device is not None and ", DISTRO" in str(
            DEVICE.cl_device.platform.version) and "PoCL 3.0" in str(
            DEVICE.cl_device.platform.version):
        assert DEVICE.lane_shares_builds
        # PoCL's cache turned off: nothing to share, and the lane keeps its wait
        done = _python("import tapegrad as tg; print(tg.default_device().lane_shares_builds)",
                       POCL_KERNEL_CACHE="0")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["False"]


@needs_lane
def test_the_lane_is_off_where_the_user_says_so() -> None:
    """TAPEGRAD_INLINE=0, or POCL_DEVICES chosen by the user: no lane, and PoCL lists what
    the user's variable says. A child of a process that asked for the lane, with
    TAPEGRAD_INLINE=0, takes tapegrad's POCL_DEVICES back."""
    code = ("import tapegrad as tg; d = tg.default_device(); "
            "print(d.inline_device is None, [x.name.split('-')[0] for x in tg.devices()])")
    assert os.environ.get("POCL_DEVICES") == "pthread basic"  # this process asked for it
    for env in ({"TAPEGRAD_INLINE": "0"},
                {"POCL_DEVICES": "pthread", "TAPEGRAD_SET_POCL_DEVICES": ""}):
        done = _python(code, **env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[0] == "True ['pthread']", (env, done.stdout)


@needs_lane
def test_a_replayed_program_runs_its_small_launches_inline(lanes: Counter[str]) -> None:
    """A jitted step of small tensors: its program's launches have inline twins (its
    description says so), and a replay on an idle queue enqueues nothing on the queue."""
    def f(x: Any) -> Any:
        tape = tg.Tape()
        tape, xi = tg.leaf(tape, x)
        tape, y = tg.tanh(tape, xi)
        tape, z = tg.sum(tape, y)
        return tg.value(tape, z)

    step = tg.jit(f)
    x = np.linspace(-1, 1, 500).astype(np.float32)
    step(x)
    DEVICE.wait_for_inline_builds()  # a program's build for the lane the call started
    for _ in range(3):
        assert abs(float(step(x).numpy()) - float(np.tanh(x).sum())) < 1e-3
    assert "(inline lane)" in step.describe()
    DEVICE.finish()
    lanes.clear()
    step(x)
    assert lanes["inline"] >= 1 and lanes["queue"] == 0


def test_inline_bytes_bounds_what_runs_inline() -> None:
    """The lane's size test reads each buffer argument's size."""
    class Buffer:
        def __init__(self, size: int) -> None:
            self.size = size

    small, large = Buffer(_device.INLINE_BYTES), Buffer(_device.INLINE_BYTES + 1)
    assert _device._touches_little((small, 3, None), (0, 2), _device.INLINE_BYTES)  # pyright: ignore[reportPrivateUsage]
    assert not _device._touches_little((small, large), (0, 1), _device.INLINE_BYTES)  # pyright: ignore[reportPrivateUsage]


@needs_lane
# 4 KB each (the lane); 400 KB (the queue); exactly INLINE_BYTES of data (the lane, though
# the pool rounds those buffers up past it)
@pytest.mark.parametrize("size", [1000, 100_000, _device.INLINE_BYTES // 4])
def test_an_update_takes_the_lane_its_parameters_bytes_give(lanes: Counter[str],
                                                            size: int) -> None:
    """An optimizer tells the device the most bytes its launch's buffers hold (no size asked
    per buffer): the lane is the one the parameters' bytes give. Values as Adam's first
    step."""
    params = {"a": np.full(size, 1.0, np.float32), "b": np.full(size, -1.0, np.float32)}
    grads = {"a": np.full(size, 0.5, np.float32), "b": np.full(size, -2.0, np.float32)}
    args = [tg.tree_map(tg.AnyTensor.from_numpy, tree) for tree in (params, grads)]
    tg.optim.adam(args[0], args[1], None, lr=0.1)  # the optimizers' program built first
    DEVICE.wait_for_inline_builds()
    DEVICE.finish()
    lanes.clear()
    new, _ = tg.optim.adam(args[0], args[1], None, lr=0.1)
    DEVICE.finish()
    small = size * 4 <= _device.INLINE_BYTES
    assert lanes == Counter({"inline" if small else "queue": 1})
    np.testing.assert_allclose(new["a"].numpy(), 0.9, rtol=1e-6)
    np.testing.assert_allclose(new["b"].numpy(), -0.9, rtol=1e-6)


@needs_lane
def test_the_users_warnings_show_while_the_lane_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane's builds run on a thread of their own; warnings.catch_warnings there would
    set every thread's filters, and a jitted step's JitWarning went unseen while it built."""
    started, release = threading.Event(), threading.Event()

    class SlowProgram:
        def __init__(self, context: cl.Context, source: str) -> None:
            pass

        def build(self, options: Any = (), devices: Any = None) -> None:
            started.set()
            release.wait(30)
            raise cl.Error("the test's build")  # dropped: its kernels keep the queue

    monkeypatch.setattr(cl, "Program", SlowProgram)
    key = ("test", "float32")
    monkeypatch.setitem(DEVICE._sources, key, ("", ()))  # pyright: ignore[reportPrivateUsage]
    try:
        with warnings.catch_warnings(record=True) as caught:  # as pytest.warns, first
            warnings.simplefilter("always")
            with DEVICE.lock:
                DEVICE._build_inline([key])  # pyright: ignore[reportPrivateUsage]
            assert started.wait(30)
            warnings.warn("seen", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["seen"]
    finally:
        release.set()
        DEVICE.wait_for_inline_builds()
    assert DEVICE._inline_programs.pop(key) is None  # pyright: ignore[reportPrivateUsage]


@needs_lane
def test_a_read_from_an_idle_queue_copies_on_the_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing left on the queue, a host read is the lane's copy, on this thread; and a
    finish has nothing to wait for."""
    _ready()
    DEVICE.finish()
    copies: list[bool] = []
    copy = cl.enqueue_copy

    def recorded(queue: cl.CommandQueue, *args: Any, **kwargs: Any) -> cl.Event:
        copies.append(queue is DEVICE._inline_queue)  # pyright: ignore[reportPrivateUsage]
        return copy(queue, *args, **kwargs)

    monkeypatch.setattr(cl, "enqueue_copy", recorded)
    x = np.linspace(-1, 1, 300).astype(np.float32)
    np.testing.assert_allclose(_tanh(x), np.tanh(x), rtol=1e-6)
    assert copies == [True]
    finishes: list[cl.CommandQueue] = []

    def finish(queue: cl.CommandQueue) -> None:
        finishes.append(queue)

    monkeypatch.setattr(cl.CommandQueue, "finish", finish)
    DEVICE.finish()
    assert finishes == []


def test_the_lane_pairs_pocls_two_cpu_drivers_only() -> None:
    """PoCL's threaded device and its basic one are paired; a platform of another vendor, or
    PoCL listing one driver only (a user's POCL_DEVICES), is left as it is."""
    def device(name: str, platform: str = "Portable Computing Language") -> Any:
        return SimpleNamespace(name=f"{name}-a CPU", platform=SimpleNamespace(name=platform))

    threaded, basic = device("pthread"), device("basic")
    assert _device._inline_lane([basic, threaded]) == (threaded, basic)  # pyright: ignore[reportPrivateUsage]
    assert _device._inline_lane([threaded]) is None  # pyright: ignore[reportPrivateUsage]
    assert _device._inline_lane([basic]) is None  # pyright: ignore[reportPrivateUsage]
    other = [device("pthread", "a vendor"), device("basic", "a vendor")]
    assert _device._inline_lane(other) is None  # pyright: ignore[reportPrivateUsage]


@needs_lane
def test_launches_reading_a_large_buffer_through_small_views_run_inline(
        lanes: Counter[str]) -> None:
    """A jitted step over x[:, t] of a large input (640 KiB, over INLINE_BYTES) for a few t:
    each fused kernel and gather touches a step's 16 KiB of it, so the replay runs them all
    on the lane, as it would for a small input (its lane chosen by the bytes a launch touches,
    not by the size of the buffers it names)."""
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((64, 40, 64)).astype(np.float32)
    w0 = rng.standard_normal((64, 8)).astype(np.float32)

    def f(x: Any, w: Any) -> Any:
        tape = tg.Tape()
        tape, xi = tg.leaf(tape, x)
        tape, wi = tg.leaf(tape, w)
        total: tg.Id | None = None
        for t in range(3):
            tape, xt = tg.slice(tape, xi, np.s_[:, t])
            tape, y = tg.mul(tape, xt, 2.0)
            tape, y = tg.add(tape, y, 1.0)
            tape, z = tg.matmul(tape, y, wi)
            tape, zt = tg.transpose(tape, z)
            if total is None:
                total = zt
            else:
                tape, total = tg.add(tape, total, zt)
        assert total is not None
        return tg.value(tape, total)

    step = tg.jit(f)
    x, w = tg.AnyTensor.from_numpy(x0), tg.AnyTensor.from_numpy(w0)
    step(x, w)
    DEVICE.wait_for_inline_builds()  # a program's build for the lane the call started
    want = sum(((x0[:, t] * 2 + 1).astype(np.float64) @ w0).T for t in range(3))
    for _ in range(3):
        np.testing.assert_allclose(step(x, w).numpy(), want, rtol=1e-4, atol=1e-4)
    DEVICE.finish()
    lanes.clear()
    step(x, w)
    DEVICE.finish()
    assert lanes["inline"] >= 4 and lanes["queue"] == 0, lanes
