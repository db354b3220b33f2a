"""tril/triu, argmax/argmin, cumsum and split: the semantics the op table's random rows do not
reach (ties, NaN, integers, the chunked paths of long axes, split's edge cases) and bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tapegrad as tg

Array = np.ndarray[Any, Any]


def _run(op: Any, x: Array, *args: Any, **kw: Any) -> Array:
    tape = tg.Tape()
    tape, i = tg.leaf(tape, x)
    tape, out = op(tape, i, *args, **kw)
    return tg.value(tape, out).numpy()


# --- tril and triu ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [-2**62, -5, -3, -1, 0, 1, 2, 6, 2**63 - 1])
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (2, 3, 1, 4), (0, 3), (2, 0, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.bool_])
def test_triangles_match_numpy(k: int, shape: tuple[int, ...], dtype: Any) -> None:
    x = (np.arange(np.prod(shape)).reshape(shape) % 5 + 1).astype(dtype)
    for op, ref in ((tg.tril, np.tril), (tg.triu, np.triu)):
        got = _run(op, x, k)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, ref(x, k))


def test_triangle_gradient_is_the_mask() -> None:
    x = np.ones((2, 3, 3))
    for op, ref in ((tg.tril, np.tril), (tg.triu, np.triu)):
        def loss(tape: tg.Tape, i: tg.Id, op: Any = op) -> tuple[tg.Tape, tg.Id]:
            tape, y = op(tape, i, np.int64(-1))  # numpy's integers are ints too
            return tg.sum(tape, y)

        np.testing.assert_array_equal(tg.grad(loss)(x).numpy(), ref(x, -1))


def test_triangles_past_every_diagonal() -> None:
    """Offsets beyond int64 (numpy's tril overflows there) keep all or nothing."""
    x = np.arange(1.0, 7.0).reshape(2, 3)
    for k, lower, upper in ((-2**70, 0 * x, x), (2**70, x, 0 * x)):
        np.testing.assert_array_equal(_run(tg.tril, x, k), lower)
        np.testing.assert_array_equal(_run(tg.triu, x, k), upper)


def test_triangle_bad_input() -> None:
    tape = tg.Tape()
    tape, v = tg.leaf(tape, np.ones(3))
    with pytest.raises(tg.ShapeError, match=r"tril: x has shape \(3,\) but needs at least 2 axes"
                       r"[\s\S]*called at .*test_ops_scan.py"):
        tg.tril(tape, v)
    tape, m = tg.leaf(tape, np.ones((2, 2)))
    with pytest.raises(tg.ArgumentTypeError, match=r"triu: k must be an int .*got 1\.5"):
        tg.triu(tape, m, 1.5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ArgumentTypeError, match="tril: k must be an int"):
        tg.tril(tape, m, True)


# --- argmax and argmin ------------------------------------------------------------------------

_TIES = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 2.0, -1.0, 0.0]])


@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
@pytest.mark.parametrize("keepdims", [False, True])
def test_arg_reductions_ties_take_the_first_index(axis: Any, keepdims: bool) -> None:
    torch = pytest.importorskip("torch")
    for op, ref in ((tg.argmax, np.argmax), (tg.argmin, np.argmin)):
        got = _run(op, _TIES, axis=axis, keepdims=keepdims)
        want = ref(_TIES, axis=axis, keepdims=keepdims)
        assert got.dtype == np.int64 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # PyTorch's CPU kernels agree on ties (first index) for these.
    t = torch.tensor(_TIES)
    if axis is not None:
        np.testing.assert_array_equal(_run(tg.argmax, _TIES, axis), torch.argmax(t, axis).numpy())


def test_arg_reductions_nan_gives_the_first_nan_as_numpy() -> None:
    x = np.array([[1.0, np.nan, 5.0, np.nan], [np.inf, -np.inf, 2.0, 2.0],
                  [-np.inf, -np.inf, -np.inf, np.nan]])
    for op, ref in ((tg.argmax, np.argmax), (tg.argmin, np.argmin)):
        for axis in (None, 0, 1):
            np.testing.assert_array_equal(_run(op, x, axis), ref(x, axis))
            np.testing.assert_array_equal(_run(op, x.astype(np.float32), axis), ref(x, axis))
    assert _run(tg.argmax, x) == 1 and _run(tg.argmin, x) == 1


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_arg_reductions_of_integers_and_bools(dtype: Any) -> None:
    x = np.array([[3, 7, 7, -2], [0, 0, 1, 1]]).astype(dtype)
    for op, ref in ((tg.argmax, np.argmax), (tg.argmin, np.argmin)):
        for axis in (None, 0, 1):
            np.testing.assert_array_equal(_run(op, x, axis), ref(x, axis))


@pytest.mark.parametrize("shape,axis", [((1 << 17,), 0), ((3, 40000), 1), ((50000, 2), 0),
                                        ((2, 1 << 15, 3), 1)])
def test_arg_reductions_of_long_axes_split_in_chunks_give_the_first_index(
        shape: tuple[int, ...], axis: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(-1000, 1000, shape).astype(np.float32)  # many ties across chunks
    for op, ref in ((tg.argmax, np.argmax), (tg.argmin, np.argmin)):
        np.testing.assert_array_equal(_run(op, x, axis), ref(x, axis))
        np.testing.assert_array_equal(_run(op, x), ref(x))
    x.reshape(-1)[77777 % x.size] = np.nan
    x.reshape(-1)[-5] = np.nan
    np.testing.assert_array_equal(_run(tg.argmax, x, axis), np.argmax(x, axis))
    np.testing.assert_array_equal(_run(tg.argmin, x), np.argmin(x))


def test_argmax_picks_for_take_and_takes_no_gradient() -> None:
    x = np.array([[0.5, 2.0, -1.0], [3.0, 1.0, 3.0]])
    tape = tg.Tape()
    tape, i = tg.leaf(tape, x, requires_grad=True)
    tape, at = tg.argmax(tape, i)
    assert at.shape == () and at.dtype == np.int64 and not tape[at].requires_grad
    tape, best = tg.take(tape, i, at, axis=None)
    grads = tg.backward(tape, best)
    np.testing.assert_array_equal(grads[i].numpy(), [[0, 0, 0], [1, 0, 0]])
    tape, at = tg.argmin(tape, i, axis=None, keepdims=True)
    assert at.shape == (1, 1)


def test_arg_reduction_bad_input() -> None:
    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((2, 3)))
    with pytest.raises(tg.ShapeError, match=r"argmax: axis 2 is out of range for a tensor of "
                       r"rank 2 \(valid: -2..1\)[\s\S]*called at .*test_ops_scan.py"):
        tg.argmax(tape, x, 2)
    with pytest.raises(tg.ArgumentTypeError, match=r"argmin: axis must be an int or None, got "
                       r"\(0, 1\) \(a single axis"):
        tg.argmin(tape, x, (0, 1))  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ArgumentTypeError,
                       match=r"argmax: axis must be an int or None, got 0\.0"):
        tg.argmax(tape, x, 0.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.DTypeError, match="argmax: keepdims must be True or False"):
        tg.argmax(tape, x, 0, "yes")  # pyright: ignore[reportArgumentType]
    tape, e = tg.leaf(tape, np.ones((0, 3)))
    with pytest.raises(tg.ShapeError, match=r"argmax: attempt to get argmax of an empty sequence"):
        tg.argmax(tape, e, 0)
    with pytest.raises(tg.ShapeError, match="argmin: attempt to get argmin of an empty"):
        tg.argmin(tape, e)
    np.testing.assert_array_equal(_run(tg.argmax, np.ones((0, 3)), 1), np.zeros((0,)))
    tape, s = tg.leaf(tape, 2.0)
    assert _run(tg.argmax, np.array(2.0, np.float32)) == 0
    with pytest.raises(tg.ShapeError, match="rank 0"):
        tg.argmax(tape, s, 0)


# --- cumsum -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_cumsum_of_integers_is_int64_as_numpy(dtype: Any) -> None:
    x = np.array([[3, 0, 2], [1, 1, 5]]).astype(dtype)
    for axis in (None, 0, -1):
        got, want = _run(tg.cumsum, x, axis), np.cumsum(x, axis)
        assert got.dtype == want.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    big = np.full(5, 2**40, np.int64)
    np.testing.assert_array_equal(_run(tg.cumsum, big, 0), np.cumsum(big))


@pytest.mark.parametrize("shape,axis", [((1 << 17,), 0), ((3, 60000), 1), ((40000, 2), 0),
                                        ((2, 1 << 15, 3), 1), ((4, 5000), 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cumsum_of_long_axes_is_accurate_forward_and_back(shape: tuple[int, ...], axis: int,
                                                          dtype: Any) -> None:
    """Long rows are cut in chunks (a carry per chunk); the sums stay within an ulp or so of
    the exact prefix in float32, as PyTorch's (which accumulate in double)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(dtype)
    # The reference in long double (x86: 64-bit significands), near exact for float64 too.
    exact = np.cumsum(x.astype(np.longdouble), axis)
    got = _run(tg.cumsum, x, axis).astype(np.longdouble)
    eps = float(np.finfo(dtype).eps)
    assert np.max(np.abs(got - exact) / np.maximum(np.abs(exact), 1.0)) <= 2 * eps
    g = rng.standard_normal(shape).astype(dtype)
    tape = tg.Tape()
    tape, i = tg.leaf(tape, x, requires_grad=True)
    tape, y = tg.cumsum(tape, i, axis)
    grads = tg.backward(tape, y, seed=tg.AnyTensor.from_numpy(g))
    want = np.flip(np.cumsum(np.flip(g.astype(np.longdouble), axis), axis), axis)
    back = grads[i].numpy().astype(np.longdouble)
    assert np.max(np.abs(back - want) / np.maximum(np.abs(want), 1.0)) <= 2 * eps


def test_cumsum_float32_error_on_a_long_row_is_no_worse_than_pytorchs() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal(1 << 20).astype(np.float32)
    exact = np.cumsum(x.astype(np.float64))
    scale = np.maximum(np.abs(exact), 1.0)
    ours = np.max(np.abs(_run(tg.cumsum, x, 0) - exact) / scale)
    theirs = np.max(np.abs(torch.cumsum(torch.from_numpy(x), 0).numpy() - exact) / scale)
    assert ours <= 1.01 * theirs + 1e-9


def test_cumsum_infinities_and_nan_as_numpy() -> None:
    x = np.array([1.0, np.inf, 2.0, -np.inf, 3.0])
    y = np.array([1.0, np.nan, 2.0])
    with np.errstate(invalid="ignore"):  # inf + -inf
        want_x, want_y = np.cumsum(x), np.cumsum(y)
    np.testing.assert_array_equal(_run(tg.cumsum, x, 0), want_x)
    np.testing.assert_array_equal(_run(tg.cumsum, y.astype(np.float32), 0), want_y)


def test_cumsum_bad_input() -> None:
    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((2, 3)))
    with pytest.raises(tg.ShapeError, match=r"cumsum: axis -3 is out of range for a tensor of "
                       r"rank 2 \(valid: -2..1\)[\s\S]*called at .*test_ops_scan.py"):
        tg.cumsum(tape, x, -3)
    with pytest.raises(tg.ArgumentTypeError, match="cumsum: axis must be an int or None, got"
                       r" \[0\]"):
        tg.cumsum(tape, x, [0])  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ArgumentTypeError,
                       match=r"cumsum: axis must be an int or None, got 1\.0"):
        tg.cumsum(tape, x, 1.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError):
        tg.cumsum(tape, x)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]


# --- split ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sections,axis", [
    (1, 0), (3, 0), (5, -1), ([], 0), ([0], 1), ([2, 2], 1), ([4, 1, 9], 1), ([-1], -1),
    ([-10, 2], 1), (np.array([1, 3]), 1), ((np.int64(2),), 0), (np.int64(2), 0),
])
def test_split_matches_numpy(sections: Any, axis: int) -> None:
    x = np.arange(6 * 5, dtype=np.float64).reshape(6, 5)
    tape = tg.Tape()
    tape, i = tg.leaf(tape, x, requires_grad=True)
    tape, pieces = tg.split(tape, i, sections, axis=axis)
    want = np.split(x, sections, axis=axis)
    assert len(pieces) == len(want)
    for piece, w in zip(pieces, want, strict=True):
        assert piece.shape == w.shape
        np.testing.assert_array_equal(tg.value(tape, piece).numpy(), w)
    # Each piece's gradient lands in its own place of x.
    scaled: list[tg.Id] = []
    for n, piece in enumerate(pieces):
        tape, s = tg.mul(tape, piece, float(n + 1))
        tape, s = tg.sum(tape, s)
        scaled.append(s)
    tape, total = tg.stack(tape, scaled)
    tape, loss = tg.sum(tape, total)
    g = tg.backward(tape, loss)[i].numpy()
    marks = np.zeros_like(x)  # pieces may overlap ([4, 1, 9]: x[:4], x[4:1], x[1:9])
    where = np.split(np.arange(x.size).reshape(x.shape), sections, axis=axis)
    for n, w in enumerate(where):
        np.add.at(marks.reshape(-1), w.reshape(-1), n + 1.0)
    np.testing.assert_array_equal(g, marks)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_equal_pieces_record_what_cut_points_record(requires_grad: bool) -> None:
    """A split into equal sections (its pieces' params kept per shape) records the nodes that
    the same cuts given as a numpy int record through the general path: the same ops, params,
    parents, values, gradient flags and call site; and again, from its kept params."""
    x0 = np.arange(4 * 12, dtype=np.float32).reshape(4, 12)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=requires_grad)
    recorded: list[list[tuple[object, ...]]] = []
    for sections in (4, np.int64(4), 4):
        t, pieces = tg.split(tape, x, sections, axis=-1)  # pyright: ignore[reportArgumentType]
        recorded.append([(t[p].op, t[p].params, t[p].parents, t[p].requires_grad,
                          t[p].location, p.shape) for p in pieces])
        for n, piece in enumerate(pieces):
            np.testing.assert_array_equal(tg.value(t, piece).numpy(), x0[:, 3 * n:3 * n + 3])
    assert recorded[0] == recorded[1] == recorded[2]
    assert {r[0] for r in recorded[0]} == {"slice"} and len(recorded[0]) == 4
    assert all(r[3] is requires_grad for r in recorded[0])
    # The kept params were taken (the same objects again), not made anew as the general path's
    params = [[r[1] for r in calls] for calls in recorded]
    assert all(a is b for a, b in zip(params[0], params[2], strict=True))
    assert not any(a is b for a, b in zip(params[0], params[1], strict=True))


def test_split_bad_input() -> None:
    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.ones((5, 4)))
    with pytest.raises(tg.ShapeError, match=r"split: array split does not result in an equal "
                       r"division: an axis of size 5 cannot be cut into 2 equal sections"
                       r"[\s\S]*called at .*test_ops_scan.py"):
        tg.split(tape, x, 2)
    with pytest.raises(tg.ShapeError, match="split: sections_or_indices 0 must be a positive"):
        tg.split(tape, x, 0)
    with pytest.raises(tg.ArgumentTypeError, match=r"split: cut points must be ints, got 1\.5"):
        tg.split(tape, x, [1.5])  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ArgumentTypeError, match="split: sections_or_indices must be an int"):
        tg.split(tape, x, 2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tg.ShapeError, match=r"split: axis 2 is out of range for a tensor of "
                       r"rank 2"):
        tg.split(tape, x, 1, axis=2)
    with pytest.raises(tg.ArgumentTypeError, match="split: axis must be an int, got None"):
        tg.split(tape, x, 1, axis=None)  # pyright: ignore[reportArgumentType]
    before = len(tape)
    with pytest.raises(tg.ArgumentTypeError):
        tg.split(tape, x, [1, "2"])  # pyright: ignore[reportArgumentType]
    assert len(tape) == before


def test_long_axes_are_cut_into_chunks_none_of_them_empty() -> None:
    """An empty last chunk (120000 in 468 chunks of 257) once read past the row."""
    from tapegrad._ops import scan

    for a, k, b in ((1, 120000, 1), (3, 40000, 1), (1, 1 << 17, 1), (2, 70001, 1), (1, 513, 200)):
        parts, chunk = scan._chunks(a, k, b)  # pyright: ignore[reportPrivateUsage]
        assert parts * chunk >= k and (parts - 1) * chunk < k
