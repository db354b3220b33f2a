"""Gather by integer ids: take (numpy's `take` along one axis) and embedding (take on axis 0).

`take(x, indices, axis)` views x as (A, K, B) around `axis` and the indices as J flat positions;
the result is (A, J, B): out[a, j, b] = x[a, indices[j], b]. Its VJP is `take_grad`, a
scatter-add into zeros of x's shape: gx[a, k, b] = sum of g[a, j, b] over the j with
indices[j] == k. Repeated indices sum their gradients, and the sum is deterministic: every
output element adds its matching j in ascending order, so a gradient is bitwise the same on
every run (no float atomics). Three kernels compute that same order:

- `scan`: one work-item per gx element loops over all J indices (best for few gx elements or
  few pairs: `scan_wins`).
- `rows`: one work-item per chunk of a gx row loops over all J indices and adds the g rows of
  those that name its row (few rows times indices: `rowscan_wins`, a small vocabulary's
  embedding; one launch where the sort takes ~10).
- `sorted`: the positions j are ordered by their row k once on the device (a stable radix
  sort: within a row, j stays ascending), the start of each row's run is marked, and one
  work-item per chunk of a gx row adds the g rows of its run, j ascending. Same additions in
  the same order as `scan`; every gx element is written once. Where gx has more rows than
  there are indices (a flat log-probability gathered at its labels), gx is zeros first and
  one work-item per sorted position adds the run it starts (`runs`): the rows no index names
  cost only the fill. With few indices there, each position instead looks for an earlier
  one naming its row, and the first adds them all (`firsts`: one launch, no sort).

Indices made from host data are checked against the axis before anything runs (their range
is noted at upload, `_tensor.host_range`, and kept by the ops that only move values,
`_tensor.keep_range`). Indices computed on the device cannot be checked
without reading them back, which a forward never does: out of [-K, K) they wrap modulo K
(numpy's mode="wrap"), so an invalid one picks an element instead of raising. `take_grad`
wraps the same way, so forward and VJP always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyopencl as cl

from .._device import LOCAL, Device, fp64_pragma
from .._errors import DTypeError, IndexRangeError, NotAnIdError, ShapeError, at_site
from .._kernels import fill_into, launch_size
from .._primitive import Aval, LinearOp, transposes
from .._tape import Id, Tape, record, takes_tape
from .._tensor import (
    C_TYPES,
    INTS,
    AnyTensor,
    DType,
    Shape,
    checked_range,
    dtype_name,
    empty,
    size_of,
)
from .shape import int_axis, reshape, split_at

# Up to this many (gx element, index) pairs the scan kernel runs whatever its cost relative to
# the sort (whose ~10 launches dominate small problems).
SCAN_LIMIT = 1 << 17
SCAN_ROWS = 8  # ... and for at most this many gradient elements, however many indices
# Up to this many (work-item, index) comparisons the row scan runs: about what the sort's
# launches cost at the limit (BENCHMARKS, session 19).
ROWSCAN_LIMIT = 1 << 19
# Up to this many (work-item, index) comparisons `firsts` runs rather than the sort (twice as
# many cost as much as the sort's launches: BENCHMARKS, session 21).
FIRSTS_LIMIT = 1 << 17
CHUNK = 256  # elements that one work-item of take_fwd (of a row: take_grad_rows) writes
RADIX_BLOCK = 512  # keys per block of the radix sort, at least (at most RADIX_BLOCKS blocks)
RADIX_BLOCKS = 256


def scan_wins(outputs: int, j: int) -> bool:
    """Whether `take_grad_scan` is cheaper than sorting the J indices, for `outputs` gradient
    elements. The scan visits every (element, index) pair (~0.6 ns a pair on two cores); the
    sort costs a few ns per index and radix pass (2-3 passes) plus ~10 launches, and then
    every gradient element is written once."""
    return outputs * j <= SCAN_LIMIT or outputs <= SCAN_ROWS


def sparse_wins(rows: int, j: int) -> bool:
    """Whether gx's `rows` (along the axis) outnumber the J indices, so that a fill and then a
    work-item per index position (`firsts`, `runs`) beat a work-item per row (`rows`)."""
    return rows > j


def rowscan_wins(items: int, j: int) -> bool:
    """Whether `take_grad_rowscan` (`items` work-items, one per chunk of a gradient row, each
    testing all J indices) is cheaper than sorting the indices."""
    return items * j <= ROWSCAN_LIMIT


def _source(dtype: DType, index_dtype: DType) -> str:
    head = (f"typedef {C_TYPES[dtype]} T;\ntypedef {C_TYPES[index_dtype]} IT;\n"
            f"#define CHUNK {CHUNK}\n")
    return fp64_pragma(dtype) + head + """
// v modulo K, in [0, K); an index in [-K, K) (all that the host checks let through) takes no
// 64-bit division, which cost the scan ~3 ns a pair.
inline long tg_wrap(const long v, const long K) {
  if (v >= 0 && v < K) return v;
  if (v < 0 && v >= -K) return v + K;
  const long r = v % K;
  return r < 0 ? r + K : r;
}

/* out (A, J, B) = x (A, K, B) gathered at the J indices: one work-item per CHUNK elements of
   out, its position decoded once and then stepped (a 64-bit division per element cost ~2.7
   ms for a 4096 x 256 embedding lookup, now ~0.8). */
__kernel void take_fwd(__global T* out, __global const T* x, __global const IT* idx,
                       const long K, const long J, const long B, const long n) {
  const long i0 = get_global_id(0) * CHUNK;
  if (i0 >= n) return;
  const long i1 = min(n, i0 + CHUNK), t = i0 / B;
  long b = i0 % B, j = t % J, a = t / J;
  __global const T* src = x + (a * K + tg_wrap((long)idx[j], K)) * B;
  for (long i = i0; i < i1;) {  // a run of one row of x at a time: a plain copy
    const long m = min(B - b, i1 - i);
    for (long q = 0; q < m; ++q) out[i + q] = src[b + q];
    i += m;
    b += m;
    if (b == B) {
      b = 0;
      if (++j == J) { j = 0; ++a; }
      src = x + (a * K + tg_wrap((long)idx[j], K)) * B;
    }
  }
}

/* gx (A, K, B): each element sums g (A, J, B) over the j with idx[j] == k, j ascending. */
__kernel void take_grad_scan(__global T* out, __global const T* g, __global const IT* idx,
                             const long K, const long J, const long B, const long n) {
  const long gid = get_global_id(0);
  if (gid >= n) return;
  const long b = gid % B, t = gid / B, k = t % K, a = t / K;
  __global const T* src = g + a * J * B + b;
  T acc = (T)0;
  for (long j = 0; j < J; ++j) {
    if (tg_wrap((long)idx[j], K) == k) acc += src[j * B];
  }
  out[gid] = acc;
}

/* A gradient kernel's work-item: its chunk (columns b0..b1) of gx row t = (a, k), zeroed. */
#define TG_ROW_CHUNK \
  const long gid = get_global_id(0); \
  if (gid >= n) return; \
  const long c = gid % chunks, t = gid / chunks, k = t % K, a = t / K; \
  const long b0 = c * CHUNK, b1 = min(B, b0 + CHUNK); \
  __global T* dst = out + t * B; \
  for (long b = b0; b < b1; ++b) dst[b] = (T)0;

/* A gradient kernel's work-item over the indices' positions: its chunk (columns b0..b1) of
   position p = (a, s) of g, the rows of gx zeros already. */
#define TG_POSITION_CHUNK \
  const long gid = get_global_id(0); \
  if (gid >= n) return; \
  const long c = gid % chunks, t = gid / chunks, s = t % J, a = t / J; \
  const long b0 = c * CHUNK, b1 = min(B, b0 + CHUNK);

/* dst's chunk += g's row j of block a. */
#define TG_ADD_G_ROW(j) { \
  __global const T* src_ = g + (a * J + (j)) * B; \
  for (long b = b0; b < b1; ++b) dst[b] += src_[b]; }

/* gx (A, K, B): one work-item per CHUNK columns of a row (a, k) walks the J indices and adds
   the g rows of those that name k, j ascending: take_grad_scan's additions in its order. */
__kernel void take_grad_rowscan(__global T* out, __global const T* g, __global const IT* idx,
                                const long K, const long J, const long B, const long chunks,
                                const long n) {
  TG_ROW_CHUNK
  for (long j = 0; j < J; ++j)
    if (tg_wrap((long)idx[j], K) == k) TG_ADD_G_ROW(j)
}

/* The sorted path: the positions j ordered by their row k (a stable LSD radix sort, 8 bits a
   pass, so equal rows keep j ascending), the start of each row's run, and then each row sums
   its run in order. Every step is a fixed computation of its inputs: no atomics, so the
   result is the same on every run. */

/* keys[t] = wrap(idx[t]), vals[t] = t. */
__kernel void take_sort_init(__global long* keys, __global long* vals, __global const IT* idx,
                             const long K, const long J) {
  const long t = get_global_id(0);
  if (t >= J) return;
  keys[t] = tg_wrap((long)idx[t], K);
  vals[t] = t;
}

/* hist[d * P + p]: how many keys of block p (positions p * per ..) have digit d. */
__kernel void take_radix_hist(__global long* hist, __global const long* keys, const long J,
                              const int shift, const long per, const long P) {
  const long p = get_global_id(0);
  if (p >= P) return;
  long count[256];
  for (int d = 0; d < 256; ++d) count[d] = 0;
  const long t1 = min(J, (p + 1) * per);
  for (long t = p * per; t < t1; ++t) ++count[(keys[t] >> shift) & 255];
  for (int d = 0; d < 256; ++d) hist[d * P + p] = count[d];
}

/* hist becomes its exclusive prefix sums, in order (digit-major): where each block's keys of
   each digit go. One work-item: 256 P additions. */
__kernel void take_radix_scan(__global long* hist, const long n) {
  if (get_global_id(0) != 0) return;
  long sum = 0;
  for (long i = 0; i < n; ++i) { const long c = hist[i]; hist[i] = sum; sum += c; }
}

/* Each block moves its keys (and their positions) to their places, in order: stable. */
__kernel void take_radix_scatter(__global long* keys_out, __global long* vals_out,
                                 __global const long* keys, __global const long* vals,
                                 __global const long* hist, const long J, const int shift,
                                 const long per, const long P) {
  const long p = get_global_id(0);
  if (p >= P) return;
  long at[256];
  for (int d = 0; d < 256; ++d) at[d] = hist[d * P + p];
  const long t1 = min(J, (p + 1) * per);
  for (long t = p * per; t < t1; ++t) {
    const long key = keys[t], o = at[(key >> shift) & 255]++;
    keys_out[o] = key;
    vals_out[o] = vals[t];
  }
}

/* starts[k] (k = 0..K): the first sorted position whose row is k or more. Position s writes
   the rows after its predecessor's up to its own (s = J: up to K), so each is written once. */
__kernel void take_starts(__global long* starts, __global const long* keys, const long K,
                          const long J) {
  const long s = get_global_id(0);
  if (s > J) return;
  const long lo = s == 0 ? 0 : keys[s - 1] + 1, hi = s == J ? K : keys[s];
  for (long k = lo; k <= hi; ++k) starts[k] = s;
}

/* gx (A, K, B), zeros already, where the rows outnumber few indices: one work-item per
   (a, position s, CHUNK columns); the first position naming a row k adds the g rows of every
   position naming k, in ascending order (take_grad_scan's additions), with no sort: J^2 / 2
   comparisons at most. */
__kernel void take_grad_firsts(__global T* out, __global const T* g, __global const IT* idx,
                               const long K, const long J, const long B, const long chunks,
                               const long n) {
  TG_POSITION_CHUNK
  const long k = tg_wrap((long)idx[s], K);
  for (long i = 0; i < s; ++i)
    if (tg_wrap((long)idx[i], K) == k) return;
  __global T* dst = out + (a * K + k) * B;
  for (long r = s; r < J; ++r)
    if (tg_wrap((long)idx[r], K) == k) TG_ADD_G_ROW(r)
}

/* gx (A, K, B), zeros already, where the rows outnumber the indices: one work-item per
   (a, sorted position s, CHUNK columns); the first position of each run of equal rows adds
   the run's g rows, j ascending: take_grad_rows's additions, without a work-item (and a start)
   per row of gx that no index names. */
__kernel void take_grad_runs(__global T* out, __global const T* g, __global const long* keys,
                             __global const long* vals, const long K, const long J,
                             const long B, const long chunks, const long n) {
  TG_POSITION_CHUNK
  const long k = keys[s];
  if (s > 0 && keys[s - 1] == k) return;
  __global T* dst = out + (a * K + k) * B;
  for (long r = s; r < J && keys[r] == k; ++r) TG_ADD_G_ROW(vals[r])
}

/* gx (A, K, B), one work-item per CHUNK elements of a row: 0 plus the row's run of g rows
   (positions vals[starts[k]..starts[k+1]), j ascending), the sums take_grad_scan makes. */
__kernel void take_grad_rows(__global T* out, __global const T* g, __global const long* vals,
                             __global const long* starts, const long K, const long J,
                             const long B, const long chunks, const long n) {
  TG_ROW_CHUNK
  const long hi = starts[k + 1];
  for (long s = starts[k]; s < hi; ++s) TG_ADD_G_ROW(vals[s])
}
"""


def _kernel(dev: Device, dtype: DType, index_dtype: DType, name: str) -> cl.Kernel:
    return dev.kernel("take", f"{dtype}_{index_dtype}", name,
                      lambda: _source(dtype, index_dtype))


def _launch(dev: Device, kernel: cl.Kernel, n: int, *args: Any) -> None:
    dev.launch(kernel, launch_size(n), (LOCAL,), *args)


@dataclass(frozen=True, slots=True)
class TakeParams:
    axis: int


@dataclass(frozen=True, slots=True)
class TakeGradParams:
    """`size`: the length K of the axis that take gathered from (x.shape[axis])."""

    axis: int
    size: int


def _check_indices(op: str, indices: Any, swapped: bool = False) -> None:
    """`swapped`: the other argument is integer, so the two were likely given the wrong way."""
    if indices.dtype not in INTS:
        hint = " (are table and indices swapped?)" if swapped else ""
        raise DTypeError(at_site(
            f"{op}: indices has dtype {dtype_name(indices.dtype)}, expected int32 or int64"
            f"{hint} (make index ids with tg.leaf(tape, np.asarray(idx, np.int64)))"))


def _take_rule(args: Sequence[Any], p: TakeParams) -> Aval:
    x, indices = args
    _check_indices("take", indices)
    shape: Shape = tuple(x.shape)
    if not 0 <= p.axis < len(shape):
        raise ShapeError(at_site(f"take: axis {p.axis} does not fit x of shape {shape}"))
    if shape[p.axis] == 0 and size_of(tuple(indices.shape)):
        raise ShapeError(at_site(
            f"take: cannot take {size_of(tuple(indices.shape))} elements from axis {p.axis} of "
            f"x (shape {shape}): that axis is empty"))
    return Aval((*shape[: p.axis], *indices.shape, *shape[p.axis + 1:]), x.dtype)


def _take_forward(dev: Device, args: Sequence[AnyTensor], p: TakeParams, aval: Aval
                  ) -> AnyTensor:
    x, indices = args
    out = empty(aval.shape, aval.dtype, dev)
    if out.size:
        _, k, b = split_at(x.shape, p.axis)
        _launch(dev, _kernel(dev, x.dtype, indices.dtype, "take_fwd"), -(-out.size // CHUNK),
                out.buffer, x.buffer, indices.buffer, np.int64(k), np.int64(indices.size),
                np.int64(b), np.int64(out.size))
    return out


def _take_grad_rule(args: Sequence[Any], p: TakeGradParams) -> Aval:
    g, indices = args
    _check_indices("take_grad", indices)
    shape: Shape = tuple(g.shape)
    ishape: Shape = tuple(indices.shape)
    end = p.axis + len(ishape)
    if end > len(shape) or shape[p.axis:end] != ishape:
        raise ShapeError(at_site(
            f"take_grad: g has shape {shape}, which does not hold the indices' shape {ishape} "
            f"at axis {p.axis}"))
    if p.size == 0 and size_of(ishape):
        raise ShapeError(at_site("take_grad: indices into an empty axis"))
    return Aval((*shape[: p.axis], p.size, *shape[end:]), g.dtype)


def _take_grad_forward(dev: Device, args: Sequence[AnyTensor], p: TakeGradParams, aval: Aval
                       ) -> AnyTensor:
    g, indices = args
    out = empty(aval.shape, aval.dtype, dev)
    if out.size == 0:
        return out
    j = indices.size
    if j == 0:
        fill_into(out, 0.0)
        return out
    _, k, b = split_at(aval.shape, p.axis)
    sizes = (np.int64(k), np.int64(j), np.int64(b), np.int64(out.size))
    if scan_wins(out.size, j):
        _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_grad_scan"), out.size,
                out.buffer, g.buffer, indices.buffer, *sizes)
        return out
    chunks = -(-b // CHUNK)
    n = out.size // b * chunks
    if rowscan_wins(n, j):
        _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_grad_rowscan"), n,
                out.buffer, g.buffer, indices.buffer, np.int64(k), np.int64(j), np.int64(b),
                np.int64(chunks), np.int64(n))
        return out
    runs = out.size // (k * b) * j * chunks  # work-items over the indices' positions
    if sparse_wins(k, j):  # most rows of gx are zeros: a fill, then the named rows summed
        fill_into(out, 0.0)
        if runs * j <= FIRSTS_LIMIT:  # few indices: each finds its row's first j, no sort
            _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_grad_firsts"), runs,
                    out.buffer, g.buffer, indices.buffer, np.int64(k), np.int64(j),
                    np.int64(b), np.int64(chunks), np.int64(runs))
            return out
        keys, vals = sort_rows(indices, k, g.dtype)
        _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_grad_runs"), runs,
                out.buffer, g.buffer, keys, vals, np.int64(k), np.int64(j), np.int64(b),
                np.int64(chunks), np.int64(runs))
        return out
    keys, vals = sort_rows(indices, k, g.dtype)
    starts = dev.allocate((k + 1) * 8)
    _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_starts"), j + 1, starts, keys,
            np.int64(k), np.int64(j))
    _launch(dev, _kernel(dev, g.dtype, indices.dtype, "take_grad_rows"), n,
            out.buffer, g.buffer, vals, starts, np.int64(k), np.int64(j), np.int64(b),
            np.int64(chunks), np.int64(n))
    return out


def sort_rows(indices: AnyTensor, k: int, dtype: DType) -> tuple[Any, Any]:
    """Scratch buffers (keys, vals): the positions j of the indices ordered by their row
    wrap(indices[j]) in [0, k) (vals), j ascending within a row (a stable radix sort on the
    device), and each one's row (keys). The kernels come from the (dtype, index dtype) program
    the gradient kernel is in."""
    dev = indices.device
    j = indices.size

    def kernel(name: str) -> cl.Kernel:
        return _kernel(dev, dtype, indices.dtype, name)

    keys, vals = dev.allocate(j * 8), dev.allocate(j * 8)
    _launch(dev, kernel("take_sort_init"), j, keys, vals, indices.buffer, np.int64(k),
            np.int64(j))
    blocks = min(RADIX_BLOCKS, -(-j // RADIX_BLOCK))
    per = -(-j // blocks)
    hist = dev.allocate(256 * blocks * 8)
    spare_keys, spare_vals = dev.allocate(j * 8), dev.allocate(j * 8)
    shift = 0
    while (k - 1) >> shift:  # one pass per 8 bits of the largest row
        _launch(dev, kernel("take_radix_hist"), blocks, hist, keys, np.int64(j),
                np.int32(shift), np.int64(per), np.int64(blocks))
        _launch(dev, kernel("take_radix_scan"), 1, hist, np.int64(256 * blocks))
        _launch(dev, kernel("take_radix_scatter"), blocks, spare_keys, spare_vals, keys, vals,
                hist, np.int64(j), np.int32(shift), np.int64(per), np.int64(blocks))
        keys, vals, spare_keys, spare_vals = spare_keys, spare_vals, keys, vals
        shift += 8
    return keys, vals


TAKE, TAKE_GRAD = transposes(
    LinearOp("take", _take_rule, _take_forward,
             "Gather along an axis by integer ids (out-of-range ids wrap, as numpy's "
             "mode='wrap'). The VJP is take_grad, a deterministic scatter-add."),
    LinearOp("take_grad", _take_grad_rule, _take_grad_forward,
             "Scatter-add of g into zeros along an axis at integer ids: repeated ids sum, in "
             "ascending order of position (bitwise reproducible). Its VJP is take."),
    a_to_b=lambda p, args: TakeGradParams(p.axis, args[0].shape[p.axis]),
    b_to_a=lambda p, args: TakeParams(p.axis))


@takes_tape
def take(tape: Tape, x: Id, indices: Id, axis: int | None = 0) -> tuple[Tape, Id]:
    """numpy's `take`: gather along `axis` (negative allowed; None flattens x first) by an
    integer id (int32 or int64) of any shape. The result has shape
    `x.shape[:axis] + indices.shape + x.shape[axis+1:]`.

    Repeated indices sum their gradients, deterministically (bitwise the same every run).
    Indices must lie in [-n, n) for an axis of size n, as numpy's default. Indices made from
    host data (a leaf of a numpy array) are checked before anything runs (`IndexRangeError`,
    a ShapeError and an IndexError); indices computed on the device cannot be without reading
    them back, and an index outside wraps modulo n (numpy's mode="wrap").
    """
    node = tape.node(x, "take", "x")
    if not isinstance(indices, Id):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise NotAnIdError(at_site(
            f"take: indices must be an integer Id, not {type(indices).__name__}; make one with "
            "tg.leaf(tape, np.asarray(idx, np.int64))"))
    tape.node(indices, "take", "indices")
    _check_indices("take", indices)
    a = 0 if axis is None else int_axis("take", axis, len(x.shape))
    size = node.value.size if axis is None else x.shape[a]
    if size == 0 and size_of(indices.shape):
        raise ShapeError(at_site(
            f"take: cannot take {size_of(indices.shape)} elements from axis {axis} of x "
            f"(shape {x.shape}): that axis is empty"))
    _check_range("take", tape[indices].value, size, axis)
    if axis is None and x.ndim != 1:
        tape, x = reshape(tape, x, (size,))
    return record(tape, TAKE, [x, indices], TakeParams(a))


def _check_range(op: str, indices: AnyTensor, size: int, axis: int | None) -> None:
    """Indices made from host data against the axis they index (see the module notes)."""
    known = checked_range(indices, -size, size - 1)
    if known is not None and (known[0] < -size or known[1] >= size):
        bad = known[0] if known[0] < -size else known[1]
        raise IndexRangeError(at_site(
            f"{op}: index {bad} is out of bounds for axis {axis} with size {size} (indices "
            f"must lie in [-{size}, {size}))"))


@takes_tape
def embedding(tape: Tape, table: Id, indices: Id) -> tuple[Tape, Id]:
    """Rows of `table` (vocab, ...) at integer ids `indices` of any shape: `take` on axis 0,
    shape `indices.shape + table.shape[1:]`. Repeated ids sum their gradients
    deterministically; out-of-range ids wrap (see `take`)."""
    node = tape.node(table, "embedding", "table")
    if len(node.value.shape) == 0:
        raise ShapeError(at_site(
            "embedding: table has shape () but needs at least one axis (vocab, ...)"))
    if isinstance(indices, Id):  # pyright: ignore[reportUnnecessaryIsInstance] - take says why not
        _check_indices("embedding", indices, swapped=table.dtype in INTS)
        _check_range("embedding", tape.node(indices, "embedding", "indices").value,
                     node.value.shape[0], 0)
    return take(tape, table, indices, 0)
