"""A CPU that PoCL's LLVM does not know, named for it.

PoCL asks LLVM for the host CPU's name once, when it starts, and passes it to every build as
`-target-cpu`; it picks its kernel library (exp, tanh...) by the host's features instead. An
LLVM older than the CPU family (PoCL 3.0 from PyPI carries LLVM 14) gets it wrong two ways:

- AMD's Zen 5 (family 1Ah) is "generic", a name LLVM's x86 backend rejects: every build fails
  with "unknown target CPU 'generic'" (pocl/pocl#512, #1049), and no kernel runs;
- AMD's Zen 4 (family 19h, like Zen 3) is "znver3", a CPU without AVX-512, while the library is
  the AVX-512 build: kernels passing 16-float vectors to it are compiled for the other calling
  convention, and crash (seen here by naming a Zen 5 "znver3").

PoCL 3.0 has no setting for the name (later PoCLs read POCL_LLVM_CPU_NAME), so `name_host_cpu`
sets it in the device itself, before any build: the device record holds the target triple's
pointer and the CPU name's side by side; where the name is "generic", or a Zen's without
AVX-512 on a host with it, it is pointed at the LLVM CPU whose instruction set PoCL's kernel
library was built for, chosen from the host's features as PoCL chooses that library (AVX-512:
skylake-avx512, AVX2: haswell...). The host runs everything that CPU's code holds. Nothing is
touched on a CPU LLVM names right, and POCL_LLVM_CPU_NAME, where set, is left to PoCL.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

# The LLVM CPU each kernel-library variant of PoCL 3.0's distribution build was compiled for,
# with the host features (Linux /proc/cpuinfo flags) that make PoCL pick it: the first whose
# features the host has, as PoCL's getX86KernelLibName (lzcnt is cpuinfo's "abm").
_VARIANTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("skylake-avx512", frozenset({"avx512f"})),
    ("haswell", frozenset({"avx", "avx2", "cx16", "popcnt", "abm", "f16c", "fma", "bmi1",
                           "bmi2"})),
    ("bdver1", frozenset({"avx", "cx16", "popcnt", "xop", "fma4"})),
    ("ivybridge", frozenset({"avx", "cx16", "popcnt", "f16c"})),
    ("sandybridge", frozenset({"avx", "cx16", "popcnt"})),
    ("penryn", frozenset({"sse4_1", "cx16"})),
    ("core2", frozenset({"ssse3", "cx16"})),
    ("athlon64", frozenset()),
)

# The names LLVM 14 gives an AMD CPU with AVX-512 (a Zen 4 is family 19h, as a Zen 3), none of
# them with it. Only these are renamed besides "generic": other PoCLs keep other things there
# (Debian's 3.1 the library variant, "avx512"), which must stay as they are.
_AMD_WITHOUT_AVX512 = frozenset({"znver1", "znver2", "znver3"})
_AVX512 = _VARIANTS[0][0]

# How far into the device record to look for the two pointers (PoCL 3.0's sits at ~630 bytes).
_RECORD_BYTES = 2048

# The names set, kept alive as long as PoCL may read them (the process).
_NAMES: list[ctypes.Array[ctypes.c_char]] = []


def _host_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _cpu_for(flags: frozenset[str]) -> str:
    return next(name for name, needs in _VARIANTS if needs <= flags)


def _read(memory: int, address: int, size: int) -> bytes | None:
    """`size` bytes at `address` of this process, or None where they are not mapped (read
    through /proc/self/mem, which fails where a plain read would crash)."""
    if address < 4096:
        return None
    try:
        return os.pread(memory, size, address)
    except (OSError, OverflowError):
        return None


def _wrong(named: bytes, wanted: str) -> bool:
    """Whether PoCL's name for the CPU would fail (see above), given the library's CPU."""
    return named == b"generic" or (wanted == _AVX512
                                   and named.decode(errors="replace") in _AMD_WITHOUT_AVX512)


def name_host_cpu(cl_device: Any) -> str | None:
    """Name the host CPU for a PoCL CPU device whose LLVM named it wrong (see above), before
    the device's first build; the name set, or None where nothing was changed."""
    if "POCL_LLVM_CPU_NAME" in os.environ or not os.path.exists("/proc/self/mem"):
        return None
    record: int = cl_device.int_ptr
    memory = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        raw = _read(memory, record, _RECORD_BYTES)
        if raw is None or len(raw) < _RECORD_BYTES:
            return None
        words = struct.unpack(f"{_RECORD_BYTES // 8}Q", raw)
        for index in range(len(words) - 1):
            if _read(memory, words[index], 7) != b"x86_64-":
                continue  # not the target triple's pointer
            found = next((text for size in (32, 16, 8)
                          if (text := _read(memory, words[index + 1], size)) is not None), None)
            if found is None or b"\0" not in found:
                return None  # not a name that could be read whole
            named = found.partition(b"\0")[0]
            wanted = _cpu_for(_host_flags())
            if not _wrong(named, wanted):
                return None  # a CPU LLVM names right
            name = ctypes.create_string_buffer(wanted.encode())
            _NAMES.append(name)
            ctypes.c_uint64.from_address(record + 8 * (index + 1)).value = (
                ctypes.addressof(name))
            return name.value.decode()
    finally:
        os.close(memory)
    return None
