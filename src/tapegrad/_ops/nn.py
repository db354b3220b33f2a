"""Network layers: linear, layer_norm, batch_norm and dropout.

`linear` is one matmul (its bias added by the kernels). `layer_norm` is one primitive: a
kernel per row computes the row's mean, its variance in a second pass (the mean of squared
deviations, which keeps float32 accurate when the mean is large) and the scaled, shifted output;
its VJP is `layer_norm_grad` (one row kernel again, the statistics recomputed from x) and column
sums for the weight and bias, and that VJP's own is made of primitives, so higher orders work.
`batch_norm` is the same per channel (axis 1, over every other axis): a work-group per channel
sums its elements in a fixed order, and the weight's cotangent is one more such kernel
(`batch_norm_weight_grad`). As compositions of reductions and elementwise ops they took two to
four times the launches (docs/BENCHMARKS.md, session 14).

`dropout` is one primitive. Its mask is drawn on the device from a counter-based generator:
element i of a tensor is kept when the top 32 bits of SplitMix64's output for the counter
mix64(seed) + (i + 1) * golden-gamma are at least p * 2**32. Nothing random lives on the host,
the same (seed, shape, p) always gives the same mask, and the VJP is the same primitive with the
same seed applied to the cotangent (dropout is linear in x, its own transpose).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import DTypeError, ShapeError, at_site, call_site, number, shown
from .._kernels import KAHAN, VEC8, fill_into, launch_size
from .._primitive import Aval, Emitter, LinearOp, Primitive, register, self_adjoint
from .._tape import Id, Tape, record, record_known, takes_tape
from .._tensor import C_TYPES, FLOATS, AnyTensor, DType, dtype_name, empty, is_float
from .._traced import as_index, is_integer, rounded
from . import elementwise as _ew
from . import linalg as _linalg
from . import shape as _shape
from .broadcast import BROADCAST_TO, SUM, BroadcastParams, ReduceParams


def _check_float(op: str, name: str, x: Id) -> None:
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected "
                                 "float32 or float64"))


def _check_same_dtype(op: str, x: Id, name: str, other: Id) -> None:
    if other.dtype != x.dtype:
        raise DTypeError(at_site(f"{op}: x is {dtype_name(x.dtype)} but {name} is "
                                 f"{dtype_name(other.dtype)}; convert one with tg.astype"))


# --- linear ----------------------------------------------------------------------------------


_NO_BIAS = _linalg.MatmulParams(False, False)
_OWN = 2  # the frames from a public op's body up to its caller: the op and `takes_tape`'s
_COLUMN_BIAS = _linalg.MatmulParams(False, False, _linalg.COLUMN_BIAS)


@takes_tape
def linear(tape: Tape, x: Id, w: Id, b: Id | None = None) -> tuple[Tape, Id]:
    """`x @ w + b`: x of shape (..., in), w of shape (in, out), b of shape (out,) or None.

    Leading axes of x are flattened into one 2-D product (no broadcast copy of w).
    """
    op = "linear"
    tape.node(x, op, "x")
    tape.node(w, op, "w")
    if (len(x.shape) == 2 and len(w.shape) == 2 and x.shape[1] == w.shape[0]
            and x.dtype is w.dtype and x.dtype in FLOATS):
        # A float matrix and a weight that fit (and a bias), the common case: the checks and
        # reshapes below would find nothing to do. (`_OWN`: this op's frames, for the site.)
        aval = Aval((x.shape[0], w.shape[1]), x.dtype)
        if b is None:
            return record_known(tape, _linalg.MATMUL, (x, w), _NO_BIAS, aval,
                                call_site(_OWN))
        if b.__class__ is Id and b.dtype is x.dtype and b.shape == w.shape[1:]:
            tape.node(b, op, "b")
            return record_known(tape, _linalg.MATMUL, (x, w, b), _COLUMN_BIAS, aval,
                                call_site(_OWN))
    _check_float(op, "x", x)
    _check_float(op, "w", w)
    _check_same_dtype(op, x, "w", w)
    if w.ndim != 2:
        raise ShapeError(at_site(f"{op}: w must be 2-D (in, out), got shape {w.shape}"))
    if x.ndim < 1:
        raise ShapeError(at_site(f"{op}: x must have a last axis of size {w.shape[0]} (in), "
                                 "got a scalar"))
    if x.shape[-1] != w.shape[0]:
        raise ShapeError(at_site(
            f"{op}: x has {x.shape[-1]} features (x.shape[-1]) but w expects {w.shape[0]} "
            f"(w.shape[0]); w is (in, out), shape {w.shape}"))
    if b is not None:
        tape.node(b, op, "b")
        _check_same_dtype(op, x, "b", b)
        if b.shape != (w.shape[1],):
            raise ShapeError(at_site(f"{op}: b must have shape ({w.shape[1]},) (out), got "
                                     f"{b.shape}"))
    if x.ndim == 1:  # one row
        tape, x2 = _shape.reshape(tape, x, (1, x.shape[0]))
        tape, y = linear(tape, x2, w, b)
        return _shape.reshape(tape, y, (w.shape[1],))
    # Leading axes are the stacked rows of one product (see `_linalg.MATMUL`); the kernels add
    # b: no broadcast copy, no separate add.
    if b is None:
        return record(tape, _linalg.MATMUL, [x, w], _NO_BIAS)
    return record(tape, _linalg.MATMUL, [x, w, b], _COLUMN_BIAS)


# --- normalisation ---------------------------------------------------------------------------


def _check_eps(op: str, eps: float) -> float:
    value = number(op, "eps", eps)
    if not value >= 0:
        raise ShapeError(at_site(f"{op}: eps must be a number >= 0, got {shown(eps)}"))
    return value


def _affine(op: str, tape: Tape, x: Id, weight: Id | None, bias: Id | None, size: int,
            what: str) -> None:
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        tape.node(p, op, name)
        _check_same_dtype(op, x, name, p)
        if p.shape != (size,):
            raise ShapeError(at_site(f"{op}: {name} must have shape ({size},) ({what}), got "
                                     f"{p.shape}"))


# --- layer norm and batch norm: one kernel each way -------------------------------------------

# Row sums by `_kernels`' TG_ROW_SUM (8 lanes, compensated blocks), as losses' rows sum.
_NORM_KERNELS = """
// Sums over a contiguous run of C elements: of p, of (p - m)^2, of g * (p - m) * r.
inline T row_sum(__global const T* p, const long C) {
  T total; TG_ROW_SUM(total, C, TG_LOAD8(p + c), p[c]) return total;
}
inline T row_squares(__global const T* p, const long C, const T m) {
  T total;
  TG_ROW_SUM(total, C, (TG_LOAD8(p + c) - m) * (TG_LOAD8(p + c) - m), (p[c] - m) * (p[c] - m))
  return total;
}
inline T row_dot(__global const T* g, __global const T* p, const long C, const T m, const T r) {
  T total;
  TG_ROW_SUM(total, C, TG_LOAD8(g + c) * ((TG_LOAD8(p + c) - m) * r), g[c] * ((p[c] - m) * r))
  return total;
}

// The mean of a row and 1 / sqrt(its biased variance + eps), the variance in a second pass.
inline void ln_stats(__global const T* r, const long C, const T eps, T* mean, T* rstd) {
  const T m = row_sum(r, C) / (T)C;
  *mean = m;
  *rstd = (T)1 / sqrt(row_squares(r, C, m) / (T)C + eps);
}

// y = (x - mean) * rstd, times w where affine & 1, plus b where affine & 2; a work-item a row.
__kernel void layer_norm(__global T* out, __global const T* x, __global const T* w,
                         __global const T* b, const int affine, const T eps, const long C,
                         const long n) {
  const long i = get_global_id(0);
  if (i >= n) return;
  __global const T* r = x + i * C;
  __global T* dst = out + i * C;
  T mean, rstd;
  ln_stats(r, C, eps, &mean, &rstd);
  long c = 0;
  for (; c + 8 <= C; c += 8) {
    T8 v = (TG_LOAD8(r + c) - mean) * rstd;
    if (affine & 1) v = v * TG_LOAD8(w + c);
    if (affine & 2) v = v + TG_LOAD8(b + c);
    TG_STORE8(v, dst + c);
  }
  for (; c < C; ++c) {
    T v = (r[c] - mean) * rstd;
    if (affine & 1) v = v * w[c];
    if (affine & 2) v = v + b[c];
    dst[c] = v;
  }
}

// dx = rstd * (gw - mean(gw) - xh * mean(gw * xh)), gw = g (times w where scaled), xh the
// normalised row: the VJP of the normalisation, whose Jacobian is symmetric.
#define LN_GW8(c) (scaled ? TG_LOAD8(gr + (c)) * TG_LOAD8(w + (c)) : TG_LOAD8(gr + (c)))
#define LN_GW1(c) (scaled ? gr[c] * w[c] : gr[c])
__kernel void layer_norm_grad(__global T* out, __global const T* x, __global const T* g,
                              __global const T* w, const int scaled, const T eps,
                              const long C, const long n) {
  const long i = get_global_id(0);
  if (i >= n) return;
  __global const T* r = x + i * C;
  __global const T* gr = g + i * C;
  __global T* dst = out + i * C;
  T mean, rstd, sum_g, sum_gx;
  ln_stats(r, C, eps, &mean, &rstd);
  TG_ROW_SUM(sum_g, C, LN_GW8(c), LN_GW1(c))
  TG_ROW_SUM(sum_gx, C, LN_GW8(c) * ((TG_LOAD8(r + c) - mean) * rstd),
             LN_GW1(c) * ((r[c] - mean) * rstd))
  const T mean_g = sum_g / (T)C, mean_gx = sum_gx / (T)C;
  long c = 0;
  for (; c + 8 <= C; c += 8) {
    const T8 xh = (TG_LOAD8(r + c) - mean) * rstd;
    TG_STORE8(rstd * ((LN_GW8(c) - mean_g) - xh * mean_gx), dst + c);
  }
  for (; c < C; ++c) {
    const T xh = (r[c] - mean) * rstd;
    dst[c] = rstd * ((LN_GW1(c) - mean_g) - xh * mean_gx);
  }
}

// Batch norm: x is (N, K, S) (S the spatial size), a channel k's statistics over its N * S
// elements, a work-group of bn_l items per channel (a power of two, at most BN_LMAX). Each
// item takes a contiguous share of the channel's elements in (a, s) order, walked as runs
// along s (`base`, relative to the channel's first element, and `run`), each run summed 8 wide
// as a layer norm row; the items' sums are added in a fixed tree: the same bits every run.
#define BN_SETUP \\
  __local T red[BN_LMAX]; \\
  const int lid = get_local_id(0), bn_l = get_local_size(0); \\
  const long k = get_group_id(0), KS = K * S, count = N * S;
#define BN_WALK { const long per_ = (count + bn_l - 1) / bn_l; \\
  long j = min(count, (long)lid * per_); const long j1_ = min(count, j + per_); \\
  long a = j / S, s = j - a * S; \\
  while (j < j1_) { const long run = min(S - s, j1_ - j), base = a * KS + s;
#define BN_WALK_END j += run; ++a; s = 0; } }
#define BN_SUM(total, SPAN) { T acc_ = (T)0, lost_ = (T)0; \\
  BN_WALK TG_KAHAN(acc_, lost_, (SPAN)) BN_WALK_END \\
  red[lid] = acc_ - lost_; barrier(CLK_LOCAL_MEM_FENCE); \\
  for (int w_ = bn_l / 2; w_ > 0; w_ >>= 1) { \\
    if (lid < w_) red[lid] += red[lid + w_]; \\
    barrier(CLK_LOCAL_MEM_FENCE); } \\
  total = red[0]; barrier(CLK_LOCAL_MEM_FENCE); }

#define BN_STATS \\
  T total, squares; \\
  BN_SUM(total, row_sum(xk + base, run)) \\
  const T mean = total / (T)count; \\
  BN_SUM(squares, row_squares(xk + base, run, mean)) \\
  const T rstd = (T)1 / sqrt(squares / (T)count + eps);

__kernel void batch_norm(__global T* out, __global const T* x, __global const T* w,
                         __global const T* b, const int affine, const T eps, const long N,
                         const long K, const long S) {
  BN_SETUP
  __global const T* xk = x + k * S;
  __global T* ok = out + k * S;
  BN_STATS
  const T wk = (affine & 1) ? w[k] : (T)0, bk = (affine & 2) ? b[k] : (T)0;
  BN_WALK
    long c = 0;
    for (; c + 8 <= run; c += 8) {
      T8 v = (TG_LOAD8(xk + base + c) - mean) * rstd;
      if (affine & 1) v = v * wk;
      if (affine & 2) v = v + bk;
      TG_STORE8(v, ok + base + c);
    }
    for (; c < run; ++c) {
      T v = (xk[base + c] - mean) * rstd;
      if (affine & 1) v = v * wk;
      if (affine & 2) v = v + bk;
      ok[base + c] = v;
    }
  BN_WALK_END
}

// As layer_norm_grad per channel; the channel's weight scales its sums and g's elements after
// they are added (sum(g) w, where layer norm's rows sum g w): the same to rounding.
__kernel void batch_norm_grad(__global T* out, __global const T* x, __global const T* g,
                              __global const T* w, const int scaled, const T eps,
                              const long N, const long K, const long S) {
  BN_SETUP
  __global const T* xk = x + k * S;
  __global const T* gk = g + k * S;
  __global T* ok = out + k * S;
  BN_STATS
  const T wk = scaled ? w[k] : (T)1;
  T sum_g, sum_gx;
  BN_SUM(sum_g, row_sum(gk + base, run))
  BN_SUM(sum_gx, row_dot(gk + base, xk + base, run, mean, rstd))
  const T mean_g = sum_g / (T)count * wk, mean_gx = sum_gx / (T)count * wk;
  BN_WALK
    long c = 0;
    for (; c + 8 <= run; c += 8) {
      const T8 xh = (TG_LOAD8(xk + base + c) - mean) * rstd;
      const T8 gw = scaled ? TG_LOAD8(gk + base + c) * wk : TG_LOAD8(gk + base + c);
      TG_STORE8(rstd * ((gw - mean_g) - xh * mean_gx), ok + base + c);
    }
    for (; c < run; ++c) {
      const T xh = (xk[base + c] - mean) * rstd;
      const T gw = scaled ? gk[base + c] * wk : gk[base + c];
      ok[base + c] = rstd * ((gw - mean_g) - xh * mean_gx);
    }
  BN_WALK_END
}

// The weight's cotangent: per channel, the sum of g * xh.
__kernel void batch_norm_weight_grad(__global T* out, __global const T* x,
                                     __global const T* g, __global const T* unused,
                                     const int flags, const T eps, const long N, const long K,
                                     const long S) {
  BN_SETUP
  __global const T* xk = x + k * S;
  __global const T* gk = g + k * S;
  BN_STATS
  T sum_gx;
  BN_SUM(sum_gx, row_dot(gk + base, xk + base, run, mean, rstd))
  if (lid == 0) out[k] = sum_gx;
}

// Batch norm of x as (N, K) (S == 1: a BatchNorm1d's input), where a channel's elements are
// K apart: a work-item per 8 adjacent channels walks the N rows, a vector of 8 channels at a
// time, and the last K % 8 channels one each (the same code over V = T), where a work-item
// per channel walked runs of one element.
// Sums run down the rows in blocks of BNC_BLOCK added plainly, the blocks with compensation.
#define BNC_BLOCK 16
#define BNC_SUM(V, total, TERM) { V acc_ = (V)0, lost_ = (V)0; long r = 0; \
  for (; r + BNC_BLOCK <= N; ) { V b_ = (V)0; \
    for (const long e_ = r + BNC_BLOCK; r < e_; ++r) b_ += (TERM); \
    TG_KAHAN_V(V, acc_, lost_, b_) } \
  for (; r < N; ++r) TG_KAHAN_V(V, acc_, lost_, (TERM)) \
  total = acc_ - lost_; }
// 1 / sqrt(variance + eps) lane by lane (sqrt of a double8 is a call whose ABI clang warns
// about without AVX-512).
#define BNC_R1(s) ((T)1 / sqrt((s) / (T)N + eps))
#define BNC_R8(s) ((T8)(BNC_R1((s).s0), BNC_R1((s).s1), BNC_R1((s).s2), BNC_R1((s).s3), \
                        BNC_R1((s).s4), BNC_R1((s).s5), BNC_R1((s).s6), BNC_R1((s).s7)))
#define BNC_STATS(V, LD, RSTD) \
  V total, squares; \
  BNC_SUM(V, total, LD(x + r * K + c)) \
  const V mean = total / (T)N; \
  BNC_SUM(V, squares, (LD(x + r * K + c) - mean) * (LD(x + r * K + c) - mean)) \
  const V rstd = RSTD(squares);
#define BNC_ONE(p) (*(p))
#define BNC_PUT1(v, p) (*(p) = (v))
// Each kernel's body once, over V (T8 or T), its load LD, store ST and RSTD, at channel c.
#define BNC_NORM(V, LD, ST, RSTD) { \
  BNC_STATS(V, LD, RSTD) \
  const V wk = (affine & 1) ? LD(w + c) : (V)0, bk = (affine & 2) ? LD(b + c) : (V)0; \
  for (long r = 0; r < N; ++r) { \
    V v = (LD(x + r * K + c) - mean) * rstd; \
    if (affine & 1) v = v * wk; \
    if (affine & 2) v = v + bk; \
    ST(v, out + r * K + c); } }
#define BNC_GRAD(V, LD, ST, RSTD) { \
  BNC_STATS(V, LD, RSTD) \
  const V wk = scaled ? LD(w + c) : (V)1; \
  V sum_g, sum_gx; \
  BNC_SUM(V, sum_g, LD(g + r * K + c)) \
  BNC_SUM(V, sum_gx, LD(g + r * K + c) * ((LD(x + r * K + c) - mean) * rstd)) \
  const V mean_g = sum_g / (T)N * wk, mean_gx = sum_gx / (T)N * wk; \
  for (long r = 0; r < N; ++r) { \
    const V xh = (LD(x + r * K + c) - mean) * rstd; \
    const V gw = scaled ? LD(g + r * K + c) * wk : LD(g + r * K + c); \
    ST(rstd * ((gw - mean_g) - xh * mean_gx), out + r * K + c); } }
#define BNC_WEIGHT_GRAD(V, LD, ST, RSTD) { \
  BNC_STATS(V, LD, RSTD) \
  V sum_gx; \
  BNC_SUM(V, sum_gx, LD(g + r * K + c) * ((LD(x + r * K + c) - mean) * rstd)) \
  ST(sum_gx, out + c); }
"""


def _column_kernels() -> str:
    """The three S == 1 kernels (BNC_NORM, BNC_GRAD, BNC_WEIGHT_GRAD), with the operands of
    their per-channel forms (x, then w and b; g and w; g): a work-item per 8 channels, the
    last K % 8 one each."""
    out: list[str] = []
    for name, body, operands, flag in (
            ("batch_norm_cols", "BNC_NORM", ("w", "b"), "const int affine = flags;"),
            ("batch_norm_grad_cols", "BNC_GRAD", ("g", "w"), "const int scaled = flags;"),
            ("batch_norm_weight_grad_cols", "BNC_WEIGHT_GRAD", ("g", "unused"), "(void)flags;")):
        one, two = operands
        out.append(f"""
__kernel void {name}(__global T* out, __global const T* x, __global const T* {one},
                     __global const T* {two}, const int flags, const T eps, const long N,
                     const long K) {{
  const long c0 = get_global_id(0) * 8;
  if (c0 >= K) return;
  {flag}
  if (c0 + 8 <= K) {{ const long c = c0; {body}(T8, TG_LOAD8, TG_STORE8, BNC_R8) }}
  else for (long c = c0; c < K; ++c) {body}(T, BNC_ONE, BNC_PUT1, BNC_R1)
}}""")
    return "".join(out) + "\n"


# A batch norm kernel's work-group: its items share a channel's elements and add their sums
# through local memory, a barrier a step. PoCL runs a work-group's items as loops split at each
# barrier: on a CPU, where a channel's sum by one item is a loop that vectorizes, 64 items made
# the kernels several times slower than one (BENCHMARKS, session 20). A CPU so gives each
# channel one item, more only where there are fewer channels than cores; a GPU BN_LMAX.
_BN_LMAX = 64
# The column kernels' work-groups: one item each, so that a few groups of 8 channels (16 for
# 128 channels) still spread over the cores, where one group of 64 ran on one.
BNC_LOCAL = 1


def _bn_items(dev: Device, channels: int, spatial: int) -> int:
    """Work-items per channel: BN_LMAX on a GPU; on a CPU the fewest (a power of two) that give
    each compute unit one, or 0 where a channel has one element per sample (spatial == 1):
    the column kernels (`_column_kernels`), a work-item per 8 channels."""
    if dev.is_gpu:
        return _BN_LMAX
    if spatial == 1:
        return 0
    units = dev.compute_units
    items = 1
    while items * channels < units and items < _BN_LMAX:
        items *= 2
    return items


def _norm_source(dtype: DType) -> str:
    t = C_TYPES[dtype]
    return (fp64_pragma(dtype) + f"typedef {t} T;\ntypedef {t}8 T8;\n#define BN_LMAX {_BN_LMAX}\n"
            + KAHAN + VEC8 + _NORM_KERNELS + _column_kernels())


register_family("norm", _norm_source)


@dataclass(frozen=True, slots=True)
class NormParams:
    """The norm's eps, whether a weight and a bias follow x among the arguments (for the
    _grad primitives: a weight after x and g; `bias` unused), and `batch`: normalise each
    channel (axis 1) over every other axis, where layer norm normalises the last axis. The
    weight and bias run along the same axis as the statistics' groups: the last, or axis 1."""

    eps: float
    weight: bool
    bias: bool = False
    batch: bool = False

    def axis(self, ndim: int) -> int:
        """The axis of the weight and bias, and of the groups of the statistics."""
        return 1 if self.batch else ndim - 1

    def reduced(self, ndim: int) -> tuple[int, ...]:
        """The axes each group's statistics are taken over."""
        return tuple(a for a in range(ndim) if a != 1) if self.batch else (ndim - 1,)


def _norm_rule(name: str, leading: int) -> Any:
    """The rule of the norms (x first) and their _grad primitives (x and g): the output is
    x's; the weight and bias (C,) of x's dtype, C the size of x along `NormParams.axis`."""

    def rule(args: Sequence[Any], p: NormParams) -> Aval:
        x = args[0]
        if len(args) != leading + p.weight + p.bias:
            raise ShapeError(f"{name}: takes {leading + p.weight + p.bias} operands, got "
                             f"{len(args)}")
        if not is_float(x.dtype) or x.ndim < 1 + p.batch:
            raise DTypeError(f"{name}: x must be float with {1 + p.batch} axes or more, got "
                             f"{x.shape} {dtype_name(x.dtype)}")
        for k, other in enumerate(args[1:], 1):
            want = x.shape if k < leading else (x.shape[p.axis(x.ndim)],)
            if other.dtype != x.dtype or tuple(other.shape) != tuple(want):
                raise ShapeError(f"{name}: operand {k} must be {want} {dtype_name(x.dtype)}, "
                                 f"got {tuple(other.shape)} {dtype_name(other.dtype)}")
        return Aval(tuple(x.shape), x.dtype)
    return rule


def _norm_kernel(dev: Device, name: str, inputs: Sequence[AnyTensor], flags: int,
                 p: NormParams, aval: Aval) -> AnyTensor:
    """One of `_NORM_KERNELS` over x (inputs[0]; a weight or bias absent from `inputs`
    is never read): layer norm's a work-item per row of the last axis, batch norm's a
    work-group per channel (`_bn_items`), or a work-item per 8 channels where each holds one
    element per sample (the column kernels)."""
    out = empty(aval.shape, aval.dtype, dev)
    if out.size and not inputs[0].size:  # the weight's cotangent of an empty x: sums of nothing
        fill_into(out, 0.0)
    elif out.size:
        shape = inputs[0].shape
        items = _bn_items(dev, shape[1], math.prod(shape[2:])) if p.batch else 0
        columns = p.batch and not items
        kernel = dev.kernel("norm", dtype_name(aval.dtype),
                            f"batch_{name}_cols" if columns
                            else f"batch_{name}" if p.batch else f"layer_{name}",
                            lambda: _norm_source(aval.dtype))
        buffers = [t.buffer for t in inputs]
        buffers += [buffers[0]] * (3 - len(buffers))
        # eps as given (no float() of it): under tg.jit it may be a traced number.
        if columns:  # (N, C): a work-item per 8 channels (`_column_kernels`)
            groups = -(-shape[1] // 8)
            dev.launch(kernel, (-(-groups // BNC_LOCAL) * BNC_LOCAL,), (BNC_LOCAL,),
                       out.buffer, *buffers, flags, p.eps, shape[0], shape[1])
        elif p.batch:
            channels = shape[1]
            dev.launch(kernel, (channels * items,), (items,), out.buffer, *buffers, flags,
                       p.eps, shape[0], channels, math.prod(shape[2:]))
        else:
            rows = math.prod(shape) // shape[-1]
            dev.launch(kernel, launch_size(rows), (LOCAL,), out.buffer, *buffers, flags, p.eps,
                       shape[-1], rows)
    return out


def _norm_forward(dev: Device, args: Sequence[AnyTensor], p: NormParams, aval: Aval
                  ) -> AnyTensor:
    x = args[0]
    weight = args[1] if p.weight else x  # an absent one is never read
    bias = args[1 + p.weight] if p.bias else x
    return _norm_kernel(dev, "norm", [x, weight, bias], p.weight | p.bias << 1, p, aval)


def _sum_groups(e: Emitter, t: Any, p: NormParams) -> Any:
    """t summed over each group of the statistics, kept as size-1 axes."""
    return e.apply(SUM, [t], ReduceParams(p.reduced(t.ndim), True))


def _sum_params(e: Emitter, t: Any, p: NormParams) -> Any:
    """t summed over every axis but the weight's: a cotangent of the weight or the bias."""
    axes = tuple(a for a in range(t.ndim) if a != p.axis(t.ndim))
    return e.apply(SUM, [t], ReduceParams(axes, False)) if axes else t


def _norm_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: NormParams,
              needs: Sequence[bool]) -> list[Any]:
    """dx by the _grad primitive; the weight's is the sum of g * xh (xh, the normalised x,
    recomputed by the norm without its affine part), the bias's of g."""
    x = args[0]
    parts: list[Any] = [None] * len(args)
    plain = NormParams(p.eps, False, batch=p.batch)
    if needs[0]:
        parts[0] = e.apply(_GRAD[p.batch], [x, g, *args[1:1 + p.weight]],
                           NormParams(p.eps, p.weight, batch=p.batch))
    if p.weight and needs[1]:
        if p.batch:  # one kernel per channel, as the norm's
            parts[1] = e.apply(BATCH_NORM_WEIGHT_GRAD, [x, g], plain)
        else:
            xh = e.apply(LAYER_NORM, [x], plain)
            parts[1] = _sum_params(e, e.apply(_ew.MUL, [g, xh]), p)
    if p.bias and needs[-1]:
        parts[-1] = _sum_params(e, g, p)
    return parts


def _norm_grad_forward(dev: Device, args: Sequence[AnyTensor], p: NormParams, aval: Aval
                       ) -> AnyTensor:
    return _norm_kernel(dev, "norm_grad", args, int(p.weight), p, aval)


def _norm_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: NormParams,
                   needs: Sequence[bool]) -> list[Any]:
    """out = J (g w), J = d xh / dx = r (I - 11'/M - xh xh'/M) per group of M elements (r =
    1/sqrt(var + eps)), symmetric: in g, w (J h); in w, the sum of g (J h); in x,
    -(r/M) (sum(h out) xh + sum(h xh) out) - r mean(g w xh) (J h)."""
    x, g = args[0], args[1]
    shape = tuple(x.shape)
    size = math.prod(shape[a] for a in p.reduced(len(shape)))
    per = 1.0 / size if size else 0.0  # no elements: every tensor below is empty

    def wide(t: Any) -> Any:  # a value per group (size-1 axes elsewhere) over x's shape
        return e.apply(BROADCAST_TO, [t], BroadcastParams(shape))

    weight = None
    if p.weight:
        along = [1] * len(shape)
        along[p.axis(len(shape))] = shape[p.axis(len(shape))]
        weight = wide(e.apply(_shape.RESHAPE, [args[2]], _shape.ReshapeParams(tuple(along))))
    plain = NormParams(p.eps, False, batch=p.batch)
    jh = e.apply(_GRAD[p.batch], [x, h], plain)
    parts: list[Any] = [None] * len(args)
    if needs[1]:
        parts[1] = jh if weight is None else e.apply(_ew.MUL, [jh, weight])
    if p.weight and needs[2]:
        parts[2] = _sum_params(e, e.apply(_ew.MUL, [g, jh]), p)
    if needs[0]:
        mean = e.apply(_ew.MUL, [_sum_groups(e, x, p), per])
        centred = e.apply(_ew.SUB, [x, wide(mean)])
        var = e.apply(_ew.MUL, [_sum_groups(e, e.apply(_ew.MUL, [centred, centred]), p),
                                per])
        r = e.apply(_ew.DIV, [1.0, e.apply(_ew.SQRT, [e.apply(_ew.ADD, [var, p.eps])])])
        xh = e.apply(_NORM[p.batch], [x], plain)
        gw = g if weight is None else e.apply(_ew.MUL, [g, weight])
        r_m = e.apply(_ew.MUL, [r, per])
        on_xh = e.apply(_ew.MUL, [r_m, _sum_groups(e, e.apply(_ew.MUL, [h, out]), p)])
        on_out = e.apply(_ew.MUL, [r_m, _sum_groups(e, e.apply(_ew.MUL, [h, xh]), p)])
        on_jh = e.apply(_ew.MUL, [r_m, _sum_groups(e, e.apply(_ew.MUL, [gw, xh]), p)])
        total = e.apply(_ew.ADD, [e.apply(_ew.MUL, [wide(on_xh), xh]),
                                  e.apply(_ew.MUL, [wide(on_out), out])])
        total = e.apply(_ew.ADD, [total, e.apply(_ew.MUL, [wide(on_jh), jh])])
        parts[0] = e.apply(_ew.NEG, [total])
    return parts


LAYER_NORM: Primitive[NormParams] = register(Primitive(
    "layer_norm", _norm_rule("layer_norm", 1), _norm_forward, _norm_vjp,
    doc="(x - mean) / sqrt(var + eps) over the last axis (the biased variance, in a second "
        "pass), times a weight and plus a bias when given: one kernel, a work-item per row."))
LAYER_NORM_GRAD: Primitive[NormParams] = register(Primitive(
    "layer_norm_grad", _norm_rule("layer_norm_grad", 2), _norm_grad_forward, _norm_grad_vjp,
    doc="layer_norm's VJP in x: r (g w - mean(g w) - xh mean(g w xh)) per row, the row's "
        "statistics recomputed from x; one kernel, a work-item per row."))
BATCH_NORM: Primitive[NormParams] = register(Primitive(
    "batch_norm", _norm_rule("batch_norm", 1), _norm_forward, _norm_vjp,
    doc="(x - mean) / sqrt(var + eps) per channel (axis 1) over every other axis, times a "
        "weight and plus a bias per channel when given: one kernel, a work-group per "
        "channel."))
BATCH_NORM_GRAD: Primitive[NormParams] = register(Primitive(
    "batch_norm_grad", _norm_rule("batch_norm_grad", 2), _norm_grad_forward, _norm_grad_vjp,
    doc="batch_norm's VJP in x, as layer_norm_grad's per channel; one kernel, a work-group "
        "per channel."))


def _weight_grad_rule(args: Sequence[Any], p: NormParams) -> Aval:
    x, g = args
    if g.shape != x.shape or g.dtype != x.dtype or x.ndim < 2:
        raise ShapeError(f"batch_norm_weight_grad: x {x.shape} and g {g.shape} must be alike, "
                         "(N, C, ...)")
    return Aval((x.shape[1],), x.dtype)


def _weight_grad_forward(dev: Device, args: Sequence[AnyTensor], p: NormParams, aval: Aval
                         ) -> AnyTensor:
    return _norm_kernel(dev, "norm_weight_grad", args, 0, p, aval)


def _weight_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: NormParams,
                     needs: Sequence[bool]) -> list[Any]:
    """out[c] = sum(g xh) over channel c: in g, h xh (batch_norm with weight h); in x,
    J (g h) (batch_norm_grad with weight h)."""
    x, g = args
    scaled = NormParams(p.eps, True, batch=True)
    return [e.apply(BATCH_NORM_GRAD, [x, g, h], scaled) if needs[0] else None,
            e.apply(BATCH_NORM, [x, h], scaled) if needs[1] else None]


BATCH_NORM_WEIGHT_GRAD: Primitive[NormParams] = register(Primitive(
    "batch_norm_weight_grad", _weight_grad_rule, _weight_grad_forward, _weight_grad_vjp,
    doc="batch_norm's VJP in its weight: per channel, the sum of g * (x - mean) * rstd; one "
        "kernel, a work-group per channel."))
_NORM = {False: LAYER_NORM, True: BATCH_NORM}
_GRAD = {False: LAYER_NORM_GRAD, True: BATCH_NORM_GRAD}


@takes_tape
def layer_norm(tape: Tape, x: Id, weight: Id | None = None, bias: Id | None = None,
               eps: float = 1e-5) -> tuple[Tape, Id]:
    """Normalise over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    The variance is biased (ddof=0), as PyTorch; weight and bias have shape (x.shape[-1],).
    """
    op = "layer_norm"
    tape.node(x, op, "x")
    _check_float(op, "x", x)
    if x.ndim < 1:
        raise ShapeError(at_site(f"{op}: x must have at least one axis, got a scalar"))
    _affine(op, tape, x, weight, bias, x.shape[-1], "the last axis of x")
    eps = _check_eps(op, eps)
    args = [x, *(p for p in (weight, bias) if p is not None)]
    return record(tape, LAYER_NORM, args, NormParams(eps, weight is not None, bias is not None))


@takes_tape
def batch_norm(tape: Tape, x: Id, weight: Id | None = None, bias: Id | None = None,
               eps: float = 1e-5) -> tuple[Tape, Id]:
    """Normalise with the batch's statistics: over every axis but axis 1 (the channels).

    x is (N, C, ...); the variance is biased (ddof=0), as PyTorch's training mode; weight and
    bias have shape (C,). Running statistics are the caller's to keep. A single value per
    channel normalises to 0 (PyTorch refuses that case; tapegrad computes it).
    """
    op = "batch_norm"
    tape.node(x, op, "x")
    _check_float(op, "x", x)
    if x.ndim < 2:
        raise ShapeError(at_site(f"{op}: x must be (N, C, ...) with at least 2 axes, got shape "
                                 f"{x.shape}"))
    c = x.shape[1]
    _affine(op, tape, x, weight, bias, c, "the channels, x.shape[1]")
    eps = _check_eps(op, eps)
    args = [x, *(p for p in (weight, bias) if p is not None)]
    return record(tape, BATCH_NORM, args,
                  NormParams(eps, weight is not None, bias is not None, batch=True))


# --- dropout ---------------------------------------------------------------------------------

def _dropout_source(dtype: DType) -> str:
    return fp64_pragma(dtype) + f"typedef {C_TYPES[dtype]} T;\n" + """
inline ulong tg_mix64(ulong z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
  return z ^ (z >> 31);
}
__kernel void dropout(__global T* out, __global const T* x, const ulong seed,
                      const ulong threshold, const T scale, const long n) {
  const long i = get_global_id(0);
  if (i >= n) return;
  const ulong bits = tg_mix64(tg_mix64(seed) + ((ulong)i + 1UL) * 0x9E3779B97F4A7C15UL);
  // x times the mask's 0 or 1/(1-p), as PyTorch: a dropped inf or NaN is NaN, not 0.
  out[i] = x[i] * ((bits >> 32) >= threshold ? scale : (T)0);
}
"""


@dataclass(frozen=True, slots=True)
class DropoutParams:
    p: float
    seed: int  # reduced to 0 .. 2**64 - 1
    # A value of a replayed sweep, not of its structure: a new seed each step still replays
    # (`_jit.SweepReplays`).
    call_numbers: ClassVar[tuple[str, ...]] = ("seed",)

    @property
    def threshold(self) -> int:
        """Elements whose 32 random bits are below this are dropped: p * 2**32 (rounded by a
        traced function: under tg.jit a p that changes every call replays)."""
        return min(rounded(self.p * 2.0**32, round), 2**32)

    @property
    def scale(self) -> float:
        return 0.0 if self.p >= 1.0 else 1.0 / (1.0 - self.p)


def _dropout_rule(args: Sequence[Any], p: DropoutParams) -> Aval:
    (x,) = args
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"dropout: x has dtype {dtype_name(x.dtype)}, expected "
                                 "float32 or float64"))
    return Aval(tuple(x.shape), x.dtype)


def _dropout_forward(dev: Device, args: Sequence[AnyTensor], p: DropoutParams, aval: Aval
                     ) -> AnyTensor:
    (x,) = args
    out = empty(aval.shape, aval.dtype, dev)
    n = out.size
    if n:
        kernel = dev.kernel("dropout", dtype_name(aval.dtype), "dropout",
                            lambda: _dropout_source(aval.dtype))
        # The seed as given (no np.uint64 of it): under tg.jit it may be a traced number.
        dev.launch(kernel, launch_size(n), (LOCAL,), out.buffer, x.buffer, p.seed,
                   p.threshold, p.scale, n)
    return out


# The same seed over the same element indices re-derives the same mask: its own transpose.
DROPOUT = self_adjoint(LinearOp(
    "dropout", _dropout_rule, _dropout_forward,
    "x * mask / (1 - p), the mask hashed on the device from (seed, element index); the VJP "
    "applies the same mask to the cotangent."))


@takes_tape
def dropout(tape: Tape, x: Id, p: float, seed: int) -> tuple[Tape, Id]:
    """Zero each element with probability p and scale the rest by 1/(1-p) (inverted dropout).

    The mask depends only on (seed, x's shape, p): the same seed gives the same mask, and it is
    drawn on the device (a SplitMix64 hash of the seed and the element's flat index). `seed` is
    any int (taken modulo 2**64). p=0 returns x itself (no node); p=1 gives zeros (and a zero
    gradient); p outside [0, 1] raises. Call with another seed at each step for fresh masks.
    """
    op = "dropout"
    tape.node(x, op, "x")
    _check_float(op, "x", x)
    prob = number(op, "p", p)
    if not 0.0 <= prob <= 1.0:
        raise ShapeError(at_site(
            f"{op}: p must be a probability in [0, 1] (1 drops everything), got {shown(p)}"))
    if not is_integer(seed):
        raise DTypeError(at_site(f"{op}: seed must be an int, got {shown(seed)}"))
    if prob == 0:
        return tape, x
    return record(tape, DROPOUT, [x], DropoutParams(prob, as_index(seed) % 2**64))


register_family("dropout", _dropout_source)
