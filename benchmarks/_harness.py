"""Timing helpers shared by the workloads: medians of repeated runs after warm-up."""

from __future__ import annotations

import cProfile
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
                 budget_s: float = 30.0, block: int = 5, settle_s: float = 0.02
                 ) -> list[float | None]:
    """Median seconds of each fn (None for a missing one), timed in alternating blocks.

    The machine is shared and its speed drifts by tens of percent from one second to the next;
    timing the engines in turns gives each the same conditions, so their ratio is fair. A turn
    is `block` counted runs after the runs of its first `settle_s` seconds (at least one),
    which are not counted: PyTorch's OpenMP threads spin-wait after a parallel region and take
    the CPU from whatever runs right after (a tapegrad MLP step measured 15.9 ms right after
    torch's, 11.7 ms with its threads asleep; the 2-3 ms CNN step stayed 50-100% slower for
    3-8 steps after torch's). numpy's BLAS spins longer still, so its reference is timed on
    its own.
    """
    present = [fn for fn in fns if fn is not None]
    times: list[list[float]] = [[] for _ in present]
    start = time.perf_counter()
    rounds = 0
    while min(len(ts) for ts in times) < repeat:
        for fn, ts in zip(present, times, strict=True):
            if rounds == 0:
                for _ in range(warmup):
                    fn()
            switched = time.perf_counter()
            counted = 0
            first = len(present) > 1  # alone, nothing to settle from
            while counted < block:
                t = time.perf_counter()
                fn()
                end = time.perf_counter()
                if first or (len(present) > 1 and t - switched < settle_s):
                    first = False
                    continue
                ts.append(end - t)
                counted += 1
        rounds += 1
        if time.perf_counter() - start > budget_s and min(len(ts) for ts in times) >= 3:
            break
    medians = iter([statistics.median(ts) for ts in times])
    return [None if fn is None else next(medians) for fn in fns]


def profiled(fn: Callable[[], object], runs: int = 1, warm_up: int = 3) -> cProfile.Profile:
    """A profile of `runs` calls of fn after `warm_up` unprofiled ones (pstats.Stats reads
    it)."""
    for _ in range(warm_up):
        fn()
    with cProfile.Profile() as prof:
        for _ in range(runs):
            fn()
    return prof
