"""Reductions on tensors: the kernels behind sum, max, min and logsumexp (and the losses').

Any reduction is run as passes over a contiguous block of axes, the input viewed as (A, K, B):
out[a, b] = reduce over k of x[a, k, b]. Non-adjacent axes take one pass per block. When there
are few outputs and a long K, a pass splits K into P chunks (A, P, B) and reduces the partial
results in a second pass, so a full reduction still has hundreds of work-items.

A backend module: tensors in, tensors out; the primitives are in `_ops.broadcast` (sum, the
transpose of broadcasting) and `_ops.reduce` (the others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._device import LOCAL, fp64_pragma, register_family
from ._fusion import sum_rows
from ._kernels import KAHAN, VEC8, launch_size, row_sum
from ._tensor import C_TYPES, AnyTensor, DType, Shape, dtype_name, empty

_COMBINE = {
    "sum": ("(T)0", "acc + v"),
    "max": ("-INFINITY", "(v > acc || v != v) ? v : acc"),
    "min": ("INFINITY", "(v < acc || v != v) ? v : acc"),
}


def _lane(combine: str, j: int) -> str:
    """`combine` over the running extreme m{j} instead of acc."""
    return combine.replace("acc", f"m{j}")


def reduction_source(dtype: DType) -> str:
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
    # A row's maximum or minimum in eight running extremes (element j of each group of eight
    # to the j-th), then those and the last few elements in order: one running extreme was a
    # chain of dependent selects, each testing NaN with a library call. The same value either
    # way (a NaN if there is one); of a -0 and a +0, which one is kept may differ.
    for kind in ("max", "min"):
        init, combine = _COMBINE[kind]
        lanes = "".join(f"    {{ const T v = src[k + {j}]; m{j} = {_lane(combine, j)}; }}\n"
                        for j in range(8))
        merge = "".join(f"  {{ const T v = m{j}; acc = {combine}; }}\n" for j in range(8))
        parts.append(
            f"__kernel void reduce_{kind}_rows(__global T* out, __global const T* x, "
            "const long K, const long P, const long chunk, const long n) {\n"
            "  const long gid = get_global_id(0);\n  if (gid >= n) return;\n"
            "  const long p = gid % P, a = gid / P;\n"
            "  const long k0 = p * chunk, k1 = min(K, k0 + chunk);\n"
            "  __global const T* src = x + a * K;\n"
            "  T " + ", ".join(f"m{j} = {init}" for j in range(8)) + ";\n  long k = k0;\n"
            f"  for (; k + 8 <= k1; k += 8) {{\n{lanes}  }}\n"
            f"  T acc = {init};\n{merge}"
            f"  for (; k < k1; ++k) {{ const T v = src[k]; acc = {combine}; }}\n"
            "  out[gid] = acc;\n}\n")
    parts.append(_LSE_SOURCE)
    parts.append(row_sumexp_source(dtype) + _LSE_ROWS_SOURCE)
    return "".join(parts)


register_family("reduce", reduction_source)


# Sum over contiguous k (B == 1), `_kernels.row_sum`'s order: eight independent partial sums
# (a single accumulator is a chain the compiler may not reorder; eight vectorize), the rest of
# a row after its whole blocks in them too, not term by term.
_SUM_ROWS_SOURCE = KAHAN + f"""
__kernel void reduce_sum_rows(__global T* out, __global const T* x, const long K,
                              const long P, const long chunk, const long n) {{
  const long gid = get_global_id(0);
  if (gid >= n) return;
  const long p = gid % P, a = gid / P;
  const long k0 = p * chunk, k1 = min(K, k0 + chunk);
  __global const T* src = x + a * K;
{row_sum(lambda i: f"src[{i}]")}  out[gid] = total_;
}}
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
  for (long k = 0; k < K; ++k) { const T v = src[k * B]; m = (v > m || v != v) ? v : m; }
  const T shift = isinf(m) ? (T)0 : m;
  T acc = (T)0;
  for (long k = 0; k < K; ++k) acc += exp(src[k * B] - shift);
  out[gid] = log(acc) + shift;
}
"""


# A row's sum of exponentials shifted by its maximum (by 0 if that is -inf), so log(sum) +
# shift is its logsumexp. A maximum of +inf shifts by inf, which makes the row's log-softmax,
# cross-entropy and gradient NaN, as PyTorch's (inf - inf); logsumexp itself
# (`reduce_logsumexp_rows`) is +inf there, as PyTorch's.
#
# A contiguous row is read 8 elements at a time: PoCL's exp of a vector is one call for eight
# lanes, where a scalar loop calls it per element. The sum adds blocks of TG_BLOCK elements
# (8 lanes of 16) plainly and the block sums with Kahan's compensation (`_kernels.KAHAN`), as
# `reduce` sums rows: a plain running sum of 1e5 exponentials erred 6.6e-6 relative, 50x PyTorch's.
_ROW_SUMEXP = """
#define LS_MAX(m, v) m = ((v) > m || (v) != (v)) ? (v) : m  // NaN wins; no library call

inline T tg_row_max(__global const T* row, const long C) {
  T8 m8 = (T8)(-INFINITY);
  long c = 0;
  for (; c + 8 <= C; c += 8) { const T8 v = TG_LOAD8(row + c); LS_MAX(m8, v); }
  T m = -INFINITY;
  LS_MAX(m, m8.s0); LS_MAX(m, m8.s1); LS_MAX(m, m8.s2); LS_MAX(m, m8.s3);
  LS_MAX(m, m8.s4); LS_MAX(m, m8.s5); LS_MAX(m, m8.s6); LS_MAX(m, m8.s7);
  for (; c < C; ++c) { const T v = row[c]; LS_MAX(m, v); }
  return m;
}

// With `keep`, each exponential is also written there (softmax's numerators: its output pass
// then divides them instead of computing each exponential again, the same values).
inline T tg_row_sumexp_kept(__global const T* row, const long C, T* shift, __global T* keep) {
  const T m = tg_row_max(row, C);
  const T sh = m == -INFINITY ? (T)0 : m;
  *shift = sh;
  T8 s8 = (T8)0, c8 = (T8)0;
  long c = 0;
  for (; c + TG_BLOCK <= C; c += TG_BLOCK) {
    T8 b = (T8)0;
    for (long u = c; u < c + TG_BLOCK; u += 8) {
      const T8 e = LS_EXP8(TG_LOAD8(row + u) - sh);
      if (keep) TG_STORE8(e, keep + u);
      b += e;
    }
    TG_KAHAN8(s8, c8, b)
  }
  T acc = ((s8.s0 + s8.s1) + (s8.s2 + s8.s3)) + ((s8.s4 + s8.s5) + (s8.s6 + s8.s7));
  T lost = ((c8.s0 + c8.s1) + (c8.s2 + c8.s3)) + ((c8.s4 + c8.s5) + (c8.s6 + c8.s7));
  for (; c + 8 <= C; c += 8) {
    const T8 e = LS_EXP8(TG_LOAD8(row + c) - sh);
    if (keep) TG_STORE8(e, keep + c);
    TG_KAHAN(acc, lost, ((e.s0 + e.s1) + (e.s2 + e.s3)) + ((e.s4 + e.s5) + (e.s6 + e.s7)))
  }
  for (; c < C; ++c) {
    const T e = exp(row[c] - sh);
    if (keep) keep[c] = e;
    TG_KAHAN(acc, lost, e)
  }
  return acc - lost;
}

inline T tg_row_sumexp(__global const T* row, const long C, T* shift) {
  return tg_row_sumexp_kept(row, C, shift, 0);
}
"""


def row_sumexp_source(dtype: DType) -> str:
    """The row helpers (`tg_row_max`, `tg_row_sumexp`, LS_EXP8 and LS_LOG8) after T, T8,
    KAHAN and VEC8: the losses' rows and logsumexp's."""
    # Library calls on double8 (exp, isnan) in the core program left PoCL's build without a
    # single kernel, reporting success (LLVM 14; the float32 core was fine): doubles, for
    # checks more than speed, take exp lane by lane.
    exp8, log8 = (("exp(v)", "log(v)") if dtype == np.float32 else
                  tuple("(T8)(" + ", ".join(f"{f}((v).s{i})" for i in range(8)) + ")"
                        for f in ("exp", "log")))
    # Guarded: the reduce and losses families share the core program.
    return (f"#ifndef TG_ROW_SUMEXP\n#define TG_ROW_SUMEXP\n#define LS_EXP8(v) {exp8}\n"
            f"#define LS_LOG8(v) {log8}\n{_ROW_SUMEXP}#endif\n")


# logsumexp over contiguous rows (B == 1), a work-item per row: the row helpers' vector exps
# (one library call for eight), where `reduce_logsumexp` calls exp per element. A row whose
# maximum is +inf is +inf.
_LSE_ROWS_SOURCE = """
__kernel void reduce_logsumexp_rows(__global T* out, __global const T* x, const long K,
                                    const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  T shift;
  const T total = tg_row_sumexp(x + gid * K, K, &shift);
  out[gid] = shift == (T)INFINITY ? shift : log(total) + shift;
}
"""


_TARGET_ITEMS = 512  # work-items wanted in a pass before it is worth splitting K
COLS_LOCAL = 8  # work-items per group of reduce_sum_cols
_MIN_CHUNK = 256
# Elements below which one pass beats two, however few its work-items: the second pass is a
# launch (40-80 us to an idle PoCL device), and a work-item sums ~100 elements a microsecond.
# The CNN's bias gradients (8 x 4096 and 16 x 1024 elements) took two launches each.
SPLIT_MIN = 1 << 16
# A GPU's (target outputs, shortest chunk, least elements): it runs thousands of work-items at
# once and a launch more costs it little, where one work-item walking all of a layer norm's
# rows was most of its weight gradient (BENCHMARKS, session 36).
_GPU_CUT = (8192, 32, 1 << 12)


def parts_of(a: int, k: int, b: int, *, gpu: bool = False) -> int:
    """Work-items per output when reducing (a, k, b) over k: 1 (one pass) unless the outputs
    are few, k is long and the whole is large; else chunks of k for a second pass to sum.
    `gpu`: the sum kernels' cut on a GPU (`_pass`), sooner and finer."""
    target, min_chunk, split_min = _GPU_CUT if gpu else (_TARGET_ITEMS, _MIN_CHUNK, SPLIT_MIN)
    if a * b >= target or k < 2 * min_chunk or a * k * b < split_min:
        return 1
    return min(max(target // (a * b), 1), k // min_chunk)


def _pass(x: AnyTensor, kind: str, a: int, k: int, b: int) -> AnyTensor:
    """Reduce x viewed as (a, k, b) over k; the result has a * b elements (shape (a, 1, b))."""
    dev = x.device
    rows = kind in ("sum", "max", "min") and b == 1
    cols = kind == "sum" and b > 1
    name = f"reduce_{kind}_rows" if rows else "reduce_sum_cols" if cols else f"reduce_{kind}"
    kernel = dev.kernel("reduce", dtype_name(x.dtype), name, lambda: reduction_source(x.dtype))
    parts = parts_of(a, k, b, gpu=dev.is_gpu)
    chunk = -(-k // parts) if k else 0
    out = empty((a * parts * b,), x.dtype, dev)
    n = out.size
    # A pending x may be summed inside one generated kernel (`sum_rows`): x is never written.
    if n and not (rows and kind == "sum" and sum_rows(x, out, k, parts, chunk)):
        items = n // b * -(-b // 8) if cols else n
        sizes = (k, parts, chunk, n) if rows else (k, b, parts, chunk, items)
        # A work-item sums 8 columns, so on a CPU a bias gradient's few work-items (64 for
        # 512 columns) made one group of LOCAL, run on one core: groups of COLS_LOCAL share
        # them. A GPU keeps LOCAL (a group runs on one multiprocessor).
        local = COLS_LOCAL if cols and not dev.is_gpu else LOCAL
        dev.launch(kernel, launch_size(items, local), (local,), out.buffer, x.buffer, *sizes)
    return _pass(out, kind, a, parts, b) if parts > 1 else out


def blocks(shape: Shape, axes: Sequence[int]) -> list[tuple[int, int]]:
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
    for i0, i1 in reversed(blocks(x.shape, axes)):
        a, k, b = math.prod(shape[:i0]), math.prod(shape[i0:i1]), math.prod(shape[i1:])
        if k != 1:
            current = _pass(current, kind, a, k, b)
        shape[i0:i1] = [1] * (i1 - i0)
    return current.with_shape(keep_shape)


def keep_shape(shape: Shape, axes: Sequence[int]) -> Shape:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))

