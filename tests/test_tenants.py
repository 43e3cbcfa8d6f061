"""Tenant quotas: the pure core on a virtual clock, then admission through the Producer (trio's
``MockClock`` for the waits, both backends for the rest) and the SyncProducer."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anykpl import Producer, SyncProducer, TenantQuota, TenantStatistics, errors
from anykpl._core._limits import MAX_HASH_KEY as MAX_HASH
from anykpl._core._tenant_quotas import Reservation, TenantQuotas

from .fakes import FakeKinesis

STREAM = "stream"
FAST: dict[str, Any] = {
    "record_max_buffered_time": 0.01,
    "retry_backoff_initial": 0.001,
    "retry_backoff_max": 0.01,
    "close_timeout": 2.0,
}
DATA = b"x" * 90  # with partition key "k123456789": 100 bytes
KEY = "k123456789"


def quotas(**per_tenant: TenantQuota) -> TenantQuotas:
    return TenantQuotas(per_tenant, None)


# -- the pure core ------------------------------------------------------------------------


class TestCore:
    def test_a_tenant_without_quota_is_not_limited_but_counted(self) -> None:
        core = TenantQuotas({}, None)
        for _i in range(10_000):
            reservation = core.reserve("free", 100, now=0.0)
            assert reservation is not None
            assert reservation.wait == 0.0
            assert not reservation.queued
        assert core.quota_of("free") is None
        stats = core.statistics(0.0)["free"]
        assert stats == TenantStatistics(
            quota=None,
            admitted_records=10_000,
            admitted_bytes=1_000_000,
            rejected_records=0,
            waits=0,
            waited_seconds=0.0,
            waiting=0,
            token_levels=(None, None),
        )

    def test_a_quota_with_no_rate_is_no_quota(self) -> None:
        core = TenantQuotas({"t": TenantQuota(burst=2.0)}, None)
        assert core.quota_of("t") is None
        assert all(core.reserve("t", 10**6, 0.0) is not None for _ in range(100))

    def test_the_default_quota_applies_to_tenants_not_listed(self) -> None:
        listed = TenantQuota(records_per_second=100)
        default = TenantQuota(records_per_second=1)
        core = TenantQuotas({"listed": listed}, default)
        assert core.quota_of("listed") is listed
        assert core.quota_of("anyone") is default
        assert core.try_take("anyone", 1, 0.0) is not None
        assert core.try_take("anyone", 1, 0.0) is None
        assert all(core.try_take("listed", 1, 0.0) is not None for _ in range(100))

    def test_starts_full_then_queues_fifo_at_the_rate(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))  # burst 1 s: 10 tokens
        reservations = [core.reserve("t", 100, now=0.0) for _ in range(15)]
        assert all(r is not None for r in reservations)
        ready = [r.ready for r in reservations if r is not None]
        assert ready[:10] == [0.0] * 10
        assert ready[10:] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
        stats = core.statistics(0.0)["t"]
        assert stats.waiting == 5
        assert stats.token_levels == (0.0, None)

    def test_only_the_head_may_go(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(10):
            core.reserve("t", 1, 0.0)
        first, second = core.reserve("t", 1, 0.0), core.reserve("t", 1, 0.0)
        assert first is not None
        assert second is not None
        assert core.poll(second, 1.0) is None  # the first is ahead, however late it is
        assert core.poll(first, 0.05) == pytest.approx(0.05)
        assert core.poll(first, 0.1) == 0.0
        assert not first.queued
        assert first.wait == pytest.approx(0.1)
        assert core.poll(second, 0.15) == pytest.approx(0.05)
        assert core.poll(second, 0.2) == 0.0
        stats = core.statistics(0.2)["t"]
        assert (stats.waits, stats.waiting) == (2, 0)
        assert stats.waited_seconds == pytest.approx(0.3)

    def test_bytes_dimension_and_the_wait_is_the_longer_of_the_two(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=100, bytes_per_second=1000))
        assert core.try_take("t", 500, 0.0) is not None
        assert core.try_take("t", 500, 0.0) is not None
        assert core.time_until("t", 500, 0.0) == pytest.approx(0.5)  # bytes, not records
        assert core.try_take("t", 500, 0.0) is None
        assert core.statistics(0.0)["t"].rejected_records == 1

    def test_a_record_bigger_than_the_bucket_goes_once_it_is_full_leaving_debt(self) -> None:
        core = quotas(t=TenantQuota(bytes_per_second=1000))  # 1000 bytes of capacity
        big = core.reserve("t", 5000, now=0.0)
        assert big is not None
        assert big.wait == 0.0
        assert core.statistics(0.0)["t"].token_levels == (None, -4000.0)
        small = core.reserve("t", 100, now=0.0)
        assert small is not None
        assert small.ready == pytest.approx(4.1)  # the debt, then its own 100 bytes
        # and a big one on a bucket that is not full waits until it is
        core = quotas(t=TenantQuota(bytes_per_second=1000))
        core.reserve("t", 500, 0.0)
        big = core.reserve("t", 5000, 0.0)
        assert big is not None
        assert big.ready == pytest.approx(0.5)

    def test_max_wait_refuses_without_taking(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(12):
            core.reserve("t", 1, 0.0)  # 10 at once, two queued (0.1, 0.2)
        assert core.reserve("t", 1, 0.0, max_wait=0.25) is None
        reservation = core.reserve("t", 1, 0.0, max_wait=0.3 + 1e-6)
        assert reservation is not None
        assert reservation.ready == pytest.approx(0.3)
        stats = core.statistics(0.0)["t"]
        assert (stats.admitted_records, stats.rejected_records, stats.waiting) == (10, 1, 3)

    def test_nobody_jumps_the_queue(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(10):
            core.reserve("t", 1, 0.0)
        waiter = core.reserve("t", 1, 0.0)
        assert waiter is not None
        # the waiter's time has long passed but it has not polled yet: a newcomer, whose
        # tokens are there, still queues behind it
        late = core.reserve("t", 1, 5.0)
        assert late is not None
        assert late.queued
        assert core.try_take("t", 1, 5.0) is None
        assert core.poll(late, 5.0) is None
        assert core.poll(waiter, 5.0) == 0.0
        assert core.poll(late, 5.0) == 0.0

    def test_cancelling_a_queued_reservation_moves_the_others_up(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(10):
            core.reserve("t", 1, 0.0)
        a, b, c = (core.reserve("t", 1, 0.0) for _ in range(3))
        assert a is not None
        assert b is not None
        assert c is not None
        assert core.cancel(b, 0.0) is False  # not the head: the head's time is unchanged
        assert core.cancel(b, 0.0) is False  # twice does nothing
        assert core.time_until("t", 1, 0.0) == pytest.approx(0.3)  # a and c ahead, not b
        assert core.cancel(a, 0.05) is True  # the head: c is the head now
        assert core.head_of(c) is c
        assert core.poll(c, 0.05) == pytest.approx(0.05)
        assert core.poll(c, 0.1) == 0.0  # at a's old time
        stats = core.statistics(0.1)["t"]
        assert (stats.admitted_records, stats.waiting, stats.waits) == (11, 0, 1)

    def test_cancelling_in_arrival_order_leaves_no_debt(self) -> None:
        # how timeouts fire: oldest first. Go's CancelAt would refund nothing here.
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(10):
            core.reserve("t", 1, 0.0)
        waiters = [core.reserve("t", 1, 0.0) for _ in range(100)]
        for waiter in waiters:
            assert waiter is not None
            core.cancel(waiter, 0.5)
        assert core.time_until("t", 1, 0.5) == 0.0  # 5 tokens refilled, nobody queued
        assert core.statistics(0.5)["t"].waiting == 0

    def test_undoing_the_latest_take_is_exact(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10, bytes_per_second=1000))
        first = core.try_take("t", 300, 0.0)
        second = core.try_take("t", 300, 0.0)
        assert first is not None
        assert second is not None
        assert core.cancel(second, 0.1) is False  # nobody waits
        assert core.statistics(0.1)["t"].token_levels == pytest.approx((10.0, 800.0))
        # not the latest take any more: no refund (it could exceed the burst)
        third = core.try_take("t", 300, 0.1)
        assert third is not None
        core.cancel(first, 0.1)
        assert core.statistics(0.1)["t"].token_levels == pytest.approx((9.0, 500.0))
        assert core.statistics(0.1)["t"].admitted_records == 1

    def test_an_undo_wakes_the_head(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=1))
        taken = core.reserve("t", 1, 0.0)
        waiter = core.reserve("t", 1, 0.0)
        assert taken is not None
        assert waiter is not None
        assert core.poll(waiter, 0.0) == pytest.approx(1.0)
        assert core.cancel(taken, 0.2) is True
        assert core.poll(waiter, 0.2) == 0.0

    def test_time_going_backwards_neither_refills_nor_drains(self) -> None:
        core = quotas(t=TenantQuota(records_per_second=10))
        for _ in range(10):
            core.try_take("t", 1, 10.0)
        assert core.statistics(9.0)["t"].token_levels == (0.0, None)
        assert core.statistics(10.1)["t"].token_levels[0] == pytest.approx(1.0)

    def test_idle_tenants_are_pruned(self) -> None:
        core = TenantQuotas(
            {"named": TenantQuota(records_per_second=1)},
            TenantQuota(records_per_second=1),
            prune_above=4,
        )
        core.reserve("named", 1, 0.0)
        busy = core.reserve("busy", 1, 0.0)
        waiting = core.reserve("busy", 1, 0.0)  # queued: "busy" is not idle
        assert busy is not None
        assert waiting is not None
        assert waiting.queued
        for i in range(100):
            core.reserve(f"device-{i}", 1, float(i))  # each refills within a second
        assert len(core) <= 8
        assert "named" in core  # named in tenant_quotas: kept, with its counters
        assert "busy" in core
        assert "device-99" in core
        assert "device-0" not in core

    def test_pruning_costs_little_when_every_tenant_is_busy(self) -> None:
        core = TenantQuotas({}, TenantQuota(records_per_second=1), prune_above=4)
        for i in range(1000):
            core.reserve(f"t{i}", 1, 0.0)  # none refills: none can be pruned
        assert len(core) == 1000
        assert core._prune_at >= 1000  # doubling: not a sweep per new tenant


def _drive(
    core: TenantQuotas,
    ops: list[tuple[float, bool, int, int]],
    promised: dict[Reservation, float] | None = None,
) -> list[tuple[float, Reservation]]:
    """Run reservations and cancellations on a virtual clock the way the async shell does:
    the head of the queue polls at the time it is told. Returns (time taken, reservation)
    for every reservation that went and was not withdrawn, in the order they went;
    ``promised`` gets each reservation's ``ready`` time as it was reserved."""
    now = 0.0
    went: list[tuple[float, Reservation]] = []
    queued: list[Reservation] = []

    def serve_until(until: float) -> None:
        t = now
        while queued:
            head = queued[0]
            if not head.queued:
                queued.pop(0)
                continue
            wait = core.poll(head, t)
            assert wait is not None, "the first queued reservation is the head"
            if wait == 0.0:
                went.append((t, queued.pop(0)))
            elif t + wait <= until:
                t += wait
            else:
                return

    live: list[Reservation] = []
    for dt, cancel, size, pick in ops:
        serve_until(now + dt)
        now += dt
        if cancel and live:
            core.cancel(live.pop(pick % len(live)), now)
        else:
            reservation = core.reserve("t", size, now)
            assert reservation is not None
            if promised is not None:
                promised[reservation] = reservation.ready
            live.append(reservation)
            if reservation.queued:
                queued.append(reservation)
            else:
                went.append((now, reservation))
    serve_until(math.inf)
    return [(t, r) for t, r in went if r in live]


def _assert_within_bucket(
    went: list[tuple[float, float]], rate: float, capacity: float, slack: float = 0.0
) -> None:
    """Over any window [t_i, t_j], the amount that went is at most rate·T + capacity."""
    went = sorted(went)
    for i in range(len(went)):
        total = 0.0
        for j in range(i, len(went)):
            total += went[j][1]
            window = went[j][0] - went[i][0]
            assert total <= rate * window + capacity + slack + 1e-6, (i, j, total, window)


QUOTAS = st.builds(
    TenantQuota,
    records_per_second=st.sampled_from([None, 5.0, 50.0]),
    bytes_per_second=st.sampled_from([None, 1000.0, 20_000.0]),
    burst=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
).filter(lambda q: q.records_per_second is not None or q.bytes_per_second is not None)
OPS = st.lists(
    st.tuples(
        st.floats(0.0, 0.3, allow_nan=False),
        st.booleans(),
        st.integers(1, 100),
        st.integers(0, 1000),
    ),
    max_size=150,
)


@settings(deadline=None, max_examples=150)
@given(quota=QUOTAS, ops=OPS)
def test_what_goes_over_any_window_is_at_most_rate_times_window_plus_capacity(
    quota: TenantQuota, ops: list[tuple[float, bool, int, int]]
) -> None:
    core = TenantQuotas({"t": quota}, None)
    went = _drive(core, ops)
    if quota.records_per_second is not None:
        rate = quota.records_per_second
        _assert_within_bucket([(t, 1.0) for t, _ in went], rate, max(1.0, rate * quota.burst))
    if quota.bytes_per_second is not None:
        rate = quota.bytes_per_second
        _assert_within_bucket(
            [(t, float(r.nbytes)) for t, r in went], rate, max(1.0, rate * quota.burst)
        )
    # FIFO: they went in the order they were reserved
    order = [r.reserved_at for _, r in went]
    assert order == sorted(order)


@settings(deadline=None, max_examples=100)
@given(
    rate=st.sampled_from([100.0, 1000.0]),
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=60),
)
def test_records_bigger_than_the_bucket_exceed_it_by_at_most_one_record(
    rate: float, sizes: list[int]
) -> None:
    quota = TenantQuota(bytes_per_second=rate, burst=1.0)
    core = TenantQuotas({"t": quota}, None)
    went = _drive(core, [(0.01, False, size, 0) for size in sizes])
    assert len(went) == len(sizes)  # nothing deadlocks
    _assert_within_bucket(
        [(t, float(r.nbytes)) for t, r in went], rate, rate, slack=max(0.0, max(sizes) - rate)
    )


@settings(deadline=None, max_examples=100)
@given(
    quota=st.builds(
        TenantQuota,
        records_per_second=st.sampled_from([None, 5.0, 50.0]),
        bytes_per_second=st.sampled_from([None, 1000.0]),
        burst=st.sampled_from([0.1, 1.0]),
    ).filter(lambda q: q.records_per_second is not None or q.bytes_per_second is not None),
    ops=st.lists(st.tuples(st.floats(0.0, 0.3), st.integers(1, 100)), max_size=80),
)
def test_the_time_promised_up_front_is_kept(
    quota: TenantQuota, ops: list[tuple[float, int]]
) -> None:
    core = TenantQuotas({"t": quota}, None)
    promised: dict[Reservation, float] = {}
    went = _drive(core, [(dt, False, size, 0) for dt, size in ops], promised)
    assert len(went) == len(ops)
    for t, reservation in went:
        if quota.records_per_second is None or quota.bytes_per_second is None:
            # one dimension: exactly on time
            assert t == pytest.approx(promised[reservation], abs=1e-6)
        else:
            # two: never earlier (a bucket can fill up while the head waits for the other
            # one, so the estimate can be short; the shell gives up at admission_timeout)
            assert t >= promised[reservation] - 1e-6


# -- admission through the Producer ------------------------------------------------------


async def ready(producer: Producer) -> None:
    """Put one record and wait for the shard map, so later puts are aggregated."""
    await producer.put_record(STREAM, b"warmup", partition_key="warmup", explicit_hash_key=MAX_HASH)
    with anyio.fail_after(5):
        while producer.statistics().streams[STREAM].shard_map_state != "READY":  # noqa: ASYNC110
            await anyio.sleep(0.001)


async def wait_until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.0001)


def tenant(producer: Producer, name: str = "t") -> TenantStatistics:
    return producer.statistics().tenants[name]


def waiting(producer: Producer, name: str = "t") -> int:
    stats = producer.statistics().tenants.get(name)
    return 0 if stats is None else stats.waiting


@pytest.mark.anyio
@pytest.mark.autojump
class TestOnMockClock:
    @pytest.mark.timeout(15)
    async def test_a_tenant_over_its_quota_waits_at_its_rate(self) -> None:
        fake = FakeKinesis()
        async with Producer(
            transport=fake, tenant_quotas={"t": TenantQuota(records_per_second=10)}, **FAST
        ) as producer:
            await ready(producer)
            start = anyio.current_time()
            admitted = []
            for i in range(30):
                await producer.submit(STREAM, b"%d" % i, partition_key=KEY, tenant="t")
                admitted.append(anyio.current_time() - start)
            await producer.flush()
            stats = tenant(producer)
        assert admitted[:10] == [0.0] * 10
        assert admitted[10:] == pytest.approx([0.1 * i for i in range(1, 21)], abs=1e-6)
        assert (stats.admitted_records, stats.waits, stats.waiting) == (30, 20, 0)
        assert stats.waited_seconds == pytest.approx(2.0, abs=1e-6)  # 0.1 s each
        assert stats.admitted_bytes == sum(len(b"%d" % i) + len(KEY) for i in range(30))
        assert sorted(r.data for r in fake.user_records() if r.data != b"warmup") == sorted(
            b"%d" % i for i in range(30)
        )

    @pytest.mark.timeout(15)
    async def test_waiters_are_served_in_arrival_order(self) -> None:
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"t": TenantQuota(records_per_second=10, burst=0.1)},
            **FAST,
        ) as producer:
            await ready(producer)
            await producer.submit(STREAM, b"first", partition_key=KEY, tenant="t")
            order: list[int] = []

            async def put(i: int) -> None:
                await producer.submit(STREAM, b"%d" % i, partition_key=KEY, tenant="t")
                order.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(put, i)
                    await wait_until(lambda i=i: waiting(producer) == i + 1)  # type: ignore[misc]
        assert order == list(range(8))

    @pytest.mark.timeout(15)
    async def test_another_tenant_does_not_wait(self) -> None:
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"noisy": TenantQuota(records_per_second=1)},
            **FAST,
        ) as producer:
            await ready(producer)
            async with anyio.create_task_group() as tg:
                for i in range(5):  # one at once, then one a second
                    put = partial(producer.put_record, tenant="noisy")
                    tg.start_soon(put, STREAM, b"%d" % i, KEY)
                await wait_until(lambda: waiting(producer, "noisy") == 4)
                start = anyio.current_time()
                for i in range(5):
                    await producer.submit(STREAM, b"q%d" % i, partition_key=KEY, tenant="quiet")
                    await producer.submit(STREAM, b"u%d" % i, partition_key=KEY)
                assert anyio.current_time() == start
                tg.cancel_scope.cancel()

    @pytest.mark.timeout(15)
    async def test_reject_mode_raises_at_once_and_takes_nothing(self) -> None:
        quota = TenantQuota(records_per_second=10)
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"t": quota},
            tenant_overflow="reject",
            **FAST,
        ) as producer:
            await ready(producer)
            for i in range(10):
                await producer.submit(STREAM, b"%d" % i, partition_key=KEY, tenant="t")
            outstanding = producer.outstanding_records
            start = anyio.current_time()
            with pytest.raises(errors.TenantQuotaExceeded) as info:
                await producer.submit(STREAM, b"over", partition_key=KEY, tenant="t")
            assert anyio.current_time() == start
            assert producer.outstanding_records == outstanding
            exc = info.value
            assert (exc.tenant, exc.quota) == ("t", quota)
            assert exc.retry_after == pytest.approx(0.1)
            assert "'t'" in str(exc)
            assert "10 records/s" in str(exc)
            assert exc.retriable
            # other tenants, and the tenant itself once its tokens are back, go through
            await producer.submit(STREAM, b"other", partition_key=KEY, tenant="other")
            await anyio.sleep(exc.retry_after)
            await producer.submit(STREAM, b"again", partition_key=KEY, tenant="t")
            await producer.flush()
            stats = tenant(producer)
        assert (stats.admitted_records, stats.rejected_records, stats.waits) == (11, 1, 0)

    @pytest.mark.timeout(15)
    async def test_a_batch_refused_part_way_hands_back_what_it_admitted(self) -> None:
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"t": TenantQuota(records_per_second=10)},
            tenant_overflow="reject",
            **FAST,
        ) as producer:
            await ready(producer)
            with pytest.raises(errors.TenantQuotaExceeded) as info:
                await producer.submit_many(STREAM, [b"%d" % i for i in range(15)], tenant="t")
            admitted = info.value.admitted
            assert [h.data for h in admitted] == [b"%d" % i for i in range(10)]
            await producer.flush()
            assert all(h.result().success for h in admitted)

    @pytest.mark.timeout(15)
    async def test_admission_timeout_refuses_up_front(self) -> None:
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"t": TenantQuota(records_per_second=10)},
            admission_timeout=0.25,
            **FAST,
        ) as producer:
            await ready(producer)
            for i in range(10):
                await producer.submit(STREAM, b"%d" % i, partition_key=KEY, tenant="t")
            async with anyio.create_task_group() as tg:
                for n in (1, 2):  # due at 0.1 and 0.2
                    tg.start_soon(partial(producer.submit, tenant="t"), STREAM, b"w", KEY)
                    await wait_until(lambda n=n: waiting(producer) == n)  # type: ignore[misc]
                start = anyio.current_time()
                with pytest.raises(errors.BackpressureTimeout, match=r"admission_timeout=0\.25"):
                    await producer.submit(STREAM, b"late", partition_key=KEY, tenant="t")
                assert anyio.current_time() == start  # at once, not after 0.25 s
            stats = tenant(producer)
        assert (stats.admitted_records, stats.rejected_records, stats.waits) == (12, 1, 2)

    @pytest.mark.timeout(15)
    async def test_cancelling_the_head_moves_the_next_up(self) -> None:
        async with Producer(
            transport=FakeKinesis(),
            tenant_quotas={"t": TenantQuota(records_per_second=10)},
            **FAST,
        ) as producer:
            await ready(producer)
            for i in range(10):
                await producer.submit(STREAM, b"%d" % i, partition_key=KEY, tenant="t")
            start = anyio.current_time()
            times: dict[str, float] = {}

            async def put(name: str, scope: anyio.CancelScope) -> None:
                with scope:
                    await producer.submit(STREAM, name.encode(), partition_key=KEY, tenant="t")
                    times[name] = anyio.current_time() - start

            head, behind = anyio.CancelScope(), anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(put, "head", head)
                await wait_until(lambda: waiting(producer) == 1)
                tg.start_soon(put, "behind", behind)
                await wait_until(lambda: waiting(producer) == 2)
                await anyio.sleep(0.05)
                head.cancel()
            stats = tenant(producer)
        assert times == {"behind": pytest.approx(0.1, abs=1e-6)}  # the head's time, not 0.2
        assert (stats.admitted_records, stats.waiting, stats.waits) == (11, 0, 1)

    @pytest.mark.timeout(15)
    async def test_closing_wakes_the_waiters(self) -> None:
        failures: list[BaseException] = []

        async def waiter(producer: Producer) -> None:
            try:
                await producer.submit(STREAM, b"w", partition_key=KEY, tenant="t")
            except errors.ProducerClosedError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            async with Producer(
                transport=FakeKinesis(),
                tenant_quotas={"t": TenantQuota(records_per_second=0.01)},  # one per 100 s
                **FAST,
            ) as producer:
                await ready(producer)
                await producer.submit(STREAM, b"one", partition_key=KEY, tenant="t")
                for n in (1, 2):
                    tg.start_soon(waiter, producer)
                    await wait_until(lambda n=n: waiting(producer) == n)  # type: ignore[misc]
                start = anyio.current_time()
            closed_at = anyio.current_time()
        assert closed_at - start < 1.0
        assert len(failures) == 2
        assert "quota" in str(failures[0])
        stats = producer.statistics().tenants["t"]
        assert (stats.admitted_records, stats.waiting) == (1, 0)

    @pytest.mark.timeout(15)
    async def test_a_failed_backpressure_wait_gives_the_tokens_back(self) -> None:
        fake = FakeKinesis()
        async with Producer(
            transport=fake,
            tenant_quotas={"t": TenantQuota(records_per_second=1, bytes_per_second=1000)},
            max_outstanding_records=1,
            admission_timeout=0.5,
            **FAST,
        ) as producer:
            await ready(producer)
            fake.hang = True
            await producer.submit(STREAM, b"stuck", partition_key=KEY)  # fills the room
            start = anyio.current_time()
            with pytest.raises(errors.BackpressureTimeout):
                await producer.submit(STREAM, DATA, partition_key=KEY, tenant="t")
            assert anyio.current_time() - start == pytest.approx(0.5)
            stats = tenant(producer)
            assert (stats.admitted_records, stats.admitted_bytes) == (0, 0)
            assert stats.token_levels == pytest.approx((1.0, 1000.0))  # all back
            fake.hang = False
            with anyio.move_on_after(1):
                await producer.flush()

    @pytest.mark.timeout(15)
    async def test_admission_timeout_bounds_both_waits_together(self) -> None:
        fake = FakeKinesis()
        async with Producer(
            transport=fake,
            tenant_quotas={"t": TenantQuota(records_per_second=1)},
            max_outstanding_records=1,
            admission_timeout=1.5,
            **FAST,
        ) as producer:
            await ready(producer)
            taken_at = anyio.current_time()
            await producer.put_record(STREAM, b"one", partition_key=KEY, tenant="t")
            fake.hang = True
            await producer.submit(STREAM, b"stuck", partition_key=KEY)  # fills the room
            start = anyio.current_time()
            with pytest.raises(errors.BackpressureTimeout, match="no room"):
                # the tenant's next token comes 1 s after the first was taken; what is left
                # of the 1.5 s goes to the wait for room
                await producer.submit(STREAM, DATA, partition_key=KEY, tenant="t")
            assert anyio.current_time() - start == pytest.approx(1.5)
            assert start - taken_at < 0.5  # so the quota wait was most of a second
            stats = tenant(producer)
            assert (stats.admitted_records, stats.waiting, stats.waits) == (1, 0, 1)
            fake.hang = False
            with anyio.move_on_after(1):
                await producer.flush()


# -- both backends -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("", errors.InvalidRecordError),
        ("x" * 257, errors.InvalidRecordError),
        (5, errors.RecordTypeError),
        (b"t", errors.RecordTypeError),
    ],
)
async def test_a_bad_tenant_is_refused_at_the_call(value: object, error: type[Exception]) -> None:
    async with Producer(transport=FakeKinesis(), **FAST) as producer:
        with pytest.raises(error, match="tenant"):
            await producer.submit(STREAM, b"x", partition_key=KEY, tenant=value)  # type: ignore[arg-type]
        with pytest.raises(error, match="tenant"):
            await producer.put_record(STREAM, b"x", partition_key=KEY, tenant=value)  # type: ignore[arg-type]
        assert producer.outstanding_records == 0
        assert producer.statistics().tenants == {}


@pytest.mark.anyio
async def test_records_carry_their_tenant_and_statistics_count_them() -> None:
    fake = FakeKinesis()
    async with Producer(
        transport=fake,
        tenant_quotas={"limited": TenantQuota(records_per_second=1000, bytes_per_second=1e6)},
        default_tenant_quota=TenantQuota(records_per_second=500),
        **FAST,
    ) as producer:
        pendings = [
            await producer.submit(STREAM, DATA, partition_key=KEY, tenant=name)
            for name in ("limited", "other", "x" * 256)
        ]
        plain = await producer.submit(STREAM, DATA, partition_key=KEY)
        for pending in [*pendings, plain]:
            assert (await pending).success
        statistics = producer.statistics()
    assert [p.tenant for p in pendings] == ["limited", "other", "x" * 256]
    assert plain.tenant is None
    assert set(statistics.tenants) == {"limited", "other", "x" * 256}
    limited = statistics.tenants["limited"]
    assert limited.quota == TenantQuota(records_per_second=1000, bytes_per_second=1e6)
    assert (limited.admitted_records, limited.admitted_bytes) == (1, 100)
    assert limited.token_levels[0] is not None
    assert limited.token_levels[1] is not None
    other = statistics.tenants["other"]
    assert other.quota == TenantQuota(records_per_second=500)
    assert other.token_levels[1] is None
    assert len(fake.user_records()) == 4


@pytest.mark.anyio
async def test_a_tenant_with_tokens_is_admitted_without_a_checkpoint() -> None:
    async with Producer(
        transport=FakeKinesis(), tenant_quotas={"t": TenantQuota(records_per_second=100)}, **FAST
    ) as producer:
        await ready(producer)
        with anyio.CancelScope() as scope:
            scope.cancel()
            # no checkpoint on the way: the cancellation is not delivered
            pending = await producer.submit(STREAM, b"x", partition_key=KEY, tenant="t")
        assert pending.tenant == "t"
        assert (await pending).success


@pytest.mark.anyio
async def test_statistics_of_a_producer_that_never_opened_have_no_tenants() -> None:
    producer = Producer(transport=FakeKinesis(), **FAST)
    assert producer.statistics().tenants == {}


# -- SyncProducer ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_producer_puts_for_a_tenant(backend: str) -> None:
    fake = FakeKinesis()
    quota = TenantQuota(records_per_second=2, burst=1.0)
    with SyncProducer(
        transport=fake,
        backend=backend,
        tenant_quotas={"t": quota},
        tenant_overflow="reject",
        **FAST,
    ) as producer:
        assert producer.put_record(STREAM, b"a", partition_key=KEY, tenant="t").success
        future = producer.submit(STREAM, b"b", partition_key=KEY, tenant="t")
        assert future.result(5).success
        with pytest.raises(errors.TenantQuotaExceeded) as info:
            producer.put_record(STREAM, b"c", partition_key=KEY, tenant="t")
        assert info.value.tenant == "t"
        with pytest.raises(errors.InvalidRecordError, match="tenant"):
            producer.submit(STREAM, b"d", partition_key=KEY, tenant="")
        stats = producer.statistics().tenants["t"]
    assert (stats.admitted_records, stats.rejected_records) == (2, 1)
    assert sorted(r.data for r in fake.user_records()) == [b"a", b"b"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_producer_timeout_covers_the_quota_wait(backend: str) -> None:
    with SyncProducer(
        transport=FakeKinesis(),
        backend=backend,
        tenant_quotas={"t": TenantQuota(records_per_second=0.01)},  # one per 100 s
        **FAST,
    ) as producer:
        producer.put_record(STREAM, b"a", partition_key=KEY, tenant="t")
        with pytest.raises(errors.BackpressureTimeout, match="not admitted"):
            producer.put_record(STREAM, b"b", partition_key=KEY, tenant="t", timeout=0.2)
        stats = producer.statistics().tenants["t"]
    assert (stats.admitted_records, stats.waiting) == (1, 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_producer_a_waiting_tenant_holds_up_only_its_own_records(backend: str) -> None:
    with SyncProducer(
        transport=FakeKinesis(),
        backend=backend,
        tenant_quotas={"slow": TenantQuota(records_per_second=0.01)},  # one per 100 s
        **{**FAST, "close_timeout": 0.5},
    ) as producer:
        producer.put_record(STREAM, b"first", partition_key=KEY, tenant="slow")
        results: list[BaseException] = []

        def blocked() -> None:  # waits 100 s for the tenant's next token
            try:
                producer.submit(STREAM, b"second", partition_key=KEY, tenant="slow")
            except errors.ProducerClosedError as exc:
                results.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        deadline = time.monotonic() + 5
        while producer.statistics().tenants["slow"].waiting == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        # other tenants, records without a tenant, and the same tenant's callers with a
        # timeout are not stuck behind it
        started = time.monotonic()
        assert producer.put_record(STREAM, b"other", partition_key=KEY, tenant="other").success
        assert producer.put_record(STREAM, b"plain", partition_key=KEY).success
        with pytest.raises(errors.BackpressureTimeout):
            producer.submit(STREAM, b"third", partition_key=KEY, tenant="slow", timeout=0.2)
        assert time.monotonic() - started < 3.0
    # closing gave up on the waiting record at once (close_timeout), instead of in 100 s
    thread.join(5)
    assert not thread.is_alive()
    assert len(results) == 1
