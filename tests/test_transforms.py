"""grad, value_and_grad, vjp, jacobian, hessian, hvp: values against closed forms."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import numpy as np
import pytest

import tapegrad as tg

Out = tuple[tg.Tape, tg.Id]


def cube_sum(tape: tg.Tape, x: tg.Id) -> Out:
    tape, y = tg.pow(tape, x, 3.0)
    return tg.sum(tape, y)


def test_grad_with_arrays_returns_tensors() -> None:
    x = np.array([1.0, -2.0, 0.5])
    g = tg.grad(cube_sum)(x)
    assert isinstance(g, tg.AnyTensor)
    np.testing.assert_allclose(g.numpy(), 3 * x**2)


def test_grad_argnums_and_pytrees() -> None:
    def f(tape: tg.Tape, params: dict[str, Any], x: tg.Id) -> Out:
        tape, h = tg.matmul(tape, x, params["w"])
        tape, h = tg.add(tape, h, params["b"][0])
        tape, h = tg.mul(tape, h, h)
        return tg.sum(tape, h)

    rng = np.random.default_rng(0)
    w, b, x = rng.standard_normal((3, 2)), rng.standard_normal(2), rng.standard_normal((4, 3))
    grads = tg.grad(f)({"w": w, "b": [b]}, x)
    h = x @ w + b
    np.testing.assert_allclose(grads["w"].numpy(), x.T @ (2 * h), rtol=1e-10)
    np.testing.assert_allclose(grads["b"][0].numpy(), (2 * h).sum(0), rtol=1e-10)
    both: tuple[Any, tg.AnyTensor] = tg.grad(f, argnums=(0, 1))({"w": w, "b": [b]}, x)
    assert isinstance(both, tuple)
    np.testing.assert_allclose(both[1].numpy(), (2 * h) @ w.T, rtol=1e-10)


def test_numbers_outside_argnums_reach_f_as_numbers() -> None:
    # A penalty weight and a dropout seed: as leaves they were a float32 id (a DTypeError
    # against float64 parameters) and an id dropout refused as a seed.
    def loss(tape: tg.Tape, w: tg.Id, lam: float, seed: int) -> tuple[tg.Tape, tg.Id]:
        assert type(lam) is float and type(seed) is int
        tape, d = tg.dropout(tape, w, 0.5, seed)
        tape, sq = tg.mul(tape, d, d)
        tape, sq = tg.mul(tape, sq, lam)
        return tg.sum(tape, sq)

    w = np.linspace(-1.0, 1.0, 8)  # float64
    value, g = tg.value_and_grad(loss)(w, 0.25, 3)
    kept = (g.numpy() != 0).astype(np.float64)  # dropout's mask (w has no zero)
    np.testing.assert_allclose(g.numpy(), 0.25 * 2 * (2 * kept) ** 2 * w, rtol=1e-12)
    np.testing.assert_allclose(value.numpy(), 0.25 * np.sum((2 * kept * w) ** 2), rtol=1e-12)
    with pytest.raises(tg.DTypeError, match="gradients exist only for float"):
        tg.grad(loss, argnums=(0, 2))(w, 0.25, 3)
    # numpy numbers likewise (ops take them as numbers): the same bits
    same = tg.grad(lambda t, w, lam, seed: loss(t, w, float(lam), int(seed)))(
        w, np.float32(0.25), np.int64(3))
    assert same.numpy().tobytes() == g.numpy().tobytes()


def test_grad_is_named_as_f_and_typed_reads_its_own_signature() -> None:
    def loss(tape: tg.Tape, w: tg.Id, c: float) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.mul(tape, w, c)
        return tg.sum(tape, y)

    g = tg.grad(loss)
    assert g.__name__ == "loss" and not hasattr(g, "__wrapped__")
    np.testing.assert_array_equal(tg.typed(g)(np.ones(3, np.float32), 2.0).numpy(), [2, 2, 2])


def test_value_and_grad_with_aux() -> None:
    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tuple[tg.Id, str]]:
        tape, y = cube_sum(tape, x)
        return tape, (y, "aux")

    (value, aux), g = tg.value_and_grad(f, has_aux=True)(np.array([2.0]))
    assert value.numpy() == pytest.approx(8.0) and aux == "aux"
    np.testing.assert_allclose(g.numpy(), [12.0])

    # Ids in aux come back as their values: the tape they live on is never seen by the caller.
    def g_aux(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tuple[tg.Id, Any]]:
        tape, h = tg.exp(tape, x)
        tape, s = tg.sum(tape, h)
        return tape, (s, {"h": h, "tag": ["h", h]})

    (value, aux), g = tg.value_and_grad(g_aux, has_aux=True)(np.array([0.0, 1.0]))
    np.testing.assert_allclose(aux["h"].numpy(), np.exp([0.0, 1.0]))
    assert aux["tag"][0] == "h" and isinstance(aux["tag"][1], tg.AnyTensor)
    grads, aux = tg.grad(g_aux, has_aux=True)(np.array([0.0, 1.0]))
    np.testing.assert_allclose(aux["h"].numpy(), grads.numpy())


def test_grad_nests() -> None:
    """d²/dx² x³ = 6x via tg.grad(tg.grad(f)) on a scalar."""
    def first(tape: tg.Tape, x: tg.Id) -> Out:
        tape, g = tg.grad(cube_sum)(tape, x)
        return tape, g

    np.testing.assert_allclose(tg.grad(first)(np.array(1.5)).numpy(), 9.0)


def test_grad_rejects_non_scalar() -> None:
    with pytest.raises(tg.ShapeError, match="scalar id"):
        tg.grad(tg.exp)(np.ones(3))


def test_vjp() -> None:
    def f(tape: tg.Tape, a: tg.Id, b: tg.Id) -> Out:
        return tg.mul(tape, a, b)

    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    out, fn = tg.vjp(f, a, b)
    np.testing.assert_allclose(out.numpy(), a * b)
    ga, gb = fn(np.array([1.0, 10.0]))
    np.testing.assert_allclose(ga.numpy(), [3.0, 40.0])
    np.testing.assert_allclose(gb.numpy(), [1.0, 20.0])


def test_jacobian_hessian_hvp() -> None:
    x = np.array([0.3, -0.7, 1.1])

    def f(tape: tg.Tape, x: tg.Id) -> Out:
        return tg.tanh(tape, x)

    jac = tg.jacobian(f, x).numpy()
    np.testing.assert_allclose(jac, np.diag(1 - np.tanh(x) ** 2), rtol=1e-10)

    def quad(tape: tg.Tape, x: tg.Id) -> Out:
        tape, m = tg.leaf(tape, np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 1.0]]))
        tape, mx = tg.matmul(tape, m, x)
        tape, xmx = tg.mul(tape, x, mx)
        tape, s = tg.sum(tape, xmx)
        tape, c = tg.pow(tape, x, 3.0)
        tape, cs = tg.sum(tape, c)
        return tg.add(tape, s, cs)

    m = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 1.0]])
    hess = 2 * m + np.diag(6 * x)
    np.testing.assert_allclose(tg.hessian(quad, x).numpy(), hess, rtol=1e-10)
    v = np.array([1.0, -1.0, 2.0])
    np.testing.assert_allclose(tg.hvp(quad, x, v).numpy(), hess @ v, rtol=1e-10)


def test_jacobian_hessian_hvp_also_curry_as_jax() -> None:
    # jax.jacobian(f)(x) and torch's jacobian(f, x) are both what users try first: both work,
    # with argnums choosing among several arrays (the others constants).
    x, y = np.array([0.3, -0.7]), np.array([2.0, 5.0])

    def f(tape: tg.Tape, x: tg.Id, y: tg.Id) -> Out:
        tape, xy = tg.mul(tape, x, y)
        return tg.tanh(tape, xy)

    d = 1 - np.tanh(x * y) ** 2
    np.testing.assert_allclose(tg.jacobian(f)(x, y).numpy(), np.diag(d * y), rtol=1e-12)
    np.testing.assert_allclose(tg.jacobian(f, x, y, argnums=1).numpy(), np.diag(d * x),
                               rtol=1e-12)
    np.testing.assert_allclose(tg.jacobian(f, argnums=-1)(x, y).numpy(), np.diag(d * x),
                               rtol=1e-12)

    def cubes(tape: tg.Tape, x: tg.Id) -> Out:
        tape, c = tg.pow(tape, x, 3.0)
        return tg.sum(tape, c)

    np.testing.assert_allclose(tg.hessian(cubes)(x).numpy(), np.diag(6 * x), rtol=1e-12)
    np.testing.assert_allclose(tg.hvp(cubes)(x, y).numpy(), 6 * x * y, rtol=1e-12)
    with pytest.raises(tg.DTypeError, match="jacobian: argnums must be one int"):
        tg.jacobian(f, x, y, argnums=(0, 1))  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DTypeError, match="jacobian: argument 0 must be one array, got a "
                       "dict"):
        tg.jacobian(f, {"a": x}, y)
    calls: list[int] = []

    def counted(tape: tg.Tape, x: tg.Id) -> Out:
        calls.append(1)
        return cubes(tape, x)

    # v's shape is checked before f runs (and so before any kernel).
    with pytest.raises(tg.ShapeError, match=r"hvp: v has shape \(3,\), expected x's \(2,\)"):
        tg.hvp(counted, x, np.ones(3))
    assert calls == []


def test_none_in_a_pytree_is_an_empty_subtree_as_in_jax() -> None:
    # A layer without a bias, {"w": w, "b": None}: JAX keeps the None and differentiates the
    # rest (it was a DTypeError from leaf).
    def f(tape: tg.Tape, p: dict[str, Any], x: tg.Id) -> Out:
        tape, y = tg.matmul(tape, x, p["w"])
        if p["b"] is not None:
            tape, y = tg.add(tape, y, p["b"])
        return tg.sum(tape, y)

    x = np.arange(6.0).reshape(2, 3)
    grads = tg.grad(f)({"w": np.ones((3, 2)), "b": None}, x)
    assert grads["b"] is None
    np.testing.assert_allclose(grads["w"].numpy(), np.repeat(x.sum(0)[:, None], 2, 1))
    assert tg.gradcheck(f, {"w": np.ones((3, 2)), "b": None}, x) is True


def test_jacobian_and_hessian_of_empty_shapes_are_empty() -> None:
    def none_of(tape: tg.Tape, x: tg.Id) -> Out:
        return tg.slice(tape, x, np.s_[:0])

    jac = tg.jacobian(none_of, np.ones(3))
    assert jac.shape == (0, 3) and jac.dtype == np.float64
    assert tg.jacobian(tg.exp, np.zeros(0)).shape == (0, 0)
    assert tg.hessian(tg.sum, np.zeros((0, 2), np.float32)).shape == (0, 2, 0, 2)


def test_gradcheck_takes_pytree_arguments_and_names_the_leaf() -> None:
    def f(tape: tg.Tape, p: dict[str, Any], scale: tg.Id) -> Out:
        tape, y = tg.mul(tape, p["w"], p["b"][0])
        tape, y = tg.mul(tape, y, scale)
        return tg.sum(tape, y)

    tree = {"w": np.array([1.0, 2.0]), "b": [np.array([3.0, -1.0])]}
    assert tg.gradcheck(f, tree, np.array(0.5)) is True
    wrong = tg.elementwise_op("tree_wrong_square", 1, "a * a", ["g * a"])  # should be 2 g a

    def g(tape: tg.Tape, p: dict[str, Any]) -> Out:
        tape, y = wrong(tape, p["b"])
        tape, z = tg.mul(tape, y, p["a"])
        return tg.sum(tape, z)

    with pytest.raises(tg.GradcheckError, match=r"argument 0\['b'\], element"):
        tg.gradcheck(g, {"a": np.array([1.0, 2.0]), "b": np.array([0.5, 1.5])})


def test_transforms_check_their_arguments_when_made() -> None:
    # As JAX: a transform of something that is not a function fails when made, naming it; flags
    # must be bools (a truthy string is not True); argnums must be ints.
    x = np.ones(3)
    five: Any = 5
    for op, make in (("grad", lambda: tg.grad(five)),
                     ("value_and_grad", lambda: tg.value_and_grad(five)),
                     ("vjp", lambda: tg.vjp(five, x)), ("jacobian", lambda: tg.jacobian(five, x)),
                     ("hessian", lambda: tg.hessian(five, x)), ("hvp", lambda: tg.hvp(five, x, x)),
                     ("gradcheck", lambda: tg.gradcheck(five, x))):
        with pytest.raises(tg.DTypeError, match=f"{op}: f must be a tape function"):
            make()
    with pytest.raises(tg.DTypeError, match="grad: has_aux must be True or False, got 'no'"):
        tg.grad(cube_sum, has_aux="no")  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DTypeError, match=r"argnums must be ints, got 1\.0"):
        tg.grad(cube_sum, argnums=1.0)(x)  # pyright: ignore[reportArgumentType]
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"eps": "a"}, tg.DTypeError, "eps must be a number"),
        ({"eps": -1e-6}, tg.ShapeError, "eps must be a finite number > 0"),
        ({"atol": "a"}, tg.DTypeError, "atol must be a number"),
        ({"atol": -1.0}, tg.ShapeError, "atol must be a finite number >= 0")]
    for kw, error, message in bad:
        with pytest.raises(error, match=f"gradcheck: {message}"):
            tg.gradcheck(cube_sum, x, **kw)


def test_backward_and_anomaly_flags_must_be_bools() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3), requires_grad=True)
    tape, loss = cube_sum(tape, x)
    with pytest.raises(tg.DTypeError, match="backward: check_finite must be True or False"):
        tg.backward(tape, loss, check_finite="yes")  # pyright: ignore[reportArgumentType]
    five: Any = 5
    with (pytest.raises(tg.DTypeError, match="detect_anomaly: enabled must be True or False"),
          tg.detect_anomaly(five)):
        pass


def test_value_and_grad_pauses_the_cyclic_collector_and_restores_it() -> None:
    seen: list[bool] = []

    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        seen.append(gc.isenabled())
        return tg.sum(tape, x)

    x = np.ones(3)
    assert gc.isenabled()
    tg.value_and_grad(f)(x)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ZeroDivisionError):  # restored on an error too
        tg.grad(lambda tape, x: (1 / 0, f(tape, x))[1])(x)
    assert gc.isenabled()
    gc.disable()
    try:  # a collector the user turned off stays off
        tg.grad(f)(x)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_one_call_pauses_the_collector_and_overlapping_threads_cannot_keep_it_off() -> None:
    inside = {name: threading.Event() for name in "ab"}
    leave = {name: threading.Event() for name in "ab"}

    def step(name: str) -> None:
        def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
            inside[name].set()
            leave[name].wait(timeout=30)
            return tg.sum(tape, x)

        tg.grad(f)(np.ones(2))

    first = threading.Thread(target=step, args=("a",))
    first.start()
    assert inside["a"].wait(timeout=30)
    second = threading.Thread(target=step, args=("b",))
    second.start()
    assert inside["b"].wait(timeout=30)
    assert not gc.isenabled()
    leave["a"].set()  # the call that paused it ends: it runs again, the other call or not
    first.join(timeout=30)
    assert gc.isenabled()
    leave["b"].set()
    second.join(timeout=30)
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_the_collector_back() -> None:
    inside, leave = threading.Event(), threading.Event()

    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        inside.set()
        leave.wait(timeout=30)
        return tg.sum(tape, x)

    thread = threading.Thread(target=tg.grad(f), args=(np.ones(2),))
    thread.start()
    try:
        assert inside.wait(timeout=30) and not gc.isenabled()
        child = os.fork()
        if child == 0:  # the child: its pausing thread is gone
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        leave.set()
        thread.join(timeout=30)
    assert gc.isenabled()
