"""Op-table rows for tril/triu, argmax/argmin, cumsum and split (see cases.py for the row
format).

argmax and argmin return int64 ids, so their rows add the index (cast to x's dtype) to a sum
of x: the value checks the index against numpy, and the gradient (that of the sum; the index
takes none) runs a backward through a tape holding them. The "grad(...)" rows differentiate a
recorded backward, so the VJPs of the VJP primitives (cumsum_reverse, the masks again) are
checked against finite differences too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg
from cases import Array, Case, Out, case1


def _triangle_cases() -> list[Case]:
    cases: list[Case] = []
    for shape in ((4, 5), (2, 3, 4), (5, 3), (2, 1, 3, 3)):
        for k in (-2, 0, 1, 4):
            cases.append(case1(f"tril(k={k}){shape}", lambda t, x, k=k: tg.tril(t, x, k),
                               lambda x, k=k: np.tril(x, k), shape))
            cases.append(case1(f"triu(k={k}){shape}", lambda t, x, k=k: tg.triu(t, x, k=k),
                               lambda x, k=k: np.triu(x, k), shape))
    cases.append(case1("tril(default)", tg.tril, np.tril, (3, 3)))
    cases.append(case1("triu(default)", tg.triu, np.triu, (3, 3)))
    return cases


def _arg_case(kind: str, axis: int | None, keepdims: bool, shape: tuple[int, ...]) -> Case:
    op = tg.argmax if kind == "argmax" else tg.argmin
    ref_op = np.argmax if kind == "argmax" else np.argmin

    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, i = op(t, x, axis=axis, keepdims=keepdims)
        t, fi = tg.astype(t, i, x.dtype)
        t, s = tg.sum(t, x, axis=axis, keepdims=keepdims)
        return tg.add(t, s, fi)

    def ref(x: Array) -> Array:
        index = ref_op(x, axis=axis, keepdims=keepdims)
        return np.sum(x, axis=axis, keepdims=keepdims) + index.astype(x.dtype)

    return case1(f"{kind}(axis={axis}, keepdims={keepdims}){shape}", f, ref, shape)


def _arg_cases() -> list[Case]:
    return [_arg_case(kind, axis, keep, shape)
            for kind in ("argmax", "argmin")
            for axis, keep, shape in ((None, False, (3, 4)), (None, True, (2, 3, 2)),
                                      (0, False, (4, 3)), (-1, True, (2, 3, 4)),
                                      (1, False, (2, 5, 3)), (0, False, (6,)))]


def _cumsum_cases() -> list[Case]:
    rows: list[tuple[int | None, tuple[int, ...]]] = [
        (0, (5,)), (0, (4, 3)), (1, (4, 3)), (-1, (2, 3, 4)), (1, (2, 3, 4)), (-3, (2, 3, 4)),
        (None, (3, 4)), (None, ()), (0, (1, 3)), (1, (3, 0)),
    ]
    return [case1(f"cumsum(axis={a}){s}", lambda t, x, a=a: tg.cumsum(t, x, a),
                  lambda x, a=a: np.cumsum(x, a), s) for a, s in rows]


def split_join(sections: Any, axis: int) -> Callable[[tg.Tape, tg.Id], Out]:
    """split, the pieces scaled by 1, 2, 3... and joined again: every piece reaches the
    output, each with a gradient of its own (also test_against_torch's split row)."""
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, pieces = tg.split(t, x, sections, axis=axis)
        scaled: list[tg.Id] = []
        for i, piece in enumerate(pieces):
            t, piece = tg.mul(t, piece, float(i + 1))
            scaled.append(piece)
        return tg.concat(t, scaled, axis=axis)
    return f


def _split_case(sections: Any, axis: int, shape: tuple[int, ...]) -> Case:
    f = split_join(sections, axis)

    def ref(x: Array) -> Array:
        pieces = np.split(x, sections, axis=axis)
        return np.concatenate([p * (i + 1) for i, p in enumerate(pieces)], axis=axis)

    return case1(f"split({sections}, axis={axis}){shape}", f, ref, shape)


def _split_cases() -> list[Case]:
    return [
        _split_case(3, 0, (6, 2)),
        _split_case(2, -1, (2, 3, 4)),
        _split_case([1, 3], 1, (2, 5)),
        _split_case([2, 1, 7], 0, (5, 2)),  # an empty piece (2:1) and a clamped one (7:)
        _split_case([-2], -1, (3, 4)),
        _split_case(1, 0, (3, 2)),
    ]


def _cube_grad(op: Callable[[tg.Tape, tg.Id], Out]) -> Callable[[tg.Tape, tg.Id], Out]:
    """grad of sum(op(x)**3) with respect to x, recorded on the tape."""
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, y = op(t, x)
        t, y2 = tg.mul(t, y, y)
        t, y3 = tg.mul(t, y2, y)
        t, loss = tg.sum(t, y3)
        t, grads = tg.backward_on_tape(t, loss, [x])
        return t, grads[x]
    return f


def _reverse_cumsum(g: Array, axis: int) -> Array:
    return np.flip(np.cumsum(np.flip(g, axis), axis), axis)


def _second_order_cases() -> list[Case]:
    def cumsum_ref(x: Array) -> Array:
        return _reverse_cumsum(3 * np.cumsum(x, 1) ** 2, 1)

    return [
        case1("grad(sum(tril(x, -1)**3))", _cube_grad(lambda t, x: tg.tril(t, x, -1)),
              lambda x: 3 * np.tril(x, -1) ** 2, (2, 3, 4)),
        case1("grad(sum(triu(x, 1)**3))", _cube_grad(lambda t, x: tg.triu(t, x, 1)),
              lambda x: 3 * np.triu(x, 1) ** 2, (4, 3)),
        case1("grad(sum(cumsum(x, 1)**3))", _cube_grad(lambda t, x: tg.cumsum(t, x, 1)),
              cumsum_ref, (2, 4, 3)),
        case1("grad(sum(split(x)[1]**3))",
              _cube_grad(lambda t, x: (lambda r: (r[0], r[1][1]))(tg.split(t, x, [1, 3], 1))),
              lambda x: np.concatenate([0 * x[:, :1], 3 * x[:, 1:3] ** 2, 0 * x[:, 3:]], 1),
              (2, 5)),
    ]


CASES: list[Case] = (_triangle_cases() + _arg_cases() + _cumsum_cases() + _split_cases()
                     + _second_order_cases())
