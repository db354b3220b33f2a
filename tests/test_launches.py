"""Held launches (`_device.DEFER_BYTES`): on a CPU device small launches wait and are enqueued
together; anything that uses the queue, a launch over a larger buffer, the DEFER_LAUNCHES-th
held launch and one made DEFER_SECONDS after the first enqueue them first, in order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyopencl as cl
import pytest

import tapegrad as tg
from cases import run_threads
from tapegrad import _device


@pytest.fixture
def enqueued(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The kernels enqueued, by name, in order; the device holds launches (a CPU's default
    without the inline lane, which runs small launches at once: tests/test_inline_lane.py)
    and starts with none held; no age limit (a first kernel build takes longer than it)."""
    device = tg.default_device()
    device.finish()
    monkeypatch.setattr(device, "_defers", True)
    monkeypatch.setattr(device, "inline_device", None)
    monkeypatch.setattr(_device, "DEFER_SECONDS", 60.0)
    names: list[str] = []
    enqueue = cl.enqueue_nd_range_kernel

    def counted(queue: cl.CommandQueue, kernel: cl.Kernel, *rest: Any) -> Any:
        names.append(str(kernel.function_name))
        return enqueue(queue, kernel, *rest)

    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", counted)
    yield names
    device.finish()


def _exp_chain(x: np.ndarray[Any, Any], n: int) -> tuple[tg.Tape, tg.Id]:
    """n heavy ops (each its own launch: heavy values are never pending)."""
    tape, h = tg.leaf(tg.Tape(), x)
    for _ in range(n):
        tape, h = tg.exp(tape, h)
        tape, h = tg.log(tape, h)
    return tape, h


def test_small_launches_wait_for_a_read_and_give_the_values(enqueued: list[str]) -> None:
    x = np.linspace(0.5, 2.0, 64, dtype=np.float32)
    tape, h = _exp_chain(x, 3)
    value = tg.value(tape, h)
    assert value.buffer is not None  # computed, as far as the host can tell
    assert enqueued == []  # ... by six launches held back
    got = value.numpy()  # the read enqueues them, in order, and waits
    assert enqueued == ["exp__b", "log__b"] * 3
    expected = x
    for _ in range(3):
        expected = np.log(np.exp(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_launch_over_a_large_buffer_goes_at_once_after_the_held_ones(
        forwards_at_once: None, enqueued: list[str]) -> None:
    small = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    tape, s = _exp_chain(small, 1)
    assert enqueued == []
    big_n = _device.DEFER_BYTES // 4 + 1
    tape, b = tg.leaf(tape, np.ones(big_n, np.float32))
    tape, e = tg.exp(tape, b)
    assert tg.value(tape, e).buffer is not None
    assert enqueued == ["exp__b", "log__b", "exp__b"]  # the held two first, then the large one
    tape, s_sum = tg.sum(tape, s)
    tape, e_sum = tg.sum(tape, e)
    tape, total = tg.add(tape, s_sum, e_sum)
    assert tg.value(tape, total).item() == pytest.approx(
        float(np.sum(small)) + big_n * float(np.exp(np.float32(1))), rel=1e-5)


def test_the_held_launches_go_at_the_count_and_age_limits(
        enqueued: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "DEFER_LAUNCHES", 4)
    tape, h = _exp_chain(np.ones(8, np.float32), 2)
    assert tg.value(tape, h).buffer is not None
    assert len(enqueued) == 4  # the fourth held launch enqueued all four
    monkeypatch.setattr(_device, "DEFER_LAUNCHES", 1000)
    monkeypatch.setattr(_device, "DEFER_SECONDS", 0.0)
    tape, h = tg.exp(tape, h)
    assert tg.value(tape, h).buffer is not None
    assert len(enqueued) == 4  # the first held launch has no age yet
    tape, h = tg.exp(tape, h)
    assert tg.value(tape, h).buffer is not None
    assert len(enqueued) == 6  # the next finds the first older than DEFER_SECONDS


def test_finish_and_the_queue_enqueue_the_held_launches(enqueued: list[str]) -> None:
    device = tg.default_device()
    tape, h = _exp_chain(np.ones(8, np.float32), 1)
    assert tg.value(tape, h).buffer is not None and enqueued == []
    device.finish()
    assert enqueued == ["exp__b", "log__b"]
    tape, h = tg.exp(tape, h)
    assert tg.value(tape, h).buffer is not None and len(enqueued) == 2
    assert device.queue is not None  # code that enqueues its own commands reads the queue
    assert len(enqueued) == 3


def test_threads_holding_launches_on_one_device_read_their_own_values(
        enqueued: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A read must wait for its thread's launches that another thread is enqueueing (their
    list emptied before they were all enqueued let the read go first)."""
    monkeypatch.setattr(_device, "DEFER_LAUNCHES", 3)  # releases often, by every thread
    wrong: list[tuple[int, int, float]] = []

    def work(k: int) -> Callable[[], None]:
        def steps() -> None:
            for step in range(30):  # new values each time: a stale buffer shows
                x = np.full(32, 0.1 * (k + 1) + 0.01 * step, np.float32)
                tape, h = _exp_chain(x, 4)
                got = tg.value(tape, h).numpy()
                if not np.allclose(got, x, rtol=1e-5):
                    wrong.append((k, step, float(got[0])))
        return steps

    run_threads([work(k) for k in range(4)])
    assert wrong == []


def test_another_threads_read_waits_while_the_held_launches_are_enqueued(
        enqueued: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The held list empties only once all of it is enqueued: a thread whose read took the
    queue meanwhile would have its read run before its own held kernels."""
    device = tg.default_device()
    tape, h = _exp_chain(np.ones(8, np.float32), 2)
    assert tg.value(tape, h).buffer is not None and enqueued == []  # four held
    counting = cl.enqueue_nd_range_kernel
    reader: list[threading.Thread] = []
    enqueued_when_read: list[int] = []

    def read() -> None:
        assert device.queue is not None  # as a read takes it
        enqueued_when_read.append(len(enqueued))

    def first_waits(queue: cl.CommandQueue, kernel: cl.Kernel, *rest: Any) -> Any:
        if not reader:  # another thread takes the queue while this release is under way
            reader.append(threading.Thread(target=read))
            reader[0].start()
            time.sleep(0.05)
        return counting(queue, kernel, *rest)

    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", first_waits)
    device.finish()
    reader[0].join()
    assert enqueued_when_read == [4]


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_a_held_launch_that_fails_or_is_interrupted_loses_no_other(
        enqueued: list[str], monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """An enqueue that fails at release (out of resources, say) is a DeviceError naming the
    kernel, raised at the read that released it; an interrupt there (Ctrl-C) leaves that
    launch held. Either way the launches held after it stay held, and run: a later read gives
    the right values, where emptying the list lost them (the pool's old contents read back)."""
    counting = cl.enqueue_nd_range_kernel
    fail = ["exp__b"]

    def flaky(queue: cl.CommandQueue, kernel: cl.Kernel, *rest: Any) -> Any:
        if fail and str(kernel.function_name) == fail[0]:
            fail.clear()
            if failure == "error":
                raise cl.Error("clEnqueueNDRangeKernel failed: OUT_OF_RESOURCES (simulated)")
            raise KeyboardInterrupt
        return counting(queue, kernel, *rest)

    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", flaky)
    x = np.linspace(0.1, 1.0, 64, dtype=np.float32)
    tape, i = tg.leaf(tg.Tape(), x)
    tape, a = tg.tanh(tape, i)  # heavy ops: each launched when made
    tape, b = tg.exp(tape, i)  # its enqueue fails
    tape, c = tg.log(tape, i)
    values = [tg.value(tape, n) for n in (a, b, c)]
    assert all(v.buffer is not None for v in values) and enqueued == []
    if failure == "error":
        with pytest.raises(tg.DeviceError, match="exp__b failed when enqueued"):
            values[2].numpy()
    else:
        with pytest.raises(KeyboardInterrupt):
            values[2].numpy()
    np.testing.assert_allclose(values[2].numpy(), np.log(x), rtol=1e-6)
    np.testing.assert_allclose(values[0].numpy(), np.tanh(x), rtol=1e-6)
    if failure == "interrupt":  # the interrupted launch ran at the next read
        np.testing.assert_allclose(values[1].numpy(), np.exp(x), rtol=1e-6)
        assert enqueued == ["tanh__b", "exp__b", "log__b"]
    else:  # the failed launch dropped, the one after it kept
        assert enqueued == ["tanh__b", "log__b"]
