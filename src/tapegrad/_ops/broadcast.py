"""Broadcasting and summing, in one place: each is the other's VJP.

Elementwise primitives take operands of one shape. A public binary op broadcasts by numpy's rules
first, inserting explicit `broadcast_to` nodes; the VJP of `broadcast_to` sums the cotangent back
to the operand's shape. So no other VJP ever has to "unbroadcast". The `sum` primitive is here
too, as broadcasting's transpose (its VJP broadcasts back); the public `tg.sum` and the other
reductions are in `reduce`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._device import Device
from .._errors import DTypeError, NotAnIdError, ShapeError, at_site, call_site
from .._fusion import pending_broadcast
from .._kernels import broadcast_strides, strided_gather
from .._primitive import Aval, Emitter, Primitive, register
from .._reduction import keep_shape, reduce_tensor
from .._tape import Id, Tape, id_hint, nodes_of, record, record_checked, takes_tape
from .._tensor import AnyTensor, DType, Shape, dtype_name, is_float, keep_range
from .._traced import TracedInt, as_float
from . import shape as _shape

Scalar = float | int | bool


def broadcast_shapes(op: str, shapes: Sequence[Shape], names: Sequence[str]) -> Shape:
    """numpy's broadcast of shapes, or a ShapeError naming the operands and the axis."""
    ndim = max((len(s) for s in shapes), default=0)
    out: list[int] = []
    for axis in range(-ndim, 0):
        size = 1
        for shape in shapes:
            n = shape[axis] if -axis <= len(shape) else 1
            if n != 1:
                if size not in (1, n):
                    desc = ", ".join(f"{name} {s}" for name, s in zip(names, shapes, strict=True))
                    sizes = ", ".join(
                        f"{name}: {s[axis] if -axis <= len(s) else '-'}"
                        for name, s in zip(names, shapes, strict=True)
                    )
                    raise ShapeError(at_site(
                        f"{op}: shapes do not broadcast ({desc}): axis {axis} has sizes "
                        f"{sizes}; sizes must be equal or 1"))
                size = n
        out.append(size)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BroadcastParams:
    shape: Shape


def _broadcast_rule(args: Sequence[Any], p: BroadcastParams) -> Aval:
    (x,) = args
    if len(p.shape) < len(x.shape) or any(
        n not in (1, m) for n, m in zip(x.shape[::-1], p.shape[::-1], strict=False)
    ):
        raise ShapeError(at_site(
            f"broadcast_to: cannot broadcast x of shape {x.shape} to shape {p.shape}"))
    return Aval(p.shape, x.dtype)


def broadcast_tensor(x: AnyTensor, shape: Shape) -> AnyTensor:
    """x repeated to `shape` by numpy's rules (callers did the checks): pending where a fused
    kernel can read x itself (`_fusion.pending_broadcast`), else one strided copy."""
    if x.shape == shape:
        return x
    pending = pending_broadcast(x, shape)
    if pending is not None:
        return pending
    return strided_gather(x, shape, broadcast_strides(x.shape, shape))


def _broadcast_forward(dev: Any, args: Sequence[AnyTensor], p: BroadcastParams, aval: Aval
                       ) -> AnyTensor:
    return keep_range(broadcast_tensor(args[0], aval.shape), args[0])


def _broadcast_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: BroadcastParams,
                   needs: Sequence[bool]) -> list[Any]:
    return [sum_to(e, g, args[0].shape)]


BROADCAST_TO: Primitive[BroadcastParams] = register(Primitive(
    "broadcast_to", _broadcast_rule, _broadcast_forward, _broadcast_vjp,
    doc="Repeat x along new leading axes and size-1 axes; the VJP sums them back."))


@dataclass(frozen=True, slots=True)
class ReduceParams:
    axes: tuple[int, ...]
    keepdims: bool


def reduced_shape(shape: Shape, p: ReduceParams) -> Shape:
    if p.keepdims:
        return keep_shape(shape, p.axes)
    return tuple(n for i, n in enumerate(shape) if i not in p.axes)


def reduction_rule(kind: str) -> Any:
    def rule(args: Sequence[Any], p: ReduceParams) -> Aval:
        (x,) = args
        if not is_float(x.dtype):
            raise DTypeError(at_site(f"{kind}: x has dtype {x.dtype}, expected float32 or float64 "
                                     "(convert with tg.astype(tape, x, np.float32))"))
        if kind != "sum" and any(x.shape[a] == 0 for a in p.axes):
            raise ShapeError(at_site(
                f"{kind}: cannot reduce over an empty axis (x has shape {x.shape}, axes "
                f"{p.axes}): the result has no identity"))
        return Aval(reduced_shape(x.shape, p), x.dtype)
    return rule


def reduction_forward(kind: str) -> Any:
    def forward(dev: Device, args: Sequence[AnyTensor], p: ReduceParams, aval: Aval
                ) -> AnyTensor:
        (x,) = args
        return reduce_tensor(x, kind, p.axes, keep_shape(x.shape, p.axes)).with_shape(aval.shape)
    return forward


def to_keep(e: Emitter, t: Any, x_shape: Shape, p: ReduceParams) -> Any:
    """A reduced value with the reduced axes kept as size 1 (a free reshape)."""
    if p.keepdims:
        return t
    return e.apply(_shape.RESHAPE, [t], _shape.ReshapeParams(keep_shape(x_shape, p.axes)))


def _sum_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReduceParams,
             needs: Sequence[bool]) -> list[Any]:
    x_shape = args[0].shape
    gk = to_keep(e, g, x_shape, p)
    return [e.apply(BROADCAST_TO, [gk], BroadcastParams(x_shape))]


SUM: Primitive[ReduceParams] = register(Primitive(
    "sum", reduction_rule("sum"), reduction_forward("sum"), _sum_vjp, doc="Sum over axes."))


def sum_to(e: Emitter, g: Any, shape: Shape) -> Any:
    """Sum a cotangent of a broadcast shape back down to `shape` (the VJP of broadcasting)."""
    if tuple(g.shape) == shape:
        return g
    lead = len(g.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1
    )
    summed = e.apply(SUM, [g], ReduceParams(axes, False))
    if tuple(summed.shape) != shape:
        summed = e.apply(_shape.RESHAPE, [summed], _shape.ReshapeParams(shape))
    return summed


@takes_tape
def broadcast_to(tape: Tape, x: Id, shape: Sequence[int]) -> tuple[Tape, Id]:
    """numpy's `broadcast_to`: the result is materialised; its VJP sums back to x's shape."""
    node = tape.node(x, "broadcast_to", "x")
    target = tuple(_shape.shape_arg("broadcast_to", shape))
    if any(n < 0 for n in target):
        raise ShapeError(at_site(f"broadcast_to: shape {target} has a negative size"))
    if node.value.shape == target:
        return tape, x
    return record(tape, BROADCAST_TO, [x], BroadcastParams(target))


@functools.lru_cache(maxsize=4096)
def _broadcast_pair(a: Shape, b: Shape) -> Shape | None:
    """`broadcast_shapes` of two shapes, or None where they do not broadcast (the caller's
    slow path then names the problem). Cached: a model broadcasts a few pairs, every step."""
    try:
        return broadcast_shapes("broadcast", [a, b], ["a", "b"])
    except ShapeError:
        return None


def broadcast_pair(tape: Tape, a: Id, b: Id, skip: int) -> tuple[Tape, Id, Id] | None:
    """Two ids of one dtype broadcast to one shape, each broadcast recorded as `operands`
    records it, or None where `operands` must run instead (shapes that do not broadcast, an id
    not on this tape, no tape: it names the problem). A binary op's common case over ids of
    two shapes (a bias, a scale, a mask): `operands`' general checks cost several times the
    op. `skip`: the frames above this one that are tapegrad's own (see `call_site`)."""
    shape = _broadcast_pair(a.shape, b.shape)
    if shape is None or tape.__class__ is not Tape:
        return None
    nodes, length = nodes_of(tape, "broadcast_to")
    for x in (a, b):
        if not (x.index < length and nodes[x.index].id._uid == x._uid):
            return None
    site = call_site(skip + 1)
    if a.shape != shape:
        tape, a = record_checked(tape, BROADCAST_TO, a, *_broadcast_to(shape, a.dtype), site)
    if b.shape != shape:
        tape, b = record_checked(tape, BROADCAST_TO, b, *_broadcast_to(shape, b.dtype), site)
    return tape, a, b


@functools.lru_cache(maxsize=4096)
def _broadcast_to(shape: Shape, dtype: DType) -> tuple[BroadcastParams, Aval]:
    """A broadcast's (params, aval), kept per target: made for every bias added, and every
    operand `operands` broadcasts."""
    return BroadcastParams(shape), Aval(shape, dtype)


def operands(
    tape: Tape, op: str, values: Sequence[Id | Scalar], names: Sequence[str],
    floats_only: bool = True,
) -> tuple[Tape, list[Id | float]]:
    """Check ids and scalars of an elementwise op, then broadcast the ids to one shape.

    Python scalars keep the ids' dtype; float32 mixed with float64 is a DTypeError.
    """
    ids: list[tuple[str, Id]] = []
    for name, v in zip(names, values, strict=True):
        if isinstance(v, Id):
            tape.node(v, op, name)
            ids.append((name, v))
        elif not isinstance(v, float | int | bool | TracedInt):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise NotAnIdError(at_site(
                f"{op}: argument {name!r} must be an Id or a Python number, not "
                f"{type(v).__name__} ({id_hint(v)})"))
    if not ids:
        raise NotAnIdError(at_site(f"{op}: at least one operand must be an Id, not only numbers"))
    first = ids[0][1]
    if any(v.dtype != first.dtype for _, v in ids):
        desc = ", ".join(f"{name} is {dtype_name(v.dtype)}" for name, v in ids)
        raise DTypeError(at_site(
            f"{op}: operands have different dtypes ({desc}); convert one explicitly with "
            f"tg.astype(tape, x, np.float32) or np.float64"))
    if floats_only and not is_float(first.dtype):
        name = ids[0][0]
        raise DTypeError(at_site(
            f"{op}: argument {name!r} has dtype {dtype_name(first.dtype)}, expected float32 "
            "or float64 (convert with tg.astype)"))
    shape = first.shape
    if any(v.shape != shape for _, v in ids):
        shape = broadcast_shapes(op, [v.shape for _, v in ids], [name for name, _ in ids])
    out: list[Id | float] = []
    for v in values:
        if isinstance(v, Id):
            if v.shape != shape:  # validated above: the broadcast recorded directly
                tape, v = record_checked(tape, BROADCAST_TO, v,
                                         *_broadcast_to(shape, v.dtype), call_site())
            out.append(v)
        else:
            out.append(as_float(v))  # keeps a number of a tg.jit step traced
    return tape, out
