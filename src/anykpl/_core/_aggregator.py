"""The Aggregator: user records → Kinesis records, one open aggregate per predicted shard.

Mirrors aws/kinesis/core/aggregator.h and the Reducer (reducer.h) used in its first stage:
records are packed per predicted shard until a count or size limit, or until the earliest
deadline among them (``record_max_buffered_time`` after arrival, ``RMBT/2`` after a retry)
passes; the result is a :class:`~anykpl._core._records.KinesisRecord` in the KPL wire format
(single records are sent raw).

Where we differ, and why:

- The size trigger is checked *before* adding: if the record would push the aggregate past
  ``aggregation_max_size``, the aggregate is sealed first and the record starts the next one.
  The KPL adds, then sorts by deadline and trims from the end; with exact incremental sizes
  (``AggregateBuilder.add_within``) the check gives the same bound without the sort.
- A record that is larger than ``aggregation_max_size`` on its own goes out alone, raw.
- Records put with a tenant never share an aggregate with another tenant's, and a tenant's
  aggregates hold at most ``FAIR_QUANTUM`` (16 KiB, one turn of the Limiter's fair queue) when
  ``aggregation_max_size`` is larger; a tenant's record bigger than that goes alone, raw.
- Records that arrive while the shard map is not READY (at start, or after an invalidation)
  *wait* for it, up to their deadline plus ``SHARD_MAP_WAIT``, and are then aggregated and
  limited like any other. The KPL sends them alone and raw at once: at start-up that is a
  burst of one-record Kinesis records that no limiter has seen, which a busy producer turns
  into thousands of throttled records in its first second (measured on the emulator: 5,000
  raw records and ~10,000 throttles before the first ListShards answered, 146 ms in). If the
  map is still not ready when the wait ends, they go out raw, as in the KPL. A record whose
  TTL passes while it waits (a short ``record_ttl``, an older retried record) fails as expired
  then (within ``EXPIRY_SCAN_INTERVAL``, as in the Limiter), unsent, rather than at the wait's
  end; the others wait on.
- With aggregation off we *still* predict the shard (and wait for the map), so the limiter
  applies (KPL issue #127).
- A ``submit_many`` batch admitted in columns (``Intake.admit_columns``) joins its shards'
  aggregates as *items* (:meth:`Aggregator.put_items`), no record made per item: an open
  aggregate holds column items or records, never both (the other kind seals it first), and the
  sealed Kinesis record carries its items as chunks, ``(batch, positions)``. One item alone goes
  raw, made a record, as one record does.
- ``put`` is synchronous and called from the intake (no channel message per user record); the
  aggregator's task only handles deadlines, retries and flush requests, which arrive on its
  input stream. Deadlines are kept in one heap, so one timer serves every shard.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Final

from ._limiter import EXPIRY_SCAN_INTERVAL
from ._records import ColumnBatch, KinesisRecord, Record, ShardBacklog
from ._shard_queue import FAIR_QUANTUM
from ._wire import AggregateBuilder, KeyFacts, untrack_list

__all__ = ("SHARD_MAP_WAIT", "Aggregator")

#: How long past its deadline a record waits for a shard map that is not READY before it is
#: sent raw and unlimited (the KPL's behaviour, without the wait). The first ListShards of a
#: cold client against a cold endpoint took more than a second here; with a one-second wait a
#: start-up burst of 5,000 records went out raw and 3,000 of them were throttled (and the
#: throttles cut the shard's adaptive rate before it had sent anything of its own).
SHARD_MAP_WAIT = 5.0

#: The smallest data size of an aggregate of column items before its first item (larger than
#: any record's).
NO_ITEM_SIZE: Final = 1 << 40


class _OpenAggregate:
    __slots__ = (
        "builder",
        "deadline",
        "expiration",
        "first_key",
        "item_backlog",
        "item_bytes",
        "item_data",
        "item_high",
        "item_low",
        "items",
        "key",
        "limit",
        "nitems",
        "records",
        "shard",
    )

    def __init__(self, shard: str, key: str | tuple[str, str], limit: int) -> None:
        self.shard = shard
        # the aggregate's bytes may reach this: aggregation_max_size (FAIR_QUANTUM for a
        # tenant's) less its partition key's (the service counts a Kinesis record's data and
        # partition key against its limit)
        self.limit = limit
        # the shard, or (shard, tenant) for records put with a tenant: tenants never share an
        # aggregate, so the Limiter can queue each tenant's Kinesis records fairly
        self.key = key
        self.builder = AggregateBuilder()
        self.records: list[Record] = []
        self.deadline = math.inf
        self.expiration = math.inf
        # an aggregate of column items instead (Aggregator.put_items): its chunks, (batch,
        # positions) in the order they were added; how many items and their bytes (data and
        # key, as admitted); the shard backlog they count in; the first item's key (its hash
        # key is the container's explicit hash key); their data sizes' total, smallest and
        # largest
        self.items: list[tuple[ColumnBatch, list[int]]] | None = None
        self.nitems = 0
        self.item_bytes = 0
        self.item_backlog: ShardBacklog | None = None
        self.first_key: KeyFacts | None = None
        self.item_data = 0
        self.item_low = NO_ITEM_SIZE
        self.item_high = 0


class Aggregator:
    """Per-stream aggregation state. Pure: the caller passes times and moves the output."""

    def __init__(
        self,
        *,
        enabled: bool,
        max_size: int,
        max_count: int,
        container_partition_key: str,
        predict: Callable[[int], str | None],
        container_key_from_records: bool = False,
    ) -> None:
        self.enabled = enabled
        self.max_size = max_size
        self.max_count = max_count
        self.container_partition_key = container_partition_key
        # each aggregate under its first user record's key (Lambda's ParallelizationFactor)
        self.container_key_from_records = container_key_from_records
        # an aggregate under the constant key may be this big (see _OpenAggregate.limit)
        self._constant_limit = max_size - len(container_partition_key.encode())
        self.predict = predict
        self._open: dict[str | tuple[str, str], _OpenAggregate] = {}
        self._deadlines: list[tuple[float, int, _OpenAggregate]] = []
        self._counter = 0
        # records waiting for the shard map, and when the first of them stops waiting
        self._unmapped: list[Record] = []
        self._unmapped_until = math.inf
        # the first waiting record's deadline plus SHARD_MAP_WAIT: all go then, ready or not
        # (``_unmapped_until`` is earlier when a waiting record expires before)
        self._unmapped_wait_end = math.inf
        # ListShards failed for good (shard_map_failed): records without a shard go out raw
        # at once instead of waiting for a map that will not come
        self.map_unavailable = False
        # a flush came while records waited for the shard map
        self._flush_when_released = False
        # records whose TTL passed while they waited for the shard map (take_expired)
        self.expired: list[Record] = []

    def __repr__(self) -> str:
        return f"<Aggregator {len(self._open)} open aggregate(s) {self.buffered_records} records>"

    @property
    def buffered_records(self) -> int:
        """The user records buffered: in the open aggregates, and waiting for the shard map
        (counted when asked, not as they come and go)."""
        return sum(len(agg.records) + agg.nitems for agg in self._open.values()) + len(
            self._unmapped
        )

    @property
    def next_deadline(self) -> float:
        """The earliest deadline of any open aggregate (``inf`` when none)."""
        heap = self._deadlines
        while heap:
            deadline, _, agg = heap[0]
            if self._open.get(agg.key) is agg and agg.deadline == deadline:
                return min(deadline, self._unmapped_until)
            heapq.heappop(heap)
        return self._unmapped_until

    @property
    def open_aggregates(self) -> int:
        """Aggregates gathering records now."""
        return len(self._open)

    @property
    def waiting_for_shard_map(self) -> int:
        """User records waiting for the shard map to become READY."""
        return len(self._unmapped)

    def queue_depths(self) -> dict[str, int]:
        depths: dict[str, int] = {}
        for agg in self._open.values():
            depths[agg.shard] = depths.get(agg.shard, 0) + len(agg.records) + agg.nitems
        return depths

    def put(self, record: Record, out: list[KinesisRecord]) -> bool:
        """Add ``record``; append any sealed Kinesis records to ``out``.

        Returns True if the earliest deadline may have moved earlier (the caller should wake
        the deadline timer).
        """
        record.predicted_shard = self.predict(record.hash_key)
        return self.put_placed(record, out)

    def put_placed(self, record: Record, out: list[KinesisRecord]) -> bool:
        """:meth:`put` for a record whose shard was predicted already (``predicted_shard``,
        ``None`` while the shard map was not ready): the intake predicts it to admit the record
        by its shard's backlog, and the prediction is not repeated."""
        shard = record.predicted_shard
        if shard is None:
            if self.map_unavailable:
                # ListShards failed for good (a missing stream): out raw at once, to fail fast
                out.append(KinesisRecord.single(record))
                return False
            self._unmapped.append(record)
            if len(self._unmapped) == 1:
                self._unmapped_wait_end = record.deadline + SHARD_MAP_WAIT
                self._unmapped_until = min(self._unmapped_wait_end, record.expiration)
                return True
            if record.expiration < self._unmapped_until:
                # no record waits past its TTL (a short record_ttl, an older retried record)
                self._unmapped_until = record.expiration
                return True
            return False
        if not self.enabled:
            out.append(KinesisRecord.single(record))
            return False
        tenant = record.tenant
        key: str | tuple[str, str] = shard if tenant is None else (shard, tenant)
        agg = self._open.get(key)
        if agg is not None and agg.items is not None:
            # a record joins an open aggregate of column items: they become records (rather
            # than a seal each time submit and submit_many take turns on a shard)
            self._items_to_records(agg)
        if agg is None or not _add(agg.builder, record, agg.limit):
            # no open aggregate, or the record would push it past the limit: start the next
            limit = (
                self.max_size - len(record.partition_key.encode())
                if self.container_key_from_records
                else self._constant_limit
            )
            if tenant is not None and self.max_size > FAIR_QUANTUM:
                # a tenant's aggregates are at most one turn of the shard's fair queue, so a
                # quiet tenant's record waits for at most a turn's tokens per busy tenant (a
                # bigger aggregate holds the round until the shard has its whole size)
                limit -= self.max_size - FAIR_QUANTUM
            fresh = _OpenAggregate(shard, key, limit)
            if not _add(fresh.builder, record, limit):
                # too big to share an aggregate even alone: out on its own, raw, after the open
                # aggregate (sealed first so that records of one key keep their order)
                if agg is not None:
                    out.append(self._seal(agg))
                out.append(KinesisRecord.single(record))
                return False
            if agg is not None:
                out.append(self._seal(agg))
            agg = self._open[key] = fresh
        agg.records.append(record)
        if record.expiration < agg.expiration:
            agg.expiration = record.expiration
        if len(agg.records) >= self.max_count:  # full by count: out at once, as in the KPL
            if record.deadline < agg.deadline:
                agg.deadline = record.deadline
            out.append(self._seal(agg))
            return False
        if record.deadline < agg.deadline:
            agg.deadline = record.deadline
            self._counter += 1
            heapq.heappush(self._deadlines, (record.deadline, self._counter, agg))
            return True
        return False

    def add_to_open(self, record: Record, facts: KeyFacts) -> bool:
        """:meth:`put_placed`'s commonest case in one call: ``record`` (no tenant, under the
        partition key ``facts`` describes) joins its shard's open aggregate, which takes it
        without being sealed, and whose deadline and expiration it does not bring forward (it
        came later than the aggregate's first record). ``False`` (nothing changed) for
        anything else, which :meth:`put_placed` does."""
        agg = self._open.get(record.predicted_shard)  # type: ignore[arg-type]
        if (
            agg is None
            or agg.items is not None
            or self.map_unavailable
            or record.deadline < agg.deadline
            or record.expiration < agg.expiration
            or len(agg.records) + 1 >= self.max_count
            or not agg.builder.add_key_within(facts, record.data, agg.limit)
        ):
            return False
        agg.records.append(record)
        return True

    def put_run(self, shard: str, records: list[Record], out: list[KinesisRecord]) -> bool:
        """:meth:`put_placed` for ``records``, in order: records admitted together for
        ``shard`` (predicted), with one deadline and one expiration, no tenant, each under the
        key cache's :class:`KeyFacts` (a batch's records of one shard). While the shard's open
        aggregate takes them as :meth:`add_to_open` would, they join it in one call
        (:meth:`AggregateBuilder.add_keys_within`); the others, the first of each new aggregate
        among them, go by :meth:`put_placed`. Returns as :meth:`put_placed` does (for any)."""
        moved = False
        position = 0
        end = len(records)
        first = records[0]
        deadline = first.deadline
        expiration = first.expiration
        opened = self._open
        while True:
            agg = opened.get(shard)
            if (
                agg is not None
                and agg.items is None
                and not self.map_unavailable
                and deadline >= agg.deadline
                and expiration >= agg.expiration
            ):
                taken = agg.records
                # as add_to_open: the record that fills the aggregate by count goes by
                # put_placed, which seals it
                stop = min(end, position + self.max_count - 1 - len(taken))
                if stop > position:
                    added = agg.builder.add_keys_within(records, position, stop, agg.limit)
                    taken.extend(records[position:added])
                    position = added
                    if position == end:
                        return moved
            if self.put_placed(records[position], out):
                moved = True
            position += 1
            if position == end:
                return moved

    def put_items(
        self,
        backlog: ShardBacklog,
        batch: ColumnBatch,
        indices: list[int],
        out: list[KinesisRecord],
    ) -> bool:
        """Put a column batch's items at ``indices`` (all of ``backlog``'s shard) into the
        shard's open aggregate of column items, sealing into ``out`` each that fills; whether
        a new aggregate was opened (the caller's deadline to schedule). An aggregate holds
        column items or records, never both: items join an open aggregate of records as
        records (``ColumnBatch.take``) until it is full; one whose deadline or expiration comes
        later than the batch's is sealed first."""
        datas = batch.datas
        facts = batch.facts
        deadline = batch.deadline
        expiration = batch.expiration
        max_count = self.max_count
        shard = backlog.shard
        assert shard is not None  # a placed item's backlog always has one
        agg = self._open.get(shard)
        if (
            agg is not None
            and agg.items is None
            and not self.map_unavailable
            and deadline >= agg.deadline
            and expiration >= agg.expiration
        ):
            # an open aggregate of records (a submit's, say): items join it as records while
            # it takes them (as add_to_open), rather than a seal each time submit and
            # submit_many take turns on a shard; the rest start an aggregate of items
            records = agg.records
            add_record = agg.builder.add_key_within
            record_limit = agg.limit
            taken = 0
            for i in indices:
                if len(records) + 1 >= max_count or not add_record(
                    facts[i], datas[i], record_limit
                ):
                    break
                records.append(batch.take(i, backlog))
                taken += 1
            if taken == len(indices):
                return False
            indices = indices[taken:]
        if (
            agg is None
            or agg.items is None
            or deadline < agg.deadline
            or expiration < agg.expiration
        ):
            if agg is not None:
                out.append(self._seal(agg))
            agg = self._fresh_items(shard, backlog, deadline, expiration)
            moved = True
        else:
            moved = False
        # the items join the open aggregate in runs (AggregateBuilder.add_items_within), each
        # sealed as it fills and the next item starting a fresh one (the intake admits no
        # item too big to share an aggregate alone)
        start = 0
        end = len(indices)
        while True:
            count = agg.nitems
            stop = min(end, start + max_count - count)
            added = agg.builder.add_items_within(facts, datas, indices, start, stop, agg.limit)
            if added > start:
                if not count:
                    agg.first_key = facts[indices[start]]
                _store_items(agg, batch, indices[start:added], count + added - start)
            elif not count:
                raise AssertionError("an item the intake admitted fits no aggregate")
            if added == end:
                break
            out.append(self._seal(agg))
            agg = self._fresh_items(shard, backlog, deadline, expiration)
            moved = True
            start = added
        if agg.nitems >= max_count:  # full by count: out at once, as in the KPL
            out.append(self._seal(agg))
        return moved

    def _items_to_records(self, agg: _OpenAggregate) -> None:
        """The open aggregate of column items ``agg`` holds them as records from now on
        (``ColumnBatch.take``: counted where they were, their bytes in its builder already)."""
        items = agg.items
        assert items is not None
        backlog = agg.item_backlog
        agg.records = [batch.take(p, backlog) for batch, positions in items for p in positions]
        agg.items = None
        agg.nitems = agg.item_bytes = agg.item_data = agg.item_high = 0
        agg.item_low = NO_ITEM_SIZE
        agg.item_backlog = None
        agg.first_key = None

    def items_limit(self) -> int:
        """The size limit of an aggregate of column items: the constant one (column items go
        only where aggregation is on, without ``container_key_from_records``)."""
        return self._constant_limit

    def _fresh_items(
        self, shard: str, backlog: ShardBacklog, deadline: float, expiration: float
    ) -> _OpenAggregate:
        """A new open aggregate of column items for ``shard`` (``backlog``'s)."""
        new = self._open[shard] = _OpenAggregate(shard, shard, self._constant_limit)
        new.items = []
        new.item_backlog = backlog
        new.deadline = deadline
        new.expiration = expiration
        self._counter += 1
        heapq.heappush(self._deadlines, (deadline, self._counter, new))
        return new

    def _seal(self, agg: _OpenAggregate) -> KinesisRecord:
        del self._open[agg.key]
        items = agg.items
        if items is not None:
            if agg.nitems == 1:
                # one item alone goes raw, as one record does: made a record, the per-record
                # path takes it (ColumnBatch.take)
                batch, positions = items[0]
                return KinesisRecord.single(batch.take(positions[0], agg.item_backlog))
            first_key: KeyFacts = agg.first_key  # type: ignore[assignment]
            kr = KinesisRecord.aggregate(
                [],
                agg.builder,
                self.container_partition_key,
                str(first_key.hash_key),
                agg.shard,
                agg.deadline,
                agg.expiration,
            )
            kr.chunks = items
            kr.item_sizes = (agg.item_data, agg.item_low, agg.item_high)
            kr.nitems = agg.nitems
            kr.item_bytes = agg.item_bytes
            kr.item_backlog = agg.item_backlog
            return kr
        records = agg.records
        if len(records) == 1:
            return KinesisRecord.single(records[0])
        first = records[0]
        return KinesisRecord.aggregate(
            records,
            agg.builder,
            first.partition_key
            if self.container_key_from_records
            else self.container_partition_key,
            first.explicit_hash_key or str(first.hash_key),
            agg.shard,
            agg.deadline,
            agg.expiration,
        )

    def _release_unmapped(self, now: float, out: list[KinesisRecord], force: bool) -> None:
        """Aggregate the records that waited for the shard map if it is ready now; send them
        raw if it is not and their wait is over (or ``force``); those whose TTL has passed go
        to :attr:`expired` instead."""
        waiting = self._unmapped
        mapped = self.predict(waiting[0].hash_key) is not None
        if not mapped and not force and now < self._unmapped_until:
            return
        # those whose TTL has passed are not sent: raw, they would go past it; aggregated,
        # they would take their aggregate's records down with them
        live = self._expire_waiting(waiting, now)
        if not mapped and not force and now < self._unmapped_wait_end:
            # the map is not there and the wait not over: the others keep waiting, looked at
            # again at most every EXPIRY_SCAN_INTERVAL, as the Limiter's scan (not one wake-up
            # per record when their TTLs pass one by one)
            self._unmapped = live
            self._unmapped_until = (
                min(
                    self._unmapped_wait_end,
                    max(now + EXPIRY_SCAN_INTERVAL, min(r.expiration for r in live)),
                )
                if live
                else math.inf
            )
            return
        self._unmapped = []
        self._unmapped_until = math.inf
        for record in live:
            shard = record.predicted_shard = self.predict(record.hash_key)
            if shard is None:
                out.append(KinesisRecord.single(record))
            else:
                self.put_placed(record, out)  # predicted just now

    def _expire_waiting(self, waiting: list[Record], now: float) -> list[Record]:
        """Move the records of ``waiting`` whose TTL has passed to :attr:`expired` (they no
        longer count as buffered); return the others."""
        live: list[Record] = []
        for record in waiting:
            if record.expiration <= now:
                self.expired.append(record)
            else:
                live.append(record)
        return live

    def take_expired(self) -> list[Record]:
        """The records whose TTL passed while they waited for the shard map, since the last
        call: the caller fails them as expired (they are not sent)."""
        expired, self.expired = self.expired, []
        return expired

    def shard_map_failed(self) -> bool:
        """The map will not come (ListShards failed for good, a missing stream): records
        without a shard go out raw from now on, to fail fast, and those waiting for it go at
        the next :meth:`flush_due`. Returns whether any were waiting (the caller wakes the
        task that flushes)."""
        self.map_unavailable = True
        if not self._unmapped:
            return False
        self._unmapped_until = self._unmapped_wait_end = -math.inf
        return True

    def shard_map_ready(self) -> None:
        """The map is there (again): records are placed by their shards."""
        self.map_unavailable = False

    def flush_due(self, now: float, out: list[KinesisRecord]) -> None:
        """Seal every aggregate whose deadline has passed; release records that waited for the
        shard map once it is ready."""
        if self._unmapped:
            self._release_unmapped(now, out, force=False)
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, agg = heapq.heappop(heap)
            if self._open.get(agg.key) is agg and agg.deadline == deadline:
                out.append(self._seal(agg))

    def flush_all(self, out: list[KinesisRecord], now: float = -math.inf) -> None:
        """Seal every open aggregate (a manual flush) at ``now``.

        Records waiting for the shard map go only if it is ready now (those past their TTL at
        ``now`` to :attr:`expired`); otherwise they keep waiting for it (until their own wait
        ends, see :meth:`flush_due`). Forcing them out
        raw sent every record of a submit-then-flush burst at start-up unaggregated and past
        the limiter (measured: 3,000 records in one go, 2,000 of them throttled)."""
        if self._unmapped:
            self._release_unmapped(now, out, force=False)
            # still waiting: the flush is theirs too, once they go (see deferred_flush_due)
            self._flush_when_released = bool(self._unmapped)
        for agg in list(self._open.values()):
            out.append(self._seal(agg))
        self._deadlines.clear()

    def seal_all(
        self,
        out: list[KinesisRecord],
        busy: AbstractSet[str | tuple[str, str]] = frozenset(),
        now: float = 0.0,
        horizon: float = 0.0,
    ) -> bool:
        """Seal the open aggregates now (adaptive batching: nothing is in flight that they
        could wait for), except those of the ``busy`` lanes (a shard, or a ``(shard, tenant)``
        for records put with a tenant, as ``Limiter.waiting_lanes`` gives them: their records
        wait for tokens, so the aggregate keeps gathering) and, with a ``horizon``, those that
        fill up within it at the pace they have been filling since their first record (a
        firehose's, which a full aggregate serves better than an early one; such an
        aggregate's deadline comes at the horizon's end at the latest; one record alone tells
        no pace). Records waiting for the shard map keep waiting. Returns whether an aggregate
        was left filling (a busy lane's does not count: it goes with its shard's tokens)."""
        filling = False
        for agg in list(self._open.values()):
            if agg.key in busy:
                continue
            items = agg.items
            if horizon > 0.0 and (len(agg.records) > 1 if items is None else agg.nitems > 1):
                size = agg.builder.size
                age = now - (agg.records[0].arrival if items is None else items[0][0].arrival)
                # fills within the horizon: (limit - size) / (size / age) <= horizon, against
                # the aggregate's own limit (a tenant's is one turn of the fair queue)
                if (agg.limit - size) * age <= horizon * size:
                    # ... or goes at the horizon's end, should the pace not hold (a burst)
                    deadline = now + horizon
                    if deadline < agg.deadline:
                        agg.deadline = deadline
                        self._counter += 1
                        heapq.heappush(self._deadlines, (deadline, self._counter, agg))
                    filling = True
                    continue
            out.append(self._seal(agg))
        return filling

    def open_outside(self, busy: AbstractSet[str | tuple[str, str]]) -> bool:
        """Whether an aggregate is gathering records for a lane (a shard, or a ``(shard,
        tenant)``) not in ``busy``."""
        return any(agg.key not in busy for agg in self._open.values())

    def deferred_flush_due(self) -> bool:
        """Whether records a flush found waiting for the shard map have gone since (the
        caller flushes again, so that they do not wait out their buffered time)."""
        if self._flush_when_released and not self._unmapped:
            self._flush_when_released = False
            return True
        return False

    def take_all_records(self) -> list[Record]:
        """Remove and return every buffered user record (used when failing everything). A
        column batch's items are not among them: the producer takes those over first
        (``Intake.take_all_items``), and their chunks here are dropped with the aggregates."""
        records = [r for agg in self._open.values() for r in agg.records]
        records.extend(self._unmapped)
        records.extend(self.expired)
        self._unmapped = []
        self._unmapped_until = math.inf
        self.expired = []
        self._open.clear()
        self._deadlines.clear()
        return records


def _add(builder: AggregateBuilder, record: Record, limit: float) -> bool:
    """Add ``record`` to ``builder`` if the aggregate stays within ``limit``: by its partition
    key's facts from the key cache, or by the key's text (a record with an explicit hash key,
    or one made without the cache)."""
    facts = record.key_facts
    if facts is None:
        return builder.add_within(
            record.partition_key, record.explicit_hash_key, record.data, limit
        )
    return builder.add_key_within(facts, record.data, limit)


def _store_items(
    agg: _OpenAggregate,
    batch: ColumnBatch,
    chunk: list[int],
    count: int,
) -> None:
    """Store what :meth:`Aggregator.put_items` added to the open aggregate ``agg`` of column
    items: ``chunk``, the batch's positions it took (if any), their bytes and data sizes
    (summed by builtins, no bytecode per item), and its count of items, ``count``."""
    agg.nitems = count
    if not chunk:
        return
    if untrack_list is not None:  # (positions)
        untrack_list(id(chunk))
    agg.items.append((batch, chunk))  # type: ignore[union-attr]
    agg.item_bytes += sum(map(batch.sizes.__getitem__, chunk))
    lengths = list(map(len, map(batch.datas.__getitem__, chunk)))
    agg.item_data += sum(lengths)
    low = min(lengths)
    if low < agg.item_low:
        agg.item_low = low
    high = max(lengths)
    if high > agg.item_high:
        agg.item_high = high
