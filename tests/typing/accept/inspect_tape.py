"""Seeing a tape and hunting a NaN, as a user would write it."""

from __future__ import annotations

import numpy as np

import tapegrad as tg


def main() -> str:
    tape = tg.Tape()
    tape, x = tg.leaf(tape, np.array([0.0, 1.0, 4.0], np.float32), requires_grad=True, name="x")
    tape, r = tg.sqrt(tape, x)
    tape, loss = tg.sum(tape, r)

    table: str = tg.describe(tape)
    dot: str = tg.to_dot(tape, highlight=loss)
    both: str = tg.to_dot(tape, highlight=[r, loss])
    try:
        tg.backward(tape, loss, check_finite=True)
    except tg.AnomalyError as err:
        found = str(err)
    else:
        found = ""
    with tg.detect_anomaly():
        tape, _ = tg.exp(tape, loss)
    return "\n".join([table, dot, both, found])


if __name__ == "__main__":
    print(main())
