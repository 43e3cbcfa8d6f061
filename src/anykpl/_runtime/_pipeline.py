"""One stream's pipeline: the stages, the streams between them, and their tasks.

::

    intake ──put()──► Aggregator ─[limiter_in]─► Limiter ─[collector_in]─► Collector
                          ▲                                                      │
                     [aggregator_in]                                       [sender_in]
                          │                                                      ▼
                       Retrier ◄──────────────[retrier_in]─────────────────── Sender

Each bracket is an anyio memory object stream; each stage is a task in the producer's task
group. Messages are *lists* of Kinesis records (or a whole PutRecords request), never one per
user record: the intake calls :meth:`Aggregator.put` synchronously and ships whatever it seals.
The aggregator's input carries retries plus three control messages, ``WAKE`` (a record with an
earlier deadline arrived), ``FLUSH`` (a manual flush, which travels down the pipeline and
flushes the collector once the aggregates ahead of it have passed) and ``SEND_NOW`` (adaptive
batching: no request is in flight, so what the stages hold goes at once; docs/batching.md).

The streams are unbounded in type but bounded in practice: every message holds admitted
records, and admission is capped by ``max_outstanding_records``/``max_outstanding_bytes``.
That is also what makes the Retrier → Aggregator cycle safe (a bounded buffer in a cycle can
deadlock).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import errors
from .._core._aggregator import Aggregator
from .._core._collector import Collector
from .._core._intake import StreamIntake
from .._core._limiter import AdaptiveSettings, Limiter
from .._core._metrics import Metrics
from .._core._network import NetworkWindow
from .._core._records import AttemptRecord, KinesisRecord, Record, ShardBacklog
from .._core._retrier import Outcome, Retrier, RetryBudget, StatisticSet
from .._core._shard_map import ShardMap
from .._core._token_bucket import TokenBucket
from .._transport._botocore import error_code
from .._transport._protocol import Transport
from ..config import ProducerConfig
from ._sender import run_sender
from ._shard_refresh import run_shard_map
from ._statistics import ShardStatistics, StreamStatistics

__all__ = ("Pipeline",)

#: Resolves records and returns how many were still pending and their bytes (the producer's).
ProducerFinish = Callable[[Sequence[Record], bool], tuple[int, int]]

#: How often the stream's backlog limit is planned again (by the Limiter's task), and how
#: many Kinesis records must have been released before their aggregation ratio is trusted.
BACKLOG_INTERVAL = 0.25
RATIO_SAMPLES = 100
#: Adaptive batching: when the last request in flight returns, an aggregate that would fill up
#: within this share of ``record_max_buffered_time`` at the pace it has been filling keeps
#: gathering (until then at the latest); the others go at once.
FILL_HORIZON = 0.25


class Control(Enum):
    """The control messages that travel the pipeline's streams beside the records."""

    #: a record with an earlier deadline arrived: the Aggregator plans its wake-up again
    WAKE = "wake"
    #: a manual flush: each stage sends what it holds, then passes the marker on
    FLUSH = "flush"
    #: the end of the stream: the stage returns
    END = "end"
    #: adaptive batching: nothing is in flight, so each stage sends what it holds now (as a
    #: flush does, but for the records already there; the Limiter's tokens still apply)
    SEND_NOW = "send now"


WAKE, FLUSH, END, SEND_NOW = Control.WAKE, Control.FLUSH, Control.END, Control.SEND_NOW


#: What travels each stream: the Aggregator's input carries retries (user records); the
#: Limiter's and the Collector's, Kinesis records; the Sender's, PutRecords requests; the
#: Retrier's, outcomes; control messages ride along where a stage needs them.
AggregatorMessage = list[Record] | Control
LimiterMessage = list[KinesisRecord] | Control
CollectorMessage = list[KinesisRecord] | Control
_T = TypeVar("_T")


async def _receive_until(
    stream: MemoryObjectReceiveStream[_T], deadline: float
) -> _T | Control | None:
    """The next message, ``None`` once ``deadline`` (absolute) has passed, or ``END`` when the
    upstream side has closed (shutdown cascades through the stages this way)."""
    try:
        if deadline == math.inf:
            return await stream.receive()
        with anyio.CancelScope(deadline=deadline):
            return await stream.receive()
    except anyio.EndOfStream:
        return END
    return None


#: The most messages a stage takes from its input in one go.
MAX_COALESCE = 1024


async def _receive_batch(
    stream: MemoryObjectReceiveStream[_T], deadline: float
) -> list[_T | Control]:
    """The next message and every message already queued behind it (up to ``MAX_COALESCE``);
    ``[]`` once ``deadline`` has passed; ending with ``END`` if the upstream side has closed.

    A stage that falls behind (the event loop busy sending) then handles its backlog as one
    batch instead of one message at a time: with aggregation off every user record is its own
    message, and handling them singly made one PutRecords request per record once their
    deadlines had passed in the queue (measured: 1.6 records per request, ~900 records/s).
    """
    first = await _receive_until(stream, deadline)
    if first is None:
        return []
    messages: list[_T | Control] = [first]
    while first is not END and len(messages) < MAX_COALESCE:
        try:
            messages.append(stream.receive_nowait())
        except anyio.WouldBlock:
            break
        except anyio.EndOfStream:
            messages.append(END)
            break
    return messages


class Pipeline:
    """The stages of one stream. Created by the producer; its tasks run in a task group of
    their own, inside the producer's, so that the producer can stop one stream (an idle one,
    ``stream_idle_timeout``) without touching the others."""

    def __init__(
        self,
        stream: str,
        config: ProducerConfig,
        transport: Transport,
        metrics: Metrics,
        finish: ProducerFinish,
        shared_bucket: TokenBucket | None = None,
        place_unplaced: Callable[[StreamIntake], None] | None = None,
        finish_items: Callable[[ShardBacklog, int, int], None] | None = None,
    ) -> None:
        self.stream = stream
        # the producer's Intake.place_unplaced: records admitted before the shard map was
        # ready move into their shards' backlogs once it is
        self._place_unplaced = place_unplaced
        self.config = config
        self.transport = transport
        self.metrics = metrics
        self.shard_map = ShardMap()
        self.aggregator = Aggregator(
            enabled=config.aggregation_enabled,
            max_size=config.aggregation_max_size,
            max_count=config.aggregation_max_count,
            container_partition_key=config.container_partition_key,
            predict=self.shard_map.shard_id,
            container_key_from_records=config.container_key_from_records,
        )
        adaptive = None
        if config.adaptive:
            adaptive = AdaptiveSettings(
                decrease=config.adaptive_decrease,
                increase=config.adaptive_increase,
                floor=config.adaptive_floor,
                window=config.adaptive_window,
            )
        self.limiter = Limiter(
            rate_limit_percent=config.rate_limit,
            adaptive=adaptive,
            shared=shared_bucket,
            stream=stream,
        )
        self.collector = Collector(
            max_count=config.collection_max_count,
            max_size=config.collection_max_size,
            record_max_buffered_time=config.record_max_buffered_time,
            extend_deadlines=config.aggregation_enabled,
        )
        self.retrier = Retrier(
            stream=stream,
            shard_map=self.shard_map,
            finish=self.finish,
            count=self._count,
            request_refresh=self._request_refresh,
            record_max_buffered_time=config.record_max_buffered_time,
            fail_if_throttled=config.fail_if_throttled,
            backoff_initial=config.retry_backoff_initial,
            backoff_max=config.retry_backoff_max,
            observe=self._observe,
            on_outcome=self.limiter.outcome,
            finish_items=self._finish_items,
            retry_budget=(
                None
                if config.retry_budget is None
                else RetryBudget(config.retry_budget, anyio.current_time())
            ),
        )
        # unbounded: see the module's docstring
        self.aggregator_send: MemoryObjectSendStream[AggregatorMessage]
        self.aggregator_in: MemoryObjectReceiveStream[AggregatorMessage]
        self.aggregator_send, self.aggregator_in = anyio.create_memory_object_stream[
            AggregatorMessage
        ](math.inf)
        self.limiter_send: MemoryObjectSendStream[LimiterMessage]
        self.limiter_in: MemoryObjectReceiveStream[LimiterMessage]
        self.limiter_send, self.limiter_in = anyio.create_memory_object_stream[LimiterMessage](
            math.inf
        )
        self.collector_send: MemoryObjectSendStream[CollectorMessage]
        self.collector_in: MemoryObjectReceiveStream[CollectorMessage]
        self.collector_send, self.collector_in = anyio.create_memory_object_stream[
            CollectorMessage
        ](math.inf)
        self.sender_send: MemoryObjectSendStream[list[KinesisRecord]]
        self.sender_in: MemoryObjectReceiveStream[list[KinesisRecord]]
        self.sender_send, self.sender_in = anyio.create_memory_object_stream[list[KinesisRecord]](
            math.inf
        )
        self.retrier_send: MemoryObjectSendStream[Outcome]
        self.retrier_in: MemoryObjectReceiveStream[Outcome]
        self.retrier_send, self.retrier_in = anyio.create_memory_object_stream[Outcome](math.inf)
        self._refresh_event = anyio.Event()
        # ListShards' last error while the map is not ready ("code: message"), for the records
        # that expire waiting for it
        self._shard_map_error: str | None = None
        # ListShards has answered (a map or an error) at least once; the event a batch waits
        # on for that (first_map_answered), made when one does
        self._map_answered = False
        self._map_answered_event: anyio.Event | None = None
        # Admission by what the stream's shards can deliver (``max_outstanding_time``): each
        # shard's backlog limit lives in the intake, planned again by the Limiter's task every
        # BACKLOG_INTERVAL (see update_backlog_limit).
        backlog_time = config.max_outstanding_time
        self.backlog_time = config.record_ttl / 2 if backlog_time is None else backlog_time
        # the synchronous intake: admitted records into the aggregator, the stream's counts
        self.intake = StreamIntake(
            finish,
            self.aggregator,
            self.shard_map,
            config.record_max_buffered_time,
            config.record_ttl,
            self.backlog_time,
            ship=self.limiter_send.send_nowait,
            wake=self._wake_aggregator,
            request_refresh=self._request_refresh,
            finish_items=finish_items,
        )
        self._received_counted = 0
        self.in_flight = 0
        # the Collector holds records past their deadline while a request waits for the Sender
        self._collector_held = False
        # the bytes in flight the network path carries (the Sender keeps to it)
        self.network = NetworkWindow(self.request_timeout, config.request_timeout)
        # adaptive batching (Nagle's rule): while no request is in flight, records go at once;
        # while one is, they gather until it returns (or a size limit, or their deadline)
        self.adaptive_batching = config.adaptive_batching
        self._send_now_horizon = 0.0  # for the next SEND_NOW (see _idle)
        self._gathering = False  # the last SEND_NOW left aggregates gathering on purpose
        self._fill_horizon = FILL_HORIZON * config.record_max_buffered_time
        # how long the stream's last PutRecords request took (not yet known: as long as one
        # may), for lingering: only where requests come back within the fill horizon
        self._last_request_time = math.inf
        if self.adaptive_batching:
            self.intake.send_now = self._send_now
            self.intake.idle = True
        self._next_backlog_update = -math.inf
        self._network_cuts = 0  # the network window's cuts when the limits were last planned
        self.on_room: Callable[[], None] | None = None  # the producer's wake-up for waiters
        self.update_backlog_limit(-math.inf)
        # the stages' scope: cancelled by stop() (created now, so stop() works before start)
        self._scope = anyio.CancelScope()
        self.stopped = False

    def __repr__(self) -> str:
        return f"<Pipeline {self.stream!r} {self.shard_map!r} {self.aggregator!r}>"

    # -- intake (called synchronously by the producer) ------------------------------------

    def put(self, record: Record) -> None:
        """Hand an admitted record to the aggregator (:meth:`StreamIntake.put`), its shard
        predicted now."""
        self.intake.place(record)
        self.intake.put(record)

    def _wake_aggregator(self) -> None:
        self.aggregator_send.send_nowait(WAKE)

    def _send_now(self) -> None:
        """A record came while the stream was idle: the stages send what they hold at once."""
        self.aggregator_send.send_nowait(SEND_NOW)

    def _idle(self, horizon: float = 0.0) -> None:
        """No request is in flight any more (adaptive batching): what waits in the
        Aggregator or the Collector goes now; with nothing there, the next record that comes
        asks for it. A shard whose records wait for the Limiter's tokens is not idle: its
        aggregate keeps gathering until its deadline (or a later SEND_NOW finds the shard's
        tokens caught up), as it would without adaptive batching, since sending it early
        would only spend the shard's record tokens. With tenants this holds per lane: a
        tenant with nothing waiting on the shard sends its aggregate, which takes its turn in
        the shard's round robin (``Limiter.waiting_lanes``). An aggregate that fills within
        ``horizon`` at its pace keeps gathering too (``Aggregator.seal_all``). Records waiting
        for the shard map go when it is ready (the Aggregator's task sends them on if the
        stream is idle then)."""
        aggregator = self.aggregator
        if len(self.collector) or aggregator.open_outside(self.limiter.waiting_lanes()):
            self._send_now_horizon = horizon
            self.aggregator_send.send_nowait(SEND_NOW)
        elif not aggregator.waiting_for_shard_map:
            # (while records wait for the map, the next ones wait with them: its arrival sends
            # them, see _run_aggregator)
            self.intake.idle = True

    def flush(self) -> None:
        self.aggregator_send.send_nowait(FLUSH)

    # -- admission by what the stream can deliver ----------------------------------------

    def admit(self, size: int) -> None:
        """Count a record admitted for this stream (its data + partition key bytes)."""
        intake = self.intake
        intake.outstanding_records += 1
        intake.outstanding_bytes += size
        intake.received += 1

    # the stream's counts and backlog limit live in its intake (compiled with it)
    @property
    def received(self) -> int:
        return self.intake.received

    @property
    def outstanding_records(self) -> int:
        return self.intake.outstanding_records

    @property
    def outstanding_bytes(self) -> int:
        return self.intake.outstanding_bytes

    @property
    def backlog_records(self) -> float:
        return self.intake.backlog_records

    @backlog_records.setter
    def backlog_records(self, value: float) -> None:
        self.intake.backlog_records = value

    @property
    def backlog_bytes(self) -> float:
        return self.intake.backlog_bytes

    @backlog_bytes.setter
    def backlog_bytes(self, value: float) -> None:
        self.intake.backlog_bytes = value

    def take_received(self) -> int:
        """User records admitted since the last call (for ``UserRecordsReceived``)."""
        new = self.received - self._received_counted
        self._received_counted = self.received
        return new

    def has_room(self, size: int) -> bool:
        """Whether a record of ``size`` bytes whose shard is not known fits in the stream's
        backlog limit (a stream with nothing outstanding always takes one record)."""
        return self.intake.has_room(size, self.intake.unplaced)

    def finish(self, records: Sequence[Record], success: bool) -> None:
        """Resolve records of this stream (the Retrier's, and the producer's when it fails
        everything) and give their room back."""
        self.intake.finish(records, success)

    def _finish_items(self, kr: KinesisRecord) -> None:
        """A Kinesis record of column items succeeded (the Retrier's): their room back."""
        self.intake.finish_items(kr)

    def fail_all(self, records: Sequence[Record], attempt: AttemptRecord) -> None:
        """Fail ``records`` (this stream's outstanding ones, wherever they are: in a stage,
        in flight, in backoff) with ``attempt``, and drop what the stages hold."""
        self.aggregator.take_all_records()
        self.limiter.take_all()
        self.retrier.take_all()
        for record in records:
            record.add_attempt(attempt)
        if not records:
            return
        failed = len(records)
        metrics, stream, code = self.metrics, self.stream, attempt.code
        metrics.add("UserRecordsFailed", failed, stream, None, code)
        metrics.observe("UserRecordsPut", stream, None, None, failed, 0, 0, 0)  # KPL's zeros
        self.finish(records, False)

    def demand(self, now: float) -> tuple[int, int, int, int, bool]:
        """(Kinesis records, their bytes) offered to the Limiter so far, retries included,
        the Kinesis records waiting in it now, and the records the fleet's bucket refused so
        far and whether it holds a shard back now: the fleet worker's view of the load."""
        limiter = self.limiter
        refusals, holding = limiter.shared_holds(now)
        return limiter.offered_records, limiter.offered_bytes, limiter.queued, refusals, holding

    def statistics(self, now: float | None) -> StreamStatistics:
        """A frozen snapshot of the stream's stages (token levels only with ``now``)."""
        limiter = self.limiter.statistics(now)
        retrier = self.retrier.statistics()
        backlogs = self.intake.backlogs
        unused = ShardBacklog(None, math.inf, math.inf)
        shards = {}
        for shard in (*limiter.shards, *(s for s in backlogs if s not in limiter.shards)):
            state = limiter.shards.get(shard)
            backlog = backlogs.get(shard, unused)
            shards[shard] = ShardStatistics(
                rate=limiter.ceiling if state is None else state.rate,
                ceiling=limiter.ceiling,
                cuts=0 if state is None else state.cuts,
                throttled_records=retrier.throttled.get(shard, 0),
                records_sent=0 if state is None else state.records_sent,
                bytes_sent=0 if state is None else state.bytes_sent,
                token_wait=0.0 if state is None else state.token_wait,
                backoff=retrier.backoff_time.get(shard, 0.0),
                queued=0 if state is None else state.queued,
                noise=0.0 if state is None else state.noise,
                outstanding_records=backlog.outstanding_records,
                outstanding_bytes=backlog.outstanding_bytes,
                backlog_limit=(backlog.limit_records, backlog.limit_bytes),
                admission_waits=backlog.waits,
            )
        return StreamStatistics(
            shard_map_state=self.shard_map.state.value,
            open_shards=self.shard_map.open_shards,
            aggregator_queue_depths=self.aggregator.queue_depths(),
            limiter_queue_depths=limiter.queue_depths,
            token_levels=limiter.token_levels,
            rates={shard: state.rate for shard, state in limiter.shards.items()},
            requests_in_flight=self.in_flight,
            retry_backoff_records=retrier.delayed_records,
            held_records=self.retrier.held_records,
            outstanding_records=self.outstanding_records,
            outstanding_bytes=self.outstanding_bytes,
            backlog_limit=(self.backlog_records, self.backlog_bytes),
            user_records_received=self.received,
            shards=shards,
            retry_budget_exhausted=retrier.retry_budget_exhausted,
            pace=self.limiter.pace,
            path_limit_bytes=self.intake.path_bytes,
        )

    def update_backlog_limit(self, now: float) -> None:
        """Plan the backlog limits again: each shard's, ``backlog_time`` seconds of what the
        shard delivers now (a new shard's: its ceiling's), in bytes, and in user records at the
        aggregation ratio seen so far; and the stream's, for records admitted while the shard
        map is not ready: what all its open shards deliver (one shard's ceiling without a
        map); and the stream's whole backlog's, ``backlog_time`` of what the network path
        has proven it delivers (:meth:`NetworkWindow.admission_bytes`). Wakes the waiting
        submits if a limit grew. Planned every :data:`BACKLOG_INTERVAL` and at once after a
        cut of the network window; the path's bound also at each answer while records wait
        for it (:meth:`plan_path`)."""
        # a cut of the network window (a timeout, or a stall the Sender found) is planned at once
        network = self.network
        if now < self._next_backlog_update and network.timeouts == self._network_cuts:
            return
        self._network_cuts = network.timeouts
        self._next_backlog_update = now + BACKLOG_INTERVAL
        horizon = self.backlog_time
        if horizon == math.inf:
            return
        limiter = self.limiter
        intake = self.intake
        aggregating = self.config.aggregation_enabled
        grew = False

        def limits(shard: str, records_rate: float, bytes_rate: float) -> tuple[float, float]:
            ratio = limiter.aggregation_ratio(shard, RATIO_SAMPLES)
            if ratio is not None:
                records = records_rate * ratio * horizon
            elif aggregating:
                records = math.inf  # no ratio yet: the bytes and the producer's caps bound it
            else:
                records = records_rate * horizon
            return records, bytes_rate * horizon

        # the open shards (the last map's while a refresh runs; none before the first)
        shards = self.shard_map.open_shards
        open_shards = set(shards)
        for shard, backlog in list(intake.backlogs.items()):
            if shard not in open_shards and not backlog.outstanding_records:
                del intake.backlogs[shard]  # closed by a reshard, and drained
        rates = {
            shard: limiter.shard_deliverable(shard) for shard in (*open_shards, *intake.backlogs)
        }
        if rates:
            records_rate = sum(r for r, _ in rates.values())
            bytes_rate = sum(b for _, b in rates.values())
        else:  # no map yet: the records may all go to one shard
            records_rate, bytes_rate = limiter.records_ceiling, limiter.bytes_ceiling
        # With a fleet cap, the shards together deliver no more than this producer's grant:
        # each shard's part of it is in proportion to its own rate (the grant is shared by the
        # producer's streams too; each stream is bounded by the whole of it).
        records_scale = bytes_scale = 1.0
        shared = limiter.shared_rates()
        if shared is not None:
            if records_rate > shared[0]:
                records_scale = shared[0] / records_rate
            if bytes_rate > shared[1]:
                bytes_scale = shared[1] / bytes_rate
        # While the network path is slower than the shards (requests timed out), the shards
        # together deliver what the path does: both limits scale down with it.
        delivered = self.network.delivery_rate(now)
        if delivered is not None and bytes_rate > delivered:
            path_scale = delivered / bytes_rate
            records_scale = min(records_scale, path_scale)
            bytes_scale = min(bytes_scale, path_scale)
        for shard, backlog in intake.backlogs.items():
            shard_records, shard_bytes = rates[shard]
            records, nbytes = limits(
                shard, shard_records * records_scale, shard_bytes * bytes_scale
            )
            grew = grew or records > backlog.limit_records or nbytes > backlog.limit_bytes
            backlog.set_limits(records, nbytes)
        intake.new_shard_records, intake.new_shard_bytes = limits(
            "", limiter.records_ceiling * records_scale, limiter.bytes_ceiling * bytes_scale
        )
        records, nbytes = limits("", records_rate * records_scale, bytes_rate * bytes_scale)
        grew = grew or records > intake.backlog_records or nbytes > intake.backlog_bytes
        intake.backlog_records, intake.backlog_bytes = records, nbytes
        # and the stream's whole backlog: what the path has proven it delivers
        grew = self.plan_path(now) or grew
        if grew and self.on_room is not None:
            self.on_room()

    def plan_path(self, now: float) -> bool:
        """Plan the stream's bound by what the network path has proven it delivers
        (:meth:`NetworkWindow.admission_bytes` over ``backlog_time``), which the records whose
        shard is not known yet are held to as well, and each open shard's equal part of it;
        whether it grew."""
        intake = self.intake
        path_bytes = self.network.admission_bytes(now, self.backlog_time)
        grew = path_bytes > intake.path_bytes
        intake.path_bytes = path_bytes
        intake.path_share = path_bytes / max(1, len(self.shard_map.open_shards))
        intake.path_waits = False
        return grew

    def wake_limiter(self) -> None:
        """Make the Limiter plan every shard's wait again (a shared bucket got faster)."""
        self.limiter.unblock()
        # after the pipeline has shut down there is nothing left to plan
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.limiter_send.send_nowait(WAKE)

    # -- tasks ----------------------------------------------------------------------------

    def start(self, tg: TaskGroup, guard: Callable[..., Any]) -> None:
        """Start the stages in a task group of their own, in ``tg``; each runs under ``guard``
        (the producer's: a crashed stage fails every outstanding record)."""
        tg.start_soon(self._run, guard)

    async def _run(self, guard: Callable[..., Any]) -> None:
        with self._scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(guard, self._run_shard_map)
                tg.start_soon(guard, self._run_aggregator)
                tg.start_soon(guard, self._run_limiter)
                tg.start_soon(guard, self._run_collector)
                tg.start_soon(guard, self._run_sender)
                tg.start_soon(guard, self._run_retrier)

    def stop(self) -> None:
        """Stop the stages (the producer has checked that nothing is outstanding)."""
        self.stopped = True
        self.wake_map_waiters()
        self._scope.cancel()

    def _count(self, name: str, value: int, shard: str | None, code: str | None) -> None:
        self.metrics.add(name, value, self.stream, shard, code)

    def _observe(self, name: str, shard: str | None, code: str | None, stats: StatisticSet) -> None:
        self.metrics.observe(
            name, self.stream, shard, code, stats.count, stats.total, stats.minimum, stats.maximum
        )

    def _request_refresh(self) -> None:
        self._refresh_event.set()

    def _new_refresh_event(self) -> anyio.Event:
        self._refresh_event = anyio.Event()
        return self._refresh_event

    async def _run_shard_map(self) -> None:
        await run_shard_map(
            self.shard_map,
            self.stream,
            self.transport.list_shards,
            self._new_refresh_event,
            self._shard_map_ready,
            self._shard_map_failed,
        )

    async def first_map_answered(self) -> None:
        """Return once ListShards has answered for this stream at least once (with its map or
        an error), or once :meth:`wake_map_waiters` is called."""
        if self._map_answered:
            return
        if self._map_answered_event is None:
            self._map_answered_event = anyio.Event()
        await self._map_answered_event.wait()

    def _map_answer(self) -> None:
        self._map_answered = True
        self.wake_map_waiters()

    def wake_map_waiters(self) -> None:
        """End every :meth:`first_map_answered` wait now (closing, or the pipeline stopped)."""
        if self._map_answered_event is not None:
            self._map_answered_event.set()

    def _shard_map_failed(self, exc: BaseException) -> bool:
        """ListShards failed; returns whether to try again on its own (after the backoff)."""
        self._map_answer()
        code, message = error_code(exc)
        # told to the records whose TTL passes while they wait for the map
        self._shard_map_error = f"{code}: {message}"
        if errors.is_retriable(code):
            # what waits for the map's next try keeps waiting, unless it expires before
            self._settle_held(give_up_before=anyio.current_time() + self.shard_map.backoff)
            return True
        self._settle_held(give_up_before=math.inf)
        # A stream that does not exist (or that we may not read) will not get a map: the
        # records waiting for it go now, raw, and fail fast with the service's error code, as
        # do the records that come later. ListShards is tried again only when they come: an
        # idle producer does not call it for a missing stream for ever.
        if self.aggregator.shard_map_failed():
            self.aggregator_send.send_nowait(WAKE)
        return False

    def _settle_held(self, *, give_up_before: float = -math.inf) -> None:
        """Decide the outcomes the Retrier holds until the map knows their shard, and send on
        what it retries (Wrong Shard waits no backoff)."""
        retrier = self.retrier
        if retrier.held_records:
            now = anyio.current_time()
            retrier.settle_held(now, give_up_before=give_up_before)
            due = retrier.take_due(now)
            if due:
                self.aggregator_send.send_nowait(due)

    def _shard_map_ready(self) -> None:
        self._map_answer()
        self._shard_map_error = None
        self._settle_held()
        self.aggregator.shard_map_ready()
        if self._place_unplaced is not None:
            self._place_unplaced(self.intake)
        # records waiting under the stream's limit may fit their shards' now
        self._next_backlog_update = -math.inf
        if self.on_room is not None:
            self.on_room()
        # records that waited for the map can be aggregated now
        if self.aggregator.waiting_for_shard_map:
            # (the Aggregator's task also sends them on if nothing is in flight then:
            # adaptive batching, see _run_aggregator)
            self.aggregator_send.send_nowait(WAKE)

    async def _run_aggregator(self) -> None:
        aggregator = self.aggregator
        async with self.aggregator_in, self.limiter_send:
            while True:
                deadline = aggregator.next_deadline
                self.intake.wake_at = deadline
                message = await _receive_until(self.aggregator_in, deadline)
                if message is END:
                    return
                out: list[KinesisRecord] = []
                send_now = message is SEND_NOW
                unmapped = aggregator.waiting_for_shard_map
                if message is FLUSH:
                    aggregator.flush_all(out, anyio.current_time())
                elif isinstance(message, list):  # retries
                    for record in message:
                        aggregator.put(record, out)
                aggregator.flush_due(anyio.current_time(), out)
                placed = unmapped and not aggregator.waiting_for_shard_map
                if (
                    self.adaptive_batching
                    and aggregator.open_aggregates
                    and (self.intake.idle or (placed and not self.in_flight))
                ):
                    # retries on an idle stream, or the records the shard map's arrival placed
                    # with nothing in flight: they go now
                    self.intake.idle = False
                    send_now = True
                if send_now:
                    horizon, self._send_now_horizon = self._send_now_horizon, 0.0
                    self._gathering = aggregator.seal_all(
                        out, self.limiter.waiting_lanes(), anyio.current_time(), horizon
                    )
                flush = message is FLUSH
                if aggregator.deferred_flush_due():
                    # records a flush found waiting for the shard map went now: flush them too
                    aggregator.flush_all(out, anyio.current_time())
                    flush = True
                if aggregator.expired:
                    # their TTL passed while they waited for the shard map: failed, unsent
                    self.retrier.expire_unsent(
                        aggregator.take_expired(), anyio.current_time(), self._shard_map_error
                    )
                    if (
                        self.adaptive_batching
                        and not self.in_flight
                        and not aggregator.waiting_for_shard_map
                    ):
                        # no answer will come to say the stream is idle (nothing was sent)
                        self._idle()
                if out:
                    self.limiter_send.send_nowait(out)
                if flush:
                    self.limiter_send.send_nowait(FLUSH)
                if send_now:
                    self.limiter_send.send_nowait(SEND_NOW)

    async def _run_limiter(self) -> None:
        limiter = self.limiter
        wake = math.inf
        async with self.limiter_in, self.collector_send:
            while True:
                messages = await _receive_batch(self.limiter_in, wake)
                if messages and messages[0] is END:
                    return
                now = anyio.current_time()
                out: list[KinesisRecord] = []
                expired: list[KinesisRecord] = []
                flush = FLUSH in messages
                if flush:
                    limiter.unpace(now)  # a flush sends what it finds, paced or not
                for message in messages:
                    if isinstance(message, list):
                        limiter.put(message, now, out)
                if self.adaptive_batching:
                    # pacing at capacity (docs/batching.md)
                    limiter.plan_pace(
                        now, self.intake.outstanding_records, self.config.record_max_buffered_time
                    )
                wake = limiter.drain(now, out, expired)
                self.update_backlog_limit(now)
                if expired:
                    self.retrier.expire(expired, now)
                if out:
                    self.collector_send.send_nowait(out)
                if flush:
                    # after the records that came before it (and a few after: harmless)
                    self.collector_send.send_nowait(FLUSH)
                if SEND_NOW in messages:
                    self.collector_send.send_nowait(SEND_NOW)
                if messages and messages[-1] is END:
                    return

    async def _run_collector(self) -> None:
        collector = self.collector
        queued = self.sender_send.statistics
        async with self.collector_in, self.sender_send:
            while True:
                # records past their deadline are held while a request already waits for the
                # Sender (it takes it when a connection frees, and wakes this task): they go
                # in the next request, full, rather than in one cut early (docs/stages/collector.md)
                wait_until = math.inf if self._collector_held else collector.deadline
                messages = await _receive_batch(self.collector_in, wait_until)
                if messages and messages[0] is END:
                    return
                now = anyio.current_time()
                out: list[list[KinesisRecord]] = []
                send_now = False
                for message in messages:
                    if message is FLUSH:
                        collector.flush(out)
                    elif message is SEND_NOW:
                        send_now = True
                    elif isinstance(message, list):
                        collector.put(message, now, out)
                self._collector_held = False
                if collector.deadline <= now:
                    if queued().current_buffer_used:
                        self._collector_held = True
                    else:
                        collector.flush_due(now, out)
                if (
                    self.adaptive_batching
                    and not self.in_flight
                    and not out
                    and not (
                        # a fast endpoint (requests come back within the fill horizon): on a
                        # slow path requests gather while in flight, and a bigger one would
                        # only take longer to cross it
                        self._last_request_time < self._fill_horizon
                        and collector.linger(
                            now, self._fill_horizon, self.config.aggregation_max_size
                        )
                    )
                ):
                    # nothing in flight could carry these records: they go now (a firehose's
                    # gather a little longer: a request costs more than the records it carries)
                    collector.flush(out)
                    if send_now and not out and not self._gathering:
                        # nothing to send after all: idle, unless more came meanwhile (what
                        # was left gathering on purpose goes when it fills, or at its deadline)
                        self._idle()
                if out:
                    self.intake.idle = False  # a request is in flight now
                for request in out:
                    self.in_flight += 1
                    self.sender_send.send_nowait(request)
                if messages and messages[-1] is END:
                    return

    @property
    def request_timeout(self) -> float:
        """Seconds a PutRecords call may take, its connection's opening included."""
        return self.config.connect_timeout + self.config.request_timeout

    def _sender_took(self) -> None:
        """The Sender took a request (a connection is free or about to be): records the
        Collector holds past their deadline go now."""
        if self._collector_held:
            self._collector_held = False
            # the Collector may be gone (a crashed stage: everything fails anyway)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.collector_send.send_nowait(WAKE)

    def _count_split(self, more: int) -> None:
        """The Sender split a request into ``more`` more: each has its own outcome."""
        self.in_flight += more

    async def _run_sender(self) -> None:
        await run_sender(
            self.stream,
            self.transport,
            self.sender_in,
            self.retrier_send,
            max_connections=self.config.max_connections,
            request_timeout=self.request_timeout,
            window=self.network,
            on_split=self._count_split,
            on_take=self._sender_took,
        )

    async def _run_retrier(self) -> None:
        retrier = self.retrier
        async with self.retrier_in, self.aggregator_send:
            while True:
                outcome = await _receive_until(self.retrier_in, retrier.next_release)
                if outcome is END:
                    return
                now = anyio.current_time()
                if outcome is not None and not isinstance(outcome, Control):
                    self.in_flight -= 1
                    # answered or not, how long the stream's last request took (lingering)
                    self._last_request_time = outcome.end - outcome.start
                    retrier.handle(outcome, now)
                    if self.intake.path_waits and self.plan_path(now) and self.on_room:
                        # records wait for what the path has proven: this answer proved more
                        self.on_room()
                    if not self.in_flight and self.adaptive_batching:
                        # an aggregate that fills within a quarter of the buffered time is
                        # better full: a firehose's keeps gathering
                        self._idle(self._fill_horizon)
                due = retrier.take_due(now)
                if due:
                    self.aggregator_send.send_nowait(due)
