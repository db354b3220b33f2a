"""Two settings PoCL 3.0 does not offer, made in its device records: a CPU its LLVM misnames,
named for it (`name_host_cpu`), and one cache for its two CPU drivers (`share_builds`).

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

tapegrad's inline lane is PoCL's basic driver beside its threaded one (`_device`). The two
build the same program to byte-equal binaries, but PoCL files each build under the driver's
name, so the lane compiled every program and kernel a second time (seconds with empty
caches). `share_builds` files the basic driver's builds under the threaded one's hash, on the
same release, after checking what each driver's hash function gives.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from typing import Any, cast

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


# PoCL 3.0's `struct pocl_device_ops` (lib/CL/pocl_cl.h): `device_name` first, `build_hash`
# the 61st of its pointer-sized members.
_BUILD_HASH_AT = 60 * 8


def _ops(memory: int, cl_device: Any, driver: bytes) -> int | None:
    """The address of the driver ops of a PoCL 3.0 device: the pointer in its record to a
    record whose first member names `driver`."""
    raw = _read(memory, cl_device.int_ptr, _RECORD_BYTES)
    if raw is None or len(raw) < _RECORD_BYTES:
        return None
    for address in struct.unpack(f"{_RECORD_BYTES // 8}Q", raw):
        first = _read(memory, address, 8)
        if first is None or len(first) < 8:
            continue
        name = _read(memory, struct.unpack("Q", first)[0], len(driver) + 1)
        if name == driver + b"\0":
            return address
    return None


def share_builds(basic: Any, threaded: Any) -> bool:
    """Have PoCL 3.0's basic CPU device (tapegrad's inline lane) file its builds under the
    threaded device's hash in PoCL's cache, so that each reads the other's: its build of a
    program the threaded device built is a read of that program, and it runs the work-group
    functions that device compiled. Whether done.

    The two drivers compile the same LLVM module with the same compiler for the same CPU, and
    write byte-equal kernel binaries; PoCL tells their cache entries apart only by the
    driver's name at the head of each device's build hash ("basic-..." against
    "pthread-..."). So the basic driver's `build_hash` member is pointed at the threaded
    one's. Only where both devices were named alike (`name_host_cpu`) and each driver's
    function gives its own name before a hash the two share."""
    if "PoCL 3.0" not in str(basic.platform.version) or ", DISTRO" not in str(
            basic.platform.version):
        return False
    if _NAMED.get(basic.int_ptr) != _NAMED.get(threaded.int_ptr):
        return False
    caching = os.environ.get("POCL_KERNEL_CACHE")
    if caching is not None and not caching.startswith("1"):  # as PoCL reads it
        return False  # no cache: nothing to share, and each lane build would compile
    try:
        memory = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return False
    try:
        basic_ops, threaded_ops = _ops(memory, basic, b"basic"), _ops(memory, threaded, b"pthread")
        if basic_ops is None or threaded_ops is None or basic_ops == threaded_ops:
            return False
        functions = [_read(memory, ops + _BUILD_HASH_AT, 8) for ops in (basic_ops, threaded_ops)]
    finally:
        os.close(memory)
    if any(f is None or len(f) < 8 for f in functions):
        return False
    basic_hash, threaded_hash = (struct.unpack("Q", cast(bytes, f))[0] for f in functions)
    if basic_hash == threaded_hash or not all(map(_in_pocl_code, (basic_hash, threaded_hash))):
        return False  # not two functions of PoCL's: not the record laid out as read here
    hashes = [_build_hash(basic_hash, basic), _build_hash(threaded_hash, threaded)]
    if not (hashes[0].startswith(b"basic-") and hashes[1].startswith(b"pthread-")
            and hashes[0][len(b"basic-"):] == hashes[1][len(b"pthread-"):]):
        return False
    ctypes.c_uint64.from_address(basic_ops + _BUILD_HASH_AT).value = threaded_hash
    return True


def _in_pocl_code(address: int) -> bool:
    """Whether `address` lies in the executable code of a PoCL library of this process."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or "x" not in fields[1] or "libpocl" not in fields[5]:
                    continue
                start, _, end = fields[0].partition("-")
                if int(start, 16) <= address < int(end, 16):
                    return True
    except (OSError, ValueError):
        pass
    return False


def _build_hash(function: int, cl_device: Any) -> bytes:
    """What a PoCL driver's `build_hash` gives for `cl_device` (a string it allocates)."""
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    text = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(function)(cl_device.int_ptr)
    if not text:
        return b""
    found = ctypes.string_at(text)
    libc.free(text)
    return found
