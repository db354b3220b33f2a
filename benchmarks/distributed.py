"""tg.distributed's costs: an allreduce per MB, and the digits CNN's step on 1 and 2 processes.

    python -m benchmarks.distributed          # runs the measurements below, prints the rows
    mpiexec -n 2 python -m benchmarks.distributed worker   # one measurement run (rank 0 prints)

Each process runs with one PoCL thread (POCL_MAX_PTHREAD_COUNT=1, the variable PoCL 3's pthread
device reads), so two ranks on a 2-core machine do not fight for the cores. The CNN step is
the data-parallel one of `tapegrad.demo.ddp`: a minibatch of 64 split across the ranks,
value_and_grad on each share, allreduce of the loss and gradients, Adam. `make bench` adds
these rows to docs/BENCHMARKS.md; docs/SCALING.md reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import Row

SIZES_MB = (0.0625, 1.0, 8.0)  # allreduce payloads (float32, in 4 leaves)
CNN_STEPS = 60  # timed steps (after warm-up)


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _barrier() -> None:
    import tapegrad as tg

    if tg.distributed.size() > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()


def _allreduce_ms(megabytes: float, repeat: int = 15) -> float:
    """Median ms of one allreduce (mean) of float32 leaves totalling `megabytes`, the ranks
    starting together."""
    import tapegrad as tg

    n = int(megabytes * 2**20 / 4) // 4
    tree = [tg.AnyTensor(np.full(n, float(k), np.float32)) for k in range(4)]
    times: list[float] = []
    for _ in range(3 + repeat):
        _barrier()
        start = time.perf_counter()
        tg.distributed.allreduce(tree)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


def _cnn_step_ms(batch_size: int = 64, reduce: bool = True) -> tuple[float, float]:
    """Mean ms of a data-parallel CNN step over CNN_STEPS steps (a minibatch of `batch_size`
    split across the ranks), and of the allreduce in it; without `reduce`, each rank steps on
    its own gradients (the compute alone, with the ranks running side by side)."""
    import tapegrad as tg
    from tapegrad.demo import ddp, digits

    data = digits.load()
    params = tg.distributed.broadcast(digits.cnn_params(10))
    loss_and_grads = tg.value_and_grad(digits.classifier_loss(digits.cnn))
    order = np.random.default_rng(0).permutation(len(data.y_train))
    state: dict[str, Any] | None = None
    in_allreduce = 0.0
    start = 0.0
    for step in range(10 + CNN_STEPS):
        if step == 10:  # warm: programs built, pools full
            _barrier()
            in_allreduce = 0.0
            start = time.perf_counter()
        first = (step * batch_size) % 1280
        mine = ddp.shard(order[first:first + batch_size])
        loss, grads = loss_and_grads(params, data.x_train[mine], data.y_train[mine])
        if reduce:
            before = time.perf_counter()
            loss, grads = tg.distributed.allreduce((loss, grads))
            in_allreduce += time.perf_counter() - before
        params, state = tg.optim.adam(params, grads, state, lr=1e-3)
    params["b"].numpy()  # waits for the last step
    total = time.perf_counter() - start
    return 1e3 * total / CNN_STEPS, 1e3 * in_allreduce / CNN_STEPS


def worker() -> None:
    """One run's measurements; rank 0 prints them as one JSON line."""
    import tapegrad as tg

    tg.distributed.init()
    result: dict[str, Any] = {"ranks": tg.distributed.size()}
    if tg.distributed.size() > 1:
        result["allreduce_ms"] = {str(mb): _allreduce_ms(mb) for mb in SIZES_MB}
    result["cnn_step_ms"], result["cnn_allreduce_ms"] = _cnn_step_ms()
    result["cnn_compute_ms"], _ = _cnn_step_ms(reduce=False)
    if tg.distributed.size() == 1:
        result["cnn_half_batch_ms"], _ = _cnn_step_ms(32, reduce=False)
        result["cnn_batch_256_ms"], _ = _cnn_step_ms(256, reduce=False)  # compute per image
    if tg.distributed.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _run(args: list[str]) -> dict[str, Any] | str:
    """A worker run's result, or why there is none."""
    env = {**os.environ, "POCL_MAX_PTHREAD_COUNT": "1"}
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired:
        return "timed out"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            found: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return found
    return f"failed (exit {done.returncode}): {(done.stdout + done.stderr)[-300:]}"


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over runs (dicts of numbers, nested once)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _medians([run[key] for run in runs])
        else:
            out[key] = statistics.median(run[key] for run in runs)
    return out


def _repeated(args: list[str], runs: list[dict[str, Any]] | str) -> list[dict[str, Any]] | str:
    if isinstance(runs, str):
        return runs
    found = _run(args)
    return found if isinstance(found, str) else [*runs, found]


def rows(repeat: int = 3) -> list[Row]:
    """The allreduce and CNN-step rows, medians of `repeat` runs of each kind, the kinds in
    turns (the machine's speed drifts); a row says why where a run failed."""
    me = [sys.executable, "-m", "benchmarks.distributed", "worker"]
    mpiexec = _mpiexec()
    ones: list[dict[str, Any]] | str = []
    twos: list[dict[str, Any]] | str = [] if mpiexec else 'no mpiexec: pip install ".[mpi]"'
    for _ in range(repeat):
        ones = _repeated(me, ones)
        if mpiexec:
            twos = _repeated([mpiexec, "-n", "2", *me], twos)
    one = ones if isinstance(ones, str) else _medians(ones)
    two = twos if isinstance(twos, str) else _medians(twos)
    out: list[Row] = []
    if isinstance(two, str):
        out.append(Row("distributed: allreduce (mean) on 2 ranks", "ms/MB", None, note=two))
    else:
        per_size: dict[str, float] = two["allreduce_ms"]
        eight = per_size[str(SIZES_MB[-1])]
        out.append(Row(f"distributed: allreduce (mean) of {SIZES_MB[-1]:g} MB float32 on 2 "
                       "ranks", "ms/MB", eight / SIZES_MB[-1],
                       note=", ".join(f"{float(mb):g} MB: {ms:.2f} ms"
                                      for mb, ms in per_size.items())))
    for ranks, result in ((1, one), (2, two)):
        name = f"distributed: digits CNN step, batch 64 on {ranks} process(es), 1 PoCL thread each"
        if isinstance(result, str):
            out.append(Row(name, "ms", None, note=result))
        else:
            half = (f"; one process on 32 images: {result['cnn_half_batch_ms']:.2f} ms, on "
                    f"256: {result['cnn_batch_256_ms']:.2f} ms"
                    if "cnn_half_batch_ms" in result else "")
            out.append(Row(name, "ms", result["cnn_step_ms"],
                           note=f"allreduce {result['cnn_allreduce_ms']:.2f} ms of it; "
                                f"without the allreduce {result['cnn_compute_ms']:.2f} ms"
                                + half))
    return out


def main() -> None:
    for row in rows():
        note = f" ({row.note})" if row.note else ""
        value = "-" if row.tapegrad is None else f"{row.tapegrad:.3g}"
        print(f"{row.workload}: {value} {row.unit}{note}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        worker()
    else:
        main()
