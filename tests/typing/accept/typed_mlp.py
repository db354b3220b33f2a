"""A typed two-layer network: dimension names bind across arguments and through the result."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from jaxtyping import Float, Int

import tapegrad as tg


@tg.typed
def layer(
    tape: tg.Tape,
    x: Float[tg.Id, "batch d_in"],
    w: Float[tg.Id, "d_in d_out"],
    b: Float[tg.Id, " d_out"],
) -> tuple[tg.Tape, Float[tg.Id, "batch d_out"]]:
    tape, h = tg.matmul(tape, x, w)
    tape, h = tg.add(tape, h, b)
    return tg.tanh(tape, h)


@tg.typed
def squared_error(
    tape: tg.Tape, pred: Float[tg.Id, "batch 1"], target: Float[tg.Id, "batch 1"]
) -> tuple[tg.Tape, Float[tg.Id, ""]]:
    tape, d = tg.sub(tape, pred, target)
    tape, d2 = tg.mul(tape, d, d)
    return tg.mean(tape, d2)


@tg.typed
def count_positive(labels: Int[tg.Id, " batch"]) -> int:
    return labels.shape[0]


def main() -> float:
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    tape, x = tg.leaf(tape, rng.standard_normal((8, 3)).astype(np.float32), name="x")
    tape, y = tg.leaf(tape, rng.standard_normal((8, 1)).astype(np.float32), name="y")
    tape, w1 = tg.leaf(tape, rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    tape, b1 = tg.leaf(tape, np.zeros(4, np.float32), requires_grad=True)
    tape, w2 = tg.leaf(tape, rng.standard_normal((4, 1)).astype(np.float32), requires_grad=True)
    tape, b2 = tg.leaf(tape, np.zeros(1, np.float32), requires_grad=True)
    tape, labels = tg.leaf(tape, np.arange(8))
    assert count_positive(labels) == 8

    tape, h = layer(tape, x, w1, b1)
    tape, out = layer(tape, h, w2, b2)
    tape, loss = squared_error(tape, out, y)

    grads: Mapping[tg.Id, tg.AnyTensor] = tg.backward(tape, loss)
    gw1: tg.AnyTensor = tg.require(tape, w1, (3, 4), np.float32)
    assert grads[w1].shape == gw1.shape
    return float(tg.value(tape, loss).numpy())


if __name__ == "__main__":
    print(main())
