"""Matrix products.

The primitive is `matmul_t(a, b, ta, tb) = op(a) @ op(b)` on 2-D or equally batched 3-D
operands, where op transposes when its flag is set. Transposes are read through strides, so the
backward products (g @ b^T, a^T @ g) never materialise a transposed copy. The public `matmul`
follows numpy's rules (1-D operands, broadcast batch dims) by reshapes and explicit broadcasts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyopencl as cl

from .._device import Device, fp64_pragma
from .._errors import DTypeError, ShapeError, at_site
from .._primitive import Aval, Emitter, Primitive, register
from .._tape import Id, Tape, record
from .._tensor import C_TYPES, AnyTensor, DType, dtype_name, empty, is_float
from .broadcast import broadcast_shapes, broadcast_to
from .shape import reshape

TILE = 16


def _source(dtype: DType) -> str:
    return fp64_pragma(dtype) + f"typedef {C_TYPES[dtype]} T;\n#define TS {TILE}\n" + """
__kernel void matmul(__global T* C, __global const T* A, __global const T* B,
                     const int M, const int N, const int K,
                     const long sab, const long sam, const long sak,
                     const long sbb, const long sbk, const long sbn) {
  const int col = get_global_id(0), row = get_global_id(1), bat = get_global_id(2);
  const int lc = get_local_id(0), lr = get_local_id(1);
  __local T As[TS][TS + 1];
  __local T Bs[TS][TS + 1];
  A += bat * sab;
  B += bat * sbb;
  T acc = (T)0;
  for (int t = 0; t < K; t += TS) {
    const int ak = t + lc, bk = t + lr;
    As[lr][lc] = (row < M && ak < K) ? A[row * sam + ak * sak] : (T)0;
    Bs[lr][lc] = (bk < K && col < N) ? B[bk * sbk + col * sbn] : (T)0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < TS; ++k) acc += As[lr][k] * Bs[k][lc];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (row < M && col < N) C[(long)bat * M * N + (long)row * N + col] = acc;
}
"""


class MatmulParams:
    __slots__ = ("ta", "tb")

    def __init__(self, ta: bool, tb: bool) -> None:
        self.ta = ta
        self.tb = tb


def _dims(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if transposed else (rows, cols)


def _rule(args: Sequence[Any], p: MatmulParams) -> Aval:
    a, b = args
    if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[:-2] != b.shape[:-2]:
        raise ShapeError(f"matmul_t: operands {a.shape} and {b.shape} must be 2-D or equally "
                         "batched 3-D")
    m, k = _dims(a.shape, p.ta)
    k2, n = _dims(b.shape, p.tb)
    if k != k2:
        raise ShapeError(at_site(f"matmul: inner sizes differ: {k} vs {k2}"))
    return Aval((*a.shape[:-2], m, n), a.dtype)


def _strides(shape: tuple[int, ...], transposed: bool) -> tuple[int, int, int]:
    rows, cols = shape[-2], shape[-1]
    batch = rows * cols if len(shape) == 3 else 0
    return (batch, 1, cols) if transposed else (batch, cols, 1)


def _forward(dev: Device, args: Sequence[AnyTensor], p: MatmulParams, aval: Aval) -> AnyTensor:
    a, b = args
    m, k = _dims(a.shape, p.ta)
    n = aval.shape[-1]
    batches = a.shape[0] if a.ndim == 3 else 1
    out = empty(aval.shape, aval.dtype, dev)
    if out.size == 0:
        return out
    if k == 0:
        from .._kernels import fill_into

        fill_into(out, 0.0)
        return out
    kernel = dev.kernel("matmul", str(aval.dtype), "matmul", lambda: _source(aval.dtype),
                        [None] * 3 + [np.int32] * 3 + [np.int64] * 6)
    sab, sam, sak = _strides(a.shape, p.ta)
    sbb, sbn, sbk = _strides(b.shape, not p.tb)
    kernel.set_args(out.buffer, a.buffer, b.buffer, m, n, k, sab, sam, sak, sbb, sbk, sbn)
    size = (-(-n // TILE) * TILE, -(-m // TILE) * TILE, batches)
    cl.enqueue_nd_range_kernel(dev.queue, kernel, size, (TILE, TILE, 1))
    return out


def _vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: MatmulParams,
         needs: Sequence[bool]) -> list[Any]:
    # With A = op(a), B = op(b): dA = g B^T and dB = A^T g; transposed operands take the
    # transpose of those, each again one matmul_t with flags.
    a, b = args
    ga = gb = None
    if needs[0]:
        ga = (e.apply(MATMUL, [b, g], MatmulParams(p.tb, True)) if p.ta
              else e.apply(MATMUL, [g, b], MatmulParams(False, not p.tb)))
    if needs[1]:
        gb = (e.apply(MATMUL, [g, a], MatmulParams(True, p.ta)) if p.tb
              else e.apply(MATMUL, [a, g], MatmulParams(not p.ta, False)))
    return [ga, gb]


MATMUL: Primitive[MatmulParams] = register(Primitive(
    "matmul", _rule, _forward, _vjp,
    doc="op(a) @ op(b) for 2-D or equally batched 3-D operands; op transposes by flag."))


def matmul(tape: Tape, a: Id, b: Id) -> tuple[Tape, Id]:
    """numpy's matmul: 1-D operands are promoted and squeezed, batch dims broadcast."""
    tape.node(a, "matmul", "a")
    tape.node(b, "matmul", "b")
    for name, x in (("a", a), ("b", b)):
        if not is_float(x.dtype):
            raise DTypeError(at_site(
                f"matmul: argument {name!r} has dtype {dtype_name(x.dtype)}, expected float32 "
                "or float64"))
        if x.ndim == 0:
            raise ShapeError(at_site(
                f"matmul: argument {name!r} is a scalar (shape ()); use tg.mul for scaling"))
    if a.dtype != b.dtype:
        raise DTypeError(at_site(
            f"matmul: a is {dtype_name(a.dtype)} but b is {dtype_name(b.dtype)}; convert one "
            "with tg.astype"))
    a_shape = (1, *a.shape) if a.ndim == 1 else a.shape
    b_shape = (*b.shape, 1) if b.ndim == 1 else b.shape
    if a_shape[-1] != b_shape[-2]:
        raise ShapeError(at_site(
            f"matmul: a has shape {a.shape} and b has shape {b.shape}: a's last axis "
            f"({a_shape[-1]}) must equal b's {'only' if b.ndim == 1 else 'second-to-last'} "
            f"axis ({b_shape[-2]})"))
    m, n = a_shape[-2], b_shape[-1]
    batch = broadcast_shapes("matmul", [a_shape[:-2], b_shape[:-2]],
                             ["a's batch dims", "b's batch dims"])
    out_shape = (*batch, *([m] if a.ndim > 1 else []), *([n] if b.ndim > 1 else []))
    if len(b_shape) == 2:
        # (..., m, k) @ (k, n): one 2-D product over the stacked rows, no broadcast copy.
        tape, a2 = reshape(tape, a, (math.prod(batch) * m, a_shape[-1]))
        tape, b2 = reshape(tape, b, b_shape) if b.ndim == 1 else (tape, b)
        tape, c = record(tape, MATMUL, [a2, b2], MatmulParams(False, False))
    else:
        tape, a3 = _batched(tape, a, a_shape, batch)
        tape, b3 = _batched(tape, b, b_shape, batch)
        tape, c = record(tape, MATMUL, [a3, b3], MatmulParams(False, False))
    if c.shape != out_shape:
        tape, c = reshape(tape, c, out_shape)
    return tape, c


def _batched(tape: Tape, x: Id, shape: tuple[int, ...], batch: tuple[int, ...]
             ) -> tuple[Tape, Id]:
    """x promoted to `shape`, broadcast over `batch`, as 3-D (prod(batch), rows, cols)."""
    tape, x = reshape(tape, x, shape)
    tape, x = broadcast_to(tape, x, (*batch, *shape[-2:]))
    return reshape(tape, x, (math.prod(batch), *shape[-2:]))
