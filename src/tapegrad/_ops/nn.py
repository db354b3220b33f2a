"""Network layers: linear, layer_norm, batch_norm (compositions of primitives) and dropout.

`linear` and the norms are built from matmul, reductions and elementwise primitives, so their
VJPs (and the VJPs of those VJPs) are the primitives' own. The norms compute the variance in two
passes (mean, then the mean of squared deviations), which keeps float32 accurate when the mean
is large.

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
from typing import Any

import numpy as np

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import DTypeError, ShapeError, at_site, number
from .._kernels import launch_size
from .._primitive import Aval, LinearOp, self_adjoint
from .._tape import Id, Tape, record, takes_tape
from .._tensor import C_TYPES, AnyTensor, DType, dtype_name, empty, is_float
from .._traced import as_index
from . import elementwise as _ew
from . import linalg as _linalg
from . import reduce as _reduce
from . import shape as _shape


def _check_float(op: str, name: str, x: Id) -> None:
    if not is_float(x.dtype):
        raise DTypeError(at_site(f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected "
                                 "float32 or float64"))


def _check_same_dtype(op: str, x: Id, name: str, other: Id) -> None:
    if other.dtype != x.dtype:
        raise DTypeError(at_site(f"{op}: x is {dtype_name(x.dtype)} but {name} is "
                                 f"{dtype_name(other.dtype)}; convert one with tg.astype"))


# --- linear ----------------------------------------------------------------------------------


@takes_tape
def linear(tape: Tape, x: Id, w: Id, b: Id | None = None) -> tuple[Tape, Id]:
    """`x @ w + b`: x of shape (..., in), w of shape (in, out), b of shape (out,) or None.

    Leading axes of x are flattened into one 2-D product (no broadcast copy of w).
    """
    op = "linear"
    tape.node(x, op, "x")
    tape.node(w, op, "w")
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
    lead = x.shape[:-1]
    tape, x2 = _shape.reshape(tape, x, (math.prod(lead), x.shape[-1]))
    if b is None:
        tape, y = record(tape, _linalg.MATMUL, [x2, w], _linalg.MatmulParams(False, False))
    else:  # the kernels add b: no broadcast copy, no separate add
        tape, y = record(tape, _linalg.MATMUL, [x2, w, b],
                         _linalg.MatmulParams(False, False, _linalg.COLUMN_BIAS))
    return _shape.reshape(tape, y, (*lead, w.shape[1]))


# --- normalisation ---------------------------------------------------------------------------


def _check_eps(op: str, eps: float) -> float:
    value = number(op, "eps", eps)
    if not value >= 0:
        raise ShapeError(at_site(f"{op}: eps must be a number >= 0, got {eps!r}"))
    return value


def _normalize(tape: Tape, x: Id, axes: tuple[int, ...], eps: float) -> tuple[Tape, Id]:
    """(x - mean) / sqrt(var + eps) over `axes`, with the biased variance."""
    tape, mu = _reduce.mean(tape, x, axes, keepdims=True)
    tape, xc = _ew.sub(tape, x, mu)
    tape, sq = _ew.mul(tape, xc, xc)
    tape, var = _reduce.mean(tape, sq, axes, keepdims=True)
    tape, var = _ew.add(tape, var, eps)
    tape, std = _ew.sqrt(tape, var)
    return _ew.div(tape, xc, std)


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


def _scale_shift(tape: Tape, y: Id, weight: Id | None, bias: Id | None, shape: tuple[int, ...]
                 ) -> tuple[Tape, Id]:
    if weight is not None:
        tape, wv = _shape.reshape(tape, weight, shape)
        tape, y = _ew.mul(tape, y, wv)
    if bias is not None:
        tape, bv = _shape.reshape(tape, bias, shape)
        tape, y = _ew.add(tape, y, bv)
    return tape, y


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
    tape, y = _normalize(tape, x, (x.ndim - 1,), eps)
    return _scale_shift(tape, y, weight, bias, (x.shape[-1],))


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
    axes = (0, *range(2, x.ndim))
    tape, y = _normalize(tape, x, axes, eps)
    return _scale_shift(tape, y, weight, bias, (c, *([1] * (x.ndim - 2))))


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

    @property
    def threshold(self) -> int:
        """Elements whose 32 random bits are below this are dropped: p * 2**32."""
        return min(round(self.p * 2.0**32), 2**32)

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
            f"{op}: p must be a probability in [0, 1] (1 drops everything), got {p!r}"))
    if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(f"{op}: seed must be an int, got {seed!r}"))
    if prob == 0:
        return tape, x
    return record(tape, DROPOUT, [x], DropoutParams(prob, as_index(seed) % 2**64))


register_family("dropout", _dropout_source)
