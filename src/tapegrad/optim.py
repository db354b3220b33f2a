"""Optimizers as pure functions over parameter pytrees, computed on the device.

`params, state = tg.optim.adam(params, grads, state)`: nothing is mutated. Each step runs one
fused kernel per parameter that writes fresh buffers for the new parameter and its state, so
old parameters and old states stay valid (they are values, like everything else here).
Semantics follow PyTorch's `torch.optim.SGD` (dampening 0, not Nesterov) and `torch.optim.Adam`
(bias-corrected, L2-free).
"""

from __future__ import annotations

import operator
from typing import Any, cast

import numpy as np
import pyopencl as cl

from ._device import LOCAL, Device, register_family
from ._errors import DeviceError, DTypeError, ShapeError, TapegradError, at_site
from ._kernels import DENSE_PRELUDE, dense_size
from ._tensor import C_TYPES, AnyTensor, DType, dtype_name, empty, is_float
from ._transforms import flatten, flatten_like

# `fresh` means no state yet (all zeros): the state pointers are then not read, so a first step
# needs no zero-filled buffers (two fill kernels fewer per parameter).
_SOURCE = """
__kernel void sgd(__global T* p_out, __global T* v_out, __global const T* p,
                  __global const T* g, __global const T* v, const T lr, const T momentum,
                  const T weight_decay, const int fresh, const long n) {
  TG_EACH(n) {
    const T d = g[i] + weight_decay * p[i];
    const T buf = fresh ? d : momentum * v[i] + d;
    v_out[i] = buf;
    p_out[i] = p[i] - lr * buf;
  }
}
__kernel void adam(__global T* p_out, __global T* m_out, __global T* v_out,
                   __global const T* p, __global const T* g, __global const T* m,
                   __global const T* v, const T lr, const T b1, const T b2, const T eps,
                   const T c1, const T c2, const int fresh, const long n) {
  TG_EACH(n) {
    const T gi = g[i];
    const T mi = (fresh ? (T)0 : b1 * m[i]) + ((T)1 - b1) * gi;
    const T vi = (fresh ? (T)0 : b2 * v[i]) + ((T)1 - b2) * gi * gi;
    m_out[i] = mi;
    v_out[i] = vi;
    p_out[i] = p[i] - lr * (mi / c1) / (sqrt(vi / c2) + eps);
  }
}
"""


def _source(dtype: DType) -> str:
    pragma = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" if dtype == np.float64 else ""
    return f"{pragma}typedef {C_TYPES[dtype]} T;\n{DENSE_PRELUDE}{_SOURCE}"


register_family("optim", _source)


def _kernel(device: Device, dtype: DType, name: str) -> cl.Kernel:

    types = {"sgd": [None] * 5 + [dtype] * 3 + [np.int32, np.int64],
             "adam": [None] * 7 + [dtype] * 6 + [np.int32, np.int64]}[name]
    return device.kernel("optim", dtype_name(dtype), name, lambda: _source(dtype), types)


def _pairs(params: Any, grads: Any, op: str) -> tuple[list[AnyTensor], list[AnyTensor], Any]:
    p_flat, rebuild = flatten(params)
    g_flat = flatten_like(grads, params, op, "grads")
    if len(p_flat) != len(g_flat):
        raise ShapeError(at_site(
            f"{op}: params has {len(p_flat)} leaves but grads has {len(g_flat)}; grads must "
            "have the structure of params"))
    ps: list[AnyTensor] = []
    gs: list[AnyTensor] = []
    for k, (p, g) in enumerate(zip(p_flat, g_flat, strict=True)):
        p = p if isinstance(p, AnyTensor) else AnyTensor.from_numpy(p)
        if not is_float(p.dtype):
            raise DTypeError(at_site(f"{op}: leaf {k}: param is {p.dtype}, not a float dtype"))
        ps.append(p)
        gs.append(_matching(g, p, op, f"leaf {k}: grad"))
    return ps, gs, rebuild


def _matching(t: Any, p: AnyTensor, op: str, what: str) -> AnyTensor:
    """`t` as a tensor with p's shape, dtype and device, or an error saying which differs.

    Kernels trust these: a state or gradient of the wrong size would be read past its end."""
    t = t if isinstance(t, AnyTensor) else AnyTensor.from_numpy(t, p.device)
    if t.device is not p.device:
        raise DeviceError(at_site(f"{op}: {what} is on {t.device!r}, the param on {p.device!r}"))
    if t.shape != p.shape:
        raise ShapeError(at_site(f"{op}: {what} has shape {t.shape}, the param {p.shape}"))
    if t.dtype != p.dtype:
        raise DTypeError(at_site(f"{op}: {what} is {t.dtype}, the param {p.dtype}"))
    return t


def _state(state: Any, keys: tuple[str, ...], params: Any, ps: list[AnyTensor], op: str
           ) -> list[list[AnyTensor]]:
    """The per-parameter leaves of each state entry, checked against the params."""
    if not isinstance(state, dict) or not set(keys) <= set(cast(dict[str, Any], state)):
        raise TapegradError(at_site(
            f"{op}: state must be None or the dict {op} returned (keys {', '.join(keys)})"))
    entries = cast(dict[str, Any], state)
    out: list[list[AnyTensor]] = []
    for key in keys:
        leaves = flatten_like(entries[key], params, op, f"state[{key!r}]")
        out.append([_matching(t, p, op, f"leaf {k}: state[{key!r}]")
                    for k, (t, p) in enumerate(zip(leaves, ps, strict=True))])
    return out


def _numbers(op: str, **values: Any) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
            raise DTypeError(at_site(f"{op}: {name} must be a number, got {v!r}"))


def _launch(kernel: cl.Kernel, device: Device, n: int, *args: Any) -> None:
    if n:
        device.launch(kernel, dense_size(n), (LOCAL,), *args, n)


def sgd(params: Any, grads: Any, state: Any = None, *, lr: float, momentum: float = 0.0,
        weight_decay: float = 0.0) -> tuple[Any, dict[str, Any]]:
    """One SGD step: `d = g + weight_decay * p; buf = momentum * buf + d; p -= lr * buf`."""
    _numbers("sgd", lr=lr, momentum=momentum, weight_decay=weight_decay)
    ps, gs, rebuild = _pairs(params, grads, "sgd")
    fresh = not state
    bufs = gs if fresh else _state(state, ("momentum",), params, ps, "sgd")[0]
    new_p: list[AnyTensor] = []
    new_b: list[AnyTensor] = []
    for p, g, b in zip(ps, gs, bufs, strict=True):
        out_p, out_b = empty(p.shape, p.dtype, p.device), empty(p.shape, p.dtype, p.device)
        _launch(_kernel(p.device, p.dtype, "sgd"), p.device, p.size, out_p.buffer, out_b.buffer,
                p.buffer, g.buffer, b.buffer, lr, momentum, weight_decay, int(fresh))
        new_p.append(out_p)
        new_b.append(out_b)
    return rebuild(new_p), {"momentum": rebuild(new_b)}


def adam(params: Any, grads: Any, state: Any = None, *, lr: float = 1e-3, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, dict[str, Any]]:
    """One Adam step with bias correction (PyTorch's `torch.optim.Adam` without weight decay)."""
    _numbers("adam", lr=lr, b1=b1, b2=b2, eps=eps)
    ps, gs, rebuild = _pairs(params, grads, "adam")
    if state:
        ms, vs = _state(state, ("m", "v"), params, ps, "adam")
        step = cast(dict[str, Any], state).get("step")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 1:
            raise TapegradError(at_site(f"adam: state['step'] must be a positive int, got "
                                        f"{step!r}"))
        step = operator.index(cast(int, step)) + 1
    else:
        step, ms, vs = 1, gs, gs  # not read: the kernel's `fresh` flag stands for zeros
    c1, c2 = 1.0 - b1**step, 1.0 - b2**step
    new_p: list[AnyTensor] = []
    new_m: list[AnyTensor] = []
    new_v: list[AnyTensor] = []
    for p, g, m, v in zip(ps, gs, ms, vs, strict=True):
        outs = [empty(p.shape, p.dtype, p.device) for _ in range(3)]
        _launch(_kernel(p.device, p.dtype, "adam"), p.device, p.size,
                *(o.buffer for o in outs), p.buffer, g.buffer, m.buffer, v.buffer,
                lr, b1, b2, eps, c1, c2, int(not state))
        new_p.append(outs[0])
        new_m.append(outs[1])
        new_v.append(outs[2])
    return rebuild(new_p), {"step": step, "m": rebuild(new_m), "v": rebuild(new_v)}
