"""Data parallelism over MPI: `tg.distributed` (mpi4py, under `mpiexec -n N`).

Each process (a *rank*) runs the same script on its share of the batch; `allreduce(grads)`
averages the gradients so every rank takes the same optimizer step, and `broadcast(params)`
gives every rank root's initial parameters.

Design:
- MPI is loaded on first use (`init`, implicit in every call here), not at import: a program
  that never asks pays nothing, and one process without mpi4py is a world of size 1 where
  every call works. A process started by a launcher for more than one rank (its environment
  says so) without a loadable mpi4py is an error naming the install, since carrying on alone
  would train N independent copies.
- MPI does no arithmetic here: it only moves bytes. `allreduce` is a reduce-scatter built from
  an all-to-all (rank j receives every rank's chunk j) followed by an all-gather of the summed
  chunks; rank j sums its n pieces on the host in rank order 0, 1, ..., n-1. The order is
  fixed by n alone, so the result is the same on every run, and every rank holds bitwise the
  same bytes because each chunk is summed once, by its owner, and then copied. MPI_Allreduce
  gives neither promise: the standard only recommends that an implementation reduce in the
  same order every time, and implementations pick algorithms by message size and process
  count (a rank may combine in another order than its neighbour). Each rank sends and
  receives 2(n-1)/n of the data, as a ring allreduce does.
- All leaves of one dtype travel in one host buffer (a bucket): a step makes 1 + 2 collectives
  per dtype whatever the number of parameters. Host buffers are kept per (call, dtype, size)
  and reused by later calls with the same trees.
- Before moving data, one all-gather of a 16-byte digest of (call, tree structure, shapes,
  dtypes) checks that the ranks agree. Only when they do not are the full descriptions
  exchanged, so that every rank raises the same error naming the first differing leaf.
- A rank that raises must not leave the others waiting: with several ranks, `init` chains
  an uncaught-exception hook that prints the traceback and then calls MPI_Abort, which ends
  every rank at once (what `python -m mpi4py script.py` does). For what raises nothing (a
  rank stuck, or skipping a call the others make), every collective is nonblocking and polled
  against a deadline, `TAPEGRAD_DISTRIBUTED_TIMEOUT` seconds (300 by default: long enough for
  a rank that writes a checkpoint or builds kernels on a cold cache while the others wait),
  past which the waiting rank raises a TapegradError. Polling sleeps between tests once a
  wait is long, so a rank waiting for a slower one leaves the core to it (blocking MPI calls
  spin).
- Every call here is a collective: all ranks make the same calls in the same order, each from
  one thread at a time (the host buffers and MPI's ordering of collectives assume it).
- The device is `tg.default_device()`'s: under a launcher it is the node's `local_rank()`-th
  device (GPUs if any), read from the launcher's variables when first needed, so tensors made
  before any call here land on it too; `TAPEGRAD_DEVICE` or `PYOPENCL_CTX` override it.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyopencl as cl

from . import _device
from ._errors import DTypeError, ShapeError, TapegradError, at_site, shown
from ._sweep import Gradients
from ._tensor import SUPPORTED, AnyTensor, DType, host_array, is_float, upload
from ._tree import flatten, leaf_paths

if TYPE_CHECKING:
    from mpi4py import MPI

INSTALL = 'pip install "tapegrad[mpi]"'
TIMEOUT_VAR = "TAPEGRAD_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
_OPS = ("mean", "sum")
_STAGING_KEPT = 16  # sets of host buffers kept for reuse (one per call site's trees, usually)
# Polling (`_wait`): test in a loop this long, then sleep between tests (the tree check) or
# yield the core (the data exchange); sleeps grow to the maximum.
_SPIN_S = 2e-4
_MAX_SLEEP_S = 5e-4
_ABORT_GRACE_S = 0.5


@dataclass
class _World:
    """The processes of this run, as seen from this one; `comm` None when there is no MPI."""

    comm: MPI.Intracomm | None
    rank: int
    size: int
    local_rank: int
    timeout: float
    staging: dict[tuple[Any, ...], list[np.ndarray[Any, Any]]] = field(
        default_factory=dict[tuple[Any, ...], list[np.ndarray[Any, Any]]])


_world: _World | None = None
_INIT = threading.Lock()


def _timeout(fn: str) -> float:
    text = os.environ.get(TIMEOUT_VAR, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise TapegradError(f"{fn}: {TIMEOUT_VAR}={text!r} must be a positive number of "
                            "seconds")
    return seconds


def _get_world(fn: str) -> _World:
    world = _world
    if world is None:
        with _INIT:
            world = _world if _world is not None else _start(fn)
    return world


def _start(fn: str) -> _World:
    global _world
    timeout = _timeout(fn)
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as err:
        # RuntimeError/OSError: mpi4py is there but finds no MPI library to load.
        launched = _device.launched_size()
        if launched is not None:
            var, n = launched
            raise TapegradError(
                f"tg.distributed.{fn}: this process is one of {n} ranks ({var}={n}) but MPI "
                f"cannot be loaded ({type(err).__name__}: {err}); install it with\n"
                f"    {INSTALL}") from None
        _world = _World(None, 0, 1, 0, timeout)
        return _world
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    _world = _World(comm, comm.Get_rank(), comm.Get_size(), local.Get_rank(), timeout)
    local.Free()
    if _world.size > 1:
        _abort_on_uncaught(comm)
    return _world


def _abort_on_uncaught(comm: MPI.Intracomm) -> None:
    """Make an uncaught exception end every rank (after the usual traceback), not this one
    alone while the others wait for it in a collective."""
    previous = sys.excepthook

    def report_and_abort(kind: type[BaseException], value: BaseException,
                         traceback: TracebackType | None) -> None:
        previous(kind, value, traceback)
        # Said here: MPICH's own abort message races the launcher's teardown and is often lost.
        print(f"tg.distributed: the exception above is uncaught on rank {comm.Get_rank()}: "
              "MPI_Abort ends every rank", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        # The launcher forwards output through its own pipes and stops reading them when the
        # abort reaches it: a moment first, or the traceback can be cut off.
        time.sleep(_ABORT_GRACE_S)
        comm.Abort(1)

    sys.excepthook = report_and_abort


def init() -> None:
    """Start MPI (once; every other call here does it on first use) and, with several ranks,
    make an uncaught exception end every rank. Without MPI installed, the world is this one
    process (an error if a launcher started several). Each rank's device is
    `tg.default_device()`'s, which takes the launcher's local rank into account."""
    _get_world("init")


def rank() -> int:
    """This process's index among the `size()` ranks, 0 to size() - 1 (0 without MPI)."""
    return _get_world("rank").rank


def size() -> int:
    """How many processes run this program together (`mpiexec -n N`); 1 without MPI."""
    return _get_world("size").size


def local_rank() -> int:
    """This process's index among the ranks on its own machine (it picks the device)."""
    return _get_world("local_rank").local_rank


# --- the leaves -------------------------------------------------------------------------------

@dataclass
class _Leaves:
    """A tree's leaves as tensors or host arrays, with what the ranks must agree on."""

    leaves: list[AnyTensor | np.ndarray[Any, Any]]
    spec: Any
    shapes: list[tuple[int, ...]]
    dtypes: list[DType]


_HOST_LEAVES: tuple[type, ...] = (np.ndarray, np.generic, int, float, bool)


def _leaves(tree: Any, fn: str) -> _Leaves:
    flat, spec = flatten(tree)
    leaves: list[AnyTensor | np.ndarray[Any, Any]] = []
    for k, leaf in enumerate(flat):
        if isinstance(leaf, AnyTensor):
            leaves.append(leaf)
        elif isinstance(leaf, _HOST_LEAVES):
            leaves.append(host_array(leaf, fn, f"tree{_path(spec, k)}"))
        else:
            raise DTypeError(at_site(
                f"{fn}: tree{_path(spec, k)} must be an AnyTensor or an array, got "
                f"{type(leaf).__name__}"))
    return _Leaves(leaves, spec, [tuple(x.shape) for x in leaves],
                   [np.dtype(x.dtype) for x in leaves])


def _path(spec: Any, k: int) -> str:
    return leaf_paths(spec)[k]


def _on_device(leaf: AnyTensor | np.ndarray[Any, Any]) -> AnyTensor:
    return leaf if isinstance(leaf, AnyTensor) else upload(leaf, _device.default_device())


def _buckets(dtypes: list[DType]) -> dict[DType, list[int]]:
    """The leaf indices of each dtype, dtypes in order of first appearance (the same on every
    rank once the trees agree)."""
    buckets: dict[DType, list[int]] = {}
    for k, dtype in enumerate(dtypes):
        buckets.setdefault(dtype, []).append(k)
    return buckets


def _stage(leaves: _Leaves, ks: list[int], out: np.ndarray[Any, Any]) -> None:
    """Copy leaves `ks` one after another into the host buffer `out` (device copies are all
    enqueued, then waited for once per device: its queue is in order)."""
    last: dict[int, cl.Event] = {}
    offset = 0
    for k in ks:
        leaf = leaves.leaves[k]
        n = leaf.size
        if isinstance(leaf, AnyTensor):
            if n:
                last[id(leaf.device)] = cl.enqueue_copy(
                    leaf.device.queue, out[offset:offset + n], leaf.buffer, is_blocking=False)
        else:
            out[offset:offset + n] = leaf.reshape(-1)
        offset += n
    for event in last.values():
        event.wait()


def _unstage(leaves: _Leaves, ks: list[int], data: np.ndarray[Any, Any],
             results: list[AnyTensor | None]) -> None:
    """Upload the values of leaves `ks`, one after another in `data`, each to its leaf's device
    (a copy made as the buffer is created: `data` may be reused at once)."""
    offset = 0
    for k in ks:
        leaf = leaves.leaves[k]
        n = leaf.size
        device = leaf.device if isinstance(leaf, AnyTensor) else _device.default_device()
        results[k] = upload(data[offset:offset + n].reshape(leaf.shape), device)
        offset += n


def _buffers(world: _World, key: tuple[Any, ...], make: Callable[[], list[np.ndarray[Any, Any]]]
             ) -> list[np.ndarray[Any, Any]]:
    """The host buffers kept under `key`, made once by `make`."""
    found = world.staging.get(key)
    if found is None:
        if len(world.staging) >= _STAGING_KEPT:
            del world.staging[next(iter(world.staging))]
        found = world.staging[key] = make()
    return found


# --- collectives ------------------------------------------------------------------------------

def _wait(world: _World, requests: list[MPI.Request], fn: str, what: str,
          patient: bool = False) -> None:
    """Wait for `requests`, testing them until the world's deadline; past it, a TapegradError
    (and, at exit, MPI_Abort: the unfinished collective leaves MPI unusable).

    MPI moves a nonblocking collective's data only inside MPI calls, so a wait that sleeps
    between tests stretches every step of the transfer. Only `patient` waits sleep (after
    `_SPIN_S`): the tree check, where a rank waits for slower ones to finish computing and
    should leave them the cores; the data then moves between ranks that are all there."""
    from mpi4py import MPI

    start = time.monotonic()
    sleep = 1e-5
    while not MPI.Request.Testall(requests):
        waited = time.monotonic() - start
        if waited > world.timeout:
            assert world.comm is not None
            comm = world.comm
            atexit.register(comm.Abort, 1)
            raise TapegradError(
                f"{fn}: rank {world.rank} waited {world.timeout:g} s for the other ranks "
                f"({what}): one of them stopped (an error?) or is far behind; "
                f"{TIMEOUT_VAR} sets the limit in seconds")
        if waited > _SPIN_S:
            if patient:
                time.sleep(sleep)
                sleep = min(2 * sleep, _MAX_SLEEP_S)
            else:  # a peer descheduled on a busy machine gets the core back sooner
                os.sched_yield()


def _signature(fn: str, detail: str, leaves: _Leaves) -> bytes:
    return pickle.dumps((fn, detail, str(leaves.spec), leaf_paths(leaves.spec),
                         leaves.shapes, [d.str for d in leaves.dtypes]))


def _agree(world: _World, fn: str, detail: str, leaves: _Leaves,
           stage: Callable[[], None]) -> None:
    """Check that every rank called `fn` (with `detail`: its op or root) on trees of the same
    structure, shapes and dtypes; otherwise raise the same ShapeError on every rank.

    `stage` (the copies of this rank's values to the host) runs while the check's message is
    in flight: it waits for this rank's device to finish computing them, so a rank that is
    ahead then waits here, patiently, rather than spinning in the data exchange while the
    others still compute."""
    assert world.comm is not None
    comm = world.comm
    digest = np.frombuffer(hashlib.blake2b(
        repr((fn, detail, str(leaves.spec), leaves.shapes, [d.str for d in leaves.dtypes]))
        .encode(), digest_size=16).digest(), np.uint8)
    digests = np.empty((world.size, digest.size), np.uint8)
    request = comm.Iallgather(digest, digests)
    stage()
    _wait(world, [request], fn, "checking that the trees agree", patient=True)
    if (digests == digests[0]).all():
        return
    mine = np.frombuffer(_signature(fn, detail, leaves), np.uint8)
    lengths = np.empty(world.size, np.int64)
    _wait(world, [comm.Iallgather(np.array([mine.size], np.int64), lengths)], fn,
          "comparing the trees")
    everyone = np.empty(int(lengths.sum()), np.uint8)
    displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    _wait(world, [comm.Iallgatherv(mine, [everyone, (lengths.tolist(), displs.tolist())])], fn,
          "comparing the trees")
    signatures = [pickle.loads(everyone[d:d + n].tobytes())
                  for d, n in zip(displs.tolist(), lengths.tolist(), strict=True)]
    raise ShapeError(at_site(_difference(fn, signatures)))


def _difference(fn: str, signatures: list[Any]) -> str:
    """The first difference between rank 0's call and another rank's, in words (the same
    words on every rank: each has all the signatures)."""
    first = signatures[0]
    for r, other in enumerate(signatures[1:], start=1):
        if other == first:
            continue
        (fn0, detail0, spec0, paths0, shapes0, dtypes0) = first
        (fn1, detail1, spec1, paths1, shapes1, dtypes1) = other
        tail = (" (every rank must pass a tree of the same structure, shapes and dtypes)")
        if (fn0, detail0) != (fn1, detail1):
            return (f"{fn}: the ranks made different calls: rank 0 {fn0}({detail0}), "
                    f"rank {r} {fn1}({detail1})")
        for k in range(min(len(paths0), len(paths1))):
            if paths0[k] != paths1[k]:
                return (f"{fn}: the ranks' trees differ at leaf {k}: rank 0 has "
                        f"tree{paths0[k]}, rank {r} has tree{paths1[k]}{tail}")
            if (shapes0[k], dtypes0[k]) != (shapes1[k], dtypes1[k]):
                return (f"{fn}: the ranks' trees differ at tree{paths0[k]}: rank 0 has "
                        f"{np.dtype(dtypes0[k])} of shape {tuple(shapes0[k])}, rank {r} has "
                        f"{np.dtype(dtypes1[k])} of shape {tuple(shapes1[k])}{tail}")
        if len(paths0) != len(paths1):
            longer, r_longer = (paths0, 0) if len(paths0) > len(paths1) else (paths1, r)
            k = min(len(paths0), len(paths1))
            return (f"{fn}: the ranks' trees differ: rank 0 has {_leaf_count(len(paths0))}, "
                    f"rank {r} has {_leaf_count(len(paths1))}; the first one only rank "
                    f"{r_longer} has is tree{longer[k]}{tail}")
        return (f"{fn}: the ranks' trees differ in structure: rank 0 has {spec0}, rank {r} "
                f"has {spec1}{tail}")
    return f"{fn}: the ranks' trees differ"  # unreachable: some digest differed


def _is_rank(value: object, n: int) -> bool:
    """Whether `value` is an int (not a bool) from 0 to n - 1."""
    if isinstance(value, np.integer):
        value = value.item()
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n


def _leaf_count(n: int) -> str:
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def broadcast(tree: Any, root: int = 0) -> Any:
    """Root's values of `tree` on every rank, as AnyTensors on each rank's own devices (each
    leaf's device, or the default one for host arrays), in `tree`'s structure.

        params = tg.distributed.broadcast(cnn_params(seed=rank()))   # root's everywhere

    Every rank passes a tree of the same structure, shapes and dtypes (only root's values are
    used); a difference raises a ShapeError on every rank naming the first differing leaf.
    Leaves are AnyTensors or arrays (any dtype tapegrad holds). With one process, `tree`
    comes back with its leaves as AnyTensors."""
    fn = "broadcast"
    world = _get_world(fn)
    if not _is_rank(root, world.size):
        raise ShapeError(at_site(
            f"{fn}: root must be a rank, an int from 0 to {world.size - 1}, got {shown(root)}"))
    root = int(root)
    leaves = _leaves(tree, fn)
    if world.comm is None or world.size == 1:
        return leaves.spec.unflatten([_on_device(x) for x in leaves.leaves])
    comm = world.comm
    staged: list[tuple[list[int], np.ndarray[Any, Any]]] = []
    for dtype, ks in _buckets(leaves.dtypes).items():
        total = sum(leaves.leaves[k].size for k in ks)
        if total:
            staged.append((ks, _buffers(world, (fn, dtype.str, total),
                                        lambda dtype=dtype, total=total: [
                                            np.empty(total, dtype)])[0]))

    def stage() -> None:
        if world.rank == root:
            for ks, buffer in staged:
                _stage(leaves, ks, buffer)

    _agree(world, fn, f"root={root}", leaves, stage)
    results: list[AnyTensor | None] = [None] * len(leaves.leaves)
    requests = [comm.Ibcast(buffer.view(np.uint8), root=root) for _, buffer in staged]
    _wait(world, requests, fn, f"receiving root {root}'s values")
    if world.rank == root:
        return leaves.spec.unflatten([_on_device(x) for x in leaves.leaves])
    for ks, buffer in staged:
        _unstage(leaves, ks, buffer, results)
    return leaves.spec.unflatten([
        r if r is not None else _on_device(x) for r, x in zip(results, leaves.leaves,
                                                              strict=True)])


def allreduce(tree: Any, op: str = "mean") -> Any:
    """The elementwise sum (`op="sum"`) or mean (`op="mean"`) over the ranks of `tree`'s
    leaves, as AnyTensors on each leaf's device, in `tree`'s structure: the step of data
    parallelism is `grads = tg.distributed.allreduce(grads)`.

    The result is bitwise the same on every rank and on every run with as many ranks: rank j
    sums chunk j of every rank's values in rank order (0, 1, ..., n-1), then every rank gets
    the sums (MPI only moves bytes). Leaves of one dtype travel as one message. Leaves are
    AnyTensors or arrays: floats for "mean", floats or integers for "sum"; `tg.backward`'s
    result (keyed by ids) is reduced too, and comes back keyed by the same ids. Every rank passes
    a tree of the same structure, shapes and dtypes; a difference raises a ShapeError on every
    rank naming the first differing leaf. A rank left waiting longer than
    `TAPEGRAD_DISTRIBUTED_TIMEOUT` seconds (300) for the others raises a TapegradError."""
    fn = "allreduce"
    if op not in _OPS:
        raise ShapeError(at_site(f"{fn}: op must be 'mean' or 'sum', got {shown(op)}"))
    if isinstance(tree, Gradients):
        return _allreduce_by_id(cast(Gradients[AnyTensor], tree), op)
    world = _get_world(fn)
    leaves = _leaves(tree, fn)
    for k, dtype in enumerate(leaves.dtypes):
        if dtype not in SUPPORTED or dtype.kind == "b" or (op == "mean" and not is_float(dtype)):
            allowed = "a float dtype" if op == "mean" else "a float or integer dtype"
            raise DTypeError(at_site(
                f"{fn}: tree{_path(leaves.spec, k)} is {dtype}; op={op!r} needs {allowed}"))
    if world.comm is None or world.size == 1:
        return leaves.spec.unflatten([_on_device(x) for x in leaves.leaves])
    n = world.size
    buckets: list[tuple[list[int], list[np.ndarray[Any, Any]]]] = []
    for dtype, ks in _buckets(leaves.dtypes).items():
        total = sum(leaves.leaves[k].size for k in ks)
        if total:
            mine = total // n + (1 if world.rank < total % n else 0)
            buckets.append((ks, _buffers(  # the values, the chunks received, the result
                world, (fn, dtype.str, total),
                lambda dtype=dtype, total=total, mine=mine: [
                    np.empty(total, dtype), np.empty((n, mine), dtype),
                    np.empty(total, dtype)])))

    def stage() -> None:
        for ks, (send, _, _) in buckets:
            _stage(leaves, ks, send)

    _agree(world, fn, f"op={op!r}", leaves, stage)
    results: list[AnyTensor | None] = [None] * len(leaves.leaves)
    for ks, (send, parts, result) in buckets:
        _reduce(world, send, parts, result, op)
        _unstage(leaves, ks, result, results)
    return leaves.spec.unflatten([
        r if r is not None else _on_device(x) for r, x in zip(results, leaves.leaves,
                                                              strict=True)])


def _allreduce_by_id(grads: Gradients[AnyTensor], op: str) -> Gradients[AnyTensor]:
    """`tg.backward`'s result (keyed by the tape's ids, a leaf to optree) reduced as the list
    of its gradients in node order, which ranks that record the same tape share; errors name
    them by that order (`tree[1]`)."""
    ids = sorted(grads, key=lambda i: i.index)
    reduced: list[AnyTensor] = allreduce([grads[i] for i in ids], op)
    out = Gradients[AnyTensor](grads._tape, grads._loss, grads._op)
    out.update(zip(ids, reduced, strict=True))
    return out


def _reduce(world: _World, send: np.ndarray[Any, Any], parts: np.ndarray[Any, Any],
            result: np.ndarray[Any, Any], op: str) -> None:
    """Reduce `send` (this rank's values of one dtype) over the ranks into `result`: an
    all-to-all of chunks into `parts` (rank r's piece of this rank's chunk in row r), each
    chunk summed in rank order by its owner, and an all-gather of the sums."""
    assert world.comm is not None
    comm, n, me, total = world.comm, world.size, world.rank, send.size
    counts = [total // n + (1 if j < total % n else 0) for j in range(n)]
    starts = [sum(counts[:j]) for j in range(n)]
    mine = counts[me]
    size = send.dtype.itemsize
    byte_counts = [c * size for c in counts]
    byte_starts = [s * size for s in starts]
    _wait(world, [comm.Ialltoallv(
        [send.view(np.uint8), (byte_counts, byte_starts)],
        [parts.view(np.uint8).reshape(-1), ([mine * size] * n, [r * mine * size
                                                                for r in range(n)])])],
        "allreduce", "exchanging chunks")
    chunk = result[starts[me]:starts[me] + mine]
    np.copyto(chunk, parts[0])
    for r in range(1, n):
        np.add(chunk, parts[r], out=chunk)
    if op == "mean":
        np.divide(chunk, n, out=chunk)
    _wait(world, [comm.Iallgatherv(
        _in_place(), [result.view(np.uint8), (byte_counts, byte_starts)])],
        "allreduce", "gathering the sums")


def _in_place() -> Any:
    """MPI_IN_PLACE (mpi4py is imported only once MPI is in use)."""
    from mpi4py import MPI

    return MPI.IN_PLACE
