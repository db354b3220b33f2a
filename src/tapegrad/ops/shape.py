"""Shape ops: reshape (no copy), transpose (one strided copy).

A reshape shares its input's buffer: values are never written after they are made, so a second
header over the same data is safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ShapeError, at_site
from .._kernels import contiguous_strides, strided_gather
from .._primitive import Aval, Emitter, Primitive, register
from .._tape import Id, Tape, record
from .._tensor import AnyTensor, Shape, size_of


class ReshapeParams:
    __slots__ = ("shape",)

    def __init__(self, shape: Shape) -> None:
        self.shape = shape


def _reshape_rule(args: Sequence[Any], p: ReshapeParams) -> Aval:
    (x,) = args
    if size_of(p.shape) != size_of(x.shape):
        raise ShapeError(at_site(
            f"reshape: cannot reshape x of shape {x.shape} ({size_of(x.shape)} elements) to "
            f"{p.shape} ({size_of(p.shape)} elements)"))
    return Aval(p.shape, x.dtype)


def _reshape_forward(dev: Any, args: Sequence[AnyTensor], p: ReshapeParams, aval: Aval
                     ) -> AnyTensor:
    return args[0].with_shape(aval.shape)


def _reshape_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ReshapeParams,
                 needs: Sequence[bool]) -> list[Any]:
    return [e.apply(RESHAPE, [g], ReshapeParams(args[0].shape))]


RESHAPE: Primitive[ReshapeParams] = register(Primitive(
    "reshape", _reshape_rule, _reshape_forward, _reshape_vjp,
    doc="The same elements in C order under another shape; no copy."))


def resolve_shape(op: str, size: int, shape: Sequence[int]) -> Shape:
    """Fill in one -1 of a requested shape, as numpy does."""
    dims = [int(n) for n in shape]
    unknown = [i for i, n in enumerate(dims) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in dims):
        raise ShapeError(at_site(
            f"{op}: shape {tuple(dims)} may hold one -1 and otherwise sizes >= 0"))
    if unknown:
        known = size_of(tuple(n for n in dims if n != -1))
        if known == 0 or size % known:
            raise ShapeError(at_site(
                f"{op}: cannot reshape {size} elements to {tuple(dims)}: -1 has no whole size"))
        dims[unknown[0]] = size // known
    return tuple(dims)


def reshape(tape: Tape, x: Id, shape: Sequence[int] | int) -> tuple[Tape, Id]:
    """numpy's reshape (C order); one entry may be -1."""
    tape.node(x, "reshape", "x")
    wanted = resolve_shape("reshape", size_of(x.shape), (shape,) if isinstance(shape, int)
                           else shape)
    if wanted == x.shape:
        return tape, x
    return record(tape, RESHAPE, [x], ReshapeParams(wanted))


class TransposeParams:
    __slots__ = ("axes",)

    def __init__(self, axes: tuple[int, ...]) -> None:
        self.axes = axes


def normalize_axis(op: str, axis: int, ndim: int, arg: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ShapeError(at_site(
            f"{op}: {arg} {axis} is out of range for a tensor of rank {ndim} "
            f"(valid: {-ndim}..{ndim - 1})" if ndim else
            f"{op}: {arg} {axis} is out of range for a tensor of rank 0 (it has no axes)"))
    return axis % ndim


def _transpose_rule(args: Sequence[Any], p: TransposeParams) -> Aval:
    (x,) = args
    return Aval(tuple(x.shape[a] for a in p.axes), x.dtype)


def _transpose_forward(dev: Any, args: Sequence[AnyTensor], p: TransposeParams, aval: Aval
                       ) -> AnyTensor:
    (x,) = args
    strides = contiguous_strides(x.shape)
    return strided_gather(x, aval.shape, [strides[a] for a in p.axes])


def _transpose_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: TransposeParams,
                   needs: Sequence[bool]) -> list[Any]:
    inverse = [0] * len(p.axes)
    for i, a in enumerate(p.axes):
        inverse[a] = i
    return [e.apply(TRANSPOSE, [g], TransposeParams(tuple(inverse)))]


TRANSPOSE: Primitive[TransposeParams] = register(Primitive(
    "transpose", _transpose_rule, _transpose_forward, _transpose_vjp,
    doc="Permute axes; one strided copy. The VJP is the inverse permutation."))


def transpose(tape: Tape, x: Id, axes: Sequence[int] | None = None) -> tuple[Tape, Id]:
    """numpy's transpose: `axes=None` reverses the axes."""
    tape.node(x, "transpose", "x")
    ndim = len(x.shape)
    if axes is None:
        perm = tuple(reversed(range(ndim)))
    else:
        perm = tuple(normalize_axis("transpose", int(a), ndim, "axes entry") for a in axes)
        if sorted(perm) != list(range(ndim)):
            raise ShapeError(at_site(
                f"transpose: axes {tuple(axes)} is not a permutation of the {ndim} axes of x "
                f"(shape {x.shape})"))
    if perm == tuple(range(ndim)):
        return tape, x
    return record(tape, TRANSPOSE, [x], TransposeParams(perm))
