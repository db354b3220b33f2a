"""What tests/test_distributed.py runs under `mpiexec -n 2` (and as one plain process): each
check prints `rank R: ok NAME` on success and raises on failure (the rank exits non-zero).

    python tests/distributed_worker.py checks   # broadcast, gradients, Adam steps, mismatches
    python tests/distributed_worker.py dies     # rank 1 raises; the others must stop too
    python tests/distributed_worker.py late     # rank 1 comes late; the others time out

The same script runs unchanged with one process: there the reduction is the identity and the
"half batch" is the whole batch.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

import numpy as np

import tapegrad as tg

dist = tg.distributed
Params = dict[str, tg.AnyTensor]


def loss_fn(tape: tg.Tape, params: dict[str, tg.Id], x: tg.Id, y: tg.Id
            ) -> tuple[tg.Tape, tg.Id]:
    """A 2-layer MLP's mean cross-entropy (a mean over the batch, as data parallelism averages)."""
    tape, h = tg.linear(tape, x, params["w1"], params["b1"])
    tape, h = tg.tanh(tape, h)
    tape, logits = tg.linear(tape, h, params["w2"], params["b2"])
    return tg.cross_entropy(tape, logits, y)


def make_params(seed: int, dtype: Any) -> Params:
    rng = np.random.default_rng(seed)
    shapes = {"w1": (6, 16), "b1": (16,), "w2": (16, 4), "b2": (4,)}
    return {k: tg.AnyTensor(rng.normal(0, 0.5, s).astype(dtype)) for k, s in shapes.items()}


def data(dtype: Any, n: int = 32) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(100)
    return rng.normal(0, 1, (n, 6)).astype(dtype), rng.integers(0, 4, n).astype(np.int64)


def mine(n: int) -> np.ndarray[Any, Any]:
    """This rank's share of a batch of n rows (contiguous, equal shares)."""
    return np.array_split(np.arange(n), dist.size())[dist.rank()]


def host(tree: Params) -> dict[str, np.ndarray[Any, Any]]:
    return {k: v.numpy() for k, v in tree.items()}


def report(line: str) -> None:
    """Print `line` for this rank, and append it to this rank's file in $WORKER_LOG_DIR if
    set (the ranks' printed lines can interleave in mpiexec's output)."""
    print(f"rank {dist.rank()}: {line}", flush=True)
    folder = os.environ.get("WORKER_LOG_DIR")
    if folder:
        with open(os.path.join(folder, f"rank{dist.rank()}.txt"), "a") as f:
            f.write(line + "\n")


def ok(name: str) -> None:
    report(f"ok {name}")


def same_on_every_rank(values: dict[str, np.ndarray[Any, Any]]) -> bool:
    """Whether every rank holds bitwise these values (digests compared through MPI)."""
    digest = hashlib.sha256(b"".join(values[k].tobytes() for k in sorted(values))).hexdigest()
    if dist.size() == 1:
        return True
    from mpi4py import MPI

    digests: list[str] = MPI.COMM_WORLD.allgather(digest)
    return len(set(digests)) == 1


def check_broadcast() -> None:
    got = host(dist.broadcast(make_params(seed=dist.rank(), dtype=np.float32)))
    want = host(make_params(seed=0, dtype=np.float32))
    assert all(np.array_equal(got[k], want[k]) for k in want), "broadcast: not root's values"
    last = dist.size() - 1
    ints = dist.broadcast({"i": np.full(3, 7 * dist.rank(), np.int64),
                           "t": [tg.AnyTensor(np.array([dist.rank() == last]))]}, root=last)
    assert np.array_equal(ints["i"].numpy(), np.full(3, 7 * last)), ints["i"].numpy()
    assert bool(ints["t"][0].numpy()[0]), "broadcast: root's bool not received"
    ok("broadcast")


def check_gradients(dtype: Any, name: str) -> None:
    params = make_params(seed=1, dtype=dtype)
    x, y = data(dtype)
    loss_and_grads = tg.value_and_grad(loss_fn)
    _, full = loss_and_grads(params, x, y)
    part = mine(len(y))
    _, local = loss_and_grads(params, x[part], y[part])
    averaged = host(dist.allreduce(local))
    want = host(full)
    for k in want:
        scale = float(np.abs(want[k]).max()) or 1.0
        err = float(np.abs(averaged[k] - want[k]).max())
        bound = 1e-12 * scale if dtype == np.float64 else 8 * np.finfo(np.float32).eps * scale
        assert err <= bound, f"{name}: grads[{k!r}] off by {err} (> {bound})"
    assert same_on_every_rank(averaged), f"{name}: ranks hold different reduced gradients"
    summed = host(dist.allreduce(local, op="sum"))
    for k in want:
        np.testing.assert_allclose(summed[k], averaged[k] * dist.size(), rtol=1e-5, atol=1e-7)
    ok(name)


def check_backward_result() -> None:
    """tg.backward's result (keyed by ids) reduces like a dict of the same gradients."""
    params = make_params(seed=1, dtype=np.float64)
    x, y = data(np.float64)
    part = mine(len(y))
    tape = tg.Tape()
    ids: dict[str, tg.Id] = {}
    for name, value in params.items():
        tape, ids[name] = tg.leaf(tape, value, requires_grad=True)
    tape, x_id = tg.leaf(tape, x[part])
    tape, y_id = tg.leaf(tape, y[part])
    tape, loss = loss_fn(tape, ids, x_id, y_id)
    by_id = dist.allreduce(tg.backward(tape, loss))
    _, local = tg.value_and_grad(loss_fn)(params, x[part], y[part])
    by_name = host(dist.allreduce(local))
    for name, i in ids.items():
        err = float(np.abs(by_id[i].numpy() - by_name[name]).max())
        assert err <= 1e-12, f"backward's result: grads[{name!r}] off by {err}"
    ok("backward's result")


def check_adam(steps: int = 20) -> None:
    """`steps` data-parallel Adam steps against one process's steps on the whole batch."""
    x, y = data(np.float64)
    part = mine(len(y))
    loss_and_grads = tg.value_and_grad(loss_fn)
    ddp = dist.broadcast(make_params(seed=2 + dist.rank(), dtype=np.float64))
    single = make_params(seed=2, dtype=np.float64)
    ddp_state: dict[str, Any] | None = None
    single_state: dict[str, Any] | None = None
    for step in range(steps):
        _, grads = loss_and_grads(ddp, x[part], y[part])
        ddp, ddp_state = tg.optim.adam(ddp, dist.allreduce(grads), ddp_state, lr=1e-2)
        _, grads = loss_and_grads(single, x, y)
        single, single_state = tg.optim.adam(single, grads, single_state, lr=1e-2)
        got, want = host(ddp), host(single)
        assert same_on_every_rank(got), f"adam: ranks' params differ after step {step + 1}"
        for k in want:
            err = float(np.abs(got[k] - want[k]).max())
            assert err <= 1e-12, f"adam step {step + 1}: params[{k!r}] off by {err}"
    ok(f"adam {steps} steps")


def check_mismatches() -> None:
    r = dist.rank()
    cases: list[tuple[str, Any, str]] = [
        ("shape", {"b": np.zeros(2), "w": np.zeros((3, 2 + r))}, "tree['w']"),
        ("dtype", {"w": np.zeros(3, np.float32 if r == 0 else np.float64)}, "tree['w']"),
        ("keys", {"a": np.zeros(2), ("b" if r == 0 else "c"): np.zeros(2)}, "tree['"),
        ("count", [np.zeros(2)] * (1 + r), "leaves"),
    ]
    for name, tree, named in cases:
        start = time.monotonic()
        try:
            dist.allreduce(tree)
        except tg.TapegradError as err:
            waited = time.monotonic() - start
            message = str(err)
            assert named in message, f"mismatch {name}: {message}"
            assert waited < 5, f"mismatch {name}: raised after {waited:.1f} s"
            report(f"mismatch {name} raised in {waited:.2f} s: {message.splitlines()[0]}")
        else:
            assert dist.size() == 1, f"mismatch {name}: no error"
    if dist.size() > 1:
        ok("mismatches")
    # The ranks still work together after an error that every rank raised.
    total = dist.allreduce({"one": np.ones(3)}, op="sum")["one"].numpy()
    assert np.array_equal(total, np.full(3, float(dist.size()))), total
    ok("after mismatches")


def checks() -> None:
    dist.init()
    print(f"rank {dist.rank()} of {dist.size()}, local rank {dist.local_rank()}, "
          f"device {tg.default_device()}", flush=True)
    check_broadcast()
    check_gradients(np.float64, "float64 gradients")
    check_gradients(np.float32, "float32 gradients")
    check_backward_result()
    check_adam()
    check_mismatches()


def dies() -> None:
    """Rank 1 raises, uncaught, before the allreduce the others wait in: all must end."""
    dist.init()
    if dist.rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.allreduce({"g": np.ones(4)})
    report("not stopped")


def late() -> None:
    """Rank 1 comes to the allreduce long after the others' timeout: they raise."""
    if dist.rank() == 1:
        time.sleep(30)
    start = time.monotonic()
    try:
        dist.allreduce({"g": np.ones(4)})
    except tg.TapegradError as err:
        report(f"stopped after {time.monotonic() - start:.1f} s: {err}")
        raise


if __name__ == "__main__":
    {"checks": checks, "dies": dies, "late": late}[sys.argv[1]]()
