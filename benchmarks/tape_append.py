"""Appending along one line of use is O(1) amortized: time per node stays flat up to 1,000,000.

Each append is `tg.leaf(tape, t)` with one device tensor `t` reused, so no data moves and the
figure is the tape's own cost (plus the leaf's checks and call-site capture).
"""

from __future__ import annotations

import time

import numpy as np

import tapegrad as tg


def run(sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)) -> list[tuple[int, float, float]]:
    t = tg.AnyTensor.from_numpy(np.zeros(1, np.float32))
    rows: list[tuple[int, float, float]] = []
    for n in sizes:
        tape = tg.Tape(t.device)
        start = time.perf_counter()
        for _ in range(n):
            tape, _ = tg.leaf(tape, t)
        seconds = time.perf_counter() - start
        rows.append((n, seconds, seconds / n * 1e6))
    return rows


def main() -> None:
    print("tape appends (one line of use)")
    print(f"{'nodes':>10} {'seconds':>9} {'us/append':>10}")
    for n, seconds, per in run():
        print(f"{n:>10,} {seconds:>9.3f} {per:>10.2f}")


if __name__ == "__main__":
    main()
