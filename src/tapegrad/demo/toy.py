"""A two-layer network on generated data: the loss falls and gradients match finite differences.

Everything runs on the default OpenCL device; parameters stay on the device between steps and
the host reads only the printed loss.
"""

from __future__ import annotations

import time

import numpy as np

import tapegrad as tg


def _forward(tape: tg.Tape, x: tg.Id, w1: tg.Id, b1: tg.Id, w2: tg.Id, b2: tg.Id,
             y: tg.Id) -> tuple[tg.Tape, tg.Id]:
    tape, h = tg.matmul(tape, x, w1)
    tape, h = tg.add(tape, h, b1)
    tape, h = tg.tanh(tape, h)
    tape, out = tg.matmul(tape, h, w2)
    tape, out = tg.add(tape, out, b2)
    tape, err = tg.sub(tape, out, y)
    tape, sq = tg.mul(tape, err, err)
    return tg.mean(tape, sq)


def _sgd_step(params: list[tg.AnyTensor], grads: list[tg.AnyTensor], lr: float
              ) -> list[tg.AnyTensor]:
    tape = tg.Tape(params[0].device)
    updated: list[tg.AnyTensor] = []
    for p, g in zip(params, grads, strict=True):
        tape, pi = tg.leaf(tape, p)
        tape, gi = tg.leaf(tape, g)
        tape, step = tg.mul(tape, gi, lr)
        tape, new = tg.sub(tape, pi, step)
        updated.append(tg.value(tape, new))
    return updated


def main(steps: int = 200) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (256, 2)).astype(np.float32)
    y = (np.sin(x[:, :1]) * np.cos(x[:, 1:])).astype(np.float32)
    device = tg.default_device()
    print(f"device: {device}")
    shapes = [(2, 32), (32,), (32, 1), (1,)]
    params = [tg.AnyTensor.from_numpy(
        (rng.standard_normal(s) / np.sqrt(s[0]) if len(s) > 1 else np.zeros(s)).astype(np.float32),
        device) for s in shapes]
    start = time.perf_counter()
    for step in range(steps + 1):
        tape = tg.Tape(device)
        tape, xi = tg.leaf(tape, x)
        tape, yi = tg.leaf(tape, y)
        ids: list[tg.Id] = []
        for p in params:
            tape, i = tg.leaf(tape, p, requires_grad=True)
            ids.append(i)
        w1, b1, w2, b2 = ids
        tape, loss = _forward(tape, xi, w1, b1, w2, b2, yi)
        grads = tg.backward(tape, loss)
        if step % 40 == 0:
            print(f"step {step:4d}  loss {tg.value(tape, loss).item():.5f}")
        params = _sgd_step(params, [grads[i] for i in ids], lr=0.05)
    print(f"{steps} steps in {time.perf_counter() - start:.2f} s")

    def model(tape: tg.Tape, w1: tg.Id, b1: tg.Id, w2: tg.Id, b2: tg.Id
              ) -> tuple[tg.Tape, tg.Id]:
        tape, xi = tg.leaf(tape, x[:8].astype(np.float64))
        tape, yi = tg.leaf(tape, y[:8].astype(np.float64))
        return _forward(tape, xi, w1, b1, w2, b2, yi)

    tg.gradcheck(model, *(p.numpy().astype(np.float64) for p in params))
    print("gradients agree with float64 finite differences: ok")


if __name__ == "__main__":
    main()
