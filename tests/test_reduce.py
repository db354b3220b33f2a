"""The sum kernels, one case per path `_reduction._pass` picks: contiguous rows, columns eight per
work-item with a narrower last group, and a long axis split in chunks (only above SPLIT_MIN
elements: below it one pass is quicker than two launches)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import on_launch
from tapegrad import _reduction


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axis"), [
    ((256, 512), 0),      # columns in eights (a bias gradient)
    ((3, 1400, 16), 1),   # columns in eights, the long axis in chunks (above SPLIT_MIN)
    ((2, 5, 24), (0, 1)),
    ((7, 9), 0),          # eight columns and a last group of one
    ((7000, 10), 0),      # eight and two, the long axis in chunks
    ((2, 40000), 1),      # rows, in chunks
    ((4, 1000), 1),       # rows
    ((64, 61), 1),        # rows shorter than a block: groups of 8 and a tail of 5
])
def test_sums_match_numpy(shape: tuple[int, ...], axis: Any, dtype: Any) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, s = tg.sum(tape, xi, axis=axis)
    want = x.sum(axis=axis)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    # A sum of k terms of size ~1 is ~sqrt(k): its rounding error grows with it.
    atol = tol * np.sqrt(x.size / want.size)
    np.testing.assert_allclose(tg.value(tape, s).numpy(), want, rtol=tol, atol=atol)


@pytest.mark.parametrize(("dtype", "axis", "keepdims"), [
    (np.bool_, None, False), (np.bool_, 1, True), (np.int32, 0, False), (np.int64, (0, 2), False)])
def test_bools_and_integers_sum_to_int64_as_in_pytorch(dtype: Any, axis: Any, keepdims: bool
                                                       ) -> None:
    # Counting a mask (an accuracy) is the common case; integers sum exactly below 2**53.
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 5, 6)) > 0 if dtype == np.bool_
         else rng.integers(-(2 ** 40), 2 ** 40, (4, 5, 6))).astype(dtype)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, s = tg.sum(tape, xi, axis=axis, keepdims=keepdims)
    got = tg.value(tape, s).numpy()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, x.sum(axis=axis, keepdims=keepdims, dtype=np.int64))
    assert not tape[s].requires_grad


def test_a_mask_counts_in_float32_on_a_device_without_doubles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mask = np.random.default_rng(8).standard_normal((300, 70)) > 0.3
    monkeypatch.setattr(tg.default_device(), "has_fp64", False)
    tape, m = tg.leaf(tg.Tape(), mask)
    tape, s = tg.sum(tape, m, axis=0)
    assert [n.op for n in tape][1:] == ["cast", "sum", "cast"]
    assert tape[tape[s].parents[0]].value.dtype == np.float32
    np.testing.assert_array_equal(tg.value(tape, s).numpy(), mask.sum(axis=0))


def test_a_column_sums_alike_in_a_group_of_eight_and_in_the_last_group() -> None:
    """Both add a column's rows in order: a bias gradient does not depend on where its column
    falls."""
    x = np.random.default_rng(2).standard_normal((300, 9)).astype(np.float32)
    rolled = np.ascontiguousarray(np.roll(x, 8, axis=1))  # column 0 of x is column 8 here
    tape, a = tg.leaf(tg.Tape(), x)
    tape, b = tg.leaf(tape, rolled)
    tape, sa = tg.sum(tape, a, axis=0)
    tape, sb = tg.sum(tape, b, axis=0)
    assert tg.value(tape, sa).numpy()[0] == tg.value(tape, sb).numpy()[8]
    np.testing.assert_array_equal(tg.value(tape, sb).numpy(),
                                  np.roll(tg.value(tape, sa).numpy(), 8))


def _passes(a: int, k: int, b: int, gpu: bool) -> int:
    """Launches `_reduction._pass` makes for (a, k, b): one, and one more per cut of k."""
    passes = 1
    while (parts := _reduction.parts_of(a, k, b, gpu=gpu)) > 1:
        passes, k = passes + 1, parts
    return passes


def _sum_and_count(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], axis: int) -> int:
    """tg.sum of a float32 x of `shape` over `axis`, checked against numpy's; its launches."""
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    tape, xi = tg.leaf(tg.Tape(), x)
    names: collections.Counter[str] = collections.Counter()
    on_launch(monkeypatch, lambda name: names.update([name]))
    tape, s = tg.sum(tape, xi, axis=axis)
    np.testing.assert_allclose(tg.value(tape, s).numpy(), x.sum(axis=axis), rtol=1e-5,
                               atol=1e-4)
    return sum(names.values())


@pytest.mark.parametrize(("shape", "axis", "passes"), [
    ((8, 4096), 1, 1),    # a conv bias gradient: below SPLIT_MIN, one pass
    ((16, 1024), 1, 1),
    ((2, 40000), 1, 2),   # few long rows, above it: chunks, then their sums
    ((7000, 10), 0, 2),
])
def test_a_long_axis_is_split_only_when_the_whole_is_large(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], axis: int, passes: int) -> None:
    a, k, b = (1, shape[0], shape[1]) if axis == 0 else (shape[0], shape[1], 1)
    assert _passes(a, k, b, gpu=False) == passes
    launches = _sum_and_count(monkeypatch, shape, axis)
    assert launches == _passes(a, k, b, gpu=tg.default_device().is_gpu)


@pytest.mark.parametrize(("shape", "axis", "passes"), [
    ((512, 64), 0, 2),    # a layer norm's weight gradient (GPT: batch 16 x block 32 rows)
    ((16, 4096), 1, 2),   # a conv bias gradient, by rows
    ((2, 40000), 1, 2),   # few long rows: chunks of 32, then their sums
    ((4, 1 << 18), 1, 3),  # chunks of chunks
    ((8, 4096), 0, 1),    # outputs enough
    ((40, 60), 0, 1),     # small
])
def test_a_gpu_cuts_a_long_axis_sooner_and_finer(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], axis: int, passes: int) -> None:
    """A GPU cuts k into chunks of 32 or more for thousands of work-items (one work-item
    walking all of a layer norm's rows was most of its weight gradient there): the GPU's
    cut, run by this device's kernels, sums alike."""
    a, k, b = (1, shape[0], shape[1]) if axis == 0 else (shape[0], shape[1], 1)
    assert _passes(a, k, b, gpu=True) == passes
    by_cpu = _reduction.parts_of

    def by_gpu(a: int, k: int, b: int, *, gpu: bool = False) -> int:
        return by_cpu(a, k, b, gpu=True)

    monkeypatch.setattr(_reduction, "parts_of", by_gpu)
    assert _sum_and_count(monkeypatch, shape, axis) == passes


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_split_passes_of_max_logsumexp_and_log_softmax_match_numpy(dtype: Any) -> None:
    # Long rows, few of them, above SPLIT_MIN: the reductions in chunks (the gradient checks
    # run on small inputs, which take one pass).
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 40000)) * 3).astype(dtype)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, mx = tg.max(tape, xi, axis=1)
    tape, mn = tg.min(tape, xi, axis=1)
    tape, lse = tg.logsumexp(tape, xi, axis=1)
    tape, ls = tg.log_softmax(tape, xi)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_array_equal(tg.value(tape, mx).numpy(), x.max(axis=1))
    np.testing.assert_array_equal(tg.value(tape, mn).numpy(), x.min(axis=1))
    m = x.astype(np.float64).max(axis=1, keepdims=True)
    want = np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m
    np.testing.assert_allclose(tg.value(tape, lse).numpy(), want[:, 0], rtol=tol)
    np.testing.assert_allclose(tg.value(tape, ls).numpy(), x - want, rtol=tol, atol=tol)


def _rel(got: Any, want: Any) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.abs(want)))


def test_float32_sums_are_compensated_to_a_few_ulps() -> None:
    # A plain float32 running sum of n terms errs by up to n units in the last place: the sum
    # of 16000 rows over axis 0 erred by 2e-6, the mean of 4001 values near 1e4 by 3e-5, and
    # the variance through that mean by 100%. PyTorch's float32 errs by ~1e-7 on these.
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((16000, 4)).astype(np.float32)
    offset = (rng.random((4001, 5)) + 1e4).astype(np.float32)
    flat = (rng.random(60000) + 1e3).astype(np.float32)
    tape, r = tg.leaf(tg.Tape(), rows)
    tape, o = tg.leaf(tape, offset)
    tape, f = tg.leaf(tape, flat)
    tape, s = tg.sum(tape, r, axis=0)
    tape, m = tg.mean(tape, o, axis=0)
    tape, v = tg.var(tape, o, axis=0)
    tape, sf = tg.sum(tape, f)
    tape, sq = tg.mul(tape, f, f)
    tape, fused = tg.sum(tape, sq)  # summed inside the generated kernel of f * f
    r64, o64, f64 = (a.astype(np.float64) for a in (rows, offset, flat))
    assert _rel(tg.value(tape, s).numpy(), r64.sum(0)) < 5e-7
    assert _rel(tg.value(tape, m).numpy(), o64.mean(0)) < 2e-7
    assert _rel(tg.value(tape, v).numpy(), o64.var(0)) < 5e-7
    assert _rel(tg.value(tape, sf).numpy(), f64.sum()) < 2e-7
    assert _rel(tg.value(tape, fused).numpy(), (f64 * f64).sum()) < 2e-7


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_reaching_infinity_are_infinite_as_numpy(dtype: Any) -> None:
    """A compensated sum that becomes infinite (an infinite term, or an overflow) stays +-inf
    (or NaN for inf - inf), as a plain sum: its compensation would be inf - inf. Rows (short,
    and long enough for blocks), columns (a group of eight and the last group) and a sum fused
    into its pending operand's kernel (the same structure, fourth time)."""
    big = float(np.finfo(dtype).max)
    rows = [[np.inf, 1.0], [-np.inf, 1.0], [big, big], [-big, -big, -big], [np.inf, -np.inf],
            [np.nan, 1.0], [1.0] * 150 + [np.inf] + [1.0] * 149, [big / 4] * 300]
    for row in rows:
        x = np.array(row, dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.sum(dtype=np.float64 if dtype == np.float64 else np.float32)
            cols = np.repeat(x[:, None], 9, axis=1)
        tape, i = tg.leaf(tg.Tape(), x)
        tape, s = tg.sum(tape, i)
        np.testing.assert_array_equal(tg.value(tape, s).numpy(), want, err_msg=str(row[:4]))
        tape, c = tg.leaf(tape, cols)
        tape, sc = tg.sum(tape, c, axis=0)
        np.testing.assert_array_equal(tg.value(tape, sc).numpy(), np.full(9, want))
        for _ in range(4):
            tape, y = tg.mul(tape, i, 1.0)
            tape, sy = tg.sum(tape, y)
            np.testing.assert_array_equal(tg.value(tape, sy).numpy(), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["max", "min"])
def test_row_and_column_extremes_match_numpy_with_nans_and_infinities(name: str, dtype: Any
                                                                      ) -> None:
    """Rows are taken eight running extremes at a time, then the last few elements: a NaN
    anywhere (each running extreme's lane, the tail) makes the row's NaN, an infinity is an
    extreme like any value; columns (the general kernel) alike. Rows shorter than eight too."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((12, 61)).astype(dtype)
    x[1, 0] = x[2, 9] = x[3, 60] = x[4, 55] = np.nan
    x[5, 17] = np.inf
    x[6, 3] = -np.inf
    x[7, :] = -np.inf
    x[8, :] = np.inf
    x[9, 1], x[9, 40] = np.nan, np.inf
    fn = tg.max if name == "max" else tg.min
    want = getattr(np, name)
    for arr in (x, x[:, :5].copy()):
        tape, i = tg.leaf(tg.Tape(), arr)
        tape, rows = fn(tape, i, axis=1)
        tape, cols = fn(tape, i, axis=0)
        np.testing.assert_array_equal(tg.value(tape, rows).numpy(), want(arr, axis=1))
        np.testing.assert_array_equal(tg.value(tape, cols).numpy(), want(arr, axis=0))


def test_keepdims_must_be_a_bool() -> None:
    # PyTorch refuses a non-bool keepdim; taking "no" for its truth would keep the axis.
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    numpy_true: Any = np.True_  # a numpy bool (from a comparison, say) is a bool too
    numpy_false: Any = np.False_
    for keepdims in (True, numpy_true):
        _, y = tg.sum(tape, x, axis=1, keepdims=keepdims)
        assert y.shape == (2, 1)
    _, y = tg.mean(tape, x, axis=1, keepdims=numpy_false)
    assert y.shape == (2,)
    for fn in (tg.sum, tg.mean, tg.var, tg.max, tg.min, tg.logsumexp):
        with pytest.raises(tg.DTypeError, match=f"{fn.__name__}: keepdims must be True or "
                           "False, got 'no'"):
            fn(tape, x, axis=1, keepdims="no")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "logsumexp"])
@pytest.mark.parametrize(("axis", "keepdims"), [(None, False), (1, True), (-1, False), (0, True)])
def test_a_reduction_kept_per_shape_records_what_the_general_path_records(
        op: str, axis: int | None, keepdims: bool) -> None:
    """An int axis (or None) takes the (params, aval) kept per shape, a tuple of axes the
    general path: the same nodes (op, params, parents, gradient flag, call site, values) either
    way; a bad axis still raises, naming the op and the user's line."""
    fn = getattr(tg, op)
    x0 = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    tape, x = tg.leaf(tg.Tape(), x0, requires_grad=True)
    given = [axis, tuple(range(2)) if axis is None else (axis,), axis]
    made: list[list[tuple[object, ...]]] = []
    values: list[np.ndarray[Any, Any]] = []
    for ax in given:
        t, y = fn(tape, x, axis=ax, keepdims=keepdims)
        made.append([(n.op, n.params, tuple(p.index for p in n.parents), n.requires_grad,
                      n.location)
                     for n in list(t)[len(tape):]])
        values.append(tg.value(t, y).numpy())
    assert made[0] == made[1] == made[2] and made[0]
    assert all(np.array_equal(v, values[0]) for v in values)
    assert "test_reduce.py" in str(made[0][0][4])
    with pytest.raises(tg.ShapeError, match=f"{op}: axis 2 is out of range") as err:
        fn(tape, x, axis=2)
    assert "test_reduce.py" in str(err.value)
