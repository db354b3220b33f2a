"""Comparisons, logical ops and the more elementwise ops, beyond the op table: numpy's NaN and
scalar semantics, bool results that take no gradient, every dtype, bad inputs, and where the
kernels live (a program of their own, outside the core every cold start builds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import warm_up
from tapegrad import _device, _kernels

Array = np.ndarray[Any, Any]
Out = tuple[tg.Tape, tg.Id]
Compare = Callable[[tg.Tape, Any, Any], Out]

_OPS: list[tuple[Compare, Callable[..., Any]]] = [
    (tg.greater, np.greater), (tg.greater_equal, np.greater_equal), (tg.less, np.less),
    (tg.less_equal, np.less_equal), (tg.equal, np.equal), (tg.not_equal, np.not_equal),
]
_IDS = [fn.__name__ for fn, _ in _OPS]


def _value(fn: Callable[..., Out], *operands: Any) -> Array:
    """fn over operands: arrays become ids, numbers stay numbers."""
    tape = tg.Tape()
    args: list[Any] = []
    for v in operands:
        if isinstance(v, np.ndarray):
            tape, i = tg.leaf(tape, v)
            args.append(i)
        else:
            args.append(v)
    tape, out = fn(tape, *args)
    got = tg.value(tape, out).numpy()
    assert out.dtype == np.bool_ and got.dtype == np.bool_
    return got


# --- numpy's semantics --------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "ref"), _OPS, ids=_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_compares_false_except_not_equal(fn: Compare, ref: Callable[..., Any],
                                             dtype: Any) -> None:
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 0.0, np.inf], dtype)
    b = np.array([1.0, np.nan, np.nan, -np.inf, -0.0, 1e30], dtype)
    got = _value(fn, a, b)
    np.testing.assert_array_equal(got, ref(a, b))
    assert got[:3].all() if fn is tg.not_equal else not got[:3].any()


@pytest.mark.parametrize(("fn", "ref"), _OPS, ids=_IDS)
def test_python_numbers_on_either_side_keep_the_dtype(fn: Compare,
                                                      ref: Callable[..., Any]) -> None:
    # 0.1 is rounded to float32 first, as numpy's weak scalars (and PyTorch's): equal to x[0].
    x = np.array([0.1, 0.2, -1.0, np.nan], np.float32)
    for c in (0.1, 1, True, -1, 1e40):
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(_value(fn, x, c), ref(x, c), err_msg=f"x op {c}")
            np.testing.assert_array_equal(_value(fn, c, x), ref(c, x), err_msg=f"{c} op x")


@pytest.mark.parametrize(("fn", "ref"), _OPS, ids=_IDS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_int_and_bool_ids_compare_as_numpy(fn: Compare, ref: Callable[..., Any],
                                           dtype: Any) -> None:
    a = np.array([[0, 1, 5, -3]]).astype(dtype)
    b = np.array([[1], [0], [5]]).astype(dtype)
    np.testing.assert_array_equal(_value(fn, a, b), ref(a, b))  # broadcast to (3, 4)
    # A float number compares with the values in double (numpy); an int beyond int64's range
    # with every value on one side of it; a bool as 0 or 1.
    for c in (0.5, 5.0, -2.5, float("nan"), float("inf"), 2 ** 40, -(2 ** 70), True, 3):
        want_right = ref(a.astype(object), c).astype(bool) if isinstance(c, int) else ref(a, c)
        want_left = ref(c, a.astype(object)).astype(bool) if isinstance(c, int) else ref(c, a)
        np.testing.assert_array_equal(_value(fn, a, c), want_right, err_msg=f"x op {c!r}")
        np.testing.assert_array_equal(_value(fn, c, a), want_left, err_msg=f"{c!r} op x")


def test_int64_beyond_double_precision_compares_exactly_with_ints() -> None:
    big = 2 ** 53 + 1
    x = np.array([big, big - 1], np.int64)
    np.testing.assert_array_equal(_value(tg.equal, x, big), [True, False])
    np.testing.assert_array_equal(_value(tg.greater, x, 2 ** 53), [True, False])


def test_broadcasting_and_empty_shapes() -> None:
    a = np.arange(6.0).reshape(2, 1, 3)
    b = np.array([[1.0], [4.0]])
    got = _value(tg.greater_equal, a, b)
    assert got.shape == (2, 2, 3)
    np.testing.assert_array_equal(got, a >= b)
    assert _value(tg.less, np.zeros((0, 3)), 1.0).shape == (0, 3)
    assert _value(tg.logical_not, np.zeros((0,), np.bool_)).shape == (0,)


def test_logical_ops_over_bool_ids_and_python_bools() -> None:
    p = np.array([True, False, True, False])
    q = np.array([[True], [False]])
    np.testing.assert_array_equal(_value(tg.logical_and, p, q), p & q)
    np.testing.assert_array_equal(_value(tg.logical_or, p, q), p | q)
    np.testing.assert_array_equal(_value(tg.logical_not, q), ~q)
    for c in (True, False, np.bool_(True)):
        np.testing.assert_array_equal(_value(tg.logical_and, p, c), p & bool(c))
        np.testing.assert_array_equal(_value(tg.logical_or, c, p), p | bool(c))


# --- no gradient --------------------------------------------------------------------------


def test_a_mask_takes_no_gradient_and_where_passes_it_through_its_branches() -> None:
    xs = np.array([-2.0, -0.5, 0.5, 3.0])
    tape, x = tg.leaf(tg.Tape(), xs, requires_grad=True)
    tape, m = tg.greater(tape, x, 0.0)
    tape, inner = tg.less(tape, x, 2.0)
    tape, m = tg.logical_and(tape, m, inner)
    assert not tape[m].requires_grad and m.dtype == np.bool_
    tape, sq = tg.mul(tape, x, x)
    tape, y = tg.where(tape, m, sq, x)  # x^2 on (0, 2), x elsewhere
    tape, loss = tg.sum(tape, y)
    np.testing.assert_allclose(tg.backward(tape, loss)[x].numpy(), [1.0, 1.0, 1.0, 1.0])
    tape, grads = tg.backward_on_tape(tape, loss, [x])  # recorded: differentiable again
    np.testing.assert_allclose(tg.value(tape, grads[x]).numpy(), [1.0, 1.0, 1.0, 1.0])
    tape, s = tg.sum(tape, grads[x])
    np.testing.assert_allclose(tg.backward(tape, s, wrt=[x])[x].numpy(), [0.0, 0.0, 2.0, 0.0])


def test_a_mask_alone_is_not_a_loss_and_reaches_no_leaf() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3), requires_grad=True)
    tape, m = tg.equal(tape, x, 1.0)
    tape, f = tg.astype(tape, m, np.float64)
    tape, s = tg.sum(tape, f)
    assert not tape[s].requires_grad
    assert len(tg.backward(tape, s)) == 0


def test_comparisons_of_pending_values_and_their_reuse_in_fused_chains() -> None:
    """A comparison reads its operands computed (it never joins a fused DAG); values around it
    still fuse, and repeated steps build nothing new."""
    device = tg.default_device()
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, 300)).astype(np.float32)

    def step() -> Array:
        tape, x = tg.leaf(tg.Tape(), xs, requires_grad=True)
        tape, y = tg.mul(tape, x, 2.0)
        tape, y = tg.add(tape, y, 1.0)  # pending
        tape, m = tg.greater(tape, y, 0.0)
        tape, z = tg.where(tape, m, y, 0.0)
        tape, z = tg.mul(tape, z, z)
        tape, loss = tg.sum(tape, z)
        return tg.backward(tape, loss)[x].numpy()

    warm_up(device, step)
    before = device.builds
    got = step()
    assert device.builds == before
    y = xs * 2.0 + 1.0
    np.testing.assert_allclose(got, np.where(y > 0, 4.0 * y, 0.0), rtol=1e-6)


# --- the more elementwise ops at their edges -----------------------------------------------


def _grad(fn: Callable[[tg.Tape, tg.Id], Out], xs: Array) -> tuple[Array, Array]:
    tape, x = tg.leaf(tg.Tape(), xs, requires_grad=True)
    tape, y = fn(tape, x)
    tape, loss = tg.sum(tape, y)
    return tg.value(tape, y).numpy(), tg.backward(tape, loss)[x].numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_leaky_relu_and_elu_at_zero_and_nan(dtype: Any) -> None:
    xs = np.array([-1.0, -0.0, 0.0, 2.0, np.nan], dtype)
    y, g = _grad(lambda t, x: tg.leaky_relu(t, x, 0.1), xs)
    np.testing.assert_array_equal(g, np.array([0.1, 0.1, 0.1, 1.0, 0.1], dtype))
    assert np.signbit(y[1]) and np.isnan(y[4])
    y, g = _grad(lambda t, x: tg.elu(t, x, alpha=2.0), xs)
    np.testing.assert_allclose(g, np.array([2.0 * np.exp(-1.0), 2.0, 2.0, 1.0, np.nan], dtype),
                               rtol=1e-6)
    assert np.signbit(y[1]) and np.isnan(y[4])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softplus_is_x_above_the_threshold_and_stable_below(dtype: Any) -> None:
    xs = np.array([-1000.0, -30.0, 0.0, 20.0, 20.5, 1000.0], dtype)
    y, g = _grad(tg.softplus, xs)
    with np.errstate(over="ignore"):
        want = np.where(xs > 20, xs, np.log1p(np.exp(xs.astype(np.float64))))
        sigmoid = 1.0 / (1.0 + np.exp(-xs.astype(np.float64)))
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(g, sigmoid, rtol=1e-6)
    assert np.isfinite(y).all() and np.isfinite(g).all()


def test_small_arguments_keep_their_digits() -> None:
    xs = np.array([1e-10, -1e-12, 1e-30], np.float32)
    np.testing.assert_allclose(_grad(tg.log1p, xs)[0], np.log1p(xs), rtol=1e-6)
    np.testing.assert_allclose(_grad(tg.expm1, xs)[0], np.expm1(xs), rtol=1e-6)


def test_the_rare_transcendentals_build_outside_the_core_program() -> None:
    """softplus, silu, elu, log1p, expm1, sin, cos and erf (and their fused VJPs) are a program
    of their own: every cold start builds the core, and they would lengthen its build."""
    core = _device.core_source(np.dtype(np.float32))
    for name in ("softplus", "softplus_grad", "silu", "silu_grad", "elu", "elu_grad", "log1p",
                 "expm1", "sin", "cos", "erf"):
        assert _kernels._EXPRESSIONS[name].family == _kernels.RARE_FAMILY
        assert f"void {name}__b" not in core
    assert "void leaky_relu__bs" in core  # cheap: it stays in the core and fuses
    assert "void greater__" not in core


# --- bad inputs -----------------------------------------------------------------------------


def test_comparison_errors_name_op_argument_and_dtypes() -> None:
    tape, f32 = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape, f64 = tg.leaf(tape, np.ones(3))
    tape, i64 = tg.leaf(tape, np.ones(3, np.int64))
    tape, flags = tg.leaf(tape, np.ones(3, np.bool_))
    tape, wide = tg.leaf(tape, np.ones(4, np.float32))
    n = len(tape)
    with pytest.raises(tg.DTypeError, match=r"greater: operands have different dtypes \(a is "
                       r"float32, b is float64\).*tg.astype\(tape, a, np.float64\)"):
        tg.greater(tape, f32, f64)
    with pytest.raises(tg.DTypeError, match=r"less: .*a is int64, b is float32.*numpy would "
                       r"promote.*astype"):
        tg.less(tape, i64, f32)
    with pytest.raises(tg.DTypeError, match=r"equal: .*a is bool, b is int64"):
        tg.equal(tape, flags, i64)
    with pytest.raises(tg.ShapeError, match=r"not_equal: .*\(3,\).*\(4,\)"):
        tg.not_equal(tape, f32, wide)
    with pytest.raises(tg.NotAnIdError, match=r"greater_equal: a and b are all numbers"):
        tg.greater_equal(tape, 1.0, 2.0)
    with pytest.raises(tg.NotAnIdError, match=r"less_equal: argument 'b' must be an Id"):
        tg.less_equal(tape, f32, [1.0])  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.TapeError):
        tg.greater(None, f32, 1.0)  # pyright: ignore[reportArgumentType]
    assert len(tape) == n  # nothing recorded by a failed call


def test_logical_ops_refuse_non_bool_operands() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape, k = tg.leaf(tape, np.ones(3, np.int64))
    tape, p = tg.leaf(tape, np.ones(3, np.bool_))
    n = len(tape)
    with pytest.raises(tg.DTypeError, match=r"logical_and: argument 'b' has dtype float32, "
                       r"expected bool; compare first .*tg.not_equal\(tape, b, 0\)"):
        tg.logical_and(tape, p, x)
    with pytest.raises(tg.DTypeError, match=r"logical_not: argument 'x' has dtype int64, "
                       r"expected bool"):
        tg.logical_not(tape, k)
    with pytest.raises(tg.DTypeError, match=r"logical_or: argument 'a' must be an Id of dtype "
                       r"bool or a Python bool, not int"):
        tg.logical_or(tape, 1, p)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.NotAnIdError, match=r"logical_or: a and b are all numbers"):
        tg.logical_or(tape, True, False)
    assert len(tape) == n


def test_more_elementwise_errors() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape, k = tg.leaf(tape, np.ones(3, np.int64))
    n = len(tape)
    for fn in (tg.softplus, tg.silu, tg.log1p, tg.expm1, tg.sin, tg.cos, tg.erf, tg.leaky_relu,
               tg.elu):
        with pytest.raises(tg.DTypeError, match=rf"{fn.__name__}: .*int64.*float32 or float64"):
            fn(tape, k)
    with pytest.raises(tg.DTypeError, match=r"leaky_relu: negative_slope must be a Python "
                       r"number, not str"):
        tg.leaky_relu(tape, x, "0.1")  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DTypeError, match=r"elu: alpha must be a Python number, not bool"):
        tg.elu(tape, x, alpha=True)
    with pytest.raises(tg.NotAnIdError, match=r"elu: argument 'x' must be an Id"):
        tg.elu(tape, 1.0)  # pyright: ignore[reportArgumentType]
    assert len(tape) == n
    tape, y = tg.leaky_relu(tape, x, np.float64(0.5))  # numpy numbers are numbers
    np.testing.assert_allclose(tg.value(tape, y).numpy(), np.ones(3))
