"""Reductions over axes: sum, max, min, logsumexp primitives; mean and var built on them.

Any reduction is run as passes over a contiguous block of axes, the input viewed as (A, K, B):
out[a, b] = reduce over k of x[a, k, b]. Non-adjacent axes take one pass per block. When there
are few outputs and a long K, a pass splits K into P chunks (A, P, B) and reduces the partial
results in a second pass, so a full reduction still has hundreds of work-items.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import ArgumentTypeError, DTypeError, ShapeError, at_site, flag, number
from .._fusion import elementwise, sum_rows
from .._kernels import KAHAN, VEC8, launch_size, register_expression
from .._primitive import Aval, Emitter, Primitive, register
from .._tape import Id, Tape, record, takes_tape
from .._tensor import C_TYPES, AnyTensor, DType, Shape, dtype_name, empty, is_float

_COMBINE = {
    "sum": ("(T)0", "acc + v"),
    "max": ("-INFINITY", "(v > acc || isnan(v)) ? v : acc"),
    "min": ("INFINITY", "(v < acc || isnan(v)) ? v : acc"),
}


def _source(dtype: DType) -> str:
    parts = [fp64_pragma(dtype), f"typedef {C_TYPES[dtype]} T;\ntypedef {C_TYPES[dtype]}8 T8;\n"]
    for kind, (init, combine) in _COMBINE.items():
        parts.append(
            f"__kernel void reduce_{kind}(__global T* out, __global const T* x, const long K, "
            "const long B, const long P, const long chunk, const long n) {\n"
            "  const long gid = get_global_id(0);\n  if (gid >= n) return;\n"
            "  const long b = gid % B, t = gid / B, p = t % P, a = t / P;\n"
            "  const long k0 = p * chunk;\n  const long k1 = min(K, k0 + chunk);\n"
            "  __global const T* src = x + a * K * B + b;\n"
            f"  T acc = {init};\n"
            f"  for (long k = k0; k < k1; ++k) {{ const T v = src[k * B]; acc = {combine}; }}\n"
            "  out[gid] = acc;\n}\n"
        )
    parts.append(_SUM_ROWS_SOURCE)
    parts.append(VEC8 + _SUM_COLS_SOURCE)
    parts.append(_LSE_SOURCE)
    return "".join(parts)


register_family("reduce", _source)


# Sum over contiguous k (B == 1) with eight independent partial sums: a single accumulator is
# a dependency chain the compiler may not reorder; eight vectorize.
_SUM_ROWS_SOURCE = KAHAN + """
__kernel void reduce_sum_rows(__global T* out, __global const T* x, const long K,
                              const long P, const long chunk, const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  const long p = gid % P, a = gid / P;
  const long k0 = p * chunk;
  const long k1 = min(K, k0 + chunk);
  __global const T* src = x + a * K;
  T s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
  T c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0, c7 = 0;
  long k = k0;
  for (; k + TG_BLOCK <= k1; k += TG_BLOCK) {
    T b0 = 0, b1 = 0, b2 = 0, b3 = 0, b4 = 0, b5 = 0, b6 = 0, b7 = 0;
    for (long u = k; u < k + TG_BLOCK; u += 8) {
      b0 += src[u]; b1 += src[u + 1]; b2 += src[u + 2]; b3 += src[u + 3];
      b4 += src[u + 4]; b5 += src[u + 5]; b6 += src[u + 6]; b7 += src[u + 7];
    }
    TG_KAHAN(s0, c0, b0) TG_KAHAN(s1, c1, b1) TG_KAHAN(s2, c2, b2) TG_KAHAN(s3, c3, b3)
    TG_KAHAN(s4, c4, b4) TG_KAHAN(s5, c5, b5) TG_KAHAN(s6, c6, b6) TG_KAHAN(s7, c7, b7)
  }
  T acc = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
  T lost = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7));
  for (; k < k1; ++k) TG_KAHAN(acc, lost, src[k])
  out[gid] = acc - lost;
}
"""


# Sum over k of x viewed as (A, K, B), B > 1 (a bias gradient: columns of a (batch, features)
# cotangent): a work-item sums 8 adjacent columns with 8-wide loads, rather than one column
# reading a strided scalar per row; the last group of a row with fewer than 8 columns sums them
# one by one. Blocks of RD_BLOCK rows are summed plainly (four interleaved partial sums) and the
# block sums added with compensation, as rows are: compensating every term made each row wait
# for the last (the chain through the running sum and its correction).
_SUM_COLS_SOURCE = """
#define RD_BLOCK 16
__kernel void reduce_sum_cols(__global T* out, __global const T* x, const long K,
                              const long B, const long P, const long chunk, const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  const long groups = (B + 7) / 8, b = (gid % groups) * 8, t = gid / groups;
  const long p = t % P, a = t / P;
  const long k0 = p * chunk, k1 = min(K, k0 + chunk);
  __global const T* src = x + a * K * B + b;
  __global T* dst = out + t * B + b;
  if (b + 8 <= B) {
    T8 acc = (T8)0, lost = (T8)0;
    long k = k0;
    for (; k + RD_BLOCK <= k1; k += RD_BLOCK) {
      __global const T* r = src + k * B;
      T8 b0 = TG_LOAD8(r), b1 = TG_LOAD8(r + B), b2 = TG_LOAD8(r + 2 * B),
         b3 = TG_LOAD8(r + 3 * B);
      for (int u = 4; u < RD_BLOCK; u += 4) {
        r += 4 * B;
        b0 += TG_LOAD8(r); b1 += TG_LOAD8(r + B); b2 += TG_LOAD8(r + 2 * B);
        b3 += TG_LOAD8(r + 3 * B);
      }
      TG_KAHAN8(acc, lost, (b0 + b1) + (b2 + b3))
    }
    for (; k < k1; ++k) TG_KAHAN8(acc, lost, TG_LOAD8(src + k * B))
    acc -= lost;
    dst[0] = acc.s0; dst[1] = acc.s1; dst[2] = acc.s2; dst[3] = acc.s3;
    dst[4] = acc.s4; dst[5] = acc.s5; dst[6] = acc.s6; dst[7] = acc.s7;
  } else {
    for (long c = 0; c < B - b; ++c) {  // the same sums as a lane of the vectors above
      T acc = (T)0, lost = (T)0;
      long k = k0;
      for (; k + RD_BLOCK <= k1; k += RD_BLOCK) {
        __global const T* r = src + k * B + c;
        T b0 = r[0], b1 = r[B], b2 = r[2 * B], b3 = r[3 * B];
        for (int u = 4; u < RD_BLOCK; u += 4) {
          r += 4 * B;
          b0 += r[0]; b1 += r[B]; b2 += r[2 * B]; b3 += r[3 * B];
        }
        TG_KAHAN(acc, lost, (b0 + b1) + (b2 + b3))
      }
      for (; k < k1; ++k) TG_KAHAN(acc, lost, src[k * B + c])
      dst[c] = acc - lost;
    }
  }
}
"""


# logsumexp over k of x viewed as (A, K, B), one work-item per output: the maximum, then the
# shifted sum. An infinite maximum shifts by 0 (see _LSE_SHIFT_EXP below for why).
_LSE_SOURCE = """
__kernel void reduce_logsumexp(__global T* out, __global const T* x, const long K,
                               const long B, const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  __global const T* src = x + (gid / B) * K * B + gid % B;
  T m = -INFINITY;
  for (long k = 0; k < K; ++k) { const T v = src[k * B]; m = (v > m || isnan(v)) ? v : m; }
  const T shift = isinf(m) ? (T)0 : m;
  T acc = (T)0;
  for (long k = 0; k < K; ++k) acc += exp(src[k * B] - shift);
  out[gid] = log(acc) + shift;
}
"""


_TARGET_ITEMS = 512  # work-items wanted in a pass before it is worth splitting K
_MIN_CHUNK = 256
# Elements below which one pass beats two, however few its work-items: the second pass is a
# launch (40-80 us to an idle PoCL device), and a work-item sums ~100 elements a microsecond.
# The CNN's bias gradients (8 x 4096 and 16 x 1024 elements) took two launches each.
SPLIT_MIN = 1 << 16


def parts_of(a: int, k: int, b: int) -> int:
    """Work-items per output when reducing (a, k, b) over k: 1 (one pass) unless the outputs
    are few, k is long and the whole is large; else chunks of k for a second pass to sum."""
    if a * b >= _TARGET_ITEMS or k < 2 * _MIN_CHUNK or a * k * b < SPLIT_MIN:
        return 1
    return builtins.min(builtins.max(_TARGET_ITEMS // (a * b), 1), k // _MIN_CHUNK)


def _pass(x: AnyTensor, kind: str, a: int, k: int, b: int) -> AnyTensor:
    """Reduce x viewed as (a, k, b) over k; the result has a * b elements (shape (a, 1, b))."""
    dev = x.device
    rows = kind == "sum" and b == 1
    cols = kind == "sum" and b > 1
    name = "reduce_sum_rows" if rows else "reduce_sum_cols" if cols else f"reduce_{kind}"
    kernel = dev.kernel("reduce", dtype_name(x.dtype), name, lambda: _source(x.dtype))
    parts = parts_of(a, k, b)
    chunk = -(-k // parts) if k else 0
    out = empty((a * parts * b,), x.dtype, dev)
    n = out.size
    # A pending x may be summed inside one generated kernel (`sum_rows`): x is never written.
    if n and not (rows and sum_rows(x, out, k, parts, chunk)):
        items = n // b * -(-b // 8) if cols else n
        sizes = (k, parts, chunk, n) if rows else (k, b, parts, chunk, items)
        dev.launch(kernel, launch_size(items), (LOCAL,), out.buffer, x.buffer, *sizes)
    return _pass(out, kind, a, parts, b) if parts > 1 else out


def _blocks(shape: Shape, axes: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs [i0, i1) of reduced axes; size-1 axes may join a run either way."""
    reduced = set(axes)
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(shape):
        if i in reduced:
            j = i
            while j < len(shape) and (j in reduced or shape[j] == 1):
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def reduce_tensor(x: AnyTensor, kind: str, axes: Sequence[int], keep_shape: Shape) -> AnyTensor:
    shape = list(x.shape)
    current = x
    for i0, i1 in reversed(_blocks(x.shape, axes)):
        a, k, b = math.prod(shape[:i0]), math.prod(shape[i0:i1]), math.prod(shape[i1:])
        if k != 1:
            current = _pass(current, kind, a, k, b)
        shape[i0:i1] = [1] * (i1 - i0)
    return current.with_shape(keep_shape)


@dataclass(frozen=True, slots=True)
class ReduceParams:
    axes: tuple[int, ...]
    keepdims: bool


def keep_shape(shape: Shape, axes: Sequence[int]) -> Shape:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def _out_shape(shape: Shape, p: ReduceParams) -> Shape:
    if p.keepdims:
        return keep_shape(shape, p.axes)
    return tuple(n for i, n in enumerate(shape) if i not in p.axes)


def _rule(kind: str) -> Any:
    def rule(args: Sequence[Any], p: ReduceParams) -> Aval:
        (x,) = args
        if not is_float(x.dtype):
            raise DTypeError(at_site(f"{kind}: x has dtype {x.dtype}, expected float32 or float64 "
                                     "(convert with tg.astype(tape, x, np.float32))"))
        if kind != "sum" and any(x.shape[a] == 0 for a in p.axes):
            raise ShapeError(at_site(
                f"{kind}: cannot reduce over an empty axis (x has shape {x.shape}, axes "
                f"{p.axes}): the result has no identity"))
        return Aval(_out_shape(x.shape, p), x.dtype)
    return rule


def _forward(kind: str) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: ReduceParams, aval: Aval
                ) -> AnyTensor:
        (x,) = args
        return reduce_tensor(x, kind, p.axes, keep_shape(x.shape, p.axes)).with_shape(aval.shape)
    return forward


def _to_keep(e: Emitter, t: Any, x_shape: Shape, p: ReduceParams) -> Any:
    """A reduced value with the reduced axes kept as size 1 (a free reshape)."""
    from . import shape as _shape

    if p.keepdims:
        return t
    return e.apply(_shape.RESHAPE, [t], _shape.ReshapeParams(keep_shape(x_shape, p.axes)))


def _sum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
             needs: Sequence[bool]) -> list[Any]:
    from . import broadcast as _bc

    x_shape = args[0].shape
    gk = _to_keep(e, g, x_shape, p)
    return [e.apply(_bc.BROADCAST_TO, [gk], _bc._BroadcastParams(x_shape))]


def _extremum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
                  needs: Sequence[bool]) -> list[Any]:
    """Ties share the gradient evenly (PyTorch's amax/amin and full max/min do the same)."""
    from . import broadcast as _bc
    from . import elementwise as _ew

    (x,) = args
    shape = x.shape
    full = _bc._BroadcastParams(shape)
    out_b = e.apply(_bc.BROADCAST_TO, [_to_keep(e, out, shape, p)], full)
    mask = e.apply(_ew.EQUAL, [x, out_b])
    count = e.apply(SUM, [mask], ReduceParams(p.axes, True))
    share = e.apply(_ew.DIV, [_to_keep(e, g, shape, p), count])
    return [e.apply(_ew.MUL, [mask, e.apply(_bc.BROADCAST_TO, [share], full)])]


SUM: Primitive[ReduceParams] = register(Primitive(
    "sum", _rule("sum"), _forward("sum"), _sum_vjp, doc="Sum over axes."))
MAX: Primitive[ReduceParams] = register(Primitive(
    "max", _rule("max"), _forward("max"), _extremum_vjp,
    doc="Maximum over axes; NaN propagates; ties split the gradient evenly."))
MIN: Primitive[ReduceParams] = register(Primitive(
    "min", _rule("min"), _forward("min"), _extremum_vjp,
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
    return Aval(_out_shape(x.shape, p), x.dtype)


def _lse_forward(dev: Device, args: Sequence[AnyTensor], p: ReduceParams, aval: Aval
                 ) -> AnyTensor:
    (x,) = args
    blocks = _blocks(x.shape, p.axes)
    if len(blocks) <= 1:
        i0, i1 = blocks[0] if blocks else (x.ndim, x.ndim)
        a, k, b = (math.prod(x.shape[:i0]), math.prod(x.shape[i0:i1]),
                   math.prod(x.shape[i1:]))
        if parts_of(a, k, b) == 1:
            # One block of axes, and enough outputs or a small whole: one pass, one launch.
            out = empty(aval.shape, x.dtype, dev)
            if out.size:
                kernel = dev.kernel("reduce", dtype_name(x.dtype), "reduce_logsumexp",
                                    lambda: _source(x.dtype))
                dev.launch(kernel, launch_size(out.size), (LOCAL,), out.buffer, x.buffer,
                           np.int64(k), np.int64(b), np.int64(out.size))
            return out
    # Several blocks of axes, or a long axis with few outputs: the split max and sum passes.
    m, total = shifted_sumexp(x, p.axes)
    keep = keep_shape(x.shape, p.axes)
    return elementwise(_LSE_FINISH, [total, m], keep, x.dtype, dev).with_shape(aval.shape)


def shifted_sumexp(x: AnyTensor, axes: Sequence[int]) -> tuple[AnyTensor, AnyTensor]:
    """(m, sum(exp(x - m))) over `axes`, kept as size-1 dims, with m the maximum (0 where it is
    infinite): the passes of a logsumexp too long or too scattered for one fused kernel."""
    from .broadcast import broadcast_tensor

    keep = keep_shape(x.shape, axes)
    m = reduce_tensor(x, "max", axes, keep)
    shifted = elementwise(_LSE_SHIFT_EXP, [x, broadcast_tensor(m, x.shape)], x.shape, x.dtype,
                          x.device)
    return m, reduce_tensor(shifted, "sum", axes, keep)


def _lse_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
             needs: Sequence[bool]) -> list[Any]:
    """g * softmax(x), the softmax taken as exp(x - out) from the stored result."""
    from . import broadcast as _bc
    from . import elementwise as _ew

    (x,) = args
    full = _bc._BroadcastParams(x.shape)
    gb = e.apply(_bc.BROADCAST_TO, [_to_keep(e, g, x.shape, p)], full)
    ob = e.apply(_bc.BROADCAST_TO, [_to_keep(e, out, x.shape, p)], full)
    return [e.apply(_ew.MUL_EXP_SUB, [gb, x, ob])]


LOGSUMEXP: Primitive[ReduceParams] = register(Primitive(
    "logsumexp", _lse_rule, _lse_forward, _lse_vjp,
    doc="log(sum(exp(x))) over axes, shifted by the maximum (no overflow); -inf over an empty "
        "axis; the VJP is g * softmax(x)."))


def normalize_axes(op: str, axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """`axis` as sorted non-negative ints: None means all; negatives count from the end."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int | np.integer) or not isinstance(axis, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raw: list[object] = [axis]
    else:
        raw = list(cast(Sequence[object], axis))
    out: list[int] = []
    for a in raw:
        if not isinstance(a, int | np.integer) or isinstance(a, bool):
            raise ArgumentTypeError(at_site(f"{op}: axis entries must be ints, got {a!r}"))
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
    axes = normalize_axes(prim.name, axis, len(x.shape))
    return record(tape, prim, [x], ReduceParams(axes, flag(prim.name, "keepdims", keepdims)))


@takes_tape
def sum(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False) -> tuple[Tape, Id]:
    """Sum over `axis` (None: all axes; an int or tuple, negatives allowed)."""
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
    from . import elementwise as _ew

    tape.node(x, "mean", "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"mean: needs a float32 or float64 tensor, got {dtype_name(x.dtype)} (convert with "
            "tg.astype)"))
    axes = normalize_axes("mean", axis, len(x.shape))
    tape, total = record(tape, SUM, [x], ReduceParams(axes, flag("mean", "keepdims", keepdims)))
    count = math.prod(x.shape[a] for a in axes)
    return _ew.mul(tape, total, 1.0 / count if count else math.nan)


@takes_tape
def logsumexp(tape: Tape, x: Id, axis: Axis = -1, keepdims: bool = False) -> tuple[Tape, Id]:
    """log(sum(exp(x))) over `axis` (default the last), computed stably as
    m + log(sum(exp(x - m))) with m the maximum: no overflow at large |x|.

    An axis of -inf values (or an empty axis) gives -inf; one holding +inf gives +inf. The
    gradient is softmax(x) along the axis.
    """
    return _reduce(tape, LOGSUMEXP, x, axis, keepdims)


@takes_tape
def var(tape: Tape, x: Id, axis: Axis = None, keepdims: bool = False, ddof: int | float = 0
        ) -> tuple[Tape, Id]:
    """Variance over `axis`: sum((x - mean)**2) / (n - ddof), as numpy's var (ddof=0 default).

    Two passes (the mean first), so it stays accurate when the mean is large; the rounding of
    the mean itself, d = mean(x) - m, would add d**2 (4e-6 of a float32 variance of values
    near 1e4 with spread 0.3), so the sum of the deviations takes it back out: sum((x - m)**2)
    - sum(x - m)**2 / n (the corrected two-pass algorithm). With n - ddof <= 0 the division is
    by 0, giving inf or NaN as numpy does.
    """
    from . import elementwise as _ew

    tape.node(x, "var", "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"var: needs a float32 or float64 tensor, got {dtype_name(x.dtype)} (convert with "
            "tg.astype)"))
    ddof = number("var", "ddof", ddof)  # numpy's integers too, as numpy's var takes them
    keepdims = flag("var", "keepdims", keepdims)
    axes = normalize_axes("var", axis, len(x.shape))
    count = math.prod(x.shape[a] for a in axes)
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
    return _ew.div(tape, total, builtins.max(count - ddof, 0.0))
