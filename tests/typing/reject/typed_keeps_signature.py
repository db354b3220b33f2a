"""tg.typed keeps the decorated function's signature, so static checks still see it."""

from __future__ import annotations

import numpy as np
from jaxtyping import Float

import tapegrad as tg


@tg.typed
def affine(
    tape: tg.Tape, x: Float[tg.Id, "n d"], w: Float[tg.Id, "d k"]
) -> tuple[tg.Tape, Float[tg.Id, "n k"]]:
    return tg.matmul(tape, x, w)


tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
affine(tape, x)  # expect: reportCallIssue: Argument missing for parameter "w"
affine(tape, x, x, bias=None)  # expect: reportCallIssue: No parameter named "bias"
table: int = tg.describe(tape)  # expect: reportAssignmentType
tg.to_dot(tape, highlight=3)  # expect: reportArgumentType


def missing_dims(x: Float[tg.Id]) -> None:  # expect: reportInvalidTypeForm
    print(x)
