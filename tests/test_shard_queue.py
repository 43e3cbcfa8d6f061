"""A shard's queue in the Limiter: the deadline queue and the tenants' fair queue (pure)."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest

from anykpl._core._records import KinesisRecord, Record
from anykpl._core._shard_queue import (
    FAIR_QUANTUM,
    DeadlineQueue,
    FairQueue,
    QueuedRecord,
    ShardQueue,
)

SHARD = "shardId-000000000000"
_arrivals = itertools.count()


def record(
    tenant: str | None = None,
    *,
    size: int = 100,
    deadline: float = 0.0,
    expiration: float = 1000.0,
) -> KinesisRecord:
    data = bytes(size - 1)
    user = Record("stream", "k", data, 1, None, 0.0, deadline, expiration)
    kr = KinesisRecord([user], data, "k", "1", SHARD, deadline, expiration)
    kr.tenant = tenant
    return kr


def queued(kr: KinesisRecord, at: float = 0.0) -> QueuedRecord:
    return QueuedRecord(kr.deadline, next(_arrivals), kr, at)


class Tokens:
    """An ``admit`` that allows ``budget`` bytes, then refuses."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.asked: list[KinesisRecord] = []

    def __call__(self, item: QueuedRecord, now: float) -> bool:
        self.asked.append(item.record)
        if item.record.size > self.budget:
            return False
        self.budget -= item.record.size
        return True


def release(
    queue: ShardQueue, budget: float, now: float = 0.0
) -> tuple[list[KinesisRecord], list[KinesisRecord], bool]:
    out: list[KinesisRecord] = []
    expired: list[KinesisRecord] = []
    blocked = queue.release(now, Tokens(budget), out, expired)
    return out, expired, blocked


def test_queued_records_compare_by_deadline_then_arrival_never_by_record() -> None:
    a, b = record(deadline=1.0), record(deadline=1.0)
    heap: list[QueuedRecord] = []
    # a KinesisRecord has no ordering: comparing one would raise TypeError
    for item in (
        QueuedRecord(2.0, 1, a, 0.0),
        QueuedRecord(1.0, 3, b, 0.0),
        QueuedRecord(1.0, 2, a, 0.0),
    ):
        heapq.heappush(heap, item)
    order = [heapq.heappop(heap) for _ in range(3)]
    assert [(item.deadline, item.arrival) for item in order] == [(1.0, 2), (1.0, 3), (2.0, 1)]


def test_the_deadline_queue_releases_in_deadline_order_until_a_refusal() -> None:
    queue = DeadlineQueue()
    late, early, tie = record(deadline=2.0), record(deadline=1.0), record(deadline=1.0)
    for kr in (late, early, tie):
        queue.push(queued(kr))
    out, expired, blocked = release(queue, budget=200)
    assert out == [early, tie]  # equal deadlines leave in the order they arrived
    assert expired == []
    assert blocked
    assert [item.record for item in queue] == [late]
    out, _, blocked = release(queue, budget=1000)
    assert out == [late]
    assert not blocked
    assert len(queue) == 0


def test_expired_heads_leave_on_release_and_deeper_ones_on_expire() -> None:
    queue = DeadlineQueue()
    head = record(deadline=0.0, expiration=1.0)
    big = record(deadline=1.0, size=500)
    deep = record(deadline=2.0, expiration=1.0)
    for kr in (head, big, deep):
        queue.push(queued(kr))
    out, expired, blocked = release(queue, budget=100, now=2.0)
    # the head's TTL passed: it needed no tokens; the next one is refused, so the record
    # behind it stays until the queue is scanned
    assert (out, expired, blocked) == ([], [head], True)
    found: list[KinesisRecord] = []
    queue.expire(2.0, found)
    assert found == [deep]
    assert [item.record for item in queue] == [big]


def test_a_fair_queue_takes_over_a_deadline_queue_with_its_records_in_the_first_turn() -> None:
    plain = DeadlineQueue()
    untenanted = [record() for _ in range(3)]
    for kr in untenanted:
        plain.push(queued(kr))
    fair = FairQueue(plain)
    acme = record("acme")
    fair.push(queued(acme))
    assert len(fair) == 4
    out, _, blocked = release(fair, budget=math.inf)
    assert out == [*untenanted, acme]
    assert not blocked
    assert len(fair) == 0
    assert list(fair.turns) == []
    assert fair.deficits == {}
    assert list(fair.lanes) == [None]  # the lane without a tenant stays, empty


def test_lanes_take_turns_of_a_quantum_of_bytes() -> None:
    fair = FairQueue()
    size = FAIR_QUANTUM // 4
    for tenant in ("a", "b"):
        for _ in range(8):
            fair.push(queued(record(tenant, size=size)))
    out, _, _ = release(fair, budget=math.inf)
    assert [kr.tenant for kr in out] == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4


def test_a_record_bigger_than_the_quantum_waits_for_its_lane_to_save_up() -> None:
    fair = FairQueue()
    big = record("big", size=2 * FAIR_QUANTUM + 1)
    fair.push(queued(big))
    smalls = [record("small", size=FAIR_QUANTUM) for _ in range(5)]
    for kr in smalls:
        fair.push(queued(kr))
    out, _, _ = release(fair, budget=math.inf)
    # "big" saves one quantum a round and goes in the third
    assert out.index(big) == 2


def test_a_refused_lane_that_released_nothing_keeps_its_turn_and_savings() -> None:
    fair = FairQueue()
    big = record("big", size=FAIR_QUANTUM)
    fair.push(queued(big))
    fair.push(queued(record("small", size=100)))
    out, _, blocked = release(fair, budget=10)
    assert (out, blocked) == ([], True)
    assert fair.turns[0] == "big"
    assert fair.deficits["big"] == 0.0
    out, _, _ = release(fair, budget=FAIR_QUANTUM)  # the next refill is big's
    assert out == [big]


def test_a_refused_lane_that_released_some_passes_the_turn_and_drops_the_rest() -> None:
    fair = FairQueue()
    for _ in range(3):
        fair.push(queued(record("a", size=1000)))
    fair.push(queued(record("b", size=1000)))
    out, _, blocked = release(fair, budget=1500)
    assert [kr.tenant for kr in out] == ["a"]
    assert blocked
    assert list(fair.turns) == ["b", "a"]
    assert fair.deficits["a"] == 0.0  # not FAIR_QUANTUM - 1000: deficits stay bounded
    for _ in range(100):  # however often its turn is cut short
        release(fair, budget=1000)
        assert all(0.0 <= d <= FAIR_QUANTUM for d in fair.deficits.values())


def test_expire_removes_emptied_lanes_from_the_round() -> None:
    fair = FairQueue()
    gone = record("gone", expiration=1.0)
    stays = record("stays", size=5000)
    fair.push(queued(stays))
    fair.push(queued(gone))
    expired: list[KinesisRecord] = []
    fair.expire(2.0, expired)
    assert expired == [gone]
    assert len(fair) == 1
    assert list(fair.turns) == ["stays"]
    assert "gone" not in fair.lanes
    assert "gone" not in fair.deficits


@pytest.mark.parametrize("fair", [False, True])
def test_take_all_empties_the_queue(fair: bool) -> None:
    queue: ShardQueue = FairQueue() if fair else DeadlineQueue()
    records = [record(tenant if fair else None) for tenant in ("a", "b", "a")]
    for kr in records:
        queue.push(queued(kr))
    assert sorted(map(id, queue.take_all())) == sorted(map(id, records))
    assert len(queue) == 0
    assert list(queue) == []
    out, _, blocked = release(queue, budget=math.inf)
    assert (out, blocked) == ([], False)
