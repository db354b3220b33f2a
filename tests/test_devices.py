"""Choosing the device: TAPEGRAD_DEVICE, then PYOPENCL_CTX (read as pyopencl reads it), then a
GPU, then a CPU; a variable that names no device, or a machine without OpenCL, is a
DeviceError that says which variable, or what to install."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import cast

import numpy as np
import pyopencl as cl
import pytest

import tapegrad as tg
from tapegrad import _device

CHOSEN = "import tapegrad as tg; print(repr(tg.Tape().device))"

# The tests of this machine's devices are written for CI's: one platform, PoCL's, with one CPU
# device. Elsewhere (a GPU machine) they are skipped; the simulated machines below run anywhere.
_POCL_CPU_ONLY = [(dev.platform_name, dev.kind) for dev in tg.devices()] == [
    ("Portable Computing Language", "cpu")]
on_pocl_cpu_only = pytest.mark.skipif(
    not _POCL_CPU_ONLY, reason="written for a machine whose only OpenCL device is PoCL's CPU")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh process with the device variables of `env` only."""
    clean = {key: value for key, value in os.environ.items()
             if key not in ("TAPEGRAD_DEVICE", "PYOPENCL_CTX")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No default device chosen yet and no device variable set (all restored after)."""
    monkeypatch.setattr(_device, "_default", None)
    monkeypatch.delenv("TAPEGRAD_DEVICE", raising=False)
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    return monkeypatch


# --- in a fresh process, as a user meets them ----------------------------------------------------


@on_pocl_cpu_only
def test_a_bad_tapegrad_device_names_the_variable_not_a_line_of_the_user() -> None:
    result = _python(CHOSEN, TAPEGRAD_DEVICE="foo")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tapegrad.DeviceError: TAPEGRAD_DEVICE='foo' is not a device: use "
                           "'cpu', 'gpu' or 'P:D'")
    assert "available: Device('0:0'" in last
    assert "called at" not in result.stderr


@on_pocl_cpu_only
def test_pyopencl_ctx_chooses_the_device_and_tapegrad_device_wins() -> None:
    result = _python(CHOSEN, PYOPENCL_CTX="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Device('0:0'")
    result = _python(CHOSEN, PYOPENCL_CTX="5", TAPEGRAD_DEVICE="0:0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Device('0:0'")
    result = _python(CHOSEN, PYOPENCL_CTX="5")
    assert "PYOPENCL_CTX='5' matches no platform" in result.stderr


# --- the rules, in this process -------------------------------------------------------------------


@on_pocl_cpu_only
@pytest.mark.parametrize("spec", ["cpu", "0:0", " CPU "])
def test_tapegrad_device_names_a_device(fresh: pytest.MonkeyPatch, spec: str) -> None:
    fresh.setenv("TAPEGRAD_DEVICE", spec)
    assert tg.default_device() is tg.devices()[0]


@on_pocl_cpu_only
@pytest.mark.parametrize(("spec", "message"), [
    ("foo", "TAPEGRAD_DEVICE='foo' is not a device: use 'cpu', 'gpu' or 'P:D'"),
    ("0", "TAPEGRAD_DEVICE='0' is not a device"),
    ("5:0", "TAPEGRAD_DEVICE='5:0' names no device here; available: Device('0:0'"),
    ("gpu", "TAPEGRAD_DEVICE='gpu' names no device here"),
])
def test_tapegrad_device_that_names_no_device(fresh: pytest.MonkeyPatch, spec: str,
                                              message: str) -> None:
    fresh.setenv("TAPEGRAD_DEVICE", spec)
    with pytest.raises(tg.DeviceError) as info:
        tg.default_device()
    assert str(info.value).startswith(message)
    assert "called at" not in str(info.value)


@on_pocl_cpu_only
@pytest.mark.parametrize("ctx", ["0:0", "0", ":0", "0:", "portable", "Portable:{device}",
                                 ":{device}", "0:0,0"])
def test_pyopencl_ctx_as_pyopencl_reads_it(fresh: pytest.MonkeyPatch, ctx: str) -> None:
    # PoCL names its CPU device "pthread-<cpu>", or "cpu-<arch>-<cpu>" in newer releases
    device = tg.devices()[0].name.split("-")[0]
    fresh.setenv("PYOPENCL_CTX", ctx.format(device=device))
    assert tg.default_device() is tg.devices()[0]


@on_pocl_cpu_only
@pytest.mark.parametrize(("ctx", "message"), [
    ("5", "PYOPENCL_CTX='5' matches no platform: use 'P:D' or 'P'"),
    ("nvidia", "PYOPENCL_CTX='nvidia' matches no platform"),
    ("0:3", "PYOPENCL_CTX='0:3' matches no device of platform 0"),
    ("0:0:0", "PYOPENCL_CTX='0:0:0' has more than platform:device"),
])
def test_pyopencl_ctx_that_names_no_device(fresh: pytest.MonkeyPatch, ctx: str,
                                           message: str) -> None:
    fresh.setenv("PYOPENCL_CTX", ctx)
    with pytest.raises(tg.DeviceError, match="^" + message.replace("(", r"\(")):
        tg.default_device()


@on_pocl_cpu_only
def test_tapegrad_device_wins_over_pyopencl_ctx(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("PYOPENCL_CTX", "nvidia")
    fresh.setenv("TAPEGRAD_DEVICE", "cpu")
    assert tg.default_device() is tg.devices()[0]


def _device_on(p_index: int, d_index: int, platform: str, name: str, gpu: bool) -> tg.Device:
    """A Device over a stand-in for pyopencl's, for machines this one is not."""
    fake = SimpleNamespace(
        name=name, platform=SimpleNamespace(name=platform),
        type=cl.device_type.GPU if gpu else cl.device_type.CPU, double_fp_config=1,
        max_mem_alloc_size=1 << 30)
    return tg.Device(p_index, d_index, cast(cl.Device, fake))


_MACHINE = [
    _device_on(0, 0, "NVIDIA CUDA", "NVIDIA H100 80GB HBM3", True),
    _device_on(0, 1, "NVIDIA CUDA", "NVIDIA H100 80GB HBM3", True),
    _device_on(1, 0, "Portable Computing Language", "cpu-haswell-AMD EPYC", False),
    _device_on(2, 0, "Intel(R) OpenCL", "Intel(R) Xeon(R) CPU", False),
]


@pytest.mark.parametrize(("ctx", "chosen"), [
    ("1", (1, 0)), ("0:1", (0, 1)), ("nvidia:1", (0, 1)), ("cuda:h100", (0, 0)),
    ("portable", (1, 0)), ("2:xeon", (2, 0)), ("0:1,0", (0, 1)),
    ("c", (2, 0)),  # as pyopencl: the last platform whose name holds it
])
def test_pyopencl_ctx_on_a_machine_with_several_platforms(ctx: str,
                                                          chosen: tuple[int, int]) -> None:
    found = _device._pyopencl_ctx(ctx, _MACHINE)  # pyright: ignore[reportPrivateUsage]
    assert (found.platform_index, found.device_index) == chosen


@pytest.mark.parametrize(("env", "chosen"), [
    ({}, (0, 0)), ({"MPI_LOCALRANKID": "1"}, (0, 1)), ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, (0, 1)),
    ({"SLURM_LOCALID": "2"}, (0, 0)), ({"MPI_LOCALRANKID": "x"}, (0, 0)),
])
def test_an_mpi_launchers_local_rank_picks_the_gpu(fresh: pytest.MonkeyPatch, env: dict[str, str],
                                                   chosen: tuple[int, int]) -> None:
    """Ranks on one node take one GPU each, round robin, from the first tensor they make."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID"):
        fresh.delenv(var, raising=False)
    for var, value in env.items():
        fresh.setenv(var, value)
    fresh.setattr(_device, "devices", lambda: list(_MACHINE))
    found = tg.default_device()
    assert (found.platform_index, found.device_index) == chosen


@pytest.mark.parametrize("ctx", ["3", "0:2", "1:h100"])
def test_pyopencl_ctx_names_no_device_of_several_platforms(ctx: str) -> None:
    with pytest.raises(tg.DeviceError, match=f"^PYOPENCL_CTX='{ctx}' matches no"):
        _device._pyopencl_ctx(ctx, _MACHINE)  # pyright: ignore[reportPrivateUsage]


# --- no OpenCL ----------------------------------------------------------------------------------


@pytest.fixture
def no_devices_yet(fresh: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    fresh.setattr(_device, "_devices", None)
    return fresh


def _no_platform() -> list[cl.Platform]:
    # What the ICD loader reports when it finds no driver at all.
    raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")


def _no_platform_listed() -> list[cl.Platform]:
    return []


@pytest.mark.parametrize("get_platforms", [_no_platform, _no_platform_listed])
def test_no_platform_says_what_to_install(no_devices_yet: pytest.MonkeyPatch,
                                          get_platforms: object) -> None:
    no_devices_yet.setattr(cl, "get_platforms", get_platforms)
    with pytest.raises(tg.DeviceError) as info:
        tg.Tape()
    message = str(info.value)
    assert message.startswith("no OpenCL platform found")
    assert message.endswith(_device.install_hint())
    if sys.platform == "linux" and _device.machine() == "x86_64":
        assert 'pip install "pyopencl[pocl]"' in message
    assert "called at" not in message


def test_a_platform_without_devices_says_what_to_install(
        no_devices_yet: pytest.MonkeyPatch) -> None:
    def no_device() -> list[cl.Device]:
        raise cl.RuntimeError("clGetDeviceIDs failed: DEVICE_NOT_FOUND")

    empty = SimpleNamespace(name="Portable Computing Language", get_devices=no_device)
    no_devices_yet.setattr(cl, "get_platforms", lambda: [empty])
    with pytest.raises(tg.DeviceError) as info:
        tg.devices()
    assert str(info.value).startswith(
        "no OpenCL device found on the platforms 'Portable Computing Language'; install")


@pytest.mark.parametrize(("system", "arch", "command"), [
    ("linux", "x86_64", 'pip install "pyopencl[pocl]"'),
    ("linux", "x86_64", "pip install pocl-binary-distribution"),
    ("linux", "aarch64", "apt install pocl-opencl-icd"),
    ("linux", "aarch64", "/etc/OpenCL/vendors"),
    ("darwin", "arm64", "pip install --force-reinstall pyopencl"),
    ("win32", "AMD64", "Intel's CPU Runtime for OpenCL Applications"),
])
def test_the_install_hint_fits_the_platform(system: str, arch: str, command: str) -> None:
    assert command in _device.install_hint(system, arch)


# --- float32 arithmetic as IEEE rounds it -------------------------------------------------------


def test_float32_division_and_sqrt_round_correctly_on_the_default_device() -> None:
    """OpenCL lets a device's float32 `/` and sqrt be 2.5-3 ulp off unless programs ask
    otherwise (NVIDIA's did); tapegrad asks where the device can: numpy's bits, every one."""
    if not tg.default_device().exact_options:
        pytest.skip("the device cannot round float32 division and sqrt correctly")
    rng = np.random.default_rng(17)
    a = (rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 7, 4096)).astype(np.float32)
    b = (rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 7, 4096)).astype(np.float32)
    tape, ai = tg.leaf(tg.Tape(), a)
    tape, bi = tg.leaf(tape, b)
    tape, quotient = tg.div(tape, ai, bi)
    tape, magnitude = tg.abs(tape, ai)
    tape, root = tg.sqrt(tape, magnitude)
    np.testing.assert_array_equal(tg.value(tape, quotient).numpy(), a / b)
    np.testing.assert_array_equal(tg.value(tape, root).numpy(), np.sqrt(np.abs(a)))


@pytest.mark.parametrize("exact", [True, False])
def test_programs_ask_for_exact_division_where_the_device_offers_it(exact: bool) -> None:
    fake = SimpleNamespace(
        name="a GPU", platform=SimpleNamespace(name="a vendor"), type=cl.device_type.GPU,
        double_fp_config=1, max_mem_alloc_size=1 << 30,
        single_fp_config=int(cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT) * exact
        | int(cl.device_fp_config.ROUND_TO_NEAREST))
    device = tg.Device(0, 0, cast(cl.Device, fake))
    want = ("-cl-fp32-correctly-rounded-divide-sqrt",) if exact else ()
    assert device.exact_options == want


def test_kernel_objects_share_their_invoker_from_memory() -> None:
    """pyopencl makes every kernel object's invoker from its disk cache; tapegrad keeps them in
    memory (`_device._invokers_in_memory`): two kernel objects of one kernel get the same
    invoker, and each still launches with its own arguments."""
    import importlib

    invoker = importlib.import_module("pyopencl.invoker")
    assert getattr(invoker.generate_enqueue_and_set_args, "_tapegrad_memo", False)
    device = tg.default_device()
    program = cl.Program(device.context, """
        __kernel void scale(__global float* out, __global const float* x, const float by) {
          out[get_global_id(0)] = x[get_global_id(0)] * by;
        }""").build(devices=[device.cl_device])
    types = (None, None, np.dtype(np.float32))
    made = [invoker.generate_enqueue_and_set_args("scale", 3, 3, types, False, False,
                                                  [device.cl_device]) for _ in range(2)]
    assert made[0] is made[1]
    first, second = cl.Kernel(program, "scale"), cl.Kernel(program, "scale")
    first.set_scalar_arg_dtypes(list(types))
    second.set_scalar_arg_dtypes(list(types))
    queue = cl.CommandQueue(device.context, device.cl_device)
    x = np.arange(4, dtype=np.float32)
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
    src = cl.Buffer(device.context, flags, hostbuf=x)
    outs = [np.empty(4, np.float32) for _ in range(2)]
    for kernel, by, out in ((first, 2.0, outs[0]), (second, 3.0, outs[1])):
        buf = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, 16)
        kernel.set_args(buf, src, by)
        cl.enqueue_nd_range_kernel(queue, kernel, (4,), None)
        cl.enqueue_copy(queue, out, buf)
    queue.finish()
    np.testing.assert_array_equal(outs[0], x * 2)
    np.testing.assert_array_equal(outs[1], x * 3)
