"""Elementwise ops: each is a C expression, a VJP written with other primitives, and a doc.

Operands of one primitive have one shape (`broadcast.operands` broadcast them first) and one
float dtype; a Python scalar operand is a kernel argument of that dtype. The fused VJP helpers
(`relu_grad`, `tanh_grad`, `sigmoid_grad`) are primitives too, with VJPs of their own, so a
recorded backward can be differentiated again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import DTypeError, ShapeError, at_site
from .._kernels import elementwise, register_expression
from .._primitive import Aval, Emitter, Primitive, Vjp, register
from .._tape import Id, Tape, record
from .._tensor import AnyTensor, is_float
from .broadcast import Scalar, operands


def _make(name: str, arity: int, expr: str, vjp: Vjp[None] | None, doc: str) -> Primitive[None]:
    """Register the kernel expression and the primitive of one elementwise op."""
    found = register_expression(name, arity, expr)

    def rule(args: Sequence[Any], params: None) -> Aval:
        typed = [a for a in args if not isinstance(a, float)]
        if len(args) != arity or not typed:
            raise ShapeError(f"{name}: takes {arity} operands, at least one a tensor")
        first = typed[0]
        for a in typed[1:]:
            if a.shape != first.shape or a.dtype != first.dtype:
                raise ShapeError(at_site(
                    f"{name}: operands must share shape and dtype after broadcasting; got "
                    f"{first.shape} {first.dtype} and {a.shape} {a.dtype}"))
        if not is_float(first.dtype):
            raise DTypeError(at_site(f"{name}: needs float operands, got {first.dtype}"))
        return Aval(first.shape, first.dtype)

    def forward(dev: Any, args: Sequence[Any], params: None, aval: Aval) -> AnyTensor:
        return elementwise(found, args, aval.shape, aval.dtype, dev)

    return register(Primitive(name, rule, forward, vjp, doc))


def _ap(e: Emitter, prim: Primitive[None], *args: Any) -> Any:
    return e.apply(prim, list(args))


# --- VJPs ------------------------------------------------------------------------------------
# Each returns one cotangent per operand; a scalar operand's slot is ignored by the sweep.

def _add_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [g, g]


def _sub_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [g, _ap(e, NEG, g) if needs[1] else None]


def _mul_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    a, b = args
    return [_ap(e, MUL, g, b) if needs[0] else None, _ap(e, MUL, g, a) if needs[1] else None]


def _div_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    _, b = args
    ga = _ap(e, DIV, g, b) if needs[0] else None
    gb = _ap(e, NEG, _ap(e, DIV, _ap(e, MUL, g, out), b)) if needs[1] else None
    return [ga, gb]


def _neg_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, NEG, g)]


def _pow_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    a, b = args
    ga = gb = None
    if needs[0]:
        b_minus_1 = b - 1.0 if isinstance(b, float) else _ap(e, ADD, b, -1.0)
        ga = _ap(e, MUL, _ap(e, MUL, g, b), _ap(e, POW, a, b_minus_1))
    if needs[1]:
        # d(a**b)/db = a**b * log(a); where a == 0 the limit is 0 (PyTorch's choice too).
        gb = _ap(e, MUL, g, _ap(e, POW_LOG, out, a))
    return [ga, gb]


def _pow_log_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    o, a = args
    go = _ap(e, MUL, g, _ap(e, LOG, a)) if needs[0] else None
    ga = _ap(e, DIV, _ap(e, MUL, g, o), a) if needs[1] else None
    return [go, ga]


def _exp_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, MUL, g, out)]


def _log_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
             needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, DIV, g, args[0])]


def _sqrt_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, DIV, g, _ap(e, MUL, out, 2.0))]


def _tanh_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, TANH_GRAD, g, out)]


def _tanh_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    g, y = args  # tanh_grad(g, y) = g * (1 - y*y)
    gg = _ap(e, TANH_GRAD, h, y) if needs[0] else None
    gy = _ap(e, MUL, _ap(e, MUL, h, g), _ap(e, MUL, y, -2.0)) if needs[1] else None
    return [gg, gy]


def _sigmoid_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                 needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, SIGMOID_GRAD, g, out)]


def _sigmoid_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                      needs: Sequence[bool]) -> list[Any]:
    g, y = args  # sigmoid_grad(g, y) = g * y * (1 - y)
    gg = _ap(e, SIGMOID_GRAD, h, y) if needs[0] else None
    gy = None
    if needs[1]:
        gy = _ap(e, MUL, _ap(e, MUL, h, g), _ap(e, ADD, _ap(e, MUL, y, -2.0), 1.0))
    return [gg, gy]


def _relu_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
              needs: Sequence[bool]) -> list[Any]:
    return [_ap(e, RELU_GRAD, g, args[0])]


def _relu_grad_vjp(e: Emitter, h: Any, out: Any, args: Sequence[Any], p: None,
                   needs: Sequence[bool]) -> list[Any]:
    # relu_grad(g, x) is linear in g with the mask of x, and flat in x almost everywhere.
    return [_ap(e, RELU_GRAD, h, args[1]) if needs[0] else None, None]


ADD = _make("add", 2, "a + b", _add_vjp, "a + b")
SUB = _make("sub", 2, "a - b", _sub_vjp, "a - b")
MUL = _make("mul", 2, "a * b", _mul_vjp, "a * b")
DIV = _make("div", 2, "a / b", _div_vjp, "a / b")
NEG = _make("neg", 1, "-a", _neg_vjp, "-a")
POW = _make("pow", 2, "pow(a, b)", _pow_vjp, "a ** b (real-valued: NaN for a < 0 with a "
            "non-integer b, as in C and PyTorch)")
POW_LOG = _make("pow_log", 2, "b == (T)0 ? (T)0 : a * log(b)", _pow_log_vjp,
                "out * log(a), 0 where a == 0: the exponent's derivative of a ** b")
EXP = _make("exp", 1, "exp(a)", _exp_vjp, "e ** a")
LOG = _make("log", 1, "log(a)", _log_vjp, "natural logarithm")
SQRT = _make("sqrt", 1, "sqrt(a)", _sqrt_vjp, "square root")
TANH = _make("tanh", 1, "tanh(a)", _tanh_vjp, "hyperbolic tangent")
TANH_GRAD = _make("tanh_grad", 2, "a * ((T)1 - b * b)", _tanh_grad_vjp,
                  "g * (1 - y*y): the VJP of tanh from its output y, fused")
SIGMOID = _make("sigmoid", 1, "tg_sigmoid(a)", _sigmoid_vjp, "1 / (1 + e ** -a), stable both ways")
SIGMOID_GRAD = _make("sigmoid_grad", 2, "a * b * ((T)1 - b)", _sigmoid_grad_vjp,
                     "g * y * (1 - y): the VJP of sigmoid from its output y, fused")
RELU = _make("relu", 1, "a > (T)0 ? a : (T)0", _relu_vjp, "max(a, 0); gradient 0 at 0, as "
             "PyTorch")
RELU_GRAD = _make("relu_grad", 2, "b > (T)0 ? a : (T)0", _relu_grad_vjp,
                  "g where x > 0 else 0: the VJP of relu, fused")
EQUAL = _make("equal", 2, "a == b ? (T)1 : (T)0", None,
              "1 where a == b else 0 (a mask; no gradient)")


# --- the public ops --------------------------------------------------------------------------

Operand = Id | Scalar


def _binary(tape: Tape, prim: Primitive[None], a: Operand, b: Operand) -> tuple[Tape, Id]:
    tape, args = operands(tape, prim.name, [a, b], ["a", "b"])
    return record(tape, prim, args)


def _unary(tape: Tape, prim: Primitive[None], x: Id) -> tuple[Tape, Id]:
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
