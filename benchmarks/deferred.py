"""Deferred forwards against forwards run at once, in one process, alternating rounds.

`python -m benchmarks.deferred [lstm|gpt|resnet] [rounds]`: the model's eager training step
(value_and_grad, Adam, finish) and its forward alone ending in a host read of the loss, each
with `_tape.deferring(True)` and `(False)` in turn; the medians, and whether the two modes
gave the same bits. The two modes' sweeps are separate structures (a sweep's key says which
values are deferred), so each replays its own program.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import tapegrad as tg
from tapegrad._tape import deferring
from tapegrad._transforms import _leaves

from . import models

MODELS: dict[str, tuple[Callable[[], Any], Callable[..., Any], Callable[..., Any]]] = {
    "lstm": (models.LSTMConfig, models.lstm_init, models.lstm_loss_fn),
    "gpt": (models.GPTConfig, models.gpt_init, models.gpt_loss_fn),
    "resnet": (models.ResNetConfig, models.resnet_init, models.resnet_loss_fn),
}


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "lstm"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    make_config, init, make_loss = MODELS[which]
    cfg = make_config()
    params, batch = init(cfg)
    loss_fn = make_loss(cfg)
    trainers = {}
    for on in (True, False):
        with deferring(on):
            trainers[on] = models.Trainer(loss_fn, params, batch, jit=False)
            for _ in range(6):
                trainers[on]()
    dev_params, dev_batch = models.to_device(params), models.to_device(batch)

    def forward() -> Any:
        tape, trees, _, _ = _leaves(tg.Tape(), (dev_params, dev_batch), [0], "x")
        tape, loss = loss_fn(tape, *trees)
        return tg.value(tape, loss).numpy()

    steps: dict[bool, list[float]] = {True: [], False: []}
    reads: dict[bool, list[float]] = {True: [], False: []}
    bits: dict[bool, list[bytes]] = {True: [], False: []}
    for on in (True, False):
        with deferring(on):
            for _ in range(5):
                forward()
    for _ in range(rounds):
        for on in (True, False):
            with deferring(on):
                start = time.perf_counter()
                for _ in range(4):
                    trainers[on]()
                steps[on].append((time.perf_counter() - start) / 4 * 1e3)
                loss = trainers[on].loss
                assert loss is not None
                bits[on].append(loss.numpy().tobytes())
                start = time.perf_counter()
                for _ in range(4):
                    out = forward()
                reads[on].append((time.perf_counter() - start) / 4 * 1e3)
                bits[on].append(out.tobytes())
    print(f"{which}: train step {statistics.median(steps[True]):.2f} ms deferred, "
          f"{statistics.median(steps[False]):.2f} at once; forward with a read "
          f"{statistics.median(reads[True]):.2f} / {statistics.median(reads[False]):.2f} ms; "
          f"same bits: {bits[True] == bits[False]}")


if __name__ == "__main__":
    main()
