"""The sum kernels, one case per path `reduce._pass` picks: contiguous rows, columns eight per
work-item with a narrower last group, and a long axis split in chunks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tapegrad as tg


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axis"), [
    ((256, 512), 0),      # columns in eights (a bias gradient)
    ((3, 1100, 16), 1),   # columns in eights, the long axis in chunks
    ((2, 5, 24), (0, 1)),
    ((7, 9), 0),          # eight columns and a last group of one
    ((600, 10), 0),       # eight and two, the long axis in chunks
    ((4, 1000), 1),       # rows
])
def test_sums_match_numpy(shape: tuple[int, ...], axis: Any, dtype: Any) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, s = tg.sum(tape, xi, axis=axis)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(tg.value(tape, s).numpy(), x.sum(axis=axis), rtol=tol, atol=tol)


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
