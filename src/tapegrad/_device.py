"""OpenCL devices, their queues, memory pools and the program cache.

Invariants:
- A `Device` owns one context and one in-order queue. Every kernel and copy of that device goes
  through that queue, so a pooled buffer freed by Python can be handed to a later kernel safely:
  the kernels that still read it were enqueued first and finish first.
- Programs are built once per (family, variant) and device; kernels are taken from them once and
  kept. `Device.builds` counts program builds, so tests can show nothing is rebuilt per call.
  pyopencl keeps built binaries on disk across runs.
- Threads may share a device: `Device.lock` (re-entrant) guards what they share, the program
  cache, the pool, and a kernel object between its `set_args` and its enqueue.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pyopencl as cl
import pyopencl.tools as cl_tools

from ._errors import DeviceError, at_site

_INSTALL_HINT = (
    'install a CPU OpenCL device with `pip install "pyopencl[pocl]"`, '
    "or a GPU vendor's OpenCL driver"
)

# Kernel families whose programs join one program per float dtype ("core"): a program build
# costs 0.3-1 s on PoCL whatever its size, so one build instead of one per family is most of a
# cold start. A family registers `source(dtype) -> str`; dtype-free families (copies, casts)
# join the float32 program. Families not registered here (custom ops, take) keep their own.
_FAMILY_SOURCES: dict[str, Callable[[np.dtype[Any]], str]] = {}
_STRIP = re.compile(r"^(typedef \w+ T\d*;|#pragma OPENCL EXTENSION cl_khr_fp64 : enable)\s*$",
                    re.MULTILINE)


def register_family(name: str, source: Callable[[np.dtype[Any]], str]) -> None:
    _FAMILY_SOURCES[name] = source


def core_source(dtype: np.dtype[Any]) -> str:
    """Every registered family's kernels for `dtype`, under one shared prelude."""
    t = {"float32": "float", "float64": "double"}[str(dtype)]
    pragma = "#ifdef cl_khr_fp64\n#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n#endif\n"
    head = pragma + "".join(f"typedef {t}{w} T{w};\n" for w in ("", "2", "4", "8"))
    return head + "".join(_STRIP.sub("", source(dtype)) for source in _FAMILY_SOURCES.values())


# Work-group size for 1-D launches. PoCL compiles a work-group function per (kernel, local
# size), so a fixed local size means one compile per kernel instead of one per tensor size.
LOCAL = 64


class Device:
    """One OpenCL device; made by `devices()`, used through `Tape(device=...)`."""

    def __init__(self, platform_index: int, device_index: int, cl_device: cl.Device) -> None:
        self.platform_index = platform_index
        self.device_index = device_index
        self.cl_device = cl_device
        self.name: str = cl_device.name.strip()
        self.platform_name: str = cl_device.platform.name.strip()
        self.is_gpu = bool(cl_device.type & cl.device_type.GPU)
        self.has_fp64 = bool(cl_device.double_fp_config)
        self.max_alloc: int = int(cl_device.max_mem_alloc_size)
        self._context: cl.Context | None = None
        self._queue: cl.CommandQueue | None = None
        self._pool: cl_tools.MemoryPool | None = None
        self._programs: dict[tuple[str, str], cl.Program] = {}
        self._kernels: dict[tuple[str, str, str], cl.Kernel] = {}
        # Hot paths key kernels by cheap tuples (no string formatting per launch).
        self.launch_cache: dict[tuple[Any, ...], cl.Kernel] = {}
        self._typed: set[cl.Kernel] = set()
        # Generated kernels of fused elementwise DAGs, and how often each structure was seen
        # (`_fusion`).
        self.fused: dict[Any, cl.Kernel] = {}
        self.fused_seen: dict[Any, int] = {}
        self.builds = 0
        self._peak = 0
        self._host_copies = 0  # bytes of live `upload` buffers (outside the pool)
        self.lock = threading.RLock()

    @property
    def kind(self) -> str:
        return "gpu" if self.is_gpu else "cpu"

    def __repr__(self) -> str:
        return (
            f"Device('{self.platform_index}:{self.device_index}', {self.kind}, "
            f"{self.name!r} on {self.platform_name!r})"
        )

    @property
    def context(self) -> cl.Context:
        if self._context is None:
            with self.lock:
                if self._context is None:
                    self._context = cl.Context([self.cl_device])
        return self._context

    @property
    def queue(self) -> cl.CommandQueue:
        if self._queue is None:
            with self.lock:
                if self._queue is None:
                    self._queue = cl.CommandQueue(self.context)
        return self._queue

    def allocate(self, nbytes: int) -> Any:
        """A pooled device buffer of at least `nbytes` (at least one byte: OpenCL has no empty)."""
        if nbytes >= self.max_alloc:  # `check_size`'s test, without its call: run per op
            self.check_size(nbytes)  # raises
        with self.lock:
            pool = self._pool
            if pool is None:
                # ImmediateAllocator forces every new buffer into being with an extra device
                # command (~150 us per fresh buffer on PoCL, paid on every op of a first step);
                # the deferred one only creates it. The price, which pyopencl warns about, is
                # that running out of device memory can surface when a kernel first uses the
                # buffer rather than here: this still refuses single buffers over the device's
                # limit up front, with a DeviceError.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    pool = self._pool = cl_tools.MemoryPool(
                        cl_tools.DeferredAllocator(self.context))
            try:
                buffer = pool.allocate(nbytes if nbytes > 8 else 8)
            except cl.Error as err:
                raise DeviceError(
                    f"allocating {nbytes:,} bytes on {self.name} failed: {err}") from err
            # `_note_peak` inline: this runs for every buffer an op makes.
            active = int(pool.active_bytes) + self._host_copies
            if active > self._peak:
                self._peak = active
        return buffer

    def upload(self, host: np.ndarray[Any, Any]) -> Any:
        """A new buffer holding a copy of `host` (C-contiguous, non-empty).

        Made with COPY_HOST_PTR: the driver copies while creating the buffer, and no command
        is queued. An enqueued write waits for the queue's worker: on an idle PoCL device a
        blocking write of 16 KiB took ~170 us, and the buffer made this way ~6 us. Such
        buffers are not pooled; their bytes count in `active_bytes` while they live.
        """
        self.check_size(host.nbytes)
        try:
            buffer = _HostCopy(self, host)
        except cl.Error as err:
            raise DeviceError(
                f"allocating {host.nbytes:,} bytes on {self.name} failed: {err}") from err
        with self.lock:
            self._host_copies += host.nbytes
            self._note_peak()
        return buffer

    def _note_peak(self) -> None:
        active = self.active_bytes()
        if active > self._peak:
            self._peak = active

    def check_size(self, nbytes: int) -> None:
        """DeviceError unless one buffer of `nbytes` is within the device's limit."""
        if nbytes >= self.max_alloc:  # PoCL refuses a buffer of exactly its stated maximum
            raise DeviceError(
                f"cannot allocate {nbytes:,} bytes on {self.name}: the device allows less than "
                f"{self.max_alloc:,} bytes in one buffer"
            )

    def active_bytes(self) -> int:
        """Bytes of device buffers that live tensors hold now (pool blocks, rounded up)."""
        pooled = 0 if self._pool is None else int(self._pool.active_bytes)
        return pooled + self._host_copies

    def peak_bytes(self) -> int:
        """The most `active_bytes` has been since `reset_peak()`."""
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.active_bytes()

    def kernel(
        self, family: str, variant: str, name: str, source: Callable[[], str],
        arg_types: Sequence[Any] | None = None,
    ) -> cl.Kernel:
        """The kernel `name` from the program of (family, variant), built once from `source`.

        `arg_types` gives a numpy dtype per scalar argument (None for buffers). Set once here,
        it lets launches pass plain Python numbers: pyopencl converts numpy scalars an order of
        magnitude more slowly (about 25 us against 2 us per launch on PoCL).
        """
        key = (family, variant, name)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self.lock:
            return self._kernel(key, family, variant, name, source, arg_types)

    def _kernel(
        self, key: tuple[str, str, str], family: str, variant: str, name: str,
        source: Callable[[], str], arg_types: Sequence[Any] | None,
    ) -> cl.Kernel:
        found = self._kernels.get(key)  # another thread may have made it meanwhile
        if found is not None:
            return found
        program_key = (family, variant)
        if family in _FAMILY_SOURCES and variant in ("float32", "float64", "all"):
            core = "float32" if variant == "all" else variant
            program_key = ("core", core)
            source = lambda: core_source(np.dtype(core))  # noqa: E731
        program = self._programs.get(program_key)
        if program is None:
            program = self._build(*program_key, source())
            self._programs[program_key] = program
        kernel = cl.Kernel(program, name)
        if arg_types is not None:
            kernel.set_scalar_arg_dtypes(list(arg_types))  # pyright: ignore[reportUnknownMemberType]
            self._typed.add(kernel)
        self._kernels[key] = kernel
        return kernel

    def _build(self, family: str, variant: str, src: str) -> cl.Program:
        self.builds += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = cl.Program(self.context, src).build()
        except cl.Error as err:
            raise DeviceError(
                f"OpenCL program {family}[{variant}] failed to build on {self.name}:\n{err}"
            ) from err
        # PoCL (LLVM 14) has reported success for a program with no kernels in it (a core
        # calling isnan and exp on double8): say so here, not as a missing kernel later.
        if "__kernel" in src and not program.get_info(cl.program_info.NUM_KERNELS):
            raise DeviceError(
                f"OpenCL program {family}[{variant}] built on {self.name} without its kernels "
                "(the compiler reported success)")
        return program

    def launch(self, kernel: cl.Kernel, size: tuple[int, ...], local: tuple[int, ...],
               *args: Any) -> None:
        """Set arguments and enqueue. A kernel made without `arg_types` takes its scalar types
        from the numpy scalars of its first launch, so later launches avoid pyopencl's slow
        untyped conversion."""
        with self.lock:
            if kernel not in self._typed:
                types: list[Any] = [
                    cast(np.generic, a).dtype if isinstance(a, np.generic) else None for a in args]
                kernel.set_scalar_arg_dtypes(types)  # pyright: ignore[reportUnknownMemberType]
                self._typed.add(kernel)
            kernel.set_args(*args)
            cl.enqueue_nd_range_kernel(self.queue, kernel, size, local)

    def finish(self) -> None:
        """Wait for every enqueued kernel and copy of this device."""
        self.queue.finish()


_HOST_COPY = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR


class _HostCopy(cl.Buffer):
    """A buffer made from host data (`Device.upload`); gives its bytes back to the device's
    count when it dies."""

    def __init__(self, device: Device, host: np.ndarray[Any, Any]) -> None:
        super().__init__(device.context, _HOST_COPY, hostbuf=host)
        self._device = device

    def __del__(self) -> None:
        with self._device.lock:  # a read-modify-write, and uploads add under the lock
            self._device._host_copies -= self.size  # pyright: ignore[reportPrivateUsage]


_devices: list[Device] | None = None
_default: Device | None = None


def devices() -> list[Device]:
    """Every OpenCL device of every platform, in platform order."""
    global _devices
    if _devices is None:
        try:
            platforms = cl.get_platforms()
        except cl.Error as err:
            raise DeviceError(f"no OpenCL platform found ({err}); {_INSTALL_HINT}") from err
        found: list[Device] = []
        for p_index, platform in enumerate(platforms):
            try:
                cl_devices = platform.get_devices()
            except cl.Error:
                continue
            for d_index, cl_device in enumerate(cl_devices):
                found.append(Device(p_index, d_index, cl_device))
        if not found:
            raise DeviceError(f"no OpenCL device found; {_INSTALL_HINT}")
        _devices = found
    return list(_devices)


def get_device(spec: Device | str | None = None, op: str = "") -> Device:
    """Resolve a device: a `Device`, 'cpu', 'gpu', 'P:D', or None for the default. Errors name
    `op`, the call that was given `spec` (Tape, AnyTensor...)."""
    if isinstance(spec, Device):
        return spec
    if spec is None:
        return default_device()
    try:
        return _resolve(spec)
    except DeviceError as err:
        if not op:
            raise
        raise DeviceError(f"{op}: {err}") from None


def _resolve(spec: object) -> Device:
    if not isinstance(spec, str):
        raise DeviceError(at_site(
            f"device must be a Device, a string or None, not {type(spec).__name__}"))
    all_devices = devices()
    text = spec.strip().lower()
    if text in ("cpu", "gpu"):
        for dev in all_devices:
            if dev.kind == text:
                return dev
        raise DeviceError(at_site(
            f"no {text} OpenCL device; available: {', '.join(map(repr, all_devices))}"))
    parts = text.split(":")
    if len(parts) == 2 and all(part.isdigit() for part in parts):
        p_index, d_index = int(parts[0]), int(parts[1])
        for dev in all_devices:
            if (dev.platform_index, dev.device_index) == (p_index, d_index):
                return dev
        raise DeviceError(at_site(
            f"no OpenCL device {spec!r}; available: {', '.join(map(repr, all_devices))}"))
    raise DeviceError(at_site(
        f"unknown device {spec!r}: use 'cpu', 'gpu', 'P:D' (platform:device) or a Device "
        "from tg.devices()"))


def default_device() -> Device:
    """`TAPEGRAD_DEVICE` if set, else the first GPU, else the first CPU device."""
    global _default
    if _default is None:
        env = os.environ.get("TAPEGRAD_DEVICE")
        if env:
            _default = get_device(env)
        else:
            all_devices = devices()
            gpus = [dev for dev in all_devices if dev.is_gpu]
            _default = gpus[0] if gpus else all_devices[0]
    return _default


def fp64_pragma(dtype: np.dtype[Any]) -> str:
    return "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" if dtype == np.float64 else ""
