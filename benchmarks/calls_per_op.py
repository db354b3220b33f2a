"""Python calls per op of the 200-op chain (forward, sum, backward), counted by cProfile:
an exact measure of the host path's length where timings on a shared machine are not.

    python -m benchmarks.calls_per_op
"""

from __future__ import annotations

import pstats

import numpy as np

import tapegrad as tg

from ._harness import profiled
from .workloads import per_op_chain

N_OPS, WARM_UP, RUNS = 200, 20, 10


def main() -> None:
    x0 = tg.AnyTensor.from_numpy(np.random.default_rng(0).standard_normal(16).astype(np.float32))

    def chain() -> None:
        tape, x = tg.leaf(tg.Tape(x0.device), x0, requires_grad=True)
        tape, h = per_op_chain(tape, x, N_OPS)
        tape, s = tg.sum(tape, h)
        tg.backward(tape, s)[x].numpy()

    stats = pstats.Stats(profiled(chain, RUNS, WARM_UP))
    print(f"Python calls per op: {stats.total_calls / RUNS / N_OPS:.2f}")


if __name__ == "__main__":
    main()
