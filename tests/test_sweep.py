"""The reverse sweep: shared values, wrt, unreached leaves, seeds, and no host reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyopencl as cl
import pytest

import tapegrad as tg


def test_shared_subexpression_sums_contributions() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0, 3.0]), requires_grad=True)
    tape, y = tg.mul(tape, x, x)        # x used twice by one op
    tape, z = tg.add(tape, y, x)        # and again by another
    tape, loss = tg.sum(tape, z)
    grads = tg.backward(tape, loss)
    np.testing.assert_allclose(grads[x].numpy(), 2 * np.array([1.0, 2.0, 3.0]) + 1)


def test_default_wrt_is_every_requires_grad_leaf_reached() -> None:
    tape, a = tg.leaf(tg.Tape(), np.ones(2), requires_grad=True)
    tape, b = tg.leaf(tape, np.ones(2), requires_grad=True)   # never used
    tape, c = tg.leaf(tape, np.full(2, 3.0))                  # constant
    tape, y = tg.mul(tape, a, c)
    tape, loss = tg.sum(tape, y)
    grads = tg.backward(tape, loss)
    assert set(grads) == {a}
    np.testing.assert_allclose(grads[a].numpy(), [3.0, 3.0])
    assert b not in grads


def test_a_leaf_reached_only_by_zero_cotangents_gets_zeros() -> None:
    # pow(., 0.0) and clip with lo > hi have no gradient: their VJPs give no cotangent, yet the
    # leaves behind them are reached, and get zeros as in PyTorch, also through other ops.
    tape, x = tg.leaf(tg.Tape(), np.array([0.0, 1.0, -2.0]), requires_grad=True)
    tape, w = tg.leaf(tape, np.array([1.0, 2.0, 3.0]), requires_grad=True)
    tape, z = tg.leaf(tape, np.array([4.0, 5.0, 6.0]), requires_grad=True)
    tape, e = tg.exp(tape, w)
    tape, p = tg.pow(tape, e, 0.0)         # w reaches the loss through exp, then pow: zeros
    tape, c = tg.clip(tape, x, 1.0, -1.0)  # lo > hi: hi everywhere, no gradient
    tape, zx = tg.mul(tape, z, 2.0)
    tape, zp = tg.pow(tape, z, 0.0)        # z also reached by a real cotangent: that one
    tape, s = tg.add(tape, p, c)
    tape, s = tg.add(tape, s, zx)
    tape, s = tg.add(tape, s, zp)
    tape, loss = tg.sum(tape, s)
    grads = tg.backward(tape, loss)
    assert set(grads) == {x, w, z}
    np.testing.assert_array_equal(grads[x].numpy(), np.zeros(3))
    np.testing.assert_array_equal(grads[w].numpy(), np.zeros(3))
    np.testing.assert_array_equal(grads[z].numpy(), np.full(3, 2.0))
    tape, on_tape = tg.backward_on_tape(tape, loss, [x, w, z])
    np.testing.assert_array_equal(tg.value(tape, on_tape[w]).numpy(), np.zeros(3))
    np.testing.assert_array_equal(tg.value(tape, on_tape[z]).numpy(), np.full(3, 2.0))


def test_wrt_interior_node_and_unreached_leaf_gets_zeros() -> None:
    tape, a = tg.leaf(tg.Tape(), np.array([0.5, -1.0]), requires_grad=True)
    tape, b = tg.leaf(tape, np.ones((2, 2)), requires_grad=True)
    tape, h = tg.exp(tape, a)
    tape, h2 = tg.mul(tape, h, 2.0)
    tape, loss = tg.sum(tape, h2)
    grads = tg.backward(tape, loss, wrt=[h, b, a])
    np.testing.assert_allclose(grads[h].numpy(), [2.0, 2.0])
    np.testing.assert_allclose(grads[a].numpy(), 2 * np.exp([0.5, -1.0]))
    np.testing.assert_allclose(grads[b].numpy(), np.zeros((2, 2)))
    assert list(grads) == [h, b, a]


def test_wrt_on_a_constant_leaf_works() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([2.0, 3.0]))
    tape, sq = tg.mul(tape, x, x)
    tape, y = tg.sum(tape, sq)
    np.testing.assert_allclose(tg.backward(tape, y, wrt=x)[x].numpy(), [4.0, 6.0])


def test_only_nodes_between_wrt_and_loss_are_visited(monkeypatch: pytest.MonkeyPatch) -> None:
    from tapegrad._ops import elementwise as ew

    tape, a = tg.leaf(tg.Tape(), np.ones(3), requires_grad=True)
    tape, b = tg.leaf(tape, np.ones(3), requires_grad=True)
    tape, ea = tg.exp(tape, a)
    tape, tb = tg.tanh(tape, b)
    tape, s = tg.add(tape, ea, tb)
    tape, loss = tg.sum(tape, s)
    calls: list[str] = []
    original = ew.TANH.vjp
    assert original is not None

    def spy(*args: Any) -> Any:
        calls.append("tanh")
        return original(*args)

    import dataclasses
    tape_nodes = tape._store.nodes  # swap in a spying copy of the node (a test-only edit)
    tape_nodes[tb.index] = tape_nodes[tb.index]._replace(prim=dataclasses.replace(ew.TANH,
                                                                                   vjp=spy))
    tg.backward(tape, loss, wrt=[a])
    assert calls == []
    tg.backward(tape, loss, wrt=[b])
    assert calls == ["tanh"]


def test_non_scalar_loss_needs_seed() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3)), requires_grad=True)
    tape, y = tg.mul(tape, x, 3.0)
    with pytest.raises(tg.ShapeError, match=r"loss has shape \(2, 3\).*seed"):
        tg.backward(tape, y)
    seed = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(tg.backward(tape, y, seed=seed)[x].numpy(), 3 * seed)
    with pytest.raises(tg.ShapeError, match="seed has shape"):
        tg.backward(tape, y, seed=np.ones(3))


def test_sweep_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    tape, x = tg.leaf(tg.Tape(), rng.standard_normal((8, 5)).astype(np.float32))
    tape, w = tg.leaf(tape, rng.standard_normal((5, 4)).astype(np.float32), requires_grad=True)
    tape, b = tg.leaf(tape, np.zeros(4, np.float32), requires_grad=True)
    tape, h = tg.matmul(tape, x, w)
    tape, h = tg.add(tape, h, b)
    tape, h = tg.relu(tape, h)
    tape, h = tg.sigmoid(tape, h)
    tape, m = tg.max(tape, h, axis=1)
    tape, loss = tg.mean(tape, m)
    tg.value(tape, loss).device.finish()

    real_copy = cl.enqueue_copy
    copies: list[str] = []

    def guarded_copy(queue: Any, dest: Any, src: Any, **kwargs: Any) -> Any:
        if isinstance(dest, np.ndarray):
            copies.append("device-to-host")
            raise AssertionError("the sweep copied device data to the host")
        return real_copy(queue, dest, src, **kwargs)

    monkeypatch.setattr(cl, "enqueue_copy", guarded_copy)
    def no_host_read(self: tg.AnyTensor) -> None:
        pytest.fail("numpy() was called during the sweep")

    monkeypatch.setattr(tg.AnyTensor, "numpy", no_host_read)
    grads = tg.backward(tape, loss)
    monkeypatch.undo()
    assert copies == [] and set(grads) == {w, b}
    assert grads[w].numpy().shape == (5, 4) and np.abs(grads[w].numpy()).sum() > 0


def test_cotangent_buffers_are_released() -> None:
    """After a sweep, only the returned gradients hold buffers: the cotangents were freed."""
    import gc
    import weakref

    tape, x = tg.leaf(tg.Tape(), np.ones(4), requires_grad=True)
    y = x
    for _ in range(5):
        tape, y = tg.exp(tape, y)
    tape, loss = tg.sum(tape, y)
    seen: list[weakref.ref[Any]] = []
    from tapegrad import _sweep

    original = _sweep._sweep

    def tracking(*args: Any) -> Any:
        out = original(*args)
        seen.extend(weakref.ref(g) for g in out.values())
        return out

    _sweep._sweep = tracking  # type: ignore[assignment]
    try:
        grads = tg.backward(tape, loss)
    finally:
        _sweep._sweep = original
    gc.collect()
    alive = [r for r in seen if r() is not None]
    assert len(alive) == 1 and alive[0]() is grads[x]


def test_integer_leaf_cannot_require_grad() -> None:
    with pytest.raises(tg.DTypeError, match="requires_grad=True needs a float"):
        tg.leaf(tg.Tape(), np.array([1, 2, 3]), requires_grad=True)


def test_integer_inputs_take_no_gradient() -> None:
    tape, labels = tg.leaf(tg.Tape(), np.array([1, 2], np.int64))
    assert labels.dtype == np.int64
    with pytest.raises(tg.DTypeError, match="expected float32 or float64"):
        tg.exp(tape, labels)
    with pytest.raises(tg.DTypeError, match="gradients exist only for float"):
        tg.backward(tape, labels, wrt=[labels])


def test_second_order_through_backward_on_tape() -> None:
    """d/dx of d/dx sum(x**3) = 6x, recorded with differentiable VJPs."""
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0]), requires_grad=True)
    tape, y = tg.pow(tape, x, 3.0)
    tape, loss = tg.sum(tape, y)
    tape, grads = tg.backward_on_tape(tape, loss, [x])
    np.testing.assert_allclose(tg.value(tape, grads[x]).numpy(), [3.0, 12.0])
    tape, total = tg.sum(tape, grads[x])
    np.testing.assert_allclose(tg.backward(tape, total, wrt=[x])[x].numpy(), [6.0, 12.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_seed_scaled_by_a_mean_is_folded_without_a_kernel(
        dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """mean's VJP scales the seed (a constant 1) by 1/n: the product is another constant, made
    with no launch, and equal to bit to the kernel's product (a seed passed as data is no
    constant, and takes the kernel)."""
    from cases import on_launch

    x0 = np.array([0.5, -1.25, 2.0], dtype)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    tape, sq = tg.mul(tape, x, x)
    tape, loss = tg.mean(tape, sq)  # sum, then mul by 1/3: not exact in binary
    folded = tg.backward(tape, loss)[x].numpy()
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tg.backward(tape, loss)
    assert "mul__bs" not in names, names  # a tensor times a number: not launched
    names.clear()
    by_kernel = tg.backward(tape, loss, seed=np.ones((), dtype))[x].numpy()
    assert "mul__bs" in names, names  # the data seed took the kernel
    np.testing.assert_array_equal(folded, by_kernel)
    third = np.asarray(1.0 / 3.0, dtype)
    np.testing.assert_array_equal(folded, (third * x0) + (third * x0))
