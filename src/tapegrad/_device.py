"""OpenCL devices, their queues, memory pools and the program cache.

Invariants:
- A `Device` owns one context and one in-order queue. Every kernel and copy of that device goes
  through that queue, so a pooled buffer freed by Python can be handed to a later kernel safely:
  the kernels that still read it were enqueued first and finish first.
- A PoCL CPU device may also have an inline lane (see INLINE_BYTES): PoCL's single-threaded
  "basic" driver in the same context, which runs a kernel inside its enqueue, on the calling
  thread. A small launch takes it only while the queue is idle (nothing enqueued since its
  last finish, or its last launch complete), so the two lanes keep the queue's one order.
- Programs are built once per (family, variant) and device; kernels are taken from them once and
  kept. `Device.builds` counts program builds (`inline_builds` the inline lane's), so tests
  can show nothing is rebuilt per call.
  pyopencl keeps built binaries on disk across runs.
- Threads may share a device: `Device.lock` (re-entrant) guards what they share, the program
  cache, the pool, and a kernel object between its `set_args` and its enqueue.
- tapegrad's own programs build with an empty log (tests/test_quiet_builds.py): PoCL's clang
  prints "N warnings generated." to stderr itself, so a warning is noise on every cold start.
  Build logs reach the user only in the DeviceError of a failed build.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Generator, Sequence
from contextvars import ContextVar
from platform import machine
from time import perf_counter
from typing import Any, Protocol, cast

import numpy as np
import pyopencl as cl
import pyopencl.tools as cl_tools

from ._compile_ahead import (
    SMALL_GRID,
    CompileAhead,
    pocl_cache_empty,
    pocl_cache_stamp,
)
from ._compile_ahead import wanted as compile_ahead_wanted
from ._errors import DeviceError, at_site
from ._pocl import build_option, name_host_cpu, share_builds
from ._traced import plain

# Build options of programs holding user-supplied OpenCL C (`tg.elementwise_op`). A warning in
# a build that succeeds would reach the user only as clang's bare "1 warning generated." on
# stderr (its text is in the log, which is shown with errors only), so it is not asked for;
# errors still fail the build with their log. tapegrad's own programs take no -w: tests keep
# their logs empty, and -w would hide a new warning from those tests.
USER_SOURCE_OPTIONS = ("-w",)

# PoCL's threaded CPU driver hands each launch to worker threads, a hand-over that costs a
# small kernel several times its run; its single-threaded "basic" driver runs a kernel on the
# calling thread (docs/BENCHMARKS.md, session 28). PoCL lists the basic driver only when
# POCL_DEVICES asks for it, read once when it starts: asked for here, before any platform is
# queried, unless the user chose POCL_DEVICES or TAPEGRAD_INLINE=0. The basic device is not
# listed as a device of its own; it is the inline lane of the threaded one (`_find_devices`).
# The variable is marked as tapegrad's, so that a child process (which inherits it) with
# TAPEGRAD_INLINE=0 takes it back rather than list the basic device as a device of its own.
INLINE = os.environ.get("TAPEGRAD_INLINE", "1").strip() != "0"
_MARK = "TAPEGRAD_SET_POCL_DEVICES"
if INLINE and "POCL_DEVICES" not in os.environ:
    os.environ["POCL_DEVICES"] = "pthread basic"
    os.environ[_MARK] = "1"
elif not INLINE and os.environ.get(_MARK) == "1":
    os.environ.pop("POCL_DEVICES", None)
    os.environ.pop(_MARK, None)

# A launch whose buffers each hold at most this many bytes runs on the inline lane: its kernel
# costs less on one core than the hand-over to two, or little more (an elementwise op over 32k
# floats, a product of 181x181 matrices at most). An LSTM of width 64 (its recurrent weight
# 64 KiB) has all its launches under it.
INLINE_BYTES = 128 << 10

# Where the lane's builds are its own (a PoCL whose cache `_pocl.share_builds` cannot make
# the two drivers share), each compiles again (seconds, with empty caches), so the lane starts
# once a run is steady: after this many small launches (eager, or in replayed programs) with
# no new kernel among them, built on a thread of its own. A short run, or a model of large
# kernels, never pays for it, and a first step or a first jitted call, which make new
# kernels and compile them under PoCL's one compiler lock, do not wait for it.
INLINE_AFTER = 512

# Where the lane's builds read the queue's from PoCL's cache (`_pocl.share_builds`), the lane
# builds each program on a thread as soon as the queue has, a read of what the queue's build
# wrote, and is ready from its first such build: no wait for INLINE_AFTER, and a launch takes
# it once the queue ran the same kernel at the same sizes (`Device._ran`), whose compiled
# work-group function the lane then runs as well.
INLINE_AT_ONCE = True

# The longest the device waits for the compile-ahead helper's build of a program it needs.
AHEAD_BUILD_SECONDS = 30.0

# With the compile-ahead helper running (caches cold), a program built for the lane is taken
# once the helper has compiled its small launches' kernels for the lane, or after this long.
LANE_WARM_SECONDS = 60.0


def _invokers_in_memory() -> None:
    """Keep pyopencl's generated kernel invokers in memory. pyopencl makes one for every
    kernel object from its disk cache (sqlite, with no cache in memory), and tg.jit's programs
    make a kernel object per launch (two for a small one: its twin on the inline lane), so a
    recording of a sweep or a step paid for them many times over (BENCHMARKS, session 37).
    Keyed by everything pyopencl keys them by, and the devices."""
    try:
        invoker: Any = importlib.import_module("pyopencl.invoker")
    except ImportError:
        return
    made = getattr(invoker, "generate_enqueue_and_set_args", None)
    if made is None or getattr(made, "_tapegrad_memo", False):
        return
    memo: dict[Any, Any] = {}

    def generate(function_name: Any, num_passed_args: Any, num_cl_args: Any, arg_types: Any,
                 work_around_arg_count_bug: Any, warn_about_arg_count_bug: Any, devs: Any
                 ) -> Any:
        key = (function_name, num_passed_args, num_cl_args,
               None if arg_types is None else tuple(arg_types), work_around_arg_count_bug,
               warn_about_arg_count_bug, tuple(devs))
        found = memo.get(key)
        if found is None:
            found = memo[key] = made(function_name, num_passed_args, num_cl_args, arg_types,
                                     work_around_arg_count_bug, warn_about_arg_count_bug, devs)
        return found

    generate._tapegrad_memo = True  # type: ignore[attr-defined]
    invoker.generate_enqueue_and_set_args = generate


_invokers_in_memory()


class Observer(Protocol):
    """Sees the device work of one thread (`observing`): `tg.jit` records a step this way."""

    def launched(self, device: Device, kernel: cl.Kernel, types: list[Any],
                 size: tuple[int, ...], local: tuple[int, ...], args: tuple[Any, ...],
                 largest: int | None) -> None: ...

    def uploaded(self, device: Device, host: np.ndarray[Any, Any], buffer: Any) -> None: ...

    def allocated(self, buffer: Any) -> None: ...


_observer: ContextVar[Observer | None] = ContextVar("tapegrad_observer", default=None)
_OBSERVER_GET = _observer.get


@contextlib.contextmanager
def observing(observer: Observer) -> Generator[None]:
    """Within the block, this thread's launches and uploads are also told to `observer`."""
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


def observed() -> bool:
    """Whether this thread's launches are being observed (a tg.jit recording)."""
    return _OBSERVER_GET() is not None


def current_observer() -> Observer | None:
    """The observer of this thread's launches (a tg.jit recording), if any."""
    return _OBSERVER_GET()


# Kernel families whose programs join two programs per float dtype ("core", `core_group`): a
# program build costs 0.3-1 s on PoCL whatever its size, so two builds instead of one per
# family are most of a cold start. A family registers `source(dtype) -> str`; dtype-free
# families (copies, casts) join the float32 programs. Families not registered here (custom
# ops, take) keep their own.
_FAMILY_SOURCES: dict[str, Callable[[np.dtype[Any]], str]] = {}
_STRIP = re.compile(r"^(typedef \w+ T\d*;|#pragma OPENCL EXTENSION cl_khr_fp64 : enable)\s*$",
                    re.MULTILINE)


# For a program whose double kernels are optional (inside #ifdef cl_khr_fp64): the extension
# enabled where the device has it, so the same source builds on a device without it.
FP64_IF_AVAILABLE = "#ifdef cl_khr_fp64\n#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n#endif\n"


def register_family(name: str, source: Callable[[np.dtype[Any]], str]) -> None:
    _FAMILY_SOURCES[name] = source


def core_source(dtype: np.dtype[Any], families: Sequence[str] | None = None) -> str:
    """The registered families' kernels for `dtype` (all of them by default), under one
    shared prelude."""
    t = {"float32": "float", "float64": "double"}[str(dtype)]
    head = FP64_IF_AVAILABLE + "".join(f"typedef {t}{w} T{w};\n" for w in ("", "2", "4", "8"))
    names = _FAMILY_SOURCES if families is None else families
    return head + "".join(_STRIP.sub("", _FAMILY_SOURCES[name](dtype)) for name in names)


# The core is two programs of about the same build time (the elementwise ops, casts, copies
# and dropout; the rest): with empty caches, the compile-ahead helper builds one while the
# device builds the other (`Device._before_build`). Warm, each is read from the cache.
CORE_GROUPS = ("core0", "core1")
_CORE0 = frozenset({"elementwise", "cast", "copy", "dropout"})


def core_group(family: str) -> str:
    """The core program (CORE_GROUPS) that holds a registered family's kernels."""
    return CORE_GROUPS[0] if family in _CORE0 else CORE_GROUPS[1]


def core_group_source(dtype: np.dtype[Any], group: str) -> str:
    """The kernels of core program `group` for `dtype`."""
    return core_source(dtype, [f for f in _FAMILY_SOURCES if core_group(f) == group])


# On a CPU device a launch onto an idle queue wakes PoCL's worker threads, which take the cores
# from the Python thread (a launch into a busy queue costs it a fraction of that: BENCHMARKS,
# session 19): small launches are held and enqueued together, waking the workers once. A launch
# with a larger buffer (one that may run long), a host read, `finish` and every other use of
# the queue enqueue the held ones first, in order; so do the DEFER_LAUNCHES-th held launch and
# one made DEFER_SECONDS after the first held. GPUs take every launch at once.
DEFER_BYTES = 128 << 10
DEFER_LAUNCHES = 64
DEFER_SECONDS = 1e-3

# Work-group size for 1-D launches. PoCL compiles a work-group function per (kernel, local
# size), so a fixed local size means one compile per kernel instead of one per tensor size.
LOCAL = 64


# A launch prepared for `Device.run_launches`: the queue's kernel, global and local sizes, the
# arguments set per run (argument index, index into the run's values), and the inline lane's
# kernel with the same arguments set (None: the launch always takes the queue).
PreparedLaunch = tuple[cl.Kernel, tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...],
                       "cl.Kernel | None"]
_COMPLETE = cl.command_execution_status.COMPLETE


def _largest(args: Sequence[Any], pointers: tuple[int, ...]) -> int:
    """The bytes of the largest buffer among a launch's arguments (at `pointers`, the kernel's
    pointer parameters: an isinstance test of each argument cost more than the rest of a
    launch). Each size is a driver query (~0.3 us): a launch asks once, for both its tests.
    A loop, not max() over a generator: this runs for every launch."""
    most = 0
    for i in pointers:
        a = args[i]
        if a is not None:
            size = a.size
            if size > most:
                most = size
    return most


def _touches_little(args: Sequence[Any], pointers: tuple[int, ...],
                    limit: int = DEFER_BYTES, largest: int | None = None) -> bool:
    """Whether every buffer among a launch's arguments holds at most `limit` bytes: by
    `largest` where given (`_largest`'s, or the most bytes any of them holds as data where the
    caller knows it: an optimizer's 56 buffers; the pool rounds a buffer up, so at the limit
    the two may differ: a choice of lane, the same bits either way)."""
    return (_largest(args, pointers) if largest is None else largest) <= limit


class Device:
    """One OpenCL device; made by `devices()`, used through `Tape(device=...)`."""

    def __init__(self, platform_index: int, device_index: int, cl_device: cl.Device,
                 inline: cl.Device | None = None, shared: bool = False) -> None:
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
        # Each program's kernels' argument types, read from its source (`signatures`).
        self._signatures: dict[tuple[str, str], dict[str, list[Any]]] = {}
        # Each program's source and options, for the inline lane's build and the helper's.
        self._sources: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self._kernels: dict[tuple[str, str, str], cl.Kernel] = {}
        # Dtypes whose core program failed to build: their families are built one by one.
        self._core_broken: set[str] = set()
        # Hot paths key kernels by cheap tuples (no string formatting per launch).
        self.launch_cache: dict[tuple[Any, ...], cl.Kernel] = {}
        # Each kernel's scalar argument types (None for a buffer), set once on the kernel.
        self._typed: dict[cl.Kernel, list[Any]] = {}
        self._pointers: dict[cl.Kernel, tuple[int, ...]] = {}  # its pointer parameters
        self.builds = 0
        self.inline_builds = 0  # the inline lane's builds of programs built for the queue
        self._peak = 0
        self._host_copies = 0  # bytes of live `upload` buffers (outside the pool)
        self.lock = threading.RLock()
        # Launches held back (see DEFER_BYTES): kernel, sizes and arguments, set when enqueued.
        self._held: list[tuple[cl.Kernel, tuple[int, ...], tuple[int, ...], tuple[Any, ...]]] = []
        self._held_since = 0.0
        self._defers = not self.is_gpu
        # The inline lane (see INLINE_BYTES, INLINE_AFTER): its device and queue; the small
        # launches seen while it waits; its own build of each program (None while building or
        # where one failed), made on a thread; `inline_generation` counts those built, for a
        # replayed program to take their kernels; a kernel's twin, by the queue's kernel.
        self.inline_device = inline
        self._inline_queue: cl.CommandQueue | None = None
        self.small_launches = 0
        self.inline_ready = False
        self.inline_generation = 0
        self._inline_programs: dict[tuple[str, str], cl.Program | None] = {}
        self._inline_builders: list[threading.Thread] = []
        # Whether the lane's builds are the queue's (`_pocl.share_builds`, INLINE_AT_ONCE);
        # then the launches (kernel, local size, grid under PoCL's bound) the queue ran, whose
        # compiled work-group functions the lane may run.
        self.lane_shares_builds = shared
        self._ran: set[tuple[cl.Kernel, tuple[int, ...], bool]] = set()
        self._twins: dict[cl.Kernel, cl.Kernel] = {}
        self._origin: dict[cl.Kernel, tuple[str, str]] = {}  # a kernel's program's key
        # The helper compiling kernels ahead while caches are cold (`_compile_ahead`).
        self._ahead: CompileAhead | None = None
        self._ahead_failed = False  # its process could not be started
        # Whether the queue may hold work not yet finished (a launch or a copy since the
        # last finish), and its last launch's event where that is all it may hold; a count
        # of the times it was taken, so that a finish clears the flag only if no other thread
        # enqueued meanwhile.
        self._threaded = False
        self._last_event: cl.Event | None = None
        self._taken = 0

    @functools.cached_property
    def native_floats(self) -> int:
        """Floats in one of the device's native vectors (16 on a CPU with AVX-512)."""
        return int(self.cl_device.native_vector_width_float)

    @functools.cached_property
    def wide_lanes(self) -> bool:
        """Whether heavy elementwise kernels run 16 lanes at a time (TG_WIDE): a CPU whose
        vectors hold 16 floats, where PoCL's library computes exp, tanh... on 16 lanes in
        about the time of 8."""
        return not self.is_gpu and self.native_floats >= 16

    @functools.cached_property
    def build_options(self) -> tuple[str, ...]:
        """The options every program of this device is built with (`_pocl.build_option`: the
        CPU tapegrad named for PoCL, where it did)."""
        return (*self.exact_options, *(("-D", "TG_WIDE=1") if self.wide_lanes else ()),
                *build_option(self.cl_device))

    @functools.cached_property
    def exact_options(self) -> tuple[str, ...]:
        """Build options every program takes. OpenCL lets float32 `/` and sqrt be off by
        2.5-3 ulp unless a program asks for them rounded correctly, and NVIDIA's driver takes
        that licence; where the device can, every program asks, as CUDA does by default."""
        exact = int(cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT)
        if int(self.cl_device.single_fp_config) & exact:
            return ("-cl-fp32-correctly-rounded-divide-sqrt",)
        return ()

    @functools.cached_property
    def compute_units(self) -> int:
        """The device's compute units (a CPU's cores)."""
        return int(self.cl_device.max_compute_units)

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
                    lanes = [self.cl_device] if self.inline_device is None else [
                        self.cl_device, self.inline_device]
                    self._context = cl.Context(lanes)
                    # PoCL's cache empty: every build will compile. The helper starts now,
                    # to be ready (its own PoCL started) by the first build.
                    if self._may_compile_ahead() and pocl_cache_empty():
                        self._start_ahead()
        return self._context

    @property
    def queue(self) -> cl.CommandQueue:
        """The device's in-order queue, with every held launch enqueued on it. Its user may
        enqueue anything on it: until its next finish, no launch takes the inline lane."""
        with self.lock:
            if self._held:
                self._release()
            self._enqueued(None)
            return self._own_queue()

    def _own_queue(self) -> cl.CommandQueue:
        if self._queue is None:
            with self.lock:
                if self._queue is None:
                    self._queue = cl.CommandQueue(self.context)
        return self._queue

    def _release(self) -> None:
        """Enqueue the held launches, in order (under `lock`). Each leaves the list only once
        enqueued: another thread's `queue` that finds it empty has nothing of its own still to
        enqueue, and an interrupt (Ctrl-C) leaves the rest held, to run at the next release.
        A launch that fails is dropped and its error raised here, a DeviceError naming it.
        While the queue is idle, those with an inline twin run on the lane (all are small)."""
        queue = self._own_queue()
        enqueue = cl.enqueue_nd_range_kernel
        held = self._held
        done = 0
        inline = self.inline_ready and self.queue_idle()
        try:
            shared = self.lane_shares_builds
            for kernel, size, local, args in held:
                twin = self._twins.get(kernel) if inline else None
                ran = (kernel, local, max(size) < SMALL_GRID) if shared else None
                if twin is not None and (ran is None or ran in self._ran):
                    twin.set_args(*args)
                    enqueue(self._own_inline_queue(), twin, size, local)
                else:
                    inline = False
                    kernel.set_args(*args)
                    self._enqueued(enqueue(queue, kernel, size, local))
                    if ran is not None:
                        self._ran.add(ran)
                done += 1
        except Exception as err:
            name = held[done][0].function_name
            done += 1  # it cannot run: dropped, and said
            raise DeviceError(
                f"kernel {name} failed when enqueued on {self.name} (launches are held and "
                f"enqueued together, so this surfaced at a later op or read): {err}") from err
        finally:
            del held[:done]

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
        observer = _OBSERVER_GET()
        if observer is not None:
            observer.allocated(buffer)
        return buffer

    def allocate_many(self, sizes: Sequence[int]) -> list[Any]:
        """`allocate` of each of `sizes` (bytes, each a size already allocated on this device:
        a replayed program's outputs, an optimizer's copies of its parameters), under one hold
        of the lock and one peak check: a replayed sweep makes hundreds."""
        with self.lock:
            pool = self._pool
            if pool is None:
                return [self.allocate(n) for n in sizes]
            take = pool.allocate
            try:
                buffers = [take(n if n > 8 else 8) for n in sizes]
            except cl.Error as err:
                raise DeviceError(
                    f"allocating {sum(sizes):,} bytes on {self.name} failed: {err}") from err
            self._note_peak()
        observer = _OBSERVER_GET()
        if observer is not None:
            for buffer in buffers:
                observer.allocated(buffer)
        return buffers

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
        observer = _OBSERVER_GET()
        if observer is not None:
            observer.uploaded(self, host, buffer)
        return buffer

    def copy(self, dst: Any, src: Any, nbytes: int) -> None:
        """Copy `nbytes` of buffer `src` into `dst` on the queue, after what is enqueued
        before it: the driver's copy, no kernel (none to compile)."""
        cl.enqueue_copy(self.queue, dst, src, byte_count=nbytes)

    def download(self, out: np.ndarray[Any, Any], buffer: Any) -> None:
        """Copy a buffer into the host array `out`, waiting for the kernels that write it.
        With the queue idle, the inline lane copies, on this thread: no worker to wake."""
        with self.lock:
            if self.inline_device is not None and not self._held and self.queue_idle():
                cl.enqueue_copy(self._own_inline_queue(), out, buffer, is_blocking=True)
                return
            queue, taken = self.queue, self._taken
        cl.enqueue_copy(queue, out, buffer, is_blocking=True)
        self._finished(taken)  # a blocking read on an in-order queue: all before it is done

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
        arg_types: Sequence[Any] | None = None, options: Sequence[str] = (),
    ) -> cl.Kernel:
        """The kernel `name` from the program of (family, variant), built once from `source`
        with build `options` (`USER_SOURCE_OPTIONS` for users' OpenCL C).

        The kernel's argument types (a numpy dtype per scalar, None for a pointer) are read
        from its C signature in the program's source (`signatures`); `arg_types` states them
        instead for a kernel whose signature is not plain C (a macro in its parameter list).
        Set once on the kernel, they let launches pass plain Python numbers, which pyopencl
        converts an order of magnitude faster than numpy scalars.
        """
        key = (family, variant, name)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self.lock:
            return self._kernel(key, family, variant, name, source, arg_types, options)

    def _kernel(
        self, key: tuple[str, str, str], family: str, variant: str, name: str,
        source: Callable[[], str], arg_types: Sequence[Any] | None, options: Sequence[str],
    ) -> cl.Kernel:
        found = self._kernels.get(key)  # another thread may have made it meanwhile
        if found is not None:
            return found
        program_key = (family, variant)
        if family in _FAMILY_SOURCES and variant in ("float32", "float64", "all"):
            core = "float32" if variant == "all" else variant
            if core in self._core_broken:
                program_key = (family, core)
                source = lambda: core_source(np.dtype(core), [family])  # noqa: E731
            else:
                group = core_group(family)
                program_key = (group, core)
                source = lambda: core_group_source(np.dtype(core), group)  # noqa: E731
        program = self._programs.get(program_key)
        if program is None:
            text = source()
            self._before_build(program_key, options)
            # Whether this build compiled (caches cold): where a helper could start.
            ahead = not self._ahead_running() and self._may_compile_ahead()
            stamp = pocl_cache_stamp() if ahead else None
            try:
                program = self._build(*program_key, text, options)
            except DeviceError:
                if program_key[0] not in CORE_GROUPS:
                    raise
                # One family broke the shared program: build each family on its own from now
                # on, so the error names that family and the others still work.
                self._core_broken.add(program_key[1])
                return self._kernel(key, family, variant, name, source, arg_types, options)
            self._programs[program_key] = program
            self._signatures[program_key] = signatures(text)
            self._sources[program_key] = (text, tuple(options))
            compiled = stamp is not None and pocl_cache_stamp() != stamp
            self._tell_ahead(program_key, ahead and compiled)
            if self.lane_shares_builds and INLINE_AT_ONCE:
                self._build_inline([program_key], first=True)
        kernel = cl.Kernel(program, name)
        types = (list(arg_types) if arg_types is not None
                 else self._signatures[program_key].get(name))
        if types is None:
            raise DeviceError(
                f"kernel {name}: no argument types (its C signature could not be read; give "
                "arg_types to Device.kernel)")
        kernel.set_scalar_arg_dtypes(types)
        self._typed[kernel] = types
        self._pointers[kernel] = tuple(i for i, t in enumerate(types) if t is None)
        self._kernels[key] = kernel
        self._origin[kernel] = program_key
        if self.inline_device is not None:
            self.small_launches = 0  # not steady yet (INLINE_AFTER)
        return kernel

    def _lane_built(self, program_key: tuple[str, str], program: cl.Program) -> None:
        """The lane's build of a program made (under `lock`): its kernels' twins may take it."""
        self._inline_programs[program_key] = program
        self.inline_builds += 1
        self.inline_generation += 1

    def _before_build(self, program_key: tuple[str, str], options: Sequence[str]) -> None:
        """Before the device builds a program (under `lock`), where a compile-ahead helper
        runs (caches cold): at the first build of a core program, the helper is asked to
        build the dtype's other one meanwhile; the helper's build of this one, if under way,
        is waited for (this build then reads it from the cache), or else taken back."""
        ahead = self._ahead
        if ahead is None or not ahead.alive:
            return
        if program_key[0] in CORE_GROUPS:
            dtype = program_key[1]
            for group in CORE_GROUPS:
                other = (group, dtype)
                if other != program_key and other not in self._programs:
                    ahead.build(other, lambda g=group: core_group_source(np.dtype(dtype), g),
                                options)
        ahead.await_build(program_key, options, AHEAD_BUILD_SECONDS)

    def _tell_ahead(self, program_key: tuple[str, str], compiled: bool) -> None:
        """Tell the compile-ahead helper of a program just built (under `lock`); start one at
        a build that `compiled` (added an entry to PoCL's cache) where none runs."""
        if self._ahead_running():
            assert self._ahead is not None
            self._ahead.program(program_key, *self._sources[program_key])
        elif compiled:
            self._start_ahead()

    def _ahead_running(self) -> bool:
        """Whether a compile-ahead helper runs (it leaves once idle: another may start)."""
        return self._ahead is not None and self._ahead.alive

    def _may_compile_ahead(self) -> bool:
        """Whether a helper may start for this device: PoCL's CPU device, `wanted`, and not
        one of several ranks (each would start one, on cores the ranks already share)."""
        return (not self.is_gpu and "Portable Computing Language" in self.platform_name
                and not self._ahead_failed and compile_ahead_wanted()
                and launched_size() is None)

    def _start_ahead(self) -> None:
        """Start a compile-ahead helper, told of every program built so far; if the process
        cannot be started, go on without one, for good."""
        try:
            ahead = self._ahead = CompileAhead(self.platform_index, self.device_index)
        except OSError:
            self._ahead_failed = True
            return
        for key, (text, options) in self._sources.items():
            ahead.program(key, text, options)

    def queue_idle(self) -> bool:
        """Whether the queue has nothing left to run (under `lock`): nothing enqueued since
        its last finish, or only launches, the last of them complete."""
        if not self._threaded:
            return True
        event = self._last_event
        if event is not None and event.command_execution_status == _COMPLETE:
            self._threaded, self._last_event = False, None
            return True
        return False

    def is_small(self, kernel: cl.Kernel, args: Sequence[Any], largest: int | None = None
                 ) -> bool:
        """Whether a launch of `kernel` with `args` would take the inline lane, given its twin
        (each buffer among them at most INLINE_BYTES; `largest`: see `_touches_little`)."""
        return self.inline_device is not None and _touches_little(
            args, self._pointers[kernel], INLINE_BYTES, largest)

    def inline_twin(self, kernel: cl.Kernel, args: Sequence[Any], largest: int | None = None
                    ) -> cl.Kernel | None:
        """The inline lane's kernel for a launch of `kernel` with `args` (under `lock`), or
        None where it takes the queue: a large buffer among them, no lane or not yet, or its
        program's build for the lane not made (yet: it starts here) or failed."""
        if not self.is_small(kernel, args, largest):
            return None
        if not self.inline_ready:
            self.note_small(1)
            return None
        return self.twin_of(kernel)  # its dict lookup first

    def note_small(self, count: int) -> None:
        """Count small launches since the last new kernel (under `lock`); at INLINE_AFTER,
        start building the lane."""
        if self.inline_ready or self.inline_device is None or self._inline_builders:
            return
        self.small_launches += count
        if self.small_launches >= INLINE_AFTER:
            self._build_inline(list(self._sources), first=True)

    def inline_program(self, kernel: cl.Kernel) -> cl.Program | None:
        """The inline lane's build of `kernel`'s program (under `lock`), if made; the build
        starts at the first asking."""
        program_key = self._origin.get(kernel)
        if program_key is None:
            return None
        if program_key not in self._inline_programs:
            self._build_inline([program_key])
            return None
        return self._inline_programs[program_key]

    def twin_of(self, kernel: cl.Kernel) -> cl.Kernel | None:
        """`kernel`'s twin on the ready inline lane (under `lock`), its argument types set, if
        its program's build for the lane is made (`inline_program`)."""
        twin = self._twins.get(kernel)
        if twin is not None:
            return twin
        program = self.inline_program(kernel)
        if program is None:
            return None
        twin = cl.Kernel(program, kernel.function_name)
        types = self._typed[kernel]
        twin.set_scalar_arg_dtypes(types)
        self._typed[twin] = types
        self._pointers[twin] = self._pointers[kernel]
        self._twins[kernel] = twin
        return twin

    def _build_inline(self, keys: list[tuple[str, str]], first: bool = False) -> None:
        """Build programs for the inline lane on a thread of its own (under `lock`; pyopencl
        lets go of the GIL while PoCL compiles). The first build, of every program made so
        far, makes the lane ready. A build that fails leaves its kernels on the queue."""
        lane = self.inline_device
        assert lane is not None
        for key in keys:
            self._inline_programs[key] = None
        sources = [(key, *self._sources[key]) for key in keys]

        def build() -> None:
            # No warnings.catch_warnings here: it sets the filters of every thread, and would
            # silence the user's warnings while it builds. The sources built for the queue
            # first, with the same log (tapegrad's build with none: tests/test_quiet_builds).
            for key, text, options in sources:
                try:
                    program = self.build_program(text, options, inline=True)
                except cl.Error:
                    continue
                ahead = self._ahead
                if ahead is not None and ahead.alive and not self.lane_shares_builds:
                    # compiled in the helper, not at their first launch on the lane (mid-step)
                    ahead.warm_lane(key, LANE_WARM_SECONDS)
                with self.lock:
                    self._lane_built(key, program)
            if first:
                with self.lock:
                    self.inline_ready = True
                    self.inline_generation += 1

        builder = threading.Thread(target=build, name="tapegrad inline build", daemon=True)
        # those done let go (a thread per program where the lane builds each at once)
        self._inline_builders = [b for b in self._inline_builders if b.is_alive()]
        self._inline_builders.append(builder)
        builder.start()

    def wait_for_inline_builds(self) -> None:
        """Wait for the inline lane's builds under way (tests; the interpreter's exit)."""
        for builder in list(self._inline_builders):
            builder.join()

    def build_program(self, src: str, options: Sequence[str] = (), inline: bool = False
                      ) -> cl.Program:
        """`src` built with the device's options and `options`, for the device or (`inline`)
        its inline lane where it has one; cl.Error where it fails."""
        lane = self.inline_device if inline and self.inline_device is not None else \
            self.cl_device
        return cl.Program(self.context, src).build(
            options=[*self.build_options, *options], devices=[lane])

    def _build(self, family: str, variant: str, src: str,
               options: Sequence[str] = ()) -> cl.Program:
        """Build `src`. pyopencl's CompilerWarning (a non-empty log) is silenced: a log is for
        a failed build's DeviceError, and tapegrad's own programs build with none."""
        self.builds += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = self.build_program(src, options)
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
               *args: Any, largest: int | None = None) -> None:
        """Set arguments and enqueue, on a kernel from `kernel` (its argument types set).
        `largest`: the most bytes any buffer among `args` holds as data, where the caller
        knows it (else each buffer's size is asked of the driver, once: `_largest`)."""
        with self.lock:
            observer = _OBSERVER_GET()
            # recording a jitted step: its traced numbers are set by their values
            bound = args if observer is None else tuple(plain(a) for a in args)
            if largest is None and (self.inline_device is not None or self._defers):
                largest = _largest(args, self._pointers[kernel])
            twin = (self.inline_twin(kernel, args, largest) if self.inline_device is not None
                    else None)
            # where the lane runs the queue's compiled kernels: this launch's, as `_ran` keys it
            ran = ((kernel, local, max(size) < SMALL_GRID) if self.lane_shares_builds
                   and largest is not None and largest <= INLINE_BYTES else None)
            if twin is not None and ran is not None and ran not in self._ran:
                twin = None  # its work-group function not compiled yet: the queue's
            if twin is not None and self.queue_idle() and self._held:
                self._release()  # on the lane too, unless one of them has no twin
            if twin is not None and not self._threaded:
                twin.set_args(*bound)
                cl.enqueue_nd_range_kernel(self._own_inline_queue(), twin, size, local)
            elif self._defers and largest is not None and largest <= DEFER_BYTES:
                now = perf_counter()
                held = self._held
                if not held:
                    self._held_since = now
                held.append((kernel, size, local, bound))
                if len(held) >= DEFER_LAUNCHES or now - self._held_since > DEFER_SECONDS:
                    self._release()
            else:
                if self._held:
                    self._release()
                kernel.set_args(*bound)
                self._enqueued(cl.enqueue_nd_range_kernel(self._own_queue(), kernel, size,
                                                          local))
                if ran is not None:
                    self._ran.add(ran)
            if observer is not None:
                observer.launched(self, kernel, self._typed[kernel], size, local, args,
                                  largest)
            ahead = self._ahead
            if ahead is not None and ahead.alive:
                ahead.launch(kernel, self._origin[kernel], self._typed[kernel], size, local,
                             bound, self._pointers[kernel],
                             self.is_small(kernel, args, largest))

    def finish(self) -> None:
        """Wait for every enqueued kernel and copy of this device (the inline lane's ran when
        enqueued)."""
        with self.lock:
            if not self._held and self.queue_idle():
                return  # nothing left on the queue: no worker to wake and wait for
            queue, taken = self.queue, self._taken
        queue.finish()
        self._finished(taken)

    def _enqueued(self, event: cl.Event | None) -> None:
        """Note a launch (its event) or other work (None) enqueued on the queue (under
        `lock`): it is busy until a finish or, for a launch last, that launch's completion."""
        self._threaded, self._last_event = True, event
        self._taken += 1

    def _finished(self, taken: int) -> None:
        """The queue has run what it held when it was taken `taken` times: idle, unless it was
        taken again since."""
        with self.lock:
            if self._taken == taken:
                self._threaded, self._last_event = False, None

    def _own_inline_queue(self) -> cl.CommandQueue:
        if self._inline_queue is None:
            self._inline_queue = cl.CommandQueue(self.context, self.inline_device)
        return self._inline_queue

    def run_launches(self, launches: Sequence[PreparedLaunch], values: Sequence[Any]) -> None:
        """Enqueue prepared launches (a replayed program's): each kernel's arguments are set
        but for its patches, (argument index, index into `values`). While the queue is idle,
        those with an inline twin run on the inline lane; one without takes the queue, and
        so do those after it until its last launch there is complete."""
        enqueue = cl.enqueue_nd_range_kernel
        with self.lock:
            if self._held:
                self._release()
            queue = self._own_queue()
            inline = self._own_inline_queue() if self.inline_device is not None else None
            idle = inline is not None and self.queue_idle()
            event = None
            for kernel, size, local, patches, twin in launches:
                if twin is not None and not idle and event is not None and inline is not None:
                    # the queue's last launch (from this run) complete: the lane again
                    idle = event.command_execution_status == _COMPLETE
                if idle and twin is not None:
                    for i, k in patches:
                        twin.set_arg(i, values[k])
                    enqueue(cast(cl.CommandQueue, inline), twin, size, local)
                    continue
                for i, k in patches:
                    kernel.set_arg(i, values[k])
                event = enqueue(queue, kernel, size, local)
                idle = False
            if event is not None:
                self._enqueued(event)


_KERNEL = re.compile(r"__kernel\s+void\s+(\w+)\s*\(([^)]*)\)")
_TYPEDEF = re.compile(r"typedef\s+(\w+)\s+(\w+)\s*;")
_C_SCALARS: dict[str, Any] = {
    "char": np.int8, "uchar": np.uint8, "short": np.int16, "ushort": np.uint16,
    "int": np.int32, "uint": np.uint32, "long": np.int64, "ulong": np.uint64,
    "float": np.float32, "double": np.float64}


def signatures(source: str) -> dict[str, list[Any]]:
    """Each kernel's argument types from its C signature in `source`, as pyopencl's
    `set_scalar_arg_dtypes` takes them: None for a pointer, a numpy dtype for a scalar
    (typedefs such as `T` resolved). A kernel whose parameters are not all plain declarations
    (a macro among them) is left out, and states its types itself."""
    names: dict[str, str] = {}
    for c, alias in _TYPEDEF.findall(source):
        names.setdefault(alias, c)  # the file's own: a kernel body may retype T in its scope
    found: dict[str, list[Any]] = {}
    for name, params in _KERNEL.findall(source):
        types: list[Any] = []
        for param in params.split(","):
            if "*" in param:
                types.append(None)
                continue
            words = [w for w in param.split() if w not in ("const", "__private")]
            ctype = names.get(words[0], words[0]) if len(words) == 2 else None
            if ctype not in _C_SCALARS:
                break
            types.append(np.dtype(_C_SCALARS[ctype]))
        else:
            found[name] = types
    return found


_HOST_COPY = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR


class _HostCopy(cl.Buffer):
    """A buffer made from host data (`Device.upload`); gives its bytes back to the device's
    count when it dies."""

    def __init__(self, device: Device, host: np.ndarray[Any, Any]) -> None:
        super().__init__(device.context, _HOST_COPY, hostbuf=host)
        self._device = device

    def __del__(self) -> None:
        device: Device | None = getattr(self, "_device", None)
        if device is None:  # interrupted (Ctrl-C) before its bytes were counted
            return
        with device.lock:  # a read-modify-write, and uploads add under the lock
            device._host_copies -= self.size  # pyright: ignore[reportPrivateUsage]


_devices: list[Device] | None = None
_default: Device | None = None


@atexit.register
def _join_inline_builds() -> None:
    """An inline lane's build under way at exit is waited for: PoCL torn down under a thread
    still compiling could crash the exit."""
    for device in _devices or ():
        device.wait_for_inline_builds()


def install_hint(system: str = sys.platform, arch: str = "") -> str:
    """What to install to get an OpenCL device on `system` (a `sys.platform`) and processor
    `arch` (a `platform.machine()`; this one's if empty)."""
    arch = (arch or machine()).lower()
    if system.startswith("linux") and arch in ("x86_64", "amd64"):
        return ('install PoCL, a CPU OpenCL device: pip install "pyopencl[pocl]" (or pip install '
                "pocl-binary-distribution), or your GPU vendor's OpenCL driver")
    if system == "darwin":
        # Apple's OpenCL driver comes with macOS: none found means an ICD loader that does not
        # know it, as from a pyopencl built for another system's drivers.
        return ("macOS has an OpenCL driver built in, which pyopencl finds unless it was built "
                "for another ICD loader: reinstall it (pip install --force-reinstall pyopencl; "
                "with conda, conda install -c conda-forge ocl_icd_wrapper_apple)")
    if system == "win32":
        return ("install your GPU vendor's driver (NVIDIA's, AMD's and Intel's include OpenCL) "
                "or a CPU OpenCL runtime, such as Intel's CPU Runtime for OpenCL Applications")
    return ("install an OpenCL driver: PoCL for the CPU (apt install pocl-opencl-icd, or dnf "
            "install pocl) or your GPU vendor's; pyopencl's ICD loader finds drivers by their "
            ".icd files in /etc/OpenCL/vendors (or the folder $OCL_ICD_VENDORS names)")


# Finding the devices and choosing the default happen once, under this lock: two threads
# making their first tensors at once would otherwise each make Device objects of their own
# for the same hardware, whose tensors and tapes then refuse each other.
_finding = threading.RLock()


def devices() -> list[Device]:
    """Every OpenCL device of every platform, in platform order."""
    if _devices is None:
        with _finding:
            if _devices is None:
                _find_devices()
    assert _devices is not None
    return list(_devices)


def _find_devices() -> None:
    global _devices
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:  # PLATFORM_NOT_FOUND_KHR: the ICD loader found no driver
        raise DeviceError(f"no OpenCL platform found ({err}); {install_hint()}") from err
    if not platforms:
        raise DeviceError(f"no OpenCL platform found; {install_hint()}")
    found: list[Device] = []
    for p_index, platform in enumerate(platforms):
        try:
            cl_devices = platform.get_devices()
        except cl.Error:
            continue
        if "Portable Computing Language" in platform.name:
            for cl_device in cl_devices:
                if cl_device.type & cl.device_type.CPU:
                    name_host_cpu(cl_device)
        inline = _inline_lane(cl_devices)
        shared = inline is not None and share_builds(inline[1], inline[0])
        listed = [d for d in cl_devices if inline is None or d is not inline[1]]
        for d_index, cl_device in enumerate(listed):
            lane = inline[1] if inline is not None and cl_device is inline[0] else None
            found.append(Device(p_index, d_index, cl_device, lane, shared and lane is not None))
    if not found:
        names = ", ".join(repr(platform.name.strip()) for platform in platforms)
        raise DeviceError(f"no OpenCL device found on the platforms {names}; "
                          f"{install_hint()}")
    _devices = found


def _inline_lane(cl_devices: Sequence[cl.Device]) -> tuple[cl.Device, cl.Device] | None:
    """PoCL's threaded CPU device and its basic one, where a platform lists both and INLINE is
    on: the second becomes the first's inline lane, not a device of its own."""
    if not INLINE or not cl_devices or "Portable Computing Language" not in str(
            cl_devices[0].platform.name):
        return None
    threaded = [d for d in cl_devices if d.name.startswith("pthread-")]
    basic = [d for d in cl_devices if d.name.startswith("basic-")]
    return (threaded[0], basic[0]) if threaded and basic else None


def get_device(spec: Device | str | None = None, op: str = "") -> Device:
    """Resolve a device: a `Device`, 'cpu', 'gpu', 'P:D', or None for the default. Errors name
    `op`, the call that was given `spec` (Tape, AnyTensor...)."""
    if isinstance(spec, Device):
        return spec
    if spec is None:
        return default_device()
    if not isinstance(spec, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        message = f"device must be a Device, a string or None, not {type(spec).__name__}"
    else:
        all_devices = devices()
        try:
            found = _named(spec, all_devices)
        except ValueError:
            message = (f"unknown device {spec!r}: use 'cpu', 'gpu', 'P:D' (platform:device) or "
                       "a Device from tg.devices()")
        else:
            if found is not None:
                return found
            what = spec.strip().lower()
            message = (f"no {what} OpenCL device" if what in ("cpu", "gpu")
                       else f"no OpenCL device {spec!r}") + f"; available: {_listed(all_devices)}"
    message = at_site(message)
    raise DeviceError(f"{op}: {message}" if op else message)


def _named(spec: str, all_devices: Sequence[Device]) -> Device | None:
    """The device that `spec` names ('cpu', 'gpu' or 'P:D'), or None where there is none such.
    ValueError if `spec` has none of these forms."""
    text = spec.strip().lower()
    if text in ("cpu", "gpu"):
        return next((dev for dev in all_devices if dev.kind == text), None)
    parts = text.split(":")
    if len(parts) == 2 and all(part.isdigit() for part in parts):
        wanted = (int(parts[0]), int(parts[1]))
        return next((dev for dev in all_devices
                     if (dev.platform_index, dev.device_index) == wanted), None)
    raise ValueError(spec)


def _listed(all_devices: Sequence[Device]) -> str:
    return ", ".join(map(repr, all_devices))


def default_device() -> Device:
    """The device `TAPEGRAD_DEVICE` names if it is set, else the one `PYOPENCL_CTX` names (as
    pyopencl's create_some_context reads it) if that is set, else the first GPU, else the first
    device (under an MPI launcher, the local rank's among them). A variable that names no
    device is a DeviceError that names the variable."""
    if _default is None:
        with _finding:
            if _default is None:
                _choose_default()
    assert _default is not None
    return _default


def _choose_default() -> None:
    global _default
    all_devices = devices()
    spec = os.environ.get("TAPEGRAD_DEVICE", "").strip()
    ctx = os.environ.get("PYOPENCL_CTX", "").strip()
    if spec:
        try:
            found = _named(spec, all_devices)
        except ValueError:
            raise DeviceError(
                f"TAPEGRAD_DEVICE={spec!r} is not a device: use 'cpu', 'gpu' or 'P:D' "
                f"(platform P, device D); available: {_listed(all_devices)}") from None
        if found is None:
            raise DeviceError(f"TAPEGRAD_DEVICE={spec!r} names no device here; available: "
                              f"{_listed(all_devices)}")
        _default = found
    elif ctx:
        _default = _pyopencl_ctx(ctx, all_devices)
    else:
        # Several processes of an MPI job on one node take one device each, by their rank
        # on the node (tg.distributed's local_rank), from the first tensor made.
        candidates = [dev for dev in all_devices if dev.is_gpu] or all_devices
        _default = candidates[launcher_local_rank() % len(candidates)]


# Variables by which launchers tell a process its rank among those on its node: MPICH's and
# Intel MPI's hydra, Open MPI, MVAPICH, Slurm.
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def launcher_local_rank() -> int:
    """This process's rank on its node as its launcher says (0 outside a launcher)."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0


# Variables by which launchers tell a process how many ranks were started (MPICH's and Intel
# MPI's hydra and Slurm's PMI, Open MPI, MVAPICH).
_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_size() -> tuple[str, int] | None:
    """(variable, ranks) where a launcher says this process is one of several ranks."""
    for var in _LAUNCHER_SIZE_VARS:
        text = os.environ.get(var, "").strip()
        if text.isdigit() and int(text) > 1:
            return var, int(text)
    return None


def _pyopencl_ctx(ctx: str, all_devices: Sequence[Device]) -> Device:
    """The device `PYOPENCL_CTX=ctx` picks, as in pyopencl's `choose_devices`: "P:D", each part
    an index or else a case-insensitive part of a name (the last platform whose name holds it,
    the first device); an empty or missing part is 0, so "P" is platform P's first device. Of a
    device list "P:D1,D2" tapegrad takes D1, its one device."""
    def failed(what: str) -> DeviceError:
        return DeviceError(
            f"PYOPENCL_CTX={ctx!r} {what}: use 'P:D' or 'P' (indices, or parts of names); "
            f"available: {_listed(all_devices)}")

    answers = ctx.split(":")
    if len(answers) > 2:
        raise failed("has more than platform:device")
    platform_part = answers[0].strip()
    device_part = answers[1].split(",")[0].strip() if len(answers) == 2 else ""
    platforms = {dev.platform_index: dev.platform_name for dev in all_devices}
    if not platform_part:
        p_index = min(platforms)
    elif platform_part.isdigit() and int(platform_part) in platforms:
        p_index = int(platform_part)
    else:
        named = [i for i, name in platforms.items() if platform_part.lower() in name.lower()]
        if not named:
            raise failed("matches no platform")
        p_index = named[-1]
    on_platform = [dev for dev in all_devices if dev.platform_index == p_index]
    if not device_part:
        return on_platform[0]
    if device_part.isdigit():
        by_index = [dev for dev in on_platform if dev.device_index == int(device_part)]
        if by_index:
            return by_index[0]
    by_name = [dev for dev in on_platform if device_part.lower() in dev.name.lower()]
    if not by_name:
        raise failed(f"matches no device of platform {p_index}")
    return by_name[0]


def fp64_pragma(dtype: np.dtype[Any]) -> str:
    return "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" if dtype == np.float64 else ""
