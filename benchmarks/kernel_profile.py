"""Device time per kernel of a model's training step, from OpenCL profiling events.

    python -m benchmarks.kernel_profile gpt|resnet|lstm [eager]   # tg.jit unless `eager`

The default device's queue is replaced by a profiling one and its inline lane turned off;
every enqueued kernel (eager launches and tg.jit's replayed ones alike) is timed over 5
steps after 8 of warm-up. Kernels
are listed by their total time, then the costliest launch shapes (kernel, global size).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import pyopencl as cl

import tapegrad as tg
from benchmarks import models

STEPS, WARM_UP = 5, 8


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "gpt"
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
    configs = {"gpt": (models.GPTConfig(), models.gpt_init, models.gpt_loss_fn),
               "resnet": (models.ResNetConfig(), models.resnet_init, models.resnet_loss_fn),
               "lstm": (models.LSTMConfig(), models.lstm_init, models.lstm_loss_fn)}
    cfg, init, loss_fn = configs[which]
    params, batch = init(cfg)
    trainer = models.Trainer(loss_fn(cfg), params, batch, jit="eager" not in sys.argv)
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
