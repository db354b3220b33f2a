"""A CPU that PoCL 3.0's LLVM misnames, named for it.

PoCL asks LLVM for the host CPU's name once, when it starts, and passes it to every build as
`-target-cpu`; it picks its kernel library (exp, tanh...) by LLVM's view of the host's
features instead. PoCL 3.0 from PyPI carries LLVM 14, older than two CPU families:

- AMD's Zen 5 (family 1Ah) is "generic", a name LLVM's x86 backend rejects: every build fails
  with "unknown target CPU 'generic'" (pocl/pocl#512, #1049), and no kernel runs;
- AMD's Zen 4 (family 19h, like Zen 3) is "znver3", a CPU without AVX-512, while the library is
  the AVX-512 build: kernels passing 16-float vectors to it are compiled for the other calling
  convention, and crash (seen here by naming a Zen 5 "znver3").

PoCL 3.0 reads no setting for the name (POCL_LLVM_CPU_NAME arrived in PoCL 5), so
`name_host_cpu` sets it in the device itself, before any build: PoCL 3.0's device record holds
the target triple's pointer and the CPU name's side by side; where the name is "generic", or a
CPU's without AVX-512 where the library is the AVX-512 build, it is pointed at the LLVM CPU
PoCL's kernel library was built for, chosen as PoCL chooses that library (AVX-512, which
PoCL's native vector width of 16 floats shows: skylake-avx512; else by /proc/cpuinfo, AVX2:
haswell...), or at POCL_LLVM_CPU_NAME where the user set it (one word). The build options
then name it too (`build_option`): PoCL's device hash holds the name LLVM gave; the option
keeps tapegrad's entries in its cache apart by name, whatever else the key holds.

Only PoCL 3.0's distribution build (the wheel's) is touched: other PoCLs lay the record out
otherwise (Debian's 3.1 keeps its library's variant, "avx512", where 3.0 keeps the CPU) or
read the setting, and a build for one CPU picks its library by that name. Nothing is touched
on a CPU LLVM names right, and where the record cannot be read nothing happens.
"""

from __future__ import annotations

import ctypes
import os
import re
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
_AVX512 = _VARIANTS[0][0]

# LLVM 14's CPUs with AVX-512. Where PoCL links the AVX-512 library, any other name is renamed
# (LLVM 14 calls a Zen 4 "znver3", an Alder Lake with AVX-512 unlocked "alderlake", a VM may
# show an older model): compiled for a CPU without it, the kernels' calls into the library
# crash ("haswell", "skylake", "znver3", "alderlake" seen so on this Zen 5).
_AVX512_CPUS = frozenset({
    "knl", "knm", "skylake-avx512", "cascadelake", "cooperlake", "cannonlake",
    "icelake-client", "icelake-server", "rocketlake", "tigerlake", "sapphirerapids",
    "x86-64-v4"})

# A name PoCL passes on as `-target-cpu <name>`: one word (the user's POCL_LLVM_CPU_NAME too).
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")

# How far into the device record to look for the two pointers (PoCL 3.0's sit at 632 and 640
# bytes; its records lie 1024 bytes apart).
_RECORD_BYTES = 1024

# The names set, by device record: copies made by the C library, never freed (PoCL reads them
# for as long as the device lives, and may free them as its own).
_NAMED: dict[int, str] = {}


def _host_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _cpu_for(flags: frozenset[str], floats: int) -> str:
    """The CPU of the library PoCL links: AVX-512 where PoCL's vectors hold 16 floats (LLVM's
    own view of the features, which PoCL's choice follows), else by the host's flags."""
    if floats >= 16:
        return _AVX512
    return next(name for name, needs in _VARIANTS[1:] if needs <= flags)


def _wrong(named: bytes, wanted: str) -> bool:
    """Whether PoCL's name for the CPU would fail (see above), given the library's CPU."""
    return named == b"generic" or (wanted == _AVX512
                                   and named.decode(errors="replace") not in _AVX512_CPUS)


def _read(memory: int, address: int, size: int) -> bytes | None:
    """`size` bytes at `address` of this process, or None where they are not mapped (read
    through /proc/self/mem, which fails where a plain read would crash)."""
    if address < 4096:
        return None
    try:
        return os.pread(memory, size, address)
    except (OSError, OverflowError):
        return None


def _strdup(text: str) -> int:
    """A copy of `text` made by the C library's malloc, never freed here."""
    libc = ctypes.CDLL(None)
    libc.strdup.restype = ctypes.c_void_p
    libc.strdup.argtypes = [ctypes.c_char_p]
    address = libc.strdup(text.encode())
    if not address:
        raise MemoryError("strdup")
    return int(address)


def name_host_cpu(cl_device: Any) -> str | None:
    """Name the host CPU for a PoCL 3.0 CPU device whose LLVM named it wrong (see above),
    before the device's first build; the name set, or None where nothing was changed."""
    version = str(cl_device.platform.version)
    if "PoCL 3.0" not in version or ", DISTRO" not in version:
        return None  # elsewhere the record, or the library PoCL picks, is another's
    try:
        memory = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return None  # a sandbox may refuse it: PoCL's name stands
    record: int = cl_device.int_ptr
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
            library = _cpu_for(_host_flags(), int(cl_device.native_vector_width_float))
            users = os.environ.get("POCL_LLVM_CPU_NAME", "").strip()
            if _NAME.fullmatch(users):  # PoCL 3.0 does not read it: taken here
                wanted = users
            elif _wrong(named, library):
                wanted = library
            else:
                return None  # a CPU LLVM names right
            if named.decode(errors="replace") == wanted:
                return None
            ctypes.c_uint64.from_address(record + 8 * (index + 1)).value = _strdup(wanted)
            _NAMED[record] = wanted
            return wanted
    finally:
        os.close(memory)
    return None


def build_option(cl_device: Any) -> tuple[str, ...]:
    """A build option naming the CPU set for `cl_device` (none where none was set), so that
    PoCL's cache, keyed by the name LLVM gave, keeps this CPU's binaries apart from another's
    that LLVM named alike."""
    named = _NAMED.get(cl_device.int_ptr)
    return () if named is None else ("-D", f"TG_LLVM_CPU_{named.replace('-', '_')}")
