"""Op-table rows for the more elementwise ops, the comparisons and the logical ops.

softplus, silu, leaky_relu, elu, log1p, expm1, sin, cos and erf: forward against numpy, the VJP
against float64 finite differences, and (the "grad of" rows) the VJP of a recorded backward,
which checks the fused helpers softplus_grad, leaky_relu_grad and elu_grad. The comparisons
and logical ops give bool ids that take no gradient, so each row feeds its mask to `where`:
the float result is checked against numpy, and the gradient flows only through where's
branches. Inputs stay away from kinks and ties (leaky_relu and elu away from 0; distinct
random values for comparisons, whose masks then do not flip under finite differences).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg
from cases import BROADCAST_PAIRS, Array, Case, Fn1, Fn2, Out, Ref1, Ref2, case1
from cases_elem import _grad_of1

_erf: Callable[[Array], Array] = np.vectorize(math.erf)


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: Array) -> Array:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _leaky(slope: float) -> tuple[Fn1, Ref1, Ref2]:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return tg.leaky_relu(t, x, slope)

    return (f, lambda x: np.where(x > 0, x, slope * x),
            lambda x, w: w * np.where(x > 0, 1.0, slope))


def _elu(alpha: float) -> tuple[Fn1, Ref1, Ref2]:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        return tg.elu(t, x, alpha)

    return (f, lambda x: np.where(x > 0, x, alpha * np.expm1(x)),
            lambda x, w: w * np.where(x > 0, 1.0, alpha * np.exp(x)))


def _shifted_softplus(t: tg.Tape, x: tg.Id) -> Out:
    """softplus above its threshold (x + 25 > 20 for the table's draws): x itself there."""
    t, y = tg.add(t, x, 25.0)
    return tg.softplus(t, y)


_LEAKY, _LEAKY_02 = _leaky(0.01), _leaky(0.2)
_ELU, _ELU_15 = _elu(1.0), _elu(1.5)

# name: (op, numpy reference, d/dx reference times the cotangent w, input domain)
UNARY: dict[str, tuple[Fn1, Ref1, Ref2, str]] = {
    "softplus": (tg.softplus, _softplus, lambda x, w: w * _sigmoid(x), "any"),
    "softplus above 20": (_shifted_softplus, lambda x: x + 25.0, lambda x, w: w, "any"),
    "silu": (tg.silu, lambda x: x * _sigmoid(x),
             lambda x, w: w * _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x))), "any"),
    "leaky_relu": (*_LEAKY, "away0"),
    "leaky_relu(0.2)": (*_LEAKY_02, "away0"),
    "elu": (*_ELU, "away0"),
    "elu(1.5)": (*_ELU_15, "away0"),
    "log1p": (tg.log1p, np.log1p, lambda x, w: w / (1.0 + x), "positive"),
    "expm1": (tg.expm1, np.expm1, lambda x, w: w * np.exp(x), "any"),
    "sin": (tg.sin, np.sin, lambda x, w: w * np.cos(x), "any"),
    "cos": (tg.cos, np.cos, lambda x, w: -w * np.sin(x), "any"),
    "erf": (tg.erf, _erf, lambda x, w: w * 2.0 / math.sqrt(math.pi) * np.exp(-x * x), "any"),
}


def _unary_cases() -> list[Case]:
    cases = [case1(f"{n}{s}", fn, ref, s, dom) for n, (fn, ref, _, dom) in UNARY.items()
             for s in ((3, 4), ())]
    cases += [_grad_of1(n, fn, dref, (3, 4), domain=dom)
              for n, (fn, _, dref, dom) in UNARY.items()]
    return cases


# --- comparisons and logical ops, each mask feeding where ------------------------------------

COMPARISONS: dict[str, tuple[Fn2, Ref2]] = {
    "greater": (tg.greater, np.greater),
    "greater_equal": (tg.greater_equal, np.greater_equal),
    "less": (tg.less, np.less),
    "less_equal": (tg.less_equal, np.less_equal),
    "equal": (tg.equal, np.equal),
    "not_equal": (tg.not_equal, np.not_equal),
}


def _select(name: str, fn: Fn2, ref: Ref2, shapes: tuple[tuple[int, ...], ...]) -> Case:
    """where(fn(a, b), a, b): a and b broadcast through both the comparison and where."""

    def f(t: tg.Tape, a: tg.Id, b: tg.Id) -> Out:
        t, mask = fn(t, a, b)
        assert mask.dtype == np.bool_
        return tg.where(t, mask, a, b)

    def r(a: Array, b: Array) -> Any:
        return np.where(ref(a, b), a, b)

    return Case(f"where({name}(a, b), a, b){shapes[0]}{shapes[1]}", f, r, shapes)


def _select_scalar(name: str, fn: Fn2, ref: Ref2, c: float, right: bool) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, mask = fn(t, x, c) if right else fn(t, c, x)  # type: ignore[arg-type]
        return tg.where(t, mask, x, 0.0)

    def r(x: Array) -> Any:
        c_ = np.asarray(c, x.dtype)
        return np.where(ref(x, c_) if right else ref(c_, x), x, 0.0)

    return case1(f"where({name}(x, {c}), x, 0)" if right else f"where({name}({c}, x), x, 0)",
                 f, r, (3, 4))


def _equal_case() -> Case:
    """equal and not_equal with true ties: x against itself rounded (a tie wherever rounding
    to 0.5 changes nothing, on the row's fixed halves)."""

    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, y = tg.mul(t, x, 0.0)
        t, halves = tg.add(t, y, 0.5)
        t, same = tg.equal(t, halves, 0.5)  # all True
        t, differ = tg.not_equal(t, x, x)  # all False (no NaN)
        t, either = tg.logical_or(t, same, differ)
        return tg.where(t, either, x, 1.0)

    return case1("where(equal(0.5, 0.5) or not_equal(x, x), x, 1)", f, lambda x: x, (2, 3))


def _logical_case(name: str) -> Case:
    """where(a > 0 <op> b < 0.5, a, b), broadcasting (3, 1) against (4,)."""

    def f(t: tg.Tape, a: tg.Id, b: tg.Id) -> Out:
        t, p = tg.greater(t, a, 0.0)
        t, q = tg.less(t, b, 0.5)
        if name == "logical_and":
            t, m = tg.logical_and(t, p, q)
        elif name == "logical_or":
            t, m = tg.logical_or(t, p, q)
        else:
            t, m = tg.logical_not(t, p)
        return tg.where(t, m, a, b)

    def r(a: Array, b: Array) -> Any:
        p, q = a > 0, b < 0.5
        m = p & q if name == "logical_and" else p | q if name == "logical_or" else ~p
        return np.where(m, a, b)

    return Case(f"where({name}(a > 0, b < 0.5), a, b)", f, r, ((3, 1), (4,)))


def _compare_cases() -> list[Case]:
    cases = [_select(n, fn, ref, pair) for n, (fn, ref) in COMPARISONS.items()
             for pair in BROADCAST_PAIRS[:3]]
    for n, (fn, ref) in COMPARISONS.items():
        cases += [_select_scalar(n, fn, ref, 0.3, True), _select_scalar(n, fn, ref, -0.2, False)]
    cases.append(_equal_case())
    cases += [_logical_case(n) for n in ("logical_and", "logical_or", "logical_not")]
    return cases


CASES: list[Case] = _unary_cases() + _compare_cases()
