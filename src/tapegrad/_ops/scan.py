"""Ops that depend on positions along axes: tril and triu (triangles of the last two axes),
argmax and argmin (arg-reductions), cumsum (an inclusive prefix sum).

Each views its input as the reductions do, (A, K, B) around the axis: out[a, ., b] depends on
x[a, k, b] for k along the axis. Their kernels are one program per dtype (floats, int32, int64
and bool alike), built on first use rather than joining the core program: every kernel in the
core adds to the cold start of programs that never call these ops.

- argmax/argmin keep numpy's rules: the first index at ties, and a NaN beats every number
  (the first NaN's index, for argmin too), as numpy and PyTorch do. A long axis with few
  outputs is cut into chunks (`_reduction.parts_of`), each giving its best (value, index), and a
  second launch picks the first best chunk in order: the same index as one pass.
- cumsum keeps a running sum and the exact sum of what its additions lost (TwoSum), so a
  float32 prefix is within about half a unit in the last place of the exact one however long
  the axis, as PyTorch's (which accumulates float32 in double on the CPU). Few long rows are
  cut into chunks: each chunk's (sum, loss) pair, then the running pairs over the chunks,
  then each chunk from the pair before it. Its VJP is the reverse prefix sum
  (`cumsum_reverse`: the same kernels walking the axis backwards), whose VJP is cumsum again.
- tril/triu zero one side of a diagonal of the last two axes; the VJP is the same mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyopencl as cl

from .._device import LOCAL, Device, fp64_pragma
from .._errors import ArgumentTypeError, DTypeError, ShapeError, at_site, flag, shown
from .._kernels import launch_size
from .._primitive import Aval, LinearOp, Primitive, register, self_adjoint, transposes
from .._reduction import parts_of
from .._tape import Id, Tape, record, takes_tape
from .._tensor import (
    BOOL,
    C_TYPES,
    FLOAT32,
    FLOAT64,
    INT32,
    INT64,
    AnyTensor,
    DType,
    Shape,
    dtype_name,
    empty,
    is_float,
    size_of,
)
from .._traced import integer
from .elementwise import astype
from .shape import normalize_axis, reshape, split_at

# A running sum s and the sum c of what its additions lost, each loss found exactly by
# Knuth's TwoSum (Kahan's shorter form needs |s| >= |v|, which a prefix of values of both signs
# breaks near every zero crossing: 2e-5 relative error on 2^20 normal floats). The prefix is
# s + c. Once s is infinite the losses are no longer counted: inf - inf would make them NaN
# where a plain sum (numpy's, PyTorch's) is +-inf.
_FLOAT_HEAD = """
#define TG_ISNAN(v) ((v) != (v))  // isnan is a library call in PoCL
#define TG_ADD(s, c, v) { const T v_ = (v), t_ = s + v_, z_ = t_ - s; \\
  c += t_ - t_ == (T)0 ? (s - (t_ - z_)) + (v_ - z_) : (T)0; s = t_; }
"""
# Integers have no NaN and add exactly (wrapping on overflow, as numpy's int64 does).
_INT_HEAD = """
#define TG_ISNAN(v) 0
#define TG_ADD(s, c, v) { s += (v); }
"""

_SOURCE = """
/* The better of two candidates along an axis: strictly better only, so the earlier index
   stays at ties; a NaN beats any number and the first NaN stays. */
#define TG_MAX_BETTER(v, best) ((v) > (best) || (TG_ISNAN(v) && !TG_ISNAN(best)))
#define TG_MIN_BETTER(v, best) ((v) < (best) || (TG_ISNAN(v) && !TG_ISNAN(best)))

#define TG_ARG(kind, BETTER) \\
/* x (A, K, B) in P chunks of k: each work-item its chunk's best value and index. */ \\
__kernel void arg##kind##_part(__global T* vals, __global long* ids, __global const T* x, \\
                               const long K, const long B, const long P, const long chunk, \\
                               const long n) { \\
  const long gid = get_global_id(0); \\
  if (gid >= n) return; \\
  const long b = gid % B, t = gid / B, p = t % P, a = t / P; \\
  const long k0 = p * chunk, k1 = min(K, k0 + chunk); \\
  __global const T* src = x + a * K * B + b; \\
  T best = src[k0 * B]; \\
  long at = k0; \\
  for (long k = k0 + 1; k < k1; ++k) { \\
    const T v = src[k * B]; \\
    if (BETTER(v, best)) { best = v; at = k; } \\
  } \\
  vals[gid] = best; \\
  ids[gid] = at; \\
} \\
/* The chunks' candidates (A, P, B): the first best, chunks in order. */ \\
__kernel void arg##kind##_merge(__global long* out, __global const T* vals, \\
                                __global const long* ids, const long P, const long B, \\
                                const long n) { \\
  const long gid = get_global_id(0); \\
  if (gid >= n) return; \\
  const long b = gid % B, a = gid / B; \\
  const long base = a * P * B + b; \\
  T best = vals[base]; \\
  long at = ids[base]; \\
  for (long p = 1; p < P; ++p) { \\
    const T v = vals[base + p * B]; \\
    if (BETTER(v, best)) { best = v; at = ids[base + p * B]; } \\
  } \\
  out[gid] = at; \\
}

TG_ARG(max, TG_MAX_BETTER)
TG_ARG(min, TG_MIN_BETTER)

/* Inclusive prefix sums along k of x (A, K, B), element k at offset `first + k * step` from
   its row's start (step -B from the last element: a sum from the end), in P chunks of k. */
#define TG_SCAN_HEAD \\
  const long gid = get_global_id(0); \\
  if (gid >= n) return; \\
  const long b = gid % B, t = gid / B, p = t % P, a = t / P; \\
  const long k0 = p * chunk, k1 = min(K, k0 + chunk); \\
  const long row = a * K * B + b + first;

__kernel void cumsum_run(__global T* out, __global const T* x, const long K, const long B,
                         const long P, const long chunk, const long first, const long step,
                         const long n) {
  TG_SCAN_HEAD
  T s = (T)0, c = (T)0;
  for (long k = k0; k < k1; ++k) {
    TG_ADD(s, c, x[row + k * step])
    out[row + k * step] = s + c;
  }
}

/* Each chunk's sum, as the pair (s, c) of a running sum and its losses: (A, P, B) each. */
__kernel void cumsum_totals(__global T* hi, __global T* lo, __global const T* x, const long K,
                            const long B, const long P, const long chunk, const long first,
                            const long step, const long n) {
  TG_SCAN_HEAD
  T s = (T)0, c = (T)0;
  for (long k = k0; k < k1; ++k) TG_ADD(s, c, x[row + k * step])
  hi[gid] = s;
  lo[gid] = c;
}

/* The running sums (s, c) over p of the chunks' (hi, lo) pairs, per (a, b): in place. */
__kernel void cumsum_carries(__global T* hi, __global T* lo, const long P, const long B,
                             const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  const long at = (gid / B) * P * B + gid % B;
  T s = (T)0, c = (T)0;
  for (long p = 0; p < P; ++p) {
    TG_ADD(s, c, hi[at + p * B])
    c += lo[at + p * B];
    hi[at + p * B] = s;
    lo[at + p * B] = c;
  }
}

/* The prefix sums of each chunk, starting from the running sum of the chunks before it. */
__kernel void cumsum_carry(__global T* out, __global const T* x, __global const T* hi,
                           __global const T* lo, const long K, const long B, const long P,
                           const long chunk, const long first, const long step,
                           const long n) {
  TG_SCAN_HEAD
  const long before = (a * P + p - 1) * B + b;
  T s = p ? hi[before] : (T)0, c = p ? lo[before] : (T)0;
  for (long k = k0; k < k1; ++k) {
    TG_ADD(s, c, x[row + k * step])
    out[row + k * step] = s + c;
  }
}

/* Rows of the last two axes (R, C): one work-item per row r, keeping the columns c with
   c - r <= k (lower) or c - r >= k (upper) and writing 0 elsewhere. */
__kernel void triangle(__global T* out, __global const T* x, const long R, const long C,
                       const long k, const int upper, const long rows) {
  const long gid = get_global_id(0);
  if (gid >= rows) return;
  const long r = gid % R;
  const long split = upper ? r + k : r + k + 1;  // the first column of the upper part
  const long cut = min(C, max((long)0, split));
  __global const T* src = x + gid * C;
  __global T* dst = out + gid * C;
  if (upper) {
    for (long c = 0; c < cut; ++c) dst[c] = (T)0;
    for (long c = cut; c < C; ++c) dst[c] = src[c];
  } else {
    for (long c = 0; c < cut; ++c) dst[c] = src[c];
    for (long c = cut; c < C; ++c) dst[c] = (T)0;
  }
}
"""


def _source(dtype: DType) -> str:
    head = _FLOAT_HEAD if is_float(dtype) else _INT_HEAD
    return fp64_pragma(dtype) + f"typedef {C_TYPES[dtype]} T;\n" + head + _SOURCE


# The arg-reductions' kernels are made by a macro (TG_ARG), whose signatures the device cannot
# read from the source: their argument types, stated.
_MACRO_KERNEL_TYPES: dict[str, list[Any]] = {
    "part": [None, None, None] + [np.int64] * 5,
    "merge": [None, None, None] + [np.int64] * 3,
}


def _kernel(dev: Device, dtype: DType, name: str) -> cl.Kernel:
    return dev.kernel("scan", dtype_name(dtype), name, lambda: _source(dtype),
                      _MACRO_KERNEL_TYPES.get(name.rsplit("_", 1)[-1])
                      if name.startswith("arg") else None)


def _launch(dev: Device, name: str, dtype: DType, n: int, *args: Any) -> None:
    dev.launch(_kernel(dev, dtype, name), launch_size(n), (LOCAL,), *args)


def _chunks(a: int, k: int, b: int) -> tuple[int, int]:
    """(parts, chunk): k cut into `parts` chunks of `chunk` (the last shorter), as the
    reductions cut it (`_reduction.parts_of`), none of them empty (an argmax of an empty chunk
    would have no candidate)."""
    chunk = -(-k // parts_of(a, k, b))
    return -(-k // chunk), chunk


# --- tril and triu ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriangleParams:
    k: int


def _triangle_rule(name: str) -> Any:
    def rule(args: Sequence[Any], p: TriangleParams) -> Aval:
        (x,) = args
        if len(x.shape) < 2:
            raise ShapeError(at_site(
                f"{name}: x has shape {tuple(x.shape)} but needs at least 2 axes (the last two "
                "are the matrix, leading axes a batch)"))
        return Aval(tuple(x.shape), x.dtype)
    return rule


def _triangle_forward(upper: bool) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: TriangleParams, aval: Aval
                ) -> AnyTensor:
        (x,) = args
        out = empty(aval.shape, aval.dtype, dev)
        if out.size:
            r, c = aval.shape[-2], aval.shape[-1]
            rows = out.size // c
            k = min(max(p.k, -r), c)  # the same mask, and no overflow in C
            _launch(dev, "triangle", x.dtype, rows, out.buffer, x.buffer, np.int64(r),
                    np.int64(c), np.int64(k), np.int32(upper), np.int64(rows))
        return out
    return forward


TRIL = self_adjoint(LinearOp(
    "tril", _triangle_rule("tril"), _triangle_forward(False),
    "The lower triangle of the last two axes (column - row <= k), zeros above; the VJP is "
    "the same mask on the cotangent."))
TRIU = self_adjoint(LinearOp(
    "triu", _triangle_rule("triu"), _triangle_forward(True),
    "The upper triangle of the last two axes (column - row >= k), zeros below; the VJP is "
    "the same mask on the cotangent."))



def _diagonal(op: str, k: object) -> int:
    found = integer(k)
    if found is None:
        raise ArgumentTypeError(at_site(f"{op}: k must be an int (the diagonal offset), got "
                                        f"{shown(k)}"))
    return found


def _triangle(tape: Tape, prim: Primitive[TriangleParams], x: Id, k: object
              ) -> tuple[Tape, Id]:
    tape.node(x, prim.name, "x")
    return record(tape, prim, [x], TriangleParams(_diagonal(prim.name, k)))


@takes_tape
def tril(tape: Tape, x: Id, k: int = 0) -> tuple[Tape, Id]:
    """The lower triangle of the last two axes of x (leading axes are a batch), zeros above
    the k-th diagonal: element (i, j) is kept where j - i <= k (numpy's and PyTorch's tril;
    k > 0 keeps diagonals above the main one, k < 0 drops some below it). Any dtype; the
    gradient is the same triangle of the cotangent."""
    return _triangle(tape, TRIL, x, k)


@takes_tape
def triu(tape: Tape, x: Id, k: int = 0) -> tuple[Tape, Id]:
    """The upper triangle of the last two axes of x (leading axes are a batch), zeros below
    the k-th diagonal: element (i, j) is kept where j - i >= k (numpy's and PyTorch's triu).
    Any dtype; the gradient is the same triangle of the cotangent."""
    return _triangle(tape, TRIU, x, k)


# --- argmax and argmin ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArgParams:
    """`axis`: the reduced axis of x (x is flattened first for axis=None); `shape`: the
    result's shape."""

    axis: int
    shape: Shape


def _arg_rule(kind: str) -> Any:
    def rule(args: Sequence[Any], p: ArgParams) -> Aval:
        (x,) = args
        shape: Shape = tuple(x.shape)
        if not 0 <= p.axis < len(shape):
            raise ShapeError(at_site(f"{kind}: axis {p.axis} does not fit x of shape {shape}"))
        if shape[p.axis] == 0:
            raise ShapeError(at_site(
                f"{kind}: attempt to get {kind} of an empty sequence (axis {p.axis} of x, shape "
                f"{shape}, has size 0)"))
        return Aval(p.shape, INT64)
    return rule


def _arg_forward(kind: str) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: ArgParams, aval: Aval
                ) -> AnyTensor:
        (x,) = args
        a, k, b = split_at(x.shape, p.axis)
        out = empty(aval.shape, INT64, dev)
        if out.size == 0:
            return out
        parts, chunk = _chunks(a, k, b)
        n = a * parts * b
        vals = empty((n,), x.dtype, dev)
        ids = out if parts == 1 else empty((n,), INT64, dev)
        sizes = (np.int64(k), np.int64(b), np.int64(parts), np.int64(chunk), np.int64(n))
        _launch(dev, f"arg{kind}_part", x.dtype, n, vals.buffer, ids.buffer, x.buffer, *sizes)
        if parts > 1:
            _launch(dev, f"arg{kind}_merge", x.dtype, a * b, out.buffer, vals.buffer,
                    ids.buffer, np.int64(parts), np.int64(b), np.int64(a * b))
        return out
    return forward


ARGMAX: Primitive[ArgParams] = register(Primitive(
    "argmax", _arg_rule("argmax"), _arg_forward("max"), None,
    doc="int64 index of the maximum along an axis: the first at ties, the first NaN if any "
        "(numpy's rules). No gradient."))
ARGMIN: Primitive[ArgParams] = register(Primitive(
    "argmin", _arg_rule("argmin"), _arg_forward("min"), None,
    doc="int64 index of the minimum along an axis: the first at ties, the first NaN if any "
        "(numpy's rules). No gradient."))


def _axis_arg(op: str, axis: object, ndim: int) -> int | None:
    """An `axis` argument that is None or one int (numpy's arg-reductions and cumsum take no
    tuples), normalised against `ndim`."""
    if axis is None:
        return None
    found = integer(axis)
    if found is None:
        raise ArgumentTypeError(at_site(
            f"{op}: axis must be an int or None, got {shown(axis)}"
            + (" (a single axis: this op takes no tuple of axes)"
               if isinstance(axis, tuple | list) else "")))
    return normalize_axis(op, found, ndim)


def _arg(tape: Tape, prim: Primitive[ArgParams], x: Id, axis: object, keepdims: object
         ) -> tuple[Tape, Id]:
    op = prim.name
    tape.node(x, op, "x")
    keep = flag(op, "keepdims", keepdims)
    ndim = len(x.shape)
    a = _axis_arg(op, axis, ndim)
    if a is None:
        if size_of(x.shape) == 0:
            raise ShapeError(at_site(
                f"{op}: attempt to get {op} of an empty sequence (x has shape {x.shape})"))
        shape: Shape = (1,) * ndim if keep else ()
        if ndim != 1:
            tape, x = reshape(tape, x, (size_of(x.shape),))
        return record(tape, prim, [x], ArgParams(0, shape))
    if x.shape[a] == 0:
        raise ShapeError(at_site(
            f"{op}: attempt to get {op} of an empty sequence (axis {axis} of x, shape "
            f"{x.shape}, has size 0)"))
    shape = tuple(1 if i == a else n for i, n in enumerate(x.shape) if keep or i != a)
    return record(tape, prim, [x], ArgParams(a, shape))


@takes_tape
def argmax(tape: Tape, x: Id, axis: int | None = None, keepdims: bool = False
           ) -> tuple[Tape, Id]:
    """numpy's `argmax`: the int64 index of the largest element along `axis` (an int, negative
    allowed), or of the flattened x for `axis=None` (shape (), or all ones with keepdims).

    Ties give the first index. NaN counts as larger than every number, so the first NaN's
    index comes back where there is one (numpy's rule; PyTorch agrees). An empty axis is a
    ShapeError (numpy's ValueError). The result takes no gradient; feed it to `tg.take`.
    """
    return _arg(tape, ARGMAX, x, axis, keepdims)


@takes_tape
def argmin(tape: Tape, x: Id, axis: int | None = None, keepdims: bool = False
           ) -> tuple[Tape, Id]:
    """numpy's `argmin`: the int64 index of the smallest element along `axis` (an int,
    negative allowed), or of the flattened x for `axis=None` (shape (), or all ones with
    keepdims).

    Ties give the first index. A NaN wins here too: the first NaN's index comes back where
    there is one (numpy's rule; PyTorch agrees). An empty axis is a ShapeError. No gradient.
    """
    return _arg(tape, ARGMIN, x, axis, keepdims)


# --- cumsum -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CumsumParams:
    axis: int


def _cumsum_rule(name: str) -> Any:
    def rule(args: Sequence[Any], p: CumsumParams) -> Aval:
        (x,) = args
        if not 0 <= p.axis < len(x.shape):
            raise ShapeError(at_site(
                f"{name}: axis {p.axis} does not fit x of shape {tuple(x.shape)}"))
        if x.dtype not in (FLOAT32, FLOAT64, INT64):
            raise DTypeError(at_site(
                f"{name}: x has dtype {dtype_name(x.dtype)}, expected float32, float64 or "
                "int64"))
        return Aval(tuple(x.shape), x.dtype)
    return rule


def prefix_sums(x: AnyTensor, axis: int, reverse: bool) -> AnyTensor:
    """Inclusive prefix sums of x along `axis` (from the end when `reverse`), compensated."""
    dev = x.device
    out = empty(x.shape, x.dtype, dev)
    if out.size == 0:
        return out
    a, k, b = split_at(x.shape, axis)
    first, step = ((k - 1) * b, -b) if reverse else (0, b)
    parts, chunk = _chunks(a, k, b)
    n = a * parts * b
    view = (np.int64(k), np.int64(b), np.int64(parts), np.int64(chunk), np.int64(first),
            np.int64(step), np.int64(n))
    if parts == 1:
        _launch(dev, "cumsum_run", x.dtype, n, out.buffer, x.buffer, *view)
        return out
    hi, lo = empty((n,), x.dtype, dev), empty((n,), x.dtype, dev)
    _launch(dev, "cumsum_totals", x.dtype, n, hi.buffer, lo.buffer, x.buffer, *view)
    _launch(dev, "cumsum_carries", x.dtype, a * b, hi.buffer, lo.buffer, np.int64(parts),
            np.int64(b), np.int64(a * b))
    _launch(dev, "cumsum_carry", x.dtype, n, out.buffer, x.buffer, hi.buffer, lo.buffer, *view)
    return out


def _cumsum_forward(reverse: bool) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: CumsumParams, aval: Aval
                ) -> AnyTensor:
        return prefix_sums(args[0], p.axis, reverse)
    return forward


CUMSUM, CUMSUM_REVERSE = transposes(
    LinearOp("cumsum", _cumsum_rule("cumsum"), _cumsum_forward(False),
             "Inclusive prefix sum along an axis (compensated in floats). The VJP is the "
             "reverse prefix sum of the cotangent (cumsum_reverse)."),
    LinearOp("cumsum_reverse", _cumsum_rule("cumsum_reverse"), _cumsum_forward(True),
             "Inclusive prefix sum along an axis taken from the end: out[k] = sum of x[j] for "
             "j >= k; cumsum's VJP. Its own VJP is cumsum."))


@takes_tape
def cumsum(tape: Tape, x: Id, axis: int | None) -> tuple[Tape, Id]:
    """numpy's `cumsum`: inclusive prefix sums along `axis` (an int, negative allowed; None
    sums the flattened x, as numpy's default). PyTorch's `cumsum(x, dim)` for an int axis.

    Floats keep their dtype and take a gradient, the reverse prefix sum of the cotangent.
    Integers and bools sum exactly in int64, as numpy and PyTorch promote them (no gradient).
    Float sums are compensated: a float32 prefix of a long axis stays within a few units in
    the last place of the exact one, as PyTorch's.
    """

    tape.node(x, "cumsum", "x")
    a = _axis_arg("cumsum", axis, len(x.shape))
    if a is None:
        a = 0
        if len(x.shape) != 1:
            tape, x = reshape(tape, x, (size_of(x.shape),))
    if x.dtype in (INT32, BOOL):
        tape, x = astype(tape, x, INT64)
    return record(tape, CUMSUM, [x], CumsumParams(a))
