"""Shape ops: reshape, expand_dims, squeeze (no copy), transpose, slice, pad, concat, stack
(strided copies), and stop_gradient.

A reshape shares its input's buffer: values are never written after they are made, so a second
header over the same data is safe. Slice, pad and concat move data with the strided copy kernels
of `_kernels` (gather, scatter, fill) into one fresh output; their VJPs are slices and
scatters-into-zeros of the cotangent, each a primitive with a VJP of its own (second order).
"""

from __future__ import annotations

import builtins
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, SupportsIndex, cast

import numpy as np

from .._errors import (
    ArgumentTypeError,
    DTypeError,
    ShapeError,
    TapegradError,
    at_site,
    call_site,
    shown,
)
from .._fusion import block_view, pending_view
from .._kernels import (
    concat_into,
    contiguous_strides,
    embed_block,
    fill_into,
    put_rows,
    strided_gather,
    strided_scatter,
)
from .._primitive import Aval, Emitter, LinearOp, Primitive, register, transposes
from .._tape import Id, Tape, record, record_checked, record_known, record_pieces, takes_tape
from .._tensor import AnyTensor, DType, Shape, dtype_name, empty, keep_range, size_of
from .._traced import integer


@dataclass(frozen=True, slots=True)
class ReshapeParams:
    shape: Shape


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


def _representable(op: str, arg: str, dims: list[int]) -> list[int]:
    """`dims`, unless numpy could not hold an array of that shape: a size past its largest
    (2**63 - 1), or, zero-sized axes aside, more bytes than that at 8 bytes an element, the
    widest dtype's (numpy refuses (0, 2**62, 4) although it holds no element; so would
    `numpy()`, much later). A narrower dtype's limit is 2-8 times higher: refused too."""
    if any(n > _MAX_DIM for n in dims):
        raise ShapeError(at_site(f"{op}: {arg} {tuple(dims)} has a size past numpy's limit of "
                                 f"{_MAX_DIM}"))
    if 0 in dims and math.prod(n for n in dims if n > 0) > _MAX_DIM // _WIDEST:
        raise ShapeError(at_site(
            f"{op}: {arg} {tuple(dims)} is too big: beside its zero-sized axis, its other "
            f"sizes multiply past {_MAX_DIM // _WIDEST} elements, more than numpy holds at 8 "
            f"bytes an element"))
    return dims


_MAX_DIM = int(np.iinfo(np.intp).max)
_WIDEST = 8  # bytes of tapegrad's widest element (float64, int64)


def shape_arg(op: str, shape: object, arg: str = "shape") -> list[int]:
    """A shape argument (an int or a sequence of ints, numpy's integers too) as a list."""
    if shape.__class__ is tuple:  # the common case, and every internal call: plain ints
        dims = cast(tuple[object, ...], shape)
        if all(n.__class__ is int for n in dims):
            return _representable(op, arg, list(cast(tuple[int, ...], dims)))
    one = integer(shape)
    if one is not None:
        return _representable(op, arg, [one])
    if isinstance(shape, Sequence | np.ndarray) and not isinstance(shape, str):
        dims = [integer(n) for n in cast(Sequence[object], shape)]
        if all(n is not None for n in dims):
            return _representable(op, arg, [n for n in dims if n is not None])
    raise ArgumentTypeError(at_site(
        f"{op}: {arg} must be an int or a sequence of ints, got {shown(shape)}"))


def resolve_shape(op: str, size: int, shape: object) -> Shape:
    """Fill in one -1 of a requested shape, as numpy does."""
    plain = cast(tuple[object, ...], shape)
    if (plain.__class__ is tuple and all(n.__class__ is int and cast(int, n) > 0 for n in plain)
            and math.prod(cast(Shape, plain)) == size):
        return cast(Shape, plain)  # sizes that fit (every internal call): nothing to resolve
    dims = shape_arg(op, shape)
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
        _representable(op, "shape", dims)  # -1 resolved to 0 beside huge sizes
    return tuple(dims)


@takes_tape
def reshape(tape: Tape, x: Id, shape: Sequence[int] | int) -> tuple[Tape, Id]:
    """numpy's reshape (C order); one entry may be -1."""
    tape.node(x, "reshape", "x")
    dims = cast(tuple[object, ...], shape)
    plain = dims.__class__ is tuple and all(n.__class__ is int for n in dims)
    # plain ints: (params, aval) kept per shape (a model reshapes the same shapes every step)
    made = (_kept_reshape if plain else _reshape_params)(x.shape, x.dtype, shape)
    if made is None:
        return tape, x
    return record_checked(tape, RESHAPE, x, *made, call_site(_OWN))


def _reshape_params(shape: Shape, dtype: DType, wanted: object
                    ) -> tuple[ReshapeParams, Aval] | None:
    """A reshape of an x of `shape` and `dtype` to `wanted` (-1 allowed) as its (params,
    aval); None where it keeps x's shape. Bad sizes raise."""
    resolved = resolve_shape("reshape", size_of(shape), wanted)
    if resolved == shape:
        return None
    params = ReshapeParams(resolved)
    return params, _reshape_rule([Aval(shape, dtype)], params)  # the sizes checked


_kept_reshape = functools.lru_cache(maxsize=1 << 12)(_reshape_params)  # bad sizes not kept


@dataclass(frozen=True, slots=True)
class TransposeParams:
    axes: tuple[int, ...]


def split_at(shape: Shape, axis: int) -> tuple[int, int, int]:
    """(A, K, B): the sizes before, at and after `axis`, viewing an array as (A, K, B)."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


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
    return keep_range(strided_gather(x, aval.shape, [strides[a] for a in p.axes]), x)


def _transpose_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: TransposeParams,
                   needs: Sequence[bool]) -> list[Any]:
    inverse = [0] * len(p.axes)
    for i, a in enumerate(p.axes):
        inverse[a] = i
    return [e.apply(TRANSPOSE, [g], TransposeParams(tuple(inverse)))]


TRANSPOSE: Primitive[TransposeParams] = register(Primitive(
    "transpose", _transpose_rule, _transpose_forward, _transpose_vjp,
    doc="Permute axes; one strided copy. The VJP is the inverse permutation."))


@takes_tape
def transpose(tape: Tape, x: Id, axes: Sequence[int] | None = None) -> tuple[Tape, Id]:
    """numpy's transpose: `axes=None` reverses the axes."""
    tape.node(x, "transpose", "x")
    given = cast(tuple[object, ...] | None, axes)
    plain = given is None or (given.__class__ is tuple and all(a.__class__ is int for a in given))
    # plain ints: (params, aval) kept per shape (attention's heads every step)
    made = (_kept_transpose if plain else _transpose_params)(x.shape, x.dtype, axes)
    if made is None:
        return tape, x
    return record_checked(tape, TRANSPOSE, x, *made, call_site(_OWN))


def _transpose_params(shape: Shape, dtype: DType, axes: Sequence[int] | None
                      ) -> tuple[TransposeParams, Aval] | None:
    """A transpose of an x of `shape` and `dtype` by `axes` (None: reversed), checked as a
    permutation of its axes, as its (params, aval); None where it keeps the order."""
    ndim = len(shape)
    if axes is None:
        perm = tuple(reversed(range(ndim)))
    else:
        entries = _axis_list(axes)
        perm = tuple(normalize_axis("transpose", _axis_entry("transpose", a), ndim,
                                    "axes entry") for a in entries)
        if sorted(perm) != list(range(ndim)):
            raise ShapeError(at_site(
                f"transpose: axes {tuple(entries)} is not a permutation of the {ndim} axes of x "
                f"(shape {shape})"))
    if perm == tuple(range(ndim)):
        return None
    return TransposeParams(perm), Aval(tuple(shape[a] for a in perm), dtype)


_kept_transpose = functools.lru_cache(maxsize=1 << 12)(_transpose_params)  # bad axes not kept


# --- expand_dims and squeeze: free reshapes ----------------------------------------------------



def int_axis(op: str, axis: object, ndim: int) -> int:
    """One axis argument: an int in [-ndim, ndim), returned non-negative."""
    i = integer(axis)
    if i is None:
        raise ArgumentTypeError(at_site(f"{op}: axis must be an int, got {shown(axis)}"))
    return normalize_axis(op, i, ndim)


def _axis_entry(op: str, a: object) -> int:
    i = integer(a)
    if i is None:
        raise ArgumentTypeError(at_site(f"{op}: axis entries must be ints, got {shown(a)}"))
    return i


def _axis_list(axis: object) -> list[object]:
    # a str is one (wrong) entry, not a sequence of letters
    return list(cast(Sequence[object], axis)) if isinstance(axis, Sequence) and not isinstance(
        axis, str) else [axis]


def _axes_tuple(op: str, axis: object, ndim: int) -> tuple[int, ...]:
    """An int or a sequence of ints, normalised against `ndim`, with no repeats."""
    raw = _axis_list(axis)
    out: list[int] = []
    for a in raw:
        i = integer(a)
        if i is None:
            raise ArgumentTypeError(at_site(f"{op}: axis entries must be ints, got {shown(a)}"))
        out.append(normalize_axis(op, i, ndim))
    if len(set(out)) != len(out):
        raise ShapeError(at_site(f"{op}: axis {tuple(raw)} repeats an axis"))
    return tuple(out)


@takes_tape
def expand_dims(tape: Tape, x: Id, axis: int | Sequence[int]) -> tuple[Tape, Id]:
    """numpy's `expand_dims`: insert size-1 axes at `axis` (int or tuple, negatives counted
    in the result's rank). A free reshape: no copy."""
    tape.node(x, "expand_dims", "x")
    if type(axis) is int and -len(x.shape) - 1 <= axis <= len(x.shape):
        # one plain axis, the common case: its shape at once
        at = axis % (len(x.shape) + 1)
        return reshape(tape, x, (*x.shape[:at], 1, *x.shape[at:]))
    ndim = len(x.shape) + len(_axis_list(axis))
    new = _axes_tuple("expand_dims", axis, ndim)
    if not new:
        return tape, x
    rest = iter(x.shape)
    shape = tuple(1 if i in new else next(rest) for i in range(ndim))
    return reshape(tape, x, shape)


@takes_tape
def squeeze(tape: Tape, x: Id, axis: int | Sequence[int] | None = None) -> tuple[Tape, Id]:
    """numpy's `squeeze`: drop size-1 axes (all of them when `axis` is None). Naming an axis
    whose size is not 1 is a ShapeError. A free reshape: no copy."""
    tape.node(x, "squeeze", "x")
    if axis is None:
        drop = tuple(i for i, n in enumerate(x.shape) if n == 1)
    else:
        drop = _axes_tuple("squeeze", axis, len(x.shape))
        for a in drop:
            if x.shape[a] != 1:
                raise ShapeError(at_site(
                    f"squeeze: axis {a} of x (shape {x.shape}) has size {x.shape[a]}; only "
                    "axes of size 1 can be squeezed"))
    if not drop:
        return tape, x
    shape = tuple(n for i, n in enumerate(x.shape) if i not in drop)
    return reshape(tape, x, shape)


# --- slice and its transpose: strided views copied out, and scattered back into zeros ---------


@dataclass(frozen=True, slots=True)
class StridedParams:
    """A strided view of a tensor of shape `src_shape`: element idx of the view (of `shape`)
    is element `base + sum(idx * strides)` of the source in C order. Views here are
    one-to-one (no stride 0 on an axis longer than 1), so the transpose is a scatter."""

    src_shape: Shape
    shape: Shape
    strides: tuple[int, ...]
    base: int


def _slice_rule(args: Sequence[Any], p: StridedParams) -> Aval:
    (x,) = args
    if tuple(x.shape) != p.src_shape:
        raise ShapeError(at_site(
            f"slice: x has shape {tuple(x.shape)}, the slice was made for shape {p.src_shape}"))
    return Aval(p.shape, x.dtype)


def _slice_forward(dev: Any, args: Sequence[AnyTensor], p: StridedParams, aval: Aval
                   ) -> AnyTensor:
    # Rows of a block (a split's piece, x[t]) are a pending view that the kernel consuming it
    # reads in place (a transpose of it, the elementwise ops over it); else one strided copy.
    block = block_view(aval.shape, p.strides, p.base)
    if block is not None:
        view = pending_view("take", args[0], aval.shape, *block)
        if view is not None:
            return view
    return strided_gather(args[0], aval.shape, p.strides, p.base)


def _slice_grad_rule(args: Sequence[Any], p: StridedParams) -> Aval:
    (g,) = args
    if tuple(g.shape) != p.shape:
        raise ShapeError(at_site(
            f"slice_grad: g has shape {tuple(g.shape)}, expected the slice's shape {p.shape}"))
    return Aval(p.src_shape, g.dtype)


def _embed(part: AnyTensor, shape: Shape, strides: Sequence[int], base: int) -> AnyTensor:
    """A fresh tensor of `shape`: zeros, with `part` written at `base + idx * strides`."""
    block = block_view(part.shape, strides, base)
    if block is not None and part.size != size_of(shape):
        # Rows of a block (a split's piece, x[t]): pending, so that the pieces' VJPs and their
        # sum are one kernel; with fusion off, the copy kernels' put (mostly one launch).
        view = pending_view("put", part, shape, *block)
        return view if view is not None else put_rows(part, shape, *block)
    out = empty(shape, part.dtype, part.device)
    if part.size == 0:  # an empty piece: zeros, in one launch
        embed_block(part, out, out.size, 1, 0, 0)
        return out
    if part.size != out.size:  # a one-to-one view of every element needs no zeros first
        fill_into(out, 0.0)
    strided_scatter(part, out, strides, base)
    return out


def _slice_grad_forward(dev: Any, args: Sequence[AnyTensor], p: StridedParams, aval: Aval
                        ) -> AnyTensor:
    return _embed(args[0], aval.shape, p.strides, p.base)


SLICE, SLICE_GRAD = transposes(
    LinearOp("slice", _slice_rule, _slice_forward,
             "Basic indexing: one strided gather (base offset, strides may be negative). The "
             "VJP scatters the cotangent into zeros (slice_grad)."),
    LinearOp("slice_grad", _slice_grad_rule, _slice_grad_forward,
             "The transpose of a slice: zeros of the source's shape with g scattered into the "
             "sliced positions. Its VJP is the slice again."))

IndexItem = SupportsIndex | builtins.slice | EllipsisType | None
Index = IndexItem | tuple[IndexItem, ...]


def _index_error(item: object) -> TapegradError:
    kind = type(item).__name__
    if isinstance(item, Id | np.ndarray | list | bool | np.bool_):
        return DTypeError(at_site(
            f"slice: index entry of type {kind} is advanced (array) indexing, which slice does "
            "not do; slice takes ints, slices, None and ... (numpy's basic indexing). Gather by "
            "integer ids with tg.take(tape, x, indices, axis), indices an int32/int64 id"))
    return DTypeError(at_site(
        f"slice: index entry {shown(item)} of type {kind} is not an int, a slice, None or ..."))


def slice_params(shape: Shape, index: object) -> StridedParams:
    """The strided view that numpy's `x[index]` (basic indexing) takes from a C-order x."""
    if type(index) is int and shape and -shape[0] <= index < shape[0]:
        # x[t], a step of a sequence: the common index, without the parse (111 -> 84 calls)
        src_strides = contiguous_strides(shape)
        return StridedParams(shape, tuple(shape[1:]), tuple(src_strides[1:]),
                             (index % shape[0]) * src_strides[0])
    items: tuple[object, ...] = (
        cast(tuple[object, ...], index) if isinstance(index, tuple) else (index,))
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, builtins.slice)
                or integer(item) is not None):
            raise _index_error(item)
    ellipses = sum(1 for item in items if item is Ellipsis)
    if ellipses > 1:
        raise ShapeError(at_site("slice: an index can hold only one ellipsis (...)"))
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    ndim = len(shape)
    if used > ndim:
        raise ShapeError(at_site(
            f"slice: too many indices: x has shape {shape} ({ndim} axes) but {used} were "
            "indexed"))
    fill: list[object] = [builtins.slice(None)] * (ndim - used)
    if ellipses:
        at = items.index(Ellipsis)
        items = items[:at] + tuple(fill) + items[at + 1:]
    else:
        items = items + tuple(fill)
    src_strides = contiguous_strides(shape)
    out_shape: list[int] = []
    out_strides: list[int] = []
    base = 0
    axis = 0
    for item in items:
        if item is None:
            out_shape.append(1)
            out_strides.append(0)
            continue
        n, stride = shape[axis], src_strides[axis]
        if isinstance(item, builtins.slice):
            try:
                start, stop, step = item.indices(n)
            except (TypeError, ValueError) as err:
                error = ShapeError if isinstance(err, ValueError) else DTypeError
                raise error(at_site(
                    f"slice: bad slice {shown(item)} for axis {axis} (size {n}): {err}")) from None
            count = len(range(start, stop, step))
            out_shape.append(count)
            out_strides.append(step * stride)
            if count:
                base += start * stride
        else:
            i = integer(item)
            assert i is not None
            if not -n <= i < n:
                raise ShapeError(at_site(
                    f"slice: index {i} is out of bounds for axis {axis} with size {n} (x has "
                    f"shape {shape})"))
            base += (i % n) * stride
        axis += 1
    return StridedParams(shape, tuple(out_shape), tuple(out_strides), base)


@takes_tape
def slice(tape: Tape, x: Id, index: Index) -> tuple[Tape, Id]:
    """numpy's basic indexing `x[index]`: ints (negative count from the end), slices with any
    step (negative too), None (a new axis), ... and tuples of those.

    `tg.slice(tape, x, np.s_[1:, ::-2])`. One strided copy; an index that keeps every element
    in order (`...`, `None`, an int on a size-1 axis) is a free reshape. Arrays, lists and ids
    as indices (advanced indexing) are refused: use `tg.take`.
    """
    tape.node(x, "slice", "x")
    # x[t] or x[:, t], a step of a sequence: its view kept per shape and index
    key = index if type(index) is int else _index_key(index)
    if key is not None:
        view = _kept_view(x.shape, x.dtype, key)
        if view is not None:
            return record_checked(tape, SLICE, x, *view, call_site(_OWN))
    return _view(tape, x, slice_params(x.shape, index))


_OWN = 2  # the frames from a public op's body up to its caller: the op and `takes_tape`'s
_PLAIN_BOUNDS = (int, type(None))


def _index_key(index: object) -> tuple[object, ...] | None:
    """A hashable form of a tuple index of plain ints, slices of plain ints, None and ...
    (a slice as its (start, stop, step)); None for anything else, which is parsed each time
    (a traced int of `tg.jit`, a numpy integer, an error to name). Slices do not hash in
    Python 3.11."""
    if type(index) is not tuple:
        return None
    key: list[object] = []
    for item in cast(tuple[object, ...], index):
        if type(item) is int or item is None or item is Ellipsis:
            key.append(item)
        elif (type(item) is builtins.slice and type(item.start) in _PLAIN_BOUNDS
              and type(item.stop) in _PLAIN_BOUNDS and type(item.step) in _PLAIN_BOUNDS):
            key.append((item.start, item.stop, item.step))
        else:
            return None
    return tuple(key)


@functools.lru_cache(maxsize=1 << 12)
def _kept_view(shape: Shape, dtype: DType, key: int | tuple[object, ...]
               ) -> tuple[StridedParams, Aval] | None:
    """x[index] of an x of `shape` and `dtype` as a slice's (params, aval), kept per shape and
    index (`key`: an int, or `_index_key`'s form); None where it is a free reshape (`_view`)."""
    index: object = key if type(key) is int else tuple(
        builtins.slice(*cast(tuple[int | None, ...], item)) if type(item) is tuple else item
        for item in cast(tuple[object, ...], key))
    p = slice_params(shape, index)
    return None if _reshapes(shape, p) else (p, Aval(p.shape, dtype))


def _reshapes(shape: Shape, p: StridedParams) -> bool:
    """Whether the view `p` of a tensor of `shape` keeps every element in order."""
    return p.base == 0 and size_of(p.shape) == size_of(shape) and all(
        s == c for n, s, c in zip(p.shape, p.strides, contiguous_strides(p.shape), strict=True)
        if n != 1)


def _view(tape: Tape, x: Id, p: StridedParams) -> tuple[Tape, Id]:
    """Record the strided view `p` of x: a free reshape where it keeps every element in
    order, else one strided copy (`slice`'s node)."""
    if _reshapes(x.shape, p):
        return reshape(tape, x, p.shape)
    return record(tape, SLICE, [x], p)


# --- pad ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PadParams:
    widths: tuple[tuple[int, int], ...]


def _padded(shape: Shape, p: PadParams) -> tuple[Shape, list[int], int]:
    """The padded shape, its C strides, and where x's first element lands."""
    out = tuple(n + b + a for n, (b, a) in zip(shape, p.widths, strict=True))
    strides = contiguous_strides(out)
    return out, strides, builtins.sum(b * s for (b, _), s in zip(p.widths, strides, strict=True))


def _pad_rule(args: Sequence[Any], p: PadParams) -> Aval:
    (x,) = args
    if len(p.widths) != len(x.shape):
        raise ShapeError(at_site(
            f"pad: pad_width has {len(p.widths)} (before, after) pairs but x has "
            f"{len(x.shape)} axes (shape {tuple(x.shape)})"))
    return Aval(_padded(tuple(x.shape), p)[0], x.dtype)


def _pad_forward(dev: Any, args: Sequence[AnyTensor], p: PadParams, aval: Aval) -> AnyTensor:
    (x,) = args
    _, strides, base = _padded(x.shape, p)
    return _embed(x, aval.shape, strides, base)


def _pad_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: PadParams,
             needs: Sequence[bool]) -> list[Any]:
    shape: Shape = tuple(args[0].shape)
    padded, strides, base = _padded(shape, p)
    return [e.apply(SLICE, [g], StridedParams(padded, shape, tuple(strides), base))]


PAD: Primitive[PadParams] = register(Primitive(
    "pad", _pad_rule, _pad_forward, _pad_vjp,
    doc="Zero padding, (before, after) per axis: zeros, then one strided scatter of x. The "
        "VJP slices the cotangent."))

PadWidth = int | Sequence[int] | Sequence[Sequence[int]]


def _pad_widths(pad_width: object, ndim: int) -> tuple[tuple[int, int], ...]:
    """numpy's pad_width forms: n, (n,), (before, after), ((before, after),), or one pair per
    axis."""
    def ints(v: object) -> list[int] | None:
        one = integer(v)
        if one is not None:
            return [one]
        if isinstance(v, Sequence | np.ndarray) and not isinstance(v, str):
            out: list[int] = []
            for w in cast(Sequence[object], v):
                i = integer(w)
                if i is None:
                    return None
                out.append(i)
            return out
        return None

    pairs: list[tuple[int, int]] | None = None
    flat = ints(pad_width)
    if flat is not None and len(flat) in (1, 2):
        pairs = [(flat[0], flat[-1])] * ndim
    elif flat is None and isinstance(pad_width, Sequence | np.ndarray):
        rows = [ints(r) for r in cast(Sequence[object], pad_width)]
        if all(r is not None and len(r) in (1, 2) for r in rows) and len(rows) in (1, ndim):
            found = [(r[0], r[-1]) for r in rows if r is not None]
            pairs = found * ndim if len(found) == 1 else found
    if pairs is None:
        raise ShapeError(at_site(
            f"pad: pad_width {shown(pad_width)} is not one (before, after) pair of ints per axis "
            f"of x ({ndim} axes), nor a single int or pair for every axis"))
    if any(b < 0 or a < 0 for b, a in pairs):
        raise ShapeError(at_site(f"pad: pad_width {shown(pad_width)} holds a negative width; "
                                 "widths must be >= 0"))
    return tuple(pairs)


@takes_tape
def pad(tape: Tape, x: Id, pad_width: PadWidth) -> tuple[Tape, Id]:
    """numpy's `pad` with zeros: `pad_width` is ((before, after), ...) per axis, or numpy's
    shorthands (an int, or one pair, for every axis). Widths are non-negative."""
    tape.node(x, "pad", "x")
    widths = _pad_widths(pad_width, len(x.shape))
    if all(b == 0 and a == 0 for b, a in widths):
        return tape, x
    return record(tape, PAD, [x], PadParams(widths))


# --- concat and stack -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConcatParams:
    """`new`: the parts (of one shape) are stacked along a new axis `axis` (`stack`), each
    viewed with a size-1 axis there."""

    axis: int
    new: bool = False


def _check_parts(op: str, parts: Sequence[Any], axis: int | None) -> None:
    """Same dtype and rank, equal sizes except on `axis` (None: on every axis)."""
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if part.dtype != first.dtype:
            raise DTypeError(at_site(
                f"{op}: operand {i} has dtype {dtype_name(part.dtype)} but operand 0 has "
                f"{dtype_name(first.dtype)}; convert one explicitly with tg.astype"))
        if len(part.shape) != len(first.shape):
            raise ShapeError(at_site(
                f"{op}: operand {i} has shape {tuple(part.shape)} ({len(part.shape)} axes) but "
                f"operand 0 has shape {tuple(first.shape)} ({len(first.shape)} axes)"))
        for a, (n, m) in enumerate(zip(first.shape, part.shape, strict=True)):
            if a != axis and n != m:
                where = ("" if axis is None else
                         f" (every axis but the concat axis {axis} must match)")
                raise ShapeError(at_site(
                    f"{op}: operand {i} has shape {tuple(part.shape)} but operand 0 has shape "
                    f"{tuple(first.shape)}: axis {a} has size {m}, expected {n}{where}"))


def _concat_rule(args: Sequence[Any], p: ConcatParams) -> Aval:
    if not args or not 0 <= p.axis < len(args[0].shape) + p.new:
        raise ShapeError(at_site(f"concat: axis {p.axis} does not fit the operands"))
    first = args[0]
    if p.new:
        _check_parts("stack", args, None)
        return Aval((*first.shape[:p.axis], len(args), *first.shape[p.axis:]), first.dtype)
    _check_parts("concat", args, p.axis)
    size = builtins.sum(a.shape[p.axis] for a in args)
    shape = (*first.shape[: p.axis], size, *first.shape[p.axis + 1:])
    return Aval(shape, first.dtype)


def _concat_forward(dev: Any, args: Sequence[AnyTensor], p: ConcatParams, aval: Aval
                    ) -> AnyTensor:
    out = empty(aval.shape, aval.dtype, dev)
    if p.new:  # each part one slab of the new axis
        slab = (*aval.shape[:p.axis], 1, *aval.shape[p.axis + 1:])
        args = [part.with_shape(slab) for part in args]
    concat_into(out, args, p.axis)
    return keep_range(out, *(part for part in args if part.size))


def _concat_vjp(e: Emitter, g: Any, out: Any, args: Sequence[Any], p: ConcatParams,
                needs: Sequence[bool]) -> list[Any]:
    shape: Shape = tuple(g.shape)
    strides = tuple(contiguous_strides(shape))
    # A stacked part's slab drops the new axis (its view has no stride there).
    part_strides = strides[:p.axis] + strides[p.axis + 1:] if p.new else strides
    grads: list[Any] = []
    offset = 0
    for part, wanted in zip(args, needs, strict=True):
        part_shape: Shape = tuple(part.shape)
        grads.append(e.apply(SLICE, [g], StridedParams(
            shape, part_shape, part_strides, offset * strides[p.axis])) if wanted else None)
        offset += 1 if p.new else part_shape[p.axis]
    return grads


CONCAT: Primitive[ConcatParams] = register(Primitive(
    "concat", _concat_rule, _concat_forward, _concat_vjp,
    doc="Join tensors along an axis, or stack them along a new one: one fresh output, up to "
        "eight parts written by one launch. The VJP slices the cotangent into the parts."))


def _operands(tape: Tape, op: str, xs: Sequence[Id]) -> list[Id]:
    if isinstance(xs, Id) or not isinstance(xs, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise DTypeError(at_site(
            f"{op}: takes a list of ids, e.g. tg.{op}(tape, [a, b], axis=0), not "
            f"{type(xs).__name__}"))
    parts = list(xs)
    if not parts:
        raise ShapeError(at_site(f"{op}: needs at least one operand, got an empty list"))
    for i, part in enumerate(parts):
        tape.node(part, op, f"operand {i}")
    return parts


@takes_tape
def concat(tape: Tape, xs: Sequence[Id], axis: int = 0) -> tuple[Tape, Id]:
    """numpy's `concatenate` of a list of ids along `axis` (negative allowed). Operands share
    their dtype and every size but the one on `axis`."""
    parts = _operands(tape, "concat", xs)
    ndim = len(parts[0].shape)
    if ndim == 0:
        raise ShapeError(at_site(
            "concat: operand 0 has shape () and rank-0 tensors cannot be concatenated; "
            "use tg.stack"))
    a = int_axis("concat", axis, ndim)
    if len(parts) == 1:
        return tape, parts[0]
    params = ConcatParams(a)
    # the operands looked up: the rule's checks and aval, then the node (not record's loop)
    return record_known(tape, CONCAT, tuple(parts), params, _concat_rule(parts, params),
                        call_site(_OWN))


@takes_tape
def stack(tape: Tape, xs: Sequence[Id], axis: int = 0) -> tuple[Tape, Id]:
    """numpy's `stack`: join equal-shape ids along a new axis `axis` (negative counts in the
    result's rank). Recorded as one concat of the parts, each a slab of the new axis."""
    parts = _operands(tape, "stack", xs)
    a = int_axis("stack", axis, len(parts[0].shape) + 1)
    if len(parts) == 1:
        return expand_dims(tape, parts[0], a)
    params = ConcatParams(a, new=True)
    return record_known(tape, CONCAT, tuple(parts), params, _concat_rule(parts, params),
                        call_site(_OWN))


# --- split: slices along one axis ---------------------------------------------------------------


def _split_bounds(sections_or_indices: object, size: int) -> list[tuple[int, int | None]]:
    """(start, stop) of each piece, as numpy's `split` cuts an axis of `size`: N equal pieces
    for an int N, or the pieces between the given cut points (Python slice bounds: negative
    counts from the end, past the end clamps, a cut before the previous one gives an empty
    piece)."""
    sections = integer(sections_or_indices)
    if sections is not None:
        if sections <= 0:
            raise ShapeError(at_site(
                f"split: sections_or_indices {sections} must be a positive number of sections"))
        if size % sections:
            raise ShapeError(at_site(
                f"split: array split does not result in an equal division: an axis of size "
                f"{size} cannot be cut into {sections} equal sections (give a list of cut "
                "points for unequal pieces)"))
        each = size // sections
        return [(i * each, (i + 1) * each) for i in range(sections)]
    if not isinstance(sections_or_indices, Sequence | np.ndarray) or isinstance(
            sections_or_indices, str):
        raise ArgumentTypeError(at_site(
            f"split: sections_or_indices must be an int (equal sections) or a sequence of int "
            f"cut points, got {shown(sections_or_indices)}"))
    cuts: list[int] = []
    for cut in cast(Sequence[object], sections_or_indices):
        found = integer(cut)
        if found is None:
            raise ArgumentTypeError(at_site(
                f"split: cut points must be ints, got {shown(cut)} in "
                f"{shown(sections_or_indices)}"))
        cuts.append(found)
    starts: list[int] = [0, *cuts]
    stops: list[int | None] = [*cuts, None]
    return list(zip(starts, stops, strict=True))


_EQUAL_PIECES_KEPT = 64  # sections kept at most: a sequence cut into its rows is made anew


def _equal_pieces(shape: Shape, dtype: DType, sections: int, a: int
                  ) -> tuple[tuple[StridedParams, Aval], ...]:
    """Each piece's (params, aval) of x (`shape`, `dtype`) cut into `sections` (at least 2,
    dividing the axis) along axis `a`: every piece a slice's node. Kept per shape up to
    _EQUAL_PIECES_KEPT sections, so that a loop splitting the same gates every step skips the
    bounds and the params (an LSTM step's splits were a third of its forward's host time)."""
    if sections <= _EQUAL_PIECES_KEPT:
        return _kept_pieces(shape, dtype, sections, a)
    return _make_pieces(shape, dtype, sections, a)


def _make_pieces(shape: Shape, dtype: DType, sections: int, a: int
                 ) -> tuple[tuple[StridedParams, Aval], ...]:
    strides = tuple(contiguous_strides(shape))
    each = shape[a] // sections
    piece = (*shape[:a], each, *shape[a + 1:])
    aval = Aval(piece, dtype)
    return tuple((StridedParams(shape, piece, strides, i * each * strides[a]), aval)
                 for i in range(sections))


_kept_pieces = functools.lru_cache(maxsize=1 << 10)(_make_pieces)


@takes_tape
def split(tape: Tape, x: Id, sections_or_indices: int | Sequence[int], axis: int = 0
          ) -> tuple[Tape, list[Id]]:
    """numpy's `split` along `axis` (negative allowed): an int N cuts the axis into N equal
    pieces (N must divide it, else ShapeError, numpy's ValueError); a sequence of cut points
    [i, j, ...] gives x[:i], x[i:j], ..., x[last:] along the axis, with Python's slice bounds
    (empty pieces allowed). Returns the tape and the list of pieces; each piece is a `slice`,
    so gradients flow back to x."""
    tape.node(x, "split", "x")
    a = int_axis("split", axis, len(x.shape))
    shape: Shape = tuple(x.shape)
    sections = sections_or_indices
    if type(sections) is int and 1 < sections <= shape[a] and not shape[a] % sections:
        # Equal pieces, none empty or all of x: each a slice's node (the common case).
        return record_pieces(tape, SLICE, x, _equal_pieces(shape, x.dtype, sections, a),
                             call_site(_OWN))
    pieces: list[Id] = []
    strides = tuple(contiguous_strides(shape))
    n = shape[a]
    site = call_site()
    shapes: dict[int, Shape] = {}  # pieces of one size share their shape's tuple
    for start, stop in _split_bounds(sections_or_indices, n):
        # x[..., start:stop] along the axis as `slice` would record it, its view made here
        # rather than parsed from an index (an LSTM's gates: 105 -> 78 calls a piece).
        lo, hi, _ = builtins.slice(start, stop).indices(n)
        count = max(hi - lo, 0)
        piece = shapes.get(count)
        if piece is None:
            piece = shapes[count] = (*shape[:a], count, *shape[a + 1:])
        params = StridedParams(shape, piece, strides, lo * strides[a] if count else 0)
        if not 0 < count < n:  # empty, or all of x (a free reshape): as `slice` records it
            tape, piece = _view(tape, x, params)
        else:  # `slice`'s node, its operand checked here
            tape, piece = record_checked(tape, SLICE, x, params, Aval(params.shape, x.dtype),
                                         site)
        pieces.append(piece)
    return tape, pieces


# --- stop_gradient ----------------------------------------------------------------------------


def _stop_rule(args: Sequence[Any], p: None) -> Aval:
    (x,) = args
    return Aval(tuple(x.shape), x.dtype)


def _stop_forward(dev: Any, args: Sequence[AnyTensor], p: None, aval: Aval) -> AnyTensor:
    return args[0]


STOP_GRADIENT: Primitive[None] = register(Primitive(
    "stop_gradient", _stop_rule, _stop_forward, None,
    doc="x's value (no copy) as a constant: the node takes no gradient and passes none."))


@takes_tape
def stop_gradient(tape: Tape, x: Id) -> tuple[Tape, Id]:
    """x's value as a constant: no copy; the node has requires_grad False and no VJP, so no
    gradient flows through it to x."""
    tape.node(x, "stop_gradient", "x")
    return record(tape, STOP_GRADIENT, [x])
