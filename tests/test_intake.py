"""The intake's clock: the running backend's, read with as few calls as possible."""

from __future__ import annotations

import anyio
import pytest

from anykpl._intake import offset_clock
from anykpl._producer import _backend_clock

pytestmark = pytest.mark.anyio


def test_offset_clock_adds_the_offset_to_each_reading() -> None:
    readings = iter([1.0, 2.5])
    clock = offset_clock(lambda: next(readings), 100.0)
    assert (clock(), clock()) == (101.0, 102.5)


async def test_the_backend_clock_reads_the_backends_time() -> None:
    clock = _backend_clock()
    before = anyio.current_time()
    now = clock()
    after = anyio.current_time()
    assert before <= now <= after


@pytest.mark.autojump
async def test_under_a_mock_clock_the_backend_clock_follows_it() -> None:
    clock = _backend_clock()
    start = clock()
    await anyio.sleep(30)  # no real time passes: the mock clock jumps
    assert clock() - start == pytest.approx(30, abs=1e-6)
    assert clock() == anyio.current_time()
