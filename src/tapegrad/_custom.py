"""Custom ops: a user's OpenCL C expressions become a first-class, broadcasting op.

    softplus = tg.elementwise_op(
        "softplus", arity=1,
        forward="log1p(exp(a))",
        vjps=["g * (T)1 / ((T)1 + exp(-a))"],
    )
    tape, y = softplus(tape, x)

The forward expression reads the operands `a`, `b`, `c` (type `T`, the float dtype); each VJP
expression also reads `out` (the forward value) and `g` (the cotangent) and gives one operand's
cotangent. Each becomes a registered primitive whose kernels live in a program of the op's own,
built once per dtype like every other family. The VJP kernels have no VJP of their own, so
differentiating a custom op twice raises a TapegradError instead of returning a wrong zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._errors import TapegradError, at_site
from ._kernels import ARG_NAMES, expression_names
from ._primitive import Emitter, Primitive, primitives
from ._tape import Id, Tape, record
from .ops.broadcast import Scalar, operands
from .ops.elementwise import _make as make_elementwise
from .ops.elementwise import number


def elementwise_op(
    name: str, arity: int, forward: str, vjps: Sequence[str | None], helpers: str = "",
    doc: str = "",
) -> Callable[..., tuple[Tape, Id]]:
    """Make a broadcasting elementwise op `f(tape, *operands) -> (tape, id)` from C expressions.

    `vjps[i]` is operand i's cotangent over (a, b, c, out, g), or None if it takes no gradient.
    `helpers` is C source (inline functions) placed before the kernels.
    """
    if not 1 <= arity <= len(ARG_NAMES):
        raise TapegradError(f"elementwise_op: arity must be 1..{len(ARG_NAMES)}, got {arity}")
    if len(vjps) != arity:
        raise TapegradError(
            f"elementwise_op: {name!r} has {arity} operands but {len(vjps)} VJP expressions")
    taken = set(primitives()) | expression_names()
    for wanted in [name] + [f"{name}_vjp{i}" for i, e in enumerate(vjps) if e is not None]:
        if wanted in taken:
            raise TapegradError(f"elementwise_op: an op named {wanted!r} already exists")
    family = f"custom.{name}"
    names = ARG_NAMES[:arity]
    vjp_prims: list[Primitive[None] | None] = []
    for i, expr in enumerate(vjps):
        if expr is None:
            vjp_prims.append(None)
            continue
        vjp_name = f"{name}_vjp{i}"

        def no_second_order(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                            needs: Sequence[bool], vjp_name: str = vjp_name) -> list[Any]:
            raise TapegradError(f"{vjp_name}: a custom op's VJP has no VJP of its own, so it "
                                "cannot be differentiated a second time")

        vjp_prims.append(make_elementwise(
            vjp_name, arity + 2, expr, no_second_order, f"VJP of custom op {name} for operand {i}",
            family, (*names, "out", "g"), helpers, builtin=False))

    def vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
            needs: Sequence[bool]) -> list[Any]:
        return [e.apply(prim, [*args, out, g]) if prim is not None and needs[i] else None
                for i, prim in enumerate(vjp_prims)]

    prim = make_elementwise(name, arity, forward, vjp, doc or f"custom op: {forward}", family,
                            names, helpers, builtin=False)

    def op(tape: Tape, *args: Id | Scalar) -> tuple[Tape, Id]:
        if len(args) != arity:
            raise TapegradError(at_site(f"{name}: takes {arity} operands, got {len(args)}"))
        values = [number(name, n, a) for n, a in zip(names, args, strict=True)]
        tape, ready = operands(tape, name, values, list(names))
        return record(tape, prim, ready)

    op.__name__ = name
    op.__doc__ = doc or f"Custom elementwise op: {forward}"
    return op
