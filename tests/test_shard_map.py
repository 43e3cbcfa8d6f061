"""The shard map: pure prediction and update logic, and the async refresh shell."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from anykpl._core import _shard_map
from anykpl._core._limits import MAX_HASH_KEY as MAX_HASH
from anykpl._core._shard_map import ShardMap, ShardMapState, shard_number
from anykpl._runtime._shard_refresh import run_shard_map

from .fakes import FakeKinesis, even_ranges


def _shard(number: int, start: int, end: int, *, closed: bool = False) -> Mapping[str, Any]:
    sequence_range = {"StartingSequenceNumber": "1"}
    if closed:
        sequence_range["EndingSequenceNumber"] = "2"
    return {
        "ShardId": f"shardId-{number:012d}",
        "HashKeyRange": {"StartingHashKey": str(start), "EndingHashKey": str(end)},
        "SequenceNumberRange": sequence_range,
    }


def _ready_map(shards: list[Mapping[str, Any]], now: float = 10.0) -> ShardMap:
    shard_map = ShardMap()
    assert shard_map.begin_update()
    shard_map.apply_page(shards)
    shard_map.finish_update(now)
    return shard_map


def _even_shards(count: int) -> list[Mapping[str, Any]]:
    return [_shard(i, start, end) for i, (start, end) in enumerate(even_ranges(count))]


# -- prediction ---------------------------------------------------------------------------


def test_new_map_is_invalid_and_predicts_nothing() -> None:
    shard_map = ShardMap()
    assert shard_map.state is ShardMapState.INVALID
    assert shard_map.refresh_requested
    assert shard_map.shard_id(0) is None
    assert shard_map.open_shards == ()
    assert "INVALID" in repr(shard_map)


def test_prediction_at_range_boundaries() -> None:
    ranges = even_ranges(4)
    shard_map = _ready_map(_even_shards(4))
    assert shard_map.state is ShardMapState.READY
    assert shard_map.shard_id(0) == "shardId-000000000000"
    assert shard_map.shard_id(MAX_HASH) == "shardId-000000000003"
    for i, (start, end) in enumerate(ranges):
        expected = f"shardId-{i:012d}"
        assert shard_map.shard_id(start) == expected
        assert shard_map.shard_id(end) == expected
        assert shard_map.shard_id((start + end) // 2) == expected
        if i + 1 < len(ranges):
            assert shard_map.shard_id(end + 1) == f"shardId-{i + 1:012d}"


def test_prediction_sorts_pages_given_out_of_order() -> None:
    shards = _even_shards(3)
    shard_map = ShardMap()
    shard_map.begin_update()
    shard_map.apply_page([shards[2]])
    shard_map.apply_page([shards[0], shards[1]])
    shard_map.finish_update(1.0)
    assert shard_map.open_shards == tuple(s["ShardId"] for s in shards)
    assert shard_map.shard_id(0) == "shardId-000000000000"
    assert shard_map.shard_id(MAX_HASH) == "shardId-000000000002"


def test_single_shard_covers_everything() -> None:
    shard_map = _ready_map([_shard(0, 0, MAX_HASH)])
    assert shard_map.shard_id(0) == shard_map.shard_id(MAX_HASH) == "shardId-000000000000"


def test_closed_shards_are_not_predicted_but_their_ranges_are_cached() -> None:
    half = MAX_HASH // 2
    shards = [
        _shard(0, 0, MAX_HASH, closed=True),
        _shard(1, 0, half),
        _shard(2, half + 1, MAX_HASH),
    ]
    shard_map = _ready_map(shards)
    assert shard_map.open_shards == ("shardId-000000000001", "shardId-000000000002")
    assert shard_map.shard_id(0) == "shardId-000000000001"
    assert shard_map.shard_id(half + 1) == "shardId-000000000002"
    assert shard_map.hash_range("shardId-000000000000") == (0, MAX_HASH)
    assert shard_map.hash_range("shardId-000000000001") == (0, half)
    assert shard_map.hash_range("shardId-000000000009") is None


def test_closed_shard_ranges_survive_a_refresh_then_expire() -> None:
    shard_map = _ready_map(_even_shards(2), now=0.0)
    # shard 0 was split: the next refresh no longer lists it
    half = MAX_HASH // 4
    shard_map.begin_update()
    shard_map.apply_page(
        [
            _shard(1, *even_ranges(2)[1]),
            _shard(2, 0, half),
            _shard(3, half + 1, even_ranges(2)[0][1]),
        ]
    )
    shard_map.finish_update(100.0)
    assert "shardId-000000000000" not in shard_map.open_shards
    assert shard_map.hash_range("shardId-000000000000") == even_ranges(2)[0]
    shard_map.drop_closed_ranges(100.0 + _shard_map.CLOSED_SHARD_TTL)
    assert shard_map.hash_range("shardId-000000000000") is not None
    shard_map.drop_closed_ranges(100.0 + _shard_map.CLOSED_SHARD_TTL + 1)
    assert shard_map.hash_range("shardId-000000000000") is None
    assert shard_map.hash_range("shardId-000000000002") == (0, half)


def test_nothing_predicted_while_updating() -> None:
    shard_map = _ready_map(_even_shards(2))
    assert shard_map.begin_update()
    assert shard_map.state is ShardMapState.UPDATING
    assert not shard_map.begin_update()  # one refresh at a time
    assert shard_map.shard_id(0) is None
    shard_map.apply_page(_even_shards(2))
    shard_map.finish_update(20.0)
    assert shard_map.shard_id(0) == "shardId-000000000000"
    assert shard_map.updated_at == 20.0
    assert shard_map.updates == 2


@pytest.mark.parametrize(
    ("shard_id", "number"),
    [("shardId-000000000042", 42), ("shardId-000000000000", 0), ("garbage", -1)],
)
def test_shard_number(shard_id: str, number: int) -> None:
    assert shard_number(shard_id) == number


# -- backoff --------------------------------------------------------------------------------


def test_failure_backoff_grows_by_half_to_thirty_seconds() -> None:
    shard_map = ShardMap()
    delays = []
    for _ in range(12):
        shard_map.begin_update()
        delays.append(shard_map.fail_update())
        assert shard_map.state is ShardMapState.INVALID
        assert shard_map.shard_id(0) is None
    assert delays[:5] == pytest.approx([1.0, 1.5, 2.25, 3.375, 5.0625])
    assert all(b == pytest.approx(min(30.0, a * 1.5)) for a, b in itertools.pairwise(delays))
    assert max(delays) == 30.0
    assert delays[-1] == 30.0


def test_a_page_resets_the_backoff() -> None:
    shard_map = ShardMap()
    for _ in range(4):
        shard_map.begin_update()
        shard_map.fail_update()
    shard_map.begin_update()
    shard_map.apply_page(_even_shards(1))
    shard_map.finish_update(1.0)
    shard_map.begin_update()
    assert shard_map.fail_update() == 1.0


# -- invalidation guard ---------------------------------------------------------------------


def test_invalidate_requests_a_refresh() -> None:
    shard_map = _ready_map(_even_shards(2), now=10.0)
    assert not shard_map.refresh_requested
    assert shard_map.invalidate(10.5, "shardId-000000000000")
    assert shard_map.refresh_requested


def test_an_invalidated_map_predicts_nothing_until_refreshed() -> None:
    """As the KPL's: records must not go to the stale ranges while the refresh task has not
    run yet (on trio it may not run for a while), which sent them to the wrong shard again."""
    shard_map = _ready_map(_even_shards(2), now=10.0)
    assert shard_map.shard_id(5) == "shardId-000000000000"
    assert shard_map.invalidate(10.5, "shardId-000000000000")
    assert shard_map.state is ShardMapState.INVALID
    assert shard_map.shard_id(5) is None
    # a second failure meanwhile asks for nothing more
    assert not shard_map.invalidate(10.6, "shardId-000000000000")
    assert shard_map.begin_update()
    shard_map.apply_page(_even_shards(4))
    shard_map.finish_update(11.0)
    assert shard_map.shard_id(5) == "shardId-000000000000"


def test_invalidate_without_prediction_requests_a_refresh() -> None:
    shard_map = _ready_map(_even_shards(2), now=10.0)
    assert shard_map.invalidate(10.5, None)
    assert shard_map.refresh_requested


@pytest.mark.parametrize("seen_at", [9.0, 10.0])
def test_invalidate_ignores_requests_that_started_before_the_refresh(seen_at: float) -> None:
    shard_map = _ready_map(_even_shards(2), now=10.0)
    assert not shard_map.invalidate(seen_at, "shardId-000000000000")
    assert not shard_map.refresh_requested


def test_invalidate_ignores_predictions_against_a_shard_that_is_not_open() -> None:
    shard_map = _ready_map(_even_shards(2), now=10.0)
    assert not shard_map.invalidate(11.0, "shardId-000000000007")
    assert not shard_map.refresh_requested


@pytest.mark.parametrize("state", [ShardMapState.INVALID, ShardMapState.UPDATING])
def test_invalidate_only_when_ready(state: ShardMapState) -> None:
    shard_map = _ready_map(_even_shards(2), now=10.0)
    if state is ShardMapState.UPDATING:
        shard_map.begin_update()
    else:
        shard_map.begin_update()
        shard_map.fail_update()
        shard_map.refresh_requested = False
    assert not shard_map.invalidate(11.0, "shardId-000000000000")
    assert not shard_map.refresh_requested


# -- the async shell -------------------------------------------------------------------------


class _Wake:
    """The ``wake`` callable run_shard_map takes: a fresh event per call, kept for the test."""

    def __init__(self) -> None:
        self.event: anyio.Event | None = None

    def __call__(self) -> anyio.Event:
        self.event = anyio.Event()
        return self.event


async def _wait_until(predicate: Any, limit: float = 5.0) -> None:
    """Poll ``predicate`` (the shard map has no event to wait on)."""
    with anyio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_pagination_sends_only_next_token_on_later_pages() -> None:
    fake = FakeKinesis(shard_count=5)
    fake.page_size = 2
    shard_map = ShardMap()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_shard_map, shard_map, "stream", fake.list_shards, _Wake())
        await _wait_until(lambda: shard_map.state is ShardMapState.READY)
        tg.cancel_scope.cancel()
    assert len(fake.list_shards_calls) == 3
    first, *later = fake.list_shards_calls
    assert first == {
        "StreamName": "stream",
        "MaxResults": 1000,
        "ShardFilter": {"Type": "AT_LATEST"},
    }
    assert [call["NextToken"] for call in later] == ["2", "4"]
    for call in later:
        # sending NextToken together with the stream name (or filter) is rejected (KPL #481)
        assert set(call) <= {"NextToken", "MaxResults"}
    assert shard_map.open_shards == tuple(s.shard_id for s in fake.shards)
    assert shard_map.shard_id(MAX_HASH) == "shardId-000000000004"


@pytest.mark.anyio
async def test_refresh_on_request_picks_up_a_split() -> None:
    fake = FakeKinesis(shard_count=2)
    shard_map = ShardMap()
    wake = _Wake()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_shard_map, shard_map, "stream", fake.list_shards, wake)
        await _wait_until(lambda: shard_map.state is ShardMapState.READY)
        fake.split("shardId-000000000000")
        await anyio.sleep(0.01)
        assert shard_map.updates == 1  # there is no periodic refresh
        assert shard_map.invalidate(anyio.current_time(), "shardId-000000000000")
        assert wake.event is not None
        wake.event.set()
        await _wait_until(lambda: shard_map.updates == 2)
        tg.cancel_scope.cancel()
    assert shard_map.open_shards == (
        "shardId-000000000002",
        "shardId-000000000003",
        "shardId-000000000001",
    )
    assert shard_map.hash_range("shardId-000000000000") == (
        fake.shards[0].start,
        fake.shards[0].end,
    )


@pytest.mark.autojump
class TestOnMockClock:
    @pytest.mark.anyio
    async def test_failed_refreshes_back_off(self) -> None:
        fake = FakeKinesis(shard_count=2)
        fake.list_shards_errors = [RuntimeError("boom")] * 5
        call_times: list[float] = []
        shard_map = ShardMap()

        async def list_shards(**kwargs: Any) -> Mapping[str, Any]:
            call_times.append(anyio.current_time())
            return await fake.list_shards(**kwargs)

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_shard_map, shard_map, "stream", list_shards, _Wake())
            await _wait_until(lambda: shard_map.state is ShardMapState.READY, limit=100)
            tg.cancel_scope.cancel()
        gaps = [b - a for a, b in itertools.pairwise(call_times)]
        assert call_times[0] == pytest.approx(start)
        assert gaps == pytest.approx([1.0, 1.5, 2.25, 3.375, 5.0625], abs=0.01)
        assert shard_map.backoff == 1.0

    @pytest.mark.anyio
    async def test_closed_ranges_are_dropped_a_while_after_a_refresh(self) -> None:
        fake = FakeKinesis(shard_count=2)
        shard_map = ShardMap()
        wake = _Wake()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_shard_map, shard_map, "stream", fake.list_shards, wake)
            await _wait_until(lambda: shard_map.state is ShardMapState.READY)
            fake.split("shardId-000000000000")
            shard_map.invalidate(anyio.current_time() + 1, None)
            assert wake.event is not None
            wake.event.set()
            await _wait_until(lambda: shard_map.updates == 2)
            # FakeKinesis lists the closed parent too; it is cached, never predicted
            assert shard_map.hash_range("shardId-000000000000") is not None
            assert "shardId-000000000000" not in shard_map.open_shards
            fake.shards = [s for s in fake.shards if s.open]
            shard_map.invalidate(anyio.current_time() + 1, None)
            wake.event.set()
            await _wait_until(lambda: shard_map.updates == 3)
            assert shard_map.hash_range("shardId-000000000000") is not None
            await anyio.sleep(_shard_map.CLOSED_SHARD_TTL * 1.6)
            tg.cancel_scope.cancel()
        assert shard_map.hash_range("shardId-000000000000") is None
        assert shard_map.hash_range("shardId-000000000002") is not None
