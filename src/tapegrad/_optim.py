"""Optimizers as pure functions over parameter pytrees, computed on the device.

`params, state = tg.optim.adam(params, grads, state)`: nothing is mutated. params, grads and the
state's entries are pytrees of one structure (`_tree`: dicts matched by key, dataclasses,
namedtuples...); the new parameters and state come back in the params'. A step writes fresh
buffers for the new parameters and their state, so old parameters and old states stay valid
(they are values, like everything else here). One launch updates up to GROUP parameters of a
dtype (a kernel per size in GROUPS): on PoCL a launch to an idle device costs ~25 us of host
time, more than the update of a small parameter, and a model has many.
Semantics follow PyTorch's `torch.optim.SGD` (dampening 0, not Nesterov) and `torch.optim.Adam`
(bias-corrected, L2-free).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyopencl as cl
from optree import PyTreeSpec

from ._device import LOCAL, Device, fp64_pragma
from ._errors import DeviceError, DTypeError, ShapeError, at_site, number, shown
from ._kernels import DENSE_CHUNK, DENSE_PRELUDE, VEC8, launch_size
from ._tensor import C_TYPES, AnyTensor, DType, buffers_of, dtype_name, is_float, tensor
from ._traced import as_float, as_index, is_integer
from ._tree import describe, flatten, is_node, leaf_path, match

# `fresh` means no state yet (all zeros): the state pointers are then not read, so a first step
# needs no zero-filled buffers (two fill kernels fewer per parameter). Each update is written
# once, for elements [i0, i1) of one parameter; the kernels below apply it to GROUP parameters.
_UPDATES = """
inline void sgd_one(__global T* p_out, __global T* v_out, __global const T* p,
                    __global const T* g, __global const T* v, const T lr, const T momentum,
                    const T weight_decay, const int fresh, const long i0, const long i1) {
  for (long i = i0; i < i1; ++i) {
    const T d = g[i] + weight_decay * p[i];
    const T buf = fresh ? d : momentum * v[i] + d;
    v_out[i] = buf;
    p_out[i] = p[i] - lr * buf;
  }
}
inline void adam_one(__global T* p_out, __global T* m_out, __global T* v_out,
                     __global const T* p, __global const T* g, __global const T* m,
                     __global const T* v, const T lr, const T b1, const T b2, const T eps,
                     const T c1, const T c2, const int fresh, const long i0, const long i1) {
  // A vector of TG_VW elements at a time where there are that many (the square root and the
  // divisions, at 10-20 cycles each, would otherwise run one element at a time), then one by
  // one.
  long i = i0;
  for (; i + TG_VW <= i1; i += TG_VW) {
    const TV gi = TG_VLOAD(g + i);
    const TV mi = (fresh ? (TV)0 : b1 * TG_VLOAD(m + i)) + ((T)1 - b1) * gi;
    const TV vi = (fresh ? (TV)0 : b2 * TG_VLOAD(v + i)) + ((T)1 - b2) * gi * gi;
    TG_VSTORE(mi, m_out + i);
    TG_VSTORE(vi, v_out + i);
    const TV pi = TG_VLOAD(p + i) - lr * (mi / c1) / (sqrt(vi / c2) + eps);
    TG_VSTORE(pi, p_out + i);
  }
  for (; i < i1; ++i) {
    const T gi = g[i];
    const T mi = (fresh ? (T)0 : b1 * m[i]) + ((T)1 - b1) * gi;
    const T vi = (fresh ? (T)0 : b2 * v[i]) + ((T)1 - b2) * gi * gi;
    m_out[i] = mi;
    v_out[i] = vi;
    p_out[i] = p[i] - lr * (mi / c1) / (sqrt(vi / c2) + eps);
  }
}
"""

# The updates' vector: eight floats (`_kernels.VEC8`'s loads and stores) or four doubles, one
# AVX register (a double8 passed to sqrt is an out-of-line call whose ABI clang warns about
# without AVX-512).
_VECTORS = {
    4: "typedef float8 T8;\ntypedef T8 TV;\n#define TG_VW 8\n" + VEC8
       + "#define TG_VLOAD TG_LOAD8\n#define TG_VSTORE TG_STORE8\n",
    8: "typedef double4 TV;\n#define TG_VW 4\n"
       "#define TG_VLOAD(p) ((TV)((p)[0], (p)[1], (p)[2], (p)[3]))\n"
       "#define TG_VSTORE(v, p) do { (p)[0] = (v).s0; (p)[1] = (v).s1; (p)[2] = (v).s2; "
       "(p)[3] = (v).s3; } while (0)\n"}

GROUP = 8  # parameters per launch at most
# The kernels' sizes: a launch takes the smallest that holds its parameters, as PoCL handles
# each buffer argument of a launch on the host (eight slots of Adam's seven buffers were most
# of a small model's update: BENCHMARKS, session 37).
GROUPS = (1, 2, 4, GROUP)
# name: (buffers per parameter, outputs among them, scalar hyperparameters)
_OPTIMIZERS = {"sgd": (5, 2, ("lr", "momentum", "weight_decay")),
               "adam": (7, 3, ("lr", "b1", "b2", "eps", "c1", "c2"))}


# Each update's outputs and the inputs it reads for them at the same element only, before
# writing them (`in_place`): (output, input) buffer positions within a parameter's slot.
_SAME_ELEMENT = {"sgd": ((0, 2), (1, 4)), "adam": ((0, 3), (1, 5), (2, 6))}
# The grouped kernels by name: the optimizer and how many parameters it takes.
_KERNELS = {f"{name}{size}": (name, size) for name in _OPTIMIZERS for size in GROUPS}


def in_place(kernel: str, args: Sequence[Any], out: int, given: int) -> bool:
    """Whether a launch of the kernel named `kernel` with `args` may write the buffer `out`
    (by id) into the buffer `given`: an optimizer's grouped update where, among the slots that
    update elements (unused slots repeat another's buffers and update none), `out` is only a
    parameter's (or its state's) new value and `given` only its old one (tg.jit's donated
    buffers)."""
    named = _KERNELS.get(kernel)
    if named is None:
        return False
    name, size = named
    pairs = _SAME_ELEMENT[name]
    buffers = _OPTIMIZERS[name][0]
    per = buffers + 2  # a slot's buffers, then its n and o
    found: set[tuple[int, int]] = set()
    for j in range(size):
        slot = args[j * per: (j + 1) * per]
        if not slot[buffers]:  # n: no elements
            continue
        outs = [b for b in range(buffers) if id(slot[b]) == out]
        ins = [b for b in range(buffers) if id(slot[b]) == given]
        if not outs and not ins:
            continue
        if len(outs) != 1 or len(ins) != 1 or (outs[0], ins[0]) not in pairs:
            return False
        found.add((j, outs[0]))
    return len(found) == 1


def _chunk(device: Device) -> int:
    """Elements a work-item updates: DENSE_CHUNK on a CPU (a core's vector loop), one vector
    on a GPU, where neighbouring work-items then read neighbouring memory and a model's
    parameters make thousands of work-items, not dozens (BENCHMARKS, session 36)."""
    return 8 if device.is_gpu else DENSE_CHUNK


def _group_kernel(name: str, chunk: int, group: int) -> str:
    """`name` over `group` parameters: slot j holds n{j} elements and starts at chunk o{j} of the
    launch; a work-item updates `chunk` elements of the last slot starting at or before it
    (an unused slot has n 0 and starts past the end). The slot's pointers are picked first and
    the update is inlined once: a copy per slot made the program ~0.1 s slower to build."""
    buffers, outputs, hyper = _OPTIMIZERS[name]
    params: list[str] = []
    for j in range(group):
        params += [f"__global {'' if b < outputs else 'const '}T* b{j}_{b}" for b in range(buffers)]
        params += [f"const long n{j}", f"const long o{j}"]
    params += [f"const T {h}" for h in hyper] + ["const int fresh"]
    decls = "".join(f"  __global {'' if b < outputs else 'const '}T* q{b};\n"
                    for b in range(buffers))
    cases = "".join(
        f"    case {j}: {' '.join(f'q{b} = b{j}_{b};' for b in range(buffers))} "
        f"n = n{j}; o = o{j}; break;\n" for j in range(group))
    pick = "".join(f"  if (c >= o{j}) s = {j};\n" for j in range(1, group))
    qs = ", ".join(f"q{b}" for b in range(buffers))
    # Work-items past the end pick the last slot and find no elements of it left.
    return (f"__kernel void {name}{group}({', '.join(params)}) {{\n"
            f"  const long c = get_global_id(0);\n  int s = 0;\n{pick}{decls}  long n, o;\n"
            f"  switch (s) {{\n{cases}    default: return;\n  }}\n"
            f"  {name}_one({qs}, {', '.join(hyper)}, fresh, (c - o) * {chunk}, "
            f"min(n, (c - o + 1) * {chunk}));\n}}\n")


def _source(dtype: DType, chunk: int) -> str:
    kernels = "".join(_group_kernel(name, chunk, group) for name in _OPTIMIZERS
                      for group in GROUPS)
    return (f"{fp64_pragma(dtype)}typedef {C_TYPES[dtype]} T;\n{_VECTORS[dtype.itemsize]}"
            f"{DENSE_PRELUDE}{_UPDATES}{kernels}")


def _kernel(device: Device, dtype: DType, name: str, group: int) -> cl.Kernel:
    """The kernel of `name` over `group` parameters. Not a core family: the optimizers' program
    is built at the first update, so a cold forward and backward (and a program that never
    trains) builds less."""
    chunk = _chunk(device)
    variant = dtype_name(dtype) + ("" if chunk == DENSE_CHUNK else f" chunk {chunk}")
    return device.kernel("optim", variant, f"{name}{group}", lambda: _source(dtype, chunk))


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _run(name: str, ps: list[AnyTensor], operands: list[list[AnyTensor]], hyper: list[float],
         fresh: bool) -> list[list[AnyTensor]]:
    """Apply optimizer `name` to every parameter: `operands[k]` are parameter k's inputs (after
    the parameter itself). Returns each parameter's fresh outputs (new parameter first)."""
    count, outputs, _ = _OPTIMIZERS[name]
    outs: list[list[AnyTensor]] = [[] for _ in ps]
    on: dict[Device, list[int]] = {}
    for k, p in enumerate(ps):
        on.setdefault(p.device, []).append(k)
    for device, ks in on.items():  # every output buffer of a device at once (a GPT's ~100)
        made = iter(device.allocate_many([ps[k].nbytes for k in ks for _ in range(outputs)]))
        for k in ks:
            p = ps[k]
            outs[k] = [tensor(next(made), p.shape, p.dtype, device) for _ in range(outputs)]
    groups: dict[tuple[Device, DType], list[int]] = {}
    for k, p in enumerate(ps):
        if p.size:
            groups.setdefault((p.device, p.dtype), []).append(k)
    for (device, dtype), ks in groups.items():
        chunk = _chunk(device)
        # The inputs' buffers at once: gradients clipped by one norm are one forward to force.
        assert all(1 + len(operands[k]) == count - outputs for k in ks)
        ins = dict(zip(ks, _chunks(buffers_of([t for k in ks for t in (ps[k], *operands[k])]),
                                   count - outputs), strict=True))
        for start in range(0, len(ks), GROUP):
            group = ks[start:start + GROUP]
            size = next(size for size in GROUPS if size >= len(group))
            total = sum(-(-ps[k].size // chunk) for k in group)
            args: list[Any] = []
            first = 0
            for j in range(size):
                k = group[j] if j < len(group) else group[0]
                args += [t.buffer for t in outs[k]]
                args += ins[k]
                if j < len(group):
                    args += [ps[k].size, first]
                    first += -(-ps[k].size // chunk)
                else:  # unused: no elements, starting past the end
                    args += [0, total]
            # Every buffer of a slot holds its parameter's bytes: the most is the group's.
            largest = max(ps[k].nbytes for k in group)
            device.launch(_kernel(device, dtype, name, size), launch_size(total), (LOCAL,),
                          *args, *hyper, int(fresh), largest=largest)
    return outs


def _pairs(params: Any, grads: Any, op: str
           ) -> tuple[list[AnyTensor], list[AnyTensor], PyTreeSpec]:
    """The params' leaves as tensors, the grads' leaves matched to them (dicts by key), and
    the params' structure. Where the two differ, the error names the first place."""
    p_flat, spec = flatten(params)
    g_flat = match(grads, spec, params, op, "grads", "params")
    ps: list[AnyTensor] = []
    gs: list[AnyTensor] = []
    for k, (p, g) in enumerate(zip(p_flat, g_flat, strict=True)):
        p = _tensor(p, op, "params", spec, k, None)
        if not is_float(p.dtype):
            raise DTypeError(at_site(
                f"{op}: params{leaf_path(spec, k)} is {p.dtype}, not a float dtype"))
        ps.append(p)
        gs.append(_matching(g, p, op, "grads", spec, k))
    return ps, gs, spec


def _tensor(t: Any, op: str, name: str, spec: PyTreeSpec, k: int, device: Device | None
            ) -> AnyTensor:
    """Leaf `k` of the tree `name` (whose structure is `spec`) as a tensor: an AnyTensor, or an
    array uploaded; anything else is an error naming it by its key path."""
    if isinstance(t, AnyTensor):
        return t
    if not isinstance(t, np.ndarray | np.generic | float | int):
        path = leaf_path(spec, k)
        if t is not None and is_node(t):
            raise ShapeError(at_site(
                f"{op}: {name}{path} must be a tensor like params{path}, got {describe(t)}"))
        raise DTypeError(at_site(
            f"{op}: {name}{path} must be an AnyTensor or a numpy array, got {type(t).__name__}"))
    return AnyTensor.from_numpy(t, device)


def _matching(t: Any, p: AnyTensor, op: str, name: str, spec: PyTreeSpec, k: int) -> AnyTensor:
    """Leaf `k` of the tree `name` as a tensor with p's shape, dtype and device, or an error
    saying which differs.

    Kernels trust these: a state or gradient of the wrong size would be read past its end."""
    t = _tensor(t, op, name, spec, k, p.device)
    if t.device is not p.device or t.shape != p.shape or t.dtype != p.dtype:
        what = f"{name}{leaf_path(spec, k)}"
        if t.device is not p.device:
            raise DeviceError(at_site(
                f"{op}: {what} is on {t.device!r}, the param on {p.device!r}"))
        if t.shape != p.shape:
            raise ShapeError(at_site(f"{op}: {what} has shape {t.shape}, the param {p.shape}"))
        raise DTypeError(at_site(f"{op}: {what} is {t.dtype}, the param {p.dtype}"))
    return t


def _fresh(state: Any) -> bool:
    """Whether `state` starts the optimizer afresh: None or an empty dict (not a truth test,
    which of a tensor given by mistake would read it)."""
    return state is None or (isinstance(state, dict) and not state)


def _state(state: Any, keys: tuple[str, ...], params: Any, spec: PyTreeSpec,
           ps: list[AnyTensor], op: str) -> list[list[AnyTensor]]:
    """The per-parameter leaves of each state entry, checked against the params (whose
    structure is `spec`)."""
    if not isinstance(state, dict) or not set(keys) <= set(cast(dict[str, Any], state)):
        wrong = ShapeError if isinstance(state, dict) else DTypeError
        got = cast(object, state)
        given = (f", got {shown(got)}: the hyperparameters are keywords ({op}(params, grads, "
                 f"state, lr=...))" if isinstance(got, int | float) else
                 f", got {type(got).__name__}")
        raise wrong(at_site(
            f"{op}: state must be None or the dict {op} returned (keys {', '.join(keys)})"
            + given))
    entries = cast(dict[str, Any], state)
    out: list[list[AnyTensor]] = []
    for key in keys:
        name = f"state[{key!r}]"
        leaves = match(entries[key], spec, params, op, name, "params")
        out.append([_matching(t, p, op, name, spec, k)
                    for k, (t, p) in enumerate(zip(leaves, ps, strict=True))])
    return out


def _numbers(op: str, **values: Any) -> None:
    for name, v in values.items():
        number(op, name, v)


def _in_range(op: str, name: str, v: float, lo: float, hi: float, hi_open: bool = False
              ) -> None:
    """PyTorch's checks on hyperparameters (a NaN fails them too)."""
    if not (lo <= v and (v < hi if hi_open else v <= hi)):
        bounds = f"[{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ShapeError(at_site(f"{op}: {name} must be in {bounds}, got {shown(v)}"))


def sgd(params: Any, grads: Any, state: Any = None, *, lr: float, momentum: float = 0.0,
        weight_decay: float = 0.0) -> tuple[Any, dict[str, Any]]:
    """One SGD step: `d = g + weight_decay * p; buf = momentum * buf + d; p -= lr * buf`."""
    _numbers("sgd", lr=lr, momentum=momentum, weight_decay=weight_decay)
    for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        _in_range("sgd", name, v, 0.0, math.inf)
    ps, gs, spec = _pairs(params, grads, "sgd")
    fresh = _fresh(state)
    bufs = gs if fresh else _state(state, ("momentum",), params, spec, ps, "sgd")[0]
    outs = _run("sgd", ps, [[g, b] for g, b in zip(gs, bufs, strict=True)],
                [lr, momentum, weight_decay], fresh)
    return spec.unflatten([o[0] for o in outs]), {
        "momentum": spec.unflatten([o[1] for o in outs])}


def adam(params: Any, grads: Any, state: Any = None, *, lr: float = 1e-3, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, dict[str, Any]]:
    """One Adam step with bias correction (PyTorch's `torch.optim.Adam` without weight decay)."""
    _numbers("adam", lr=lr, b1=b1, b2=b2, eps=eps)
    _in_range("adam", "lr", lr, 0.0, math.inf)
    _in_range("adam", "eps", eps, 0.0, math.inf)
    _in_range("adam", "b1", b1, 0.0, 1.0, hi_open=True)
    _in_range("adam", "b2", b2, 0.0, 1.0, hi_open=True)
    ps, gs, spec = _pairs(params, grads, "adam")
    if not _fresh(state):
        ms, vs = _state(state, ("m", "v"), params, spec, ps, "adam")
        step = cast(dict[str, Any], state).get("step")
        if not is_integer(step) or step < 1:
            wrong = ShapeError if is_integer(step) else DTypeError
            raise wrong(at_site(f"adam: state['step'] must be a positive int, got {shown(step)}"))
        step = as_index(step) + 1
    else:
        step, ms, vs = 1, gs, gs  # not read: the kernel's `fresh` flag stands for zeros
    # b ** step for b < 1 is 0 in floats long before 2^30 steps: a larger int (restored state)
    # would not convert to a float
    # (as_float: float ** traced int would lose tg.jit's trace; the power is the same)
    power = as_float(min(step, 1 << 30))
    c1, c2 = 1.0 - b1 ** power, 1.0 - b2 ** power
    outs = _run("adam", ps, [[g, m, v] for g, m, v in zip(gs, ms, vs, strict=True)],
                [lr, b1, b2, eps, c1, c2], not state)
    return spec.unflatten([o[0] for o in outs]), {
        "step": step, "m": spec.unflatten([o[1] for o in outs]),
        "v": spec.unflatten([o[2] for o in outs])}
