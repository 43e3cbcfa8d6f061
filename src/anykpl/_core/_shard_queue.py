"""The queue of one shard's Kinesis records waiting in the Limiter for tokens.

Two implementations behind one small interface (:class:`ShardQueue`), so the Limiter reads like
the KPL's ``limiter.h`` — buckets, a queue per shard, drain — whichever queue a shard has:

- :class:`DeadlineQueue` mirrors aws/utils/time_sensitive_queue.h: records leave in deadline
  order (by arrival among equal deadlines), and those whose TTL has passed are removed. Every
  shard starts with one; it is the hot path.
- :class:`FairQueue` is beyond the KPL (see docs/tenants.md): one deadline queue per tenant, a
  *lane*, served by deficit round robin in bytes, so a tenant with a backlog cannot hold back a
  quiet tenant's records on the same shard. Records without a tenant share one lane. A shard
  switches to it when its first record with a tenant arrives, and keeps it.

The interface: :meth:`~ShardQueue.push` a record; :meth:`~ShardQueue.release` records in the
queue's order while the Limiter's ``admit`` gives them tokens (the first refusal stops the
shard: head of line); :meth:`~ShardQueue.expire` the records whose TTL passed; ``take_all``
when failing everything; ``len`` and iteration over what is queued. The queues know nothing of
tokens: ``admit`` takes them (and counts the record released) or blocks the shard.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from ._records import KinesisRecord

__all__ = ("FAIR_QUANTUM", "Admit", "DeadlineQueue", "FairQueue", "QueuedRecord", "ShardQueue")

#: Bytes a tenant's lane may release per round of the fair queue (deficit round robin): about
#: 16 ms of a shard's 1 MiB/s. A tenant's aggregates hold at most this much (``Aggregator``),
#: so a quiet tenant's record waits about that long per busy tenant ahead of it in the round.
#: A bigger Kinesis record (the lane without a tenant's aggregates, up to
#: ``aggregation_max_size``, 50 KiB by default; a tenant's record too big to aggregate) goes
#: once its lane has saved up enough turns, and holds the round until the shard has its size.
FAIR_QUANTUM = 16 * 1024


class QueuedRecord(NamedTuple):
    """A Kinesis record in a shard's queue. A tuple, so the heap compares it as one (deadline
    first, then the order of arrival; never the record) and quickly."""

    deadline: float
    arrival: int  # the tie-breaker: a counter, unique per Limiter
    record: KinesisRecord
    queued_at: float  # when it was queued (for the time spent waiting for tokens)


#: ``admit(item, now)``: take the tokens for a queued record and count it released (True), or
#: block its shard until they could be there (False). The Limiter's, per shard.
Admit = Callable[[QueuedRecord, float], bool]


class ShardQueue(Protocol):
    """What the Limiter asks of a shard's queue."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[QueuedRecord]: ...

    def push(self, item: QueuedRecord) -> None:
        """Queue a record."""

    def release(
        self, now: float, admit: Admit, out: list[KinesisRecord], expired: list[KinesisRecord]
    ) -> bool:
        """Move records, in the queue's order, into ``out`` while ``admit`` allows, and
        expired ones met on the way into ``expired``; return whether ``admit`` refused one
        (the shard is blocked and records remain)."""

    def expire(self, now: float, expired: list[KinesisRecord]) -> None:
        """Move every record whose TTL has passed into ``expired`` (a scan of the queue)."""

    def take_all(self) -> list[KinesisRecord]:
        """Remove and return every queued record."""


class DeadlineQueue:
    """Records in deadline order: a heap of :class:`QueuedRecord` (the KPL's
    ``TimeSensitiveQueue``)."""

    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[QueuedRecord] = []

    def __repr__(self) -> str:
        return f"<DeadlineQueue {len(self.heap)} record(s)>"

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self) -> Iterator[QueuedRecord]:
        return iter(self.heap)

    def push(self, item: QueuedRecord) -> None:
        heapq.heappush(self.heap, item)

    def release(
        self, now: float, admit: Admit, out: list[KinesisRecord], expired: list[KinesisRecord]
    ) -> bool:
        # the hot loop: one pass per Kinesis record
        heap = self.heap
        heappop = heapq.heappop
        while heap:
            item = heap[0]
            kr = item.record
            if kr.expiration < now:
                heappop(heap)
                expired.append(kr)
            elif admit(item, now):
                heappop(heap)
                out.append(kr)
            else:
                return True
        return False

    def expire(self, now: float, expired: list[KinesisRecord]) -> None:
        heap = self.heap
        keep = [item for item in heap if item.record.expiration >= now]
        if len(keep) == len(heap):
            return
        expired.extend(item.record for item in heap if item.record.expiration < now)
        heapq.heapify(keep)
        heap[:] = keep

    def take_all(self) -> list[KinesisRecord]:
        records = [item.record for item in self.heap]
        self.heap.clear()
        return records


class FairQueue:
    """One :class:`DeadlineQueue` per tenant (a lane; ``None``: the records without a tenant),
    served by deficit round robin in bytes.

    Each turn adds ``FAIR_QUANTUM`` bytes to a lane's deficit and releases its records
    (deadline order) while they fit in it; a lane that empties leaves the round. When the shard
    runs out of tokens, a lane that released nothing this turn keeps its turn and what it had
    saved; one that released something passes the next turn to the next lane and drops what is
    left of this turn's quantum (see :meth:`release`)."""

    __slots__ = ("_size", "deficits", "lanes", "turns")

    def __init__(self, plain: DeadlineQueue | None = None) -> None:
        """A fair queue whose lane without a tenant starts as ``plain`` (the shard's deadline
        queue until now)."""
        plain = DeadlineQueue() if plain is None else plain
        self.lanes: dict[str | None, DeadlineQueue] = {None: plain}
        # the round robin's order: the tenants whose lanes hold records
        self.turns: deque[str | None] = deque()
        # each lane in the round: bytes saved up from earlier turns
        self.deficits: dict[str | None, float] = {}
        self._size = len(plain)
        if plain:
            self.turns.append(None)
            self.deficits[None] = 0.0

    def __repr__(self) -> str:
        return f"<FairQueue {len(self.turns)} lane(s) {self._size} record(s)>"

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[QueuedRecord]:
        for lane in self.lanes.values():
            yield from lane

    def push(self, item: QueuedRecord) -> None:
        tenant = item.record.tenant
        lane = self.lanes.get(tenant)
        if lane is None:
            lane = self.lanes[tenant] = DeadlineQueue()
        if not lane:
            self.turns.append(tenant)
            self.deficits[tenant] = 0.0
        lane.push(item)
        self._size += 1

    def release(
        self, now: float, admit: Admit, out: list[KinesisRecord], expired: list[KinesisRecord]
    ) -> bool:
        lanes, turns, deficits = self.lanes, self.turns, self.deficits
        heappop = heapq.heappop
        left = self._size
        blocked = False
        while turns and not blocked:
            tenant = turns[0]
            heap = lanes[tenant].heap
            deficit = deficits[tenant] + FAIR_QUANTUM
            took = False
            while heap:
                item = heap[0]
                kr = item.record
                if kr.expiration < now:
                    heappop(heap)
                    expired.append(kr)
                    left -= 1
                    continue
                if kr.size > deficit:
                    break
                if not admit(item, now):
                    blocked = True
                    break
                heappop(heap)
                out.append(kr)
                left -= 1
                deficit -= kr.size
                took = True
            if blocked and not took:
                # out of tokens before this lane released anything: it keeps its turn (and
                # what it had saved), so the next refill is its own. Rotating it would let the
                # other lanes take every refill first, and a record needing more tokens than
                # they leave would never go.
                deficits[tenant] = deficit - FAIR_QUANTUM
            elif blocked:
                # out of tokens after releasing some: the next release starts with the next
                # lane, so each refill goes to a different tenant first; what is left of this
                # turn's quantum is dropped (a deficit carried over from earlier turns is
                # kept), which keeps deficits bounded however often a turn is cut short
                deficits[tenant] = max(0.0, deficit - FAIR_QUANTUM)
                turns.rotate(-1)
            elif heap:
                deficits[tenant] = deficit
                turns.rotate(-1)
            else:
                turns.popleft()
                self._leave(tenant)
        self._size = left
        return blocked

    def expire(self, now: float, expired: list[KinesisRecord]) -> None:
        lanes = self.lanes
        for tenant in list(self.turns):
            lane = lanes[tenant]
            before = len(lane)
            lane.expire(now, expired)
            self._size -= before - len(lane)
            if not lane:
                self.turns.remove(tenant)
                self._leave(tenant)

    def _leave(self, tenant: str | None) -> None:
        """Forget an emptied lane that has left the round (the lane without a tenant stays,
        empty)."""
        del self.deficits[tenant]
        if tenant is not None:
            del self.lanes[tenant]

    def take_all(self) -> list[KinesisRecord]:
        records: list[KinesisRecord] = []
        for lane in self.lanes.values():
            records.extend(lane.take_all())
        self.lanes = {None: self.lanes[None]}
        self.turns.clear()
        self.deficits.clear()
        self._size = 0
        return records
