"""Arrays and gradients are values, not ids: they must go through tg.leaf first."""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

import tapegrad as tg


@tg.typed
def scale(tape: tg.Tape, x: Float[tg.Id, "a b"]) -> tuple[tg.Tape, Float[tg.Id, "a b"]]:
    return tg.mul(tape, x, 0.5)


data = np.ones((2, 3), np.float32)
tape, w = tg.leaf(tg.Tape(), data, requires_grad=True)
tape, y = scale(tape, data)  # expect: reportArgumentType: parameter "x" of type "Id"
tape, s = tg.sum(tape, y)
g = tg.backward(tape, s)[w]
tape, z = tg.exp(tape, g)  # expect: reportArgumentType: "AnyTensor" is not assignable
