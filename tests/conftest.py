"""Fixtures shared by the test modules."""

from collections.abc import Iterator

import pytest

from tapegrad._tape import deferring


@pytest.fixture
def forwards_at_once() -> Iterator[None]:
    """Ops run their forward kernels as they are recorded, not when a value is first needed
    (`_tape.defers`): for tests of which kernels an op itself launches."""
    with deferring(False):
        yield
