"""The part of pyopencl that tapegrad (its source, tests and benchmarks) uses, typed fully.

pyopencl's own annotations leave some members unknown (`Kernel.set_scalar_arg_dtypes`, the
build log's `get_build_info`), which strict pyright reports at every use; these stubs say what
tapegrad relies on instead. A name missing here is one tapegrad does not use yet: add it with
the signature pyopencl documents.
"""

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from . import tools as tools

class Error(Exception):
    def __init__(self, *args: object) -> None: ...

class LogicError(Error): ...
class RuntimeError(Error): ...

class device_fp_config(IntEnum):
    DENORM = 1
    INF_NAN = 2
    ROUND_TO_NEAREST = 4
    ROUND_TO_ZERO = 8
    ROUND_TO_INF = 16
    FMA = 32
    SOFT_FLOAT = 64
    CORRECTLY_ROUNDED_DIVIDE_SQRT = 128

class device_type(IntEnum):
    DEFAULT = 1
    CPU = 2
    GPU = 4
    ACCELERATOR = 8
    CUSTOM = 16
    ALL = 0xFFFFFFFF

class mem_flags(IntEnum):
    READ_WRITE = 1
    WRITE_ONLY = 2
    READ_ONLY = 4
    USE_HOST_PTR = 8
    ALLOC_HOST_PTR = 16
    COPY_HOST_PTR = 32

class program_info(IntEnum):
    REFERENCE_COUNT = 0x1160
    CONTEXT = 0x1161
    NUM_DEVICES = 0x1162
    DEVICES = 0x1163
    SOURCE = 0x1164
    BINARY_SIZES = 0x1165
    BINARIES = 0x1166
    NUM_KERNELS = 0x1167
    KERNEL_NAMES = 0x1168

class program_build_info(IntEnum):
    STATUS = 0x1181
    OPTIONS = 0x1182
    LOG = 0x1183

class Platform:
    name: str
    vendor: str
    version: str
    def get_devices(self, device_type: int = ...) -> list[Device]: ...

class Device:
    name: str
    vendor: str
    version: str
    platform: Platform
    type: int
    double_fp_config: int
    single_fp_config: int
    max_mem_alloc_size: int
    native_vector_width_float: int
    global_mem_size: int
    max_compute_units: int
    max_work_group_size: int

class Context:
    devices: list[Device]
    def __init__(self, devices: Sequence[Device] | None = None) -> None: ...

class CommandQueue:
    context: Context
    device: Device
    def __init__(self, context: Context, device: Device | None = None,
                 properties: int | None = None) -> None: ...
    def finish(self) -> None: ...
    def flush(self) -> None: ...

class MemoryObjectHolder:
    size: int
    int_ptr: int

class MemoryObject(MemoryObjectHolder):
    def release(self) -> None: ...

class Buffer(MemoryObject):
    def __init__(self, context: Context, flags: int, size: int = 0,
                 hostbuf: np.ndarray[Any, Any] | None = None) -> None: ...

class Program:
    def __init__(self, context: Context, source: str) -> None: ...
    def build(self, options: str | Sequence[str] = ..., devices: Sequence[Device] | None = None,
              cache_dir: str | None = None) -> Program: ...
    def get_info(self, param: program_info) -> Any: ...
    def get_build_info(self, device: Device, param: program_build_info) -> Any: ...

class Kernel:
    def __init__(self, program: Program, name: str) -> None: ...
    def set_scalar_arg_dtypes(self, dtypes: Sequence[np.dtype[Any] | type[Any] | None]) -> None:
        ...
    def set_args(self, *args: Any) -> None: ...
    def set_arg(self, index: int, value: Any) -> None: ...
    @property
    def program(self) -> Program: ...
    @property
    def function_name(self) -> str: ...
    def __hash__(self) -> int: ...

class command_execution_status(IntEnum):
    COMPLETE = 0
    RUNNING = 1
    SUBMITTED = 2
    QUEUED = 3

class Event:
    command_execution_status: int
    def wait(self) -> None: ...

def get_platforms() -> list[Platform]: ...
def enqueue_copy(queue: CommandQueue, dest: Any, src: Any, *, is_blocking: bool = True,
                 **kwargs: Any) -> Event: ...
def enqueue_fill_buffer(queue: CommandQueue, mem: Buffer, pattern: Any, offset: int,
                        size: int, wait_for: Sequence[Event] | None = None) -> Event: ...
def enqueue_nd_range_kernel(queue: CommandQueue, kernel: Kernel,
                            global_work_size: tuple[int, ...],
                            local_work_size: tuple[int, ...] | None,
                            global_work_offset: tuple[int, ...] | None = None,
                            wait_for: Sequence[Event] | None = None) -> Event: ...
