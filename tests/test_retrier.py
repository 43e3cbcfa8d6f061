"""The Retrier: outcome classification, results, retries with backoff (pure, virtual time)."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest

from anykpl import errors
from anykpl._core._limits import MAX_HASH_KEY as MAX_HASH
from anykpl._core._records import Attempt, KinesisRecord, Record
from anykpl._core._retrier import Observe, Outcome, Retrier, StatisticSet
from anykpl._core._shard_map import ShardMap

HALF = MAX_HASH // 2
SHARD_0 = "shardId-000000000000"
SHARD_1 = "shardId-000000000001"
THROTTLED = "ProvisionedThroughputExceededException"


def _shard(shard_id: str, start: int, end: int) -> dict[str, Any]:
    return {
        "ShardId": shard_id,
        "HashKeyRange": {"StartingHashKey": str(start), "EndingHashKey": str(end)},
        "SequenceNumberRange": {"StartingSequenceNumber": "1"},
    }


class _StubRandom(random.Random):
    """Records every ``uniform`` bound and returns the upper one (the longest backoff)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.bounds: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.bounds.append((a, b))
        return b


class Harness:
    def __init__(
        self,
        *,
        fail_if_throttled: bool = False,
        rng: random.Random | None = None,
        record_max_buffered_time: float = 0.1,
        backoff_initial: float = 0.05,
        backoff_max: float = 1.0,
        observe: Observe | None = None,
    ) -> None:
        self.shard_map = ShardMap()
        self.shard_map.begin_update()
        self.shard_map.apply_page([_shard(SHARD_0, 0, HALF), _shard(SHARD_1, HALF + 1, MAX_HASH)])
        self.shard_map.finish_update(0.0)
        self.finished: list[tuple[list[Record], bool]] = []
        self.counts: list[tuple[str, int, str | None, str | None]] = []
        self.refreshes = 0
        self.retrier = Retrier(
            stream="stream",
            shard_map=self.shard_map,
            finish=self._finish,
            count=self._count,
            request_refresh=self._refresh,
            record_max_buffered_time=record_max_buffered_time,
            fail_if_throttled=fail_if_throttled,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            rng=rng,
            observe=observe,
        )

    def _finish(self, records: Sequence[Record], success: bool) -> None:
        for record in records:
            assert not record.done(), "a record was finished twice"
            record.resolve(success)
        self.finished.append((list(records), success))

    def _count(self, name: str, value: int, shard: str | None, code: str | None) -> None:
        self.counts.append((name, value, shard, code))

    def _refresh(self) -> None:
        self.refreshes += 1

    def count_of(self, name: str, code: str | None = None) -> int:
        return sum(v for n, v, _, c in self.counts if n == name and (code is None or c == code))


def make_record(hash_key: int = 1, *, arrival: float = 0.0, expiration: float = 30.0) -> Record:
    return Record(
        "stream", f"pk{hash_key}", b"data", hash_key, None, arrival, arrival + 0.1, expiration
    )


def make_kinesis_record(records: list[Record], predicted: str | None = SHARD_0) -> KinesisRecord:
    for record in records:
        record.predicted_shard = predicted
    first = records[0]
    deadline = min(r.deadline for r in records)
    expiration = min(r.expiration for r in records)
    return KinesisRecord(records, b"x", "a", str(first.hash_key), predicted, deadline, expiration)


def ok(shard: str = SHARD_0, sequence: str = "49") -> dict[str, str]:
    return {"ShardId": shard, "SequenceNumber": sequence}


def err(code: str, message: str = "nope") -> dict[str, str]:
    return {"ErrorCode": code, "ErrorMessage": message}


def outcome(
    krs: list[KinesisRecord],
    entries: list[dict[str, str]] | None,
    *,
    start: float = 1.0,
    end: float = 1.5,
    code: str | None = None,
) -> Outcome:
    response = None if entries is None else {"Records": entries}
    return Outcome("stream", krs, start, end, response, code, None if code is None else "boom")


def attempts(record: Record) -> tuple[Attempt, ...]:
    try:
        return record.result().attempts
    except errors.RecordFailedError as exc:
        return exc.result.attempts


def codes(record: Record) -> list[str | None]:
    return [a.error_code for a in record.build_result().attempts]


# -- success ---------------------------------------------------------------------------------


def test_success_resolves_every_user_record_with_its_position() -> None:
    h = Harness()
    records = [make_record(i) for i in (1, 2, 3)]
    h.retrier.handle(outcome([make_kinesis_record(records)], [ok(sequence="77")]), now=1.5)
    assert h.finished == [(records, True)]
    for index, record in enumerate(records):
        result = record.result()
        assert result.success
        assert result.shard_id == SHARD_0
        assert result.sequence_number == "77"
        assert result.sub_sequence_number == index
        (attempt,) = result.attempts
        assert attempt.success
        assert attempt.error_code is None
    assert h.count_of("KinesisRecordsPut") == 1
    assert h.count_of("UserRecordsPut") == 3
    assert h.refreshes == 0


def test_one_response_gives_one_statistic_set_per_metric_and_shard() -> None:
    """What the metrics merge (see test_metrics.py): per metric and shard, the samples of the
    whole response — with the KPL's 0 samples for the failed Kinesis records."""
    seen: dict[tuple[str, str | None], StatisticSet] = {}

    def observe(name: str, shard: str | None, code: str | None, stats: StatisticSet) -> None:
        assert (name, shard) not in seen, "one call per metric and shard"
        seen[name, shard] = stats

    h = Harness(observe=observe)
    delivered = make_kinesis_record([make_record(1), make_record(2)])
    failed = make_kinesis_record([make_record(3)])
    other = make_kinesis_record([make_record(HALF + 5)], predicted=SHARD_1)
    response = [ok(), err("InternalFailure"), ok(shard=SHARD_1)]
    h.retrier.handle(outcome([delivered, failed, other], response, start=1.0, end=1.5), now=1.5)
    size = delivered.size
    assert seen == {
        ("RequestTime", None): StatisticSet(1, 500.0, 500.0, 500.0),
        ("KinesisRecordsPerPutRecordsRequest", None): StatisticSet(1, 3, 3, 3),
        ("UserRecordsPerPutRecordsRequest", None): StatisticSet(1, 4, 4, 4),
        ("UserRecordsPerKinesisRecord", SHARD_0): StatisticSet(2, 3, 1, 2),
        ("UserRecordsPerKinesisRecord", SHARD_1): StatisticSet(1, 1, 1, 1),
        ("BufferingTime", SHARD_0): StatisticSet(2, 2000.0, 1000.0, 1000.0),
        ("BufferingTime", SHARD_1): StatisticSet(1, 1000.0, 1000.0, 1000.0),
        ("KinesisRecordsPut", SHARD_0): StatisticSet(2, 1, 0.0, 1.0),
        ("KinesisRecordsPut", SHARD_1): StatisticSet(1, 1, 1.0, 1.0),
        ("AllErrors", SHARD_0): StatisticSet(2, 1, 0.0, 1.0),
        ("AllErrors", SHARD_1): StatisticSet(1, 0, 0.0, 0.0),
        ("KinesisRecordsDataPut", SHARD_0): StatisticSet(1, size, size, size),
        ("KinesisRecordsDataPut", SHARD_1): StatisticSet(1, other.size, other.size, other.size),
        ("UserRecordsPut", SHARD_0): StatisticSet(2, 2, 1, 1),
        ("UserRecordsPut", SHARD_1): StatisticSet(1, 1, 1, 1),
        ("UserRecordsDataPut", SHARD_0): StatisticSet(2, 8, 4, 4),  # b"data" each
        ("UserRecordsDataPut", SHARD_1): StatisticSet(1, 4, 4, 4),
    }


def test_the_user_records_sizes_are_counted_per_shard_over_the_whole_response() -> None:
    seen: dict[tuple[str, str | None], StatisticSet] = {}
    h = Harness(observe=lambda name, shard, code, stats: seen.__setitem__((name, shard), stats))
    records = [make_record(n) for n in range(1, 7)]
    for record, size in zip(records, (5, 2, 9, 4, 3, 1), strict=True):
        record.data = b"d" * size
    first, second = make_kinesis_record(records[:4]), make_kinesis_record(records[4:])
    h.retrier.handle(outcome([first, second], [ok(), ok()], start=1.0, end=1.5), now=1.5)
    assert seen["UserRecordsDataPut", SHARD_0] == StatisticSet(6, 24, 1, 9)
    assert [r.sub_sequence_number for r in records] == [0, 1, 2, 3, 0, 1]


def test_entries_are_matched_by_position() -> None:
    h = Harness()
    a, b, c = make_record(1), make_record(2), make_record(3)
    krs = [make_kinesis_record([a]), make_kinesis_record([b]), make_kinesis_record([c])]
    h.retrier.handle(outcome(krs, [ok(sequence="1"), err(THROTTLED), ok(sequence="3")]), 1.5)
    assert a.result().sequence_number == "1"
    assert c.result().sequence_number == "3"
    assert not b.done()
    assert h.retrier.delayed_records == 1


# -- per-record errors and request failures --------------------------------------------------


def test_throttled_record_is_retried_after_a_full_jitter_backoff() -> None:
    h = Harness(rng=random.Random(1234))
    record = make_record()
    h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED)]), now=2.0)
    assert h.finished == []
    assert h.retrier.delayed_records == 1
    release = h.retrier.next_release
    assert 2.0 <= release <= 2.0 + 0.05
    assert record.deadline == pytest.approx(release + 0.05)  # RMBT / 2 after the release
    assert h.retrier.take_due(release - 1e-9) == [] or release == 2.0
    assert h.retrier.take_due(release) == [record]
    assert h.retrier.delayed_records == 0
    assert codes(record) == [THROTTLED]
    assert h.count_of("ErrorsByCode", THROTTLED) == 1
    assert h.count_of("RetriesPerRecord") == 1


def test_backoff_doubles_per_shard_up_to_the_maximum_and_a_success_resets_it() -> None:
    rng = _StubRandom()
    h = Harness(rng=rng, backoff_initial=0.05, backoff_max=0.5)
    record = make_record()
    now = 1.0
    for _ in range(6):
        h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED)]), now)
        now = h.retrier.next_release
        assert h.retrier.take_due(now) == [record]
    assert [b for _, b in rng.bounds] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    assert all(a == 0.0 for a, _ in rng.bounds)
    # another shard has its own streak
    other = make_record(HALF + 5)
    h.retrier.handle(outcome([make_kinesis_record([other], SHARD_1)], [err(THROTTLED)]), now)
    assert rng.bounds[-1] == (0.0, 0.05)
    # a success on shard 0 resets its streak
    h.retrier.handle(outcome([make_kinesis_record([record])], [ok()]), now)
    h.retrier.handle(outcome([make_kinesis_record([make_record()])], [err(THROTTLED)]), now)
    assert rng.bounds[-1] == (0.0, 0.05)


def test_a_streak_of_any_length_backs_off_at_most_the_maximum() -> None:
    # an endpoint that refuses every request for long enough: the backoff's doubling stops at
    # its maximum, a streak of thousands of failed outcomes included (2.0 ** 1024 overflows)
    rng = _StubRandom()
    h = Harness(rng=rng, backoff_initial=0.05, backoff_max=0.5)
    record = make_record(expiration=math.inf)
    now = 1.0
    for _ in range(1_100):
        h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED)]), now)
        now = h.retrier.next_release
        assert h.retrier.take_due(now) == [record]
    assert rng.bounds[-1] == (0.0, 0.5)
    assert not record.done()


@pytest.mark.parametrize("seed", range(20))
def test_full_jitter_delay_is_within_the_bound(seed: int) -> None:
    h = Harness(rng=random.Random(seed), backoff_initial=0.05, backoff_max=1.0)
    record = make_record()
    now = 10.0
    for streak in range(8):
        h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED)]), now)
        delay = h.retrier.next_release - now
        assert 0.0 <= delay <= min(1.0, 0.05 * 2**streak)
        now = h.retrier.next_release
        h.retrier.take_due(now)


def test_fail_if_throttled_fails_at_once() -> None:
    h = Harness(fail_if_throttled=True)
    record = make_record()
    h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED, "slow")]), 1.5)
    assert h.finished == [([record], False)]
    with pytest.raises(errors.RecordFailedError) as info:
        record.result()
    assert info.value.error_code == THROTTLED
    assert h.retrier.delayed_records == 0


def test_fail_if_throttled_retries_other_codes() -> None:
    h = Harness(fail_if_throttled=True)
    record = make_record()
    h.retrier.handle(outcome([make_kinesis_record([record])], [err("InternalFailure")]), 1.5)
    assert h.finished == []
    assert h.retrier.delayed_records == 1


NON_RETRIABLE = [
    "ResourceNotFoundException",
    "AccessDeniedException",
    "KMSAccessDeniedException",
    "KMSDisabledException",
    "KMSInvalidStateException",
    "KMSNotFoundException",
    "KMSOptInRequired",
    "ValidationException",
    "InvalidArgumentException",
    "UnrecognizedClientException",
]
RETRIABLE = [
    THROTTLED,
    "InternalFailure",
    "ServiceUnavailable",
    "HTTP500",
    "HTTP503",
    errors.TIMEOUT,
    errors.CONNECTION_ERROR,
    "SomethingNobodyHasSeenBefore",
]


@pytest.mark.parametrize("code", NON_RETRIABLE)
@pytest.mark.parametrize("level", ["request", "record"])
def test_non_retriable_codes_fail_at_once(code: str, level: str) -> None:
    h = Harness()
    records = [make_record(1), make_record(2)]
    kr = make_kinesis_record(records)
    if level == "request":
        h.retrier.handle(outcome([kr], None, code=code), 1.5)
    else:
        h.retrier.handle(outcome([kr], [err(code)]), 1.5)
    assert h.finished == [(records, False)]
    for record in records:
        (attempt,) = attempts(record)
        assert not attempt.success
        assert attempt.error_code == code
    assert h.retrier.delayed_records == 0
    assert h.count_of("ErrorsByCode", code) == 1


@pytest.mark.parametrize("code", RETRIABLE)
@pytest.mark.parametrize("level", ["request", "record"])
def test_retriable_codes_are_retried(code: str, level: str) -> None:
    h = Harness()
    records = [make_record(1), make_record(2)]
    kr = make_kinesis_record(records)
    if level == "request":
        h.retrier.handle(outcome([kr], None, code=code), 1.5)
    else:
        h.retrier.handle(outcome([kr], [err(code)]), 1.5)
    assert h.finished == []
    assert h.retrier.delayed_records == 2
    assert h.retrier.take_due(h.retrier.next_release) == records
    assert codes(records[0]) == [code]


def test_request_failure_retries_every_kinesis_record() -> None:
    h = Harness()
    krs = [make_kinesis_record([make_record(i)]) for i in range(5)]
    h.retrier.handle(outcome(krs, None, code="HTTP500"), 1.5)
    assert h.retrier.delayed_records == 5
    assert h.count_of("ErrorsByCode", "HTTP500") == 1
    assert h.count_of("AllErrors") == 1


def test_one_outcome_advances_a_shards_backoff_once() -> None:
    rng = _StubRandom()
    h = Harness(rng=rng, backoff_initial=0.05, backoff_max=5.0)
    # twenty Kinesis records for shard 0 in one failed request: one step of backoff
    krs = [make_kinesis_record([make_record(i)]) for i in range(20)]
    h.retrier.handle(outcome(krs, None, code="HTTP500"), 1.0)
    assert {b for _, b in rng.bounds} == {0.05}
    # the next failure takes the next step, for every record in it
    krs = [make_kinesis_record([make_record(i)]) for i in range(3)]
    h.retrier.handle(outcome(krs, [err(THROTTLED)] * 3), 2.0)
    assert [b for _, b in rng.bounds[20:]] == pytest.approx([0.1, 0.1, 0.1])


def test_record_count_mismatch_fails_everything() -> None:
    h = Harness()
    a, b = make_record(1), make_record(2)
    krs = [make_kinesis_record([a]), make_kinesis_record([b])]
    h.retrier.handle(outcome(krs, [ok()]), 1.5)
    assert sorted(id(r) for recs, ok_ in h.finished for r in recs if not ok_) == sorted(
        [id(a), id(b)]
    )
    for record in (a, b):
        assert codes(record) == [errors.RECORD_COUNT_MISMATCH]
    assert h.retrier.delayed_records == 0


# -- expiry ---------------------------------------------------------------------------------


def test_expiry_on_the_retry_path_adds_an_expired_attempt() -> None:
    h = Harness()
    fresh = make_record(1, expiration=30.0)
    stale = make_record(2, expiration=1.0)
    h.retrier.handle(outcome([make_kinesis_record([fresh, stale])], [err(THROTTLED)]), 2.0)
    assert h.finished == [([stale], False)]
    assert codes(stale) == [THROTTLED, errors.EXPIRED]
    with pytest.raises(errors.RecordFailedError) as info:
        stale.result()
    assert info.value.error_code == errors.EXPIRED
    assert h.retrier.delayed_records == 1
    assert h.count_of("UserRecordExpired") == 1


def test_retry_deadline_is_clamped_to_the_expiration() -> None:
    h = Harness(rng=_StubRandom(), record_max_buffered_time=10.0)
    record = make_record(expiration=2.1)
    h.retrier.handle(outcome([make_kinesis_record([record])], [err(THROTTLED)]), 2.0)
    assert record.deadline == 2.1


def test_expired_in_the_limiter() -> None:
    h = Harness()
    records = [make_record(1), make_record(2)]
    h.retrier.expire([make_kinesis_record(records)], now=5.0)
    assert h.finished == [(records, False)]
    (attempt,) = attempts(records[0])
    assert attempt.error_code == errors.EXPIRED
    assert "limiter" in (attempt.error_message or "")
    assert attempt.duration == 0.0
    assert attempt.delay == 5.0


# -- wrong shard -----------------------------------------------------------------------------


def test_wrong_shard_out_of_range_is_retried_and_invalidates() -> None:
    h = Harness(rng=_StubRandom())
    record = make_record(1)  # in shard 0's range
    kr = make_kinesis_record([record], SHARD_0)
    h.retrier.handle(outcome([kr], [ok(shard=SHARD_1)], start=1.0), now=1.5)
    assert h.finished == []
    assert codes(record) == [errors.WRONG_SHARD]
    assert h.refreshes == 1
    assert h.shard_map.refresh_requested
    # no backoff: the refreshed map is the fix
    assert h.retrier.next_release == 1.5
    assert h.retrier.take_due(1.5) == [record]
    assert h.count_of("ErrorsByCode", errors.WRONG_SHARD) == 1


def test_wrong_shard_aggregate_with_one_record_out_of_range_retries_all() -> None:
    h = Harness()
    inside = make_record(HALF + 10)  # in shard 1's range
    outside = make_record(10)  # in shard 0's range
    kr = make_kinesis_record([inside, outside], SHARD_0)
    h.retrier.handle(outcome([kr], [ok(shard=SHARD_1)], start=1.0), now=1.5)
    assert h.finished == []
    assert codes(inside) == codes(outside) == [errors.WRONG_SHARD]
    assert h.retrier.delayed_records == 2


def _learn_closed_range(h: Harness, shard_id: str, start: int, end: int) -> None:
    """Refresh the harness's map with one more, closed, shard (cached, never predicted)."""
    closed = _shard(shard_id, start, end)
    closed["SequenceNumberRange"]["EndingSequenceNumber"] = "2"
    h.shard_map.begin_update()
    h.shard_map.apply_page([_shard(SHARD_0, 0, HALF), _shard(SHARD_1, HALF + 1, MAX_HASH), closed])
    h.shard_map.finish_update(0.0)


def test_landing_in_a_lower_shard_whose_range_holds_every_record_succeeds() -> None:
    h = Harness()
    records = [make_record(10), make_record(20)]  # in shard 0's range
    kr = make_kinesis_record(records, "shardId-000000000005")
    h.retrier.handle(outcome([kr], [ok(shard=SHARD_0)], start=1.0), 1.5)
    assert h.finished == [(records, True)]
    assert [r.result().shard_id for r in records] == [SHARD_0, SHARD_0]
    assert h.refreshes == 0  # predicted > actual: nothing to converge


def test_landing_in_a_child_with_every_record_in_range_succeeds_and_invalidates() -> None:
    h = Harness()
    child = "shardId-000000000002"
    _learn_closed_range(h, child, 0, HALF // 2)
    records = [make_record(5), make_record(6)]
    kr = make_kinesis_record(records, SHARD_0)
    h.retrier.handle(outcome([kr], [ok(shard=child)], start=1.0), 1.5)
    assert h.finished == [(records, True)]
    assert [r.result().shard_id for r in records] == [child, child]
    assert h.refreshes == 1  # predicted < actual: the map is stale, help it converge


CHILD = "shardId-000000000002"


def _refresh_with_child(h: Harness, start: int, end: int) -> None:
    """The refresh after a split of shard 0: the child ``CHILD`` holds ``start``..``end``."""
    assert h.shard_map.begin_update()
    h.shard_map.apply_page(
        [_shard(SHARD_1, HALF + 1, MAX_HASH), _shard(CHILD, start, end)]
        + ([_shard("shardId-000000000003", end + 1, HALF)] if end < HALF else [])
    )
    h.shard_map.finish_update(2.0)


def _held_aggregate(h: Harness, *keys: int) -> list[Record]:
    records = [make_record(key) for key in keys]
    kr = make_kinesis_record(records, SHARD_0)
    h.retrier.handle(outcome([kr], [ok(shard=CHILD, sequence="77")], start=1.0), 1.5)
    return records


def test_an_aggregate_of_several_keys_in_an_unknown_shard_waits_for_the_map() -> None:
    """Under load, an aggregate can land in a child of a split before the map has seen the
    child. Whether a reader keeps it depends on the child's range: the outcome is held until
    the map is refreshed, not retried at once (a needless second copy of every record)."""
    h = Harness()
    records = _held_aggregate(h, 5, 6)
    assert h.finished == []
    assert h.retrier.held_records == 2
    assert h.retrier.delayed_records == 0
    assert codes(records[0]) == []  # nothing decided yet
    assert h.refreshes == 1
    assert h.shard_map.refresh_requested
    _refresh_with_child(h, 0, HALF // 2)
    h.retrier.settle_held(2.5)
    assert h.finished == [(records, True)]
    assert [r.result().shard_id for r in records] == [CHILD, CHILD]
    assert [r.result().sub_sequence_number for r in records] == [0, 1]
    assert [r.result().sequence_number for r in records] == ["77", "77"]
    (attempt,) = records[0].result().attempts
    assert attempt.success
    assert attempt.duration == pytest.approx(0.5)  # the request's (1.0 to 1.5), not the wait
    assert h.retrier.held_records == 0
    assert h.count_of("UserRecordsPut") == 2


def test_a_held_aggregate_out_of_its_shards_range_is_retried_as_wrong_shard() -> None:
    h = Harness(rng=_StubRandom())
    records = _held_aggregate(h, 5, HALF - 5)
    _refresh_with_child(h, 0, HALF // 2)
    h.retrier.settle_held(2.5)
    assert h.finished == []
    assert codes(records[0]) == codes(records[1]) == [errors.WRONG_SHARD]
    assert h.retrier.take_due(2.5) == records  # no backoff: the refreshed map is the fix


def test_a_refresh_under_way_when_the_outcome_came_does_not_decide_it() -> None:
    """A refresh that started before the record landed may have listed the shards before the
    child existed: it takes the refresh after it to give up on the shard."""
    h = Harness()
    assert h.shard_map.begin_update()  # a refresh is under way
    records = _held_aggregate(h, 5, 6)
    assert h.shard_map.refresh_requested  # another one after it
    h.shard_map.apply_page([_shard(SHARD_0, 0, HALF), _shard(SHARD_1, HALF + 1, MAX_HASH)])
    h.shard_map.finish_update(1.8)
    h.retrier.settle_held(1.9)
    assert h.retrier.held_records == 2
    assert h.finished == []
    # the next refresh still does not list the shard: the KPL's answer, retry
    assert h.shard_map.begin_update()
    h.shard_map.apply_page([_shard(SHARD_0, 0, HALF), _shard(SHARD_1, HALF + 1, MAX_HASH)])
    h.shard_map.finish_update(2.0)
    h.retrier.settle_held(2.1)
    assert h.retrier.held_records == 0
    assert codes(records[0]) == codes(records[1]) == [errors.WRONG_SHARD]
    assert h.retrier.delayed_records == 2


def test_a_failed_refresh_retries_only_what_expires_before_the_next_try() -> None:
    h = Harness()
    soon = [make_record(5, expiration=3.0), make_record(6, expiration=3.0)]
    h.retrier.handle(
        outcome([make_kinesis_record(soon, SHARD_0)], [ok(shard=CHILD)], start=1.0), 1.5
    )
    late = _held_aggregate(h, 7, 8)  # expiration 30
    assert h.shard_map.begin_update()
    h.shard_map.fail_update()
    h.retrier.settle_held(2.0, give_up_before=4.0)
    assert codes(soon[0]) == codes(soon[1]) == [errors.WRONG_SHARD]
    assert h.retrier.delayed_records == 2
    assert h.retrier.held_records == 2
    assert codes(late[0]) == []
    # a map that will not come (a missing stream): every one goes
    h.retrier.settle_held(2.5, give_up_before=math.inf)
    assert codes(late[0]) == codes(late[1]) == [errors.WRONG_SHARD]
    assert h.retrier.held_records == 0


def test_a_held_record_that_expires_fails_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    records = [make_record(5, expiration=2.0), make_record(6, expiration=2.0)]
    h.retrier.handle(
        outcome([make_kinesis_record(records, SHARD_0)], [ok(shard=CHILD)], start=1.0), 1.5
    )
    with caplog.at_level(logging.WARNING, logger="anykpl.retrier"):
        h.retrier.settle_held(2.5, give_up_before=math.inf)
    assert codes(records[0]) == [errors.WRONG_SHARD, errors.EXPIRED]
    assert h.finished == [(records, False)]
    assert any("expired (record_ttl)" in message for message in caplog.messages)


def test_take_all_includes_what_is_held_with_the_attempt_that_stored_it() -> None:
    h = Harness()
    records = _held_aggregate(h, 5, 6)
    assert h.retrier.take_all() == records
    assert h.retrier.held_records == 0
    assert codes(records[0]) == codes(records[1]) == [errors.WRONG_SHARD]
    (attempt,) = records[0].build_result().attempts
    assert CHILD in (attempt.error_message or "")
    h.retrier.settle_held(2.0, give_up_before=math.inf)  # nothing left to decide
    assert h.finished == []
    assert len(records[0].build_result().attempts) == 1


@pytest.mark.parametrize("count", [1, 3])
def test_records_of_one_hash_key_in_an_unknown_shard_succeed(count: int) -> None:
    """The service routes a Kinesis record by its explicit hash key: a raw record (or an
    aggregate of one key) is stored in the shard that holds its key, known to the map or not
    (a child the map has not seen yet). Retrying it stored a second copy."""
    h = Harness()
    records = [make_record(5) for _ in range(count)]
    kr = make_kinesis_record(records, SHARD_0)
    child = "shardId-000000000099"
    h.retrier.handle(outcome([kr], [ok(shard=child)], start=1.0), 1.5)
    assert h.finished == [(records, True)]
    assert [r.result().shard_id for r in records] == [child] * count
    assert h.refreshes == 1  # the map is stale all the same: help it converge


def test_wrong_shard_from_a_request_older_than_the_map_does_not_refresh() -> None:
    h = Harness()
    h.shard_map.updated_at = 5.0
    record = make_record(1)
    kr = make_kinesis_record([record], SHARD_0)
    h.retrier.handle(outcome([kr], [ok(shard=SHARD_1)], start=4.0), now=6.0)
    assert codes(record) == [errors.WRONG_SHARD]
    assert h.refreshes == 0
    assert h.retrier.delayed_records == 1


def test_no_prediction_means_no_wrong_shard_check() -> None:
    h = Harness()
    record = make_record(1)
    kr = make_kinesis_record([record], None)
    h.retrier.handle(outcome([kr], [ok(shard=SHARD_1)]), 1.5)
    assert h.finished == [([record], True)]
    assert record.result().shard_id == SHARD_1


# -- attempts ---------------------------------------------------------------------------------


def test_attempt_delay_and_duration_follow_the_kpl() -> None:
    """delay: first attempt from arrival, later ones from the previous attempt's end;
    duration: the attempt's own length."""
    h = Harness(rng=_StubRandom())
    record = make_record(1, arrival=1.0)
    h.retrier.handle(
        outcome([make_kinesis_record([record])], [err(THROTTLED)], start=1.5, end=2.0), now=2.0
    )
    h.retrier.take_due(h.retrier.next_release)
    h.retrier.handle(
        outcome([make_kinesis_record([record])], [ok()], start=3.0, end=3.25), now=3.25
    )
    result = record.result()
    assert [a.success for a in result.attempts] == [False, True]
    assert [a.delay for a in result.attempts] == pytest.approx([0.5, 1.0])
    assert [a.duration for a in result.attempts] == pytest.approx([0.5, 0.25])
    assert result.attempts[0].error_code == THROTTLED
    assert result.attempts[0].error_message == "nope"
    assert result.attempts[1].error_code is None
    assert result.attempts[1].error_message is None


def test_take_all_empties_the_retry_queue() -> None:
    h = Harness()
    records = [make_record(i) for i in range(3)]
    h.retrier.handle(outcome([make_kinesis_record(records)], [err(THROTTLED)]), 1.5)
    assert sorted(id(r) for r in h.retrier.take_all()) == sorted(id(r) for r in records)
    assert h.retrier.delayed_records == 0
    assert h.retrier.take_due(1e9) == []


# -- logging --------------------------------------------------------------------------------


def test_records_failed_for_good_are_logged_once_per_code_per_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    krs = [make_kinesis_record([make_record(), make_record()]) for _ in range(3)]
    caplog.set_level("INFO", logger="anykpl")
    h.retrier.handle(
        outcome(krs, [err("AccessDeniedException", "no access")] * 2 + [err(THROTTLED)]), 0.5
    )
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # the throttled one is retried: not logged
    (line,) = warnings
    assert line.name == "anykpl.retrier"
    assert "4 user record(s) of stream stream failed: AccessDeniedException: no access" in (
        line.getMessage()
    )
    assert (line.stream, line.error_code, line.records) == (  # type: ignore[attr-defined]
        "stream",
        "AccessDeniedException",
        4,
    )


def test_expiry_in_the_limiter_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    krs = [make_kinesis_record([make_record()]) for _ in range(5)]
    caplog.set_level("INFO", logger="anykpl")
    h.retrier.expire(krs, 31.0)
    (line,) = caplog.records
    assert "5 user record(s) of stream stream expired (record_ttl)" in line.getMessage()


# --- Adaptive control and the retry budget -----------------------------------------------

from anykpl._core._retrier import RetryBudget  # noqa: E402


def test_outcomes_are_reported_once_per_shard_per_response() -> None:
    h = Harness()
    reports: list[tuple[str, int, int, int, int, float, float]] = []
    h.retrier.on_outcome = lambda *report: reports.append(report)
    krs = [make_kinesis_record([make_record()], SHARD_0) for _ in range(3)]
    krs += [make_kinesis_record([make_record(HALF + 5)], SHARD_1)]
    krs += [make_kinesis_record([make_record()], SHARD_0)]
    entries = [err(THROTTLED), err(THROTTLED), ok(), err(THROTTLED, "x"), err("InternalFailure")]
    h.retrier.handle(outcome(krs, entries, start=1.0, end=1.2), 2.0)
    # sent counts the accepted and the throttled records; the InternalFailure is in neither
    assert sorted(reports) == [
        (SHARD_0, 3, 2, 1, krs[2].size, 1.0, 2.0),
        (SHARD_1, 1, 1, 0, 0, 1.0, 2.0),
    ]
    assert h.retrier.throttled == {SHARD_0: 2, SHARD_1: 1}


def test_a_clean_response_is_reported_too() -> None:
    h = Harness()
    reports: list[tuple[str, int, int, int, int, float, float]] = []
    h.retrier.on_outcome = lambda *report: reports.append(report)
    krs = [make_kinesis_record([make_record()], SHARD_0) for _ in range(2)]
    h.retrier.handle(outcome(krs, [ok(), ok()], start=1.0, end=1.2), 2.0)
    assert reports == [(SHARD_0, 2, 0, 2, krs[0].size + krs[1].size, 1.0, 2.0)]


def test_a_whole_request_throttle_is_reported_too() -> None:
    h = Harness()
    reports: list[tuple[str, int, int, int, int, float, float]] = []
    h.retrier.on_outcome = lambda *report: reports.append(report)
    krs = [make_kinesis_record([make_record()], SHARD_0) for _ in range(4)]
    h.retrier.handle(outcome(krs, None, code=THROTTLED), 2.0)
    assert reports == [(SHARD_0, 4, 4, 0, 0, 1.0, 2.0)]


def test_backoff_time_is_counted_per_shard_in_user_record_seconds() -> None:
    h = Harness(rng=_StubRandom(), backoff_initial=0.5, backoff_max=1.0)
    krs = [make_kinesis_record([make_record(), make_record()], SHARD_0)]
    h.retrier.handle(outcome(krs, [err("InternalFailure")]), 2.0)
    assert h.retrier.backoff_time == {SHARD_0: pytest.approx(2 * 0.5)}


def test_retry_budget_is_refilled_by_deliveries_and_time() -> None:
    budget = RetryBudget(0.5, 0.0, minimum=10.0, capacity=5.0)
    assert all(budget.try_spend(0.0) for _ in range(5))
    assert not budget.try_spend(0.0)
    assert budget.exhausted == 1
    budget.deposit(2)  # two deliveries → one retry
    assert budget.try_spend(0.0)
    assert not budget.try_spend(0.0)
    assert budget.try_spend(0.1)  # 10 per second whatever the traffic
    budget.deposit(1000)
    assert budget.balance == 5.0  # capped


def test_a_spent_retry_budget_makes_retries_wait_the_longest_backoff() -> None:
    rng = _StubRandom()
    h = Harness(rng=rng, backoff_initial=0.05, backoff_max=2.0)
    h.retrier.retry_budget = RetryBudget(0.0, 0.0, minimum=0.0, capacity=1.0)
    first = make_kinesis_record([make_record()], SHARD_0)
    h.retrier.handle(outcome([first], [err("InternalFailure")]), 2.0)
    assert rng.bounds[-1] == (0.0, 0.05)  # the budget paid for it
    second = make_kinesis_record([make_record(HALF + 9)], SHARD_1)
    h.retrier.handle(outcome([second], [err("InternalFailure")]), 2.0)
    assert rng.bounds[-1] == (1.0, 2.0)  # spent: the longest backoff, jittered
    assert h.retrier.retry_budget.exhausted == 1
    assert not any(success is False for _, success in h.finished)  # nothing failed for it


def test_a_failed_request_spends_one_retry_per_shard_from_the_budget() -> None:
    rng = _StubRandom()
    h = Harness(rng=rng, backoff_initial=0.05, backoff_max=2.0)
    budget = h.retrier.retry_budget = RetryBudget(0.2, 0.0, minimum=0.0, capacity=10.0)
    krs = [make_kinesis_record([make_record()], SHARD_0) for _ in range(300)]
    krs += [make_kinesis_record([make_record(HALF + 3)], SHARD_1) for _ in range(200)]
    h.retrier.handle(outcome(krs, None, code="InternalFailure"), 2.0)
    assert budget.balance == pytest.approx(8.0)  # one per shard, not 500
    assert all(bounds == (0.0, 0.05) for bounds in rng.bounds)
    # a response delivering records for two shards deposits once per shard
    delivered = [make_kinesis_record([make_record()], SHARD_0) for _ in range(50)]
    h.retrier.handle(outcome(delivered, [ok()] * 50), 2.0)
    assert budget.balance == pytest.approx(8.2)
