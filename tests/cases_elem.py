"""Op-table rows for the elem ops (see cases.py for the row format).

abs, gelu (both forms), maximum, minimum, where, clip, logsumexp, var, softmax, log_softmax,
cross_entropy and mse: forward against numpy, gradients against float64 finite differences, on
plain and broadcast shapes. Inputs stay away from kinks and ties (abs and clip away from 0 and
the bounds; maximum on distinct random values). The "grad of" rows differentiate a recorded
backward (`backward_on_tape`), so the VJPs of the fused helper primitives (abs_grad, gelu_grad,
maximum_grad, clip_grad, mul_exp_sub, cross_entropy_rows_grad, pick_label...) are checked too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg
from cases import BROADCAST_PAIRS, Array, Case, Fn1, Fn2, Out, Ref1, Ref2, case1

_erf: Callable[[Array], Array] = np.vectorize(math.erf)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def _phi(x: Array) -> Array:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu(x: Array) -> Array:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _dgelu(x: Array) -> Array:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * _phi(x)


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + np.tanh(_K * (x + _C * x**3)))


def _dgelu_tanh(x: Array) -> Array:
    t = np.tanh(_K * (x + _C * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * x * x)


def _gelu_t(t: tg.Tape, x: tg.Id) -> Out:
    return tg.gelu(t, x, approximate="tanh")


def _lse(x: Array, axis: Any = -1, keepdims: bool = False) -> Array:
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _softmax(x: Array, axis: int = -1) -> Array:
    return np.exp(x - _lse(x, axis, keepdims=True))


def _ce(x: Array, labels: Array) -> Any:
    return np.mean(_lse(x, 1) - x[np.arange(x.shape[0]), labels])


UNARY: dict[str, tuple[Fn1, Ref1, str]] = {
    "abs": (tg.abs, np.abs, "away0"),
    "gelu": (tg.gelu, _gelu, "any"),
    "gelu_tanh": (_gelu_t, _gelu_tanh, "any"),
}

BINARY: dict[str, tuple[Fn2, Ref2]] = {
    "maximum": (tg.maximum, np.maximum),
    "minimum": (tg.minimum, np.minimum),
}


def _scalar_side(name: str, fn: Fn2, ref: Ref2, c: float, right: bool) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return fn(t, x, c) if right else fn(t, c, x)  # type: ignore[arg-type]

    def r(x: Array) -> Any:
        return ref(x, np.asarray(c, x.dtype)) if right else ref(np.asarray(c, x.dtype), x)

    return case1(f"{name}(x, {c})" if right else f"{name}({c}, x)", f, r, (3, 4))


def _elementwise_cases() -> list[Case]:
    cases = [case1(f"{n}{s}", fn, ref, s, dom) for n, (fn, ref, dom) in UNARY.items()
             for s in ((3, 4), ())]
    cases += [Case(f"{n}{a}{b}", fn, ref, (a, b)) for n, (fn, ref) in BINARY.items()
              for a, b in BROADCAST_PAIRS]
    for n, (fn, ref) in BINARY.items():
        cases += [_scalar_side(n, fn, ref, 0.3, True), _scalar_side(n, fn, ref, -0.2, False)]
    return cases


# --- where: the condition is made inside the row's function (it is not a float input) ---------

_COND = np.array([[1, 0, 3, 0], [0, -2, 0, 1], [5, 5, 0, 0]], np.int64)


def _where_case(label: str, cond: Array, shapes: tuple[tuple[int, ...], ...],
                a: float | None = None, b: float | None = None) -> Case:
    """Rows of where(cond, a, b); a or b given as a number replaces that id input."""

    def f(t: tg.Tape, *ids: tg.Id) -> Out:
        t, c = tg.leaf(t, cond)
        rest = list(ids)
        x = a if a is not None else rest.pop(0)
        y = b if b is not None else rest.pop(0)
        return tg.where(t, c, x, y)

    def r(*arrays: Array) -> Any:
        rest = list(arrays)
        dtype = rest[0].dtype
        x = np.asarray(a, dtype) if a is not None else rest.pop(0)
        y = np.asarray(b, dtype) if b is not None else rest.pop(0)
        return np.where(cond != 0, x, y)

    return Case(f"where({label})", f, r, shapes)


def _where_cases() -> list[Case]:
    bools = _COND != 0
    return [
        _where_case("int64 cond", _COND, ((3, 4), (3, 4))),
        _where_case("bool cond", bools, ((3, 4), (3, 4))),
        _where_case("int32 cond (3,1), a (4,), b ()", _COND[:, :1].astype(np.int32),
                    ((4,), ())),
        _where_case("cond (4,), a (2,1,1), b (3,1)", _COND[1], ((2, 1, 1), (3, 1))),
        _where_case("a=0.5", bools, ((3, 4),), a=0.5),
        _where_case("b=-2", bools, ((1, 4),), b=-2.0),
    ]


# --- clip -------------------------------------------------------------------------------------


def _clip_case(lo: float | None, hi: float | None, shape: tuple[int, ...]) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return tg.clip(t, x, lo, hi)

    def r(x: Array) -> Any:
        return np.clip(x, -np.inf if lo is None else lo, np.inf if hi is None else hi)

    return case1(f"clip({lo}, {hi}){shape}", f, r, shape)


def _clip_cases() -> list[Case]:
    return [_clip_case(-0.5, 0.8, (3, 4)), _clip_case(None, 0.3, (3, 4)),
            _clip_case(-0.2, None, (3, 4)), _clip_case(-0.5, 0.5, ()),
            _clip_case(1, 2, (2, 3))]


# --- reductions -------------------------------------------------------------------------------


def _var_ref(ddof: int) -> Callable[..., Any]:
    def r(x: Array, axis: Any, keepdims: bool) -> Any:
        return np.var(x, axis=axis, keepdims=keepdims, ddof=ddof)
    return r


def _reduce_case(name: str, fn: Callable[..., Out], ref: Callable[..., Any], axis: Any,
                 keep: bool) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return fn(t, x, axis=axis, keepdims=keep)

    def r(x: Array) -> Any:
        return ref(x, axis=axis, keepdims=keep)

    return case1(f"{name}(axis={axis}, keepdims={keep})", f, r, (2, 3, 4))


def _reduce_cases() -> list[Case]:
    axes: list[Any] = [None, 0, 1, 2, -1, (0, 2), (1, 2), (-1, 0), (0, 1, 2)]

    def var1(t: tg.Tape, x: tg.Id, axis: Any, keepdims: bool) -> Out:
        return tg.var(t, x, axis=axis, keepdims=keepdims, ddof=1)

    ops: dict[str, tuple[Callable[..., Out], Callable[..., Any]]] = {
        "logsumexp": (tg.logsumexp, _lse), "var": (tg.var, _var_ref(0)),
        "var(ddof=1)": (var1, _var_ref(1)),
    }
    cases = [_reduce_case(name, fn, ref, axis, keep)
             for (name, (fn, ref)), axis, keep in itertools.product(ops.items(), axes,
                                                                    (False, True))]
    cases.append(case1("logsumexp(default axis)", tg.logsumexp, _lse, (3, 5)))
    cases.append(case1("logsumexp(long axis)", lambda t, x: tg.logsumexp(t, x, axis=None),
                       lambda x: _lse(x, None), (1300,)))
    cases.append(case1("var(all, default)", tg.var, np.var, (4, 5)))
    return cases


# --- softmax, log_softmax and losses ----------------------------------------------------------


def _axis_case(name: str, fn: Callable[..., Out], ref: Callable[[Array, int], Array],
               axis: int, shape: tuple[int, ...]) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return fn(t, x, axis=axis)

    return case1(f"{name}(axis={axis}){shape}", f, lambda x: ref(x, axis), shape)


def _log_softmax(x: Array, axis: int) -> Array:
    return x - _lse(x, axis, keepdims=True)


_LABELS = np.array([2, 0, 4, 4], np.int64)


def _ce_case(dtype: Any) -> Case:
    labels = _LABELS.astype(dtype)

    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, y = tg.leaf(t, labels)
        return tg.cross_entropy(t, x, y)

    return case1(f"cross_entropy(labels {np.dtype(dtype)})", f, lambda x: _ce(x, labels),
                 (4, 5))


def _mse_ref(a: Array, b: Array) -> Any:
    return np.mean((a - b) ** 2)


def _loss_cases() -> list[Case]:
    cases: list[Case] = []
    for axis, shape in ((-1, (3, 4)), (0, (3, 4)), (1, (2, 3, 4)), (0, (5,))):
        cases.append(_axis_case("softmax", tg.softmax, _softmax, axis, shape))
        cases.append(_axis_case("log_softmax", tg.log_softmax, _log_softmax, axis, shape))
    cases += [case1("softmax(default axis)", tg.softmax, _softmax, (2, 5)),
              _ce_case(np.int64), _ce_case(np.int32),
              Case("mse(3,4)", tg.mse, _mse_ref, ((3, 4), (3, 4))),
              Case("mse()", tg.mse, _mse_ref, ((), ())),
              case1("mse(x, 0.5)", lambda t, x: tg.mse(t, x, 0.5),
                    lambda x: np.mean((x - 0.5) ** 2), (2, 3))]
    return cases


# --- second order: differentiate a recorded backward --------------------------------------------

Ref3 = Callable[[Array, Array, Array], Any]


def _grad_of(name: str, fn: Callable[..., Out], dref: Callable[..., Any],
             shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...],
             domain: str = "any") -> Case:
    """Row of x -> d/dx sum(fn(x, ...) * w): the VJP of fn recorded on the tape, as a function
    of the first input x, the other inputs and the cotangent w (the last input)."""

    def f(t: tg.Tape, *ids: tg.Id) -> Out:
        *xs, w = ids
        t, y = fn(t, *xs)
        t, yw = tg.mul(t, y, w)
        t, s = tg.sum(t, yw)
        t, grads = tg.backward_on_tape(t, s, [xs[0]])
        return t, grads[xs[0]]

    return Case(f"grad of {name}", f, dref, (*shapes, out_shape), domain)


def _grad_of1(name: str, fn: Fn1, dref: Ref2, shape: tuple[int, ...],
              out_shape: tuple[int, ...] | None = None, domain: str = "any") -> Case:
    return _grad_of(name, fn, dref, (shape,), shape if out_shape is None else out_shape, domain)


def _grad_of2(name: str, fn: Fn2, dref: Ref3, shape: tuple[int, ...],
              out_shape: tuple[int, ...] | None = None) -> Case:
    return _grad_of(name, fn, dref, (shape, shape), shape if out_shape is None else out_shape)


def _max_mask(a: Array, b: Array) -> Array:
    return (a > b).astype(a.dtype)


def _softmax_vjp(x: Array, w: Array) -> Array:
    p = _softmax(x, 0)
    return p * (w - np.sum(w * p, axis=0, keepdims=True))


def _ce_vjp(x: Array, w: Array) -> Array:
    onehot = np.eye(x.shape[1], dtype=x.dtype)[_LABELS]
    return w * (_softmax(x, 1) - onehot) / x.shape[0]


def _ce_fixed(t: tg.Tape, x: tg.Id) -> Out:
    t, y = tg.leaf(t, _LABELS)
    return tg.cross_entropy(t, x, y)


def _where_fixed(t: tg.Tape, a: tg.Id, b: tg.Id) -> Out:
    t, c = tg.leaf(t, _COND)
    return tg.where(t, c, a, b)


def _ce_weight_grad(t: tg.Tape, x: tg.Id, w1: tg.Id, w2: tg.Id) -> Out:
    """d/dw1 of sum(w2 * d/dx (w1 * cross_entropy(x))): the cotangent slot of the fused
    cross-entropy VJP, differentiated (this records pick_label; one more order, its VJP)."""
    t, loss = _ce_fixed(t, x)
    t, weighted = tg.mul(t, loss, w1)
    t, gx = tg.backward_on_tape(t, weighted, [x])
    t, v = tg.mul(t, gx[x], w2)
    t, s = tg.sum(t, v)
    t, gw = tg.backward_on_tape(t, s, [w1])
    return t, gw[w1]


def _ce_weight_grad_ref(x: Array, w1: Array, w2: Array) -> Any:
    onehot = np.eye(x.shape[1], dtype=x.dtype)[_LABELS]
    return np.sum(w2 * (_softmax(x, 1) - onehot)) / x.shape[0]


def _var_vjp(x: Array, w: Array) -> Array:
    return w[:, None] * 2.0 * (x - np.mean(x, axis=1, keepdims=True)) / (x.shape[1] - 1)


def _second_order_cases() -> list[Case]:
    s = (3, 4)
    return [
        _grad_of1("abs", tg.abs, lambda x, w: w * np.sign(x), s, domain="away0"),
        _grad_of1("gelu", tg.gelu, lambda x, w: w * _dgelu(x), s),
        _grad_of1("gelu_tanh", _gelu_t, lambda x, w: w * _dgelu_tanh(x), s),
        _grad_of2("maximum", tg.maximum, lambda a, b, w: w * _max_mask(a, b), s),
        _grad_of2("minimum (b side)", lambda t, a, b: tg.minimum(t, b, a),
                  lambda a, b, w: w * _max_mask(b, a), s),
        _grad_of1("clip", lambda t, x: tg.clip(t, x, -0.5, 0.8),
                  lambda x, w: w * ((x >= -0.5) & (x <= 0.8)), s),
        _grad_of2("where", _where_fixed, lambda a, b, w: np.where(_COND != 0, w, 0.0), s),
        _grad_of1("logsumexp", lambda t, x: tg.logsumexp(t, x, axis=-1),
                  lambda x, w: w[:, None] * _softmax(x, -1), s, (3,)),
        _grad_of1("softmax(axis=0)", lambda t, x: tg.softmax(t, x, axis=0), _softmax_vjp, s),
        _grad_of1("log_softmax", tg.log_softmax,
                  lambda x, w: w - _softmax(x, -1) * np.sum(w, -1, keepdims=True), s),
        _grad_of1("cross_entropy", _ce_fixed, _ce_vjp, (4, 5), ()),
        Case("grad of grad of cross_entropy (cotangent slot)", _ce_weight_grad,
             _ce_weight_grad_ref, ((4, 5), (), (4, 5))),
        _grad_of1("var(axis=1, ddof=1)", lambda t, x: tg.var(t, x, axis=1, ddof=1), _var_vjp,
                  s, (3,)),
        _grad_of2("mse", tg.mse, lambda a, b, w: w * 2.0 * (a - b) / a.size, s, ()),
    ]


CASES: list[Case] = (
    _elementwise_cases() + _where_cases() + _clip_cases() + _reduce_cases() + _loss_cases()
    + _second_order_cases()
)
