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
