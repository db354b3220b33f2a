"""Where the per-op workload's time goes: the 200-op chain's forward, the sum that realises
it, and the backward, each in us per op (10th percentile of 300 runs after 30 of warm-up).

`python -m benchmarks.per_op_phases`. The workload's row in `make bench` is the median of the
whole chain against PyTorch; this splits tapegrad's own time, to profile before optimising.
"""

from __future__ import annotations

import time

import numpy as np

import tapegrad as tg

from .workloads import per_op_chain


def run(n_ops: int = 200, runs: int = 300) -> dict[str, float]:
    x0 = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    dx = tg.AnyTensor.from_numpy(x0)
    times: dict[str, list[float]] = {"forward": [], "sum": [], "backward": []}

    def chain(record: bool) -> None:
        t0 = time.perf_counter()
        tape, x = tg.leaf(tg.Tape(dx.device), dx, requires_grad=True)
        tape, h = per_op_chain(tape, x, n_ops)
        t1 = time.perf_counter()
        tape, s = tg.sum(tape, h)
        t2 = time.perf_counter()
        tg.backward(tape, s, wrt=[x])
        dx.device.finish()
        t3 = time.perf_counter()
        if record:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[name].append(seconds)

    for _ in range(30):
        chain(False)
    for _ in range(runs):
        chain(True)
    return {k: float(np.percentile(v, 10)) * 1e6 / n_ops for k, v in times.items()}


def main() -> None:
    phases = run()
    print(", ".join(f"{k} {v:.2f}" for k, v in phases.items())
          + f"; total {sum(phases.values()):.2f} us/op (p10)")


if __name__ == "__main__":
    main()
