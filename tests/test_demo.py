"""The digits demo's pieces: typed layers reject wrong shapes; a short run learns."""

from __future__ import annotations

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.demo import digits


def test_short_training_run_learns() -> None:
    data = digits.load()
    small = digits.Data(data.x_train[:256], data.y_train[:256], data.x_test, data.y_test)
    before = digits.accuracy(digits.mlp, digits.mlp_params(0), small.x_test, small.y_test)
    _, losses, acc = digits.train("MLP", digits.mlp, digits.mlp_params(0), small, epochs=6,
                                  lr=1e-2)
    assert losses[-1] < losses[0]
    assert acc > max(0.8, before + 0.3)


def test_typed_layer_rejects_a_wrong_shape() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 64), np.float32))
    tape, w = tg.leaf(tape, np.ones((32, 10), np.float32))  # should be (64, ...)
    tape, b = tg.leaf(tape, np.ones(10, np.float32))
    with pytest.raises(Exception, match="fin"):
        digits.dense(tape, x, w, b)


def test_plot_writes_a_png(tmp_path: object) -> None:
    path = f"{tmp_path}/loss.png"
    digits.plot({"MLP": [1.0, 0.5, 0.25]}, path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
