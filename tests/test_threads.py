"""Threads sharing one device: independent training loops, and branches of one tape."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import tapegrad as tg
from cases import run_threads

Array = np.ndarray[tuple[int, ...], np.dtype[np.float64]]


def _train(seed: int, steps: int) -> list[Array]:
    """A few SGD steps of a small MLP with fused elementwise chains, from `seed`'s data."""
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((16, 5))
    y0 = rng.integers(0, 3, 16)
    w1, w2 = rng.standard_normal((5, 8)) * 0.5, rng.standard_normal((8, 3)) * 0.5
    params = [tg.AnyTensor.from_numpy(w1), tg.AnyTensor.from_numpy(w2)]
    for _ in range(steps):
        tape, x = tg.leaf(tg.Tape(), x0)
        tape, y = tg.leaf(tape, y0)
        tape, a = tg.leaf(tape, params[0], requires_grad=True)
        tape, b = tg.leaf(tape, params[1], requires_grad=True)
        tape, h = tg.matmul(tape, x, a)
        tape, h = tg.tanh(tape, h)
        tape, h = tg.mul(tape, h, 1.5)
        tape, h = tg.add(tape, h, 0.25)
        tape, h = tg.matmul(tape, h, b)
        tape, loss = tg.cross_entropy(tape, h, y)
        grads = tg.backward(tape, loss)
        params, _ = tg.optim.sgd(params, [grads[a], grads[b]], lr=0.1)
    return [p.numpy() for p in params]


def test_training_loops_in_threads_match_one_thread() -> None:
    want = {seed: _train(seed, 6) for seed in range(4)}
    got: dict[int, list[Array]] = {}

    def work(seed: int) -> Callable[[], None]:
        return lambda: got.__setitem__(seed, _train(seed, 6))

    run_threads([work(seed) for seed in range(4)])
    for seed in range(4):
        for g, w in zip(got[seed], want[seed], strict=True):
            np.testing.assert_array_equal(g, w)


def test_threads_branching_one_tape_get_their_own_nodes() -> None:
    data = np.arange(6.0)
    base, x = tg.leaf(tg.Tape(), data)
    results: dict[int, tuple[tg.Tape, tg.Id]] = {}

    def work(k: int) -> Callable[[], None]:
        def grow() -> None:
            tape, h = base, x
            for _ in range(50):
                tape, h = tg.add(tape, h, float(k))
            results[k] = (tape, h)
        return grow

    run_threads([work(k) for k in range(6)])
    assert len(base) == 1 and base[x].value.numpy().tolist() == data.tolist()
    for k, (tape, h) in results.items():
        assert len(tape) == 51
        assert all(tape[i].op == "add" for i in range(1, 51))
        np.testing.assert_array_equal(tg.value(tape, h).numpy(), data + 50 * k)
