"""Comparisons and logical ops: bool ids that take no gradient, made to feed `where`.

They are not expressions of the elementwise registry: its kernels, and the fused kernels of
`_fusion`, hold one type T for every operand and for the result, where a comparison reads
float, int or bool operands and writes bool (stored as uchar). So each is a primitive with
kernels of its own, in the "compare" program of its operands' dtype (built the first time ids
of that dtype are compared, so none adds to the core build), computed when recorded (pending
operands are computed first) and never pending: a bool value cannot join a fused DAG, and a
mask is read by `where`'s cast at once anyway.

Semantics are numpy's: NaN compares False, except `not_equal`, True. Python numbers may stand
on either side and never change the id's dtype; two ids must have one dtype (numpy would
promote int against float; tapegrad asks for an explicit `astype`, as its arithmetic does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._device import FP64_IF_AVAILABLE, LOCAL
from .._errors import DTypeError, NotAnIdError, ShapeError, at_site
from .._kernels import DENSE_PRELUDE, dense_size
from .._primitive import Aval, Primitive, register
from .._tape import Id, Tape, record, takes_tape
from .._tensor import BOOL, C_TYPES, FLOATS, AnyTensor, DType, dtype_name, empty
from .._traced import Traced, TracedInt, is_integer, rounded
from .broadcast import operands
from .elementwise import Operand, number

_COMPARISONS = {"greater": ">", "greater_equal": ">=", "less": "<", "less_equal": "<=",
                "equal": "==", "not_equal": "!="}
_LOGICAL = {"logical_and": "&&", "logical_or": "||"}

# How a Python number travels to a kernel beside an id: in the id's own type for float ids
# (numpy's weak scalars: x32 > 0.1 compares with float32(0.1)); for int and bool ids as a long
# when it is an int of int64's range, else as a double (the id's values converted to double,
# as numpy compares int64 with a float).
_SCALAR_TYPES = {"l": ("long", np.dtype(np.int64)), "d": ("double", np.dtype(np.float64))}
_INT64 = (-(2 ** 63), 2 ** 63)


def _scalar_kinds(dtype: DType) -> list[str]:
    return ["t"] if dtype in FLOATS else ["l", "d"]


def _source(dtype: DType) -> str:
    """Every comparison over `dtype` (and for bool, the logical ops): one kernel per op and
    per operand pattern (two buffers; a buffer and a number on either side), writing uchar."""
    t = C_TYPES[dtype]
    parts = [FP64_IF_AVAILABLE, DENSE_PRELUDE]

    def kernel(name: str, params: Sequence[str], value: str, double: bool) -> None:
        head = f"__kernel void {name}(__global uchar* res_, {', '.join(params)}, const long n)"
        body = f"{head} {{\n  TG_EACH(n) res_[i] = ({value}) ? 1 : 0;\n}}\n"
        parts.append(f"#ifdef cl_khr_fp64\n{body}#endif\n" if double else body)

    ops = dict(_COMPARISONS, **(_LOGICAL if dtype == BOOL else {}))
    for name, op in ops.items():
        kernel(f"{name}__bb", [f"__global const {t}* a_", f"__global const {t}* b_"],
               f"a_[i] {op} b_[i]", dtype == np.float64)
        for kind in _scalar_kinds(dtype):
            s, double = (t, dtype == np.float64) if kind == "t" else (
                _SCALAR_TYPES[kind][0], kind == "d" or dtype == np.float64)
            kernel(f"{name}__bs{kind}", [f"__global const {t}* a_", f"const {s} b"],
                   f"a_[i] {op} b", double)
            kernel(f"{name}__sb{kind}", [f"const {s} a", f"__global const {t}* b_"],
                   f"a {op} b_[i]", double)
    if dtype == BOOL:
        kernel("logical_not__b", [f"__global const {t}* a_"], "!a_[i]", False)
    return "".join(parts)


def _run(dev: Any, op: str, args: Sequence[Any], shape: tuple[int, ...]) -> AnyTensor:
    """The bool result of `op` over equal-shape tensors and numbers, by its kernel."""
    dtype: DType = next(a for a in args if isinstance(a, AnyTensor)).dtype
    flags = ""
    kinds = ""
    for a in args:
        if isinstance(a, AnyTensor):
            flags += "b"
        else:
            kind = "t" if dtype in FLOATS else "l" if is_integer(a) else "d"
            flags, kinds = flags + "s", kind
    out = empty(shape, BOOL, dev)
    if out.size:
        kernel = dev.kernel("compare", dtype_name(dtype), f"{op}__{flags}{kinds}",
                            lambda: _source(dtype))
        dev.launch(kernel, dense_size(out.size), (LOCAL,), out.buffer,
                   *[a.buffer if isinstance(a, AnyTensor) else a for a in args], out.size)
    return out


def _make(op: str, arity: int, doc: str) -> Primitive[None]:
    """Register the primitive of a comparison or logical op (no VJP: its nodes never require
    a gradient, whatever their operands)."""

    def rule(args: Sequence[Any], params: None) -> Aval:
        tensors = [a for a in args if not isinstance(a, int | float | Traced)]
        if len(args) != arity or not tensors:
            raise ShapeError(f"{op}: takes {arity} operands, at least one a tensor")
        first = tensors[0]
        for a in tensors[1:]:
            if a.shape != first.shape or a.dtype != first.dtype:
                raise ShapeError(at_site(
                    f"{op}: operands must share shape and dtype after broadcasting; got "
                    f"{first.shape} {first.dtype} and {a.shape} {a.dtype}"))
        if op.startswith("logical") and first.dtype != BOOL:
            raise DTypeError(at_site(f"{op}: needs bool operands, got {first.dtype}"))
        return Aval(first.shape, BOOL)

    def forward(dev: Any, args: Sequence[Any], params: None, aval: Aval) -> AnyTensor:
        return _run(dev, op, args, aval.shape)

    return register(Primitive(op, rule, forward, None, doc))


GREATER = _make("greater", 2, "a > b, a bool mask (False where either is NaN)")
GREATER_EQUAL = _make("greater_equal", 2, "a >= b, a bool mask (False where either is NaN)")
LESS = _make("less", 2, "a < b, a bool mask (False where either is NaN)")
LESS_EQUAL = _make("less_equal", 2, "a <= b, a bool mask (False where either is NaN)")
EQUAL = _make("equal", 2, "a == b, a bool mask (False where either is NaN)")
NOT_EQUAL = _make("not_equal", 2, "a != b, a bool mask (True where either is NaN)")
LOGICAL_AND = _make("logical_and", 2, "a and b over bool operands")
LOGICAL_OR = _make("logical_or", 2, "a or b over bool operands")
LOGICAL_NOT = _make("logical_not", 1, "not a over a bool operand")


# --- the public ops --------------------------------------------------------------------------


def _scalar_for(v: int | float, dtype: DType) -> int | float:
    """A Python number as its kernel takes it beside ids of `dtype` (see `_SCALAR_TYPES`)."""
    if dtype in FLOATS:  # `number` checked that an int fits a double
        # as float32 takes it; a traced threshold stays traced under tg.jit
        return rounded(v, lambda x: float(dtype.type(x)))
    if isinstance(v, float):
        return v
    if not isinstance(v, TracedInt):  # a traced int stays traced: its comparisons are guards
        v = int(v)  # a bool is 0 or 1
    if _INT64[0] <= v < _INT64[1]:
        return v
    # Beyond int64 every int id's value is smaller (or larger): infinity compares the same.
    return float("inf") if v > 0 else float("-inf")


def _ids_of(tape: Tape, op: str, values: Sequence[Id | int | float],
            names: Sequence[str]) -> list[tuple[str, Id]]:
    ids = [(name, v) for name, v in zip(names, values, strict=True) if isinstance(v, Id)]
    if not ids:
        shown = ", ".join(repr(v) for v in values)
        raise NotAnIdError(at_site(
            f"{op}: {' and '.join(names)} are all numbers ({shown}); at least one must be an "
            "Id (make one with tg.leaf)"))
    for name, v in ids:
        tape.node(v, op, name)
    return ids


def _compare(tape: Tape, prim: Primitive[None], a: Operand, b: Operand) -> tuple[Tape, Id]:
    op = prim.name
    if type(a) is Id and (type(b) is float or (
            type(b) is Id and b.shape == a.shape and b.dtype == a.dtype)):
        # An id and a Python float, or two ids alike (a mask's usual making): nothing to
        # convert or broadcast, only the ids to check.
        tape.node(a, op, "a")
        if isinstance(b, Id):
            tape.node(b, op, "b")
            return record(tape, prim, [a, b])
        return record(tape, prim, [a, _scalar_for(b, a.dtype)])
    values = [number(op, "a", a), number(op, "b", b)]
    ids = _ids_of(tape, op, values, ["a", "b"])
    if len(ids) == 2 and ids[0][1].dtype != ids[1][1].dtype:
        (_, x), (_, y) = ids
        raise DTypeError(at_site(
            f"{op}: operands have different dtypes (a is {dtype_name(x.dtype)}, b is "
            f"{dtype_name(y.dtype)}); tapegrad compares ids of one dtype (numpy would "
            f"promote): convert one with tg.astype(tape, a, np.{dtype_name(y.dtype)}) or "
            f"tg.astype(tape, b, np.{dtype_name(x.dtype)})"))
    dtype = ids[0][1].dtype
    tape, broadcast = operands(tape, op, [v for _, v in ids], [n for n, _ in ids],
                               floats_only=False)
    shared = iter(broadcast)
    args = [next(shared) if isinstance(v, Id) else _scalar_for(v, dtype) for v in values]
    return record(tape, prim, args)


def _logical_operand(op: str, name: str, value: object) -> Id | bool:
    flag: Any = value  # narrowing numpy's generic types would leave them partially unknown
    v = bool(flag) if isinstance(value, np.bool_) else value
    if isinstance(v, Id):
        if v.dtype != BOOL:
            raise DTypeError(at_site(
                f"{op}: argument {name!r} has dtype {dtype_name(v.dtype)}, expected bool; "
                f"compare first to make a bool id, e.g. tg.not_equal(tape, {name}, 0)"))
        return v
    if isinstance(v, bool):
        return v
    raise DTypeError(at_site(
        f"{op}: argument {name!r} must be an Id of dtype bool or a Python bool, not "
        f"{type(v).__name__}"))


def _logical(tape: Tape, prim: Primitive[None], values: Sequence[object]) -> tuple[Tape, Id]:
    op = prim.name
    names = ["a", "b"] if len(values) == 2 else ["x"]
    checked = [_logical_operand(op, n, v) for n, v in zip(names, values, strict=True)]
    ids = _ids_of(tape, op, checked, names)
    tape, broadcast = operands(tape, op, [v for _, v in ids], [n for n, _ in ids],
                               floats_only=False)
    shared = iter(broadcast)
    args = [next(shared) if isinstance(v, Id) else int(v) for v in checked]
    return record(tape, prim, args)


@takes_tape
def greater(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a > b elementwise, broadcasting: a bool id that takes no gradient (a mask for `where`).

    a and b are ids of one dtype (float, int or bool) or Python numbers, which never change the
    id's dtype (numpy's weak scalars). NaN compares False, as in numpy and PyTorch.
    """
    return _compare(tape, GREATER, a, b)


@takes_tape
def greater_equal(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a >= b elementwise, broadcasting: a bool id, no gradient; NaN compares False."""
    return _compare(tape, GREATER_EQUAL, a, b)


@takes_tape
def less(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a < b elementwise, broadcasting: a bool id, no gradient; NaN compares False."""
    return _compare(tape, LESS, a, b)


@takes_tape
def less_equal(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a <= b elementwise, broadcasting: a bool id, no gradient; NaN compares False."""
    return _compare(tape, LESS_EQUAL, a, b)


@takes_tape
def equal(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a == b elementwise, broadcasting: a bool id, no gradient; NaN equals nothing, itself
    included (numpy's and PyTorch's `==`)."""
    return _compare(tape, EQUAL, a, b)


@takes_tape
def not_equal(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a != b elementwise, broadcasting: a bool id, no gradient; True wherever either is NaN."""
    return _compare(tape, NOT_EQUAL, a, b)


@takes_tape
def logical_and(tape: Tape, a: Id | bool, b: Id | bool) -> tuple[Tape, Id]:
    """a and b elementwise, broadcasting, over bool ids (or a Python bool on one side).

    Other dtypes are refused (numpy would take nonzero for True): compare first, e.g.
    `tg.not_equal(tape, x, 0)`. The result is a bool id that takes no gradient.
    """
    return _logical(tape, LOGICAL_AND, [a, b])


@takes_tape
def logical_or(tape: Tape, a: Id | bool, b: Id | bool) -> tuple[Tape, Id]:
    """a or b elementwise, broadcasting, over bool ids (or a Python bool on one side)."""
    return _logical(tape, LOGICAL_OR, [a, b])


@takes_tape
def logical_not(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """not x elementwise over a bool id; a bool id that takes no gradient."""
    return _logical(tape, LOGICAL_NOT, [x])
