"""Reductions over axes: the public sum, max, min, logsumexp, mean and var.

The max, min and logsumexp primitives are here; `sum` is `broadcast.SUM` (broadcasting's
transpose), and mean and var are built on the primitives. Their kernels are `_reduction`'s.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import (
    ArgumentTypeError,
    DTypeError,
    ShapeError,
    at_site,
    call_site,
    flag,
    number,
    shown,
)
from .._fusion import elementwise
from .._kernels import KAHAN, VEC8, launch_size, register_expression
from .._primitive import Aval, Emitter, Primitive, register
from .._reduction import blocks, keep_shape, parts_of, reduce_tensor, reduction_source
from .._tape import Id, Tape, record, record_checked, takes_tape
from .._tensor import C_TYPES, AnyTensor, DType, Shape, dtype_name, empty, is_float
from .._traced import is_integer
from . import elementwise as _ew
from .broadcast import (
    BROADCAST_TO,
    SUM,
    BroadcastParams,
    ReduceParams,
    broadcast_tensor,
    reduced_shape,
    reduction_forward,
    reduction_rule,
    to_keep,
)


def _extremum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
                  needs: Sequence[bool]) -> list[Any]:
    """Ties share the gradient evenly (PyTorch's amax/amin and full max/min do the same)."""
    (x,) = args
    shape = x.shape
    full = BroadcastParams(shape)
    out_b = e.apply(BROADCAST_TO, [to_keep(e, out, shape, p)], full)
    mask = e.apply(_ew.EQUAL, [x, out_b])
    count = e.apply(SUM, [mask], ReduceParams(p.axes, True))
    share = e.apply(_ew.DIV, [to_keep(e, g, shape, p), count])
    return [e.apply(_ew.MUL, [mask, e.apply(BROADCAST_TO, [share], full)])]


MAX: Primitive[ReduceParams] = register(Primitive(
    "max", reduction_rule("max"), reduction_forward("max"), _extremum_vjp,
    doc="Maximum over axes; NaN propagates; ties split the gradient evenly."))
MIN: Primitive[ReduceParams] = register(Primitive(
    "min", reduction_rule("min"), reduction_forward("min"), _extremum_vjp,
    doc="Minimum over axes; NaN propagates; ties split the gradient evenly."))


# logsumexp's forward: m = max, then log(sum(exp(x - m))) + m. An infinite m is replaced by 0 in
# the shift, so a row holding +inf gives +inf and a row of -inf (or an empty axis) gives -inf,
# never inf - inf. These two expressions are kernels only, not primitives.
_LSE_SHIFT_EXP = register_expression("lse_shift_exp", 2, "exp(a - (isinf(b) ? (T)0 : b))")
_LSE_FINISH = register_expression("lse_finish", 2, "log(a) + (isinf(b) ? (T)0 : b)")


def _lse_rule(args: Sequence[Any], p: ReduceParams) -> Aval:
    (x,) = args
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"logsumexp: x has dtype {x.dtype}, expected float32 or "
                                 "float64 (convert with tg.astype(tape, x, np.float32))"))
    return Aval(reduced_shape(x.shape, p), x.dtype)


def _lse_forward(dev: Device, args: Sequence[AnyTensor], p: ReduceParams, aval: Aval
                 ) -> AnyTensor:
    (x,) = args
    runs = blocks(x.shape, p.axes)
    if len(runs) <= 1:
        i0, i1 = runs[0] if runs else (x.ndim, x.ndim)
        a, k, b = (math.prod(x.shape[:i0]), math.prod(x.shape[i0:i1]),
                   math.prod(x.shape[i1:]))
        if parts_of(a, k, b) == 1:
            # One block of axes, and enough outputs or a small whole: one pass, one launch.
            out = empty(aval.shape, x.dtype, dev)
            if out.size:
                rows = b == 1  # contiguous rows: eight lanes at a time
                kernel = dev.kernel("reduce", dtype_name(x.dtype),
                                    "reduce_logsumexp_rows" if rows else "reduce_logsumexp",
                                    lambda: reduction_source(x.dtype))
                sizes = (k, out.size) if rows else (k, b, out.size)
                dev.launch(kernel, launch_size(out.size), (LOCAL,), out.buffer, x.buffer,
                           *(np.int64(v) for v in sizes))
            return out
    # Several blocks of axes, or a long axis with few outputs: the split max and sum passes.
    m, total = shifted_sumexp(x, p.axes)
    keep = keep_shape(x.shape, p.axes)
    return elementwise(_LSE_FINISH, [total, m], keep, x.dtype, dev).with_shape(aval.shape)


def shifted_sumexp(x: AnyTensor, axes: Sequence[int]) -> tuple[AnyTensor, AnyTensor]:
    """(m, sum(exp(x - m))) over `axes`, kept as size-1 dims, with m the maximum (0 where it is
    infinite): the passes of a logsumexp too long or too scattered for one fused kernel."""
    keep = keep_shape(x.shape, axes)
    m = reduce_tensor(x, "max", axes, keep)
    shifted = elementwise(_LSE_SHIFT_EXP, [x, broadcast_tensor(m, x.shape)], x.shape, x.dtype,
                          x.device)
    return m, reduce_tensor(shifted, "sum", axes, keep)


def _lse_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
             needs: Sequence[bool]) -> list[Any]:
    """g * softmax(x), the softmax taken as exp(x - out) from the stored result."""
    (x,) = args
    full = BroadcastParams(x.shape)
    gb = e.apply(BROADCAST_TO, [to_keep(e, g, x.shape, p)], full)
    ob = e.apply(BROADCAST_TO, [to_keep(e, out, x.shape, p)], full)
    return [e.apply(_ew.MUL_EXP_SUB, [gb, x, ob])]


LOGSUMEXP: Primitive[ReduceParams] = register(Primitive(
    "logsumexp", _lse_rule, _lse_forward, _lse_vjp,
    doc="log(sum(exp(x))) over axes, shifted by the maximum (no overflow); -inf over an empty "
        "axis; the VJP is g * softmax(x)."))


def normalize_axes(op: str, axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """`axis` as sorted non-negative ints: None means all; negatives count from the end."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int | np.integer | str) or not isinstance(axis, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raw: list[object] = [axis]
    else:
        raw = list(cast(Sequence[object], axis))
    out: list[int] = []
    for a in raw:
        if not is_integer(a):
            raise ArgumentTypeError(at_site(f"{op}: axis entries must be ints, got {shown(a)}"))
        a = operator.index(a)  # pyright: ignore[reportUnknownArgumentType]
        if not -ndim <= a < ndim:
            raise ShapeError(at_site(
                f"{op}: axis {a} is out of range for a tensor of rank {ndim}"
                + (f" (valid: {-ndim}..{ndim - 1})" if ndim else " (it has no axes)")))
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(at_site(f"{op}: axis {tuple(raw)} repeats an axis"))
    return tuple(sorted(out))


Axis = int | Sequence[int] | None


def _reduce(tape: Tape, prim: Primitive[ReduceParams], x: Id, axis: Axis, keepdims: bool
            ) -> tuple[Tape, Id]:
    tape.node(x, prim.name, "x")
    tape, y, _ = _record_reduce(tape, prim, x, axis, keepdims, prim.name)
    return tape, y


def _record_reduce(tape: Tape, prim: Primitive[ReduceParams], x: Id, axis: Axis,
                   keepdims: bool, op: str) -> tuple[Tape, Id, ReduceParams]:
    """`prim` over `axis` of x recorded (bad arguments raise, naming the public op `op`), and
    its params. The common call (all axes, or one, and a plain bool) takes its (params, aval)
    kept per shape (`_kept_reduce`): a model reduces the same shapes every step."""
    plain = (axis is None or axis.__class__ is int) and (keepdims is True or keepdims is False)
    params, aval = (_kept_reduce if plain else _reduce_params)(
        prim, x.shape, x.dtype, axis, keepdims, op)
    tape, y = record_checked(tape, prim, x, params, aval, call_site())
    return tape, y, params


def _reduce_params(prim: Primitive[ReduceParams], shape: Shape, dtype: DType, axis: Axis,
                   keepdims: bool, op: str) -> tuple[ReduceParams, Aval]:
    """`prim` over `axis` of an x of `shape` and `dtype` as its (params, aval), checked by its
    rule."""
    params = ReduceParams(normalize_axes(op, axis, len(shape)), flag(op, "keepdims", keepdims))
    return params, prim.rule([Aval(shape, dtype)], params)


# Bad axes raise, and are not kept.
_kept_reduce = functools.lru_cache(maxsize=1 << 12)(_reduce_params)


@takes_tape
def sum(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False) -> tuple[Tape, Id]:
    """Sum over `axis` (None: all axes; an int or tuple, negatives allowed).

    A bool or integer x sums to int64, as in PyTorch and numpy (a mask counted): summed in
    float64, exact while the sums stay within 2**53 (float32 on a device without doubles:
    2**24); it takes no gradient."""
    tape.node(x, "sum", "x")
    if x.dtype.kind in "biu":
        wide_type = np.float64 if tape.device.has_fp64 else np.float32
        tape, wide = _ew.astype(tape, x, wide_type)
        tape, total = _reduce(tape, SUM, wide, axis, keepdims)
        return _ew.astype(tape, total, np.int64)
    return _reduce(tape, SUM, x, axis, keepdims)


@takes_tape
def max(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False) -> tuple[Tape, Id]:
    """Maximum over `axis`; tied maxima share the gradient evenly."""
    return _reduce(tape, MAX, x, axis, keepdims)


@takes_tape
def min(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False) -> tuple[Tape, Id]:
    """Minimum over `axis`; tied minima share the gradient evenly."""
    return _reduce(tape, MIN, x, axis, keepdims)


@takes_tape
def mean(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False) -> tuple[Tape, Id]:
    """Mean over `axis`: a sum scaled by 1/count (NaN over an empty axis, as numpy)."""
    tape.node(x, "mean", "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"mean: needs a float32 or float64 tensor, got {dtype_name(x.dtype)} (convert with "
            "tg.astype)"))
    tape, total, params = _record_reduce(tape, SUM, x, axis, keepdims, "mean")
    count = math.prod(x.shape[a] for a in params.axes)
    return _ew.mul(tape, total, 1.0 / count if count else math.nan)


@takes_tape
def logsumexp(tape: Tape, x: Id, axis: Axis = -1, keepdims: bool = False) -> tuple[Tape, Id]:
    """log(sum(exp(x))) over `axis` (default the last), computed stably as
    m + log(sum(exp(x - m))) with m the maximum: no overflow at large |x|.

    An axis of -inf values (or an empty axis) gives -inf; one holding +inf gives +inf. The
    gradient is softmax(x) along the axis.
    """
    return _reduce(tape, LOGSUMEXP, x, axis, keepdims)


# --- var over trailing axes: one kernel, a work-item per row ------------------------------------

# Rows longer than this take the composite below, whose row sums split a long row over
# work-items: `var_rows` gives each row one work-item, which walks it three times.
VAR_ROW_MAX = 1 << 13


def _var_source(dtype: DType) -> str:
    """`var_rows`: each row's variance as `var` computes it, the corrected two-pass form, its
    sums those of the norms' rows (TG_ROW_SUM: 8 lanes, compensated blocks)."""
    t = C_TYPES[dtype]
    finite = "FLT_MAX" if dtype == np.float32 else "DBL_MAX"
    return (fp64_pragma(dtype) + f"typedef {t} T;\ntypedef {t}8 T8;\n" + KAHAN + VEC8 + f"""
__kernel void var_rows(__global T* out, __global const T* x, const long C, const T div,
                       const long n) {{
  const long i = get_global_id(0);
  if (i >= n) return;
  __global const T* r = x + i * C;
  T total, squares, drift;
  TG_ROW_SUM(total, C, TG_LOAD8(r + c), r[c])
  const T m = total / (T)C;
  TG_ROW_SUM(squares, C, (TG_LOAD8(r + c) - m) * (TG_LOAD8(r + c) - m), (r[c] - m) * (r[c] - m))
  TG_ROW_SUM(drift, C, TG_LOAD8(r + c) - m, r[c] - m)
  drift = drift * drift / (T)C;
  // finite, so that squares that overflowed stay inf (inf - inf is NaN); NaN stays NaN
  drift = drift > ({t}){finite} ? ({t}){finite} : drift;
  out[i] = (squares - drift) / div;
}}
""")


register_family("var", _var_source)


@dataclass(frozen=True, slots=True)
class VarParams:
    """`var_rows` over x's trailing `axes` (count elements a row), keeping them as size 1
    where `keepdims`; the sum of squares is divided by max(count - ddof, 0)."""

    axes: tuple[int, ...]
    keepdims: bool
    ddof: float


def _trailing(axes: tuple[int, ...], ndim: int) -> bool:
    """Whether sorted `axes` are the last len(axes) of ndim: rows that `var_rows` reduces."""
    return axes == tuple(range(ndim - len(axes), ndim))


def _divisor(count: int, ddof: Any) -> Any:
    """var's divisor: count - ddof, 0 where that is below (inf or NaN follow, as numpy's)."""
    return builtins.max(count - ddof, 0.0)


def _var_rule(args: Sequence[Any], p: VarParams) -> Aval:
    (x,) = args
    if not is_float(x.dtype) or not _trailing(p.axes, len(x.shape)):
        raise DTypeError(at_site(
            f"var_rows: x must be float32 or float64 reduced over trailing axes, got "
            f"{dtype_name(x.dtype)} {tuple(x.shape)} over axes {p.axes}"))
    return Aval(reduced_shape(x.shape, ReduceParams(p.axes, p.keepdims)), x.dtype)


def _var_forward(dev: Device, args: Sequence[AnyTensor], p: VarParams, aval: Aval
                 ) -> AnyTensor:
    (x,) = args
    out = empty(aval.shape, aval.dtype, dev)
    if out.size:
        count = x.size // out.size
        kernel = dev.kernel("var", dtype_name(x.dtype), "var_rows",
                            lambda: _var_source(x.dtype))
        dev.launch(kernel, launch_size(out.size), (LOCAL,), out.buffer, x.buffer, count,
                   _divisor(count, p.ddof), out.size)
    return out


def _var_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: VarParams,
             needs: Sequence[bool]) -> list[Any]:
    """2 g (x - mean) / max(count - ddof, 0), g and the mean broadcast over each row."""
    (x,) = args
    kept = ReduceParams(p.axes, True)
    count = math.prod(x.shape[a] for a in p.axes)
    whole = BroadcastParams(tuple(x.shape))
    m = e.apply(_ew.MUL, [e.apply(SUM, [x], kept), 1.0 / count])
    d = e.apply(_ew.SUB, [x, e.apply(BROADCAST_TO, [m], whole)])
    gb = e.apply(BROADCAST_TO, [to_keep(e, g, tuple(x.shape), ReduceParams(p.axes, p.keepdims))],
                 whole)
    scaled = e.apply(_ew.MUL, [e.apply(_ew.MUL, [gb, d]), 2.0])
    return [e.apply(_ew.DIV, [scaled, _divisor(count, p.ddof)])]


VAR_ROWS: Primitive[VarParams] = register(Primitive(
    "var_rows", _var_rule, _var_forward, _var_vjp,
    doc="var over trailing axes (every row of at most VAR_ROW_MAX elements): one kernel, a "
        "work-item per row, the corrected two-pass form; the VJP 2 g (x - mean) / (n - ddof)."))


@takes_tape
def var(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False, ddof: int | float = 0
        ) -> tuple[Tape, Id]:
    """Variance over `axis`: sum((x - mean)**2) / (n - ddof), as numpy's var (ddof=0 default).
    Over trailing axes (a norm's rows) it is one kernel (`var_rows`); else the ops below.

    Two passes (the mean first), so it stays accurate when the mean is large; the rounding of
    the mean itself, d = mean(x) - m, would add d**2 (4e-6 of a float32 variance of values
    near 1e4 with spread 0.3), so the sum of the deviations takes it back out: sum((x - m)**2)
    - sum(x - m)**2 / n (the corrected two-pass algorithm). With n - ddof <= 0 the division is
    by 0, giving inf or NaN as numpy does.
    """

    tape.node(x, "var", "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"var: needs a float32 or float64 tensor, got {dtype_name(x.dtype)} (convert with "
            "tg.astype)"))
    ddof = number("var", "ddof", ddof)  # numpy's integers too, as numpy's var takes them
    keepdims = flag("var", "keepdims", keepdims)
    axes = normalize_axes("var", axis, len(x.shape))
    count = math.prod(x.shape[a] for a in axes)
    if 0 < count <= VAR_ROW_MAX and _trailing(axes, len(x.shape)):
        return record(tape, VAR_ROWS, [x], VarParams(axes, keepdims, ddof))
    tape, m = mean(tape, x, axes, keepdims=True)
    tape, d = _ew.sub(tape, x, m)
    tape, sq = _ew.mul(tape, d, d)
    tape, total = _reduce(tape, SUM, sq, axes, keepdims)
    if count:
        tape, drift = _reduce(tape, SUM, d, axes, keepdims)  # n * (mean(x) - m), ~0
        tape, drift = _ew.mul(tape, drift, drift)
        tape, drift = _ew.div(tape, drift, float(count))
        # Finite, so that a sum of squares that overflowed stays inf (inf - inf was NaN, where
        # numpy's and PyTorch's var are inf); the clip changes no finite drift.
        tape, drift = _ew.clip(tape, drift, None, float(np.finfo(x.dtype).max))
        tape, total = _ew.sub(tape, total, drift)
    return _ew.div(tape, total, _divisor(count, ddof))
