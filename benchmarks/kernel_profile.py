"""Device time per kernel of a model's training step, from OpenCL profiling events.

    python -m benchmarks.kernel_profile MODEL [eager] [inline]   # tg.jit unless `eager`

MODEL: gpt, resnet, lstm, or one of `benchmarks.survey`'s models.

The default device's queue is replaced by a profiling one and its inline lane turned off;
every enqueued kernel (eager launches and tg.jit's replayed ones alike) is timed over 5
steps after 8 of warm-up. Kernels
are listed by their total time, then the costliest launch shapes (kernel, global size).

With `inline`, the device is left as it is and, once the inline lane is built, the wall time
of each enqueue call is taken over 50 steps: a launch on the lane runs inside its call (its
kernel's time and PoCL's own per launch), one on the queue only hands it over. The steps of a
small model (the LSTM) run on the lane this way.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import pyopencl as cl

import tapegrad as tg
from benchmarks import models, survey

STEPS, WARM_UP = 5, 8


def _trainer(which: str) -> models.Trainer:
    if which in survey.SURVEY:
        model = survey.SURVEY[which]()
        return models.Trainer(model.loss_fn, model.params, model.batch,
                              jit="eager" not in sys.argv)
    configs = {"gpt": (models.GPTConfig(), models.gpt_init, models.gpt_loss_fn),
               "resnet": (models.ResNetConfig(), models.resnet_init, models.resnet_loss_fn),
               "lstm": (models.LSTMConfig(), models.lstm_init, models.lstm_loss_fn)}
    cfg, init, loss_fn = configs[which]
    params, batch = init(cfg)
    return models.Trainer(loss_fn(cfg), params, batch, jit="eager" not in sys.argv)


def inline_profile(which: str, steps: int = 50) -> None:
    """Wall time per enqueue call with the device as it is (see the module's doc)."""
    trainer = _trainer(which)
    for _ in range(WARM_UP):
        trainer()
    tg.default_device().wait_for_inline_builds()
    for _ in range(WARM_UP):
        trainer()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer()
    step = (time.perf_counter() - t0) / steps
    enqueue = cl.enqueue_nd_range_kernel
    calls: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def timed(queue: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        event = enqueue(queue, kernel, *args, **kwargs)
        seconds = time.perf_counter() - start  # before this wrapper's own lookups
        entry = calls[kernel.function_name, queue.device.name.split("-")[0]]
        entry[0] += 1
        entry[1] += seconds
        return event

    cl.enqueue_nd_range_kernel = timed
    try:
        for _ in range(steps):
            trainer()
    finally:
        cl.enqueue_nd_range_kernel = enqueue
    inside = sum(seconds for _, seconds in calls.values()) / steps
    print(f"{which}: {step * 1e3:.3f} ms/step; {inside * 1e3:.3f} ms/step inside "
          f"{sum(int(n) for n, _ in calls.values()) // steps} enqueue calls")
    for (name, lane), (n, seconds) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:18]:
        print(f"  {name[:32]:32s} {lane:8s} x{int(n) // steps:<4d} {seconds / steps * 1e3:7.3f} "
              f"ms  {seconds / n * 1e6:6.1f} us a call")


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "gpt"
    if "inline" in sys.argv:
        inline_profile(which)
        return
    device = tg.default_device()
    device._queue = cl.CommandQueue(
        device.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
    # Every launch on the profiled queue: the inline lane's queue keeps no profiling events.
    device.inline_device = None
    events: list[tuple[str, tuple[int, ...], Any]] = []
    collecting = [False]
    enqueue = cl.enqueue_nd_range_kernel

    def timed(queue: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        event = enqueue(queue, kernel, *args, **kwargs)
        if collecting[0]:
            events.append((kernel.function_name, tuple(args[0]), event))
        return event

    cl.enqueue_nd_range_kernel = timed
    trainer = _trainer(which)
    for _ in range(WARM_UP):
        trainer()
    collecting[0] = True
    for _ in range(STEPS):
        trainer()
    device.finish()
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    by_shape: dict[tuple[str, tuple[int, ...]], float] = collections.defaultdict(float)
    shape_count: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()
    for name, size, event in events:
        ms = (event.profile.end - event.profile.start) * 1e-6
        total[name] += ms
        count[name] += 1
        by_shape[name, size] += ms
        shape_count[name, size] += 1
    print(f"{which}: device {sum(total.values()) / STEPS:.2f} ms/step in "
          f"{sum(count.values()) // STEPS} launches")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {name[:40]:40s} {ms / STEPS:7.3f} ms  x{count[name] // STEPS}")
    print("costliest launch shapes (kernel, global size):")
    for (name, size), ms in sorted(by_shape.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name[:28]:28s} {size!s:20s} {ms / STEPS:7.3f} ms  "
              f"x{shape_count[name, size] // STEPS}")


if __name__ == "__main__":
    main()
