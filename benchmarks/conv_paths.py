"""conv2d as one primitive against its old composition (im2col, then the product), in one
process, the training steps alternating: wall time and device time (OpenCL profiling events)
per step, and the kernels each spends it in.

    python -m benchmarks.conv_paths resnet   # benchmarks.models' ResNet step (eager)
    python -m benchmarks.conv_paths mnist    # 64 images 28x28, two valid 3x3 convs and a pool
    python -m benchmarks.conv_paths mnist same   # the same with padding 1

The old composition is recorded here from the primitives that remain (im2col, matmul_t with
C written in NCHW); its VJP is the product's: the weight's gradient g @ cols^T over the
stored patch matrix, x's col2im(w^T g).
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyopencl as cl

import tapegrad as tg
from benchmarks import models
from tapegrad import _device
from tapegrad._ops import conv, linalg
from tapegrad._ops import shape as shape_ops
from tapegrad._tape import record

Conv = Callable[..., tuple[tg.Tape, tg.Id]]
ROUNDS, STEPS = 12, 3


def im2col_conv2d(tape: tg.Tape, x: tg.Id, w: tg.Id, b: tg.Id | None = None,
                  stride: int = 1, padding: int = 0) -> tuple[tg.Tape, tg.Id]:
    """conv2d as it was recorded before the conv2d primitive (batched x only)."""
    kh, kw = w.shape[2], w.shape[3]
    win = conv.Window(x.shape[2], x.shape[3], kh, kw, stride, stride, padding, padding)
    o = w.shape[0]
    tape, cols = record(tape, conv.IM2COL, [x], win)
    tape, w2 = shape_ops.reshape(tape, w, (o, w.shape[1] * kh * kw))
    layout = linalg.MatmulParams(False, False, linalg.NO_BIAS if b is None else linalg.ROW_BIAS,
                                 split=win.oh * win.ow)
    tape, y = record(tape, linalg.MATMUL, [w2, cols] if b is None else [w2, cols, b], layout)
    return shape_ops.reshape(tape, y, (x.shape[0], o, win.oh, win.ow))


def _mnist_step(padding: int) -> Callable[[Conv], object]:
    rng = np.random.default_rng(0)
    x = tg.AnyTensor.from_numpy(rng.standard_normal((64, 1, 28, 28)).astype(np.float32))
    w1 = tg.AnyTensor.from_numpy((rng.standard_normal((16, 1, 3, 3)) * 0.3).astype(np.float32))
    w2 = tg.AnyTensor.from_numpy((rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float32))

    def step(conv2d: Conv) -> object:
        tape, xi = tg.leaf(tg.Tape(), x)
        tape, a = tg.leaf(tape, w1, requires_grad=True)
        tape, b = tg.leaf(tape, w2, requires_grad=True)
        tape, h = conv2d(tape, xi, a, padding=padding)
        tape, h = tg.relu(tape, h)
        tape, h = tg.max_pool2d(tape, h, 2)
        tape, h = conv2d(tape, h, b, padding=padding)
        tape, h = tg.relu(tape, h)
        tape, s = tg.sum(tape, h)
        grads = tg.backward(tape, s)
        x.device.finish()
        return grads
    return step


def _resnet_step() -> Callable[[Conv], object]:
    cfg = models.ResNetConfig()
    params, batch = models.resnet_init(cfg)
    trainers: dict[Conv, models.Trainer] = {}

    def step(conv2d: Conv) -> object:
        tg.conv2d = conv2d  # the model's loss calls tg.conv2d as it records each step
        if conv2d not in trainers:
            trainers[conv2d] = models.Trainer(models.resnet_loss_fn(cfg), params, batch, False)
        trainers[conv2d]()
        return trainers[conv2d].loss
    return step


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "resnet"
    step = _resnet_step() if which == "resnet" else _mnist_step(1 if "same" in sys.argv else 0)
    device = tg.default_device()
    device._queue = cl.CommandQueue(  # pyright: ignore[reportPrivateUsage]
        device.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
    events: list[tuple[str, Any]] = []
    launch = _device.Device.launch

    def timed(self: _device.Device, kernel: cl.Kernel, size: tuple[int, ...],
              local: tuple[int, ...], *args: Any) -> None:
        kernel.set_args(*args)
        events.append((kernel.function_name,
                       cl.enqueue_nd_range_kernel(self.queue, kernel, size, local)))

    paths: dict[str, Conv] = {"im2col + product": im2col_conv2d, "conv2d primitive": tg.conv2d}
    wall: dict[str, list[float]] = collections.defaultdict(list)
    busy: dict[str, list[float]] = collections.defaultdict(list)
    kernels: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    _device.Device.launch = timed  # type: ignore[method-assign]
    try:
        for path in paths.values():
            for _ in range(STEPS):
                step(path)
        for _ in range(ROUNDS):
            for name, path in paths.items():
                for _ in range(STEPS):
                    events.clear()
                    start = time.perf_counter()
                    step(path)
                    wall[name].append(time.perf_counter() - start)
                    ms = [(k, (e.profile.end - e.profile.start) * 1e-6) for k, e in events]
                    busy[name].append(sum(t for _, t in ms))
                    for k, t in ms:
                        kernels[name][k] += t / (ROUNDS * STEPS)
    finally:
        _device.Device.launch = launch  # type: ignore[method-assign]
        tg.conv2d = paths["conv2d primitive"]
    for name in paths:
        w, d = sorted(wall[name]), sorted(busy[name])
        top = ", ".join(f"{k} {t:.2f}" for k, t in kernels[name].most_common(6))
        print(f"{which} {name}: wall p10 {w[len(w) // 10] * 1e3:.2f} / median "
              f"{w[len(w) // 2] * 1e3:.2f} ms, device p10 {d[len(d) // 10]:.2f} / median "
              f"{d[len(d) // 2]:.2f} ms per step; {top}")


if __name__ == "__main__":
    main()
