"""Op-table rows for the shape ops (see cases.py for the row format).

Integer index inputs are made inside a row's fn (`tg.leaf` of an int array), so the float inputs
stay the only checked arguments. The "grad(...)" rows differentiate a recorded backward, which
checks the VJPs of the VJP primitives (slice_grad, take_grad) against finite differences.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg
from cases import Array, Case, Out, case1


def _slice_case(index: Any, shape: tuple[int, ...], label: str) -> Case:
    return case1(f"slice[{label}]{shape}", lambda t, x: tg.slice(t, x, index),
                 lambda x: x[index], shape)


def _slice_cases() -> list[Case]:
    rows: list[tuple[Any, tuple[int, ...], str]] = [
        (np.s_[1:, ::-2], (4, 5), "1:, ::-2"),
        (np.s_[::-1], (4, 5), "::-1"),
        (np.s_[::-1, ::-1], (3, 4), "::-1, ::-1"),
        (np.s_[:, 5:1:-2], (3, 6), ":, 5:1:-2"),
        (np.s_[2], (4, 5), "2"),
        (np.s_[-1, :, ::-3], (3, 4, 5), "-1, :, ::-3"),
        (np.s_[..., None, 2], (3, 4, 5), "..., None, 2"),
        (np.s_[None, 1, ..., 1:4:2], (3, 4, 5), "None, 1, ..., 1:4:2"),
        (np.s_[-2:, None, -3::-1], (4, 5), "-2:, None, -3::-1"),
        (np.s_[1, -2], (3, 4), "1, -2"),
        (np.s_[0:1, 1:3, 2], (2, 3, 4), "0:1, 1:3, 2"),
        (np.s_[-100:100:3], (7,), "-100:100:3"),
        (np.s_[3:1], (4, 5), "3:1 (empty)"),
        # These keep every element in order: recorded as free reshapes.
        (np.s_[...], (2, 3), "..."),
        (np.s_[None], (2, 3), "None"),
        (np.s_[0], (1, 4), "0 on a size-1 axis"),
    ]
    return [_slice_case(index, shape, label) for index, shape, label in rows]


def _expand_squeeze_cases() -> list[Case]:
    cases: list[Case] = []
    for axis in (0, -1, 1, (0, 2), (-1, 1), (0, -1)):
        cases.append(case1(f"expand_dims(axis={axis})",
                           lambda t, x, a=axis: tg.expand_dims(t, x, a),
                           lambda x, a=axis: np.expand_dims(x, a), (2, 3)))
    for axis in (None, 0, -2, (0, 2), (-2,)):
        cases.append(case1(f"squeeze(axis={axis})", lambda t, x, a=axis: tg.squeeze(t, x, a),
                           lambda x, a=axis: np.squeeze(x, a), (1, 3, 1, 4)))
    cases.append(case1("squeeze(scalar-like)", lambda t, x: tg.squeeze(t, x),
                       lambda x: np.squeeze(x), (1, 1)))
    return cases


def _concat_case(shapes: tuple[tuple[int, ...], ...], axis: int) -> Case:
    def f(t: tg.Tape, *xs: tg.Id) -> Out:
        return tg.concat(t, list(xs), axis=axis)

    def r(*xs: Array) -> Array:
        return np.concatenate(xs, axis=axis)

    return Case(f"concat(axis={axis}){shapes}", f, r, shapes)


def _stack_case(shape: tuple[int, ...], count: int, axis: int) -> Case:
    def f(t: tg.Tape, *xs: tg.Id) -> Out:
        return tg.stack(t, list(xs), axis=axis)

    def r(*xs: Array) -> Array:
        return np.stack(xs, axis=axis)

    return Case(f"stack(axis={axis}){count}x{shape}", f, r, (shape,) * count)


def _concat_stack_cases() -> list[Case]:
    return [
        _concat_case(((2, 3), (4, 3)), 0),
        _concat_case(((2, 3), (2, 1), (2, 2)), 1),
        _concat_case(((2, 3), (2, 1), (2, 2)), -1),
        _concat_case(((2, 1, 3), (2, 3, 3), (2, 2, 3)), 1),
        _concat_case(((2, 2, 3), (1, 2, 3)), -3),
        _concat_case(((2, 3, 1), (2, 3, 2)), 2),
        _concat_case(((2, 0), (2, 3)), 1),
        _concat_case(((3, 2),), 0),
        _stack_case((2, 3), 2, 0),
        _stack_case((2, 3), 3, 1),
        _stack_case((2, 3), 2, -1),
        _stack_case((2, 3), 2, -2),
        _stack_case((), 3, 0),
        _stack_case((3,), 10, 1),  # more parts than one launch writes
        _stack_case((2, 3), 1, 1),
        _stack_case((2, 0), 3, 1),
    ]


def _pad_cases() -> list[Case]:
    rows: list[tuple[Any, tuple[int, ...]]] = [
        (((1, 2), (0, 3)), (2, 3)),
        (((0, 0), (2, 1), (1, 0)), (2, 3, 2)),
        (((3, 0),), (4,)),
        (1, (2, 3)),
        ((1, 2), (2, 3)),
        (((2, 1),), (2, 2)),
        (((0, 0), (0, 0)), (2, 2)),
        (((1, 1), (0, 2)), (0, 2)),
    ]
    return [case1(f"pad({w}){s}", lambda t, x, w=w: tg.pad(t, x, w),
                  lambda x, w=w: np.pad(x, w), s) for w, s in rows]


def _take_case(name: str, shape: tuple[int, ...], idx: Array, axis: int | None) -> Case:
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, i = tg.leaf(t, idx)
        return tg.take(t, x, i, axis=axis)

    return case1(f"take({name}, axis={axis}){shape}", f,
                 lambda x: np.take(x, idx, axis=axis), shape)


def _take_cases() -> list[Case]:
    i64, i32 = np.int64, np.int32
    return [
        _take_case("repeated", (4, 3), np.array([1, 3, 1, 1, 0], i64), 0),
        _take_case("repeated, negative", (4, 3), np.array([-1, 3, -4, 0, 0], i64), 0),
        _take_case("2-D repeated", (2, 4, 3), np.array([[0, 3, 3], [3, 1, 0]], i64), 1),
        _take_case("2-D int32", (2, 4, 3), np.array([[2, 2], [2, -2]], i32), 1),
        _take_case("last axis", (2, 3, 4), np.array([3, 0, 3], i64), -1),
        _take_case("scalar index", (3, 4), np.array(2, i64), 1),
        _take_case("flat", (2, 3), np.array([5, 0, 5, -6], i64), None),
        _take_case("empty indices", (3, 2), np.zeros((0, 2), i64), 0),
        _take_case("into 1-D", (5,), np.array([[4, 4], [4, 0], [1, 2]], i32), 0),
    ]


def _embedding(t: tg.Tape, table: tg.Id) -> Out:
    t, i = tg.leaf(t, np.array([[1, 4, 1], [0, 1, 4]], np.int64))
    return tg.embedding(t, table, i)


def _stop_gradient(t: tg.Tape, x: tg.Id) -> Out:
    # x + (sg(x) - sg(x)): the value is x and, as finite differences see, so is the gradient;
    # tests/test_ops_shape.py checks that no gradient passes through stop_gradient.
    t, a = tg.stop_gradient(t, x)
    t, b = tg.stop_gradient(t, x)
    t, d = tg.sub(t, a, b)
    return tg.add(t, x, d)


def _cube_grad(op: Callable[[tg.Tape, tg.Id], Out]) -> Callable[[tg.Tape, tg.Id], Out]:
    """grad of sum(op(x)**3) with respect to x, recorded on the tape: a function whose own
    VJP runs the VJPs of op's VJP primitives."""
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, y = op(t, x)
        t, y2 = tg.mul(t, y, y)
        t, y3 = tg.mul(t, y2, y)
        t, loss = tg.sum(t, y3)
        t, grads = tg.backward_on_tape(t, loss, [x])
        return t, grads[x]
    return f


_IDX = np.array([[2, 0], [2, 2]], np.int64)


def _second_order_cases() -> list[Case]:
    index = np.s_[::-2, 1:]

    def slice_ref(x: Array) -> Array:
        out = np.zeros_like(x)
        out[index] = 3 * x[index] ** 2
        return out

    def take_ref(x: Array) -> Array:
        out = np.zeros_like(x)
        g = 3 * np.take(x, _IDX, axis=1) ** 2
        where: Any = (slice(None), _IDX)
        np.add.at(out, where, g)
        return out

    def take_fn(t: tg.Tape, x: tg.Id) -> Out:
        t, i = tg.leaf(t, _IDX)
        return tg.take(t, x, i, axis=1)

    def pad_ref(x: Array) -> Array:
        return 3 * x ** 2

    def concat_fn(t: tg.Tape, x: tg.Id) -> Out:
        return tg.concat(t, [x, x], axis=1)

    def slice_fn(t: tg.Tape, x: tg.Id) -> Out:
        return tg.slice(t, x, index)

    def pad_fn(t: tg.Tape, x: tg.Id) -> Out:
        return tg.pad(t, x, ((1, 0), (2, 1)))

    return [
        case1("grad(sum(slice(x)**3))", _cube_grad(slice_fn),
              slice_ref, (5, 3)),
        case1("grad(sum(take(x)**3))", _cube_grad(take_fn), take_ref, (2, 3)),
        case1("grad(sum(pad(x)**3))", _cube_grad(pad_fn),
              pad_ref, (2, 3)),
        case1("grad(sum(concat([x, x])**3))", _cube_grad(concat_fn), lambda x: 6 * x ** 2,
              (2, 3)),
    ]


CASES: list[Case] = (
    _slice_cases() + _expand_squeeze_cases() + _concat_stack_cases() + _pad_cases()
    + _take_cases()
    + [case1("embedding", _embedding, lambda x: x[np.array([[1, 4, 1], [0, 1, 4]])], (5, 3)),
       case1("stop_gradient", _stop_gradient, lambda x: x, (2, 3))]
    + _second_order_cases()
)
