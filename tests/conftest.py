"""Fixtures shared by the test modules."""

from collections.abc import Iterator

import pytest

from tapegrad import _device
from tapegrad._jit import force_replays, sweep_replays
from tapegrad._tape import deferring


@pytest.fixture(autouse=True, scope="session")
def inline_lane_when_asked() -> Iterator[None]:
    """The inline lane (PoCL's CPU) builds each program again, on a thread: over the suite's
    thousands of programs, CPU the other tests wait for. It starts only where a test asks
    (tests/test_inline_lane.py); fresh processes keep the default."""
    old = _device.INLINE_AFTER, _device.INLINE_AT_ONCE
    _device.INLINE_AFTER, _device.INLINE_AT_ONCE = 1 << 62, False
    yield
    _device.INLINE_AFTER, _device.INLINE_AT_ONCE = old


@pytest.fixture
def forwards_at_once() -> Iterator[None]:
    """Ops run their forward kernels as they are recorded, not when a value is first needed
    (`_tape.defers`): for tests of which kernels an op itself launches."""
    with deferring(False):
        yield


@pytest.fixture
def fresh_replays() -> Iterator[None]:
    """Replays of sweeps and of deferred forwards on, no structure seen before; the settings
    restored after."""
    was = sweep_replays.enabled, force_replays.enabled
    for replays in (sweep_replays, force_replays):
        replays.enabled = True
        replays.clear()
    try:
        yield
    finally:
        sweep_replays.enabled, force_replays.enabled = was
        sweep_replays.clear()
        force_replays.clear()
