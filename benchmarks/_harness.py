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


def median_time(fn: Callable[[], object], warmup: int = 3, repeat: int = 15,
                budget_s: float = 20.0) -> float:
    """Median seconds of fn() after warm-up; stops early if the budget runs out."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def median_times(fns: list[Callable[[], object] | None], warmup: int = 3, repeat: int = 15,
                 budget_s: float = 30.0) -> list[float | None]:
    """Median seconds of each fn (None for a missing one), timed in alternation after warm-up.

    The machine is shared and its speed drifts by tens of percent from one second to the next;
    timing the engines turn by turn gives each the same conditions, so their ratio is fair.
    (Not numpy's BLAS: its threads keep spinning after a call and slow whatever runs next.)
    """
    present = [fn for fn in fns if fn is not None]
    for fn in present:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in present]
    start = time.perf_counter()
    for _ in range(repeat):
        for fn, ts in zip(present, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s and len(times[0]) >= 3:
            break
    medians = iter([statistics.median(ts) for ts in times])
    return [None if fn is None else next(medians) for fn in fns]
