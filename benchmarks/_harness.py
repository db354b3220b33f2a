"""Timing helpers shared by the workloads: medians of repeated runs after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Row:
    workload: str
    unit: str
    tapegrad: float | None
    torch: float | None = None
    numpy: float | None = None
    note: str = ""
    higher_is_better: bool = False

    @property
    def ratio(self) -> float | None:
        """tapegrad's time over torch's (for rates, torch's rate over tapegrad's): <1 is faster."""
        if self.tapegrad is None or self.torch is None or self.tapegrad == 0:
            return None
        return self.torch / self.tapegrad if self.higher_is_better else self.tapegrad / self.torch


def median_times(fns: list[Callable[[], object] | None], warmup: int = 3, repeat: int = 15,
                 budget_s: float = 30.0, block: int = 5) -> list[float | None]:
    """Median seconds of each fn (None for a missing one), timed in alternating blocks.

    The machine is shared and its speed drifts by tens of percent from one second to the next;
    timing the engines in turns gives each the same conditions, so their ratio is fair. A turn
    is `block` runs, and the first run after a switch is not counted: PyTorch's OpenMP threads
    spin-wait after a parallel region and take the CPU from whatever runs right after (a
    tapegrad MLP step measured 15.9 ms right after torch's, 11.7 ms with its threads asleep).
    numpy's BLAS spins longer still, so its reference is timed on its own.
    """
    present = [fn for fn in fns if fn is not None]
    times: list[list[float]] = [[] for _ in present]
    start = time.perf_counter()
    rounds = 0
    while min(len(ts) for ts in times) < repeat:
        for fn, ts in zip(present, times, strict=True):
            for run in range(block + 1 if len(present) > 1 else block):
                if rounds == 0 and run < warmup:
                    fn()
                    continue
                t = time.perf_counter()
                fn()
                if run > 0 or len(present) == 1:
                    ts.append(time.perf_counter() - t)
        rounds += 1
        if time.perf_counter() - start > budget_s and min(len(ts) for ts in times) >= 3:
            break
    medians = iter([statistics.median(ts) for ts in times])
    return [None if fn is None else next(medians) for fn in fns]
