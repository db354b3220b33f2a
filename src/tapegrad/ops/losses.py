"""Softmax, log-softmax and losses: compositions of tapegrad ops over a stable logsumexp.

Every function here is a plain composition (so its gradient, and its gradient's gradient, come
from the primitives it records) except the gather of each row's label logit, which needs integer
ids: `pick_label` (out[i] = x[i, labels[i]]) and its VJP `pick_label_grad` (a scatter into zeros,
one work-item per (row, class) comparing the class with the row's label: deterministic, no
atomics). Each is the other's VJP, so second order works. Their kernels are one program per
float dtype, with one kernel per label dtype.

An out-of-range label (negative, or >= C) is not read back to the host to be checked: it makes
its row's picked logit NaN, so the loss is NaN (and `tg.detect_anomaly()` names `pick_label`
and the user's line), and its row's gradient is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyopencl as cl

from .._device import LOCAL, Device, fp64_pragma
from .._errors import DTypeError, ShapeError, TapegradError, at_site
from .._kernels import launch_size
from .._primitive import Aval, Emitter, Primitive, register
from .._tape import Id, Tape, record
from .._tensor import C_TYPES, INTS, AnyTensor, DType, dtype_name, empty, is_float
from . import elementwise as _ew
from . import reduce as _reduce
from .broadcast import Scalar, broadcast_to
from .shape import normalize_axis

# --- the label gather and its scatter ---------------------------------------------------------


def _source(dtype: DType) -> str:
    parts = [fp64_pragma(dtype), f"typedef {C_TYPES[dtype]} T;\n"]
    for label in INTS:
        lt = C_TYPES[label]
        parts.append(
            f"__kernel void pick_label_{lt}(__global T* out, __global const T* x, "
            f"__global const {lt}* labels, const long n, const long C) {{\n"
            "  const long i = get_global_id(0);\n  if (i >= n) return;\n"
            "  const long l = labels[i];\n"
            "  out[i] = (l >= 0 && l < C) ? x[i * C + l] : (T)NAN;\n}\n"
            f"__kernel void pick_label_grad_{lt}(__global T* out, __global const T* g, "
            f"__global const {lt}* labels, const long n, const long C) {{\n"
            "  const long j = get_global_id(0);\n  if (j >= n) return;\n"
            "  const long i = j / C, l = labels[i];\n"
            "  out[j] = (l >= 0 && l < C) ? (l == j % C ? g[i] : (T)0) : (T)NAN;\n}\n"
        )
    return "".join(parts)


def _launch(name: str, out: AnyTensor, src: AnyTensor, labels: AnyTensor, classes: int) -> None:
    dev: Device = out.device
    kernel = dev.kernel("losses", str(out.dtype), f"{name}_{C_TYPES[labels.dtype]}",
                        lambda: _source(out.dtype))
    n = out.size
    if n:
        kernel.set_args(out.buffer, src.buffer, labels.buffer, np.int64(n), np.int64(classes))
        cl.enqueue_nd_range_kernel(dev.queue, kernel, launch_size(n), (LOCAL,))


def _check_labels(op: str, rows: int, labels: Any) -> None:
    if labels.dtype not in INTS:
        raise DTypeError(at_site(
            f"{op}: labels have dtype {dtype_name(labels.dtype)}, expected int32 or int64 class "
            "indices"))
    if tuple(labels.shape) != (rows,):
        raise ShapeError(at_site(
            f"{op}: labels must have shape (N,) = ({rows},), one class index per row of the "
            f"logits; got shape {tuple(labels.shape)}"))


def _pick_rule(args: Sequence[Any], p: None) -> Aval:
    x, labels = args
    if not is_float(x.dtype) or len(x.shape) != 2:
        raise ShapeError(at_site(
            f"pick_label: x must be a 2-D float tensor, got {x.shape} {dtype_name(x.dtype)}"))
    _check_labels("pick_label", x.shape[0], labels)
    return Aval((x.shape[0],), x.dtype)


def _pick_forward(dev: Device, args: Sequence[AnyTensor], p: None, aval: Aval) -> AnyTensor:
    x, labels = args
    out = empty(aval.shape, aval.dtype, dev)
    _launch("pick_label", out, x, labels, x.shape[1])
    return out


def _pick_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    x, labels = args
    return [e.apply(PICK_LABEL_GRAD, [g, labels], PickGradParams(x.shape[1])), None]


class PickGradParams:
    __slots__ = ("classes",)

    def __init__(self, classes: int) -> None:
        self.classes = classes


def _pick_grad_rule(args: Sequence[Any], p: PickGradParams) -> Aval:
    g, labels = args
    if not is_float(g.dtype) or len(g.shape) != 1:
        raise ShapeError(at_site(
            f"pick_label_grad: g must be a 1-D float tensor, got {g.shape} "
            f"{dtype_name(g.dtype)}"))
    _check_labels("pick_label_grad", g.shape[0], labels)
    return Aval((g.shape[0], p.classes), g.dtype)


def _pick_grad_forward(dev: Device, args: Sequence[AnyTensor], p: PickGradParams, aval: Aval
                       ) -> AnyTensor:
    g, labels = args
    out = empty(aval.shape, aval.dtype, dev)
    _launch("pick_label_grad", out, g, labels, p.classes)
    return out


def _pick_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: PickGradParams,
                   needs: Sequence[bool]) -> list[Any]:
    return [e.apply(PICK_LABEL, [h, args[1]]), None]


PICK_LABEL: Primitive[None] = register(Primitive(
    "pick_label", _pick_rule, _pick_forward, _pick_vjp,
    doc="out[i] = x[i, labels[i]] for x (N, C) and integer labels (N,); NaN for a label "
        "outside [0, C). The VJP scatters g into zeros (pick_label_grad)."))
PICK_LABEL_GRAD: Primitive[PickGradParams] = register(Primitive(
    "pick_label_grad", _pick_grad_rule, _pick_grad_forward, _pick_grad_vjp,
    doc="out[i, c] = g[i] where c == labels[i] else 0 (NaN rows for labels outside [0, C)): "
        "the VJP of pick_label, one work-item per element, no atomics."))


# --- the public functions ---------------------------------------------------------------------


def _float_input(tape: Tape, op: str, x: Id, axis: int) -> int:
    """Check x is a float id on `tape` and normalise `axis` (errors name `op`)."""
    tape.node(x, op, "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"{op}: x has dtype {dtype_name(x.dtype)}, expected float32 or float64 (convert with "
            "tg.astype)"))
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ShapeError(at_site(f"{op}: axis must be an int, not {axis!r}"))
    return normalize_axis(op, int(axis), len(x.shape))


def softmax(tape: Tape, x: Id, axis: int = -1) -> tuple[Tape, Id]:
    """exp(x - logsumexp(x)) along `axis` (default the last): stable at any magnitude."""
    ax = _float_input(tape, "softmax", x, axis)
    tape, lse = _reduce.logsumexp(tape, x, ax, keepdims=True)
    tape, lse = broadcast_to(tape, lse, x.shape)
    return record(tape, _ew.MUL_EXP_SUB, [1.0, x, lse])


def log_softmax(tape: Tape, x: Id, axis: int = -1) -> tuple[Tape, Id]:
    """x - logsumexp(x) along `axis` (default the last): stable at any magnitude."""
    ax = _float_input(tape, "log_softmax", x, axis)
    tape, lse = _reduce.logsumexp(tape, x, ax, keepdims=True)
    return _ew.sub(tape, x, lse)


def cross_entropy(tape: Tape, logits: Id, labels: Id) -> tuple[Tape, Id]:
    """Mean over rows of logsumexp(logits[i]) - logits[i, labels[i]] (PyTorch's cross_entropy).

    `logits` is a float (N, C) id, `labels` an int32 or int64 (N,) id of class indices. Stable
    at any logit magnitude (no NaN or Inf at +-1e4). A label outside [0, C) is not checked on the
    host: it makes the loss NaN (see the module notes). N == 0 gives NaN, as PyTorch.
    """
    op = "cross_entropy"
    tape.node(logits, op, "logits")
    tape.node(labels, op, "labels")
    if not is_float(logits.dtype):
        raise DTypeError(at_site(
            f"{op}: logits have dtype {dtype_name(logits.dtype)}, expected float32 or float64"))
    if len(logits.shape) != 2:
        raise ShapeError(at_site(
            f"{op}: logits must have shape (N, C), got shape {logits.shape} (reshape to 2-D "
            "first)"))
    _check_labels(op, logits.shape[0], labels)
    tape, lse = _reduce.logsumexp(tape, logits, 1)
    tape, picked = record(tape, PICK_LABEL, [logits, labels])
    tape, rows = _ew.sub(tape, lse, picked)
    return _reduce.mean(tape, rows)


def mse(tape: Tape, a: Id | Scalar, b: Id | Scalar) -> tuple[Tape, Id]:
    """Mean of (a - b)**2 over every element.

    Two ids must have the same shape (a loss that broadcasts (N,) against (N, 1) is almost always
    a bug, so it is refused); either may be a Python number.
    """
    op = "mse"
    if isinstance(a, Id) and isinstance(b, Id):
        tape.node(a, op, "a")
        tape.node(b, op, "b")
        if a.shape != b.shape:
            raise ShapeError(at_site(
                f"{op}: a has shape {a.shape} and b has shape {b.shape}; they must be equal "
                "(reshape or tg.broadcast_to one of them explicitly)"))
    elif not isinstance(a, Id) and not isinstance(b, Id):
        raise TapegradError(at_site(f"{op}: at least one of a and b must be an Id"))
    tape, d = _ew.sub(tape, a, b)
    tape, sq = _ew.mul(tape, d, d)
    return _reduce.mean(tape, sq)
