"""One op's forward and backward at a shape a small model uses: tapegrad's kernel time against
PyTorch's whole call, to find the ops whose kernels are far off (a library call per element,
a chain of dependent adds, the wrong kernel for a shape).

    python -m benchmarks.op_sweep [filter]    # rows whose name contains `filter`

Each row records the op on its operands (float32), sums it and takes every operand's
gradient; tapegrad's time is the sum of the step's OpenCL profiling events (the loss's sum
included), PyTorch's the wall time of the same forward and `autograd.grad` (its Python
included: the ratio flags kernels several times off, it is not a model's ratio). The 20th
percentile of 12 runs (24 for torch). Held launches are enqueued at once so that each event
times its kernel alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyopencl as cl

import tapegrad as tg

Op = Callable[..., tuple[tg.Tape, tg.Id]]
Row = tuple[str, list[tuple[int, ...]], Op, Callable[..., Any]]
_RUNS = 12

L = (256, 256)


def _rows(F: Any, torch: Any) -> list[Row]:
    """(name, operand shapes, tapegrad op over (tape, *ids), torch function over tensors)."""
    return [
        ("abs", [L], lambda t, x: tg.abs(t, x), torch.abs),
        ("sqrt of 1 + x * x", [L], lambda t, x: _chain(t, x, [("mul", x), ("add", 1.0),
                                                             ("sqrt", None)]),
         lambda x: torch.sqrt(x * x + 1)),
        ("maximum(x, 0)", [L], lambda t, x: tg.maximum(t, x, 0.0), lambda x: torch.clamp_min(x, 0)),
        ("gelu", [L], lambda t, x: tg.gelu(t, x), F.gelu),
        ("sigmoid", [L], lambda t, x: tg.sigmoid(t, x), torch.sigmoid),
        ("sin", [L], lambda t, x: tg.sin(t, x), torch.sin),
        ("max over rows (512, 64)", [(512, 64)], lambda t, x: tg.max(t, x, axis=1),
         lambda x: x.max(1).values),
        ("sum over (0, 2, 3) of (16, 32, 8, 8)", [(16, 32, 8, 8)],
         lambda t, x: tg.sum(t, x, axis=(0, 2, 3)), lambda x: x.sum((0, 2, 3))),
        ("var over rows (512, 64)", [(512, 64)], lambda t, x: tg.var(t, x, axis=-1),
         lambda x: x.var(-1, unbiased=False)),
        ("logsumexp over rows (512, 76)", [(512, 76)], lambda t, x: tg.logsumexp(t, x),
         lambda x: torch.logsumexp(x, -1)),
        ("softmax (512, 76)", [(512, 76)], lambda t, x: tg.softmax(t, x),
         lambda x: F.softmax(x, -1)),
        ("layer_norm (512, 64)", [(512, 64)], lambda t, x: tg.layer_norm(t, x),
         lambda x: F.layer_norm(x, (64,))),
        ("batch_norm (256, 128)", [(256, 128)], lambda t, x: tg.batch_norm(t, x),
         lambda x: F.batch_norm(x, None, None, training=True)),
        ("batch_norm (16, 16, 32, 32)", [(16, 16, 32, 32)], lambda t, x: tg.batch_norm(t, x),
         lambda x: F.batch_norm(x, None, None, training=True)),
        ("matmul (1, 256) @ (256, 256)", [(1, 256), L], lambda t, a, b: tg.matmul(t, a, b),
         lambda a, b: a @ b),
        ("matmul (32, 32) @ (32, 32)", [(32, 32), (32, 32)], lambda t, a, b: tg.matmul(t, a, b),
         lambda a, b: a @ b),
        ("matmul (512, 64) @ (64, 256)", [(512, 64), (64, 256)],
         lambda t, a, b: tg.matmul(t, a, b), lambda a, b: a @ b),
        ("transpose (512, 256)", [(512, 256)], lambda t, x: tg.transpose(t, x),
         lambda x: x.t().contiguous()),
        ("conv2d 3x3 (16, 16, 32, 32) -> 16", [(16, 16, 32, 32), (16, 16, 3, 3)],
         lambda t, x, w: tg.conv2d(t, x, w, padding=1), lambda x, w: F.conv2d(x, w, padding=1)),
        ("conv2d 3x3 (16, 3, 32, 32) -> 16", [(16, 3, 32, 32), (16, 3, 3, 3)],
         lambda t, x, w: tg.conv2d(t, x, w, padding=1), lambda x, w: F.conv2d(x, w, padding=1)),
        ("max_pool2d 3, stride 2 (8, 16, 28, 28)", [(8, 16, 28, 28)],
         lambda t, x: tg.max_pool2d(t, x, 3, stride=2, padding=1),
         lambda x: F.max_pool2d(x, 3, 2, 1)),
        ("cumsum (512, 256) axis 0", [(512, 256)], lambda t, x: tg.cumsum(t, x, axis=0),
         lambda x: torch.cumsum(x, 0)),
        ("tril (64, 128, 128)", [(64, 128, 128)], lambda t, x: tg.tril(t, x), torch.tril),
        # ops of attention, classifiers and CNN heads at their usual shapes
        ("softmax (16, 4, 64, 64)", [(16, 4, 64, 64)], lambda t, x: tg.softmax(t, x),
         lambda x: F.softmax(x, -1)),
        ("log_softmax (256, 1000)", [(256, 1000)], lambda t, x: tg.log_softmax(t, x),
         lambda x: F.log_softmax(x, -1)),
        ("cross_entropy (256, 1000)", [(256, 1000)],
         lambda t, x: _cross_entropy(t, x),
         lambda x: F.cross_entropy(x, torch.from_numpy(_LABELS))),
        ("layer_norm (1024, 768)", [(1024, 768)], lambda t, x: tg.layer_norm(t, x),
         lambda x: F.layer_norm(x, (768,))),
        ("transpose (16, 64, 4, 32) -> heads", [(16, 64, 4, 32)],
         lambda t, x: tg.transpose(t, x, (0, 2, 1, 3)),
         lambda x: x.permute(0, 2, 1, 3).contiguous()),
        ("batched matmul (64, 64, 32) @ (64, 32, 64)", [(64, 64, 32), (64, 32, 64)],
         lambda t, a, b: tg.matmul(t, a, b), lambda a, b: a @ b),
        ("concat 3 x (512, 128) axis 1", [(512, 128)] * 3,
         lambda t, a, b, c: tg.concat(t, [a, b, c], axis=1),
         lambda a, b, c: torch.cat([a, b, c], 1)),
        ("mean over axis 1 of (16, 64, 128)", [(16, 64, 128)],
         lambda t, x: tg.mean(t, x, axis=1), lambda x: x.mean(1)),
        ("avg_pool2d 2 (16, 32, 16, 16)", [(16, 32, 16, 16)],
         lambda t, x: tg.avg_pool2d(t, x, 2), lambda x: F.avg_pool2d(x, 2)),
        ("pad 1 (16, 16, 32, 32)", [(16, 16, 32, 32)],
         lambda t, x: tg.pad(t, x, ((0, 0), (0, 0), (1, 1), (1, 1))),
         lambda x: F.pad(x, (1, 1, 1, 1))),
        ("dropout 0.1 (512, 256)", [(512, 256)], lambda t, x: tg.dropout(t, x, 0.1, 7),
         lambda x: F.dropout(x, 0.1)),
        ("tanh", [L], lambda t, x: tg.tanh(t, x), torch.tanh),
        ("silu", [L], lambda t, x: tg.silu(t, x), F.silu),
        ("exp", [L], lambda t, x: tg.exp(t, x), torch.exp),
        ("softplus", [L], lambda t, x: tg.softplus(t, x), F.softplus),
        ("mse (512, 10)", [(512, 10), (512, 10)], lambda t, a, b: tg.mse(t, a, b),
         F.mse_loss),
        ("cumsum (64, 512) axis 1", [(64, 512)], lambda t, x: tg.cumsum(t, x, axis=1),
         lambda x: torch.cumsum(x, 1)),
    ]


_LABELS = np.random.default_rng(1).integers(0, 1000, 256)


def _cross_entropy(tape: tg.Tape, logits: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, labels = tg.leaf(tape, _LABELS)
    return tg.cross_entropy(tape, logits, labels)


def _chain(tape: tg.Tape, x: tg.Id, steps: list[tuple[str, Any]]) -> tuple[tg.Tape, tg.Id]:
    """x through elementwise ops: ("mul", other id) is x * other, ("add", c) adds c, ("sqrt",
    None) takes the root."""
    h = x
    for name, arg in steps:
        if name == "sqrt":
            tape, h = tg.sqrt(tape, h)
        else:
            tape, h = getattr(tg, name)(tape, h, arg)
    return tape, h


def main() -> None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("op_sweep compares with PyTorch: install the bench extra")
        return
    torch.set_num_threads(2)
    device = tg.default_device()
    device._queue = cl.CommandQueue(  # pyright: ignore[reportAttributeAccessIssue]
        device.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
    device._defers = False  # pyright: ignore[reportAttributeAccessIssue]
    events: list[tuple[str, Any]] = []
    enqueue = cl.enqueue_nd_range_kernel

    def timed(queue: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        event = enqueue(queue, kernel, *args, **kwargs)
        events.append((str(kernel.function_name), event))
        return event

    cl.enqueue_nd_range_kernel = timed
    rng = np.random.default_rng(0)
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    print(f"device: {device}")
    for name, shapes, op, torch_op in _rows(F, torch):
        if wanted not in name:
            continue
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        tensors = [tg.AnyTensor.from_numpy(a) for a in arrays]
        ours: list[float] = []
        kernels: dict[str, float] = {}
        for _ in range(_RUNS):
            events.clear()
            tape = tg.Tape()
            ids: list[tg.Id] = []
            for t in tensors:
                tape, i = tg.leaf(tape, t, requires_grad=True)
                ids.append(i)
            tape, y = op(tape, *ids)
            tape, s = tg.sum(tape, y)
            grads = tg.backward(tape, s, wrt=ids)
            for i in ids:
                grads[i].numpy()
            device.finish()
            ours.append(sum((e.profile.end - e.profile.start) * 1e-3 for _, e in events))
            kernels = {}
            for kernel, e in events:
                spent = (e.profile.end - e.profile.start) * 1e-3
                kernels[kernel] = kernels.get(kernel, 0.0) + spent
        leaves = [torch.from_numpy(a).requires_grad_() for a in arrays]
        theirs: list[float] = []
        for _ in range(2 * _RUNS):
            t0 = time.perf_counter()
            torch.autograd.grad(torch_op(*leaves).sum(), leaves)
            theirs.append((time.perf_counter() - t0) * 1e6)
        a, b = sorted(ours)[len(ours) // 5], sorted(theirs)[len(theirs) // 5]
        slowest = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
        top = ", ".join(f"{k} {v:.0f}" for k, v in slowest)
        print(f"{name:40s} tapegrad {a:8.1f} us  torch {b:8.1f} us  {a / b:5.2f}x  ({top})",
              flush=True)


if __name__ == "__main__":
    main()
