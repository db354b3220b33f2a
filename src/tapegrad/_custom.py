"""Custom ops: a user's OpenCL C expressions become a first-class, broadcasting op.

    my_softplus = tg.elementwise_op(
        "my_softplus", arity=1,
        forward="log1p(exp(a))",
        vjps=["g * (T)1 / ((T)1 + exp(-a))"],
    )
    tape, y = my_softplus(tape, x)

The forward expression reads the operands `a`, `b`, `c` (type `T`, the float dtype); each VJP
expression also reads `out` (the forward value) and `g` (the cotangent) and gives one operand's
cotangent. Each becomes a registered primitive whose kernels live in a program of the op's own,
built once per dtype like every other family. The VJP kernels have no VJP of their own, so
differentiating a custom op twice raises a TapegradError instead of returning a wrong zero.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ._device import default_device
from ._errors import (
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    ShapeError,
    TapegradError,
    at_site,
    shown,
)
from ._kernels import (
    ARG_NAMES,
    EXPRESSION_LINES,
    expression,
    expression_kernel,
    expression_names,
    forget_expressions,
    source_lines,
)
from ._ops.broadcast import Scalar, operands
from ._ops.elementwise import _make as make_elementwise
from ._ops.elementwise import number
from ._primitive import Emitter, Primitive, forget, primitives
from ._tape import Id, Tape, record, takes_tape

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # the name is part of kernel names
# An error line of a build log: file:line:column: (error:) message, in clang's or PoCL's order;
# NVIDIA's driver names the file `<kernel>`.
_LOG_ERROR = re.compile(r"(?:\.cl|<kernel>):(\d+):(\d+):\s*(?:error:\s*)?(.*)")


def elementwise_op(
    name: str, arity: int, forward: str, vjps: Sequence[str | None], helpers: str = "",
    doc: str = "",
) -> Callable[..., tuple[Tape, Id]]:
    """Make a broadcasting elementwise op `f(tape, *operands) -> (tape, id)` from C expressions.

    `vjps[i]` is operand i's cotangent over (a, b, c, out, g), or None if it takes no gradient.
    `helpers` is C source (inline functions) placed before the kernels.
    """
    if isinstance(arity, bool) or not isinstance(arity, int):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ArgumentTypeError(at_site(
            f"elementwise_op: arity must be an int 1..{len(ARG_NAMES)}, got {shown(arity)}"))
    if not 1 <= arity <= len(ARG_NAMES):
        raise ShapeError(at_site(
            f"elementwise_op: arity must be an int 1..{len(ARG_NAMES)}, got {shown(arity)}"))
    named = cast(object, name)
    if not isinstance(named, str) or not _IDENTIFIER.match(named):
        raise (ShapeError if isinstance(named, str) else DTypeError)(at_site(
            f"elementwise_op: the name must be a C identifier (letters, digits, _; not first a "
            f"digit), got {shown(name)}"))
    if isinstance(vjps, np.ndarray):
        vjps = cast(list[str | None], vjps.tolist())
    if doc is None:  # pyright: ignore[reportUnnecessaryComparison]
        doc = ""
    if not isinstance(vjps, list | tuple):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(
            f"elementwise_op: vjps must be a list of {arity} C expressions (str, or None for "
            f"no gradient), got {type(vjps).__name__} {vjps!r}"))
    if len(vjps) != arity:
        raise ShapeError(at_site(
            f"elementwise_op: {name!r} has {arity} operands, so vjps must be a list of "
            f"{arity} expressions (None for no gradient), got {len(vjps)}: {vjps!r}"))
    for what, text in [("forward", forward), ("helpers", helpers), ("doc", doc),
                       *((f"vjps[{i}]", e) for i, e in enumerate(vjps) if e is not None)]:
        if not isinstance(text, str):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise DTypeError(at_site(
                f"elementwise_op: {what} of {name!r} must be a str of OpenCL C"
                f"{' or None' if what.startswith('vjps') else ''}, got {type(text).__name__} "
                f"{text!r}"))
    definition = (arity, forward, tuple(vjps), helpers, doc)
    with _DEFINING:
        defined = _DEFINED.get(name)
        if defined is not None:
            return _again(name, definition, *defined)
        op = _define(name, arity, forward, vjps, helpers, doc)
        _DEFINED[name] = (definition, op)
        return op


# Custom ops by name, with what defined them: a cell of a notebook run again gets the same op.
_DEFINED: dict[str, tuple[tuple[Any, ...], Callable[..., tuple[Tape, Id]]]] = {}
_DEFINING = threading.Lock()


def _again(name: str, definition: tuple[Any, ...], before: tuple[Any, ...],
           op: Callable[..., tuple[Tape, Id]]) -> Callable[..., tuple[Tape, Id]]:
    """A second definition of a custom op: the same op if nothing changed, else an error that
    says how to get the new one (kernels are built and cached under the op's name, and tapes
    already recorded with it keep using them, so a name cannot change meaning in a process)."""
    if definition == before:
        return op
    parts = ("arity", "forward", "vjps", "helpers", "doc")
    changed = ", ".join(part for part, new, old in zip(parts, definition, before, strict=True)
                        if new != old)
    raise TapegradError(at_site(
        f"elementwise_op: {name!r} is already defined, with another {changed} (forward "
        f"{before[1]!r}, now {definition[1]!r}); a custom op's kernels are built and cached "
        f"under its name, so a new definition needs a new name (say {name + '_v2'!r}), or a "
        "new Python process (restart the notebook's kernel)"))


_PUBLIC_NAMES: set[str] = set()


def reserve_names(names: Sequence[str]) -> None:
    """The package's public names, which no custom op may take (`tapegrad/__init__`)."""
    _PUBLIC_NAMES.update(names)


def _define(name: str, arity: int, forward: str, vjps: Sequence[str | None], helpers: str,
            doc: str) -> Callable[..., tuple[Tape, Id]]:
    """Register and build a new custom op (its arguments are checked)."""
    taken = set(primitives()) | expression_names() | _PUBLIC_NAMES
    for wanted in [name] + [f"{name}_vjp{i}" for i, e in enumerate(vjps) if e is not None]:
        if wanted in taken:
            raise TapegradError(at_site(
                f"elementwise_op: an op named {wanted!r} already exists"))
    family = f"custom.{name}"
    names = ARG_NAMES[:arity]
    made: list[str] = []  # registered so far: all of them are forgotten if any step fails
    try:
        prim = _register(name, arity, forward, vjps, helpers, doc, family, names, made)
        _build(name, arity)
    except BaseException as err:
        # The build log's line numbers are read against the program's source, before the
        # op's expressions leave it.
        message = (_explain(err, family, name, forward, vjps) if isinstance(err, DeviceError)
                   else None)
        forget(made)  # nothing of it stays registered: the name can be defined again
        forget_expressions(made)
        if message is not None:
            raise DeviceError(at_site(message)) from None
        raise

    def op(tape: Tape, *args: Id | Scalar) -> tuple[Tape, Id]:
        if len(args) != arity:
            raise DTypeError(at_site(f"{name}: takes {arity} operands, got {len(args)}"))
        values = [number(name, n, a) for n, a in zip(names, args, strict=True)]
        tape, ready = operands(tape, name, values, list(names))
        return record(tape, prim, ready)

    op.__name__ = name
    op.__doc__ = doc or f"Custom elementwise op: {forward}"
    return takes_tape(op)  # a public op like the others: a non-Tape first is a TapeError


def _register(name: str, arity: int, forward: str, vjps: Sequence[str | None], helpers: str,
              doc: str, family: str, names: tuple[str, ...], made: list[str]) -> Primitive[None]:
    """Register the op's VJP primitives and then its own, noting each name in `made`."""
    vjp_prims: list[Primitive[None] | None] = []
    for i, expr in enumerate(vjps):
        if expr is None:
            vjp_prims.append(None)
            continue
        vjp_name = f"{name}_vjp{i}"

        def no_second_order(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
                            needs: Sequence[bool], vjp_name: str = vjp_name) -> list[Any]:
            raise TapegradError(at_site(
                f"{vjp_name}: a custom op's VJP has no VJP of its own, so the custom op "
                f"{name!r} cannot be differentiated a second time"))

        vjp_prims.append(make_elementwise(
            vjp_name, arity + 2, expr, no_second_order, f"VJP of custom op {name} for operand {i}",
            family, (*names, "out", "g"), helpers, builtin=False))
        made.append(vjp_name)  # registered: forgotten if a later step fails

    def vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: None,
            needs: Sequence[bool]) -> list[Any]:
        return [e.apply(prim, [*args, out, g]) if prim is not None and needs[i] else None
                for i, prim in enumerate(vjp_prims)]

    prim = make_elementwise(name, arity, forward, vjp, doc or f"custom op: {forward}", family,
                            names, helpers, builtin=False)
    made.append(name)
    return prim


def _build(name: str, arity: int) -> None:
    """Build the op's float32 program now (first use would): a C error is reported at the
    definition, naming the expression, rather than at some later call."""
    expression_kernel(expression(name), (True,) * arity, np.dtype(np.float32), default_device())


def _explain(err: DeviceError, family: str, name: str, forward: str,
             vjps: Sequence[str | None]) -> str:
    """Which expression did not compile, the compiler's first complaint and where in it."""
    lines = source_lines(np.dtype(np.float32), family)
    found = _LOG_ERROR.search(str(err))
    what = "its helpers"
    where = ""
    if found is not None and 0 < int(found.group(1)) <= len(lines):
        line = lines[int(found.group(1)) - 1]
        start = next((s for s in EXPRESSION_LINES if line.startswith(s)), None)
        if start is not None:
            expr = line[len(start):-2]  # "...(expr);"
            column = int(found.group(2)) - len(start)
            if expr == forward:
                what = f"the forward expression {forward!r}"
            else:
                i = next((i for i, v in enumerate(vjps) if v == expr), 0)
                what = f"the VJP expression for operand {i} ({expr!r})"
            where = f" (at character {column} of it)" if 0 < column <= len(expr) else ""
    complaint = found.group(3).strip() if found is not None else "see the log below"
    verb = "fail" if what == "its helpers" else "fails"
    return (f"elementwise_op: {name!r}: {what} {verb} to compile: {complaint}{where}\n"
            f"The build log:\n{err}")
