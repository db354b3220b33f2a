"""Deferred forwards (`_tape.defers`): an op checks its rule and appends its node; its kernels
run when the value is first needed, with the bits they give when run at once; a forward read
outside a sweep whose structure repeats is replayed (`tapegrad._jit.ForceReplays`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch, run_threads
from tapegrad._jit import force_replays
from tapegrad._tape import deferring

Array = np.ndarray[Any, Any]


def _mlp(tape: tg.Tape, x: tg.Id, w1: tg.Id, w2: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, h = tg.matmul(tape, x, w1)
    tape, h = tg.tanh(tape, h)
    tape, h = tg.mul(tape, h, 0.5)
    tape, h = tg.add(tape, h, 0.125)
    tape, h = tg.matmul(tape, h, w2)
    return tg.softmax(tape, h, axis=-1)


def _weights(seed: int) -> tuple[Array, Array, Array]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((6, 8)).astype(np.float32),
            rng.standard_normal((8, 16)).astype(np.float32) * 0.3,
            rng.standard_normal((16, 5)).astype(np.float32) * 0.3)


def test_an_op_runs_its_kernels_when_its_value_is_first_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x0, w10, w20 = _weights(0)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, w1 = tg.leaf(tape, w10)
    tape, w2 = tg.leaf(tape, w20)
    tape, p = _mlp(tape, x, w1, w2)
    assert names == []  # recorded, checked, nothing run
    assert tg.value(tape, p).shape == (6, 5)  # shape and dtype known without running
    got = tg.value(tape, p).numpy()
    assert names  # the read ran the forward
    with deferring(False):
        tape2, p2 = _mlp(tape, x, w1, w2)
    np.testing.assert_array_equal(got, tg.value(tape2, p2).numpy())
    h = (np.tanh(x0.astype(np.float64) @ w10) * 0.5 + 0.125) @ w20
    want = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5)


def test_a_large_op_over_computed_operands_runs_at_its_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(6)
    x0 = rng.standard_normal((300, 256)).astype(np.float32)  # 76,800 elements: past the bound
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, w = tg.leaf(tape, np.eye(256, dtype=np.float32))
    tape, big = tg.matmul(tape, x, w)
    assert names and tg.value(tape, big).thunk is None  # launched at the call
    launched = len(names)
    tape, total = tg.sum(tape, big, axis=1)  # 300 elements: deferred
    assert len(names) == launched and tg.value(tape, total).thunk is not None
    np.testing.assert_allclose(tg.value(tape, total).numpy(), x0.sum(axis=1), rtol=1e-5,
                               atol=1e-4)


def test_a_long_deferred_chain_is_forced_without_recursion() -> None:
    x0 = np.linspace(-2.0, 2.0, 16)
    tape, h = tg.leaf(tg.Tape(), x0)
    want = x0.copy()
    for _ in range(3000):  # heavy ops: each deferred on the one before
        tape, h = tg.tanh(tape, h)
        want = np.tanh(want)
    np.testing.assert_allclose(tg.value(tape, h).numpy(), want, rtol=1e-12)


def test_an_integer_op_over_host_data_runs_at_once_and_keeps_its_range() -> None:
    tape, table = tg.leaf(tg.Tape(), np.ones((3, 2), np.float32))
    tape, idx = tg.leaf(tape, np.array([[0, 5]]))
    tape, flat = tg.reshape(tape, idx, (2,))
    with pytest.raises(tg.IndexRangeError, match="take"):
        tg.take(tape, table, flat)  # checked at the call, from the reshape's known range


def test_a_deferred_value_read_by_several_threads_is_computed_once_alike() -> None:
    x0, w10, w20 = _weights(1)
    tape, x = tg.leaf(tg.Tape(), x0)
    tape, w1 = tg.leaf(tape, w10)
    tape, w2 = tg.leaf(tape, w20)
    tape, p = _mlp(tape, x, w1, w2)
    with deferring(False):
        want = tg.value(*_mlp(tape, x, w1, w2)).numpy()
    got: list[Array] = []
    run_threads([lambda: got.append(tg.value(tape, p).numpy()) for _ in range(4)])
    assert len(got) == 4
    for g in got:
        np.testing.assert_array_equal(g, want)


def _evaluate(steps: int) -> list[Array]:
    """A forward-only loop: fresh data each step, the output read to the host."""
    _, w10, w20 = _weights(2)
    rng = np.random.default_rng(3)
    w1, w2 = tg.AnyTensor(w10), tg.AnyTensor(w20)
    out: list[Array] = []
    for _ in range(steps):
        tape, x = tg.leaf(tg.Tape(), rng.standard_normal((6, 8)).astype(np.float32))
        tape, a = tg.leaf(tape, w1)
        tape, b = tg.leaf(tape, w2)
        tape, p = _mlp(tape, x, a, b)
        tape, p = tg.add(tape, p, 1.0)  # pending results of the DAG, the last read
        tape, p = tg.mul(tape, p, 2.0)
        out.append(tg.value(tape, p).numpy())
    return out


def test_a_forward_read_each_step_replays_with_the_bits_run_at_once(
        fresh_replays: None) -> None:
    with deferring(False):
        want = _evaluate(7)
    got = _evaluate(7)
    # Sightings: 1 node by node, 2 recorded, 3 compared, later ones replayed.
    assert force_replays.replays == 4
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _evaluate_scheduled(temperatures: list[float]) -> list[Array]:
    """`_evaluate` with the output divided by a temperature that follows a schedule, a number
    operand that changes every step, and a constant 0.25 that does not; plus the sum of x
    times half the temperature (a pending recipe's number)."""
    _, w10, w20 = _weights(2)
    rng = np.random.default_rng(3)
    w1, w2 = tg.AnyTensor(w10), tg.AnyTensor(w20)
    out: list[Array] = []
    for t in temperatures:
        tape, x = tg.leaf(tg.Tape(), rng.standard_normal((6, 8)).astype(np.float32))
        tape, a = tg.leaf(tape, w1)
        tape, b = tg.leaf(tape, w2)
        tape, p = _mlp(tape, x, a, b)
        tape, p = tg.div(tape, p, t)
        tape, p = tg.add(tape, p, 0.25)
        # a number in a pending recipe over a computed value (x's), which the DAG computes
        tape, xt = tg.mul(tape, x, 0.5 * t)
        tape, xt = tg.sum(tape, xt)
        tape, p = tg.add(tape, p, xt)
        out.append(tg.value(tape, p).numpy())
    return out


@pytest.mark.parametrize("temperatures", [[1.0 + 0.5 * k for k in range(8)],
                                          [1.0, 2.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0]],
                         ids=["every-step", "repeated-at-the-check"])
def test_a_forward_with_a_number_operand_on_a_schedule_replays_with_the_bits_run_at_once(
        fresh_replays: None, temperatures: list[float]) -> None:
    """A forward's number operand seen to change is a number of its program (as a sweep's):
    sighting 1 keys it by value, 2 finds it changed, 3 records, 4 checks, later ones replay
    each step's own. Where the check met the recorded number, the first sighting at another
    is checked again (a constant made of it would show only there)."""
    with deferring(False):
        want = _evaluate_scheduled(temperatures)
    got = _evaluate_scheduled(temperatures)
    again = 1 if temperatures[3] == temperatures[2] else 0
    assert force_replays.recordings == 2 + again and force_replays.replays == 4 - again
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(got[6], got[7])


def test_a_clipping_tape_an_optimizer_reads_replays_with_the_bits_run_at_once(
        fresh_replays: None) -> None:
    def train(steps: int) -> dict[str, Array]:
        rng = np.random.default_rng(4)
        params = {"w": tg.AnyTensor(rng.standard_normal((8, 4)).astype(np.float32))}
        state: Any = None
        for _ in range(steps):
            tape, w = tg.leaf(tg.Tape(), params["w"], requires_grad=True)
            tape, x = tg.leaf(tape, rng.standard_normal((5, 8)).astype(np.float32))
            tape, y = tg.matmul(tape, x, w)
            tape, loss = tg.sum(tape, y)
            g = tg.backward(tape, loss)[w]
            # Clip by the global norm on a tape of its own, read by the optimizer.
            clip, gi = tg.leaf(tg.Tape(), g)
            clip, sq = tg.mul(clip, gi, gi)
            clip, total = tg.sum(clip, sq)
            clip, norm = tg.sqrt(clip, total)
            clip, norm = tg.add(clip, norm, 1e-6)
            clip, coef = tg.div(clip, 1.0, norm)
            clip, coef = tg.minimum(clip, coef, 1.0)
            clip, coef = tg.mul(clip, coef, 0.5)
            clip, coef = tg.exp(clip, coef)
            clip, clipped = tg.mul(clip, gi, coef)
            params, state = tg.optim.sgd(params, {"w": tg.value(clip, clipped)}, state, lr=0.1)
        return {k: v.numpy() for k, v in params.items()}

    with deferring(False):
        want = train(6)
    got = train(6)
    assert force_replays.replays == 3
    np.testing.assert_array_equal(got["w"], want["w"])


def test_an_optimizer_forces_its_clipped_gradients_as_one_forward(
        fresh_replays: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients clipped by one global norm: the optimizer reads them together, so their
    deferred DAG is forced (and, repeated, replayed) once a step, not once a gradient; the
    squares of the computed gradients (pending recipes) are computed inside that program."""
    import tapegrad._tensor as tensors

    forced: list[int] = []
    forcer = tensors._forcer  # pyright: ignore[reportPrivateUsage]

    def counting(roots: Any) -> bool:
        forced.append(len(roots))
        return forcer(roots)

    def train(steps: int) -> dict[str, Array]:
        rng = np.random.default_rng(6)
        params = {k: tg.AnyTensor(rng.standard_normal(shape).astype(np.float32))
                  for k, shape in (("a", (4, 3)), ("b", (3,)), ("c", (3, 2)))}
        state: Any = None
        for _ in range(steps):
            tape = tg.Tape()
            ids: dict[str, tg.Id] = {}
            for k, v in params.items():
                tape, ids[k] = tg.leaf(tape, v, requires_grad=True)
            tape, x = tg.leaf(tape, rng.standard_normal((5, 4)).astype(np.float32))
            tape, h = tg.matmul(tape, x, ids["a"])
            tape, h = tg.add(tape, h, ids["b"])
            tape, h = tg.tanh(tape, h)
            tape, y = tg.matmul(tape, h, ids["c"])
            tape, loss = tg.sum(tape, y)
            grads = tg.backward(tape, loss)
            clip = tg.Tape()
            total: tg.Id | None = None
            gi: dict[str, tg.Id] = {}
            for k in params:
                clip, gi[k] = tg.leaf(clip, grads[ids[k]])
                clip, sq = tg.mul(clip, gi[k], gi[k])
                clip, s = tg.sum(clip, sq)
                clip, total = (clip, s) if total is None else tg.add(clip, total, s)
            assert total is not None
            clip, norm = tg.sqrt(clip, total)
            clip, coef = tg.div(clip, 0.5, norm)
            clip, coef = tg.minimum(clip, coef, 1.0)
            clipped: dict[str, tg.AnyTensor] = {}
            for k in params:
                clip, g = tg.mul(clip, gi[k], coef)
                clipped[k] = tg.value(clip, g)
            params, state = tg.optim.sgd(params, clipped, state, lr=0.1, momentum=0.9)
        return {k: v.numpy() for k, v in params.items()}

    with deferring(False):
        want = train(6)
    monkeypatch.setattr(tensors, "_forcer", counting)
    got = train(6)
    # The three clipped gradients, together, every step (the one-root calls force the loss).
    assert [n for n in forced if n > 1] == [3] * 6
    assert force_replays.replays == 3  # steps 4-6, each one program
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_roots_forced_meanwhile_leave_the_rest_to_the_forcer(fresh_replays: None) -> None:
    """Another thread may force some of the roots a reader offers before the forcer holds the
    device's lock: the forcer then computes the rest (here such a root is forced first)."""
    x0 = np.linspace(-1.0, 1.0, 16).astype(np.float32)
    for _ in range(5):
        tape, x = tg.leaf(tg.Tape(), x0)
        tape, a = tg.tanh(tape, x)
        tape, b = tg.sigmoid(tape, x)
        for _ in range(8):
            tape, b = tg.sigmoid(tape, b)
        ta, tb = tg.value(tape, a), tg.value(tape, b)
        _ = ta.buffer  # forced first, as by another thread
        force_replays([ta, tb])
        want = 1 / (1 + np.exp(-x0))
        for _ in range(8):
            want = 1 / (1 + np.exp(-want))
        np.testing.assert_allclose(tb.numpy(), want, rtol=1e-5)


def test_a_pending_operand_of_a_replayed_forward_is_computed_inside_it(
        fresh_replays: None) -> None:
    x0 = np.linspace(-1.0, 1.0, 32).astype(np.float32)
    for step in range(5):
        tape, x = tg.leaf(tg.Tape(), x0 + step)
        tape, sq = tg.mul(tape, x, x)  # over a computed leaf: a pending recipe, not deferred
        tape, h = tg.sum(tape, sq)  # deferred, over the recipe
        for _ in range(8):
            tape, h = tg.tanh(tape, h)
        got = tg.value(tape, h).numpy()
        want = np.tanh(np.sum((x0 + step) * (x0 + step), dtype=np.float32))
        for _ in range(7):
            want = np.tanh(want)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        if step >= 3:  # replayed: the square was computed by the program, not apart
            assert tg.value(tape, sq).pending is not None
    assert force_replays.replays == 2


def test_a_forward_with_a_new_dropout_seed_each_time_replays_with_its_bits(
        fresh_replays: None) -> None:
    """A dropout's seed is a number of the forward's program (as of a sweep's): each run draws
    its own masks, bitwise the forward run at once, and the third run on replays."""
    x0 = np.linspace(-1.0, 1.0, 64)

    def run(seed: int) -> Array:
        tape, h = tg.leaf(tg.Tape(), x0)
        for k in range(4):
            tape, h = tg.tanh(tape, h)
            tape, h = tg.dropout(tape, h, 0.5, seed=seed + 1000 * k)
        return tg.value(tape, h).numpy()

    got = [run(seed) for seed in range(6)]
    assert force_replays.replays == 3
    with deferring(False):
        for seed, g in enumerate(got):
            np.testing.assert_array_equal(g, run(seed))
    assert not np.array_equal(got[4], got[5])


def test_a_max_pool_of_the_input_replays_its_sweeps_with_the_bits_run_at_once() -> None:
    # The pool's argmax (an integer result over float data) is deferred with the window
    # maxima it writes, which pool_gather then takes: both are computed inside a recording.
    from tapegrad._jit import sweep_replays

    def train(steps: int) -> Array:
        rng = np.random.default_rng(5)
        w = tg.AnyTensor(rng.standard_normal((32, 3)).astype(np.float32))
        for _ in range(steps):
            tape, x = tg.leaf(tg.Tape(), rng.standard_normal((4, 2, 8, 8)).astype(np.float32))
            tape, wi = tg.leaf(tape, w, requires_grad=True)
            tape, h = tg.max_pool2d(tape, x, 2)
            tape, h = tg.reshape(tape, h, (4, 32))
            tape, y = tg.matmul(tape, h, wi)
            tape, y = tg.tanh(tape, y)
            tape, loss = tg.sum(tape, y)
            g = tg.backward(tape, loss)[wi]
            # SGD written with ops: w is deferred (its sub and mul), and the next step's
            # leaf of it computes it (a leaf is an input of the sweep's program).
            tape, gi = tg.leaf(tape, g)
            tape, scaled = tg.mul(tape, gi, 0.1)
            tape, new_w = tg.sub(tape, wi, scaled)
            w = tg.value(tape, new_w)
        return w.numpy()

    with deferring(False):
        want = train(6)
    replays = sweep_replays.replays
    got = train(6)
    assert sweep_replays.replays - replays == 3
    np.testing.assert_array_equal(got, want)
