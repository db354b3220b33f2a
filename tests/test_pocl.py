"""Naming a CPU that PoCL's LLVM names wrong (tapegrad._pocl), on a mock device record."""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import pytest

from tapegrad import _pocl

AVX2 = frozenset({"sse4_1", "ssse3", "cx16", "popcnt", "abm", "avx", "avx2", "fma", "bmi1",
                  "bmi2", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


@dataclass
class FakeDevice:
    """What `name_host_cpu` reads of a pyopencl device: the address of its record."""

    int_ptr: int


def _record(cpu: bytes) -> tuple[ctypes.Array[ctypes.c_char], list[ctypes.Array[ctypes.c_char]]]:
    """A device record as PoCL lays it out: unrelated words, then the target triple's pointer
    and the CPU name's side by side (the strings returned to keep them alive)."""
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


@pytest.mark.usefixtures("host")
def test_a_generic_cpu_is_named_for_the_kernel_library_the_host_runs() -> None:
    record, _keep = _record(b"generic")
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) == "skylake-avx512"
    assert _cpu_word(record) == b"skylake-avx512"


@pytest.mark.usefixtures("host")
@pytest.mark.parametrize("cpu", [b"icelake-server", b"sapphirerapids", b"skylake-avx512",
                                 b"avx512"])  # Debian's PoCL 3.1 keeps its library's variant
def test_a_cpu_llvm_names_right_is_left_alone(cpu: bytes) -> None:
    record, _keep = _record(cpu)
    before = record.raw
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert record.raw == before


@pytest.mark.usefixtures("host")
def test_a_cpu_without_avx512_on_a_host_with_it_is_renamed() -> None:
    """LLVM 14 names a Zen 4 "znver3", while PoCL links the AVX-512 library: kernels crash."""
    record, _keep = _record(b"znver3")
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) == "skylake-avx512"
    assert _cpu_word(record) == b"skylake-avx512"


def test_a_cpu_without_avx512_on_a_host_without_it_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POCL_LLVM_CPU_NAME", raising=False)
    monkeypatch.setattr(_pocl, "_host_flags", lambda: AVX2)
    record, _keep = _record(b"znver3")
    before = record.raw
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert record.raw == before


@pytest.mark.usefixtures("host")
def test_a_record_without_the_triple_is_left_alone() -> None:
    record = ctypes.create_string_buffer(bytes(_pocl._RECORD_BYTES))
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert record.raw == bytes(len(record.raw))


@pytest.mark.usefixtures("host")
def test_the_users_own_name_is_left_to_pocl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POCL_LLVM_CPU_NAME", "znver4")
    record, _keep = _record(b"generic")
    assert _pocl.name_host_cpu(FakeDevice(ctypes.addressof(record))) is None
    assert _cpu_word(record) == b"generic"


@pytest.mark.parametrize(("flags", "cpu"), [
    (AVX512, "skylake-avx512"),
    (AVX2, "haswell"),
    (AVX2 - {"bmi1"}, "ivybridge"),
    (frozenset({"avx", "cx16", "popcnt", "xop", "fma4", "f16c"}), "bdver1"),
    (frozenset({"avx", "cx16", "popcnt"}), "sandybridge"),
    (frozenset({"sse4_1", "ssse3", "cx16"}), "penryn"),
    (frozenset({"ssse3", "cx16"}), "core2"),
    (frozenset[str](), "athlon64"),
])
def test_the_name_follows_the_hosts_features(flags: frozenset[str], cpu: str) -> None:
    assert _pocl._cpu_for(flags) == cpu
