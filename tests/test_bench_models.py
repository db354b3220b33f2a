"""The research-model benchmarks (benchmarks/models.py) at tiny sizes, so that they cannot rot:
two training steps of each model, eagerly and under tg.jit, against its PyTorch twins."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cold_start, models

TINY: dict[str, Callable[[], models.Model]] = {
    "gpt": lambda: models.gpt_model(
        models.GPTConfig(vocab=11, block=8, width=16, layers=1, heads=2, batch=2)),
    "resnet": lambda: models.resnet_model(models.ResNetConfig(batch=2, size=8, widths=(4, 8))),
    "lstm": lambda: models.lstm_model(models.LSTMConfig(steps=3, batch=2, inputs=4, hidden=8)),
}


@pytest.mark.parametrize("name", list(TINY))
def test_two_steps_train_and_match_torch(name: str) -> None:
    model = TINY[name]()
    eager = models.first_losses(model, 2, jit=False)
    assert all(math.isfinite(v) for v in eager), eager
    assert eager[1] < eager[0], f"{name}: Adam's first step did not lower the loss: {eager}"
    # past the recordings (steps 1-2) and the check (3): steps 4-5 are replays
    assert models.first_losses(model, 5, jit=True) == models.first_losses(model, 5, jit=False), (
        "tg.jit is not bitwise eager")
    if models.torch is None:
        return
    twins = models.torch_first_losses(model, 2)
    assert twins
    for twin, losses in twins.items():
        # the same weights, batch and Adam: the same losses up to float32 rounding
        assert losses == pytest.approx(eager, rel=1e-5, abs=1e-6), (name, twin, losses, eager)


def test_a_models_first_jitted_call_is_timed_in_a_fresh_process() -> None:
    """`make bench`'s first-call rows: a new process builds its programs (the core program,
    at least) and times a first call that records the step."""
    first, second, builds = cold_start.run_model("lstm", cold=False)
    assert builds >= 1
    assert 0.0 < first < 600.0 and 0.0 < second < 600.0
