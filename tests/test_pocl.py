"""Naming a CPU that PoCL 3.0's LLVM names wrong (tapegrad._pocl), on a mock device record."""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _pocl

AVX2 = frozenset({"sse4_1", "ssse3", "cx16", "popcnt", "abm", "avx", "avx2", "fma", "bmi1",
                  "bmi2", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
WHEEL = "OpenCL 3.0 PoCL 3.0-rc2  Linux, Release, RELOC, LLVM 14.0.6, SLEEF, DISTRO, POCL_DEBUG"


@dataclass
class FakePlatform:
    version: str = WHEEL


@dataclass
class FakeDevice:
    """What `name_host_cpu` reads of a pyopencl device: its record's address, its platform's
    version, and the native vector width PoCL derived from LLVM's view of the features."""

    int_ptr: int
    native_vector_width_float: int = 16
    platform: FakePlatform = field(default_factory=FakePlatform)


Strings = list[ctypes.Array[ctypes.c_char]]


def _record(cpu: bytes) -> tuple[ctypes.Array[ctypes.c_char], Strings]:
    """A device record as PoCL 3.0 lays it out: unrelated words, then the target triple's
    pointer and the CPU name's side by side (the strings returned to keep them alive)."""
    triple = ctypes.create_string_buffer(b"x86_64-unknown-linux-gnu")
    name = ctypes.create_string_buffer(cpu)
    words = [7, 0, 12345] + [0] * 76 + [ctypes.addressof(triple), ctypes.addressof(name)]
    words += [0] * (_pocl._RECORD_BYTES // 8 - len(words))
    record = ctypes.create_string_buffer(struct.pack(f"{len(words)}Q", *words), len(words) * 8)
    return record, [triple, name]


def _cpu_word(record: ctypes.Array[ctypes.c_char]) -> bytes:
    address = struct.unpack_from("Q", record.raw, 80 * 8)[0]
    return ctypes.string_at(address)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POCL_LLVM_CPU_NAME", raising=False)
    monkeypatch.setattr(_pocl, "_host_flags", lambda: AVX512)
    # the names set here, apart from the real devices' (a freed record's address comes back)
    monkeypatch.setattr(_pocl, "_NAMED", {})


@pytest.mark.usefixtures("host")
def test_a_generic_cpu_is_named_for_the_kernel_library_the_host_runs() -> None:
    record, _keep = _record(b"generic")
    device = FakeDevice(ctypes.addressof(record))
    assert _pocl.build_option(device) == ()
    assert _pocl.name_host_cpu(device) == "skylake-avx512"
    assert _cpu_word(record) == b"skylake-avx512"
    # the name in the build options too: PoCL's cache keys on the name LLVM gave
    assert _pocl.build_option(device) == ("-D", "TG_LLVM_CPU_skylake_avx512")


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("cpu", [b"icelake-server", b"sapphirerapids", b"skylake-avx512",
                                 b"tigerlake"])
def test_a_cpu_llvm_names_right_is_left_alone(cpu: bytes) -> None:
    record, _keep = _record(cpu)
    before = record.raw
    device = FakeDevice(ctypes.addressof(record))
    assert _pocl.name_host_cpu(device) is None
    assert record.raw == before
    assert _pocl.build_option(device) == ()


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("version", ["OpenCL 3.0 PoCL 3.1+debian  Linux, None+Asserts",
                                     "OpenCL 3.0 PoCL 6.0  Linux, Release", "Apple",
                                     "OpenCL 3.0 PoCL 3.0  Linux, Release, RELOC, LLVM 14.0.6"])
def test_another_platforms_record_is_left_alone(version: str) -> None:
    """Debian's PoCL 3.1 keeps its library's variant ("avx512") where 3.0 keeps the CPU; a
    write there made PoCL look for a library file that does not exist, and abort. A PoCL 3.0
    built for one CPU (no DISTRO) picks its library by the name: renaming would mismatch."""
    record, _keep = _record(b"generic")
    before = record.raw
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record),
                                          platform=FakePlatform(version))) is None
    assert record.raw == before


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("cpu", [b"znver3", b"alderlake", b"haswell", b"skylake", b"x86-64"])
def test_a_name_without_avx512_where_pocl_links_the_avx512_library_is_renamed(cpu: bytes
                                                                              ) -> None:
    """LLVM 14 names a Zen 4 "znver3", an Alder Lake with AVX-512 "alderlake", while PoCL links
    the AVX-512 library: kernels crash (each of these seen so on a Zen 5)."""
    record, _keep = _record(cpu)
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) == "skylake-avx512"
    assert _cpu_word(record) == b"skylake-avx512"


@pytest.mark.usefixtures("host")
def test_a_zen_name_where_pocl_links_an_avx2_library_is_left_alone() -> None:
    """PoCL's AVX-512 library follows LLVM's view of the features (its vector width): at 8
    floats not that one, whatever /proc/cpuinfo says (a kernel's clearcpuid=); the variants
    below it are read from /proc/cpuinfo."""
    record, _keep = _record(b"znver3")
    before = record.raw
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record), 8)) is None
    assert record.raw == before


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("cpu", [b"generic", b"alderlake", b"skylake-avx512"])
def test_the_users_name_is_taken(cpu: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """PoCL 3.0 does not read POCL_LLVM_CPU_NAME (PoCL 5 does): tapegrad sets it for it,
    whatever LLVM named."""
    monkeypatch.setenv("POCL_LLVM_CPU_NAME", "icelake-server")
    record, _keep = _record(cpu)
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) == "icelake-server"
    assert _cpu_word(record) == b"icelake-server"


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("users", ["\xff", "skylake-avx512 -DX", ""])
def test_a_users_name_that_is_not_one_word_is_not_taken(users: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """PoCL splits `-target-cpu <name>` on spaces: anything but one word is left out, and the
    name follows the library."""
    monkeypatch.setenv("POCL_LLVM_CPU_NAME", users)
    record, _keep = _record(b"generic")
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) == "skylake-avx512"


@pytest.mark.usefixtures("host")
def test_a_record_without_the_triple_is_left_alone() -> None:
    record = ctypes.create_string_buffer(bytes(_pocl._RECORD_BYTES))
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert record.raw == bytes(len(record.raw))


@pytest.mark.usefixtures("host")
def test_memory_that_cannot_be_read_leaves_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox may refuse /proc/self/mem: the device keeps PoCL's name, and no error."""
    record, _keep = _record(b"generic")
    opened = os.open

    def refuse(path: str, flags: int, *args: int) -> int:
        if path == "/proc/self/mem":
            raise PermissionError(13, "Permission denied", path)
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert _cpu_word(record) == b"generic"


@pytest.mark.parametrize(("flags", "floats", "cpu"), [
    (AVX512, 16, "skylake-avx512"),
    (frozenset[str](), 16, "skylake-avx512"),  # cpuinfo unread: the vector width says
    (AVX512, 8, "haswell"),
    (AVX2, 8, "haswell"),
    (AVX2 - {"bmi1"}, 8, "ivybridge"),
    (frozenset({"avx", "cx16", "popcnt", "xop", "fma4", "f16c"}), 8, "bdver1"),
    (frozenset({"avx", "cx16", "popcnt"}), 8, "sandybridge"),
    (frozenset({"sse4_1", "ssse3", "cx16"}), 4, "penryn"),
    (frozenset({"ssse3", "cx16"}), 4, "core2"),
    (frozenset[str](), 4, "athlon64"),
])
def test_the_name_follows_pocls_choice_of_library(flags: frozenset[str], floats: int,
                                                  cpu: str) -> None:
    assert _pocl._cpu_for(flags, floats) == cpu


def test_this_machines_device_builds() -> None:
    """Whatever this CPU, a kernel builds and runs on the default device (on a Zen 5 only
    because of the name set)."""
    tape, x = tg.leaf(tg.Tape(), np.array([0.0, 1.0, 2.0], np.float32))
    tape, y = tg.exp(tape, x)
    assert tg.value(tape, y).numpy().tolist() == pytest.approx([1.0, 2.718281828, 7.389056099])
