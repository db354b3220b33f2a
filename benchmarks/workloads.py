"""The workloads of the performance issue, each for tapegrad, PyTorch (if installed) and numpy.

Every tapegrad step ends with the device synchronised (`Device.finish`), and every torch step
computes the same gradients, so times compare like for like.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

import tapegrad as tg

from ._harness import Row, median_times

try:
    import torch  # pyright: ignore[reportMissingImports]
except ImportError:  # pragma: no cover - the bench target installs it where it can
    torch = None

Arr = np.ndarray[Any, Any]
RNG = np.random.default_rng(0)


# --- 1. MLP step ------------------------------------------------------------------------------

MLP_SIZES = (784, 512, 512, 10)


def mlp_data(batch: int = 256) -> tuple[Arr, Arr, list[Arr]]:
    x = RNG.standard_normal((batch, MLP_SIZES[0])).astype(np.float32)
    y = RNG.integers(0, MLP_SIZES[-1], batch).astype(np.int64)
    params: list[Arr] = []
    for fin, fout in itertools.pairwise(MLP_SIZES):
        params.append((RNG.standard_normal((fin, fout)) / np.sqrt(fin)).astype(np.float32))
        params.append(np.zeros(fout, np.float32))
    return x, y, params


def tg_mlp_forward(x: tg.AnyTensor, y: tg.AnyTensor, params: list[tg.AnyTensor]
                   ) -> tuple[tg.Tape, tg.Id]:
    tape, xi = tg.leaf(tg.Tape(x.device), x)
    tape, yi = tg.leaf(tape, y)
    ids: list[tg.Id] = []
    for p in params:
        tape, i = tg.leaf(tape, p, requires_grad=True)
        ids.append(i)
    h = xi
    for layer in range(3):
        tape, h = tg.linear(tape, h, ids[2 * layer], ids[2 * layer + 1])
        if layer < 2:
            tape, h = tg.relu(tape, h)
    return tg.cross_entropy(tape, h, yi)


def tg_mlp_step(x: tg.AnyTensor, y: tg.AnyTensor, params: list[tg.AnyTensor]
                ) -> dict[tg.Id, tg.AnyTensor]:
    tape, loss = tg_mlp_forward(x, y, params)
    grads = dict(tg.backward(tape, loss))
    x.device.finish()
    return grads


def torch_mlp_step(x: Arr, y: Arr, params: list[Arr]) -> Callable[[], object] | None:
    """Rows 1 and 1b's PyTorch step (gradients of the same MLP), or None without torch."""
    if torch is None:
        return None
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    tps = [torch.from_numpy(p).requires_grad_() for p in params]

    def step() -> None:
        h = tx
        for layer in range(3):
            h = h @ tps[2 * layer] + tps[2 * layer + 1]
            if layer < 2:
                h = torch.relu(h)
        torch.autograd.grad(torch.nn.functional.cross_entropy(h, ty), tps)

    return step


def bench_mlp() -> Row:
    x, y, params = mlp_data()
    dx, dy = tg.AnyTensor.from_numpy(x), tg.AnyTensor.from_numpy(y)
    dps = [tg.AnyTensor.from_numpy(p) for p in params]
    t_tg, t_torch = median_times([lambda: tg_mlp_step(dx, dy, dps),
                                  torch_mlp_step(x, y, params)])
    assert t_tg is not None
    return Row("1. MLP step 256x784, 784-512-512-10", "ms", t_tg * 1e3,
               None if t_torch is None else t_torch * 1e3)


def bench_mlp_jit() -> Row:
    """Row 1's step under `tg.jit` (the gradients as AnyTensors), against the same torch step."""
    x, y, params = mlp_data()
    dx, dy = tg.AnyTensor.from_numpy(x), tg.AnyTensor.from_numpy(y)
    dps = [tg.AnyTensor.from_numpy(p) for p in params]

    def grads(x: tg.AnyTensor, y: tg.AnyTensor, params: list[tg.AnyTensor]
              ) -> list[tg.AnyTensor]:
        tape, loss = tg_mlp_forward(x, y, params)
        found = tg.backward(tape, loss)
        return [found[i] for i in sorted(found, key=lambda i: i.index)]

    step = tg.jit(grads)

    def tg_step() -> None:
        step(dx, dy, dps)
        dx.device.finish()

    t_tg, t_torch = median_times([tg_step, torch_mlp_step(x, y, params)])
    assert t_tg is not None
    return Row("1b. same MLP step under tg.jit", "ms", t_tg * 1e3,
               None if t_torch is None else t_torch * 1e3,
               note=f"{step.last_launches} launches/step")


# --- 2. per-op overhead -------------------------------------------------------------------------

def per_op_chain(tape: tg.Tape, h: tg.Id, n_ops: int) -> tuple[tg.Tape, tg.Id]:
    """The per-op workload's ops: x 1.0001, + 0.0001, relu, in turn."""
    for i in range(n_ops):
        k = i % 3
        if k == 0:
            tape, h = tg.mul(tape, h, 1.0001)
        elif k == 1:
            tape, h = tg.add(tape, h, 0.0001)
        else:
            tape, h = tg.relu(tape, h)
    return tape, h


def torch_chain(x0: Arr, n_ops: int, read: bool) -> Callable[[], object] | None:
    """Row 2's chain in PyTorch, forward and backward (`read`: the gradient read to numpy, as
    row 2c's tapegrad side does), or None without torch."""
    if torch is None:
        return None
    tx = torch.from_numpy(x0).requires_grad_()

    def chain() -> None:
        h = tx
        for i in range(n_ops):
            k = i % 3
            h = h * 1.0001 if k == 0 else (h + 0.0001 if k == 1 else torch.relu(h))
        g = torch.autograd.grad(h.sum(), [tx])[0]
        if read:
            g.numpy()

    return chain


def bench_per_op(n_ops: int = 200) -> Row:
    x0 = RNG.standard_normal(16).astype(np.float32)
    dx = tg.AnyTensor.from_numpy(x0)

    def tg_chain() -> None:
        tape, x = tg.leaf(tg.Tape(dx.device), dx, requires_grad=True)
        tape, h = per_op_chain(tape, x, n_ops)
        tape, s = tg.sum(tape, h)
        tg.backward(tape, s, wrt=[x])
        dx.device.finish()

    torch_fn = torch_chain(x0, n_ops, read=False)

    def np_chain() -> None:
        h = x0
        masks: list[Arr] = []
        for i in range(n_ops):
            k = i % 3
            if k == 0:
                h = h * np.float32(1.0001)
            elif k == 1:
                h = h + np.float32(0.0001)
            else:
                masks.append(h > 0)
                h = np.maximum(h, 0)
        g = np.ones_like(h)
        for i in reversed(range(n_ops)):
            k = i % 3
            if k == 0:
                g = g * np.float32(1.0001)
            elif k == 2:
                g = g * masks.pop()

    t_tg, t_torch = median_times([tg_chain, torch_fn])
    (t_np,) = median_times([np_chain])
    assert t_tg is not None and t_np is not None
    per = 1e6 / n_ops
    return Row("2. per-op overhead, fwd+bwd (16 elements)", "us/op", t_tg * per,
               None if t_torch is None else t_torch * per, t_np * per)


# --- 2b. the cost of user-level shape checking (tg.typed) -------------------------------------

def bench_per_op_jit(n_ops: int = 200) -> Row:
    """Row 2's chain under `tg.jit`, forward and backward, ending with a host read of the
    gradient (the torch column does the same read)."""
    x0 = RNG.standard_normal(16).astype(np.float32)
    dx = tg.AnyTensor.from_numpy(x0)

    def chain_grad(x0: tg.AnyTensor) -> tg.AnyTensor:
        tape, x = tg.leaf(tg.Tape(x0.device), x0, requires_grad=True)
        tape, h = per_op_chain(tape, x, n_ops)
        tape, s = tg.sum(tape, h)
        return tg.backward(tape, s, wrt=[x])[x]

    step = tg.jit(chain_grad)
    # Steady state: the inline lane's builds (PoCL's CPU; made with the queue's, or where its
    # builds are its own after `_device.INLINE_AFTER` small launches) waited for.
    for _ in range(600):
        step(dx).numpy()
    dx.device.wait_for_inline_builds()
    t_tg, t_torch = median_times([lambda: step(dx).numpy(), torch_chain(x0, n_ops, read=True)])
    assert t_tg is not None
    per = 1e6 / n_ops
    return Row("2c. same chain under tg.jit, ending with a host read", "us/op", t_tg * per,
               None if t_torch is None else t_torch * per,
               note=f"{step.last_launches} launches per chain")


def bench_typed(n_calls: int = 200) -> list[Row]:
    """A small typed layer called repeatedly, with and without @tg.typed; tapegrad's own ops
    never run jaxtyping, so the difference is the checker's cost per user call."""
    from jaxtyping import Float

    def layer(tape: tg.Tape, x: Float[tg.Id, "b fin"], w: Float[tg.Id, "fin fout"]
              ) -> tuple[tg.Tape, Float[tg.Id, "b fout"]]:
        tape, h = tg.matmul(tape, x, w)
        return tg.relu(tape, h)

    typed_layer = tg.typed(layer)
    x0 = tg.AnyTensor.from_numpy(RNG.standard_normal((4, 8)).astype(np.float32))
    w0 = tg.AnyTensor.from_numpy(RNG.standard_normal((8, 8)).astype(np.float32))

    def run(fn: Any) -> None:
        tape, x = tg.leaf(tg.Tape(x0.device), x0)
        tape, w = tg.leaf(tape, w0)
        for _ in range(n_calls):
            tape, x = fn(tape, x, w)
        x0.device.finish()

    t_plain, t_checked = median_times([lambda: run(layer), lambda: run(typed_layer)])
    assert t_plain is not None and t_checked is not None
    plain, checked = t_plain / n_calls * 1e6, t_checked / n_calls * 1e6
    return [Row("2b. typed layer call (2 ops), plain", "us/call", plain),
            Row("2b. same with @tg.typed (jaxtyping + beartype)", "us/call", checked,
                note=f"{checked - plain:+.0f} us per call: a call like one that passed is not "
                     "checked again; ops unchecked")]


# --- 3. large elementwise -----------------------------------------------------------------------

IDEAL_BYTES = 201e6


def bench_elementwise(n: int = 16 * 1024 * 1024) -> list[Row]:
    x0 = RNG.standard_normal(n).astype(np.float32)
    dx = tg.AnyTensor.from_numpy(x0)

    def tg_step() -> None:
        tape, x = tg.leaf(tg.Tape(dx.device), dx, requires_grad=True)
        tape, r = tg.relu(tape, x)
        tape, p = tg.mul(tape, r, x)
        tape, s = tg.sum(tape, p)
        tg.backward(tape, s)
        dx.device.finish()

    torch_fn: Callable[[], object] | None = None
    if torch is not None:
        tx = torch.from_numpy(x0).requires_grad_()

        def torch_step() -> None:
            torch.autograd.grad((torch.relu(tx) * tx).sum(), [tx])

        torch_fn = torch_step

    def np_step() -> None:
        r = np.maximum(x0, 0)
        _ = (r * x0).sum()
        _ = np.where(x0 > 0, 2 * x0, 0)

    # Three warm-up steps: a fused chain's kernel is built on its third sighting.
    t_tg, t_torch = median_times([tg_step, torch_fn], warmup=3, repeat=7)
    (t_np,) = median_times([np_step], warmup=1, repeat=5)
    assert t_tg is not None and t_np is not None
    ms = Row("3. sum(relu(x)*x), 16M, fwd+bwd", "ms", t_tg * 1e3,
             None if t_torch is None else t_torch * 1e3, t_np * 1e3)
    rate = Row("3. same, effective bandwidth (201 MB ideal)", "GB/s", IDEAL_BYTES / t_tg / 1e9,
               None if t_torch is None else IDEAL_BYTES / t_torch / 1e9,
               IDEAL_BYTES / t_np / 1e9, higher_is_better=True)
    return [ms, rate]


# --- 4. GEMM ------------------------------------------------------------------------------------

def bench_gemm(n: int = 1024) -> Row:
    a0 = RNG.standard_normal((n, n)).astype(np.float32)
    b0 = RNG.standard_normal((n, n)).astype(np.float32)
    da, db = tg.AnyTensor.from_numpy(a0), tg.AnyTensor.from_numpy(b0)
    g0 = tg.AnyTensor.from_numpy(np.ones((n, n), np.float32))

    def tg_step() -> None:
        tape, a = tg.leaf(tg.Tape(da.device), da, requires_grad=True)
        tape, b = tg.leaf(tape, db, requires_grad=True)
        tape, c = tg.matmul(tape, a, b)
        tg.backward(tape, c, seed=g0)
        da.device.finish()

    flops = 3 * 2 * n**3
    torch_fn: Callable[[], object] | None = None
    if torch is not None:
        ta = torch.from_numpy(a0).requires_grad_()
        tb = torch.from_numpy(b0).requires_grad_()
        tgr = torch.ones(n, n)

        def torch_step() -> None:
            torch.autograd.grad(ta @ tb, [ta, tb], grad_outputs=tgr)

        torch_fn = torch_step

    def np_step() -> None:
        c = a0 @ b0
        _ = c @ b0.T
        _ = a0.T @ c

    t_tg, t_torch = median_times([tg_step, torch_fn], warmup=2, repeat=7, budget_s=60)
    # numpy's BLAS threads spin for a while after each call and would slow whatever ran next:
    # it is timed on its own, after the engines.
    (t_np,) = median_times([np_step], warmup=1, repeat=5)
    assert t_tg is not None and t_np is not None
    return Row(f"4. GEMM {n}^3 fwd + both bwd products", "GFLOP/s", flops / t_tg / 1e9,
               None if t_torch is None else flops / t_torch / 1e9, flops / t_np / 1e9,
               higher_is_better=True)


# --- 5. digits CNN step ---------------------------------------------------------------------------

def bench_cnn(batch: int = 64) -> Row:
    from tapegrad.demo import digits

    x0 = RNG.standard_normal((batch, 1, 8, 8)).astype(np.float32)
    y0 = RNG.integers(0, 10, batch).astype(np.int64)
    params = digits.cnn_params(0)

    def tg_step() -> None:
        tape = tg.Tape()
        ids: dict[str, tg.Id] = {}
        for k, v in params.items():
            tape, ids[k] = tg.leaf(tape, v, requires_grad=True)
        tape, xi = tg.leaf(tape, x0)
        tape, yi = tg.leaf(tape, y0)
        tape, logits = digits.cnn(tape, ids, xi)
        tape, loss = tg.cross_entropy(tape, logits, yi)
        grads = tg.backward(tape, loss)
        tg.optim.adam(params, {k: grads[i] for k, i in ids.items()}, None)
        tg.default_device().finish()

    torch_fn: Callable[[], object] | None = None
    if torch is not None:
        tp = {k: torch.from_numpy(v.numpy()).requires_grad_() for k, v in params.items()}
        opt = torch.optim.Adam(list(tp.values()), lr=1e-3)
        tx, ty = torch.from_numpy(x0), torch.from_numpy(y0)
        F = torch.nn.functional

        def torch_step() -> None:
            h = F.max_pool2d(torch.relu(F.conv2d(tx, tp["c1"], tp["cb1"], padding=1)), 2)
            h = F.max_pool2d(torch.relu(F.conv2d(h, tp["c2"], tp["cb2"], padding=1)), 2)
            logits = h.reshape(batch, -1) @ tp["w"] + tp["b"]
            loss = F.cross_entropy(logits, ty)
            opt.zero_grad()
            loss.backward()
            opt.step()

        torch_fn = torch_step
    t_tg, t_torch = median_times([tg_step, torch_fn])
    assert t_tg is not None
    return Row("5. digits CNN training step (batch 64, Adam)", "ms", t_tg * 1e3,
               None if t_torch is None else t_torch * 1e3)


# --- 6. memory ----------------------------------------------------------------------------------

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_memory(steps: int = 10_000) -> list[Row]:
    x, y, params = mlp_data()
    dx, dy = tg.AnyTensor.from_numpy(x), tg.AnyTensor.from_numpy(y)
    dps = [tg.AnyTensor.from_numpy(p) for p in params]
    device = dx.device
    tg_mlp_step(dx, dy, dps)
    gc.collect()
    # Saved forward values: the device memory the forward's nodes hold after it. Their nominal
    # sizes are larger: a pending value (fused, see _fusion) holds no buffer.
    before = device.active_bytes()
    tape, loss = tg_mlp_forward(dx, dy, dps)
    tg.value(tape, loss).numpy()  # forwards are deferred: computed now, as a logged loss is
    device.finish()
    nominal = sum(node.value.nbytes for node in tape if node.prim is not None)
    base = device.active_bytes()
    held = base - before
    device.reset_peak()
    grads = tg.backward(tape, loss)
    device.finish()
    peak_extra = device.peak_bytes() - base
    del grads, tape
    rows = [Row("6. MLP backward: peak extra device memory / saved forward values", "ratio",
                peak_extra / held,
                note=f"{peak_extra / 2**20:.1f} MiB over the {held / 2**20:.1f} MiB the forward "
                     f"holds ({nominal / 2**20:.1f} MiB nominal; pending values hold none)")]
    gc.collect()
    rss0, dev0 = _rss_mb(), device.active_bytes()
    checkpoints: list[tuple[int, float, float]] = []
    for step in range(1, steps + 1):
        tg_mlp_step(dx, dy, dps)
        if step % (steps // 5) == 0:
            gc.collect()
            checkpoints.append((step, _rss_mb(), device.active_bytes() / 2**20))
    growth = checkpoints[-1][1] - checkpoints[0][1]
    rows.append(Row(f"6. host RSS growth over MLP steps {steps // 5}..{steps}", "MiB", growth,
                    note=f"RSS {rss0:.0f} -> {checkpoints[-1][1]:.0f} MiB; device live "
                         f"{dev0 / 2**20:.1f} -> {checkpoints[-1][2]:.1f} MiB"))
    return rows
