"""The reduction kernels, one test per path `reduce._pass` picks: contiguous rows, eight
adjacent columns per work-item, one column per work-item, and a long axis split in chunks."""

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
    ((7, 9), 0),          # one column per work-item
    ((4, 1000), 1),       # rows
])
def test_sums_match_numpy(shape: tuple[int, ...], axis: Any, dtype: Any) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, s = tg.sum(tape, xi, axis=axis)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(tg.value(tape, s).numpy(), x.sum(axis=axis), rtol=tol, atol=tol)


def test_eight_column_sums_are_bitwise_those_of_one_column_per_item() -> None:
    """Both add each column's rows in order: a bias gradient does not depend on its width."""
    x = np.random.default_rng(2).standard_normal((300, 17)).astype(np.float32)
    tape, xi = tg.leaf(tg.Tape(), x)
    tape, wide = tg.sum(tape, xi, axis=0)                             # 17 columns: one per item
    tape, x16 = tg.leaf(tape, np.ascontiguousarray(x[:, :16]))
    tape, eights = tg.sum(tape, x16, axis=0)                          # 16 columns: eights
    np.testing.assert_array_equal(tg.value(tape, eights).numpy(),
                                  tg.value(tape, wide).numpy()[:16])
