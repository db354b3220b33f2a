"""tapegrad's OpenCL programs build with empty logs, and a first run prints nothing.

PoCL's clang prints "N warnings generated." to stderr itself whenever a build warns (pyopencl's
CompilerWarning is silenced, the line is not), so a warning in any program tapegrad generates
is noise on every cold start: once per fused kernel, too. Builds here bypass every cache, in a
fresh process (PoCL reads its settings once): a cached build reports the log it had, or none.

Run as a script, this file does the work of a test in that fresh process: `logs` prints the
build log of every program family as JSON, `workload` runs a small training step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl

import tapegrad as tg
from tapegrad import _device, _fusion, _kernels, _optim
from tapegrad._ops import compare, conv, indexing, linalg, scan
from tapegrad._tensor import C_TYPES, AnyTensor

# The helper of a custom op (the identity), which warns without -w: an equality in doubled
# parentheses. A user's C builds with USER_SOURCE_OPTIONS, so it prints nothing either.
_SAME_HELPER = "inline T quiet_same(T x) { if ((x == (T)1)) return (T)1; return x; }\n"


# NVIDIA's drivers since 550 note this of every kernel of every program, whatever its source
# (the one-line kernel `o[i] *= 3` too, with -w too): a note of the driver, not of our C.
_DRIVER_NOTE = re.compile(r"^\(\): Warning: Function \w+ is a kernel, so overriding noinline "
                          r"attribute\. The function may be inlined when called\.$", re.MULTILINE)


def _cold_env(cache: Path, *, uncached: bool) -> dict[str, str]:
    """The environment of a first run: empty caches under `cache`, tapegrad's defaults. With
    `uncached`, nothing is read from or written to a build cache at all."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TAPEGRAD_", "POCL_", "PYOPENCL_"))}
    env.update(XDG_CACHE_HOME=str(cache), POCL_CACHE_DIR=str(cache / "pocl"))
    if uncached:
        env.update(POCL_KERNEL_CACHE="0", PYOPENCL_NO_CACHE="1", CUDA_CACHE_DISABLE="1")
    return env


def _run(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


# --- the programs --------------------------------------------------------------------------------


def _every_expression(x: AnyTensor, operands: list[AnyTensor | float]) -> AnyTensor:
    """A pending sum of every fusing expression over `operands` (taken in turn) and `x`."""
    total = x
    add = _kernels._EXPRESSIONS["add"]
    for k, found in enumerate(e for e in _kernels._EXPRESSIONS.values() if e.fuses):
        args = [operands[(k + i) % len(operands)] for i in range(found.arity)]
        if all(not isinstance(arg, AnyTensor) for arg in args):
            args[0] = x
        part = _fusion.elementwise(found, args, x.shape, x.dtype, x.device)
        total = _fusion.elementwise(add, [total, part], x.shape, x.dtype, x.device)
    return total


def _fused_sources() -> dict[str, str]:
    """Generated kernels of fused elementwise DAGs (`_fusion._Plan.source`), made without a
    launch: one DAG of every fusing expression over a tensor, a splat, a row block and a
    per-element block (sizes as arguments) for the map, and one without blocks for the sinks
    that evaluate a DAG inside a row sum or a strided gather."""
    device = tg.default_device()
    sources: dict[str, str] = {}
    shape = (4, 2 * _kernels.DENSE_CHUNK)
    old = _fusion.set_fuse_after(1)  # broadcasts stay pending only while fusion is on
    try:
        for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
            if dtype == np.float64 and not device.has_fp64:
                continue
            x = AnyTensor.from_numpy(np.linspace(-1.0, 1.0, 4 * shape[1], dtype=dtype)
                                     .reshape(shape), device)
            splat, row, each = (
                _fusion.pending_broadcast(AnyTensor.from_numpy(np.ones(block, dtype), device),
                                          shape)
                for block in ((1,), (shape[1],), (shape[0], 1)))
            assert splat is not None and row is not None and each is not None
            blocks = _fusion._Plan(_every_expression(x, [x, splat, 0.5, row, each]))
            assert blocks.sizes and blocks.fits()
            sources[f"fused map {dtype}"] = blocks.source(dtype, "map")
            plain = _fusion._Plan(_every_expression(x, [x, splat, 0.5]))
            assert not plain.sizes and plain.fits()
            sinks = ["sum_rows", "gather1", "gather4"] if dtype == np.float32 else ["sum_rows"]
            for sink in sinks:
                sources[f"fused {sink} {dtype}"] = plain.source(dtype, sink)
    finally:
        _fusion.set_fuse_after(old)
    return sources


def program_sources() -> dict[str, str]:
    """The source of every program family tapegrad builds, by name: the core program of each
    float dtype (every registered family), and those outside it: gathers over many dims,
    concat, take and its gradient for each data and index dtype, the optimizers, conv2d's
    kernels, the heavy ops over views, a custom op's program (tapegrad's part of it: the
    user's C here does not warn) and fused kernels."""
    device = tg.default_device()
    floats = [np.dtype(np.float32)] + ([np.dtype(np.float64)] if device.has_fp64 else [])
    sources = {f"core {dtype}": _device.core_source(dtype) for dtype in floats}
    sources["copy_wide"] = _kernels._wide_copy_source()
    sources["concat"] = _kernels._concat_source()
    for dtype in C_TYPES:
        if dtype == np.float64 and not device.has_fp64:
            continue
        for index in (np.dtype(np.int32), np.dtype(np.int64)):
            sources[f"take {dtype} {index}"] = indexing._source(dtype, index)
    for dtype in floats:
        sources[f"optim {dtype}"] = _optim._source(dtype, _optim._chunk(device))
        sources[f"conv {dtype}"] = conv._conv_source(dtype)
        sources[f"rare elementwise {dtype}"] = _kernels._elementwise_source(
            dtype, _kernels.RARE_FAMILY)
        sources[f"heavy_view {dtype}"] = _kernels._view_source(dtype)
        sources[f"add_puts {dtype}"] = _kernels._puts_source(dtype)
        sources[f"matmul_gpu {dtype}"] = linalg._gpu_source(dtype)
        sources[f"window_gpu {dtype}"] = conv._gpu_source(dtype)
    for dtype in C_TYPES:  # comparisons, triangles, arg-reductions and scans: every dtype
        if dtype == np.float64 and not device.has_fp64:
            continue
        sources[f"compare {dtype}"] = compare._source(dtype)
        sources[f"scan {dtype}"] = scan._source(dtype)
    tg.elementwise_op("quiet_softplus", 2, forward="log1p(exp(a)) * b",
                      vjps=["g * b / ((T)1 + exp(-a))", "g * log1p(exp(a))"])
    family = _kernels._EXPRESSIONS["quiet_softplus"].family
    for dtype in floats:
        sources[f"custom op {dtype}"] = _kernels._elementwise_source(dtype, family)
    sources.update(_fused_sources())
    return sources


def _print_logs() -> None:
    """Build every program as tapegrad does (no options) and print the logs as JSON."""
    device = tg.default_device()
    logs: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyopencl's CompilerWarning: the log is what counts
        for name, source in program_sources().items():
            program = cl.Program(device.context, source).build()
            log: object = program.get_build_info(
                device.cl_device, cl.program_build_info.LOG)
            logs[name] = str(log)
    print(json.dumps(logs))


# --- a first run ---------------------------------------------------------------------------------


def _workload() -> None:
    """Forward and backward of each kind of op, and Adam steps: three steps, so that fusion's
    generated kernels (built on a structure's third sighting) are built too."""
    rng = np.random.default_rng(0)
    gate = tg.elementwise_op("quiet_gate", 2, forward="quiet_same(a) * b",
                             vjps=["g * b", "g * quiet_same(a)"], helpers=_SAME_HELPER)
    state: Any = None
    for _ in range(3):
        tape = tg.Tape()
        tape, x = tg.leaf(tape, rng.standard_normal((2, 3, 8, 8)).astype(np.float32))
        tape, w = tg.leaf(tape, rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                          requires_grad=True)
        tape, m = tg.leaf(tape, rng.standard_normal((64, 10)).astype(np.float32),
                          requires_grad=True)
        tape, table = tg.leaf(tape, rng.standard_normal((5, 10)).astype(np.float32),
                              requires_grad=True)
        tape, labels = tg.leaf(tape, np.array([1, 4], np.int64))
        tape, h = tg.conv2d(tape, x, w, padding=1)
        tape, h = tg.max_pool2d(tape, h, 2)
        tape, h = tg.reshape(tape, h, (2, 64))
        tape, h = tg.matmul(tape, h, m)
        tape, h = tg.layer_norm(tape, h)
        tape, rows = tg.embedding(tape, table, labels)
        tape, a = tg.mul(tape, h, 0.5)
        tape, a = tg.tanh(tape, a)
        tape, a = tg.add(tape, a, rows)
        tape, a = tg.relu(tape, a)
        tape, a = tg.pow(tape, a, 2.0)
        tape, a = gate(tape, a, h)
        tape, loss = tg.cross_entropy(tape, a, labels)
        tape, p = tg.softmax(tape, h)
        tape, p = tg.sum(tape, p)
        tape, loss = tg.add(tape, loss, p)
        grads = tg.backward(tape, loss)
        params = {"w": tg.value(tape, w), "m": tg.value(tape, m)}
        params, state = tg.optim.adam(params, {"w": grads[w], "m": grads[m]}, state)
        tg.value(tape, loss).numpy()
    tape, a64 = tg.leaf(tg.Tape(), rng.standard_normal((2, 40)), requires_grad=True)
    tape, b64 = tg.leaf(tape, rng.standard_normal((40, 3)))
    tape, c64 = tg.matmul(tape, a64, b64)
    tape, c64 = tg.sum(tape, c64)
    tg.backward(tape, c64)[a64].numpy()


# --- the tests -----------------------------------------------------------------------------------


def test_every_program_family_is_covered() -> None:
    """Each family named where tapegrad asks for a kernel is in the core programs or among
    `program_sources`' others: a new family of its own must be added there."""
    package = Path(tg.__file__).parent
    named = set[str]()
    for path in package.rglob("*.py"):
        named.update(re.findall(r"\.kernel\(\s*\"([\w.]+)\"", path.read_text()))
    covered = set(_device._FAMILY_SOURCES) | {"copy_wide", "take", "optim", "fused", "compare",
                                              "scan", "conv", "heavy_view", "concat",
                                              "matmul_gpu", "window_gpu", "add_puts"}
    assert named, "no kernel families found: has Device.kernel been renamed?"
    assert named <= covered, f"families not covered by program_sources: {named - covered}"


def test_every_program_builds_with_an_empty_log(tmp_path: Path) -> None:
    result = _run("logs", _cold_env(tmp_path, uncached=True))
    assert result.returncode == 0, result.stderr
    logs: dict[str, str] = json.loads(result.stdout)
    assert {"core float32", "copy_wide", "concat", "optim float32", "take float32 int64",
            "add_puts float32",
            "custom op float32", "fused map float32", "fused sum_rows float32"} <= set(logs)
    noisy = {name: log for name, log in logs.items() if _DRIVER_NOTE.sub("", log).strip()}
    assert not noisy, "\n".join(f"{name}:\n{log}" for name, log in noisy.items())


def test_a_first_run_prints_nothing(tmp_path: Path) -> None:
    result = _run("workload", _cold_env(tmp_path, uncached=False))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    if tg.default_device().platform_name == "Portable Computing Language":
        assert (tmp_path / "pocl").is_dir()  # the caches were empty: this run built everything


if __name__ == "__main__":
    {"logs": _print_logs, "workload": _workload}[sys.argv[1]]()
