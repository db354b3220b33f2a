"""Elementwise ops: each is a C expression, a VJP written with other primitives, and a doc.

Operands of one primitive have one shape (`broadcast.operands` broadcast them first) and one
float dtype; a Python scalar operand is a kernel argument of that dtype. The fused VJP helpers
(`relu_grad`, `tanh_grad`, `sigmoid_grad`, `abs_grad`, `gelu_grad`, `maximum_grad`...) are
primitives too, with VJPs of their own, so a recorded backward can be differentiated again.
`cast` (behind `astype`) is the one primitive here that changes dtype; `where` casts its integer
or bool condition to the float dtype with it, so every expression kernel still sees one type T.
(Comparisons, whose results are bool, have kernels of their own in `compare.py`.)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _fusion
from .._errors import (
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    NotAnIdError,
    ShapeError,
    TapeError,
    TapegradError,
    at_site,
    call_site,
    shown,
)
from .._fusion import FUSE_DEPTH, Pending, elementwise
from .._kernels import (
    ARG_NAMES,
    RARE_FAMILY,
    cast,
    constant,
    constant_value,
    expression,
    register_expression,
)
from .._primitive import Aval, EagerEmitter, Emitter, Primitive, Vjp, register
from .._tape import (
    Id,
    Node,
    Tape,
    append_computed,
    deferred_forward,
    defers,
    id_hint,
    nodes_of,
    not_a_tape,
    note_call,
    record,
    rename_device_error,
    takes_tape,
)
from .._tensor import (
    BOOL,
    FLOAT32,
    FLOATS,
    INTS,
    SUPPORTED,
    AnyTensor,
    DType,
    _TensorFields,
    dtype_name,
    is_float,
    keep_range,
)
from .._traced import TracedInt, as_float, is_integer
from .broadcast import Scalar, broadcast_pair, broadcast_shapes, broadcast_to, operands

# The rarer transcendental ops (sin, erf, softplus...) are a program of their own per dtype,
# built when one is first used: in the core they made every cold start's build longer. Being
# heavy (computed when made), they never fuse either way.
_RARE = RARE_FAMILY


def _make(name: str, arity: int, expr: str, vjp: Vjp[None] | None, doc: str,
          family: str = "elementwise", names: tuple[str, ...] = ARG_NAMES, helpers: str = "",
          builtin: bool = True) -> Primitive[None]:
    """Register the kernel expression and the primitive of one elementwise op.

    Custom ops (`tg.elementwise_op`) come through here too, with a program family of their own.
    """
    registered = register_expression(name, arity, expr, family, names, helpers)

    def rule(args: Sequence[Any], params: None) -> Aval:
        first = _shared(args)
        if first is None:  # no tensor, or two that differ: name the first pair
            tensors: list[Any] = [a for a in args if not isinstance(a, float)]
            for a in tensors[1:]:
                if a.shape != tensors[0].shape or a.dtype != tensors[0].dtype:
                    raise ShapeError(at_site(
                        f"{name}: operands must share shape and dtype after broadcasting; got "
                        f"{tensors[0].shape} {tensors[0].dtype} and {a.shape} {a.dtype}"))
        if len(args) != arity or first is None:
            raise ShapeError(f"{name}: takes {arity} operands, at least one a tensor")
        if first.dtype not in FLOATS:
            raise DTypeError(at_site(f"{name}: needs float operands, got {first.dtype}"))
        return Aval(first.shape, first.dtype)

    def forward(dev: Any, args: Sequence[Any], params: None, aval: Aval) -> AnyTensor:
        return elementwise(registered, args, aval.shape, aval.dtype, dev)

    def eager(dev: Any, args: Sequence[Any]) -> AnyTensor | None:
        """rule and forward at once, for operands that pass the rule's checks."""
        first = _shared(args)
        if first is None or len(args) != arity or first.dtype not in FLOATS:
            return None
        return elementwise(registered, args, first.shape, first.dtype, dev)

    def recorder(prim: Primitive[Any], tape: Any, args: Sequence[Any], skip: int
                 ) -> tuple[Tape, Id] | None:
        """`record_elementwise` for a float id and a number or an id like it (or one float id
        for a unary op); None for anything else, which `record` checks by the rule."""
        # Attribute reads and an unpacking, no builtin calls: this runs for every such op.
        if arity == 2:
            try:
                a, b = args
            except ValueError:
                return None
            if a.__class__ is Id and a.dtype in FLOATS:
                if b.__class__ is not float and (
                        b.__class__ is not Id or b.shape != a.shape or b.dtype is not a.dtype):
                    return None
            elif a.__class__ is not float or b.__class__ is not Id or b.dtype not in FLOATS:
                return None
        elif arity == 1:
            try:
                (a,) = args
            except ValueError:
                return None
            b = None
            if a.__class__ is not Id or a.dtype not in FLOATS:
                return None
        else:
            return None
        return record_elementwise(tape, prim, registered, a, b, skip + 1)

    return register(Primitive(name, rule, forward, vjp, doc, builtin, eager, recorder))


def _shared(args: Sequence[Any]) -> Any:
    """The first tensor of an elementwise primitive's operands if every tensor among them has
    its shape and dtype (the numbers are Python floats), else None."""
    first: Any = None
    for a in args:
        if not isinstance(a, float):
            if first is None:
                first = a
            elif a.shape != first.shape or a.dtype != first.dtype:
                return None
    return first


# --- VJPs ------------------------------------------------------------------------------------
# Each returns one cotangent per operand; a scalar operand's slot is ignored by the sweep.

def _add_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [g, g]


def _sub_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [g, e.apply(NEG, [g]) if needs[1] else None]


def _mul_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    a, b = args
    return [_times(e, g, b) if needs[0] else None, _times(e, g, a) if needs[1] else None]


def _times(e: Emitter, g: Any, c: Any) -> Any:
    """g * c. A constant g (a backward's seed) times a number is another constant, made without
    a kernel: the multiply is the one the kernel would do, in g's dtype (a mean's seed, 1/n)."""
    if c.__class__ is float and e.__class__ is EagerEmitter:
        value = constant_value(g)
        if value is not None:
            kind = g.dtype.type
            with np.errstate(all="ignore"):  # an overflow gives inf, as on the device
                product = float(kind(value) * kind(c))
            return constant(product, g.dtype, g.device)
    return e.apply(MUL, [g, c])


def _div_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    _, b = args
    ga = e.apply(DIV, [g, b]) if needs[0] else None
    gb = e.apply(NEG, [e.apply(DIV, [e.apply(MUL, [g, out]), b])]) if needs[1] else None
    return [ga, gb]


def _neg_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(NEG, [g])]


def _pow_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    a, b = args
    ga = gb = None
    if needs[0] and not (isinstance(b, float) and b == 0.0):
        # a ** 0 is 1 everywhere: no gradient, where b * a ** -1 would be 0 * inf = NaN at
        # a == 0 (PyTorch's gradient is 0 there too). This also ends the chain of
        # pow(a, b - 1) VJPs of a recorded sweep at an integer exponent.
        b_minus_1 = b - 1.0 if isinstance(b, float) else e.apply(ADD, [b, -1.0])
        ga = e.apply(MUL, [e.apply(MUL, [g, b]), e.apply(POW, [a, b_minus_1])])
        if not isinstance(b, float):  # the same per element: 0 where b == 0 (as PyTorch)
            ga = e.apply(WHERE, [b, ga, 0.0])
    if needs[1]:
        # d(a**b)/db = a**b * log(a); 0 where a == 0 and b >= 0, as PyTorch masks it (a ** b
        # is 0 or 1 there); at a == 0 and b < 0, inf * -inf = -inf, as PyTorch.
        gb = e.apply(MUL, [g, e.apply(POW_LOG, [out, a, b])])
    return [ga, gb]


def _pow_log_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    o, a, b = args
    # pow_log(o, a, b) is o * log(a), 0 where a == 0 and b >= 0: linear in o with that same
    # mask, flat in b. The base a may be a Python number (tg.pow(tape, 2.0, x)); the kernel
    # takes it as a scalar.
    go = e.apply(POW_LOG, [g, a, b]) if needs[0] else None
    ga = e.apply(DIV, [e.apply(MUL, [g, o]), a]) if needs[1] else None
    return [go, ga, None]


def _exp_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(MUL, [g, out])]


def _log_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(DIV, [g, args[0]])]


def _sqrt_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [e.apply(DIV, [g, e.apply(MUL, [out, 2.0])])]


def _tanh_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [e.apply(TANH_GRAD, [g, out])]


def _tanh_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    g, y = args  # tanh_grad(g, y) = g * (1 - y*y)
    gg = e.apply(TANH_GRAD, [h, y]) if needs[0] else None
    gy = e.apply(MUL, [e.apply(MUL, [h, g]), e.apply(MUL, [y, -2.0])]) if needs[1] else None
    return [gg, gy]


def _sigmoid_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    return [e.apply(SIGMOID_GRAD, [g, out])]


def _sigmoid_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                      needs: Sequence[bool]) -> list[Any]:
    g, y = args  # sigmoid_grad(g, y) = g * y * (1 - y)
    gg = e.apply(SIGMOID_GRAD, [h, y]) if needs[0] else None
    gy = None
    if needs[1]:
        gy = e.apply(MUL, [e.apply(MUL, [h, g]), e.apply(ADD, [e.apply(MUL, [y, -2.0]), 1.0])])
    return [gg, gy]


def _relu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    # The mask of x <= 0 is that of relu(x) <= 0 (-0.0 and NaN included), so a computed output
    # serves as well as x, and it is the one a layer's backward has just read (H^T g): its
    # input came from memory, 100-110 us against ~45 of an MLP step's 256 x 512 relu_grad.
    # A pending output would be recomputed inside the kernel: x then (one op fewer to walk).
    masked = out if isinstance(out, AnyTensor) and out.pending is None else args[0]
    return [e.apply(RELU_GRAD, [g, masked])]


def _relu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    # relu_grad(g, x) is linear in g with the mask of x, and flat in x almost everywhere.
    return [e.apply(RELU_GRAD, [h, args[1]]) if needs[0] else None, None]


def _abs_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(ABS_GRAD, [g, args[0]])]


def _abs_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                  needs: Sequence[bool]) -> list[Any]:
    # abs_grad(g, x) = g * sign(x): linear in g, flat in x away from 0.
    return [e.apply(ABS_GRAD, [h, args[1]]) if needs[0] else None, None]


# GELU's constants, written with enough digits for double; a float program rounds them once.
_SQRT1_2 = 0.70710678118654752440  # 1/sqrt(2)
_INV_SQRT_2PI = 0.39894228040143267794  # 1/sqrt(2*pi): the normal density's factor
_SQRT_2_OVER_PI = 0.79788456080286535588  # sqrt(2/pi): the tanh form's scale
_KAPPA = 0.044715  # the tanh form's cubic coefficient


def _gelu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [e.apply(GELU_GRAD, [g, args[0]])]


def _gelu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    # gelu_grad(g, x) = g * (Phi(x) + x * phi(x)); its x-derivative is g * phi(x) * (2 - x*x).
    g, x = args
    gg = e.apply(GELU_GRAD, [h, x]) if needs[0] else None
    gx = None
    if needs[1]:
        x2 = e.apply(MUL, [x, x])
        phi = e.apply(MUL, [e.apply(EXP, [e.apply(MUL, [x2, -0.5])]), _INV_SQRT_2PI])
        gx = e.apply(MUL, [e.apply(MUL, [h, g]), e.apply(MUL, [phi, e.apply(SUB, [2.0, x2])])])
    return [gg, gx]


def _gelu_tanh_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    return [e.apply(GELU_TANH_GRAD, [g, args[0]])]


def _gelu_tanh_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                        needs: Sequence[bool]) -> list[Any]:
    # With u = k (x + c x^3), t = tanh(u): gelu' = (1 + t)/2 + x (1 - t^2) u' / 2 and
    # gelu'' = (1 - t^2) (u' + 3 k c x^2 - x t u'^2), where u' = k (1 + 3 c x^2).
    g, x = args
    gg = e.apply(GELU_TANH_GRAD, [h, x]) if needs[0] else None
    gx = None
    if needs[1]:
        k, c = _SQRT_2_OVER_PI, _KAPPA
        x2 = e.apply(MUL, [x, x])
        cube = e.apply(MUL, [x, e.apply(ADD, [e.apply(MUL, [x2, c]), 1.0])])
        t = e.apply(TANH, [e.apply(MUL, [cube, k])])
        du = e.apply(MUL, [e.apply(ADD, [e.apply(MUL, [x2, 3.0 * c]), 1.0]), k])
        inner = e.apply(SUB, [e.apply(ADD, [du, e.apply(MUL, [x2, 3.0 * k * c])]),
                              e.apply(MUL, [e.apply(MUL, [x, t]), e.apply(MUL, [du, du])])])
        gx = e.apply(MUL, [e.apply(TANH_GRAD, [e.apply(MUL, [h, g]), t]), inner])
    return [gg, gx]


def _maximum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    a, b = args
    return [e.apply(MAXIMUM_GRAD, [g, a, b]) if needs[0] else None,
            e.apply(MAXIMUM_GRAD, [g, b, a]) if needs[1] else None]


def _minimum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    a, b = args  # a wins a minimum where b > a: maximum_grad with the operands swapped
    return [e.apply(MAXIMUM_GRAD, [g, b, a]) if needs[0] else None,
            e.apply(MAXIMUM_GRAD, [g, a, b]) if needs[1] else None]


def _maximum_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                      needs: Sequence[bool]) -> list[Any]:
    # Linear in g with a mask of (a, b), flat in a and b away from ties.
    _, a, b = args
    return [e.apply(MAXIMUM_GRAD, [h, a, b]) if needs[0] else None, None, None]


def _where_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
               needs: Sequence[bool]) -> list[Any]:
    c = args[0]  # the condition takes no gradient
    return [None,
            e.apply(WHERE, [c, g, 0.0]) if needs[1] else None,
            e.apply(WHERE, [c, 0.0, g]) if needs[2] else None]


def _clip_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    x, lo, hi = args
    if isinstance(lo, float) and isinstance(hi, float) and lo > hi:
        return [None, None, None]  # every element is hi: no x lies in [lo, hi]
    # Inside [lo, hi] (inclusive) clip copies x exactly, so out == x marks where g passes.
    return [e.apply(CLIP_GRAD, [g, x, out]), None, None]


def _clip_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    _, x, y = args
    return [e.apply(CLIP_GRAD, [h, x, y]) if needs[0] else None, None, None]


def _mul_exp_sub_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                     needs: Sequence[bool]) -> list[Any]:
    _, b, c = args  # out = a * exp(b - c)
    ga = e.apply(MUL_EXP_SUB, [h, b, c]) if needs[0] else None
    hout = e.apply(MUL, [h, out]) if needs[1] or needs[2] else None
    return [ga, hout if needs[1] else None, e.apply(NEG, [hout]) if needs[2] else None]


def _log1p_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
               needs: Sequence[bool]) -> list[Any]:
    return [e.apply(DIV, [g, e.apply(ADD, [args[0], 1.0])])]


def _expm1_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
               needs: Sequence[bool]) -> list[Any]:
    return [e.apply(MUL, [g, e.apply(ADD, [out, 1.0])])]  # PyTorch's grad * (result + 1)


def _sin_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(MUL, [g, e.apply(COS, [args[0]])])]


def _cos_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [e.apply(MUL, [g, e.apply(NEG, [e.apply(SIN, [args[0]])])])]


_TWO_OVER_SQRT_PI = 1.12837916709551257390  # 2/sqrt(pi): erf's derivative at 0


def _erf_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    x = args[0]  # 2/sqrt(pi) * exp(-x^2) * g, in PyTorch's order
    density = e.apply(MUL, [e.apply(EXP, [e.apply(NEG, [e.apply(MUL, [x, x])])]),
                            _TWO_OVER_SQRT_PI])
    return [e.apply(MUL, [density, g])]


def _silu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [e.apply(SILU_GRAD, [g, args[0]])]


def _silu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    # silu_grad(g, x) = g * s (1 + x (1 - s)), s = sigmoid(x): linear in g; in x, g times
    # s' (1 + x (1 - s)) + s ((1 - s) - x s'), s' = s (1 - s), made of primitives so that it
    # can be differentiated again.
    g, x = args
    gg = e.apply(SILU_GRAD, [h, x]) if needs[0] else None
    gx = None
    if needs[1]:
        s = e.apply(SIGMOID, [x])
        rest = e.apply(SUB, [1.0, s])
        ds = e.apply(MUL, [s, rest])
        curve = e.apply(ADD, [
            e.apply(MUL, [ds, e.apply(ADD, [e.apply(MUL, [x, rest]), 1.0])]),
            e.apply(MUL, [s, e.apply(SUB, [rest, e.apply(MUL, [x, ds])])])])
        gx = e.apply(MUL, [e.apply(MUL, [h, g]), curve])
    return [gg, gx]


# PyTorch's softplus (beta=1) is x itself above this threshold, where log1p(exp(x)) rounds to x.
_SOFTPLUS_THRESHOLD = 20.0


def _softplus_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                  needs: Sequence[bool]) -> list[Any]:
    return [e.apply(SOFTPLUS_GRAD, [g, args[0]])]


def _softplus_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                       needs: Sequence[bool]) -> list[Any]:
    # softplus_grad(g, x) is linear in g; in x it is g * sigmoid'(x) below the threshold and
    # flat above it. PyTorch masks its double backward with x < 20 (0 at exactly 20, and NaN
    # kept): relu_grad of (20 - x) passes exactly there.
    g, x = args
    gg = e.apply(SOFTPLUS_GRAD, [h, x]) if needs[0] else None
    gx = None
    if needs[1]:
        curve = e.apply(SIGMOID_GRAD, [e.apply(MUL, [h, g]), e.apply(SIGMOID, [x])])
        gx = e.apply(RELU_GRAD, [curve, e.apply(SUB, [_SOFTPLUS_THRESHOLD, x])])
    return [gg, gx]


def _leaky_relu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                    needs: Sequence[bool]) -> list[Any]:
    x, slope = args
    return [e.apply(LEAKY_RELU_GRAD, [g, x, slope]), None]


def _leaky_relu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                         needs: Sequence[bool]) -> list[Any]:
    # Linear in g with the mask of x; flat in x away from 0.
    _, x, slope = args
    return [e.apply(LEAKY_RELU_GRAD, [h, x, slope]) if needs[0] else None, None, None]


def _elu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    x, alpha = args
    return [e.apply(ELU_GRAD, [g, x, alpha]), None]


def _elu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                  needs: Sequence[bool]) -> list[Any]:
    # elu_grad(g, x) is linear in g; in x it is g * alpha * exp(x) below 0 and flat above.
    # PyTorch masks its double backward with x < 0 (0 at 0 and -0, NaN kept): relu_grad of -x.
    g, x, alpha = args
    gg = e.apply(ELU_GRAD, [h, x, alpha]) if needs[0] else None
    gx = None
    if needs[1]:
        curve = e.apply(MUL, [e.apply(MUL, [h, g]), e.apply(MUL, [e.apply(EXP, [x]), alpha])])
        gx = e.apply(RELU_GRAD, [curve, e.apply(NEG, [x])])
    return [gg, gx, None]


ADD = _make("add", 2, "a + b", _add_vjp, "a + b")
SUB = _make("sub", 2, "a - b", _sub_vjp, "a - b")
MUL = _make("mul", 2, "a * b", _mul_vjp, "a * b")
DIV = _make("div", 2, "a / b", _div_vjp, "a / b")
NEG = _make("neg", 1, "-a", _neg_vjp, "-a")
POW = _make("pow", 2, "tg_pow(a, b)", _pow_vjp, "a ** b (real-valued: NaN for a < 0 with a "
            "non-integer b, as in C and PyTorch)")
POW_LOG = _make("pow_log", 3, "b == (T)0 && c >= (T)0 ? (T)0 : a * log(b)", _pow_log_vjp,
                "out * log(a), 0 where a == 0 and b >= 0: the exponent's derivative of a ** b")
EXP = _make("exp", 1, "exp(a)", _exp_vjp, "e ** a")
LOG = _make("log", 1, "log(a)", _log_vjp, "natural logarithm")
SQRT = _make("sqrt", 1, "tg_sqrt(a)", _sqrt_vjp, "square root")
TANH = _make("tanh", 1, "tg_tanh(a)", _tanh_vjp,
             "hyperbolic tangent (1 where it rounds to 1: see _kernels._PRELUDE)")
TANH_GRAD = _make("tanh_grad", 2, "a * ((T)1 - b * b)", _tanh_grad_vjp,
                  "g * (1 - y*y): the VJP of tanh from its output y, fused")
SIGMOID = _make("sigmoid", 1, "tg_sigmoid(a)", _sigmoid_vjp, "1 / (1 + e ** -a), stable both ways")
SIGMOID_GRAD = _make("sigmoid_grad", 2, "a * b * ((T)1 - b)", _sigmoid_grad_vjp,
                     "g * y * (1 - y): the VJP of sigmoid from its output y, fused")
RELU = _make("relu", 1, "a < (T)0 ? (T)0 : a", _relu_vjp, "max(a, 0); gradient 0 at 0, as "
             "PyTorch; NaN stays NaN, with the gradient passed, as PyTorch")
RELU_GRAD = _make("relu_grad", 2, "b <= (T)0 ? (T)0 : a", _relu_grad_vjp,
                  "g where x > 0 or x is NaN, else 0: the VJP of relu, fused")
# A float mask for VJPs (max's ties); the public `equal` (in compare.py) gives a bool id.
EQUAL = _make("equal_mask", 2, "a == b ? (T)1 : (T)0", None,
              "1 where a == b else 0 (a float mask; no gradient)")

# Not fabs: a library call per element in PoCL. a + 0 makes -0 +0; a NaN
# (of either sign) gives NAN, positive, as fabs and numpy clear the sign.
ABS = _make("abs", 1, "a < (T)0 ? -a : (a == a ? a + (T)0 : (T)NAN)", _abs_vjp,
            "|a|; gradient sign(a), 0 at 0, as PyTorch")
ABS_GRAD = _make("abs_grad", 2, "b > (T)0 ? a : (b < (T)0 ? -a : a * (T)0)", _abs_grad_vjp,
                 "g * sign(x), g * 0 at 0 and NaN (an infinite g gives NaN there, as "
                 "PyTorch): the VJP of abs, fused")
GELU = _make("gelu", 1, f"(T)0.5 * a * ((T)1 + tg_erf(a * (T){_SQRT1_2!r}))", _gelu_vjp,
             "x * Phi(x), Phi the standard normal CDF (the exact erf form)")
GELU_GRAD = _make(
    "gelu_grad", 2,
    f"a * ((T)0.5 * ((T)1 + tg_erf(b * (T){_SQRT1_2!r}))"
    f" + b * exp((T)-0.5 * b * b) * (T){_INV_SQRT_2PI!r})",
    _gelu_grad_vjp, "g * (Phi(x) + x * phi(x)): the VJP of the exact gelu, fused")
_GELU_TANH_T = f"tg_tanh((T){_SQRT_2_OVER_PI!r} * (b + (T){_KAPPA!r} * b * b * b))"
GELU_TANH = _make(
    "gelu_tanh", 1,
    f"(T)0.5 * a * ((T)1 + tg_tanh((T){_SQRT_2_OVER_PI!r} * (a + (T){_KAPPA!r} * a * a * a)))",
    _gelu_tanh_vjp, "x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): gelu's tanh form")
GELU_TANH_GRAD = _make(
    "gelu_tanh_grad", 2,
    f"a * ((T)0.5 * ((T)1 + {_GELU_TANH_T}) + (T)0.5 * b * ((T)1 - {_GELU_TANH_T} * "
    f"{_GELU_TANH_T}) * (T){_SQRT_2_OVER_PI!r} * ((T)1 + (T){3 * _KAPPA!r} * b * b))",
    _gelu_tanh_grad_vjp, "g * d/dx gelu_tanh(x): the VJP of gelu's tanh form, fused")
# NaN propagates from either side, as torch.maximum/minimum (C's fmax would drop it); a != a
# tests for it in the vector lanes (PoCL's isnan is a library call per element).
MAXIMUM = _make("maximum", 2, "(a >= b || a != a) ? a : b", _maximum_vjp,
                "the larger of a and b, NaN if either is NaN; ties split the gradient")
MINIMUM = _make("minimum", 2, "(a <= b || a != a) ? a : b", _minimum_vjp,
                "the smaller of a and b, NaN if either is NaN; ties split the gradient")
# Where either is NaN the result is NaN and both operands take the whole gradient, as in
# PyTorch (its masks, a == b and a < b, are false there).
MAXIMUM_GRAD = _make("maximum_grad", 3, "b < c ? (T)0 : (b == c ? a * (T)0.5 : a)",
                     _maximum_grad_vjp,
                     "g where b > c or either is NaN, g/2 where b == c, else 0: b's share of "
                     "maximum(b, c), fused (minimum's VJP swaps b and c)")
WHERE = _make("where", 3, "a != (T)0 ? b : c", _where_vjp,
              "b where a is nonzero else c (a is the condition, cast to the float dtype)")
# min(max(x, lo), hi), as numpy and PyTorch: every element is hi when lo > hi; NaN stays NaN.
CLIP = _make("clip", 3, "(a < b ? b : a) > c ? c : (a < b ? b : a)", _clip_vjp,
             "x limited to [lo, hi] (scalars; +-inf for no bound); gradient where lo <= x <= hi")
CLIP_GRAD = _make("clip_grad", 3, "b == c ? a : (T)0", _clip_grad_vjp,
                  "g where x == clip(x) (inside [lo, hi], inclusive) else 0: the VJP of clip")
MUL_EXP_SUB = _make("mul_exp_sub", 3, "a * exp(b - c)", _mul_exp_sub_vjp,
                    "a * exp(b - c), fused: softmax as exp(x - lse), and logsumexp's VJP")

# More elementwise ops (PyTorch's semantics, each noted at its public function).
LOG1P = _make("log1p", 1, "log1p(a)", _log1p_vjp, "log(1 + a), accurate for small a",
              _RARE)
EXPM1 = _make("expm1", 1, "expm1(a)", _expm1_vjp, "e ** a - 1, accurate for small a", _RARE)
SIN = _make("sin", 1, "tg_sin(a)", _sin_vjp, "sine", _RARE)
COS = _make("cos", 1, "tg_cos(a)", _cos_vjp, "cosine", _RARE)
ERF = _make("erf", 1, "tg_erf(a)", _erf_vjp, "the error function", _RARE)
SILU = _make("silu", 1, "a * tg_sigmoid(a)", _silu_vjp, "a * sigmoid(a)", _RARE)
# PyTorch's g * s * (1 + x * (1 - s)) in one kernel: as primitives it was a sigmoid kernel and
# a fused one (the same operations in the same order, so the same values).
SILU_GRAD = _make("silu_grad", 2, "a * tg_silu_slope(b)",
                  _silu_grad_vjp, "g * s * (1 + x * (1 - s)), s = sigmoid(x): the VJP of silu, "
                  "fused (NaN at x = +-inf, as PyTorch's: inf * 0)", _RARE)
SOFTPLUS = _make("softplus", 1, f"a > (T){_SOFTPLUS_THRESHOLD!r} ? a : log1p(exp(a))",
                 _softplus_vjp, "log(1 + e ** a), a itself above 20 (PyTorch's threshold)",
                 _RARE)
SOFTPLUS_GRAD = _make("softplus_grad", 2,
                      f"b > (T){_SOFTPLUS_THRESHOLD!r} ? a : a * tg_sigmoid(b)",
                      _softplus_grad_vjp,
                      "g * sigmoid(x), g above 20: the VJP of softplus, fused", _RARE)
LEAKY_RELU = _make("leaky_relu", 2, "a > (T)0 ? a : a * b", _leaky_relu_vjp,
                   "a where a > 0 else a * b (b the negative slope, a number)")
LEAKY_RELU_GRAD = _make("leaky_relu_grad", 3, "b > (T)0 ? a : a * c", _leaky_relu_grad_vjp,
                        "g where x > 0 else g * slope (at 0 and NaN too, as PyTorch): the VJP "
                        "of leaky_relu, fused")
ELU = _make("elu", 2, "a > (T)0 ? a : b * expm1(a)", _elu_vjp,
            "a where a > 0 else b * (e ** a - 1) (b is alpha, a number)", _RARE)
ELU_GRAD = _make("elu_grad", 3, "b > (T)0 ? a : a * c * exp(b)", _elu_grad_vjp,
                 "g where x > 0 else g * alpha * e ** x (at 0 and NaN too, as PyTorch): the VJP "
                 "of elu, fused", _RARE)


# --- dtype casts ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CastParams:
    dtype: DType


def _cast_rule(args: Sequence[Any], p: CastParams) -> Aval:
    (x,) = args
    for what, dtype in (("x", x.dtype), ("the target dtype", p.dtype)):
        if dtype not in SUPPORTED:
            raise DTypeError(at_site(
                f"astype: {what} is {dtype}; tapegrad holds float32, float64, int32, int64 and "
                "bool"))
    return Aval(x.shape, p.dtype)


def _cast_forward(dev: Any, args: Sequence[AnyTensor], p: CastParams, aval: Aval) -> AnyTensor:
    return keep_range(cast(args[0], p.dtype), args[0])


def _cast_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: CastParams,
              needs: Sequence[bool]) -> list[Any]:
    source: DType = args[0].dtype
    if not (is_float(source) and is_float(p.dtype)):
        return [None]  # integers and bools take no gradient
    return [g if g.dtype == source else e.apply(CAST, [g], CastParams(source))]


CAST: Primitive[CastParams] = register(Primitive(
    "cast", _cast_rule, _cast_forward, _cast_vjp,
    doc="Convert to another dtype (C's conversions: float to int truncates toward zero, "
        "anything to bool is != 0); between floats the VJP casts the cotangent back."))


# --- the public ops --------------------------------------------------------------------------

# Numbers an op takes beside ids: Python's, and numpy's scalars (converted to Python's).
Number = Scalar | np.floating[Any] | np.integer[Any] | np.bool_
Operand = Id | Number


# Ints from here on have no float: they round to 2 ** 1024, and float() overflows.
_INT_FLOATS = 2 ** 1024 - 2 ** 970


def _fits_a_float(op: str, what: str, v: int) -> None:
    if not -_INT_FLOATS < v < _INT_FLOATS:
        raise DTypeError(at_site(
            f"{op}: argument {what} is an int too large for a float ({len(str(v).lstrip('-'))} "
            "digits)"))


def number(op: str, name: str, v: object) -> Id | Scalar:
    """An operand that is an Id or a number: numpy scalars become Python numbers (they never
    change an id's dtype, as Python numbers); anything else is a DTypeError naming `name`."""
    if isinstance(v, Id | float | int | TracedInt):  # bool is an int
        if is_integer(v):  # a jitted step's int argument too: kept an int, traced
            _fits_a_float(op, repr(name), v)
        operand: Any = v  # a traced int is a Scalar to every op
        return operand
    value: Any = v  # narrowing numpy's generic types would leave them partially unknown
    kind: str = value.dtype.kind if isinstance(v, np.generic) else ""
    if kind and kind in "biuf":
        return bool(value) if kind == "b" else int(value) if kind in "iu" else float(value)
    kind_name: str = type(value).__name__
    hint = id_hint(value, "make arrays into ids with tg.leaf" if isinstance(
        v, np.ndarray | list | tuple) else "pass an Id from this tape or a Python number")
    raise NotAnIdError(at_site(
        f"{op}: argument {name!r} must be an Id or a Python number, not {kind_name} ({hint})"))


def record_elementwise(tape: Tape, prim: Primitive[Any], expr: Any, a: Any, b: Any,
                       site_skip: int) -> tuple[Tape, Id]:
    """The elementwise primitives' recorder (`Primitive.recorder`, which `record` tries first),
    for operands that passed the rule's checks: an id and None (unary), an id and a number
    (either way round) or two ids. ~1 us an op under `record`'s generality (its loop over any
    operands, the rule's aval, the forward wrapper). `expr` is the op's registered
    expression; the node is made as `record` makes it."""
    nodes, length = nodes_of(tape, prim.name)
    depth, requires_grad = 0, False  # the operands' longest pending chain (see _fusion)
    node: Node | None
    p: Any
    pa: Any = None  # the operands' recipes, if pending: their `uses` count this node
    pb: Any = None
    deferred_operand = False  # an operand's forward is deferred (see `_tape.defers`)
    if a.__class__ is Id:
        first: Id = a  # the value's shape and dtype are this id's
        index: int = a.index
        node = nodes[index] if index < length else None
        if node is None or node.id._uid != a._uid:
            node = tape.node(a, prim.name, ("a", "x")[b is None])
        va, requires_grad = node.value, node.requires_grad
        # The thunk first: a thread forcing it sets its recipe before it clears the thunk.
        deferred_operand = va.thunk is not None
        p = pa = va.pending
        if p is not None:
            depth = p.depth
    else:
        first, va = b, a
    if b.__class__ is Id:
        index = b.index
        node = nodes[index] if index < length else None
        if node is None or node.id._uid != b._uid:
            node = tape.node(b, prim.name, "b")
        vb, requires_grad = node.value, requires_grad or node.requires_grad
        if vb.thunk is not None:
            deferred_operand = True
        p = pb = vb.pending
        if p is not None and p.depth > depth:
            depth = p.depth
    else:
        vb = b
    if b is None:
        values: tuple[Any, ...] = (va,)
        args: tuple[Any, ...] = (a,)
        parents: tuple[Id, ...] = args
    else:
        values, args = (va, vb), (a, b)
        parents = args if a is first and b.__class__ is Id else (first,)
    shape = first.shape
    if (expr.fuses and depth < FUSE_DEPTH and _fusion.build_on_sighting and 0 not in shape
            and not deferred_operand):
        # `_fusion.elementwise`'s common case inline (a pending value, its operands short of
        # the depth limit): ~0.2 us an op of the call and its loop over the operands.
        value: Any = _TensorFields(None, shape, first.dtype, tape.device,
                                   Pending(expr, values, depth + 1))
        value.__class__ = AnyTensor
        if pa is not None:
            pa.uses += 1
        if pb is not None:
            pb.uses += 1
    elif prim.builtin and defers(first.dtype, math.prod(shape), values):
        # Over a deferred operand (a pending recipe never holds one), or a heavy op's kernel.
        site = call_site(site_skip)
        try:
            value = deferred_forward(prim, tape.device, values, None, Aval(shape, first.dtype),
                                     site)
        except DeviceError as err:
            rename_device_error(err, prim.name)
        return append_computed(tape, prim, args, parents, value, requires_grad, site)
    else:
        try:
            value = elementwise(expr, values, shape, first.dtype, tape.device)
        except DeviceError as err:
            rename_device_error(err, prim.name)
    return append_computed(tape, prim, args, parents, value, requires_grad, call_site(site_skip))


class _Missing:
    """What an elementwise op's operand is where the call left it out (`_missing_defaults`)."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def _left_out(op: str, tape: object, names: tuple[str, ...],
              given: tuple[object, ...]) -> TapegradError:
    """The error for an elementwise op called with too few arguments: the tape forgotten
    (`tg.relu(x)`, PyTorch's habit), or an operand."""
    call = f"tape, y = tg.{op}(tape, {', '.join(names)})"
    if tape.__class__ is not Tape:
        return TapeError(at_site(
            f"{op}: called without the tape: the first argument must be the tape (a tg.Tape), "
            f"then {' and '.join(names)}; call it as {call}"))
    missing = [name for name, value in zip(names, given, strict=True) if value is _MISSING]
    return ArgumentTypeError(at_site(
        f"{op}: argument {missing[0]!r} is missing: call it as {call}"))


# The frames from `record_elementwise` up to the user's call, all tapegrad's: itself,
# _binary or _unary, and the public op (add, relu...) that called it.
_DIRECT = 3


def _binary(tape: Tape, prim: Primitive[None], a: Operand, b: Operand) -> tuple[Tape, Id]:
    # The common case first: an id and a Python float, or two float ids of one shape and dtype
    # (or a broadcast pair), straight to `record_elementwise`. Anything else takes the
    # path below, which converts numbers, broadcasts, and names the problem. (Exact types: a
    # numpy float64 is a float too, but goes through `number`.)
    if type(a) is Id and a.dtype in FLOATS:
        if type(b) is float:
            return record_elementwise(tape, prim, expression(prim.name), a, b, _DIRECT)
        if type(b) is Id and b.dtype is a.dtype:
            if b.shape == a.shape:
                return record_elementwise(tape, prim, expression(prim.name), a, b, _DIRECT)
            broadcast = broadcast_pair(tape, a, b, 1)
            if broadcast is not None:
                result = record_elementwise(broadcast[0], prim, expression(prim.name),
                                            broadcast[1], broadcast[2], _DIRECT)
                note_call(prim.name, tape, result)  # with the broadcasts it recorded
                return result
        elif type(b) is int and -_INT_FLOATS < b < _INT_FLOATS:
            return record_elementwise(tape, prim, expression(prim.name), a, float(b), _DIRECT)
    elif type(b) is Id and b.dtype in FLOATS:
        if type(a) is float:
            return record_elementwise(tape, prim, expression(prim.name), a, b, _DIRECT)
        if type(a) is int and -_INT_FLOATS < a < _INT_FLOATS:  # 1 - z
            return record_elementwise(tape, prim, expression(prim.name), float(a), b, _DIRECT)
    if a is _MISSING or b is _MISSING:
        raise _left_out(prim.name, tape, ("a", "b"), (a, b))
    if tape.__class__ is not Tape:  # not @takes_tape: its call costs more than the fast path
        raise not_a_tape(prim.name, tape)
    a, b = number(prim.name, "a", a), number(prim.name, "b", b)
    if not isinstance(a, Id) and not isinstance(b, Id):
        raise NotAnIdError(at_site(
            f"{prim.name}: a and b are both numbers ({shown(a)}, {shown(b)}); at least one must "
            "be an Id (make one with tg.leaf)"))
    before = tape
    tape, args = operands(tape, prim.name, [a, b], ["a", "b"])
    result = record(tape, prim, args)
    note_call(prim.name, before, result)  # with the broadcasts it recorded
    return result


def _unary(tape: Tape, prim: Primitive[None], x: Id) -> tuple[Tape, Id]:
    if type(x) is Id and x.dtype in FLOATS:  # the common case (see _binary)
        return record_elementwise(tape, prim, expression(prim.name), x, None, _DIRECT)
    if x is _MISSING:
        raise _left_out(prim.name, tape, ("x",), (x,))
    if tape.__class__ is not Tape:
        raise not_a_tape(prim.name, tape)
    if not isinstance(x, Id):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise NotAnIdError(at_site(
            f"{prim.name}: argument 'x' must be an Id, not {type(x).__name__} ("
            f"{id_hint(x, 'make arrays and numbers into ids with tg.leaf')})"))
    tape, args = operands(tape, prim.name, [x], ["x"])
    return record(tape, prim, args)


def add(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a + b, broadcasting by numpy's rules; either may be a Python scalar."""
    return _binary(tape, ADD, a, b)


def sub(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a - b, broadcasting."""
    return _binary(tape, SUB, a, b)


def mul(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a * b, broadcasting."""
    return _binary(tape, MUL, a, b)


def div(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a / b, broadcasting."""
    return _binary(tape, DIV, a, b)


def pow(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a ** b, broadcasting. The exponent's gradient is taken as 0 where a == 0."""
    return _binary(tape, POW, a, b)


def neg(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """-x."""
    return _unary(tape, NEG, x)


def exp(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """e ** x."""
    return _unary(tape, EXP, x)


def log(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Natural logarithm (NaN below 0, -inf at 0, as numpy)."""
    return _unary(tape, LOG, x)


def sqrt(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Square root."""
    return _unary(tape, SQRT, x)


def tanh(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Hyperbolic tangent."""
    return _unary(tape, TANH, x)


def sigmoid(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Logistic sigmoid, computed without overflow for large |x|."""
    return _unary(tape, SIGMOID, x)


def relu(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """max(x, 0); the gradient at exactly 0 is 0, as in PyTorch."""
    return _unary(tape, RELU, x)


def abs(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """|x|; the gradient is sign(x), and 0 at exactly 0, as in PyTorch."""
    return _unary(tape, ABS, x)


@takes_tape
def gelu(tape: Tape, x: Id, approximate: str = "none") -> tuple[Tape, Id]:
    """GELU, x * Phi(x): the exact erf form, or `approximate="tanh"` for the tanh form.

    Both match PyTorch's `gelu` and its gradients.
    """
    if not isinstance(approximate, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ArgumentTypeError(at_site(
            f"gelu: approximate must be the str 'none' or 'tanh', not {shown(approximate)}"))
    if approximate not in ("none", "tanh"):
        raise ShapeError(at_site(
            f"gelu: approximate must be 'none' (the exact erf form) or 'tanh', not "
            f"{shown(approximate)}"))
    return _unary(tape, GELU if approximate == "none" else GELU_TANH, x)


def maximum(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """Elementwise larger of a and b, broadcasting; NaN if either is NaN.

    Where a == b the gradient is split evenly, half to each (as PyTorch).
    """
    return _binary(tape, MAXIMUM, a, b)


def minimum(tape: Tape, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """Elementwise smaller of a and b, broadcasting; NaN if either is NaN; ties split evenly."""
    return _binary(tape, MINIMUM, a, b)


def log1p(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """log(1 + x), accurate where x is small (-inf at -1, NaN below), as PyTorch's `log1p`."""
    return _unary(tape, LOG1P, x)


def expm1(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """e ** x - 1, accurate where x is small, as PyTorch's `expm1` (its gradient is
    g * (expm1(x) + 1), PyTorch's formula)."""
    return _unary(tape, EXPM1, x)


def sin(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Sine (radians); NaN at +-inf."""
    return _unary(tape, SIN, x)


def cos(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """Cosine (radians); NaN at +-inf."""
    return _unary(tape, COS, x)


def erf(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """The error function, 2/sqrt(pi) times the integral of exp(-t^2) from 0 to x."""
    return _unary(tape, ERF, x)


def silu(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """SiLU (swish), x * sigmoid(x), as PyTorch's `silu`: NaN at -inf (-inf * 0), and its
    gradient s * (1 + x * (1 - s)) is NaN at +-inf, as PyTorch's."""
    return _unary(tape, SILU, x)


def softplus(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """log(1 + e ** x), smooth relu, as PyTorch's `softplus` with beta=1 and threshold=20:
    x itself where x > 20 (its gradient 1 there), else log1p(exp(x)) (gradient sigmoid(x))."""
    return _unary(tape, SOFTPLUS, x)


def _missing_defaults(*ops: Callable[..., tuple[Tape, Id]]) -> None:
    """Give the operands of these ops (not @takes_tape, for speed) `_MISSING` as a default at run
    time only, so that a call that leaves one out reaches `_left_out` instead of Python's bare
    TypeError for a missing argument. Their signatures, for the type checker and for `inspect`
    (`__signature__`, taken before), keep every operand required."""
    for op in ops:
        op.__signature__ = inspect.signature(op)  # pyright: ignore[reportFunctionMemberAccess]
        op.__defaults__ = (_MISSING,) * (op.__code__.co_argcount - 1)


_missing_defaults(add, sub, mul, div, pow, neg, exp, log, sqrt, tanh, sigmoid, relu, abs,
                  maximum, minimum, log1p, expm1, sin, cos, erf, silu, softplus)


def _coefficient(op: str, name: str, v: object) -> float:
    """A number parameter of an activation (a slope, alpha) as a Python float."""
    value: Any = v  # narrowing numpy's generic types would leave them partially unknown
    kind: str = value.dtype.kind if isinstance(v, np.generic) else ""
    if kind and kind in "iuf":
        return float(value)
    if isinstance(v, bool) or not (isinstance(v, float) or is_integer(value)):
        raise DTypeError(at_site(
            f"{op}: {name} must be a Python number, not {type(value).__name__}"))
    if isinstance(v, int):
        _fits_a_float(op, repr(name), v)
    return as_float(v)


def _activation(tape: Tape, prim: Primitive[None], x: Id, coefficient: float) -> tuple[Tape, Id]:
    if not isinstance(x, Id):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise NotAnIdError(at_site(
            f"{prim.name}: argument 'x' must be an Id, not {type(x).__name__} ("
            f"{id_hint(x, 'make arrays and numbers into ids with tg.leaf')})"))
    tape, (xb,) = operands(tape, prim.name, [x], ["x"])
    return record(tape, prim, [xb, coefficient])


@takes_tape
def leaky_relu(tape: Tape, x: Id, negative_slope: Number = 0.01) -> tuple[Tape, Id]:
    """x where x > 0 else negative_slope * x, as PyTorch's `leaky_relu`.

    The gradient is 1 where x > 0 and negative_slope elsewhere: at exactly 0 (and -0, NaN) it
    is negative_slope, as PyTorch's (`x > 0 ? g : g * slope`).
    """
    return _activation(tape, LEAKY_RELU, x, _coefficient("leaky_relu", "negative_slope",
                                                         negative_slope))


@takes_tape
def elu(tape: Tape, x: Id, alpha: Number = 1.0) -> tuple[Tape, Id]:
    """x where x > 0 else alpha * (e ** x - 1) (computed with expm1), as PyTorch's `elu`.

    The gradient is 1 where x > 0 and alpha * e ** x elsewhere: alpha at exactly 0, as
    PyTorch's; NaN at NaN.
    """
    return _activation(tape, ELU, x, _coefficient("elu", "alpha", alpha))


def _common_float(tape: Tape, op: str, values: Sequence[Id | Scalar], names: Sequence[str]
                  ) -> DType | None:
    """The one float dtype of the ids among `values` (None if all are numbers), checked."""
    dtype: DType | None = None
    first = ""
    for name, v in zip(names, values, strict=True):
        if isinstance(v, Id):
            tape.node(v, op, name)
            if not is_float(v.dtype):
                raise DTypeError(at_site(
                    f"{op}: argument {name!r} has dtype {dtype_name(v.dtype)}, expected "
                    "float32 or float64 (convert with tg.astype)"))
            if dtype is not None and v.dtype != dtype:
                raise DTypeError(at_site(
                    f"{op}: operands have different dtypes ({first} is {dtype_name(dtype)}, "
                    f"{name} is {dtype_name(v.dtype)}); convert one explicitly with "
                    "tg.astype(tape, x, np.float32) or np.float64"))
            dtype, first = v.dtype, first or name
    return dtype


@takes_tape
def where(tape: Tape, cond: Id, a: Operand, b: Operand) -> tuple[Tape, Id]:
    """a where cond is true (nonzero) else b; cond, a and b broadcast together.

    `cond` is a bool, int32 or int64 id and takes no gradient; a and b are float ids of one
    dtype or Python numbers (with two numbers the result is float32). The condition is cast to
    the float dtype on the tape (a `cast` node) before the selection.
    """
    tape.node(cond, "where", "cond")
    if cond.dtype != BOOL and cond.dtype not in INTS:
        raise DTypeError(at_site(
            f"where: argument 'cond' has dtype {dtype_name(cond.dtype)}, expected bool, int32 "
            "or int64 (nonzero = true); make a mask with tg.astype(tape, x, np.bool_)"))
    if (type(a) is Id and a.shape == cond.shape and a.dtype in FLOATS and (type(b) is float or (
            type(b) is Id and b.shape == a.shape and b.dtype == a.dtype))):
        # A float id of the mask's shape, and a Python float or an id alike (a masked fill,
        # a select): nothing to convert or broadcast, only the ids to check.
        tape.node(a, "where", "a")
        if isinstance(b, Id):
            tape.node(b, "where", "b")
        tape, c = record(tape, CAST, [cond], CastParams(a.dtype))
        return record(tape, WHERE, [c, a, b])
    a, b = number("where", "a", a), number("where", "b", b)
    dtype = _common_float(tape, "where", [a, b], ["a", "b"]) or FLOAT32
    named = [("cond", cond)] + [(n, v) for n, v in (("a", a), ("b", b)) if isinstance(v, Id)]
    shape = broadcast_shapes("where", [v.shape for _, v in named], [n for n, _ in named])
    tape, c = record(tape, CAST, [cond], CastParams(dtype))
    # Only operands of another shape go through broadcast_to (a public op, checked again).
    if c.shape != shape:
        tape, c = broadcast_to(tape, c, shape)
    args: list[Id | float] = [c]
    for v in (a, b):
        if isinstance(v, Id):
            if v.shape != shape:
                tape, v = broadcast_to(tape, v, shape)
            args.append(v)
        else:
            args.append(as_float(v))
    return record(tape, WHERE, args)


def _bound(name: str, v: Number | None, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, np.generic) and v.dtype.kind in "iuf":
        v = float(v)
    if isinstance(v, bool) or not (isinstance(v, float) or is_integer(v)):
        raise DTypeError(at_site(
            f"clip: {name} must be a Python number or None (no bound), not {type(v).__name__}"))
    if isinstance(v, int):
        _fits_a_float("clip", repr(name), v)
    if math.isnan(v):
        raise ShapeError(at_site(f"clip: {name} is NaN; pass None for no bound"))
    return as_float(v)


@takes_tape
def clip(tape: Tape, x: Id, lo: Number | None, hi: Number | None) -> tuple[Tape, Id]:
    """x limited to [lo, hi]: min(max(x, lo), hi), as numpy's clip; None means no bound.

    The gradient passes where lo <= x <= hi (bounds inclusive) and is 0 elsewhere. If lo > hi
    every element is hi (as numpy and PyTorch) and no gradient passes. With both bounds None,
    x itself is returned and nothing is recorded.
    """
    low, high = _bound("lo", lo, -math.inf), _bound("hi", hi, math.inf)
    if not isinstance(x, Id):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise NotAnIdError(at_site(f"clip: argument 'x' must be an Id, not {type(x).__name__}"))
    tape, (xb,) = operands(tape, "clip", [x], ["x"])
    if lo is None and hi is None:
        return tape, x
    return record(tape, CLIP, [xb, low, high])


@takes_tape
def astype(tape: Tape, x: Id, dtype: Any) -> tuple[Tape, Id]:
    """x converted to `dtype` (float32, float64, int32, int64 or bool; anything np.dtype takes).

    float to float is differentiable (the VJP casts the cotangent back); a conversion to or from
    an integer or bool takes no gradient. float to int truncates toward zero (out-of-range and
    NaN values are undefined, as in C); anything to bool is `x != 0`. The same dtype returns x.
    """
    node = tape.node(x, "astype", "x")
    if dtype is None:  # np.dtype(None) is float64: a silent conversion, not "keep x's"
        raise DTypeError(at_site(
            "astype: dtype must be given (float32, float64, int32, int64 or bool), got None"))
    try:
        target: DType = np.dtype(dtype)
    except TypeError as err:
        raise DTypeError(at_site(f"astype: {shown(dtype)} is not a dtype ({err})")) from None
    if target not in SUPPORTED:
        raise DTypeError(at_site(
            f"astype: cannot convert to {target}; tapegrad holds float32, float64, int32, int64 "
            "and bool"))
    if target == node.value.dtype:
        return tape, x
    return record(tape, CAST, [x], CastParams(target))
