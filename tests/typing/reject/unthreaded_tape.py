"""Ops return (tape, id): forgetting to unpack, or returning only the id, is a type error."""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

import tapegrad as tg


def total(tape: tg.Tape, x: Float[tg.Id, " n"]) -> tuple[tg.Tape, Float[tg.Id, ""]]:
    return tg.sum(tape, x)[1]  # expect: reportReturnType: "Id" is not assignable to return type


def twice(tape: tg.Tape, x: Float[tg.Id, " n"]) -> tuple[tg.Tape, Float[tg.Id, " n"]]:
    y = tg.exp(tape, x)
    return tg.mul(tape, y, 2.0)  # expect: reportArgumentType


tape0, x0 = tg.leaf(tg.Tape(), np.ones(3, np.float32))
loss = tg.sum(tape0, x0)
grads = tg.backward(tape0, loss)  # expect: reportArgumentType: parameter "loss"
