"""The Limiter: per-shard token buckets and deadline queues (pure, virtual time)."""

from __future__ import annotations

import math

import pytest

from anykpl._core import _limits
from anykpl._core._limiter import MIN_REFILL_WAIT, SAMPLE_SIZE, Limiter
from anykpl._core._records import KinesisRecord, Record
from anykpl._core._token_bucket import BURST_SECONDS

SHARD = "shardId-000000000000"
OTHER = "shardId-000000000001"


def make_kinesis_record(
    *,
    shard: str | None = SHARD,
    size: int = 10,
    deadline: float = 0.0,
    expiration: float = 1000.0,
    arrival: float = 0.0,
) -> KinesisRecord:
    data = bytes(size - 1)
    user = Record("stream", "k", data, 1, None, arrival, deadline, expiration)
    return KinesisRecord([user], data, "k", "1", shard, deadline, expiration)


def _drain(limiter: Limiter, now: float) -> tuple[list[KinesisRecord], list[KinesisRecord], float]:
    out: list[KinesisRecord] = []
    expired: list[KinesisRecord] = []
    wake = limiter.drain(now, out, expired)
    return out, expired, wake


def test_records_without_prediction_bypass_the_limiter() -> None:
    limiter = Limiter(rate_limit_percent=1)
    records = [make_kinesis_record(shard=None) for _ in range(100)]
    out: list[KinesisRecord] = []
    limiter.put(records, 0.0, out)
    assert out == records
    assert limiter.queued == 0
    assert limiter.queue_depths() == {}
    assert _drain(limiter, 0.0) == ([], [], math.inf)


def test_released_in_deadline_order() -> None:
    limiter = Limiter(rate_limit_percent=100)
    records = [make_kinesis_record(deadline=d) for d in (3.0, 1.0, 2.0, 1.5)]
    limiter.put(records, 0.0, [])
    assert limiter.queued == 4
    assert limiter.queue_depths() == {SHARD: 4}
    out, expired, wake = _drain(limiter, 0.0)
    assert [kr.deadline for kr in out] == [1.0, 1.5, 2.0, 3.0]
    assert expired == []
    assert wake == math.inf
    assert limiter.queued == 0
    assert limiter.queue_depths() == {}


def test_rate_and_capacity_follow_rate_limit_percent() -> None:
    limiter = Limiter(rate_limit_percent=150)
    limiter.put([make_kinesis_record()], 0.0, [])
    rates = limiter.rates()
    assert rates[SHARD] == pytest.approx(
        (1.5 * _limits.SHARD_RECORDS_PER_SECOND, 1.5 * _limits.SHARD_BYTES_PER_SECOND)
    )


def test_bucket_capacity_then_wait_for_tokens() -> None:
    limiter = Limiter(rate_limit_percent=1)  # 10 records/s, ~10 KiB/s per shard
    records = [make_kinesis_record(deadline=i) for i in range(15)]
    limiter.put(records, 0.0, [])
    out, expired, wake = _drain(limiter, 0.0)
    assert out == records[:5]  # the bucket starts full: half a second of tokens
    assert expired == []
    assert wake == pytest.approx(0.1)
    levels = limiter.token_levels(0.0)[SHARD]
    assert levels[0] == pytest.approx(0.0)
    out, _, _ = _drain(limiter, 0.05)
    assert out == []
    out, _, wake = _drain(limiter, 0.1)
    assert out == records[5:6]
    assert wake == pytest.approx(0.2)


def test_head_of_line_blocks_smaller_records_behind_it() -> None:
    limiter = Limiter(rate_limit_percent=2)
    byte_rate = _limits.SHARD_BYTES_PER_SECOND * 0.02
    capacity = byte_rate * BURST_SECONDS
    first = make_kinesis_record(size=8000, deadline=1.0)
    head = make_kinesis_record(size=8000, deadline=2.0)
    small = make_kinesis_record(size=100, deadline=3.0)
    limiter.put([first, head, small], 0.0, [])
    out, _, wake = _drain(limiter, 0.0)
    # ``small`` would fit in the bytes left, but ``head`` has the earlier deadline
    assert out == [first]
    assert limiter.queue_depths() == {SHARD: 2}
    ready = (8000 - (capacity - 8000)) / byte_rate
    assert wake <= ready  # the tokens' time, or an earlier expiry scan
    out, _, _ = _drain(limiter, ready - 0.01)
    assert out == []
    out, _, _ = _drain(limiter, ready + 1e-9)
    assert out == [head]
    # a saturated shard waits at least MIN_REFILL_WAIT for its next tokens
    out, _, _ = _drain(limiter, ready + 100 / byte_rate + 1e-6)
    assert out == []
    out, _, _ = _drain(limiter, ready + MIN_REFILL_WAIT + 1e-6)
    assert out == [small]


def test_a_saturated_shard_releases_in_refills_not_one_token_at_a_time() -> None:
    limiter = Limiter(rate_limit_percent=100)  # 1000 records/s: a token every millisecond
    records = [make_kinesis_record(deadline=i) for i in range(600)]
    limiter.put(records, 0.0, [])
    out, _, wake = _drain(limiter, 0.0)
    assert len(out) == 500  # half a second of tokens
    assert wake == pytest.approx(MIN_REFILL_WAIT)
    # new input does not make it release the token that came in meanwhile
    limiter.put([make_kinesis_record(deadline=0.0)], 0.001, [])
    out, _, _ = _drain(limiter, 0.001)
    assert out == []
    out, _, _ = _drain(limiter, MIN_REFILL_WAIT)
    assert len(out) == 25


def test_shards_are_limited_independently() -> None:
    limiter = Limiter(rate_limit_percent=1, burst=1.0)
    limiter.put([make_kinesis_record(shard=SHARD) for _ in range(12)], 0.0, [])
    limiter.put([make_kinesis_record(shard=OTHER) for _ in range(3)], 0.0, [])
    out, _, _ = _drain(limiter, 0.0)
    assert sum(kr.predicted_shard == SHARD for kr in out) == 10
    assert sum(kr.predicted_shard == OTHER for kr in out) == 3
    assert limiter.queue_depths() == {SHARD: 2}


def test_expired_at_the_head_is_failed_not_sent() -> None:
    limiter = Limiter(rate_limit_percent=100)
    stale = make_kinesis_record(deadline=0.0, expiration=1.0)
    fresh = make_kinesis_record(deadline=0.5, expiration=10.0)
    limiter.put([stale, fresh], 0.0, [])
    out, expired, _ = _drain(limiter, 2.0)
    assert expired == [stale]
    assert out == [fresh]
    assert limiter.queued == 0


def test_expiry_while_waiting_behind_the_head() -> None:
    limiter = Limiter(rate_limit_percent=1, burst=1.0)
    filler = [make_kinesis_record(deadline=0.0) for _ in range(10)]
    head = make_kinesis_record(deadline=1.0, expiration=100.0)
    doomed = make_kinesis_record(deadline=2.0, expiration=0.5)
    limiter.put([*filler, head, doomed], 0.0, [])
    out, expired, wake = _drain(limiter, 0.0)
    assert out == filler
    assert expired == []
    # ``doomed`` waits behind ``head`` (no tokens); its TTL passes before tokens come back
    now = 0.6
    expired_all: list[KinesisRecord] = []
    while now < 2.0 and not expired_all:
        out, expired, wake = _drain(limiter, now)
        expired_all += expired
        now = max(now + 0.01, min(wake, 2.0))
    assert expired_all == [doomed]
    assert limiter.queued <= 1


def test_drain_wakes_for_expiry_scans_when_records_wait() -> None:
    limiter = Limiter(rate_limit_percent=1)
    limiter.put([make_kinesis_record(deadline=0.0) for _ in range(11)], 0.0, [])
    _, _, wake = _drain(limiter, 0.0)
    assert 0.0 < wake <= 0.25 + 1e-9


def test_rate_is_obeyed_over_simulated_time() -> None:
    limiter = Limiter(rate_limit_percent=1, burst=1.0)  # 10 records/s, capacity 10
    records = [make_kinesis_record(deadline=i * 0.001) for i in range(100)]
    limiter.put(records, 0.0, [])
    released: list[float] = []
    now = 0.0
    for _ in range(10_000):
        out, expired, wake = _drain(limiter, now)
        assert expired == []
        released += [now] * len(out)
        if wake == math.inf:
            break
        # (the next representable time: see test_drain_at_the_returned_wake_time_makes_progress)
        now = max(wake, math.nextafter(now, math.inf))
    assert len(released) == 100
    assert released[-1] == pytest.approx(9.0, abs=0.01)
    for i, start in enumerate(released):
        for j in range(i, len(released)):
            window = released[j] - start
            assert j - i + 1 <= 10 + 10 * window + 1e-6


def test_take_all() -> None:
    limiter = Limiter(rate_limit_percent=1, burst=1.0)
    records = [make_kinesis_record(shard=s) for s in (SHARD, OTHER) for _ in range(12)]
    limiter.put(records, 0.0, [])
    _drain(limiter, 0.0)
    left = limiter.take_all()
    assert len(left) == 4
    assert limiter.queued == 0
    assert limiter.queue_depths() == {}
    assert _drain(limiter, 1.0) == ([], [], math.inf)


@pytest.mark.parametrize("start", [0.0, 1e3, 123_456.789, 2e5 + 0.1, 1e6 / 3])
@pytest.mark.parametrize("percent", [1.0, 3.7, 100.0, 150.0])
def test_drain_at_the_returned_wake_time_makes_progress(start: float, percent: float) -> None:
    """Draining again at the time ``drain`` asked for must release something or ask for a
    later time; otherwise the limiter task spins without sleeping (under trio's MockClock
    forever, since virtual time never moves while a task is runnable). Float rounding makes
    this easy to get wrong, more so at large clock values."""
    limiter = Limiter(rate_limit_percent=percent)
    sizes = [10, 99_999, 7, 300_000, 1_000, 12_345] * 10
    records = [
        make_kinesis_record(size=size, deadline=start + i * 0.001) for i, size in enumerate(sizes)
    ]
    limiter.put(records, start, [])
    now = start
    released = 0
    for _ in range(100_000):
        if not limiter.queued:
            break
        out, expired, wake = _drain(limiter, now)
        assert out or expired or wake > now, f"drain({now!r}) asked to be woken at {wake!r}"
        released += len(out) + len(expired)
        now = wake
    assert released == len(records)


# --- Adaptive control, the shared (fleet) bucket, fair queuing across tenants -------------

from anykpl._core._limiter import AdaptiveSettings  # noqa: E402
from anykpl._core._shard_queue import FAIR_QUANTUM  # noqa: E402
from anykpl._core._token_bucket import TokenBucket  # noqa: E402


def adaptive_limiter(**overrides: float) -> Limiter:
    settings = {"decrease": 0.5, "increase": 0.1, "floor": 0.05, "window": 0.25, **overrides}
    return Limiter(rate_limit_percent=100, adaptive=AdaptiveSettings(**settings))


def tenant_record(tenant: str | None, *, size: int = 1000, deadline: float = 0.0) -> KinesisRecord:
    kr = make_kinesis_record(size=size, deadline=deadline)
    kr.tenant = tenant
    return kr


def _throttle_round(limiter: Limiter, now: float, sent: int = 10, throttled: int = 10) -> None:
    """One PutRecords outcome for SHARD, sent 0.1 s before ``now``."""
    accepted = sent - throttled
    limiter.outcome(SHARD, sent, throttled, accepted, 1000 * accepted, now - 0.1, now)


def test_a_throttled_round_cuts_the_shard_rate_and_it_recovers() -> None:
    limiter = adaptive_limiter(increase=0.005)
    limiter.put([make_kinesis_record()], 0.0, [])
    _drain(limiter, 0.0)
    _throttle_round(limiter, 1.0)
    records, nbytes = limiter.rates()[SHARD]
    assert records == pytest.approx(500)
    assert nbytes == pytest.approx(_limits.SHARD_BYTES_PER_SECOND / 2)
    # requests sent before the cut belong to the same congestion event
    limiter.outcome(SHARD, 10, 10, 0, 0, 0.95, 1.1)
    assert limiter.rates()[SHARD][0] == pytest.approx(500)
    # recovery is applied when the shard drains: additive, no known-good rate to climb to
    limiter.put([make_kinesis_record()], 3.0, [])
    _drain(limiter, 3.0)
    assert limiter.rates()[SHARD][0] == pytest.approx(500 + 1000 * 0.005 * 2 * 1.2)
    shard = limiter.statistics(3.0).shards[SHARD]
    assert shard.cuts == 1
    assert shard.records_sent == 2
    assert shard.queued == 0
    assert shard.rate[0] == pytest.approx(500 + 1000 * 0.005 * 2 * 1.2)


def test_a_cut_shard_wakes_to_raise_its_rate() -> None:
    limiter = adaptive_limiter()
    limiter.put([make_kinesis_record()], 0.0, [])
    _drain(limiter, 0.0)
    _throttle_round(limiter, 0.5)
    limiter.put([make_kinesis_record(size=600_000, deadline=i) for i in range(3)], 0.5, [])
    _, _, wake = _drain(limiter, 0.5)
    assert wake <= 0.5 + 4 * MIN_REFILL_WAIT


def test_throttles_without_adaptive_control_change_nothing() -> None:
    limiter = Limiter(rate_limit_percent=100)
    limiter.put([make_kinesis_record()], 0.0, [])
    _throttle_round(limiter, 1.0)
    limiter.outcome("unknown-shard", 5, 5, 0, 0, 0.0, 1.0)
    assert limiter.rates()[SHARD][0] == pytest.approx(1000)


def test_the_deadline_floor_raises_a_cut_shard_to_what_its_queue_needs() -> None:
    """Politeness never makes a record expire: a cut shard whose queue needs more than the
    cut rate to be released before its TTL gets that rate (bounded by the ceiling)."""
    limiter = adaptive_limiter(decrease=0.1, floor=0.05)
    limiter.put([make_kinesis_record()], 0.0, [])
    _drain(limiter, 0.0)
    _throttle_round(limiter, 1.0)  # cut to 10 % of the ceiling
    assert limiter.rates()[SHARD][0] == pytest.approx(100)
    # 500 records of 100 bytes that expire 3 s from now: 1 s of margin leaves 2 s, so the
    # queue needs 250 records/s, a quarter of the ceiling
    queue = [make_kinesis_record(size=100, deadline=1.0 + i / 1000) for i in range(500)]
    for kr in queue:
        kr.expiration = 4.0
    limiter.put(queue, 1.0, [])
    _drain(limiter, 1.0)
    assert limiter.rates()[SHARD][0] == pytest.approx(250, rel=0.01)


def test_the_deadline_floor_is_the_ceiling_when_the_queue_cannot_make_it() -> None:
    limiter = adaptive_limiter(decrease=0.1, floor=0.05)
    limiter.put([make_kinesis_record()], 0.0, [])
    _drain(limiter, 0.0)
    _throttle_round(limiter, 1.0)
    queue = [make_kinesis_record(size=100, deadline=1.0)]
    queue[0].expiration = 1.5  # less than the margin left
    limiter.put(queue, 1.0, [])
    _drain(limiter, 1.0)
    assert limiter.rates()[SHARD][0] == pytest.approx(1000)


def test_the_shared_bucket_binds_every_shard_and_they_take_turns() -> None:
    shared = TokenBucket(10, 1e9, 0.0, burst=1.0)  # 10 records/s for the whole producer
    limiter = Limiter(rate_limit_percent=100, shared=shared)
    a = [make_kinesis_record(shard=SHARD, deadline=i) for i in range(50)]
    b = [make_kinesis_record(shard=OTHER, deadline=i) for i in range(50)]
    limiter.put(a + b, 0.0, [])
    released: list[KinesisRecord] = []
    now = 0.0
    while now < 10.0:
        out, _, wake = _drain(limiter, now)
        released.extend(out)
        now = max(wake, now + MIN_REFILL_WAIT)
    # the shared bucket's rate, not the shards' (1,000/s each), bounds the total
    assert 95 <= len(released) <= 100 + 10
    from_a = sum(1 for kr in released if kr.predicted_shard == SHARD)
    from_b = len(released) - from_a
    assert abs(from_a - from_b) <= 10  # neither shard starves
    # a refused take gave the shard's tokens back
    assert limiter.token_levels(now)[SHARD][0] == pytest.approx(500, abs=1)


def test_records_that_wait_for_a_shared_bucket_at_no_rate_still_expire() -> None:
    # a fleet member that may send nothing (STOPPED): its shards are blocked for good, and
    # their records end when their TTL passes all the same
    shared = TokenBucket(1e-9, 1e-9, 0.0, burst=1.0)
    shared.empty(0.0)
    limiter = Limiter(rate_limit_percent=100, shared=shared)
    records = [make_kinesis_record(shard=SHARD, deadline=0.1) for _ in range(5)]
    for kr in records:
        kr.expiration = 2.0
    limiter.put(records, 0.0, [])
    now, expired = 0.0, []
    while now < 5.0 and len(expired) < len(records):
        out, gone, wake = _drain(limiter, now)
        assert out == []
        expired.extend(gone)
        if len(expired) < len(records):
            assert wake <= now + 1.0  # it wakes to look for expiries
            now = max(wake, now + MIN_REFILL_WAIT)
    assert sorted(map(id, expired)) == sorted(map(id, records))
    assert 2.0 <= now <= 2.5
    assert limiter.queued == 0
    # the head's reservation of the shared bucket was never used: given back, no debt left
    assert shared.time_until(1, 1, now) == pytest.approx(1e9, rel=0.01)


def test_a_quiet_tenant_does_not_wait_behind_a_noisy_one() -> None:
    limiter = Limiter(rate_limit_percent=1)  # 10 records/s: the shard is the bottleneck
    noisy = [tenant_record("noisy", deadline=0.0) for _ in range(100)]
    limiter.put(noisy, 0.0, [])
    quiet = tenant_record("quiet", deadline=5.0)  # a later deadline than all the noisy ones
    limiter.put([quiet], 0.1, [])
    released: list[KinesisRecord] = []
    now = 0.1
    while quiet not in released:
        out, _, wake = _drain(limiter, now)
        released.extend(out)
        now = wake
    # with one deadline queue it would wait for all 100 noisy records (about 10 s)
    assert released.index(quiet) <= 6
    assert now < 1.5


def test_records_without_a_tenant_form_one_lane_among_the_tenants() -> None:
    limiter = Limiter(rate_limit_percent=1)
    plain = [tenant_record(None, deadline=0.0) for _ in range(50)]
    limiter.put(plain, 0.0, [])
    quiet = tenant_record("t1", deadline=9.0)
    limiter.put([quiet], 0.0, [])
    first, _, wake = _drain(limiter, 0.0)
    second, _, _ = _drain(limiter, wake)  # the next refill goes to the other lane first
    assert quiet not in first
    assert second[0] is quiet
    assert limiter.queue_depths() == {SHARD: 51 - len(first) - len(second)}


def test_waiting_lanes_name_the_tenants_whose_records_wait() -> None:
    """Adaptive batching holds an aggregate back while its lane waits for tokens: the lanes
    are keyed as the Aggregator keys aggregates, so a tenant with nothing waiting on a busy
    shard is not held back by the others' backlog."""
    limiter = Limiter(rate_limit_percent=1)
    assert limiter.waiting_lanes() == set()
    plain = make_kinesis_record(shard="plain", size=1000)
    limiter.put([plain], 0.0, [])
    assert limiter.waiting_lanes() == {"plain"}  # a shard that never saw a tenant
    limiter.put([tenant_record("noisy") for _ in range(50)], 0.0, [])
    assert limiter.waiting_lanes() == {"plain", (SHARD, "noisy")}
    limiter.put([tenant_record(None)], 0.0, [])
    assert limiter.waiting_lanes() == {"plain", SHARD, (SHARD, "noisy")}
    # the quiet tenant's lane on the same shard is empty: not busy
    assert (SHARD, "quiet") not in limiter.waiting_lanes()
    limiter.put([tenant_record("quiet")], 0.0, [])
    assert (SHARD, "quiet") in limiter.waiting_lanes()
    # the lanes leave as they drain: at 10 records/s, the plain shard and the lanes of SHARD
    # with one record each empty in the first drains, the noisy lane last
    now = 0.0
    while limiter.waiting_lanes():
        _drain(limiter, now)
        lanes = limiter.waiting_lanes()
        assert lanes <= {"plain", SHARD, (SHARD, "noisy"), (SHARD, "quiet")}
        if (SHARD, "noisy") in lanes and "plain" not in lanes and SHARD not in lanes:
            # a FairQueue whose lane without a tenant is empty: only its tenant lanes count
            assert all(isinstance(lane, tuple) for lane in lanes)
        now += 0.5
    assert not limiter.queue_depths() or not any(limiter.queue_depths().values())


def test_fair_lanes_share_by_bytes() -> None:
    limiter = Limiter(rate_limit_percent=100)
    big = [tenant_record("big", size=FAIR_QUANTUM // 2) for _ in range(20)]
    small = [tenant_record("small", size=FAIR_QUANTUM // 8) for _ in range(80)]
    limiter.put(big + small, 0.0, [])
    out, _, _ = _drain(limiter, 0.0)
    first = out[:20]
    big_bytes = sum(kr.size for kr in first if kr.tenant == "big")
    small_bytes = sum(kr.size for kr in first if kr.tenant == "small")
    assert big_bytes == pytest.approx(small_bytes, rel=0.5)


def test_expired_records_leave_the_fair_lanes() -> None:
    limiter = Limiter(rate_limit_percent=1)
    records = [tenant_record("t", deadline=0.0) for _ in range(20)]
    for kr in records[10:]:
        kr.expiration = 1.0
    limiter.put(records, 0.0, [])
    out, expired, _ = _drain(limiter, 2.0)
    assert len(expired) == 10
    assert limiter.queued == 20 - len(out) - 10
    leftovers = limiter.take_all()
    assert len(leftovers) == limiter.queued + len(leftovers)
    assert limiter.queue_depths() == {}


def test_time_waiting_for_tokens_is_counted_per_user_record() -> None:
    limiter = Limiter(rate_limit_percent=1)  # 10 records/s, 5 at once
    limiter.put([make_kinesis_record(deadline=i) for i in range(6)], 0.0, [])
    _drain(limiter, 0.0)
    _drain(limiter, 0.1)
    shard = limiter.statistics(0.1).shards[SHARD]
    assert shard.records_sent == 6
    assert shard.token_wait == pytest.approx(0.1)


def test_a_big_record_on_one_shard_is_not_starved_by_small_ones_at_the_shared_bucket() -> None:
    shared = TokenBucket(1e6, 100_000, 0.0, burst=0.5)  # 100 kB/s for the whole producer
    limiter = Limiter(rate_limit_percent=100, shared=shared)
    big = make_kinesis_record(shard=OTHER, size=50_000, deadline=0.0)
    limiter.put([big], 0.0, [])
    released: list[KinesisRecord] = []
    now, uid = 0.0, 0
    while big not in released and now < 10.0:
        # SHARD always has small records waiting
        uid += 1
        limiter.put([make_kinesis_record(shard=SHARD, size=1000, deadline=now)], now, [])
        out, _, wake = _drain(limiter, now)
        released.extend(out)
        now = min(wake, now + MIN_REFILL_WAIT)
    assert big in released
    assert now < 2.0


def test_a_big_record_in_a_tenant_lane_is_not_starved_by_another_lane() -> None:
    limiter = Limiter(rate_limit_percent=10)  # ~100 KiB/s: a bucket of ~51 KiB
    big = tenant_record("big", size=50 * 1024, deadline=0.0)
    limiter.put([tenant_record("small", size=5000) for _ in range(100)], 0.0, [])
    limiter.put([big], 0.0, [])
    released: list[KinesisRecord] = []
    now = 0.0
    while big not in released and now < 30.0:
        out, _, wake = _drain(limiter, now)
        released.extend(out)
        now = wake
    assert big in released
    assert now < 3.0


def _aggregate(records: int, size: int, *, deadline: float = 0.0) -> KinesisRecord:
    from anykpl._core._wire import AggregateBuilder

    builder = AggregateBuilder()
    users = []
    for i in range(records):
        data = bytes(size)
        users.append(Record("stream", f"k{i}", data, 1, None, 0.0, deadline, 1000.0))
        builder.add(f"k{i}", None, data)
    return KinesisRecord.aggregate(users, builder, "a", "1", SHARD, deadline, 1000.0)


def test_aggregates_leave_in_pieces_while_the_controller_weighs_the_evidence() -> None:
    """A throttled period without a verdict: more, smaller Kinesis records for the same bytes
    (SAMPLE_SIZE), so the controller learns faster; none before it or after."""
    limiter = adaptive_limiter()
    limiter.put([_aggregate(40, 1000)], 0.0, [])
    out, _, _ = _drain(limiter, 0.0)
    assert [len(kr.records) for kr in out] == [40]  # no throttle yet: whole
    _throttle_round(limiter, 0.5, sent=10, throttled=3)
    assert limiter._shards[SHARD].controller.sampling  # type: ignore[union-attr]
    limiter.put([_aggregate(40, 1000, deadline=1.0)], 0.5, [])
    out, _, _ = _drain(limiter, 2.0)
    pieces = math.ceil(40 * 1000 / SAMPLE_SIZE)
    assert len(out) in (pieces, pieces + 1)  # framing may spill a record into one more
    assert all(kr.size <= SAMPLE_SIZE + 1 for kr in out)
    assert sum(len(kr.records) for kr in out) == 40
    assert limiter.statistics(2.0).shards[SHARD].records_sent == 1 + len(out)


# -- pacing at capacity ----------------------------------------------------------------------


def _user(arrival: float) -> Record:
    return Record("stream", "k", b"x" * 9, 1, None, arrival, 5.0, 1000.0)


def test_a_paced_record_leaves_once_it_has_waited_the_pace() -> None:
    """With a pace, a record is released no sooner than its arrival plus the pace (an
    aggregate: its records' mean arrival); without one, at once."""
    limiter = Limiter(rate_limit_percent=100)
    limiter.pace = 0.05
    single = make_kinesis_record(arrival=1.0, deadline=5.0)
    limiter.put([single], 1.0, [])
    out, _, wake = _drain(limiter, 1.01)
    assert out == []
    assert wake == pytest.approx(1.05)
    out, _, _ = _drain(limiter, wake)
    assert out == [single]

    both = KinesisRecord([_user(2.0), _user(2.04)], b"x" * 9, "k", "1", SHARD, 5.0, 1000.0)
    limiter.put([both], 2.04, [])
    out, _, wake = _drain(limiter, 2.04)
    assert out == []
    assert wake == pytest.approx(2.07)  # (2.0 + 2.04) / 2 + 0.05
    assert _drain(limiter, wake)[0] == [both]

    # an old record (a retry) is not held; nor anything once the pace is 0
    old = make_kinesis_record(arrival=0.0, deadline=5.0)
    limiter.put([old], 3.0, [])
    assert _drain(limiter, 3.0)[0] == [old]
    limiter.pace = 0.0
    fresh = make_kinesis_record(arrival=4.0, deadline=5.0)
    limiter.put([fresh], 4.0, [])
    assert _drain(limiter, 4.0)[0] == [fresh]


def _offer(
    limiter: Limiter, shards: tuple[str, ...], per_tick: int, outstanding: int, seconds: float
) -> list[float]:
    """Every 10 ms: ``per_tick`` records of 10 bytes for each shard, a drain, and the pace
    planned for ``outstanding`` records; the paces planned after the first second."""
    paces = []
    now = 0.0
    while now < seconds:
        for shard in shards:
            records = [
                make_kinesis_record(shard=shard, arrival=now, deadline=now + 0.1, expiration=1e9)
                for _ in range(per_tick)
            ]
            limiter.put(records, now, [])
        _drain(limiter, now)
        limiter.plan_pace(now, outstanding, 0.1)
        if now >= 1.0:
            paces.append(limiter.pace)
        now = round(now + 0.01, 6)
    return paces


def test_a_stream_at_its_capacity_is_paced_by_its_mean_latency() -> None:
    """Two shards offered more records than their 1,000 records/s: at capacity, so the pace
    is PACE_SHARE of what Little's law gives for the outstanding records (500 over 2,000 user
    records/s: 0.25 s, so the pace is record_max_buffered_time, 0.1 s; 100: 0.04 s)."""
    from anykpl._core._limiter import PACE_SHARE

    paces = _offer(Limiter(rate_limit_percent=100), (SHARD, OTHER), 15, 500, 3.0)
    assert min(paces[5:]) == pytest.approx(0.1)
    paces = _offer(Limiter(rate_limit_percent=100), (SHARD, OTHER), 15, 100, 3.0)
    assert min(paces[5:]) == pytest.approx(PACE_SHARE * 100 / 2000, rel=0.05)
    assert max(paces[5:]) == pytest.approx(PACE_SHARE * 100 / 2000, rel=0.05)


def test_no_pace_below_capacity_on_one_shard_or_for_a_short_latency() -> None:
    """Half the capacity, a stream with one shard, and a mean latency under PACE_FROM of
    record_max_buffered_time (20 records over 2,000/s: 10 ms) are not paced."""
    assert set(_offer(Limiter(rate_limit_percent=100), (SHARD, OTHER), 5, 500, 3.0)) == {0.0}
    assert set(_offer(Limiter(rate_limit_percent=100), (SHARD,), 15, 500, 3.0)) == {0.0}
    assert set(_offer(Limiter(rate_limit_percent=100), (SHARD, OTHER), 15, 20, 3.0)) == {0.0}


def test_a_flush_lifts_the_pace_until_the_next_plan() -> None:
    """unpace (a flush): what the pace held drains at once."""
    limiter = Limiter(rate_limit_percent=100)
    limiter.pace = 0.05
    held = make_kinesis_record(arrival=1.0, deadline=5.0)
    limiter.put([held], 1.0, [])
    assert _drain(limiter, 1.0)[0] == []
    limiter.unpace(1.01)
    assert limiter.pace == 0.0
    assert _drain(limiter, 1.01)[0] == [held]


def test_a_shard_cut_by_adaptive_control_is_not_paced() -> None:
    """A cut shard shares its capacity with other producers: the tokens a pace would let it
    gather would leave in a burst, which the others' records would meet as throttles."""
    limiter = adaptive_limiter()
    limiter.put([make_kinesis_record()], 0.0, [])
    _drain(limiter, 0.0)
    _throttle_round(limiter, 0.5)
    limiter.pace = 0.05
    cut = make_kinesis_record(arrival=0.6, deadline=5.0)
    limiter.put([cut], 0.6, [])
    assert _drain(limiter, 0.6)[0] == [cut]
    other = make_kinesis_record(shard=OTHER, arrival=0.6, deadline=5.0)
    limiter.put([other], 0.6, [])
    assert _drain(limiter, 0.6)[0] == []  # the shard beside it, not cut, is paced


def test_a_pace_is_gone_after_an_idle_spell_and_its_holds_with_it() -> None:
    """Planned before each drain: after a busy stream's idle spell (no shard active) the pace
    is 0 before a lone record is looked at; and a flush releases what an older pace held even
    once the pace itself is 0."""
    limiter = Limiter(rate_limit_percent=100)
    assert _offer(limiter, (SHARD, OTHER), 15, 500, 3.0)[-1] == pytest.approx(0.1)
    limiter.take_all()
    lone = make_kinesis_record(arrival=4.5, deadline=5.0)
    limiter.put([lone], 4.5, [])
    limiter.plan_pace(4.5, 1, 0.1)
    assert limiter.pace == 0.0
    assert _drain(limiter, 4.5)[0] == [lone]

    limiter.pace = 0.2
    held = make_kinesis_record(arrival=5.0, deadline=6.0)
    limiter.put([held], 5.0, [])
    assert _drain(limiter, 5.0)[0] == []
    limiter.pace = 0.0  # as a plan between the two would set it
    limiter.unpace(5.01)
    assert _drain(limiter, 5.01)[0] == [held]


def test_no_pace_past_a_records_expiration_or_for_a_reserved_record() -> None:
    """The gate gives way to a record's expiration (less DEADLINE_MARGIN), and to a record
    that already holds a reservation of the shared (fleet) bucket."""
    limiter = Limiter(rate_limit_percent=100)
    limiter.pace = 0.5
    short = make_kinesis_record(arrival=1.0, deadline=1.1, expiration=2.2)
    limiter.put([short], 1.0, [])
    assert _drain(limiter, 1.0)[0] == [short]
    reserved = make_kinesis_record(arrival=2.0, deadline=3.0)
    reserved.shared_paid = True
    limiter.put([reserved], 2.0, [])
    assert _drain(limiter, 2.0)[0] == [reserved]
