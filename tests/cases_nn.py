"""Op-table rows for the nn ops (see cases.py for the row format).

The numpy references here are written independently of the kernels: conv2d slides the window
over a padded copy (no patch matrix), pools take max/mean over padded windows, and dropout's
mask is SplitMix64 recomputed with numpy's wrapping uint64 arithmetic. Sizes are odd and small
(gradcheck runs two forwards per input element); strides and paddings differ per axis.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import tapegrad as tg
from cases import Array, Case, Out, case1

Pair = int | tuple[int, int]


def _two(v: Pair) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else v


def _pad_planes(x: Array, ph: int, pw: int, value: float) -> Array:
    widths = [(0, 0)] * (x.ndim - 2) + [(ph, ph), (pw, pw)]
    return np.pad(x, widths, constant_values=value)


def _windows(x: Array, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int],
             value: float) -> Array:
    """The windows of x (..., H, W) as (..., OH, OW, kh, kw), padded with `value`."""
    xp = _pad_planes(x, p[0], p[1], value)
    oh = (xp.shape[-2] - k[0]) // s[0] + 1
    ow = (xp.shape[-1] - k[1]) // s[1] + 1
    out = np.empty((*x.shape[:-2], oh, ow, k[0], k[1]), x.dtype)
    for i in range(oh):
        for j in range(ow):
            out[..., i, j, :, :] = xp[..., i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]]
    return out


def conv2d_ref(x: Array, w: Array, b: Array | None = None, stride: Pair = 1,
               padding: Pair = 0) -> Array:
    unbatched = x.ndim == 3
    xb = x[None] if unbatched else x
    win = _windows(xb, (w.shape[2], w.shape[3]), _two(stride), _two(padding), 0.0)
    out = np.einsum("ncyxij,ocij->noyx", win, w)
    if b is not None:
        out = out + b[None, :, None, None]
    return out[0] if unbatched else out


def max_pool2d_ref(x: Array, k: Pair, stride: Pair | None = None, padding: Pair = 0) -> Array:
    return _windows(x, _two(k), _two(k if stride is None else stride), _two(padding),
                    -np.inf).max(axis=(-2, -1))


def avg_pool2d_ref(x: Array, k: Pair, stride: Pair | None = None, padding: Pair = 0) -> Array:
    return _windows(x, _two(k), _two(k if stride is None else stride), _two(padding),
                    0.0).mean(axis=(-2, -1))


def _normalized(x: Array, axes: tuple[int, ...], eps: float) -> Array:
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


def layer_norm_ref(x: Array, weight: Array | None = None, bias: Array | None = None,
                   eps: float = 1e-5) -> Array:
    y = _normalized(x, (x.ndim - 1,), eps)
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


def batch_norm_ref(x: Array, weight: Array | None = None, bias: Array | None = None,
                   eps: float = 1e-5) -> Array:
    y = _normalized(x, (0, *range(2, x.ndim)), eps)
    shape = (x.shape[1], *([1] * (x.ndim - 2)))
    y = y * weight.reshape(shape) if weight is not None else y
    return y + bias.reshape(shape) if bias is not None else y


def _mix64(z: Array) -> Array:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def dropout_mask_ref(shape: tuple[int, ...], p: float, seed: int) -> Array:
    """True where dropout keeps an element: SplitMix64 over (seed, flat index)."""
    key = _mix64(np.array([seed % 2**64], np.uint64))
    counters = np.arange(1, int(np.prod(shape)) + 1, dtype=np.uint64)
    bits = _mix64(key + counters * np.uint64(0x9E3779B97F4A7C15))
    threshold = min(round(p * 2.0**32), 2**32)
    return ((bits >> np.uint64(32)) >= threshold).reshape(shape)


def dropout_ref(x: Array, p: float, seed: int) -> Array:
    return np.where(dropout_mask_ref(x.shape, p, seed), x / x.dtype.type(1 - p), 0).astype(
        x.dtype)


# --- rows -------------------------------------------------------------------------------------


def _conv_case(x: tuple[int, ...], w: tuple[int, ...], bias: bool, stride: Pair,
               padding: Pair) -> Case:
    def f(t: tg.Tape, *ids: tg.Id) -> Out:
        return tg.conv2d(t, ids[0], ids[1], ids[2] if bias else None, stride=stride,
                         padding=padding)

    def r(*arrays: Array) -> Array:
        return conv2d_ref(arrays[0], arrays[1], arrays[2] if bias else None, stride, padding)

    shapes = (x, w, (w[0],)) if bias else (x, w)
    label = f"conv2d{x}*{w}(stride={stride}, padding={padding}{', bias' if bias else ''})"
    return Case(label, f, r, shapes)


def _conv_cases() -> list[Case]:
    return [
        _conv_case((2, 2, 7, 5), (3, 2, 3, 2), True, 1, 0),
        _conv_case((2, 2, 7, 5), (3, 2, 3, 2), False, 2, 1),
        _conv_case((1, 3, 7, 5), (2, 3, 2, 3), True, (2, 1), (1, 2)),
        _conv_case((2, 1, 7, 5), (2, 1, 3, 2), False, (3, 2), (0, 1)),
        _conv_case((2, 3, 5, 3), (4, 3, 1, 1), True, 2, 0),
        _conv_case((2, 5, 4), (3, 2, 2, 2), True, 1, 1),
        _conv_case((2, 2, 3, 2), (2, 2, 3, 2), True, 1, 0),
        # conv_panel's paths: halves of 8 outputs in one row (vector loads, stride 2's
        # strided ones), more rows of w than one work-item takes, k over several chunks
        _conv_case((2, 3, 4, 16), (5, 3, 3, 3), True, 1, 1),
        _conv_case((2, 2, 5, 16), (3, 2, 3, 3), False, 2, 1),
        _conv_case((1, 2, 3, 3), (40, 2, 2, 2), False, 1, 0),
        _conv_case((1, 29, 2, 4), (2, 29, 3, 3), False, 1, 1),
        # a window as wide as the plane (a text CNN's): rows laid end to end, one of oh
        _conv_case((2, 1, 6, 4), (3, 1, 2, 4), True, (2, 1), (1, 0)),
        _conv_case((1, 9, 5, 1), (3, 9, 3, 1), False, 1, (1, 0)),
        # few output channels: the weight's gradient 8 positions of a row at a time, the rest
        _conv_case((2, 3, 5, 21), (2, 3, 3, 3), True, 1, 1),
        _conv_case((1, 2, 4, 17), (7, 2, 3, 3), False, 1, 1),
        _conv_x_grad_case(2, ((2, 2, 5, 6), (3, 2, 3, 3), (2, 3, 3, 3))),
        _conv_x_grad_case(1, ((1, 8, 4, 5), (2, 8, 3, 3), (1, 2, 4, 5))),
    ]


def _conv_x_grad_case(stride: int, shapes: tuple[tuple[int, ...], ...]) -> Case:
    """x's gradient of sum(conv2d(x, w) * r), recorded (`conv2d_input_grad`), so that the
    checks differentiate it: at stride 2 col2im of w^T r, at stride 1 over 8 channels the
    convolution of r with the flipped weight."""
    pad = 1

    def f(t: tg.Tape, x: tg.Id, w: tg.Id, r: tg.Id) -> Out:
        t, y = tg.conv2d(t, x, w, stride=stride, padding=pad)
        t, yr = tg.mul(t, y, r)
        t, total = tg.sum(t, yr)
        t, grads = tg.backward_on_tape(t, total, [x])
        return t, grads[x]

    def ref(x: Array, w: Array, r: Array) -> Array:
        kh, kw = w.shape[2:]
        xp = np.zeros((x.shape[0], x.shape[1], x.shape[2] + 2 * pad, x.shape[3] + 2 * pad))
        for i in range(r.shape[2]):
            for j in range(r.shape[3]):
                xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw] += np.einsum(
                    "no,ocyx->ncyx", r[:, :, i, j], w)
        return xp[:, :, pad:-pad, pad:-pad].astype(x.dtype)

    return Case(f"conv2d x gradient (stride {stride}), recorded", f, ref, shapes)


PoolFn = Callable[..., Out]


def _pool_case(name: str, fn: PoolFn, ref: Callable[..., Array], x: tuple[int, ...], k: Pair,
               stride: Pair | None, padding: Pair) -> Case:
    def f(t: tg.Tape, xi: tg.Id) -> Out:
        return fn(t, xi, k, stride=stride, padding=padding)

    def r(xa: Array) -> Array:
        return ref(xa, k, stride, padding)

    return case1(f"{name}{x}(k={k}, stride={stride}, padding={padding})", f, r, x)


def _pool_cases() -> list[Case]:
    cases: list[Case] = []
    for name, fn, ref in (("max_pool2d", tg.max_pool2d, max_pool2d_ref),
                          ("avg_pool2d", tg.avg_pool2d, avg_pool2d_ref)):
        cases += [
            _pool_case(name, fn, ref, (2, 2, 7, 5), 2, None, 0),
            _pool_case(name, fn, ref, (1, 2, 7, 5), 3, 2, 1),
            _pool_case(name, fn, ref, (1, 2, 7, 5), (3, 2), (2, 1), (1, 0)),
            _pool_case(name, fn, ref, (2, 5, 5), 3, 1, 1),  # overlapping windows, unbatched
            _pool_case(name, fn, ref, (1, 1, 5, 7), (2, 4), (3, 1), (1, 2)),
        ]
    return cases


def _linear_cases() -> list[Case]:
    def ref(x: Array, w: Array, b: Array | None = None) -> Array:
        return x @ w + b if b is not None else x @ w

    return [
        Case("linear(3-D x, bias)", tg.linear, ref, ((2, 3, 4), (4, 5), (5,))),
        Case("linear(2-D x)", tg.linear, ref, ((3, 4), (4, 2))),
        Case("linear(1-D x, bias)", tg.linear, ref, ((4,), (4, 3), (3,))),
        Case("linear(4-D x, bias)", tg.linear, ref, ((2, 2, 3, 4), (4, 5), (5,))),
        Case("linear(3-D x)", tg.linear, ref, ((2, 3, 4), (4, 2))),
    ]


NormFn = Callable[..., Out]


def _norm_cases(name: str, fn: NormFn, ref: Callable[..., Array], x: tuple[int, ...], c: int
                ) -> list[Case]:
    def weight_only(t: tg.Tape, xi: tg.Id, wi: tg.Id) -> Out:
        return fn(t, xi, wi)

    def weight_only_ref(xa: Array, wa: Array) -> Array:
        return ref(xa, wa)

    def bias_only(t: tg.Tape, xi: tg.Id, bi: tg.Id) -> Out:
        return fn(t, xi, bias=bi, eps=0.1)

    def bias_only_ref(xa: Array, ba: Array) -> Array:
        return ref(xa, bias=ba, eps=0.1)

    return [
        Case(f"{name}{x}(weight, bias)", fn, ref, (x, (c,), (c,))),
        case1(f"{name}{x}", fn, ref, x),
        Case(f"{name}{x}(weight)", weight_only, weight_only_ref, (x, (c,))),
        Case(f"{name}{x}(bias, eps=0.1)", bias_only, bias_only_ref, (x, (c,))),
    ]


def _dropout_case(shape: tuple[int, ...], p: float, seed: int) -> Case:
    def f(t: tg.Tape, xi: tg.Id) -> Out:
        return tg.dropout(t, xi, p, seed)

    def r(xa: Array) -> Array:
        return dropout_ref(xa, p, seed)

    return case1(f"dropout{shape}(p={p}, seed={seed})", f, r, shape)


CASES: list[Case] = (
    _conv_cases() + _pool_cases() + _linear_cases()
    + _norm_cases("layer_norm", tg.layer_norm, layer_norm_ref, (3, 5), 5)
    + _norm_cases("layer_norm", tg.layer_norm, layer_norm_ref, (2, 3, 4), 4)
    + _norm_cases("batch_norm", tg.batch_norm, batch_norm_ref, (4, 3), 3)
    + _norm_cases("batch_norm", tg.batch_norm, batch_norm_ref, (2, 3, 3, 2), 3)
    + [_dropout_case((4, 5), 0.3, 7), _dropout_case((3, 2, 5), 0.5, -3),
       _dropout_case((6,), 0.9, 2**70 + 5)]
)
