"""Primitives: each op's shape rule, forward kernel and VJP, declared together.

A VJP is written against an `Emitter`, never against kernels directly: it calls
`e.apply(PRIMITIVE, args, params)` for every step. The eager emitter runs the forward kernels
straight away on tensors (the first-order sweep, which records nothing); the recording emitter
appends each step to a tape, so the same rule yields a differentiable backward (second order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from ._tensor import AnyTensor, DType, Shape

if TYPE_CHECKING:  # a forward's first argument; the primitives never touch it themselves
    from ._device import Device

P = TypeVar("P")
Q = TypeVar("Q")


# An operand is an AnyTensor or Id (anything with .shape and .dtype) or a Python float: kept
# loose so both kinds of handle fit one rule.
Operand = Any


class Aval(NamedTuple):
    """What a rule returns: the output's shape and dtype (a tuple: made for every op)."""

    shape: Shape
    dtype: DType


class Emitter(Protocol):
    def apply(self, prim: Primitive[Any], args: Sequence[Any], params: Any = None) -> Any: ...


Rule = Callable[[Sequence[Operand], P], Aval]
Forward = Callable[["Device", Sequence[Any], P, Aval], AnyTensor]
# vjp(e, g, out, args, params, needs) -> one cotangent (or None, meaning zero) per argument.
Vjp = Callable[[Emitter, Any, Any, Sequence[Any], P, Sequence[bool]], Sequence[Any]]


# A primitive's own quicker way to do what `rule` then `forward` do, for operands it can check
# inline (the elementwise ops': ~1 us of an op's ~4): given the device (eager), or the
# primitive, the tape and the frames to skip for the call site (recording), the value or
# (tape, id), or None for operands it leaves to the rule. `EagerEmitter.apply` and
# `_tape.record` try it first.
Eager = Callable[["Device", Sequence[Any]], Any]
Recorder = Callable[[Any, Any, Sequence[Any], int], Any]


@dataclass(frozen=True, eq=False)
class Primitive(Generic[P]):
    """One op: `rule` checks operands and gives the output aval before any kernel runs."""

    name: str
    rule: Rule[P]
    forward: Forward[P]
    vjp: Vjp[P] | None
    doc: str = ""
    builtin: bool = True  # False for users' custom ops
    eager: Eager | None = None
    recorder: Recorder | None = None

    def __repr__(self) -> str:
        return f"Primitive({self.name})"


@dataclass(frozen=True)
class LinearOp(Generic[P]):
    """A primitive linear in its first argument, declared without a VJP: `transposes` pairs
    it with its transpose, `self_adjoint` with itself."""

    name: str
    rule: Rule[P]
    forward: Forward[P]
    doc: str


def _transpose_vjp(made: list[Primitive[Any]], which: int,
                   params_of: Callable[[Any, Sequence[Any]], Any] | None) -> Vjp[Any]:
    """The VJP that applies `made[which]` (registered after this is made) to the cotangent,
    with the differentiated op's further arguments and its params mapped by `params_of`."""
    def vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: Any,
            needs: Sequence[bool]) -> list[Any]:
        params = p if params_of is None else params_of(p, args)
        return [e.apply(made[which], [g, *args[1:]], params), *[None] * (len(args) - 1)]
    return vjp


def transposes(a: LinearOp[P], b: LinearOp[Q],
               a_to_b: Callable[[P, Sequence[Any]], Q] | None = None,
               b_to_a: Callable[[Q, Sequence[Any]], P] | None = None,
               ) -> tuple[Primitive[P], Primitive[Q]]:
    """Register two primitives, each the other's transpose (a slice and its scatter, im2col and
    col2im, a gather by indices and its scatter-add): the VJP of one applies the other to the
    cotangent with the same further arguments (indices, labels, positions: not differentiated)
    and its params made by `a_to_b` / `b_to_a` from the differentiated op's params and
    arguments (the same params where None). The VJP of a VJP is the op again, so every order
    of derivative comes from this one declaration."""
    made: list[Primitive[Any]] = []
    made.append(register(Primitive(a.name, a.rule, a.forward, _transpose_vjp(made, 1, a_to_b),
                                   a.doc)))
    made.append(register(Primitive(b.name, b.rule, b.forward, _transpose_vjp(made, 0, b_to_a),
                                   b.doc)))
    return made[0], made[1]


def self_adjoint(a: LinearOp[P]) -> Primitive[P]:
    """Register a primitive that is its own transpose (a mask: tril, dropout's): its VJP
    applies it to the cotangent with the same params and further arguments."""
    made: list[Primitive[Any]] = []
    made.append(register(Primitive(a.name, a.rule, a.forward, _transpose_vjp(made, 0, None),
                                   a.doc)))
    return made[0]


_REGISTRY: dict[str, Primitive[Any]] = {}


def register(prim: Primitive[P]) -> Primitive[P]:
    if prim.name in _REGISTRY:
        raise ValueError(f"primitive {prim.name!r} is registered twice")
    _REGISTRY[prim.name] = prim
    return prim


def registered(name: str) -> Primitive[Any]:
    """The primitive of that name (the sweep adds cotangents with "add", defined by the ops)."""
    return _REGISTRY[name]


def forget(names: Sequence[str]) -> None:
    """Unregister primitives (a custom op whose kernels did not build)."""
    for name in names:
        _REGISTRY.pop(name, None)


def primitives() -> dict[str, Primitive[Any]]:
    """Every registered primitive by name (tests check each has a gradient-check row)."""
    return dict(_REGISTRY)


def apply(prim: Primitive[Any], device: Device, values: Sequence[Any], params: Any = None,
          aval: Aval | None = None) -> AnyTensor:
    """A primitive applied to values (tensors and Python floats): the one place a primitive
    meets the backend, for `record`, a deferred forward and the eager sweep alike. Its own
    `eager` where it has one and takes these operands, else its rule (unless the caller ran it
    and passes its `aval`), which checks them and gives the output's shape and dtype once,
    then its forward."""
    eager = prim.eager
    if eager is not None:
        done: AnyTensor | None = eager(device, values)
        if done is not None:
            return done
    return prim.forward(device, values, params, prim.rule(values, params) if aval is None
                        else aval)


class EagerEmitter:
    """Runs each step's kernels at once on tensors; nothing is recorded."""

    __slots__ = ("device",)

    def __init__(self, device: Device) -> None:
        self.device = device

    def apply(self, prim: Primitive[Any], args: Sequence[Any], params: Any = None) -> AnyTensor:
        return apply(prim, self.device, args, params)
