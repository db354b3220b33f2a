"""Fusion on a long graph: an LSTM cell unrolled T steps, forward + backward, in ms per timestep
with fusion on (the default) and off (`TAPEGRAD_FUSE=0`), each mode in its own process.

`python -m benchmarks.lstm_fusion` (T = 20 and 320, batch 16, hidden 64, float32); options:
`--steps 20 320`, `--repeats N`, `--profile` (cProfile of one fused run: the calls of the plan
walk and of `realise`). The cell is written with the public ops only: per gate a `linear` of
the input and a `matmul` of the hidden state, `sigmoid`/`tanh`, `mul` and `add`; the loss is
the sum of every step's hidden state, so both the hidden and the cell state carry gradients
back through every step.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Any

import numpy as np

import tapegrad as tg

from ._harness import profiled

BATCH, HIDDEN, FEATURES = 16, 64, 32
GATES = ("i", "f", "g", "o")
Arr = np.ndarray[Any, Any]


def lstm_data(steps: int, seed: int = 0, batch: int = BATCH, hidden: int = HIDDEN,
              features: int = FEATURES) -> tuple[Arr, list[Arr]]:
    """Inputs (steps, batch, features) and the parameters: per gate Wx, Wh, b."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((steps, batch, features)).astype(np.float32)
    params: list[Arr] = []
    for _ in GATES:
        params.append((rng.standard_normal((features, hidden)) / np.sqrt(features))
                      .astype(np.float32))
        params.append((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden))
                      .astype(np.float32))
        params.append((0.1 * rng.standard_normal(hidden)).astype(np.float32))
    return xs, params


def lstm_loss(xs: list[tg.AnyTensor], params: list[tg.AnyTensor]
              ) -> tuple[tg.Tape, tg.Id, list[tg.Id]]:
    """The tape of the unrolled cell, its loss, and the parameters' ids."""
    tape = tg.Tape(params[0].device)
    ids: list[tg.Id] = []
    for p in params:
        tape, i = tg.leaf(tape, p, requires_grad=True)
        ids.append(i)
    state = (xs[0].shape[0], params[1].shape[0])  # (batch, hidden)
    tape, h = tg.leaf(tape, np.zeros(state, np.float32))
    tape, c = tg.leaf(tape, np.zeros(state, np.float32))
    total: tg.Id | None = None
    for x0 in xs:
        tape, x = tg.leaf(tape, x0)
        gates: list[tg.Id] = []
        for k, name in enumerate(GATES):
            wx, wh, b = ids[3 * k: 3 * k + 3]
            tape, a = tg.linear(tape, x, wx, b)
            tape, r = tg.matmul(tape, h, wh)
            tape, a = tg.add(tape, a, r)
            tape, a = (tg.tanh if name == "g" else tg.sigmoid)(tape, a)
            gates.append(a)
        i, f, g, o = gates
        tape, fc = tg.mul(tape, f, c)
        tape, ig = tg.mul(tape, i, g)
        tape, c = tg.add(tape, fc, ig)
        tape, tc = tg.tanh(tape, c)
        tape, h = tg.mul(tape, o, tc)
        if total is None:
            total = h
        else:
            tape, total = tg.add(tape, total, h)
    assert total is not None
    tape, loss = tg.sum(tape, total)
    return tape, loss, ids


def lstm_step(xs: list[tg.AnyTensor], params: list[tg.AnyTensor]) -> tuple[Arr, list[Arr]]:
    """One forward + backward: the loss and the parameters' gradients, on the host."""
    tape, loss, ids = lstm_loss(xs, params)
    grads = tg.backward(tape, loss, wrt=ids)
    return tg.value(tape, loss).numpy(), [grads[i].numpy() for i in ids]


def device_data(steps: int, **sizes: int) -> tuple[list[tg.AnyTensor], list[tg.AnyTensor]]:
    """`lstm_data` on the default device."""
    xs0, params0 = lstm_data(steps, **sizes)
    return ([tg.AnyTensor.from_numpy(x) for x in xs0],
            [tg.AnyTensor.from_numpy(p) for p in params0])


def time_steps(steps: int, repeats: int, warmup: int = 3) -> dict[str, float]:
    """ms per timestep of forward + backward (gradients read to the host): p10 and median."""
    xs, params = device_data(steps)
    times: list[float] = []
    for k in range(warmup + repeats):
        t0 = time.perf_counter()
        lstm_step(xs, params)
        t1 = time.perf_counter()
        if k >= warmup:
            times.append((t1 - t0) * 1e3 / steps)
    return {"p10": float(np.percentile(times, 10)), "median": float(np.median(times))}


def profile(steps: int) -> None:
    """cProfile of one warm fused run: the calls of the plan walk and of realisation."""
    xs, params = device_data(steps)
    stats = pstats.Stats(profiled(lambda: lstm_step(xs, params)))
    rows = stats.stats  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
    total = max(ct for (_, _, _), (_, _, _, ct, _) in rows.items())
    print(f"T={steps}: one fused forward + backward, {total * 1e3:.0f} ms under cProfile")
    for (path, line, name), (cc, nc, _tt, ct, _) in sorted(rows.items(), key=lambda r: -r[1][3]):
        if "_fusion" in path and nc:
            print(f"  {name:>14} ({os.path.basename(path)}:{line}): {nc:>7} calls "
                  f"({cc} primitive), {ct * 1e3:7.1f} ms cumulative")


def _child(steps: list[int], repeats: int) -> None:
    print(json.dumps({str(t): time_steps(t, repeats if t <= 40 else max(repeats // 4, 3))
                      for t in steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 320])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.steps, args.repeats)
        return
    if args.profile:
        for t in args.steps:
            profile(t)
        return
    results: dict[str, dict[str, dict[str, float]]] = {}
    for mode, setting in (("fused", "3"), ("unfused", "0")):
        env = dict(os.environ, TAPEGRAD_FUSE=setting)
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.lstm_fusion", "--child", "--repeats",
             str(args.repeats), "--steps", *map(str, args.steps)],
            env=env, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"LSTM batch {BATCH}, hidden {HIDDEN}, forward + backward, ms per timestep")
    print(f"{'T':>5} {'fused p10':>10} {'median':>8} {'unfused p10':>12} {'median':>8}")
    for t in args.steps:
        f, u = results["fused"][str(t)], results["unfused"][str(t)]
        print(f"{t:>5} {f['p10']:>10.3f} {f['median']:>8.3f} {u['p10']:>12.3f} "
              f"{u['median']:>8.3f}")


if __name__ == "__main__":
    main()
