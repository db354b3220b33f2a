"""Behaviour of the elem ops that the op table cannot show: ties, bounds, extreme logits,
conditions of every dtype, dtype conversions, bad labels and error messages."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch, warm_up

Array = np.ndarray[Any, Any]
Out = tuple[tg.Tape, tg.Id]


def _grads1(fn: Callable[[tg.Tape, tg.Id], Out], x: Array) -> tuple[Array, list[Array]]:
    return _grads(fn, x)


def _grads(fn: Callable[..., Out], *arrays: Array) -> tuple[Array, list[Array]]:
    """fn's value and the gradient of sum(fn) for each float input."""
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in arrays:
        tape, i = tg.leaf(tape, a, requires_grad=True)
        ids.append(i)
    tape, out = fn(tape, *ids)
    tape, loss = tg.sum(tape, out)
    grads = tg.backward(tape, loss, wrt=ids)
    return tg.value(tape, out).numpy(), [grads[i].numpy() for i in ids]


# --- maximum, minimum, abs, clip: kinks and ties ----------------------------------------------


def test_maximum_and_minimum_split_the_gradient_evenly_at_ties() -> None:
    a = np.array([1.0, 2.0, 3.0, -1.0], np.float32)
    b = np.array([1.0, 0.0, 3.0, 5.0], np.float32)
    out, (ga, gb) = _grads(tg.maximum, a, b)
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0, 5.0])
    np.testing.assert_array_equal(ga, [0.5, 1.0, 0.5, 0.0])
    np.testing.assert_array_equal(gb, [0.5, 0.0, 0.5, 1.0])
    out, (ga, gb) = _grads(tg.minimum, a, b)
    np.testing.assert_array_equal(out, [1.0, 0.0, 3.0, -1.0])
    np.testing.assert_array_equal(ga, [0.5, 0.0, 0.5, 1.0])
    np.testing.assert_array_equal(gb, [0.5, 1.0, 0.5, 0.0])


def test_maximum_ties_with_a_scalar_and_with_itself() -> None:
    x = np.array([-1.0, 0.0, 2.0])
    _, (g,) = _grads1(lambda t, i: tg.maximum(t, i, 0.0), x)
    np.testing.assert_array_equal(g, [0.0, 0.5, 1.0])
    _, (g,) = _grads1(lambda t, i: tg.maximum(t, i, i), x)  # both halves reach x
    np.testing.assert_array_equal(g, [1.0, 1.0, 1.0])


def test_maximum_broadcast_gradient_sums_back() -> None:
    a = np.array([[0.0, 5.0], [2.0, -3.0], [1.0, 1.0]])  # (3, 2)
    b = np.array([1.0, 1.0])  # (2,)
    _, (ga, gb) = _grads(tg.maximum, a, b)
    np.testing.assert_array_equal(ga, [[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])
    np.testing.assert_array_equal(gb, [1.0 + 0.0 + 0.5, 0.0 + 1.0 + 0.5])


def test_maximum_propagates_nan() -> None:
    a = np.array([np.nan, 1.0, 2.0], np.float32)
    b = np.array([0.0, np.nan, 1.0], np.float32)
    tape, x = tg.leaf(tg.Tape(), a)
    tape, y = tg.leaf(tape, b)
    for fn in (tg.maximum, tg.minimum):
        tape2, z = fn(tape, x, y)
        got = tg.value(tape2, z).numpy()
        assert np.isnan(got[:2]).all() and got[2] == (2.0 if fn is tg.maximum else 1.0)


def test_relu_keeps_a_nan_and_passes_its_gradient_as_pytorch() -> None:
    # PyTorch: relu(nan) is nan, and its backward (from the output) passes the gradient there.
    x = np.array([np.nan, -1.0, 0.0, 2.0])
    out, (g,) = _grads1(tg.relu, x)
    np.testing.assert_array_equal(out, [np.nan, 0.0, 0.0, 2.0])
    np.testing.assert_array_equal(g, [1.0, 0.0, 0.0, 1.0])
    out, _ = _grads1(tg.relu, np.array([-0.0, 0.0]))  # torch.relu(-0.0) is -0.0 too
    np.testing.assert_array_equal(np.signbit(out), [True, False])


def test_maximum_and_minimum_give_both_operands_the_gradient_at_a_nan() -> None:
    # PyTorch's rule: the result is NaN there, and neither tie nor loss masks it out.
    a, b = np.array([np.nan, 2.0, 3.0]), np.array([1.0, np.nan, 1.0])
    _, (ga, gb) = _grads(tg.maximum, a, b)
    np.testing.assert_array_equal(ga, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(gb, [1.0, 1.0, 0.0])
    _, (ga, gb) = _grads(tg.minimum, a, b)
    np.testing.assert_array_equal(ga, [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(gb, [1.0, 1.0, 1.0])


def test_pow_base_gradient_is_zero_where_an_id_exponent_is_zero() -> None:
    # b * a ** (b - 1) is 0 * inf at a = b = 0; PyTorch masks it to 0 where b == 0.
    a, b = np.array([0.0, 0.0, 2.0, 0.0]), np.array([0.0, 2.0, 0.0, 0.5])
    out, (ga, gb) = _grads(tg.pow, a, b)
    np.testing.assert_array_equal(out, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(ga, [0.0, 0.0, 0.0, np.inf])  # 0.5 * 0 ** -0.5 = inf
    np.testing.assert_array_equal(gb, [0.0, 0.0, np.log(2.0), 0.0])
    _, (gx,) = _grads1(lambda t, i: tg.pow(t, i, i), np.array([0.0, 1.0]))
    np.testing.assert_array_equal(gx, [0.0, 1.0])  # x ** x at 0: torch gives 0 too


def test_pow_with_common_exponents_is_multiplies_and_roots_with_pows_values() -> None:
    # PoCL's pow is a library call of ~70 ns an element; x ** 2, 3, 1, 0, -1, -2, 0.5, -0.5 are
    # computed without it (as PyTorch does): exactly numpy's values for 2, 1, 0, -1 and 0.5
    # (sqrt, as numpy's and PyTorch's x ** 0.5), within an ulp for the rest, special values
    # included; per-element exponents mixing them too.
    v64 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -2.0, 2.0, 1e-300, 1e300, -3.5, 0.7])
    v32 = np.tile(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -2.0, 2.0, 1e-30, 1e30, -3.5,
                            0.7], np.float32), 2)  # 16 in float32's eight-lane kernel, 6 after
    for v, rtol in ((v64, 4e-16), (v32, 2.5e-7)):
        for p in (2.0, 1.0, 0.0, -1.0, 0.5, 3.0, -2.0, -0.5, 1.7):
            out, _ = _grads1(lambda t, i, p=p: tg.pow(t, i, p), v)
            with np.errstate(all="ignore"):
                want = np.power(v, v.dtype.type(p))
            if p in (2.0, 1.0, 0.0, -1.0, 0.5):
                np.testing.assert_array_equal(out, want, err_msg=str(p))
                # signed zeros and infinities; a NaN's sign bit is the hardware's (x86 gives
                # -NaN for sqrt(-2), NVIDIA's GPUs +NaN)
                number = ~np.isnan(want)
                np.testing.assert_array_equal(np.signbit(out[number]), np.signbit(want[number]),
                                              err_msg=str(p))
            else:
                np.testing.assert_allclose(out, want, rtol=rtol, atol=0, err_msg=str(p))
    x = np.array([1.5, -2.0, 0.3, 4.0, 2.5, 9.0])
    b = np.array([2.0, 3.0, -1.0, 0.5, 1.7, -0.5])
    out, (gx, gb) = _grads(tg.pow, x, b)
    np.testing.assert_allclose(out, x**b, rtol=4e-16)
    np.testing.assert_allclose(gx, b * x ** (b - 1), rtol=4e-16)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(gb, np.where(x > 0, x**b * np.log(np.abs(x)), np.nan),
                                   rtol=1e-15)


def test_pow_exponent_gradient_at_base_zero_is_masked_only_for_exponents_from_zero() -> None:
    # PyTorch: a ** b * log(a) is masked to 0 where a == 0 and b >= 0 (0 * -inf, 1 * -inf);
    # for b < 0 it is inf * -inf = -inf. Likewise with the base a Python number.
    a, b = np.array([0.0, 0.0, 0.0, 2.0]), np.array([-1.0, 0.0, 2.0, -1.0])
    out, (_, gb) = _grads(tg.pow, a, b)
    np.testing.assert_array_equal(out, [np.inf, 1.0, 0.0, 0.5])
    np.testing.assert_array_equal(gb, [-np.inf, 0.0, 0.0, 0.5 * np.log(2.0)])
    _, (gx,) = _grads1(lambda t, i: tg.pow(t, 0.0, i), np.array([-2.0, 0.0, 3.0]))
    np.testing.assert_array_equal(gx, [-np.inf, 0.0, 0.0])


def test_abs_gradient_is_sign_and_zero_at_zero() -> None:
    out, (g,) = _grads(tg.abs, np.array([-2.0, -0.0, 0.0, 3.0]))
    np.testing.assert_array_equal(out, [2.0, 0.0, 0.0, 3.0])
    assert not np.signbit(out).any()  # |-0| is +0, as numpy's and PyTorch's
    special, _ = _grads1(tg.abs, np.array([-np.inf, np.inf, np.nan, -5e-324, -np.nan]))
    np.testing.assert_array_equal(special, [np.inf, np.inf, np.nan, 5e-324, np.nan])
    assert not np.signbit(special).any()  # |-NaN| is a NaN without its sign, as fabs's
    np.testing.assert_array_equal(g, [-1.0, 0.0, 0.0, 1.0])
    # PyTorch multiplies by sign(x) (0 at a NaN): an infinite cotangent at 0 gives NaN there,
    # as sqrt(abs(x)) at 0 does (it gave 0, hiding it).
    def root(t: tg.Tape, i: tg.Id) -> Out:
        t, a = tg.abs(t, i)
        return tg.sqrt(t, a)

    _, (g,) = _grads1(root, np.array([0.0, -0.0, np.nan, 4.0]))
    np.testing.assert_array_equal(g, [np.nan, np.nan, np.nan, 0.25])


def test_float32_tanh_saturates_at_one_as_pytorch() -> None:
    # PoCL's float tanh stops at 0.99999994 from |x| = 9.0109138, where the correctly rounded
    # tanh (PyTorch's) is 1; gelu's tanh form multiplied that ulp by x and x^3 (its gradient
    # was -6380 at x = -1e4, and its value -2.98e-6 at x = -100, where PyTorch has 0 and -0).
    # Three times over: 16 elements in float32's eight-lane kernel, 2 in its scalar tail.
    x = np.tile(np.array([-1e4, -100.0, -9.0109138, 9.0109138, 30.0, 1e4], np.float32), 3)
    out, (g,) = _grads1(tg.tanh, x)
    np.testing.assert_array_equal(out, np.tile([-1, -1, -1, 1, 1, 1], 3))
    np.testing.assert_array_equal(g, np.zeros(18))
    below = np.float32(9.0109129)  # rounds to 0.99999994, as math.tanh says
    out, _ = _grads1(tg.tanh, np.array([below, -below]))
    np.testing.assert_array_equal(out, np.array([math.tanh(below), -math.tanh(below)], np.float32))
    out, (g,) = _grads1(lambda t, i: tg.gelu(t, i, approximate="tanh"), x)
    np.testing.assert_array_equal(out, np.where(x < 0, np.float32(0.0), x))
    np.testing.assert_array_equal(g, np.where(x < 0, np.float32(0.0), np.float32(1.0)))


def test_clip_passes_the_gradient_inside_inclusive_bounds() -> None:
    x = np.array([-1.0, -0.5, 0.2, 0.5, 0.7], np.float32)
    out, (g,) = _grads1(lambda t, i: tg.clip(t, i, -0.5, 0.5), x)
    np.testing.assert_array_equal(out, np.clip(x, -0.5, 0.5))
    np.testing.assert_array_equal(g, [0.0, 1.0, 1.0, 1.0, 0.0])
    out, (g,) = _grads1(lambda t, i: tg.clip(t, i, None, 0.2), x)
    np.testing.assert_array_equal(out, np.minimum(x, np.float32(0.2)))
    np.testing.assert_array_equal(g, [1.0, 1.0, 1.0, 0.0, 0.0])


def test_clip_with_lo_above_hi_gives_hi_and_no_gradient() -> None:
    x = np.array([-1.0, 0.5, 1.0, 3.0])
    out, (g,) = _grads1(lambda t, i: tg.clip(t, i, 2.0, 1.0), x)
    np.testing.assert_array_equal(out, [1.0, 1.0, 1.0, 1.0])  # numpy's and PyTorch's answer
    np.testing.assert_array_equal(g, np.zeros(4))


def test_clip_without_bounds_returns_x_and_records_nothing() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    tape2, y = tg.clip(tape, x, None, None)
    assert y == x and len(tape2) == len(tape)


# --- gelu ------------------------------------------------------------------------------------


def test_gelu_values() -> None:
    """Exact form x * Phi(x) at tabulated normal CDF values; the tanh form within its known
    distance (under 5e-4) of the exact one, and equal to its own formula."""
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    phi = np.array([0.0013498980316300946, 0.15865525393145707, 0.5, 0.6914624612740131,
                    0.9772498680518208])
    tape, i = tg.leaf(tg.Tape(), x)
    tape, y = tg.gelu(tape, i)
    np.testing.assert_allclose(tg.value(tape, y).numpy(), x * phi, rtol=1e-10, atol=1e-15)
    grid = np.linspace(-8.0, 8.0, 1601)
    tape, i = tg.leaf(tape, grid)
    tape, exact = tg.gelu(tape, i)
    tape, approx = tg.gelu(tape, i, approximate="tanh")
    got = tg.value(tape, approx).numpy()
    k = np.sqrt(2.0 / np.pi)
    np.testing.assert_allclose(got, 0.5 * grid * (1 + np.tanh(k * (grid + 0.044715 * grid**3))),
                               rtol=1e-12, atol=1e-15)
    diff = np.abs(got - tg.value(tape, exact).numpy())
    assert 4e-4 < diff.max() < 5e-4


def test_gelu_second_derivative_by_finite_differences_of_the_gradient() -> None:
    def dgelu(t: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        t, y = tg.gelu(t, x)
        t, s = tg.sum(t, y)
        t, g = tg.backward_on_tape(t, s, [x])
        return t, g[x]

    assert tg.gradcheck(dgelu, np.linspace(-3.0, 3.0, 7))


# --- where ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cond_dtype", [np.bool_, np.int32, np.int64])
def test_where_takes_bool_and_integer_conditions(cond_dtype: Any) -> None:
    cond = np.array([[3, 0, -1], [0, 0, 7]]).astype(cond_dtype)
    a = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    b = np.array([-1.0, -2.0, -3.0], np.float32)
    tape, c = tg.leaf(tg.Tape(), cond)
    tape, ia = tg.leaf(tape, a, requires_grad=True)
    tape, ib = tg.leaf(tape, b, requires_grad=True)
    tape, y = tg.where(tape, c, ia, ib)
    want = np.where(cond != 0, a, b)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), want)
    assert y.dtype == np.float32
    tape, loss = tg.sum(tape, y)
    grads = tg.backward(tape, loss)
    assert set(grads) == {ia, ib}
    np.testing.assert_array_equal(grads[ia].numpy(), (cond != 0).astype(np.float32))
    np.testing.assert_array_equal(grads[ib].numpy(), (cond == 0).sum(axis=0))


def test_where_with_numbers() -> None:
    cond = np.array([True, False, True])
    tape, c = tg.leaf(tg.Tape(), cond)
    tape, y = tg.where(tape, c, 1.0, 0)
    assert y.dtype == np.float32  # two numbers: float32, as leaf(3.0)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [1.0, 0.0, 1.0])
    tape, x = tg.leaf(tape, np.array([5.0, 6.0, 7.0]))
    tape, y = tg.where(tape, c, -1, x)
    assert y.dtype == np.float64  # a number never changes the id's dtype
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [-1.0, 6.0, -1.0])


def test_where_errors_name_the_argument() -> None:
    tape, c = tg.leaf(tg.Tape(), np.array([1.0, 0.0]))
    tape, x = tg.leaf(tape, np.ones(2))
    tape, i = tg.leaf(tape, np.array([1, 0, 1]))
    tape, f32 = tg.leaf(tape, np.ones(2, np.float32))
    n = len(tape)
    with pytest.raises(tg.DTypeError, match=r"where: argument 'cond' has dtype float64"):
        tg.where(tape, c, x, 0.0)
    with pytest.raises(tg.ShapeError, match=r"where: shapes do not broadcast .*cond \(3,\)"):
        tg.where(tape, i, x, 0.0)
    with pytest.raises(tg.DTypeError, match=r"a is float64, b is float32"):
        tg.where(tape, i, x, f32)
    with pytest.raises(tg.DTypeError, match=r"argument 'b' has dtype int64"):
        tg.where(tape, i, 1.0, i)
    assert len(tape) == n


# --- astype -----------------------------------------------------------------------------------

_DTYPES = [np.float32, np.float64, np.int32, np.int64, np.bool_]


@pytest.mark.parametrize("src", _DTYPES)
@pytest.mark.parametrize("dst", _DTYPES)
def test_astype_converts_like_numpy(src: Any, dst: Any) -> None:
    data = np.array([-2.75, -1.0, -0.5, 0.0, 0.25, 1.5, 3.0, 100.9]).astype(src)
    tape, x = tg.leaf(tg.Tape(), data)
    tape2, y = tg.astype(tape, x, dst)
    assert y.dtype == np.dtype(dst)
    np.testing.assert_array_equal(tg.value(tape2, y).numpy(), data.astype(dst))
    if src == dst:
        assert y == x and len(tape2) == len(tape)
    else:
        assert len(tape2) == len(tape) + 1 and tape2[y].op == "cast"


def test_astype_between_floats_is_differentiable() -> None:
    x = np.array([0.5, -1.25, 2.0], np.float32)
    tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, d = tg.astype(tape, i, np.float64)
    tape, sq = tg.mul(tape, d, d)
    tape, loss = tg.sum(tape, sq)
    g = tg.backward(tape, loss)[i].numpy()
    assert g.dtype == np.float32  # the cotangent is cast back to x's dtype
    np.testing.assert_array_equal(g, 2 * x)


def test_astype_float_roundtrip_passes_gradcheck_and_second_order() -> None:
    def f(t: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        t, y = tg.astype(t, x, "float32")
        t, y = tg.mul(t, y, y)
        return tg.astype(t, y, np.float64)

    x = np.array([0.5, -1.25, 2.0])
    # float32 rounding of x +- eps needs a wider step than the default.
    assert tg.gradcheck(f, x, eps=1e-3, atol=1e-4, rtol=1e-3)

    def df(t: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        t, y = f(t, x)
        t, s = tg.sum(t, y)
        t, g = tg.backward_on_tape(t, s, [x])
        return t, g[x]

    tape, i = tg.leaf(tg.Tape(), x)
    tape, g = df(tape, i)
    assert g.dtype == np.float64
    np.testing.assert_allclose(tg.value(tape, g).numpy(), 2 * x, rtol=1e-6)
    assert tg.gradcheck(df, x, eps=1e-3, atol=1e-4, rtol=1e-3)


def test_astype_through_integers_takes_no_gradient() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.7, -2.2]), requires_grad=True)
    tape, k = tg.astype(tape, x, np.int32)
    np.testing.assert_array_equal(tg.value(tape, k).numpy(), [1, -2])
    tape, back = tg.astype(tape, k, np.float64)
    tape, loss = tg.sum(tape, back)
    assert x not in tg.backward(tape, loss)  # the loss does not reach x through an int
    np.testing.assert_array_equal(tg.backward(tape, loss, wrt=[x])[x].numpy(), [0.0, 0.0])


def test_astype_refuses_unsupported_dtypes() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    with pytest.raises(tg.DTypeError, match="cannot convert to float16"):
        tg.astype(tape, x, np.float16)
    with pytest.raises(tg.DTypeError, match="is not a dtype"):
        tg.astype(tape, x, "no-such-dtype")
    with pytest.raises(tg.DTypeError, match="dtype must be given"):  # numpy's None: float64
        tg.astype(tape, x, cast(Any, None))


# --- logsumexp, softmax and cross-entropy at extreme values -----------------------------------


def _stable_lse(x: Array, axis: int) -> Array:
    x64 = x.astype(np.float64)
    m = np.max(x64, axis=axis, keepdims=True)
    return np.squeeze(np.log(np.sum(np.exp(x64 - m), axis=axis, keepdims=True)) + m, axis)


_EXTREME = np.array([[1e4, -1e4, 0.0, 3.0],
                     [-1e4, -1e4, -1e4, -1e4],
                     [1e4, 1e4, -1e4, 9999.0],
                     [-1e4, 2.0, 1e4, -5.0]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_at_logits_of_1e4_has_no_nan(dtype: Any) -> None:
    logits = _EXTREME.astype(dtype)
    labels = np.array([1, 3, 0, 2], np.int64)
    tape, x = tg.leaf(tg.Tape(), logits, requires_grad=True)
    tape, y = tg.leaf(tape, labels)
    tape, loss = tg.cross_entropy(tape, x, y)
    got = tg.value(tape, loss).numpy()
    rows = _stable_lse(logits, 1) - logits.astype(np.float64)[np.arange(4), labels]
    assert np.isfinite(got)
    np.testing.assert_allclose(got, rows.mean(), rtol=1e-6)
    # the rows: 2e4 (label at -1e4), log 4 (a row of equal logits), log(2 + 1/e), about 0
    closed = (2e4 + np.log(4.0) + np.log(2.0 + np.exp(-1.0))) / 4
    np.testing.assert_allclose(got, closed, rtol=1e-6)
    g = tg.backward(tape, loss)[x].numpy()
    x64 = logits.astype(np.float64)
    softmax = np.exp(x64 - _stable_lse(logits, 1)[:, None])
    want = (softmax - np.eye(4)[labels]) / 4
    assert np.isfinite(g).all()
    # float32 holds a logsumexp near 1e4 to about 5e-4, so its softmax to about that, relatively
    np.testing.assert_allclose(g, want, atol=1e-4 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logsumexp_softmax_and_log_softmax_at_extremes(dtype: Any) -> None:
    x = _EXTREME.astype(dtype)
    tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
    lse = _stable_lse(x, -1)
    for fn, want in ((tg.logsumexp, lse), (tg.log_softmax, x - lse[:, None]),
                     (tg.softmax, np.exp(x.astype(np.float64) - lse[:, None]))):
        t, y = fn(tape, i)
        got = tg.value(t, y).numpy()
        assert np.isfinite(got).all()
        tol = 2e-3 if dtype == np.float32 else 1e-9  # float32 resolves 1e4 to about 1e-3
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=tol)
        t, s = tg.sum(t, y)
        assert np.isfinite(tg.backward(t, s)[i].numpy()).all()


def test_logsumexp_of_infinities_and_empty_axes() -> None:
    inf = np.inf
    x = np.array([[-inf, -inf, -inf], [1.0, inf, 0.0], [-inf, 0.0, -inf]], np.float32)
    tape, i = tg.leaf(tg.Tape(), x)
    tape, y = tg.logsumexp(tape, i)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [-inf, inf, 0.0])
    tape, e = tg.leaf(tape, np.zeros((2, 0), np.float32))
    tape, y = tg.logsumexp(tape, e)
    np.testing.assert_array_equal(tg.value(tape, y).numpy(), [-inf, -inf])


def test_softmax_rows_sum_to_one_along_the_axis() -> None:
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32) * 30
    tape, i = tg.leaf(tg.Tape(), x)
    for axis in (0, 1, -1):
        t, y = tg.softmax(tape, i, axis=axis)
        np.testing.assert_allclose(tg.value(t, y).numpy().sum(axis=axis), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axis"), [((40, 19), 0), ((3, 20, 16), 1), ((2, 6, 5, 3), 1),
                                            ((3, 40, 5), 1)],
                         ids=["cols-19", "cols-16", "nchw", "cols-5"])
def test_log_softmax_over_a_strided_axis_reads_eight_columns_at_a_time(
        dtype: Any, shape: tuple[int, ...], axis: int) -> None:
    """Over an axis that is not the last, a work-item takes 8 adjacent columns as vectors and
    the columns past the last 8 one at a time: both match the float64 formula, with a column
    holding NaN, one +inf and one all -inf."""
    x = (np.random.default_rng(4).standard_normal(shape) * 20).astype(dtype)
    moved = np.moveaxis(x, axis, 0)  # a view: column c of moved is a softmax row
    moved[:, 0] = -np.inf
    moved[3, 1] = np.nan
    moved[2, -1] = np.inf
    tape, i = tg.leaf(tg.Tape(), x)
    tape, y = tg.log_softmax(tape, i, axis=axis)
    got = tg.value(tape, y).numpy()
    x64 = x.astype(np.float64)
    top = np.max(x64, axis=axis, keepdims=True)
    shift = np.where(top == -np.inf, 0.0, top)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (x64 - shift) - np.log(np.sum(np.exp(x64 - shift), axis=axis, keepdims=True))
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert np.isnan(np.moveaxis(got, axis, 0)[:, 1]).all()  # NaN's column, and +inf's:
    assert np.isnan(np.moveaxis(got, axis, 0)[:, -1]).all()  # inf - inf, as PyTorch


def _softmax_ref(x: Any, axis: int) -> Any:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - np.max(x64, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize(("shape", "axis"),
                         [((5, 37), -1), ((4, 19, 3), 1), ((2, 3, 70000), 2), ((40000, 3), 0)],
                         ids=["rows", "strided", "few-long-rows", "few-long-strided-rows"])
def test_softmax_and_its_vjp_are_one_kernel_each_and_match_the_formula(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], axis: int, log: bool) -> None:
    """softmax and log_softmax are one node and one kernel, their VJPs y * (g - sum(g * y))
    and g - exp(o) * sum(g) another (softmax was exp(log_softmax(x)); the VJPs sums,
    broadcasts and elementwise kernels). Few long strided rows take the split reductions
    instead."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape) * 4
    seed = rng.standard_normal(shape)
    names: list[str] = []
    on_launch(monkeypatch, names.append)
    tape, xi = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, y = (tg.log_softmax if log else tg.softmax)(tape, xi, axis=axis)
    assert tape[y].op == ("log_softmax" if log else "softmax") and len(tape) == 2
    got = tg.value(tape, y).numpy()
    grad = tg.backward(tape, y, seed=seed)[xi].numpy()
    probs = _softmax_ref(x, axis)
    if log:
        np.testing.assert_allclose(got, np.log(probs), rtol=1e-12, atol=1e-12)
        want = seed - probs * np.sum(seed, axis=axis, keepdims=True)
    else:
        np.testing.assert_allclose(got, probs, rtol=1e-12, atol=1e-15)
        want = probs * (seed - np.sum(seed * probs, axis=axis, keepdims=True))
    np.testing.assert_allclose(grad, want, rtol=1e-9, atol=1e-12)
    if shape[axis] < 1000:
        name = "log_softmax" if log else "softmax"
        assert names == [name, f"{name}_grad"]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_second_and_third_order_gradients(log: bool) -> None:
    def f(tape: tg.Tape, x: tg.Id, w: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = (tg.log_softmax if log else tg.softmax)(tape, x, axis=0)
        tape, y = tg.mul(tape, y, w)
        return tg.sum(tape, y)

    def squared(g: Callable[..., tuple[tg.Tape, tg.Id]]) -> Callable[..., tuple[tg.Tape, tg.Id]]:
        def h(tape: tg.Tape, x: tg.Id, w: tg.Id) -> tuple[tg.Tape, tg.Id]:
            tape, gx = tg.grad(g, argnums=0)(tape, x, w)
            tape, sq = tg.mul(tape, gx, gx)
            return tg.sum(tape, sq)
        return h

    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((4, 10)), rng.standard_normal((4, 10))
    assert tg.gradcheck(squared(f), x, w)  # through softmax_grad's VJP
    assert tg.gradcheck(squared(squared(f)), x, w)  # and through that VJP's


# --- cross_entropy labels ---------------------------------------------------------------------


def test_cross_entropy_out_of_range_labels_raise_if_from_the_host_else_give_nan_rows() -> None:
    logits = np.random.default_rng(0).standard_normal((3, 4))
    tape, x = tg.leaf(tg.Tape(), logits, requires_grad=True)
    tape, host = tg.leaf(tape, np.array([1, 4, -1], np.int32))
    with pytest.raises(tg.ShapeError, match=r"cross_entropy: label -1 is out of bounds for 4 "
                                            r"classes \(labels must lie in \[0, 4\)\)"):
        tg.cross_entropy(tape, x, host)
    tape, host2 = tg.leaf(tape, np.array([1, 4, 0]))
    with pytest.raises(IndexError, match="label 4 is out of bounds"):
        tg.cross_entropy(tape, x, host2)
    # Labels computed on the device are not read back: a bad one makes its row NaN.
    tape, f = tg.leaf(tape, np.array([1.0, 4.0, -1.0]))
    tape, y = tg.astype(tape, f, np.int32)
    tape, loss = tg.cross_entropy(tape, x, y)
    assert np.isnan(tg.value(tape, loss).numpy())
    g = tg.backward(tape, loss)[x].numpy()
    assert np.isfinite(g[0]).all() and np.isnan(g[1:]).all()
    with pytest.raises(tg.AnomalyError, match="cross_entropy_rows"), tg.detect_anomaly():
        tg.cross_entropy(tape, x, y)


def test_cross_entropy_checks_labels_and_logits() -> None:
    tape, x = tg.leaf(tg.Tape(), np.zeros((4, 3), np.float32))
    tape, f = tg.leaf(tape, np.zeros(4, np.float32))
    tape, col = tg.leaf(tape, np.zeros((4, 1), np.int64))
    tape, short = tg.leaf(tape, np.zeros(3, np.int32))
    tape, x3 = tg.leaf(tape, np.zeros((2, 4, 3), np.float32))
    tape, ok = tg.leaf(tape, np.zeros(4, np.int64))
    n = len(tape)
    with pytest.raises(tg.DTypeError, match=r"cross_entropy: labels have dtype float32, "
                                            r"expected int32 or int64"):
        tg.cross_entropy(tape, x, f)
    with pytest.raises(tg.ShapeError, match=r"labels must have shape \(N,\) = \(4,\).*"
                                            r"got shape \(4, 1\)"):
        tg.cross_entropy(tape, x, col)
    with pytest.raises(tg.ShapeError, match=r"got shape \(3,\)"):
        tg.cross_entropy(tape, x, short)
    with pytest.raises(tg.ShapeError, match=r"logits must have shape \(N, C\), got shape "
                                            r"\(2, 4, 3\)"):
        tg.cross_entropy(tape, x3, ok)
    with pytest.raises(tg.DTypeError, match="logits have dtype int64"):
        tg.cross_entropy(tape, ok, ok)
    assert len(tape) == n
    tape, loss = tg.cross_entropy(tape, x, ok)  # uniform logits: log(3)
    np.testing.assert_allclose(tg.value(tape, loss).numpy(), np.log(3.0), rtol=1e-6)


def test_wide_rows_keep_float32_accuracy_in_cross_entropy_and_log_softmax() -> None:
    # Rows are summed 8 wide in blocks, compensated: a plain running sum of 1e5 exponentials
    # erred 6.6e-6 (PyTorch's float32 1.3e-7). Widths off the 8- and 128-element blocks too.
    rng = np.random.default_rng(4)
    for shape in ((1, 100000), (3, 1037), (2, 129), (5, 7)):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        labels = rng.integers(0, shape[1], shape[0])
        x64 = x.astype(np.float64)
        lse: Array = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
        tape, xi = tg.leaf(tg.Tape(), x, requires_grad=True)
        tape, li = tg.leaf(tape, labels)
        tape, loss = tg.cross_entropy(tape, xi, li)
        picked: Array = x64[np.arange(shape[0]), labels]
        want = float(np.mean(lse - picked))
        assert abs(float(tg.value(tape, loss).numpy()) - want) <= 3e-7 * abs(want)
        soft = np.exp(x64 - lse[:, None])
        onehot = np.zeros(shape)
        onehot[np.arange(shape[0]), labels] = 1.0
        g = tg.backward(tape, loss)[xi].numpy()
        np.testing.assert_allclose(g, (soft - onehot) / shape[0], rtol=0,
                                   atol=3e-7 * np.abs(soft - onehot).max() / shape[0])
        tape, ls = tg.log_softmax(tape, xi)
        np.testing.assert_allclose(tg.value(tape, ls).numpy(), x64 - lse[:, None], rtol=2e-7,
                                   atol=2e-7 * np.abs(lse).max())


# --- var, mse ---------------------------------------------------------------------------------


def test_var_with_large_mean_and_ddof_edge_cases() -> None:
    x = (1e4 + np.random.default_rng(2).standard_normal((5, 6))).astype(np.float32)
    tape, i = tg.leaf(tg.Tape(), x)
    tape, v = tg.var(tape, i, axis=0, ddof=1)
    np.testing.assert_allclose(tg.value(tape, v).numpy(), np.var(x.astype(np.float64), axis=0,
                                                                 ddof=1), rtol=1e-3)
    # n - ddof <= 0 divides by 0, as numpy: inf for a positive sum of squares, NaN for 0.
    tape, two = tg.leaf(tape, np.array([[2.0, 4.0], [3.0, 3.0]]))
    for ddof, want in ((1, [2.0, 0.0]), (2, [np.inf, np.nan]), (3, [np.inf, np.nan])):
        tape, v = tg.var(tape, two, axis=1, ddof=ddof)
        np.testing.assert_array_equal(tg.value(tape, v).numpy(), want)
    # numpy's integers are numbers, as numpy's var takes them; a string is not.
    ddof_np: Any = np.int64(1)
    tape, v = tg.var(tape, two, axis=1, ddof=ddof_np)
    np.testing.assert_array_equal(tg.value(tape, v).numpy(), [2.0, 0.0])
    with pytest.raises(tg.DTypeError, match="var: ddof must be a number, got '1'"):
        tg.var(tape, two, ddof="1")  # pyright: ignore[reportArgumentType]
    # A sum that overflows makes var inf, as numpy's and PyTorch's (the mean's correction was
    # inf - inf, a NaN).
    for big in (np.array([3e38, 3e38, 0.0, 1.0], np.float32), np.array([1e307] * 2 + [0.0] * 6)):
        tape, b = tg.leaf(tape, big)
        tape, v = tg.var(tape, b)
        assert tg.value(tape, v).numpy() == np.inf


def test_mse_refuses_mismatched_shapes() -> None:
    tape, a = tg.leaf(tg.Tape(), np.zeros((4,), np.float32))
    tape, b = tg.leaf(tape, np.zeros((4, 1), np.float32))
    with pytest.raises(tg.ShapeError, match=r"mse: a has shape \(4,\) and b has shape \(4, 1\)"):
        tg.mse(tape, a, b)


# --- other errors -----------------------------------------------------------------------------


def test_errors_name_op_argument_and_values() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    tape, y = tg.leaf(tape, np.ones((2, 3), np.float64))
    tape, k = tg.leaf(tape, np.ones((2, 3), np.int64))
    n = len(tape)
    with pytest.raises(tg.DTypeError, match=r"maximum: operands .*a is float32, b is float64"):
        tg.maximum(tape, x, y)
    tape, four = tg.leaf(tape, np.ones(4, np.float32))
    n = len(tape)
    with pytest.raises(tg.ShapeError, match=r"minimum: shapes do not broadcast"):
        tg.minimum(tape, x, four)
    with pytest.raises(tg.TapegradError, match=r"gelu: approximate must be 'none' .* 'erf'"):
        tg.gelu(tape, x, approximate="erf")
    with pytest.raises(tg.DTypeError, match=r"abs: argument 'x' has dtype int64"):
        tg.abs(tape, k)
    with pytest.raises(tg.DTypeError, match=r"clip: lo must be a Python number or None"):
        tg.clip(tape, x, "0", 1.0)  # type: ignore[arg-type]
    with pytest.raises(tg.TapegradError, match=r"clip: hi is NaN"):
        tg.clip(tape, x, 0.0, float("nan"))
    with pytest.raises(tg.ShapeError, match=r"softmax: axis 2 is out of range .*rank 2"):
        tg.softmax(tape, x, axis=2)
    with pytest.raises(tg.DTypeError, match=r"log_softmax: x has dtype int64"):
        tg.log_softmax(tape, k)
    with pytest.raises(tg.DTypeError, match=r"var: needs a float32 or float64 tensor, got int64"):
        tg.var(tape, k)
    with pytest.raises(tg.DTypeError, match=r"logsumexp: x has dtype int64, expected float32 or"):
        tg.logsumexp(tape, k)
    with pytest.raises(tg.ShapeError, match=r"logsumexp: axis \(0, -2\) repeats an axis"):
        tg.logsumexp(tape, x, axis=(0, -2))
    assert len(tape) == n
    with pytest.raises(tg.DTypeError) as info:
        tg.abs(tape, k)
    assert "test_ops_elem.py" in str(info.value)  # the user's line


def test_new_ops_build_no_programs_on_repeated_calls() -> None:
    device = tg.default_device()

    def step(n: int) -> None:
        rng = np.random.default_rng(n)
        tape, x = tg.leaf(tg.Tape(), rng.standard_normal((n, 5)).astype(np.float32),
                          requires_grad=True)
        tape, y = tg.leaf(tape, rng.integers(0, 5, n))
        tape, h = tg.gelu(tape, x)
        tape, h = tg.clip(tape, h, -1.0, 1.0)
        tape, a = tg.abs(tape, x)
        tape, h = tg.maximum(tape, h, a)
        tape, mask = tg.reshape(tape, y, (n, 1))
        tape, h = tg.where(tape, mask, h, 0.0)
        tape, loss = tg.cross_entropy(tape, h, y)
        tape, v = tg.var(tape, h)
        tape, loss = tg.add(tape, loss, v)
        tg.backward(tape, loss)

    warm_up(device, lambda: step(3))
    before = device.builds
    for n in (3, 17, 400):
        step(n)
    assert device.builds == before


def test_float32_sin_and_cos_are_within_about_an_ulp_and_a_half() -> None:
    """float32 sin and cos are tapegrad's own below |x| = 8192 (`_kernels`' tg_trig_: a
    four-part reduction by pi/2 and Cephes' polynomials; PoCL's library calls were 3-4x
    slower), the library's past it: within 1.6 ulps of the correctly rounded value, as the
    library, near every multiple of pi/2 too, in the eight lanes and the scalar tail alike;
    -0 stays -0, infinities give NaN."""
    rng = np.random.default_rng(4)
    k = np.arange(-5215, 5216) * (np.pi / 2)
    near = k.astype(np.float32)
    xs = np.concatenate([rng.uniform(-10.0, 10.0, 100_000), rng.uniform(-8192.0, 8192.0, 100_000),
                         rng.uniform(8192.0, 1e6, 20_000), np.nextafter(near, np.float32(np.inf)),
                         near, np.exp(rng.uniform(math.log(1e-30), 0.0, 20_000)),
                         [8191.999, 8192.0, -8192.0, 8192.001]]).astype(np.float32)
    tape, x = tg.leaf(tg.Tape(), xs)
    for fn, ref in ((tg.sin, np.sin), (tg.cos, np.cos)):
        tape2, y = fn(tape, x)
        got = tg.value(tape2, y).numpy().astype(np.float64)
        want = ref(xs.astype(np.float64))
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert np.max(np.abs(got - want) / ulp) <= 1.6, fn.__name__
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan] * 3 + [-0.0], np.float32)
    tape, s = tg.leaf(tape, special)
    tape, sine = tg.sin(tape, s)
    tape, cosine = tg.cos(tape, s)
    out = tg.value(tape, sine).numpy()
    np.testing.assert_array_equal(out, [0.0, -0.0, np.nan, np.nan, np.nan] * 3 + [-0.0])
    assert list(np.signbit(out[[0, 1, 5, 6, 15]])) == [False, True, False, True, True]
    np.testing.assert_array_equal(tg.value(tape, cosine).numpy(),
                                  [1.0, 1.0, np.nan, np.nan, np.nan] * 3 + [1.0])


def _float32_at(op: Callable[[tg.Tape, tg.Id], tuple[tg.Tape, tg.Id]],
                values: Any) -> np.ndarray[Any, Any]:
    """op over `values` as float32, read back."""
    tape, x = tg.leaf(tg.Tape(), np.asarray(values, np.float32))
    tape, y = op(tape, x)
    return tg.value(tape, y).numpy()


def _ulps(op: Callable[[tg.Tape, tg.Id], tuple[tg.Tape, tg.Id]], xs: np.ndarray[Any, Any],
          want: np.ndarray[Any, Any]) -> float:
    """The largest distance of op's float32 values over `xs` from `want` (float64), in units
    in the last place of the correctly rounded float32."""
    got = _float32_at(op, xs).astype(np.float64)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return float(np.max(np.abs(got - want) / ulp))


def test_float32_tanh_is_within_one_and_a_half_ulps() -> None:
    """float32 tanh is tapegrad's own (`_kernels`' tg_tanh: an odd polynomial below 0.625,
    1 - 2 / (exp(2|x|) + 1) above; PoCL's library tanh took about twice as long): within 1.5
    units in the last place of the correctly rounded value on 300,000 points, tiny ones and
    both sides of 0.625 included, and exact at the special values and from 9.0109138 on.

    Above 0.625 it carries the driver's float exp, near 0.625 at 0.62 of exp's error: within
    an ulp on PoCL, but OpenCL allows 3 and NVIDIA's took tanh past 1.5 ulps (CUDA's own
    tanhf is documented within 2), so another driver is held to 2.5."""
    rng = np.random.default_rng(4)
    xs = np.concatenate([rng.uniform(-10.0, 10.0, 200_000), rng.uniform(0.6, 0.65, 50_000),
                         np.exp(rng.uniform(math.log(1e-30), 0.0, 50_000))
                         * rng.choice([-1.0, 1.0], 50_000)]).astype(np.float32)
    on_pocl = tg.default_device().platform_name == "Portable Computing Language"
    assert _ulps(tg.tanh, xs, np.tanh(xs.astype(np.float64))) <= (1.5 if on_pocl else 2.5)
    out = _float32_at(tg.tanh, [0.0, -0.0, np.inf, -np.inf, np.nan, 9.0109138, -20.0])
    np.testing.assert_array_equal(out, [0.0, -0.0, 1.0, -1.0, np.nan, 1.0, -1.0])
    assert np.signbit(out[1])


def test_float32_erf_is_within_one_and_a_half_ulps() -> None:
    """float32 erf (and so gelu) is tapegrad's own polynomial (`_kernels`' tg_erf: PoCL's
    library erf took ~5 ns an element): within 1.5 units in the last place of the correctly
    rounded value on 300,000 points, tiny ones included, and exact at the special values."""
    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.uniform(-5.0, 5.0, 250_000),
                         np.exp(rng.uniform(math.log(1e-30), 0.0, 50_000))]).astype(np.float32)
    assert _ulps(tg.erf, xs, np.vectorize(math.erf)(xs.astype(np.float64))) <= 1.5
    out = _float32_at(tg.erf, [0.0, -0.0, np.inf, -np.inf, np.nan, 4.0, -9.0])
    np.testing.assert_array_equal(out, [0.0, -0.0, 1.0, -1.0, np.nan, 1.0, -1.0])
    assert np.signbit(out[1])


@pytest.mark.parametrize("op", ["sub", "add", "mul", "div"])
def test_an_int_before_an_id_records_the_node_of_its_float(op: str) -> None:
    """`tg.sub(tape, 1, z)` (a GRU's 1 - z) takes the quick path of `tg.sub(tape, 1.0, z)`:
    the same node (args, parents, gradient flag) and value."""
    fn = getattr(tg, op)
    tape, z = tg.leaf(tg.Tape(), np.array([0.25, -2.0], np.float32), requires_grad=True)
    t1, by_int = fn(tape, 3, z)
    t2, by_float = fn(tape, 3.0, z)
    n1, n2 = t1[by_int], t2[by_float]
    assert (n1.op, n1.args, n1.parents, n1.requires_grad) == (op, (3.0, z), (z,), True)
    assert (n1.op, n1.args, n1.parents, n1.requires_grad) == (n2.op, n2.args, n2.parents,
                                                              n2.requires_grad)
    assert type(n1.args[0]) is float
    np.testing.assert_array_equal(tg.value(t1, by_int).numpy(), tg.value(t2, by_float).numpy())


@pytest.mark.parametrize("big", [2 ** 1024 - 2 ** 970, -(2 ** 1024 - 2 ** 970), 10 ** 400],
                         ids=["just_over", "just_under", "huge"])
def test_an_int_too_large_for_a_float_is_named_either_side(big: int) -> None:
    """An int that rounds past the largest float is a DTypeError naming the argument, before
    or after the id; the largest that fits is taken as its float."""
    tape, x = tg.leaf(tg.Tape(), np.ones(2))
    for args, name in (((x, big), "b"), ((big, x), "a")):
        with pytest.raises(tg.DTypeError, match=rf"add: argument '{name}' is an int too large"):
            tg.add(tape, *args)
    fits = 2 ** 1024 - 2 ** 970 - 1
    t, y = tg.add(tape, fits, x)
    np.testing.assert_array_equal(tg.value(t, y).numpy(), [float(fits)] * 2)
