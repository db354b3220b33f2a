"""Softmax, log-softmax and losses over a stable (max-shifted) logsumexp.

`log_softmax` ((x - max) - log(sum(exp(x - max)))) and `softmax` (exp(x - max) / sum(exp(x -
max))) are one primitive each, one kernel per row (8 columns a work-item over a strided axis;
long rows with few of them go through split reductions instead). Subtracting the maximum before
anything is rounded keeps log_softmax accurate near 0 even for logits of large magnitude,
where x - logsumexp(x) would round at logsumexp's scale. Their VJPs, `log_softmax_grad` (g -
exp(out) * sum(g)) and `softmax_grad` (y * (g - sum(g * y))), are one row kernel each too;
their own VJPs are made of primitives, so higher orders work. mse is a plain composition.
cross_entropy is fused, being the hot end of every classifier: `cross_entropy_rows` computes
each row's logsumexp minus its label's logit in one kernel (one work-item per row,
max-shifted), and its VJP
`cross_entropy_rows_grad` writes g * (softmax - onehot) in one more. The latter's own VJP is
composed of primitives (logsumexp, mul_exp_sub, sum, pick_label...), so second order works.
`pick_label` (out[i] = x[i, labels[i]]) and `pick_label_grad` (a scatter into zeros, one
work-item per (row, class) comparing the class with the row's label: deterministic, no atomics)
are each other's VJPs. Their kernels are one program per float dtype, one kernel per label dtype.

An out-of-range label (negative, or >= C) in labels made from host data is an
`IndexRangeError` before anything runs (their range is noted at upload). Labels computed on
the device are not read back to the host to be checked: such a label makes its row's loss and
gradient NaN, so the mean loss is NaN (and `tg.detect_anomaly()` names `cross_entropy_rows`
and the user's line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._device import LOCAL, Device, fp64_pragma, register_family
from .._errors import (
    ArgumentTypeError,
    DTypeError,
    IndexRangeError,
    NotAnIdError,
    ShapeError,
    at_site,
    shown,
)
from .._fusion import elementwise, splat_source
from .._kernels import KAHAN, VEC8, launch_size, register_expression
from .._primitive import Aval, Emitter, LinearOp, Primitive, apply, register, transposes
from .._reduction import keep_shape, parts_of, reduce_tensor, row_sumexp_source
from .._tape import Id, Tape, record, takes_tape
from .._tensor import (
    C_TYPES,
    INTS,
    AnyTensor,
    DType,
    checked_range,
    dtype_name,
    empty,
    is_float,
)
from .._traced import is_integer
from . import elementwise as _ew
from . import reduce as _reduce
from .broadcast import BROADCAST_TO, SUM, BroadcastParams, ReduceParams, broadcast_tensor
from .shape import RESHAPE, ReshapeParams, normalize_axis, split_at

# --- the label gather and its scatter ---------------------------------------------------------


def _source(dtype: DType) -> str:
    t = C_TYPES[dtype]
    parts = [fp64_pragma(dtype), f"typedef {t} T;\ntypedef {t}8 T8;\n", KAHAN, VEC8,
             row_sumexp_source(dtype), _ROW_KERNELS]
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
            + _CE_ROWS.replace("LABEL_T", lt)
        )
    return "".join(parts)


register_family("losses", _source)


# A strided row kernel's work-item (B > 1): `per` adjacent columns (8, as vectors, if there are
# 8; else one each), from column b0, of block gid / groups, at `offset`.
_COLUMNS = """  const long per = B >= 8 ? 8 : 1, groups = (B + per - 1) / per;
  const long b0 = (gid % groups) * per, offset = (gid / groups) * K * B + b0;
"""


# log_softmax and softmax of x viewed as (A, K, B) over k, from the row's shift (its maximum;
# 0 if -inf; +inf gives a NaN row) and total (the sum of exp(x - shift)): log_softmax is
# (x - shift) - log(total), exact near 0 where x - logsumexp(x) would round at logsumexp's
# magnitude; softmax is exp(x - shift) / total. Contiguous rows (B = 1, one work-item per row)
# take the 8-wide helper; strided ones (B > 1: over axis 0, or the channels of NCHW) one
# work-item per 8 adjacent columns (a, b0..b0+7), whose elements at each k are contiguous: one
# vector exp for eight, the columns past the last 8 one by one. `setup` declares what the
# output needs of (shift, total) in scalars and vectors; `one` and `eight` give it for v, a T
# or a T8.
# With `kept` ((one, eight) of v, the element's exponential), a contiguous row's exponentials
# are written to the output by the sum and the output pass reads them back (softmax: one exp
# an element, the same values as computing each again).
def _rows_kernel(name: str, setup1: str, setup8: str, one: str, eight: str,
                 kept: tuple[str, str] | None = None) -> str:
    if kept is None:
        contiguous = f"""    const T total = tg_row_sumexp(src, K, &shift);
    {setup1}
    long k = 0;
    for (; k + 8 <= K; k += 8) {{ const T8 v = TG_LOAD8(src + k); TG_STORE8({eight}, dst + k); }}
    for (; k < K; ++k) {{ const T v = src[k]; dst[k] = {one}; }}"""
    else:
        contiguous = f"""    const T total = tg_row_sumexp_kept(src, K, &shift, dst);
    {setup1}
    long k = 0;
    for (; k + 8 <= K; k += 8) {{
      const T8 v = TG_LOAD8(dst + k);
      TG_STORE8({kept[1]}, dst + k);
    }}
    for (; k < K; ++k) {{ const T v = dst[k]; dst[k] = {kept[0]}; }}"""
    return f"""
__kernel void {name}(__global T* out, __global const T* x, const long K, const long B,
                     const long n) {{
  const long gid = get_global_id(0);
  if (gid >= n) return;
  if (B == 1) {{
    __global const T* src = x + gid * K;
    __global T* dst = out + gid * K;
    T shift;
{contiguous}
    return;
  }}
{_COLUMNS}  __global const T* src = x + offset;
  __global T* dst = out + offset;
  if (per == 8 && b0 + 8 <= B) {{
    T8 m = (T8)(-INFINITY);
    for (long k = 0; k < K; ++k) {{ const T8 v = TG_LOAD8(src + k * B); LS_MAX(m, v); }}
    const T8 shift = m == (T8)(-INFINITY) ? (T8)0 : m;
    T8 acc = (T8)0, lost = (T8)0;
    for (long k = 0; k < K; ++k) {{
      const T8 e = TG_LOAD8(src + k * B) - shift;  // a local: LS_EXP8 repeats its argument
      TG_KAHAN8(acc, lost, LS_EXP8(e))
    }}
    const T8 total = acc - lost;
    {setup8}
    for (long k = 0; k < K; ++k) {{
      const T8 v = TG_LOAD8(src + k * B);
      TG_STORE8({eight}, dst + k * B);
    }}
    return;
  }}
  for (long b = 0; b < min(per, B - b0); ++b) {{
    T m = -INFINITY;
    for (long k = 0; k < K; ++k) {{ const T v = src[k * B + b]; LS_MAX(m, v); }}
    const T shift = m == -INFINITY ? (T)0 : m;
    T acc = (T)0, lost = (T)0;
    for (long k = 0; k < K; ++k) TG_KAHAN(acc, lost, exp(src[k * B + b] - shift))
    const T total = acc - lost;
    {setup1}
    for (long k = 0; k < K; ++k) {{ const T v = src[k * B + b]; dst[k * B + b] = {one}; }}
  }}
}}
"""


# The VJPs of softmax and log_softmax over the same rows, from g and the forward's output y:
# s, the row's compensated sum of g * y (`times_y`) or of g, then `one`/`eight` per element
# (of gv and yv, the elements of g and y as T or T8, and s).
def _vjp_kernel(name: str, times_y: bool, one: str, eight: str) -> str:
    term = "gv * yv" if times_y else "gv"
    dot = f"tg_row_dot(gr, {'yr' if times_y else '0'}, K)"
    return f"""
__kernel void {name}(__global T* out, __global const T* g, __global const T* y, const long K,
                     const long B, const long n) {{
  const long gid = get_global_id(0);
  if (gid >= n) return;
  if (B == 1) {{
    __global const T* gr = g + gid * K;
    __global const T* yr = y + gid * K;
    __global T* dst = out + gid * K;
    const T s = {dot};
    long k = 0;
    for (; k + 8 <= K; k += 8) {{
      const T8 gv = TG_LOAD8(gr + k), yv = TG_LOAD8(yr + k);
      TG_STORE8({eight}, dst + k);
    }}
    for (; k < K; ++k) {{ const T gv = gr[k], yv = yr[k]; dst[k] = {one}; }}
    return;
  }}
{_COLUMNS}  __global const T* gr = g + offset;
  __global const T* yr = y + offset;
  __global T* dst = out + offset;
  if (per == 8 && b0 + 8 <= B) {{
    T8 acc = (T8)0, lost = (T8)0;
    for (long k = 0; k < K; ++k) {{
      const T8 gv = TG_LOAD8(gr + k * B), yv = TG_LOAD8(yr + k * B);
      TG_KAHAN8(acc, lost, {term})
    }}
    const T8 s = acc - lost;
    for (long k = 0; k < K; ++k) {{
      const T8 gv = TG_LOAD8(gr + k * B), yv = TG_LOAD8(yr + k * B);
      TG_STORE8({eight}, dst + k * B);
    }}
    return;
  }}
  for (long b = 0; b < min(per, B - b0); ++b) {{
    T acc = (T)0, lost = (T)0;
    for (long k = 0; k < K; ++k) {{
      const T gv = gr[k * B + b], yv = yr[k * B + b];
      TG_KAHAN(acc, lost, {term})
    }}
    const T s = acc - lost;
    for (long k = 0; k < K; ++k) {{
      const T gv = gr[k * B + b], yv = yr[k * B + b];
      dst[k * B + b] = {one};
    }}
  }}
}}
"""


_ROW_KERNELS = (
    _rows_kernel("log_softmax", "const T lse = log(total);", "const T8 lse = LS_LOG8(total);",
                 "(v - shift) - lse", "(v - shift) - lse")
    + _rows_kernel("softmax", "", "", "exp(v - shift) / total", "LS_EXP8(v - shift) / total",
                   kept=("v / total", "v / total"))
    + """
// The sum of a[c] * b[c] (b 0: of a[c]) over a contiguous row (`_kernels`' TG_ROW_SUM).
inline T tg_row_dot(__global const T* a, __global const T* b, const long C) {
  T total;
  if (b) TG_ROW_SUM(total, C, TG_LOAD8(a + c) * TG_LOAD8(b + c), a[c] * b[c])
  else TG_ROW_SUM(total, C, TG_LOAD8(a + c), a[c])
  return total;
}
"""
    # softmax's VJP: y * (g - sum(g * y)), y the softmax.
    + _vjp_kernel("softmax_grad", True, "yv * (gv - s)", "yv * (gv - s)")
    # log_softmax's VJP: g - exp(y) * sum(g), y the log-softmax.
    + _vjp_kernel("log_softmax_grad", False, "gv - exp(yv) * s", "gv - LS_EXP8(yv) * s"))

# One work-item per row i of x (N, C); n is N.
_CE_ROWS = """
__kernel void cross_entropy_rows_LABEL_T(__global T* out, __global const T* x,
                                         __global const LABEL_T* labels, const long n,
                                         const long C) {
  const long i = get_global_id(0);
  if (i >= n) return;
  __global const T* row = x + i * C;
  T shift;
  const T acc = tg_row_sumexp(row, C, &shift);
  const long l = labels[i];
  out[i] = (l >= 0 && l < C) ? log(acc) + (shift - row[l]) : (T)NAN;  // exact near 0
}
__kernel void cross_entropy_rows_grad_LABEL_T(__global T* out, __global const T* g,
                                              __global const T* x,
                                              __global const LABEL_T* labels, const long n,
                                              const long C, const long gs) {
  const long i = get_global_id(0);
  if (i >= n) return;
  __global const T* row = x + i * C;
  T shift;
  const T acc = tg_row_sumexp(row, C, &shift);
  const long l = labels[i];
  const int valid = l >= 0 && l < C;
  const T gi = g[i * gs];  // gs = 0: one g for every row (the VJP of a mean)
  __global T* dst = out + i * C;
  if (!valid) {
    for (long c = 0; c < C; ++c) dst[c] = (T)NAN;
    return;
  }
  long c = 0;
  for (; c + 8 <= C; c += 8) {
    const T8 p = LS_EXP8(TG_LOAD8(row + c) - shift) / acc;
    TG_STORE8(gi * p, dst + c);
  }
  for (; c < C; ++c) dst[c] = gi * (exp(row[c] - shift) / acc);
  dst[l] = gi * (exp(row[l] - shift) / acc - (T)1);
}
"""


def _launch(name: str, out: AnyTensor, inputs: Sequence[Any], labels: AnyTensor,
            n: int, classes: int, *extra: int) -> None:
    """Run kernel `name` (for the labels' dtype) over n work-items; `extra` are trailing long
    arguments."""
    dev: Device = out.device
    kernel = dev.kernel("losses", dtype_name(out.dtype), f"{name}_{C_TYPES[labels.dtype]}",
                        lambda: _source(out.dtype))
    if n:
        dev.launch(kernel, launch_size(n), (LOCAL,), out.buffer, *(t.buffer for t in inputs),
                   labels.buffer, np.int64(n), np.int64(classes), *map(np.int64, extra))


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
    _launch("pick_label", out, [x], labels, out.size, x.shape[1])
    return out


@dataclass(frozen=True, slots=True)
class PickGradParams:
    classes: int


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
    _launch("pick_label_grad", out, [g], labels, out.size, p.classes)
    return out


PICK_LABEL, PICK_LABEL_GRAD = transposes(
    LinearOp("pick_label", _pick_rule, _pick_forward,
             "out[i] = x[i, labels[i]] for x (N, C) and integer labels (N,); NaN for a label "
             "outside [0, C). The VJP scatters g into zeros (pick_label_grad)."),
    LinearOp("pick_label_grad", _pick_grad_rule, _pick_grad_forward,
             "out[i, c] = g[i] where c == labels[i] else 0 (NaN rows for labels outside [0, "
             "C)): the VJP of pick_label, one work-item per element, no atomics."),
    a_to_b=lambda p, args: PickGradParams(args[0].shape[1]),
    b_to_a=lambda p, args: None)


def _logits_rule(op: str, x: Any, labels: Any) -> None:
    if not is_float(x.dtype) or len(x.shape) != 2:
        raise ShapeError(at_site(
            f"{op}: logits must be a 2-D float tensor, got {x.shape} {dtype_name(x.dtype)}"))
    _check_labels(op, x.shape[0], labels)


def _ce_rows_rule(args: Sequence[Any], p: None) -> Aval:
    x, labels = args
    _logits_rule("cross_entropy_rows", x, labels)
    return Aval((x.shape[0],), x.dtype)


def _ce_rows_forward(dev: Device, args: Sequence[AnyTensor], p: None, aval: Aval
                     ) -> AnyTensor:
    x, labels = args
    out = empty(aval.shape, aval.dtype, dev)
    _launch("cross_entropy_rows", out, [x], labels, x.shape[0], x.shape[1])
    return out


def _ce_rows_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    x, labels = args
    return [e.apply(CROSS_ENTROPY_ROWS_GRAD, [g, x, labels]), None]


def _ce_grad_rule(args: Sequence[Any], p: None) -> Aval:
    g, x, labels = args
    _logits_rule("cross_entropy_rows_grad", x, labels)
    if tuple(g.shape) != (x.shape[0],) or g.dtype != x.dtype:
        raise ShapeError(at_site(
            f"cross_entropy_rows_grad: g must be ({x.shape[0]},) {dtype_name(x.dtype)}, got "
            f"{g.shape} {dtype_name(g.dtype)}"))
    return Aval(x.shape, x.dtype)


def _ce_grad_forward(dev: Device, args: Sequence[AnyTensor], p: None, aval: Aval
                     ) -> AnyTensor:
    g, x, labels = args
    out = empty(aval.shape, aval.dtype, dev)
    # A pending splat (the VJP of a mean) is read as its one element, never materialised.
    one = splat_source(g)
    _launch("cross_entropy_rows_grad", out, [g if one is None else one, x], labels, x.shape[0],
            x.shape[1], 1 if one is None else 0)
    return out


def _ce_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    """out = g[:, None] * (p - onehot), p = softmax(x) by rows. With s = sum(h * p) by rows:
    d/dg = s - h[i, labels[i]] and d/dx = g[:, None] * p * (h - s[:, None])."""

    g, x, labels = args
    rows, classes = x.shape
    full = BroadcastParams((rows, classes))
    column = ReshapeParams((rows, 1))
    lse = e.apply(_reduce.LOGSUMEXP, [x], ReduceParams((1,), True))
    probs = e.apply(_ew.MUL_EXP_SUB, [1.0, x, e.apply(BROADCAST_TO, [lse], full)])
    s = e.apply(SUM, [e.apply(_ew.MUL, [h, probs])], ReduceParams((1,), True))
    gg = gx = None
    if needs[0]:
        flat = e.apply(RESHAPE, [s], ReshapeParams((rows,)))
        gg = e.apply(_ew.SUB, [flat, e.apply(PICK_LABEL, [h, labels])])
    if needs[1]:
        gb = e.apply(BROADCAST_TO, [e.apply(RESHAPE, [g], column)], full)
        centred = e.apply(_ew.SUB, [h, e.apply(BROADCAST_TO, [s], full)])
        gx = e.apply(_ew.MUL, [e.apply(_ew.MUL, [gb, probs]), centred])
    return [gg, gx, None]


CROSS_ENTROPY_ROWS: Primitive[None] = register(Primitive(
    "cross_entropy_rows", _ce_rows_rule, _ce_rows_forward, _ce_rows_vjp,
    doc="Per-row cross-entropy of logits (N, C) and integer labels (N,): logsumexp(x[i]) - "
        "x[i, labels[i]], max-shifted in one kernel; NaN for a label outside [0, C)."))
CROSS_ENTROPY_ROWS_GRAD: Primitive[None] = register(Primitive(
    "cross_entropy_rows_grad", _ce_grad_rule, _ce_grad_forward, _ce_grad_vjp,
    doc="g[:, None] * (softmax(x) - onehot(labels)) in one kernel: the VJP of "
        "cross_entropy_rows; its own VJP is made of primitives."))


# --- log_softmax ---------------------------------------------------------------------------------

# The split path (few long rows) takes m and sum(exp(x - shift)) from reduce.shifted_sumexp
# (shifted by 0 for an infinite m), then (x - shift) - log(total); a row whose maximum is +inf
# is NaN, as above.
_FINISH = register_expression(
    "log_softmax_finish", 3, "b == (T)INFINITY ? (T)NAN : (a - (isinf(b) ? (T)0 : b)) - log(c)")


@dataclass(frozen=True, slots=True)
class AxisParams:
    axis: int


def _rule(name: str) -> Any:
    """The rule of log_softmax and softmax (errors name `name`)."""
    def rule(args: Sequence[Any], p: AxisParams) -> Aval:
        (x,) = args
        if not is_float(x.dtype):
            raise DTypeError(at_site(
                f"{name}: x has dtype {dtype_name(x.dtype)}, expected float32 or float64"))
        if not 0 <= p.axis < len(x.shape):
            raise ShapeError(at_site(f"{name}: axis {p.axis} does not fit x of shape "
                                     f"{tuple(x.shape)}"))
        return Aval(tuple(x.shape), x.dtype)
    return rule


def _by_rows(a: int, k: int, b: int) -> bool:
    """Whether x viewed as (a, k, b) takes the row kernels along k: contiguous rows, however
    few and long (read 8 wide, where the split reductions call exp and log one element at a
    time: (256, 10000) 38 -> ~3 ms), or enough strided ones to share among the cores."""
    return b == 1 or parts_of(a, k, b) == 1


def _rows(dev: Device, name: str, inputs: Sequence[AnyTensor], a: int, k: int, b: int
          ) -> AnyTensor:
    """A row kernel of `_ROW_KERNELS` (log_softmax, softmax, softmax_grad, log_softmax_grad)
    over the inputs."""
    first = inputs[0]
    out = empty(first.shape, first.dtype, dev)
    if out.size:
        kernel = dev.kernel("losses", dtype_name(first.dtype), name,
                            lambda: _source(first.dtype))
        per = 8 if b >= 8 else 1  # strided columns a work-item takes (see _rows_kernel)
        n = a * (1 if b == 1 else -(-b // per))
        dev.launch(kernel, launch_size(n), (LOCAL,), out.buffer, *[t.buffer for t in inputs],
                   np.int64(k), np.int64(b), np.int64(n))
    return out


def _log_softmax_forward(dev: Device, args: Sequence[AnyTensor], p: AxisParams, aval: Aval
                         ) -> AnyTensor:
    (x,) = args
    shape = x.shape
    a, k, b = split_at(shape, p.axis)
    # Contiguous rows take the kernel, however few and long: it reads them 8 wide, where the
    # split reductions below call exp and log one element at a time ((256, 10000): 38 ->
    # ~3 ms).
    if _by_rows(a, k, b):
        return _rows(dev, "log_softmax", [x], a, k, b)
    # Few rows, each long: the reductions split each row over many work-items.
    m, total = _reduce.shifted_sumexp(x, (p.axis,))
    return elementwise(_FINISH, [x, broadcast_tensor(m, shape), broadcast_tensor(total, shape)],
                       shape, x.dtype, dev)


def _log_softmax_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: AxisParams,
                     needs: Sequence[bool]) -> list[Any]:
    """g - exp(out) * sum(g), by one row kernel (`log_softmax_grad`)."""
    return [e.apply(LOG_SOFTMAX_GRAD, [g, out], p)]


def _row_sum(e: Emitter, t: Any, p: AxisParams) -> Any:
    """t summed along p.axis and broadcast back to t's shape."""
    total = e.apply(SUM, [t], ReduceParams((p.axis,), True))
    return e.apply(BROADCAST_TO, [total], BroadcastParams(tuple(t.shape)))


def _log_softmax_grad_forward(dev: Device, args: Sequence[AnyTensor], p: AxisParams,
                              aval: Aval) -> AnyTensor:
    g, o = args
    a, k, b = split_at(o.shape, p.axis)
    if _by_rows(a, k, b):
        return _rows(dev, "log_softmax_grad", [g, o], a, k, b)
    # Few long rows: the split reductions, then one elementwise kernel.
    total = reduce_tensor(g, "sum", (p.axis,), keep_shape(o.shape, (p.axis,)))
    probs = apply(_ew.MUL_EXP_SUB, dev, [broadcast_tensor(total, o.shape), o, 0.0])
    return apply(_ew.SUB, dev, [g, probs])


def _log_softmax_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: AxisParams,
                          needs: Sequence[bool]) -> list[Any]:
    """log_softmax_grad(g, o) = g - exp(o) * sum(g): in g, h - sum(h * exp(o)); in o,
    -h * exp(o) * sum(g)."""
    g, o = args
    gg = go = None
    if needs[0]:
        gg = e.apply(_ew.SUB, [h, _row_sum(e, e.apply(_ew.MUL_EXP_SUB, [h, o, 0.0]), p)])
    if needs[1]:
        spread = e.apply(_ew.MUL, [h, _row_sum(e, g, p)])
        go = e.apply(_ew.NEG, [e.apply(_ew.MUL_EXP_SUB, [spread, o, 0.0])])
    return [gg, go]


LOG_SOFTMAX: Primitive[AxisParams] = register(Primitive(
    "log_softmax", _rule("log_softmax"), _log_softmax_forward, _log_softmax_vjp,
    doc="x - logsumexp(x) along one axis, computed as (x - max) - log(sum(exp(x - max))) so "
        "that it stays accurate at any magnitude; the VJP is g - exp(out) * sum(g)."))


def _softmax_forward(dev: Device, args: Sequence[AnyTensor], p: AxisParams, aval: Aval
                     ) -> AnyTensor:
    (x,) = args
    a, k, b = split_at(x.shape, p.axis)
    if _by_rows(a, k, b):
        return _rows(dev, "softmax", [x], a, k, b)
    return apply(_ew.EXP, dev, [_log_softmax_forward(dev, args, p, aval)])


def _softmax_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: AxisParams,
                 needs: Sequence[bool]) -> list[Any]:
    return [e.apply(SOFTMAX_GRAD, [g, out], p)]


SOFTMAX: Primitive[AxisParams] = register(Primitive(
    "softmax", _rule("softmax"), _softmax_forward, _softmax_vjp,
    doc="exp(x - max) / sum(exp(x - max)) along one axis in one kernel; the VJP is "
        "softmax_grad."))


def _grad_rule(name: str) -> Any:
    """The rule of softmax_grad and log_softmax_grad: g and the forward's output alike."""
    output_rule = _rule(name)

    def rule(args: Sequence[Any], p: AxisParams) -> Aval:
        g, y = args
        if g.dtype != y.dtype:
            raise DTypeError(at_site(f"{name}: g is {dtype_name(g.dtype)} but the output is "
                                     f"{dtype_name(y.dtype)}"))
        if g.shape != y.shape:
            raise ShapeError(at_site(f"{name}: g has shape {tuple(g.shape)} but the output "
                                     f"{tuple(y.shape)}"))
        return output_rule([y], p)
    return rule


def _softmax_grad_forward(dev: Device, args: Sequence[AnyTensor], p: AxisParams, aval: Aval
                          ) -> AnyTensor:
    g, y = args
    a, k, b = split_at(y.shape, p.axis)
    if _by_rows(a, k, b):
        return _rows(dev, "softmax_grad", [g, y], a, k, b)
    # Few long rows: the split reductions, then elementwise kernels.
    gy = apply(_ew.MUL, dev, [g, y])
    dot = reduce_tensor(gy, "sum", (p.axis,), keep_shape(y.shape, (p.axis,)))
    diff = apply(_ew.SUB, dev, [g, broadcast_tensor(dot, y.shape)])
    return apply(_ew.MUL, dev, [y, diff])


def _softmax_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: AxisParams,
                      needs: Sequence[bool]) -> list[Any]:
    """softmax_grad(g, y) = y * (g - s), s = sum(g * y): linear in g (its VJP is
    softmax_grad(h, y)); in y, h * (g - s) - g * sum(h * y)."""

    g, y = args
    gg = e.apply(SOFTMAX_GRAD, [h, y], p) if needs[0] else None
    gy = None
    if needs[1]:
        s_g = _row_sum(e, e.apply(_ew.MUL, [g, y]), p)
        s_h = _row_sum(e, e.apply(_ew.MUL, [h, y]), p)
        gy = e.apply(_ew.SUB, [e.apply(_ew.MUL, [h, e.apply(_ew.SUB, [g, s_g])]),
                               e.apply(_ew.MUL, [g, s_h])])
    return [gg, gy]


SOFTMAX_GRAD: Primitive[AxisParams] = register(Primitive(
    "softmax_grad", _grad_rule("softmax_grad"), _softmax_grad_forward, _softmax_grad_vjp,
    doc="y * (g - sum(g * y)) along one axis: softmax's VJP, one kernel over each row."))
LOG_SOFTMAX_GRAD: Primitive[AxisParams] = register(Primitive(
    "log_softmax_grad", _grad_rule("log_softmax_grad"), _log_softmax_grad_forward,
    _log_softmax_grad_vjp,
    doc="g - exp(o) * sum(g) along one axis: log_softmax's VJP, one kernel over each row."))


# --- the public functions ---------------------------------------------------------------------


def _float_input(tape: Tape, op: str, x: Id, axis: int) -> int:
    """Check x is a float id on `tape` and normalise `axis` (errors name `op`)."""
    tape.node(x, op, "x")
    if not is_float(x.dtype):
        raise DTypeError(at_site(
            f"{op}: x has dtype {dtype_name(x.dtype)}, expected float32 or float64 (convert with "
            "tg.astype)"))
    if not is_integer(axis):
        raise ArgumentTypeError(at_site(f"{op}: axis must be an int, not {shown(axis)}"))
    return normalize_axis(op, int(axis), len(x.shape))


@takes_tape
def softmax(tape: Tape, x: Id, axis: int = -1) -> tuple[Tape, Id]:
    """exp(x - max) / sum(exp(x - max)) along `axis` (default the last): no overflow at any
    magnitude; one kernel, and one for its VJP."""
    ax = _float_input(tape, "softmax", x, axis)
    return record(tape, SOFTMAX, [x], AxisParams(ax))


@takes_tape
def log_softmax(tape: Tape, x: Id, axis: int = -1) -> tuple[Tape, Id]:
    """x - logsumexp(x) along `axis` (default the last), computed as (x - max) - log(sum(exp(
    x - max))): stable, and accurate near 0 even for logits of large magnitude."""
    ax = _float_input(tape, "log_softmax", x, axis)
    return record(tape, LOG_SOFTMAX, [x], AxisParams(ax))


@takes_tape
def cross_entropy(tape: Tape, logits: Id, labels: Id) -> tuple[Tape, Id]:
    """Mean over rows of logsumexp(logits[i]) - logits[i, labels[i]] (PyTorch's cross_entropy).

    `logits` is a float (N, C) id, `labels` an int32 or int64 (N,) id of class indices. Stable
    at any logit magnitude (no NaN or Inf at +-1e4). A label outside [0, C) is an
    `IndexRangeError` when the labels came from host data; labels computed on the device are
    not read back to be checked, and such a label makes the loss NaN (see the module notes).
    N == 0 gives NaN, as PyTorch.
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
    classes = logits.shape[1]
    known = checked_range(tape[labels].value, 0, classes - 1)
    if known is not None and (known[0] < 0 or known[1] >= classes):
        raise IndexRangeError(at_site(
            f"{op}: label {known[0] if known[0] < 0 else known[1]} is out of bounds for "
            f"{classes} classes (labels must lie in [0, {classes}))"))
    tape, rows = record(tape, CROSS_ENTROPY_ROWS, [logits, labels])
    return _reduce.mean(tape, rows)


@takes_tape
def mse(tape: Tape, a: _ew.Operand, b: _ew.Operand) -> tuple[Tape, Id]:
    """Mean of (a - b)**2 over every element.

    Two ids must have the same shape (a loss that broadcasts (N,) against (N, 1) is almost always
    a bug, so it is refused); either may be a Python number.
    """
    op = "mse"
    a, b = _ew.number(op, "a", a), _ew.number(op, "b", b)
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, Id):
            tape.node(v, op, name)
            if not is_float(v.dtype):
                raise DTypeError(at_site(
                    f"{op}: {name} has dtype {dtype_name(v.dtype)}, expected float32 or float64 "
                    "(convert with tg.astype)"))
    if isinstance(a, Id) and isinstance(b, Id):
        if a.dtype != b.dtype:
            raise DTypeError(at_site(
                f"{op}: a is {dtype_name(a.dtype)} but b is {dtype_name(b.dtype)}; convert one "
                "explicitly with tg.astype"))
        if a.shape != b.shape:
            raise ShapeError(at_site(
                f"{op}: a has shape {a.shape} and b has shape {b.shape}; they must be equal "
                "(reshape or tg.broadcast_to one of them explicitly)"))
    elif not isinstance(a, Id) and not isinstance(b, Id):
        raise NotAnIdError(at_site(f"{op}: at least one of a and b must be an Id, not two "
                                   "numbers"))
    tape, d = _ew.sub(tape, a, b)
    tape, sq = _ew.mul(tape, d, d)
    return _reduce.mean(tape, sq)
