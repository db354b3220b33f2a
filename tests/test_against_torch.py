"""Every public op against PyTorch in float64: values, first and second order gradients.

Outside suites compare tapegrad with PyTorch through SPEC's exact signatures; this file does
the same. Each row of the table is an op call with SPEC's keywords and the PyTorch expression
that computes the same thing; it is checked for its forward value, its VJP (through
`tg.backward` with a random cotangent, and through `tg.grad`), and its VJP's VJP (through
`tg.backward_on_tape`) at rtol 1e-10 in float64, and spot-checked in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import pytest

import tapegrad as tg
from cases import draw_inputs
from cases_scan import split_join

torch: Any = pytest.importorskip("torch")
F: Any = torch.nn.functional

Array = np.ndarray[Any, Any]
Out = tuple[tg.Tape, tg.Id]
TgFn = Callable[..., Out]
TorchFn = Callable[..., Any]

RTOL64, ATOL64 = 1e-10, 1e-12
RTOL32, ATOL32 = 1e-5, 1e-5


@dataclass(frozen=True)
class Row:
    """One op call: `fn(tape, *float_ids, *int_ids)` against `ref(*float_tensors, *ints)`."""

    name: str
    fn: TgFn
    ref: TorchFn
    shapes: tuple[tuple[int, ...], ...]
    domain: str = "any"  # "any", "positive", "away0" (|x| >= 0.2)
    ints: tuple[Array, ...] = field(default=())
    second: bool = True  # also compare the gradient of the gradient
    f32_rtol: float = RTOL32
    f32_atol: float = ATOL32  # forward only, relative to the largest |value| (at least 1)
    data: tuple[Array, ...] = field(default=())  # fixed float inputs (ties, zeros, extremes)

    def inputs(self, seed: int = 0) -> list[Array]:
        if self.data:
            return [np.asarray(a, np.float64) for a in self.data]
        return draw_inputs(self.shapes, self.domain, seed)


def _t(a: Array, grad: bool = False) -> Any:
    return torch.tensor(a, requires_grad=grad)


# --- the table -------------------------------------------------------------------------------

ROWS: list[Row] = []


# Overloads by arity type the lambdas of the table (their parameters are ids and tensors).
Shape = tuple[int, ...]
T = tg.Tape


@overload
def row(name: str, fn: Callable[[T, Any], Out], ref: Callable[[Any], Any], *shapes: Shape,
        **kw: Any) -> None: ...
@overload
def row(name: str, fn: Callable[[T, Any, Any], Out], ref: Callable[[Any, Any], Any],
        *shapes: Shape, **kw: Any) -> None: ...
@overload
def row(name: str, fn: Callable[[T, Any, Any, Any], Out], ref: Callable[[Any, Any, Any], Any],
        *shapes: Shape, **kw: Any) -> None: ...
@overload
def row(name: str, fn: Callable[[T, Any, Any, Any, Any], Out],
        ref: Callable[[Any, Any, Any, Any], Any], *shapes: Shape, **kw: Any) -> None: ...
def row(name: str, fn: TgFn, ref: TorchFn, *shapes: Shape, **kw: Any) -> None:
    ROWS.append(Row(name, fn, ref, tuple(shapes), **kw))


# Elementwise, with broadcasting: size-1 axes, rank mismatch, and scalars on either side.
_PAIRS = [((3, 4), (3, 4)), ((2, 1, 4), (3, 1)), ((4,), (2, 3, 4)), ((), (2, 3))]
_BINARY: list[tuple[str, Callable[[tg.Tape, Any, Any], Out], Callable[[Any, Any], Any], str]] = [
    ("add", tg.add, torch.add, "any"),
    ("sub", tg.sub, torch.sub, "any"),
    ("mul", tg.mul, torch.mul, "any"),
    ("div", tg.div, torch.div, "away0"),
    ("pow", tg.pow, torch.pow, "positive"),
    ("maximum", tg.maximum, torch.maximum, "any"),
    ("minimum", tg.minimum, torch.minimum, "any"),
]
for _name, _fn, _ref, _domain in _BINARY:
    for _sa, _sb in _PAIRS:
        row(f"{_name}{_sa}{_sb}", _fn, _ref, _sa, _sb, domain=_domain)
    row(f"{_name}_scalar_right", lambda t, a, f=_fn: f(t, a, 1.5),
        lambda a, r=_ref: r(a, torch.tensor(1.5, dtype=a.dtype)), (2, 3), domain=_domain)
    row(f"{_name}_scalar_left", lambda t, a, f=_fn: f(t, 0.75, a),
        lambda a, r=_ref: r(torch.tensor(0.75, dtype=a.dtype), a), (2, 3), domain=_domain)
row("pow_int_scalar", lambda t, a: tg.pow(t, a, 3), lambda a: a**3, (2, 3))
row("pow_negative_base_int_exponent", lambda t, a: tg.pow(t, a, 2.0), lambda a: a**2.0, (5,))

_UNARY: list[tuple[str, Callable[[tg.Tape, Any], Out], Callable[[Any], Any], str]] = [
    ("neg", tg.neg, torch.neg, "any"),
    ("exp", tg.exp, torch.exp, "any"),
    ("log", tg.log, torch.log, "positive"),
    ("sqrt", tg.sqrt, torch.sqrt, "positive"),
    ("abs", tg.abs, torch.abs, "away0"),
    ("tanh", tg.tanh, torch.tanh, "any"),
    ("sigmoid", tg.sigmoid, torch.sigmoid, "any"),
    ("relu", tg.relu, torch.relu, "away0"),
    ("gelu", tg.gelu, F.gelu, "any"),
    ("gelu_tanh", lambda t, x: tg.gelu(t, x, approximate="tanh"),
     lambda x: F.gelu(x, approximate="tanh"), "any"),
    ("gelu_none_keyword", lambda t, x: tg.gelu(t, x, approximate="none"), F.gelu, "any"),
    ("softplus", tg.softplus, F.softplus, "any"),
    ("silu", tg.silu, F.silu, "any"),
    ("leaky_relu", tg.leaky_relu, F.leaky_relu, "away0"),
    ("leaky_relu_slope", lambda t, x: tg.leaky_relu(t, x, negative_slope=0.2),
     lambda x: F.leaky_relu(x, negative_slope=0.2), "away0"),
    ("elu", tg.elu, F.elu, "away0"),
    ("elu_alpha", lambda t, x: tg.elu(t, x, alpha=1.5), lambda x: F.elu(x, alpha=1.5), "away0"),
    ("log1p", tg.log1p, torch.log1p, "positive"),
    ("expm1", tg.expm1, torch.expm1, "any"),
    ("sin", tg.sin, torch.sin, "any"),
    ("cos", tg.cos, torch.cos, "any"),
    ("erf", tg.erf, torch.erf, "any"),
]
for _name, _fn, _ref, _domain in _UNARY:
    row(_name, _fn, _ref, (3, 4), domain=_domain)
    row(f"{_name}_rank0", _fn, _ref, (), domain=_domain)

# Comparisons and logical ops give bool masks, which take no gradient: each feeds where, whose
# branches carry the gradient. Broadcasting, and Python numbers on either side.
_COMPARE: list[tuple[str, Callable[[tg.Tape, Any, Any], Out], Callable[[Any, Any], Any]]] = [
    ("greater", tg.greater, torch.gt), ("greater_equal", tg.greater_equal, torch.ge),
    ("less", tg.less, torch.lt), ("less_equal", tg.less_equal, torch.le),
    ("equal", tg.equal, torch.eq), ("not_equal", tg.not_equal, torch.ne),
]


def _where_mask(t: tg.Tape, compare: Callable[[tg.Tape, Any, Any], Out], a: Any, b: Any,
                x: Any, y: Any) -> Out:
    t, mask = compare(t, a, b)
    return tg.where(t, mask, x, y)


for _name, _fn, _ref in _COMPARE:
    row(f"where_{_name}(3, 1)(4,)", lambda t, a, b, f=_fn: _where_mask(t, f, a, b, a, b),
        lambda a, b, r=_ref: torch.where(r(a, b), a, b), (3, 1), (4,))
    row(f"where_{_name}_scalar_right", lambda t, a, f=_fn: _where_mask(t, f, a, 0.25, a, 0.0),
        lambda a, r=_ref: torch.where(r(a, 0.25), a, torch.zeros((), dtype=a.dtype)), (2, 3))
    row(f"where_{_name}_scalar_left", lambda t, a, f=_fn: _where_mask(t, f, -0.5, a, 1.0, a),
        lambda a, r=_ref: torch.where(r(torch.tensor(-0.5, dtype=a.dtype), a),
                                      torch.ones((), dtype=a.dtype), a), (2, 3))


def _where_logical(t: tg.Tape, a: tg.Id, b: tg.Id, op: str) -> Out:
    t, p = tg.greater(t, a, 0.0)
    t, q = tg.less_equal(t, b, 0.3)
    if op == "not":
        t, m = tg.logical_not(t, p)
    else:
        t, m = (tg.logical_and if op == "and" else tg.logical_or)(t, p, q)
    return tg.where(t, m, a, b)


row("where_logical_and", lambda t, a, b: _where_logical(t, a, b, "and"),
    lambda a, b: torch.where(torch.logical_and(a > 0, b <= 0.3), a, b), (3, 1), (4,))
row("where_logical_or", lambda t, a, b: _where_logical(t, a, b, "or"),
    lambda a, b: torch.where(torch.logical_or(a > 0, b <= 0.3), a, b), (2, 4), (4,))
row("where_logical_not", lambda t, a, b: _where_logical(t, a, b, "not"),
    lambda a, b: torch.where(torch.logical_not(a > 0), a, b), (3, 4), (3, 4))

_BOOL = np.array([[True, False, True, True], [False, False, True, False], [True, True, False,
                                                                            False]])
row("where", lambda t, a, b, c: tg.where(t, c, a, b),
    lambda a, b, c: torch.where(torch.tensor(c), a, b), (3, 4), (3, 4), ints=(_BOOL,))
row("where_broadcast", lambda t, a, b, c: tg.where(t, c, a, b),
    lambda a, b, c: torch.where(torch.tensor(c != 0), a, b), (3, 1), (4,),
    ints=(_BOOL.astype(np.int64),))
row("where_scalar_b", lambda t, a, c: tg.where(t, c, a, 0.5),
    lambda a, c: torch.where(torch.tensor(c), a, torch.tensor(0.5, dtype=a.dtype)), (3, 4),
    ints=(_BOOL,))
row("where_int32_cond", lambda t, a, b, c: tg.where(t, c, a, b),
    lambda a, b, c: torch.where(torch.tensor(c != 0), a, b), (3, 4), (3, 4),
    ints=(_BOOL.astype(np.int32) * 7,))
row("clip", lambda t, x: tg.clip(t, x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7), (4, 5))
row("clip_lo_only", lambda t, x: tg.clip(t, x, -0.5, None), lambda x: torch.clamp(x, min=-0.5),
    (4, 5))
row("clip_hi_only", lambda t, x: tg.clip(t, x, None, 0.1), lambda x: torch.clamp(x, max=0.1),
    (4, 5))
row("clip_int_bounds", lambda t, x: tg.clip(t, x, -1, 1), lambda x: torch.clamp(x, -1, 1), (4, 5))
row("astype_same", lambda t, x: tg.astype(t, x, np.float64) if x.dtype == np.float64
    else tg.astype(t, x, np.float32), lambda x: x, (3,))

# Reductions: axis None, int, negative, tuple; keepdims.
_AXES: list[Any] = [None, 0, -1, 1, (0, 2), (-1, 0), (), (0, 1, 2)]


def _dims(axis: Any, ndim: int) -> Any:
    if axis is None:
        return tuple(range(ndim))
    return axis


def _numpy_axes(fn: TorchFn) -> TorchFn:
    """torch reduces every axis for dim=(); numpy (and tapegrad) reduce none."""
    def ref(x: Any, dim: Any, keepdim: bool) -> Any:
        return x * 1.0 if dim == () else fn(x, dim=dim, keepdim=keepdim)
    return ref


_SUM, _MEAN = _numpy_axes(torch.sum), _numpy_axes(torch.mean)


for _axis in _AXES:
    for _keep in (False, True):
        _tag = f"axis={_axis},keepdims={_keep}"
        row(f"sum[{_tag}]", lambda t, x, a=_axis, k=_keep: tg.sum(t, x, axis=a, keepdims=k),
            lambda x, a=_axis, k=_keep: _SUM(x, _dims(a, 3), k), (2, 3, 4))
        row(f"mean[{_tag}]", lambda t, x, a=_axis, k=_keep: tg.mean(t, x, axis=a, keepdims=k),
            lambda x, a=_axis, k=_keep: _MEAN(x, _dims(a, 3), k), (2, 3, 4))
        if _axis != ():
            row(f"max[{_tag}]", lambda t, x, a=_axis, k=_keep: tg.max(t, x, axis=a, keepdims=k),
                lambda x, a=_axis, k=_keep: torch.amax(x, dim=_dims(a, 3), keepdim=k),
                (2, 3, 4))
            row(f"min[{_tag}]", lambda t, x, a=_axis, k=_keep: tg.min(t, x, axis=a, keepdims=k),
                lambda x, a=_axis, k=_keep: torch.amin(x, dim=_dims(a, 3), keepdim=k),
                (2, 3, 4))
            row(f"logsumexp[{_tag}]",
                lambda t, x, a=_axis, k=_keep: tg.logsumexp(t, x, axis=a, keepdims=k),
                lambda x, a=_axis, k=_keep: torch.logsumexp(x, dim=_dims(a, 3), keepdim=k),
                (2, 3, 4))
            row(f"var[{_tag}]", lambda t, x, a=_axis, k=_keep: tg.var(t, x, axis=a, keepdims=k),
                lambda x, a=_axis, k=_keep: torch.var(x, dim=_dims(a, 3), keepdim=k,
                                                      correction=0), (2, 3, 4))
row("logsumexp_default_axis", tg.logsumexp, lambda x: torch.logsumexp(x, dim=-1), (3, 5))
row("var_ddof1", lambda t, x: tg.var(t, x, axis=0, ddof=1),
    lambda x: torch.var(x, dim=0, correction=1), (4, 3))
row("var_ddof1_all", lambda t, x: tg.var(t, x, ddof=1), lambda x: torch.var(x), (4, 3))
row("sum_rank0", tg.sum, torch.sum, ())
row("max_rank0", tg.max, torch.amax, ())
row("mean_rank1", lambda t, x: tg.mean(t, x, axis=0), lambda x: x.mean(0), (5,))
row("max_full", tg.max, torch.max, (3, 4))
row("min_full", tg.min, torch.min, (3, 4))

# Shapes.
row("reshape", lambda t, x: tg.reshape(t, x, (4, 6)), lambda x: x.reshape(4, 6), (2, 3, 4))
row("reshape_minus1", lambda t, x: tg.reshape(t, x, (-1, 3)), lambda x: x.reshape(-1, 3),
    (2, 3, 4))
row("reshape_keyword", lambda t, x: tg.reshape(t, x, shape=(3, -1)), lambda x: x.reshape(3, -1),
    (2, 3, 4))
row("reshape_to_rank0", lambda t, x: tg.reshape(t, x, ()), lambda x: x.reshape(()), (1, 1))
row("transpose_none", tg.transpose, lambda x: x.permute(2, 1, 0), (2, 3, 4))
row("transpose_axes", lambda t, x: tg.transpose(t, x, axes=(1, 2, 0)),
    lambda x: x.permute(1, 2, 0), (2, 3, 4))
row("transpose_negative_axes", lambda t, x: tg.transpose(t, x, (-1, 0, 1)),
    lambda x: x.permute(2, 0, 1), (2, 3, 4))
row("broadcast_to", lambda t, x: tg.broadcast_to(t, x, shape=(2, 3, 4)),
    lambda x: torch.broadcast_to(x, (2, 3, 4)), (3, 1))
row("broadcast_to_from_rank0", lambda t, x: tg.broadcast_to(t, x, (2, 2)),
    lambda x: torch.broadcast_to(x, (2, 2)), ())
row("expand_dims", lambda t, x: tg.expand_dims(t, x, axis=1), lambda x: x.unsqueeze(1), (3, 4))
row("expand_dims_negative", lambda t, x: tg.expand_dims(t, x, -1), lambda x: x.unsqueeze(-1),
    (3, 4))
row("expand_dims_tuple", lambda t, x: tg.expand_dims(t, x, (0, 3)),
    lambda x: x.reshape(1, 3, 4, 1), (3, 4))
row("squeeze_all", tg.squeeze, lambda x: x.squeeze(), (1, 3, 1, 4))
row("squeeze_axis", lambda t, x: tg.squeeze(t, x, axis=2), lambda x: x.squeeze(2), (1, 3, 1, 4))
row("squeeze_negative_tuple", lambda t, x: tg.squeeze(t, x, (0, -2)),
    lambda x: x.reshape(3, 4), (1, 3, 1, 4))
row("concat", lambda t, a, b: tg.concat(t, [a, b]), lambda a, b: torch.cat([a, b]), (2, 3),
    (4, 3))
row("concat_axis", lambda t, a, b, c: tg.concat(t, [a, b, c], axis=-1),
    lambda a, b, c: torch.cat([a, b, c], dim=-1), (2, 3), (2, 1), (2, 2))
row("stack", lambda t, a, b: tg.stack(t, [a, b]), lambda a, b: torch.stack([a, b]), (2, 3),
    (2, 3))
row("stack_axis", lambda t, a, b: tg.stack(t, [a, b], axis=-1),
    lambda a, b: torch.stack([a, b], dim=-1), (2, 3), (2, 3))
row("stack_rank0", lambda t, a, b: tg.stack(t, [a, b], axis=0), lambda a, b: torch.stack([a, b]),
    (), ())

# Triangles, arg-reductions, prefix sums and splits.
for _k in (-2, -1, 0, 1, 3):
    row(f"tril[k={_k}]", lambda t, x, k=_k: tg.tril(t, x, k=k), lambda x, k=_k: torch.tril(x, k),
        (2, 3, 4))
    row(f"triu[k={_k}]", lambda t, x, k=_k: tg.triu(t, x, k), lambda x, k=_k: torch.triu(x, k),
        (4, 3))
row("tril_default", tg.tril, torch.tril, (3, 3))
row("triu_default", tg.triu, torch.triu, (2, 3, 3))
for _axis in (0, 1, -1, -3):
    row(f"cumsum[axis={_axis}]", lambda t, x, a=_axis: tg.cumsum(t, x, a),
        lambda x, a=_axis: torch.cumsum(x, a), (2, 3, 4))
row("cumsum_keyword", lambda t, x: tg.cumsum(t, x, axis=0), lambda x: torch.cumsum(x, 0), (7,))
row("cumsum_none", lambda t, x: tg.cumsum(t, x, None), lambda x: torch.cumsum(x.flatten(), 0),
    (3, 4))


def _arg_sum(op: Callable[..., Out], axis: int, keep: bool) -> TgFn:
    """sum(x) + argX(x) along an axis: the index (cast) checked by value, the sum's gradient."""
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, i = op(t, x, axis=axis, keepdims=keep)
        t, fi = tg.astype(t, i, x.dtype)
        t, s = tg.sum(t, x, axis=axis, keepdims=keep)
        return tg.add(t, s, fi)
    return f


def _take_arg(op: Callable[..., Out]) -> TgFn:
    """x's element at argX(x) over the flattened x: the gradient flows through take."""
    def f(t: tg.Tape, x: tg.Id) -> Out:
        t, i = op(t, x)
        return tg.take(t, x, i, axis=None)
    return f


for _name, _op, _ref in (("argmax", tg.argmax, torch.argmax), ("argmin", tg.argmin, torch.argmin)):
    for _axis, _keep in ((0, False), (-1, True), (1, False)):
        row(f"{_name}[axis={_axis},keepdims={_keep}]", _arg_sum(_op, _axis, _keep),
            lambda x, a=_axis, k=_keep, r=_ref: x.sum(a, keepdim=k) + r(x, a, k).to(x.dtype),
            (2, 3, 4))
    row(f"take_{_name}_flat", _take_arg(_op), lambda x, r=_ref: x.flatten()[r(x)], (3, 4))


def _split_join_torch(sections: Any, axis: int) -> TorchFn:
    def ref(x: Any) -> Any:
        pieces = torch.tensor_split(x, sections, dim=axis)
        return torch.cat([p * (i + 1) for i, p in enumerate(pieces)], dim=axis)
    return ref


for _sections, _axis in ((2, 0), (3, -1), ([1, 3], 1), ([2, 1, 5], -1)):
    row(f"split[{_sections},axis={_axis}]", split_join(_sections, _axis),
        _split_join_torch(_sections, _axis), (2, 4, 3) if _sections == 3 else (2, 4, 6))

_SLICES: list[Any] = [
    np.s_[1],
    np.s_[-1],
    np.s_[1:],
    np.s_[::-1],
    np.s_[1:, ::-2],
    np.s_[..., 1],
    np.s_[None, 0, :, 1:3],
    np.s_[:, None, ..., ::2],
    np.s_[-2:0:-1, 2, -3:],
    np.s_[0, 0, 0],
    np.s_[...],
    np.s_[5:],
    np.s_[:, 3:1],
]


def _slice_ref(index: Any) -> TorchFn:
    def ref(x: Any) -> Any:
        positions: Array = np.arange(int(x.numel())).reshape(tuple(x.shape))
        return torch.take(x, torch.tensor(np.array(positions[index])))
    return ref


for _i, _index in enumerate(_SLICES):
    row(f"slice{_i}[{_index}]", lambda t, x, ix=_index: tg.slice(t, x, ix), _slice_ref(_index),
        (3, 4, 5))

_IDX = np.array([2, 0, 2, 1, 2])
row("take_axis0_int64", lambda t, x, i: tg.take(t, x, i),
    lambda x, i: x.index_select(0, torch.tensor(i)), (4, 3), ints=(_IDX,))
row("take_axis1_int32_repeated", lambda t, x, i: tg.take(t, x, i, axis=1),
    lambda x, i: x.index_select(1, torch.tensor(i.astype(np.int64))), (2, 3, 2),
    ints=(_IDX.astype(np.int32),))
row("take_axis_negative_2d_indices", lambda t, x, i: tg.take(t, x, i, axis=-1),
    lambda x, i: x.index_select(-1, torch.tensor(i.reshape(-1))).reshape(2, 2, 3),
    (2, 4), ints=(np.array([[3, 1, 0], [1, 1, 2]]),))
row("take_negative_indices", lambda t, x, i: tg.take(t, x, indices=i, axis=0),
    lambda x, i: x.index_select(0, torch.tensor(i % 4)), (4, 2), ints=(np.array([-1, -4, 0]),))
row("take_axis_none", lambda t, x, i: tg.take(t, x, i, axis=None),
    lambda x, i: x.reshape(-1)[torch.tensor(i)], (3, 4), ints=(np.array([11, 0, 5, 5]),))
row("take_scalar_index", lambda t, x, i: tg.take(t, x, i, axis=1),
    lambda x, i: x[:, int(i)], (3, 4), ints=(np.array(2),))
row("pad", lambda t, x: tg.pad(t, x, ((1, 0), (2, 3))),
    lambda x: F.pad(x, (2, 3, 1, 0)), (3, 4))
row("pad_keyword_int", lambda t, x: tg.pad(t, x, pad_width=1), lambda x: F.pad(x, (1, 1, 1, 1)),
    (2, 3))
row("pad_3d_zero_axis", lambda t, x: tg.pad(t, x, ((0, 0), (1, 1), (0, 2))),
    lambda x: F.pad(x, (0, 2, 1, 1, 0, 0)), (2, 3, 2))

# Linear algebra.
for _sa, _sb in [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
                 ((2, 3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)),
                 ((2, 1, 3, 4), (3, 4, 2)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)),
                 ((1, 4), (4, 1)), ((2, 3, 3, 4), (2, 3, 4, 2)), ((2, 2, 3, 4), (4, 5))]:
    row(f"matmul{_sa}{_sb}", tg.matmul, torch.matmul, _sa, _sb)

# Networks.
_LABELS = np.array([1, 0, 3, 3, 2])
row("softmax", tg.softmax, lambda x: torch.softmax(x, -1), (3, 5))
row("softmax_axis0", lambda t, x: tg.softmax(t, x, axis=0), lambda x: torch.softmax(x, 0),
    (3, 5))
row("log_softmax", tg.log_softmax, lambda x: torch.log_softmax(x, -1), (2, 3, 5))
row("log_softmax_long_rows", tg.log_softmax, lambda x: torch.log_softmax(x, -1), (2, 700))
row("softmax_long_axis0", lambda t, x: tg.softmax(t, x, axis=0), lambda x: torch.softmax(x, 0),
    (600, 3))
row("log_softmax_axis1", lambda t, x: tg.log_softmax(t, x, axis=1),
    lambda x: torch.log_softmax(x, 1), (2, 3, 5))
row("cross_entropy_int64", tg.cross_entropy, lambda x, y: F.cross_entropy(x, torch.tensor(y)),
    (5, 4), ints=(_LABELS,))
row("cross_entropy_int32", tg.cross_entropy,
    lambda x, y: F.cross_entropy(x, torch.tensor(y.astype(np.int64))), (5, 4),
    ints=(_LABELS.astype(np.int32),))
row("mse", tg.mse, F.mse_loss, (3, 4), (3, 4))
row("mse_scalar", lambda t, a: tg.mse(t, a, 0.5),
    lambda a: F.mse_loss(a, torch.full_like(a, 0.5)), (3, 4))
row("linear", tg.linear, lambda x, w, b: x @ w + b, (5, 3), (3, 4), (4,))
row("linear_no_bias", tg.linear, lambda x, w: x @ w, (5, 3), (3, 4))
row("linear_batched", lambda t, x, w, b: tg.linear(t, x, w, b=b), lambda x, w, b: x @ w + b,
    (2, 5, 3), (3, 4), (4,))
row("linear_1d", tg.linear, lambda x, w, b: x @ w + b, (3,), (3, 4), (4,))
row("linear_4d", tg.linear, lambda x, w, b: x @ w + b, (2, 2, 3, 3), (3, 4), (4,))
row("linear_3d_no_bias", tg.linear, lambda x, w: x @ w, (2, 5, 3), (3, 4))

for _stride, _padding, _bias, _x, _w in [
    (1, 0, True, (2, 3, 5, 5), (4, 3, 3, 3)),
    (2, 1, False, (1, 2, 7, 6), (3, 2, 3, 2)),
    ((2, 1), (1, 0), True, (2, 1, 6, 5), (2, 1, 2, 3)),
    (3, (2, 1), True, (1, 2, 5, 7), (2, 2, 3, 3)),
    (1, 2, False, (1, 1, 4, 4), (1, 1, 5, 5)),
    ((2, 1), (1, 0), True, (2, 1, 7, 6), (4, 1, 3, 6)),  # as wide as the plane
    (1, (1, 0), False, (2, 9, 6, 1), (3, 9, 3, 1)),
    ((2, 1), (0, 1), True, (2, 4, 6, 19), (1, 4, 3, 3)),  # one output channel
]:
    _tag = f"stride={_stride},padding={_padding},bias={_bias},x={_x},w={_w}"
    if _bias:
        row(f"conv2d[{_tag}]",
            lambda t, x, w, b, s=_stride, p=_padding: tg.conv2d(t, x, w, b, stride=s, padding=p),
            lambda x, w, b, s=_stride, p=_padding: F.conv2d(x, w, b, stride=s, padding=p),
            _x, _w, (_w[0],))
    else:
        row(f"conv2d[{_tag}]",
            lambda t, x, w, s=_stride, p=_padding: tg.conv2d(t, x, w, stride=s, padding=p),
            lambda x, w, s=_stride, p=_padding: F.conv2d(x, w, stride=s, padding=p), _x, _w)
row("conv2d_unbatched", lambda t, x, w, b: tg.conv2d(t, x, w, b=b, padding=1),
    lambda x, w, b: F.conv2d(x, w, b, padding=1), (2, 4, 4), (3, 2, 3, 3), (3,))

for _k, _s, _p, _x in [(2, None, 0, (2, 3, 4, 4)), (3, 2, 1, (1, 2, 7, 6)),
                       ((2, 3), (1, 2), (1, 1), (1, 1, 5, 7)), (3, None, 0, (1, 2, 7, 8)),
                       (2, 1, 0, (2, 5, 5))]:
    _tag = f"k={_k},s={_s},p={_p},x={_x}"
    row(f"max_pool2d[{_tag}]",
        lambda t, x, k=_k, s=_s, p=_p: tg.max_pool2d(t, x, kernel_size=k, stride=s, padding=p),
        lambda x, k=_k, s=_s, p=_p: F.max_pool2d(x, k, s, p), _x)
    row(f"avg_pool2d[{_tag}]",
        lambda t, x, k=_k, s=_s, p=_p: tg.avg_pool2d(t, x, kernel_size=k, stride=s, padding=p),
        lambda x, k=_k, s=_s, p=_p: F.avg_pool2d(x, k, s, p), _x)
row("max_pool2d_default_stride", lambda t, x: tg.max_pool2d(t, x, 2),
    lambda x: F.max_pool2d(x, 2), (1, 2, 5, 5))
row("avg_pool2d_default_stride", lambda t, x: tg.avg_pool2d(t, x, 2),
    lambda x: F.avg_pool2d(x, 2), (1, 2, 5, 5))

row("layer_norm", tg.layer_norm, lambda x: F.layer_norm(x, (x.shape[-1],)), (3, 5))
row("layer_norm_affine", lambda t, x, w, b: tg.layer_norm(t, x, weight=w, bias=b),
    lambda x, w, b: F.layer_norm(x, (5,), w, b), (2, 3, 5), (5,), (5,))
row("layer_norm_long_rows", lambda t, x, w: tg.layer_norm(t, x, weight=w, eps=0.1),
    lambda x, w: F.layer_norm(x, (19,), w, eps=0.1), (3, 19), (19,))
row("layer_norm_weight_eps", lambda t, x, w: tg.layer_norm(t, x, w, eps=0.1),
    lambda x, w: F.layer_norm(x, (5,), w, eps=0.1), (3, 5), (5,))
row("layer_norm_bias_only", lambda t, x, b: tg.layer_norm(t, x, bias=b),
    lambda x, b: F.layer_norm(x, (5,)) + b, (3, 5), (5,))  # torch's double backward of
# F.layer_norm(x, s, None, b) fails on the missing weight
row("batch_norm", tg.batch_norm,
    lambda x: F.batch_norm(x, None, None, training=True, eps=1e-5), (4, 3))
row("batch_norm_4d_affine", lambda t, x, w, b: tg.batch_norm(t, x, weight=w, bias=b),
    lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (2, 3, 2, 3), (3,), (3,))
row("batch_norm_eps_weight", lambda t, x, w: tg.batch_norm(t, x, w, eps=0.5),
    lambda x, w: F.batch_norm(x, None, None, w, None, training=True, eps=0.5), (3, 2, 4), (2,))
row("batch_norm_long_channels", lambda t, x, w, b: tg.batch_norm(t, x, weight=w, bias=b),
    lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (5, 2, 7, 11), (2,), (2,))
row("dropout_p0", lambda t, x: tg.dropout(t, x, p=0.0, seed=3), lambda x: x, (3, 4))
_EMB = np.array([[1, 3, 1], [0, 2, 3]])
row("embedding", tg.embedding, lambda w, i: F.embedding(torch.tensor(i), w), (4, 3),
    ints=(_EMB,))
row("embedding_int32", lambda t, w, i: tg.embedding(t, w, indices=i),
    lambda w, i: F.embedding(torch.tensor(i.astype(np.int64)), w), (5, 2),
    ints=(np.array([4, 4, 0], np.int32),))
row("stop_gradient", lambda t, x, y: _stop_mul(t, x, y), lambda x, y: x.detach() * y + x,
    (3,), (3,))


def _stop_mul(tape: tg.Tape, x: tg.Id, y: tg.Id) -> Out:
    tape, s = tg.stop_gradient(tape, x)
    tape, m = tg.mul(tape, s, y)
    return tg.add(tape, m, x)


# Medium sizes: the split reductions (long axes, few outputs), matmul's vector kernels, the
# sorted scatter-add of take's gradient, conv through im2col and the tiled products.
row("sum_long_axis", lambda t, x: tg.sum(t, x, axis=1), lambda x: x.sum(1), (3, 1500))
row("max_long_all", tg.max, torch.max, (2100,))
row("mean_long_axis0_keepdims", lambda t, x: tg.mean(t, x, axis=0, keepdims=True),
    lambda x: x.mean(0, keepdim=True), (1300, 2))
row("var_long_axis0", lambda t, x: tg.var(t, x, axis=0, ddof=1),
    lambda x: torch.var(x, 0, correction=1), (1200, 2))
row("logsumexp_long", lambda t, x: tg.logsumexp(t, x, axis=None),
    lambda x: torch.logsumexp(x, (0, 1)), (40, 30))
row("min_long_middle_axis", lambda t, x: tg.min(t, x, axis=1), lambda x: x.amin(1), (2, 700, 3))
for _sa, _sb in [((17, 33), (33, 19)), ((3, 9, 20), (20, 17)), ((2, 1, 18, 8), (3, 8, 33)),
                 ((40,), (40, 35)), ((35, 40), (40,))]:
    row(f"matmul_medium{_sa}{_sb}", tg.matmul, torch.matmul, _sa, _sb)
row("embedding_sorted_grad", tg.embedding, lambda w, i: F.embedding(torch.tensor(i), w),
    (64, 40), ints=(np.random.default_rng(9).integers(0, 64, (20, 30)),), second=False)
row("take_sorted_grad_axis1", lambda t, x, i: tg.take(t, x, i, axis=1),
    lambda x, i: x.index_select(1, torch.tensor(i)), (40, 50, 2),
    ints=(np.random.default_rng(10).integers(0, 50, 600),), second=False)
row("conv2d_medium", lambda t, x, w, b: tg.conv2d(t, x, w, b, stride=1, padding=1),
    lambda x, w, b: F.conv2d(x, w, b, padding=1), (2, 8, 9, 9), (16, 8, 3, 3), (16,),
    second=False)
row("max_pool2d_medium", lambda t, x: tg.max_pool2d(t, x, 3, 2, 1),
    lambda x: F.max_pool2d(x, 3, 2, 1), (2, 4, 15, 13))
row("avg_pool2d_medium", lambda t, x: tg.avg_pool2d(t, x, (3, 2), (2, 2), (1, 0)),
    lambda x: F.avg_pool2d(x, (3, 2), (2, 2), (1, 0)), (2, 4, 15, 13))
row("linear_medium", tg.linear, lambda x, w, b: x @ w + b, (33, 48), (48, 20), (20,))
row("cross_entropy_medium", tg.cross_entropy, lambda x, y: F.cross_entropy(x, torch.tensor(y)),
    (70, 10), ints=(np.random.default_rng(11).integers(0, 10, 70),))


# Special values where the conventions matter: ties, zeros, boundaries, large magnitudes.
_TIES = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 2.0, -1.0, 0.0]])


@overload
def fixed(name: str, fn: Callable[[T, Any], Out], ref: Callable[[Any], Any], *data: Any,
          **kw: Any) -> None: ...
@overload
def fixed(name: str, fn: Callable[[T, Any, Any], Out], ref: Callable[[Any, Any], Any],
          *data: Any, **kw: Any) -> None: ...
def fixed(name: str, fn: TgFn, ref: TorchFn, *data: Any, **kw: Any) -> None:
    arrays = tuple(np.asarray(d, np.float64) for d in data)
    ROWS.append(Row(name, fn, ref, tuple(a.shape for a in arrays), data=arrays, **kw))


fixed("maximum_ties", tg.maximum, torch.maximum, [1.0, 2.0, -3.0, 0.0], [1.0, 1.0, -3.0, 4.0])
fixed("minimum_ties", tg.minimum, torch.minimum, [1.0, 2.0, -3.0, 0.0], [1.0, 1.0, -3.0, 4.0])
fixed("maximum_scalar_tie", lambda t, a: tg.maximum(t, a, 0.0),
      lambda a: torch.maximum(a, torch.zeros((), dtype=a.dtype)), [-1.0, 0.0, 2.0])
fixed("relu_at_zero", tg.relu, torch.relu, [-1.0, 0.0, 2.0])
fixed("abs_at_zero", tg.abs, torch.abs, [-1.0, 0.0, 2.0])
fixed("clip_at_bounds", lambda t, x: tg.clip(t, x, -1.0, 1.0), lambda x: torch.clamp(x, -1, 1),
      [-2.0, -1.0, 0.0, 1.0, 2.0])
# torch's second order is NaN at a zero base and drops d(base grad)/d(exponent) at exponent 0
# (its base gradient is masked by `where(exponent == 0, 0, ...)`); tapegrad's match finite
# differences there, so only first order is compared.
fixed("pow_zero_base", tg.pow, torch.pow, [0.0, 0.0, 2.0], [2.0, 3.0, 0.0], second=False)
fixed("pow_zero_exponent", lambda t, a: tg.pow(t, a, 0.0), lambda a: a**0.0, [0.0, 0.0, 2.0])
fixed("pow_exponent_one_at_zero", lambda t, a: tg.pow(t, a, 1.0), lambda a: a**1.0,
      [0.0, -1.0, 2.0])
fixed("pow_square_at_zero", lambda t, a: tg.pow(t, a, 2), lambda a: a**2, [0.0, -1.0, 2.0])
fixed("pow_negative_base_integer_exponent", tg.pow, torch.pow, [-2.0, -0.5], [2.0, 3.0])
fixed("sqrt_small", tg.sqrt, torch.sqrt, [1e-8, 4.0])
fixed("max_ties_axis1", lambda t, x: tg.max(t, x, axis=1), lambda x: torch.amax(x, 1), _TIES)
fixed("max_ties_axis0_keepdims", lambda t, x: tg.max(t, x, axis=0, keepdims=True),
      lambda x: torch.amax(x, 0, keepdim=True), _TIES)
fixed("min_ties_all", tg.min, torch.min, _TIES)
fixed("max_ties_all", tg.max, torch.max, _TIES)
fixed("sigmoid_large", tg.sigmoid, torch.sigmoid, [-800.0, -40.0, 40.0, 800.0])
fixed("tanh_large", tg.tanh, torch.tanh, [-400.0, 400.0])
fixed("gelu_large", tg.gelu, F.gelu, [-40.0, -5.0, 5.0, 40.0])
fixed("softmax_large", tg.softmax, lambda x: torch.softmax(x, -1), [[1e4, -1e4, 0.0, 1e4 - 1]])
fixed("log_softmax_large", tg.log_softmax, lambda x: torch.log_softmax(x, -1),
      [[1e4, -1e4, 0.0, 1e4 - 1]])
fixed("log_softmax_minus_inf", tg.log_softmax, lambda x: torch.log_softmax(x, -1),
      [[-np.inf, 0.0, 1.0], [2.0, -np.inf, -np.inf]], second=False)
# A row whose maximum is +inf: NaN throughout in PyTorch's log_softmax (inf - inf), softmax and
# cross_entropy, whatever the label; -inf elements are fine.
_PLUS_INF = [[np.inf, 0.0, 1.0], [-np.inf, 0.0, 1.0], [0.0, np.inf, np.inf]]
fixed("log_softmax_plus_inf", tg.log_softmax, lambda x: torch.log_softmax(x, -1), _PLUS_INF,
      second=False)
fixed("softmax_plus_inf", tg.softmax, lambda x: torch.softmax(x, -1), _PLUS_INF, second=False)
fixed("cross_entropy_plus_inf", tg.cross_entropy, lambda x, y: F.cross_entropy(x, torch.tensor(y)),
      [[np.inf, 0.0, 1.0], [0.0, 1.0, 2.0]], ints=(np.array([1, 0]),), second=False)
fixed("relu_nan", tg.relu, torch.relu, [np.nan, -1.0, 0.0, 2.0], second=False)
fixed("pow_exponent_at_zero_base", tg.pow, torch.pow, [0.0, 0.0, 0.0, 2.0],
      [-1.0, 0.0, 2.0, -1.0], second=False)
fixed("logsumexp_large", tg.logsumexp, lambda x: torch.logsumexp(x, -1),
      [[1e4, -1e4, 0.0], [-1e4, -1e4 + 1, -1e4]])
# Rows are a work-item's eight lanes (rows of 11: a group of eight and a tail of three): a +inf
# in either part gives +inf, a row of -inf -inf, a NaN NaN.
fixed("logsumexp_rows_inf_nan", tg.logsumexp, lambda x: torch.logsumexp(x, -1),
      [[1.0] * 10 + [np.inf], [np.inf] + [1.0] * 10, [-np.inf] * 11, [2.0] * 5 + [np.nan] * 6,
       [np.nan] + [3.0] * 10, list(np.linspace(-3.0, 3.0, 11))], second=False)
fixed("cross_entropy_large", tg.cross_entropy, lambda x, y: F.cross_entropy(x, torch.tensor(y)),
      [[1e4, -1e4, 0.0], [-1e4, 3.0, 1e4]], ints=(np.array([1, 2]),))
fixed("cross_entropy_confident", tg.cross_entropy,
      lambda x, y: F.cross_entropy(x, torch.tensor(y)), [[1000.0, 990.0], [50.0, 40.0]],
      ints=(np.array([0, 0]),), f32_rtol=1e-4, f32_atol=1e-7)
fixed("log_softmax_confident", tg.log_softmax, lambda x: torch.log_softmax(x, -1),
      [[1000.0, 990.0], [50.0, 40.0]], f32_rtol=1e-4, f32_atol=1e-7)
fixed("softmax_confident", tg.softmax, lambda x: torch.softmax(x, -1),
      [[1000.0, 990.0, 985.0]], f32_rtol=1e-4, f32_atol=1e-9)
fixed("max_pool2d_ties", lambda t, x: tg.max_pool2d(t, x, 2),
      lambda x: F.max_pool2d(x, 2), [[[[1.0, 1.0, 0.0, 2.0], [1.0, 0.0, 2.0, 2.0]]]])
fixed("max_pool2d_padding_negative", lambda t, x: tg.max_pool2d(t, x, 3, 1, 1),
      lambda x: F.max_pool2d(x, 3, 1, 1), -np.arange(1.0, 13.0).reshape(1, 1, 3, 4))
# The more elementwise ops at zeros, thresholds, large magnitudes, infinities and NaN.
_INF, _NAN = np.inf, np.nan
fixed("softplus_threshold", tg.softplus, F.softplus,
      [-800.0, -40.0, -20.0, -1.0, -0.0, 0.0, 1.0, 19.999, 20.0, 20.001, 40.0, 800.0])
fixed("softplus_inf_nan", tg.softplus, F.softplus, [-_INF, _INF, _NAN, 3.0], second=False)
fixed("silu_large", tg.silu, F.silu, [-800.0, -40.0, -1.0, -0.0, 0.0, 1e-300, 1.0, 40.0, 800.0])
fixed("silu_inf_nan", tg.silu, F.silu, [-_INF, _INF, _NAN, 3.0], second=False)
fixed("leaky_relu_at_zero", tg.leaky_relu, F.leaky_relu,
      [-_INF, -1.0, -0.0, 0.0, 1e-300, 2.0, _INF, _NAN])
fixed("leaky_relu_slope_at_zero", lambda t, x: tg.leaky_relu(t, x, 0.3),
      lambda x: F.leaky_relu(x, 0.3), [-1.0, -0.0, 0.0, 2.0])
fixed("elu_at_zero", tg.elu, F.elu, [-800.0, -1.0, -0.0, 0.0, 1e-300, 2.0, 800.0])
fixed("elu_alpha_at_zero", lambda t, x: tg.elu(t, x, alpha=2.0), lambda x: F.elu(x, alpha=2.0),
      [-1.0, -0.0, 0.0, 1e-300, 2.0])
fixed("elu_inf", tg.elu, F.elu, [-_INF, _INF, 1.0], second=False)
fixed("log1p_small", tg.log1p, torch.log1p, [-0.5, -1e-10, -0.0, 0.0, 1e-300, 1e10])
fixed("log1p_edges", tg.log1p, torch.log1p, [-2.0, -1.0, _INF, _NAN], second=False)
fixed("expm1_small", tg.expm1, torch.expm1, [-800.0, -1e-10, -0.0, 0.0, 1e-300, 80.0])
fixed("expm1_edges", tg.expm1, torch.expm1, [-_INF, _INF, _NAN], second=False)
fixed("erf_large", tg.erf, torch.erf, [-30.0, -3.0, -0.0, 0.0, 1e-300, 3.0, 30.0])
fixed("erf_edges", tg.erf, torch.erf, [-_INF, _INF, _NAN], second=False)
fixed("sin_edges", tg.sin, torch.sin, [-0.0, 0.0, 1e-300, 1e6, -_INF, _INF, _NAN], second=False)
fixed("cos_edges", tg.cos, torch.cos, [-0.0, 0.0, 1e-300, 1e6, -_INF, _INF, _NAN], second=False)
# Comparisons with NaN and ties, into where: NaN compares False (not_equal True), as torch.
_NAN_A = [_NAN, 1.0, 2.0, _NAN, -_INF, 0.0]
_NAN_B = [1.0, 1.0, _NAN, _NAN, -_INF, -0.0]
for _name, _fn, _ref in _COMPARE:
    fixed(f"where_{_name}_nan_ties", lambda t, a, b, f=_fn: _where_mask(t, f, a, b, a, b),
          lambda a, b, r=_ref: torch.where(r(a, b), a, b), _NAN_A, _NAN_B, second=False)
fixed("var_constant", lambda t, x: tg.var(t, x, axis=1), lambda x: torch.var(x, 1, correction=0),
      [[2.0, 2.0, 2.0], [1.0, 2.0, 3.0]])


# --- the checks -------------------------------------------------------------------------------


def _build(r: Row, arrays: Sequence[Array], dtype: Any) -> tuple[tg.Tape, list[tg.Id], tg.Id]:
    tape = tg.Tape()
    ids: list[tg.Id] = []
    for a in arrays:
        tape, i = tg.leaf(tape, a.astype(dtype), requires_grad=True)
        ids.append(i)
    ints: list[tg.Id] = []
    for a in r.ints:
        tape, i = tg.leaf(tape, a)
        ints.append(i)
    tape, out = r.fn(tape, *ids, *ints)
    return tape, ids, out


def _torch_run(r: Row, arrays: Sequence[Array]) -> tuple[list[Any], Any]:
    xs = [_t(a, grad=True) for a in arrays]
    return xs, r.ref(*xs, *r.ints)


def _close(got: Array, want: Any, rtol: float, atol: float, what: str) -> None:
    expected = (want.detach().numpy(force=True) if hasattr(want, "detach")
                else np.asarray(want))
    assert got.shape == expected.shape, f"{what}: shape {got.shape} vs torch {expected.shape}"
    finite = np.abs(expected[np.isfinite(expected)])
    scale = float(np.max(finite)) if finite.size else 0.0
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol * max(scale, 1.0),
                               err_msg=what)


def _cotangent(shape: tuple[int, ...], seed: int = 1) -> Array:
    return np.random.default_rng(seed).standard_normal(shape)


IDS = [r.name for r in ROWS]


@pytest.mark.parametrize("r", ROWS, ids=IDS)
def test_forward_and_vjp_float64(r: Row) -> None:
    arrays = r.inputs()
    tape, ids, out = _build(r, arrays, np.float64)
    xs, want = _torch_run(r, arrays)
    got = tg.value(tape, out).numpy()
    assert got.dtype == np.float64
    _close(got, want, RTOL64, ATOL64, "forward")
    assert out.shape == tuple(want.shape) and out.dtype == np.float64
    if not want.requires_grad:
        return
    ct = _cotangent(tuple(want.shape))
    seed = None if out.shape == () else ct
    grads = tg.backward(tape, out, seed=seed)
    assert set(grads) <= set(ids)
    tgrads = torch.autograd.grad(want, xs, torch.tensor(ct) if seed is not None else None,
                                 allow_unused=True)
    for k, (i, tgr) in enumerate(zip(ids, tgrads, strict=True)):
        expected = torch.zeros(i.shape, dtype=torch.float64) if tgr is None else tgr
        got_k = grads[i].numpy() if i in grads else np.zeros(i.shape)
        _close(got_k, expected, RTOL64, ATOL64, f"gradient of argument {k}")


@pytest.mark.parametrize("r", ROWS, ids=IDS)
def test_grad_transform_float64(r: Row) -> None:
    """`tg.grad(f, argnums=...)` on arrays: a fresh tape, AnyTensors back."""
    arrays = r.inputs(seed=2)
    nf = len(arrays)
    xs, want = _torch_run(r, arrays)
    if not want.requires_grad:
        return
    ct = _cotangent(tuple(want.shape), seed=3)

    def f(tape: tg.Tape, *ids: tg.Id) -> Out:
        tape, y = r.fn(tape, *ids)
        tape, c = tg.leaf(tape, ct)
        tape, p = tg.mul(tape, y, c)
        return tg.sum(tape, p)

    grads: tuple[tg.AnyTensor, ...] = tg.grad(f, argnums=tuple(range(nf)))(*arrays, *r.ints)
    assert isinstance(grads, tuple) and len(grads) == nf
    tgrads = torch.autograd.grad(want, xs, torch.tensor(ct), allow_unused=True)
    for k, (g, tgr) in enumerate(zip(grads, tgrads, strict=True)):
        expected = torch.zeros(arrays[k].shape, dtype=torch.float64) if tgr is None else tgr
        _close(g.numpy(), expected, RTOL64, ATOL64, f"tg.grad of argument {k}")


@pytest.mark.parametrize("r", [r for r in ROWS if r.second], ids=[r.name for r in ROWS
                                                                   if r.second])
def test_second_order_float64(r: Row) -> None:
    """d/dx of sum(v * vjp(ct)) through backward_on_tape, against torch's double backward."""
    arrays = r.inputs(seed=4)
    tape, ids, out = _build(r, arrays, np.float64)
    xs, want = _torch_run(r, arrays)
    if not want.requires_grad:
        return
    ct = _cotangent(tuple(want.shape), seed=5)
    tape, ct_id = tg.leaf(tape, ct)
    tape, gids = tg.backward_on_tape(tape, out, ids, seed=ct_id)
    tgrads = torch.autograd.grad(want, xs, torch.tensor(ct), create_graph=True,
                                 allow_unused=True)
    vs = [_cotangent(a.shape, seed=6 + k) for k, a in enumerate(arrays)]
    tape, total = tg.leaf(tape, 0.0)
    tape, total = tg.astype(tape, total, np.float64)
    torch_total: Any = torch.zeros((), dtype=torch.float64)
    for k, (i, v) in enumerate(zip(ids, vs, strict=True)):
        _close(tg.value(tape, gids[i]).numpy(),
               tgrads[k] if tgrads[k] is not None else torch.zeros(arrays[k].shape,
                                                                   dtype=torch.float64),
               RTOL64, ATOL64, f"recorded gradient of argument {k}")
        tape, vi = tg.leaf(tape, v)
        tape, p = tg.mul(tape, gids[i], vi)
        tape, s = tg.sum(tape, p)
        tape, total = tg.add(tape, total, s)
        if tgrads[k] is not None and tgrads[k].requires_grad:
            torch_total = torch_total + (tgrads[k] * torch.tensor(v)).sum()
    grads = tg.backward(tape, total, wrt=ids)
    if torch_total.requires_grad:
        second = torch.autograd.grad(torch_total, xs, allow_unused=True)
    else:
        second = [None] * len(xs)
    for k, (i, tgr) in enumerate(zip(ids, second, strict=True)):
        expected = torch.zeros(arrays[k].shape, dtype=torch.float64) if tgr is None else tgr
        _close(grads[i].numpy(), expected, 1e-9, 1e-11, f"second-order gradient of argument {k}")


F32_ROWS = [r for i, r in enumerate(ROWS) if i % 3 == 0 or r.data]  # every special-value row


@pytest.mark.parametrize("r", F32_ROWS, ids=[r.name for r in F32_ROWS])
def test_forward_and_vjp_float32(r: Row) -> None:
    arrays = [a.astype(np.float32).astype(np.float64) for a in r.inputs(seed=7)]
    tape, ids, out = _build(r, arrays, np.float32)
    xs, want = _torch_run(r, arrays)
    got = tg.value(tape, out).numpy()
    assert got.dtype == np.float32 and out.dtype == np.float32
    _close(got, want, r.f32_rtol, r.f32_atol, "forward (float32)")
    if not want.requires_grad:
        return
    ct = _cotangent(tuple(want.shape), seed=8).astype(np.float32)
    grads = tg.backward(tape, out, seed=None if out.shape == () else ct)
    tct = None if out.shape == () else torch.tensor(ct.astype(np.float64))
    tgrads = torch.autograd.grad(want, xs, tct, allow_unused=True)
    for k, (i, tgr) in enumerate(zip(ids, tgrads, strict=True)):
        expected = torch.zeros(i.shape, dtype=torch.float64) if tgr is None else tgr
        got_k = grads[i].numpy() if i in grads else np.zeros(i.shape, np.float32)
        assert got_k.dtype == np.float32
        _close(got_k, expected, r.f32_rtol * 10, ATOL32 * 10, f"float32 gradient of {k}")


# --- conventions around the ops ---------------------------------------------------------------


def test_leaf_of_python_and_numpy_scalars() -> None:
    tape, x = tg.leaf(tg.Tape(), 3.0)
    assert x.shape == () and x.dtype == np.float32
    assert len(tape) == 1 and tape[x].op == "leaf"
    np.testing.assert_array_equal(tg.value(tape, x).numpy(), np.float32(3.0))
    for value, dtype in [(2, np.int64), (True, np.bool_), (np.float64(2.5), np.float64),
                         (np.float32(2.5), np.float32), (np.int32(4), np.int32)]:
        tape, y = tg.leaf(tape, value)
        assert y.shape == () and y.dtype == dtype, (value, y.dtype)


def test_numpy_scalar_operands_are_numbers() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 4.0], np.float32))
    for s in (np.float64(2.0), np.float32(2.0), np.int64(2)):
        tape, y = tg.mul(tape, x, s)
        tape, z = tg.sub(tape, s, x)
        assert y.dtype == z.dtype == np.float32
        np.testing.assert_array_equal(tg.value(tape, y).numpy(), [2.0, 8.0])
        np.testing.assert_array_equal(tg.value(tape, z).numpy(), [1.0, -2.0])
    tape, c = tg.clip(tape, x, np.float32(2.0), np.int64(3))
    np.testing.assert_array_equal(tg.value(tape, c).numpy(), [2.0, 3.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scalar", [2, 2.5, True])
def test_python_scalars_keep_the_dtype(dtype: Any, scalar: Any) -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0], dtype))
    for op in (tg.add, tg.sub, tg.mul, tg.div, tg.pow, tg.maximum, tg.minimum):
        for args in ((x, scalar), (scalar, x)):
            tape, y = op(tape, *args)
            assert y.dtype == dtype and y.shape == (2,)
            want = getattr(torch, {"pow": "pow", "add": "add", "sub": "sub", "mul": "mul",
                                   "div": "div", "maximum": "maximum",
                                   "minimum": "minimum"}[op.__name__])(
                *[torch.tensor(np.array([1.0, 2.0])) if a is x else
                  torch.tensor(float(scalar), dtype=torch.float64) for a in args])
            _close(tg.value(tape, y).numpy(), want, RTOL32, ATOL32, op.__name__)


def _chain(tape: tg.Tape, x: tg.Id, w: tg.Id) -> tuple[tg.Tape, tg.Id, tg.Id]:
    tape, h = tg.matmul(tape, x, w)
    tape, a = tg.tanh(tape, h)
    tape, loss = tg.sum(tape, a)
    return tape, h, loss


def test_backward_wrt_leaves_interior_and_unreached() -> None:
    rng = np.random.default_rng(0)
    xv, wv, uv = rng.standard_normal((4, 3)), rng.standard_normal((3, 2)), rng.standard_normal(5)
    tape, x = tg.leaf(tg.Tape(), xv)
    tape, w = tg.leaf(tape, wv, requires_grad=True)
    tape, u = tg.leaf(tape, uv, requires_grad=True)  # never used: unreached
    tape, h, loss = _chain(tape, x, w)
    tape, after = tg.leaf(tape, 1.5, requires_grad=True)  # recorded after the loss

    xt, wt = torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True)
    ht = xt @ wt
    ht.retain_grad()
    torch.tanh(ht).sum().backward()

    default = tg.backward(tape, loss)
    assert set(default) == {w}  # every requires_grad leaf reached, and only those
    _close(default[w].numpy(), wt.grad, RTOL64, ATOL64, "default wrt")

    grads = tg.backward(tape, loss, wrt=[x, w, h, u, after])
    assert set(grads) == {x, w, h, u, after}
    _close(grads[x].numpy(), xt.grad, RTOL64, ATOL64, "constant leaf in wrt")
    _close(grads[w].numpy(), wt.grad, RTOL64, ATOL64, "leaf in wrt")
    _close(grads[h].numpy(), ht.grad, RTOL64, ATOL64, "interior id in wrt")
    np.testing.assert_array_equal(grads[u].numpy(), np.zeros(5))
    assert grads[u].dtype == np.float64
    np.testing.assert_array_equal(grads[after].numpy(), np.float32(0.0))

    single = tg.backward(tape, loss, wrt=h)
    assert set(single) == {h}
    _close(single[h].numpy(), ht.grad, RTOL64, ATOL64, "wrt a single id")


def test_backward_seed_for_non_scalar_loss() -> None:
    rng = np.random.default_rng(1)
    xv, seed = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    tape, x = tg.leaf(tg.Tape(), xv, requires_grad=True)
    tape, y = tg.sigmoid(tape, x)
    xt = torch.tensor(xv, requires_grad=True)
    torch.sigmoid(xt).backward(torch.tensor(seed))
    for s in (seed, tg.AnyTensor.from_numpy(seed)):
        _close(tg.backward(tape, y, seed=s)[x].numpy(), xt.grad, RTOL64, ATOL64, "seed")
    # A float32 seed for a float64 loss is converted, as torch's backward(gradient) does.
    got = tg.backward(tape, y, seed=seed.astype(np.float32))[x].numpy()
    assert got.dtype == np.float64
    _close(got, xt.grad, 1e-6, 1e-7, "float32 seed")
    # A seed for a scalar loss scales the gradient.
    tape, total = tg.sum(tape, y)
    _close(tg.backward(tape, total, seed=np.float64(2.0))[x].numpy(),
           2 * torch.sigmoid(torch.tensor(xv)) * (1 - torch.sigmoid(torch.tensor(xv))),
           RTOL64, ATOL64, "scalar seed")


def test_backward_on_tape_against_create_graph() -> None:
    rng = np.random.default_rng(2)
    xv, wv = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    tape, x = tg.leaf(tg.Tape(), xv, requires_grad=True)
    tape, w = tg.leaf(tape, wv, requires_grad=True)
    tape, _, loss = _chain(tape, x, w)
    tape, grads = tg.backward_on_tape(tape, loss, [x, w])
    tape, gsq = tg.mul(tape, grads[w], grads[w])
    tape, penalty = tg.sum(tape, gsq)
    second = tg.backward(tape, penalty, wrt=[x, w])

    xt, wt = torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True)
    gx, gw = torch.autograd.grad(torch.tanh(xt @ wt).sum(), [xt, wt], create_graph=True)
    _close(tg.value(tape, grads[x]).numpy(), gx, RTOL64, ATOL64, "recorded grad x")
    _close(tg.value(tape, grads[w]).numpy(), gw, RTOL64, ATOL64, "recorded grad w")
    sx, sw = torch.autograd.grad((gw * gw).sum(), [xt, wt])
    _close(second[x].numpy(), sx, RTOL64, ATOL64, "second order x")
    _close(second[w].numpy(), sw, RTOL64, ATOL64, "second order w")


def _mlp(tape: tg.Tape, w: tg.Id, x: tg.Id) -> Out:
    tape, h = tg.matmul(tape, x, w)
    tape, h = tg.gelu(tape, h)
    tape, h = tg.mul(tape, h, h)
    return tg.mean(tape, h)


def _mlp_torch(w: Any, x: Any) -> Any:
    return (F.gelu(x @ w) ** 2).mean()


def test_transforms_against_torch_autograd_functional() -> None:
    rng = np.random.default_rng(3)
    wv, xv = rng.standard_normal((3, 2)), rng.standard_normal((4, 3))
    wt, xt = torch.tensor(wv), torch.tensor(xv)
    tgw, tgx = torch.autograd.grad(_mlp_torch(wt.requires_grad_(), xt.requires_grad_()),
                                   [wt, xt])

    g = tg.grad(_mlp)(wv, xv)
    _close(g.numpy(), tgw, RTOL64, ATOL64, "grad")
    gw, gx = tg.grad(_mlp, argnums=(0, 1))(wv, xv)
    _close(gw.numpy(), tgw, RTOL64, ATOL64, "grad argnums w")
    _close(gx.numpy(), tgx, RTOL64, ATOL64, "grad argnums x")
    gx_only = tg.grad(_mlp, argnums=1)(wv, xv)
    _close(gx_only.numpy(), tgx, RTOL64, ATOL64, "grad argnums=1")

    value, g = tg.value_and_grad(_mlp)(wv, xv)
    _close(value.numpy(), _mlp_torch(torch.tensor(wv), xt), RTOL64, ATOL64, "value")
    _close(g.numpy(), tgw, RTOL64, ATOL64, "value_and_grad")

    def with_aux(tape: tg.Tape, w: tg.Id, x: tg.Id) -> tuple[tg.Tape, tuple[tg.Id, str]]:
        tape, y = _mlp(tape, w, x)
        return tape, (y, "aux")

    (value, aux), g = tg.value_and_grad(with_aux, has_aux=True)(wv, xv)
    assert aux == "aux"
    _close(g.numpy(), tgw, RTOL64, ATOL64, "value_and_grad has_aux")
    g, aux = tg.grad(with_aux, has_aux=True)(wv, xv)
    assert aux == "aux"
    _close(g.numpy(), tgw, RTOL64, ATOL64, "grad has_aux")

    def elementwise(tape: tg.Tape, w: tg.Id) -> Out:
        tape, y = tg.tanh(tape, w)
        return tg.mul(tape, y, w)

    def elementwise_torch(w: Any) -> Any:
        return torch.tanh(w) * w

    ct = rng.standard_normal((3, 2))
    out, vjp_fn = tg.vjp(elementwise, wv)
    t_out, t_vjp = torch.autograd.functional.vjp(elementwise_torch, torch.tensor(wv),
                                                 torch.tensor(ct))
    _close(out.numpy(), t_out, RTOL64, ATOL64, "vjp out")
    (gv,) = vjp_fn(ct)
    _close(gv.numpy(), t_vjp, RTOL64, ATOL64, "vjp")

    jac = tg.jacobian(elementwise, wv)
    _close(jac.numpy(), torch.autograd.functional.jacobian(elementwise_torch, torch.tensor(wv)),
           RTOL64, ATOL64, "jacobian")

    def f(tape: tg.Tape, w: tg.Id) -> Out:
        tape, x = tg.leaf(tape, xv)
        return _mlp(tape, w, x)

    hess = tg.hessian(f, wv)
    def mlp_of_w(w: Any) -> Any:
        return _mlp_torch(w, xt.detach())

    t_hess = torch.autograd.functional.hessian(mlp_of_w, torch.tensor(wv))
    _close(hess.numpy(), t_hess, RTOL64, ATOL64, "hessian")
    v = rng.standard_normal((3, 2))
    _, t_hvp = torch.autograd.functional.hvp(mlp_of_w, torch.tensor(wv), torch.tensor(v))
    _close(tg.hvp(f, wv, v).numpy(), t_hvp, RTOL64, ATOL64, "hvp")


def test_nested_grad_against_torch() -> None:
    xv = np.array([0.3, -1.2, 2.0])

    def f(tape: tg.Tape, x: tg.Id) -> Out:
        tape, y = tg.sigmoid(tape, x)
        tape, y = tg.mul(tape, y, x)
        return tg.sum(tape, y)

    def df(tape: tg.Tape, x: tg.Id) -> Out:
        tape, g = tg.grad(f)(tape, x)
        tape, g = tg.mul(tape, g, g)
        return tg.sum(tape, g)

    xt = torch.tensor(xv, requires_grad=True)
    (g1,) = torch.autograd.grad((torch.sigmoid(xt) * xt).sum(), [xt], create_graph=True)
    (g2,) = torch.autograd.grad((g1 * g1).sum(), [xt])
    _close(tg.grad(df)(xv).numpy(), g2, RTOL64, ATOL64, "grad(grad)")


def _torch_steps(opt_cls: Any, p0: list[Array], grads: list[list[Array]], **kw: Any
                 ) -> list[Array]:
    params = [torch.tensor(p, requires_grad=True) for p in p0]
    opt = opt_cls(params, **kw)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in params]


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9),
                                dict(lr=0.1, momentum=0.5, weight_decay=0.01),
                                dict(lr=0.1, weight_decay=0.1)])
def test_sgd_against_torch(kw: dict[str, float]) -> None:
    rng = np.random.default_rng(4)
    p0 = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(5)]
    params: Any = {"w": p0[0], "b": p0[1]}
    state = None
    for step in grads:
        params, state = tg.optim.sgd(params, {"w": step[0], "b": step[1]}, state, **kw)
    want = _torch_steps(torch.optim.SGD, p0, grads, **kw)
    _close(params["w"].numpy(), want[0], RTOL64, ATOL64, "sgd w")
    _close(params["b"].numpy(), want[1], RTOL64, ATOL64, "sgd b")


_ADAM: list[dict[str, float]] = [{}, {"lr": 0.01}, {"lr": 0.02, "b1": 0.8, "b2": 0.99, "eps": 1e-6}]


@pytest.mark.parametrize("kw", _ADAM)
def test_adam_against_torch(kw: dict[str, float]) -> None:
    rng = np.random.default_rng(5)
    p0 = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(6)]
    params: Any = [p0[0], p0[1]]
    state = None
    for step in grads:
        params, state = tg.optim.adam(params, step, state, **kw)
    torch_kw: dict[str, Any] = {"lr": kw.get("lr", 1e-3), "betas": (kw.get("b1", 0.9),
                                kw.get("b2", 0.999)), "eps": kw.get("eps", 1e-8)}
    want = _torch_steps(torch.optim.Adam, p0, grads, **torch_kw)
    _close(params[0].numpy(), want[0], RTOL64, ATOL64, "adam w")
    _close(params[1].numpy(), want[1], RTOL64, ATOL64, "adam b")


def test_gradcheck_true_and_raises_on_a_wrong_vjp() -> None:
    rng = np.random.default_rng(6)

    def f(tape: tg.Tape, x: tg.Id, w: tg.Id, labels: tg.Id) -> Out:
        tape, h = tg.matmul(tape, x, w)
        return tg.cross_entropy(tape, h, labels)

    assert tg.gradcheck(f, rng.standard_normal((4, 3)), rng.standard_normal((3, 5)),
                        np.array([0, 4, 2, 2])) is True
    wrong = tg.elementwise_op("conf_wrong_square", 1, "a * a", ["g * a"])  # should be 2 g a
    with pytest.raises(tg.GradcheckError, match="argument 0"):
        tg.gradcheck(wrong, rng.standard_normal(3))


def test_dropout_seed_scaling_and_gradient() -> None:
    xv = np.random.default_rng(7).standard_normal((64, 32)) + 3.0
    tape, x = tg.leaf(tg.Tape(), xv, requires_grad=True)
    tape, a = tg.dropout(tape, x, 0.25, seed=11)
    tape, b = tg.dropout(tape, x, p=0.25, seed=11)
    tape, c = tg.dropout(tape, x, 0.25, 12)
    av, bv, cv = (tg.value(tape, i).numpy() for i in (a, b, c))
    np.testing.assert_array_equal(av, bv)
    assert not np.array_equal(av, cv)
    kept = av != 0
    np.testing.assert_allclose(av[kept], xv[kept] / 0.75, rtol=1e-14)
    assert 0.65 < kept.mean() < 0.85
    ct = np.random.default_rng(8).standard_normal(xv.shape)
    g = tg.backward(tape, a, seed=ct)[x].numpy()
    np.testing.assert_allclose(g, np.where(kept, ct / 0.75, 0.0), rtol=1e-14)
    tape, same = tg.dropout(tape, x, 0.0, seed=1)
    assert same == x
    tape, zeros = tg.dropout(tape, x, 1.0, seed=1)
    np.testing.assert_array_equal(tg.value(tape, zeros).numpy(), np.zeros_like(xv))
