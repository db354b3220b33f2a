"""Programs are built once per family and dtype, never per call or per size."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from cases import warm_up
from tapegrad import _device, _kernels
from tapegrad._device import core_source
from tapegrad._tensor import empty


def _step(tape: tg.Tape, n: int) -> None:
    rng = np.random.default_rng(n)
    tape, x = tg.leaf(tape, rng.standard_normal((n, 3)).astype(np.float32))
    tape, w = tg.leaf(tape, rng.standard_normal((3, 2)).astype(np.float32), requires_grad=True)
    tape, b = tg.leaf(tape, np.zeros(2, np.float32), requires_grad=True)
    tape, h = tg.matmul(tape, x, w)
    tape, h = tg.add(tape, h, b)
    tape, h = tg.tanh(tape, h)
    tape, h = tg.mul(tape, h, 0.5)
    tape, t = tg.transpose(tape, h)
    tape, loss = tg.max(tape, t)
    tape, loss2 = tg.mean(tape, h)
    tape, total = tg.add(tape, loss, loss2)
    tg.backward(tape, total)


def test_repeated_calls_build_no_programs() -> None:
    device = tg.default_device()
    # Warm: builds whatever the step needs, the generated kernels of its fused elementwise
    # chains included (built on a structure's third sighting, by default).
    warm_up(device, lambda: _step(tg.Tape(), 4))
    before = device.builds
    for n in (4, 7, 100, 1000):  # other sizes must not rebuild either
        _step(tg.Tape(), n)
    assert device.builds == before


def test_core_families_share_two_programs_per_dtype() -> None:
    """Two builds for every core family of a dtype (builds cost about the same whatever their
    size; two, so that a cold start builds them on two cores: `_compile_ahead`)."""
    device = tg.default_device()
    _step(tg.Tape(), 4)
    programs = set(device._programs)
    assert {("core0", "float32"), ("core1", "float32")} <= programs
    assert not {key for key in programs if key[0] in ("elementwise", "copy", "reduce", "matmul")}
    kernel_families = {family for family, _, _ in device._kernels}
    products = "matmul_gpu" if device.is_gpu else "matmul"  # a GPU's has a program of its own
    assert {"elementwise", "copy", "reduce", products} <= kernel_families



def test_copies_over_many_dims_have_a_program_of_their_own() -> None:
    """Strided copies over more than CORE_DIMS merged dims are rare; the core program leaves
    them out (a cold start builds less) and they build on first use, once."""
    assert "gather4_4" in core_source(np.dtype(np.float32))
    assert "gather8_4" not in core_source(np.dtype(np.float32))
    device = tg.default_device()
    x0 = np.arange(2 * 3 * 2 * 3 * 2 * 3, dtype=np.float32).reshape(2, 3, 2, 3, 2, 3)

    def reverse_axes() -> None:
        tape, x = tg.leaf(tg.Tape(), x0)
        tape, t = tg.transpose(tape, x, (5, 4, 3, 2, 1, 0))  # six dims that cannot merge
        np.testing.assert_array_equal(tg.value(tape, t).numpy(), x0.transpose(5, 4, 3, 2, 1, 0))

    reverse_axes()
    assert ("copy_wide", "all") in device._programs
    before = device.builds
    reverse_axes()
    assert device.builds == before


def test_uploads_count_in_active_bytes_while_they_live() -> None:
    """Uploads are buffers made from host data (no queued write), outside the pool: their bytes
    must still show in the device's count, and leave it when the tensor dies."""
    device = tg.default_device()
    data = np.arange(1000, dtype=np.float32)
    base = device.active_bytes()
    t = tg.AnyTensor.from_numpy(data, device)
    assert device.active_bytes() - base == data.nbytes
    device.reset_peak()
    pooled = empty((1000,), t.dtype, device)  # the peak counts both kinds of buffer
    assert device.peak_bytes() >= base + 2 * data.nbytes
    del pooled
    data[:] = -1  # the device holds a copy, not a view of the host array
    np.testing.assert_array_equal(t.numpy(), np.arange(1000, dtype=np.float32))
    del t
    assert device.active_bytes() == base


def test_strided_copies_at_every_rank_and_element_size() -> None:
    """One gather/scatter kernel per element size serves every rank up to CORE_DIMS (and one
    more up to MAX_DIMS), its leading dims padded with size 1: each rank, with an offset, dims
    that cannot merge (reversed axes) and a strided innermost dim, for 1-, 4- and 8-byte
    dtypes."""
    from tapegrad._kernels import contiguous_strides, strided_gather, strided_scatter

    for dtype in (np.bool_, np.int32, np.float32, np.float64, np.int64):
        for rank in range(1, 9):
            shape = tuple(2 + (i % 2) for i in range(rank))  # 2, 3, 2, 3, ...
            size = int(np.prod(shape))
            host = (np.arange(3 + size) % 7).astype(dtype)
            src = tg.AnyTensor.from_numpy(host)
            # Reversed axes over the elements from offset 3: innermost stride is not 1.
            strides = list(reversed(contiguous_strides(tuple(reversed(shape)))))
            view = np.lib.stride_tricks.as_strided(
                host[3:], shape, [s * host.itemsize for s in strides])
            got = strided_gather(src, shape, strides, base=3).numpy()
            np.testing.assert_array_equal(got, view, err_msg=f"gather {dtype} rank {rank}")
            assert got.dtype == np.dtype(dtype)

            part = tg.AnyTensor.from_numpy(view.copy())
            out = empty((3 + size,), np.dtype(dtype), src.device)
            strided_scatter(part, out, strides, base=3)
            back = out.numpy()[3:]
            np.testing.assert_array_equal(back, host[3:], err_msg=f"scatter {dtype} rank {rank}")


@pytest.mark.parametrize("gpu", [False, True])
def test_short_rows_go_several_to_a_work_item_carrying_the_index(
        gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gathers over rows shorter than COPY_CHUNK give a work-item `per` rows, their index
    carried from row to row across every dim (a GPU keeps one row per work-item): transposes
    whose rows end inside a work-item's run, row counts not a multiple of `per`, ranks 2-4; a
    scatter the same way. (Fused gathers share the loop: test_fusion's transposes of pending
    values.)"""
    from tapegrad._kernels import contiguous_strides, gather_shape, strided_gather, strided_scatter

    device = tg.default_device()
    monkeypatch.setattr(device, "is_gpu", gpu)
    rng = np.random.default_rng(5)
    cases = [((7, 3), (1, 0)), ((3, 5, 7), (2, 0, 1)), ((3, 5, 7, 4), (2, 0, 3, 1)),
             ((2, 9, 4, 16), (0, 2, 1, 3)), ((5, 3, 2, 3), (3, 1, 0, 2))]
    for shape, perm in cases:
        host = rng.standard_normal(shape).astype(np.float32)
        src = tg.AnyTensor.from_numpy(host)
        strides = contiguous_strides(shape)
        out_shape = tuple(shape[a] for a in perm)
        steps = [strides[a] for a in perm]
        _, (rows, chunks, per), _ = gather_shape(out_shape, steps, device)
        assert per == (1 if gpu else 256 // out_shape[-1]) and chunks == 1 and rows > 1
        want = host.transpose(perm)
        np.testing.assert_array_equal(strided_gather(src, out_shape, steps).numpy(), want,
                                      err_msg=f"{shape} {perm}")
        out = empty(shape, np.dtype(np.float32), device)
        strided_scatter(tg.AnyTensor.from_numpy(np.ascontiguousarray(want)), out, steps)
        np.testing.assert_array_equal(out.numpy(), host, err_msg=f"scatter {shape} {perm}")


def test_a_broadcast_along_the_innermost_axis_reads_once_per_row() -> None:
    """A gather whose innermost step is 0 (a splat of one element, a column over rows) reads
    its value once and stores it along the row: rows longer than a work-item's chunk (their
    chunks start inside the row), short rows several to a work-item, from an offset, for 1-,
    4- and 8-byte elements."""
    from tapegrad._kernels import COPY_CHUNK, strided_gather

    for dtype in (np.bool_, np.float32, np.float64):
        host = (np.arange(2, 40) % 5).astype(dtype)
        src = tg.AnyTensor.from_numpy(host)
        for shape, steps in (((3 * COPY_CHUNK + 5,), [0]), ((7, 2 * COPY_CHUNK + 3), [3, 0]),
                             ((9, 5), [2, 0]), ((2, 3, 4), [5, 1, 0])):
            want = np.lib.stride_tricks.as_strided(
                host[4:], shape, [s * host.itemsize for s in steps])
            got = strided_gather(src, shape, steps, base=4).numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"{dtype} {shape} {steps}")


Op = Callable[[tg.Tape, tg.Id, tg.Id, tg.Id], tuple[tg.Tape, tg.Id]]


def _pow_by(b: float) -> Op:
    return lambda t, i, p, e: tg.pow(t, p, b)


def test_heavy_float32_kernels_run_eight_lanes_with_a_scalar_tail() -> None:
    # exp, log, tanh, sigmoid, erf (gelu) and pow run 8 lanes a call in float32 and lane by lane
    # over the tensor's last n % 8: every length around the 8-lane and 256-element chunk edges
    # gives the float64 values to float32 accuracy, on both sides of 0 (sigmoid's two forms,
    # tanh's saturation at +-1), for pow's special exponents (uniform: one branch for the
    # eight lanes) and mixed ones (lane by lane).
    rng = np.random.default_rng(3)
    specials = np.array([2.0, 3.0, 1.0, 0.0, -1.0, -2.0, 0.5, -0.5, 1.7], np.float32)
    for n in (1, 7, 8, 9, 255, 256, 257, 1003):
        x = rng.uniform(-12.0, 12.0, n).astype(np.float32)
        pos = rng.uniform(0.1, 3.0, n).astype(np.float32)
        mixed = specials[rng.integers(0, len(specials), n)]
        x64, pos64 = x.astype(np.float64), pos.astype(np.float64)
        tape, i = tg.leaf(tg.Tape(), x)
        tape, p = tg.leaf(tape, pos)
        tape, e = tg.leaf(tape, mixed)
        phi = 0.5 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
        u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
        ops: list[tuple[Op, Any, float]] = [
            (lambda t, i, p, e: tg.exp(t, p), np.exp(pos64), 0.0),
            (lambda t, i, p, e: tg.log(t, p), np.log(pos64), 0.0),
            (lambda t, i, p, e: tg.tanh(t, i), np.tanh(x64), 0.0),
            (lambda t, i, p, e: tg.sigmoid(t, i), 1 / (1 + np.exp(-x64)), 0.0),
            (lambda t, i, p, e: tg.gelu(t, i), x64 * phi, 1e-6),
            (lambda t, i, p, e: tg.gelu(t, i, approximate="tanh"),
             0.5 * x64 * (1 + np.tanh(u)), 1e-5),
            (lambda t, i, p, e: tg.pow(t, 2.0, p), 2.0**pos64, 0.0),
            (lambda t, i, p, e: tg.pow(t, p, e), pos64 ** mixed.astype(np.float64), 0.0)]
        ops += [(_pow_by(float(b)), pos64 ** float(b), 0.0) for b in specials]
        for make, want, atol in ops:
            tape, y = make(tape, i, p, e)
            np.testing.assert_allclose(tg.value(tape, y).numpy(), want, rtol=3e-7,
                                       atol=atol * 12, err_msg=str(n))


def test_sixteen_lanes_give_the_bits_of_eight() -> None:
    """On a CPU whose vectors hold 16 floats, heavy float32 kernels run 16 lanes at a time
    (TG_WIDE), then 8, then one: every heavy op of tapegrad's own, over lengths around the
    lane and chunk edges (inf, NaN, -0 and negative logarithms among the inputs; VJP
    expressions too) and over split pieces read in place (`_view_kernel`, widths 16 and
    24), gives the bits of a device built without TG_WIDE (8 lanes, then one)."""
    default = tg.default_device()
    devices: list[_device.Device] = []
    for wide in (True, False):
        device = _device.Device(0, 0, default.cl_device)  # a program cache of its own
        device.__dict__["wide_lanes"] = wide  # the cached property, as the device would say
        devices.append(device)
    assert "TG_WIDE=1" in devices[0].build_options
    assert "TG_WIDE=1" not in devices[1].build_options
    rng = np.random.default_rng(16)
    heavy = [e for e in _kernels._EXPRESSIONS.values()  # pyright: ignore[reportPrivateUsage]
             if e.heavy and e.family in _kernels.OWN_FAMILIES]
    assert len(heavy) > 20
    for n in (15, 16, 17, 24, 31, 33, 255, 256, 257, 1003):
        x = (rng.uniform(0.05, 9.0, n) * rng.choice([-1, 1], n)).astype(np.float32)
        x[:5] = [np.inf, -np.inf, np.nan, -0.0, -80.0]
        outs: list[list[bytes]] = []
        for device in devices:
            got: list[bytes] = []
            for found in heavy:  # operand j is x rotated by 5 j: signs and specials mixed
                args = [tg.AnyTensor.from_numpy(np.roll(x, 5 * j), device)
                        for j in range(found.arity)]
                out = tg.AnyTensor.from_numpy(np.zeros(n, np.float32), device)
                _kernels.run_expression(found, args, out)
                got.append(out.numpy().tobytes())
                if found.arity == 2:  # a number as the second operand: pow's uniform cases
                    for number in (1.7, -0.5, 3.0):
                        _kernels.run_expression(found, [args[0], number], out)
                        got.append(out.numpy().tobytes())
            outs.append(got)
        assert outs[0] == outs[1], n
    for width in (16, 24):  # a split's pieces: read in place, 16 lanes where w % 16 == 0
        x = rng.uniform(-6.0, 6.0, (40, 2 * width)).astype(np.float32)
        x.flat[width:width + 3] = [np.inf, np.nan, -0.0]
        outs = []
        for device in devices:
            tape, i = tg.leaf(tg.Tape(device), x)
            tape, (a, b) = tg.split(tape, i, 2, axis=1)
            tape, y = tg.sigmoid(tape, b)
            tape, z = tg.log(tape, a)
            outs.append([tg.value(tape, y).numpy().tobytes(), tg.value(tape, z).numpy().tobytes()])
        assert outs[0] == outs[1], width


def test_kernel_argument_types_come_from_the_c_signature() -> None:
    from tapegrad._device import signatures

    source = """
    typedef double T;
    typedef T8 T8x;
    __kernel void f(__global T* out, __global const T* x, const T scale, const long n,
                    const int flag, __local float* scratch) { }
    __kernel void g(__global uchar* out, const ulong seed) { typedef float T; }
    #define ARGS __global T* out
    __kernel void h(ARGS, const long n) { }
    """
    found = signatures(source)
    assert found["f"] == [None, None, np.dtype(np.float64), np.dtype(np.int64),
                          np.dtype(np.int32), None]
    assert found["g"] == [None, np.dtype(np.uint64)]
    assert "h" not in found  # a macro among the parameters: the kernel states its types


def test_a_family_that_does_not_build_is_named_and_the_others_still_work() -> None:
    """The families are one core program per dtype (one build on a cold start). Where that
    build fails, the device builds each family on its own: the broken family's error names
    it, and every other family's kernels still build and run."""
    device = _device.Device(0, 0, tg.default_device().cl_device)  # a program cache of its own
    _device.register_family("broken_for_test", lambda dtype: (
        "__kernel void broken_for_test(__global T* out) { out[0] = ; }\n"))
    try:
        with pytest.raises(tg.DeviceError, match=r"program broken_for_test\[float32\] failed"):
            device.kernel("broken_for_test", "float32", "broken_for_test", lambda: "")
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        tape, xi = tg.leaf(tg.Tape(device), x)
        tape, total = tg.sum(tape, xi, axis=1)  # the reduce family, built alone
        np.testing.assert_array_equal(tg.value(tape, total).numpy(), x.sum(axis=1))
    finally:
        del _device._FAMILY_SOURCES["broken_for_test"]  # pyright: ignore[reportPrivateUsage]
