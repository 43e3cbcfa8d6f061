"""The Producer facade: validation, admission, per-stream pipelines, flush and close.

Lifecycle. ``async with Producer(config)`` opens the Kinesis client and one task group (in
``__aenter__``, never lazily from a put, so the task that enters it is the task that exits it).
Each stream's pipeline starts its stage tasks in that group the first time the stream is used.
Leaving the block flushes, bounded by ``close_timeout``, fails whatever is still outstanding
with ``ProducerClosed``, and cancels the stages. If the block is left by cancellation, the
flush is skipped: cancellation ends the producer promptly, and the outstanding records fail.
With metrics sinks, the last report goes out after that, within the same ``close_timeout``
(at most :data:`anykpl.metrics.CLOSE_GRACE` more), or within
:data:`anykpl.metrics.FINAL_REPORT_WHEN_CANCELLED` when the block was left by cancellation.

Safety net. Every admitted record sits in ``Intake.outstanding`` until it is terminal, so whatever
happens to a stage — a crash, cancellation, close — :meth:`Producer._fail_outstanding` can
resolve every record that is left, and no awaiter ever hangs.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio

from .. import errors
from .._compat import running_trio
from .._core._intake import CHECKPOINT_EVERY, Intake, StreamIntake, offset_clock
from .._core._limits import MAX_TENANT_LENGTH
from .._core._metrics import Metrics, MetricValue
from .._core._records import AttemptRecord, BatchCounter, Record, RecordResult
from .._core._tenant_quotas import Reservation
from .._core._token_bucket import BURST_SECONDS, TokenBucket
from .._fleet import FleetDemand, FleetWorker
from .._transport._botocore import open_transport
from .._transport._protocol import Transport
from ..config import ProducerConfig
from ..metrics import FINAL_REPORT_WHEN_CANCELLED, MetricsSink
from ..metrics._uploader import Uploader
from ._admission import Admission
from ._batch import ColumnRecords, PendingBatch
from ._handle import PendingRecord
from ._pipeline import Pipeline
from ._spool import RecoveredSegment, Spool, SpoolSyncer
from ._statistics import ProducerStatistics
from ._tenants import TenantAdmission

logger = logging.getLogger("anykpl.producer")

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup
    from typing_extensions import Self

__all__ = ("Producer",)

#: One record of :meth:`Producer.submit_many`: its data, or (data, partition_key) or
#: (data, partition_key, explicit_hash_key).
BatchRecord = (
    bytes
    | bytearray
    | memoryview
    | tuple[bytes | bytearray | memoryview]
    | tuple[bytes | bytearray | memoryview, str | None]
    | tuple[bytes | bytearray | memoryview, str | None, str | int | None]
)
#: A token bucket rate that never lets a record through (a fleet member with no share).
STOPPED: Final = 1e-9
#: A token bucket rate that never binds (a fleet bucket before its first grant).
UNLIMITED = 1e15
#: The longest a stream's first ``submit_many`` batch waits for the stream's first ListShards
#: answer before it goes record by record (seconds; see Producer.submit_many)
FIRST_MAP_WAIT: Final = 1.0
_STREAM_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,128}")
#: the service's StreamARN: arn:aws.*:kinesis:.*:\d{12}:stream/\S+, at most 2048 characters
_STREAM_ARN = re.compile(
    r"arn:aws[a-z-]*:kinesis:[a-z0-9-]+:[0-9]{12}:stream/[a-zA-Z0-9_.-]{1,128}"
)
_MAX_STREAM_ARN_LENGTH = 2048


class Producer(anyio.AsyncContextManagerMixin):
    """An aggregating, rate-limited, retrying Kinesis producer for asyncio and trio.

    ``Producer(config)`` or ``Producer(**overrides)`` (``ProducerConfig`` field names), or
    both (overrides win). Use it as an async context manager::

        async with Producer(region="us-east-1") as producer:
            result = await producer.put_record("stream", b"data", partition_key="key")

    ``transport`` replaces the aiobotocore client (for tests: anything with the
    :class:`~anykpl.Transport` methods).

    ``metrics_sinks`` receive the KPL metrics every ``metrics_upload_delay`` seconds (see
    :mod:`anykpl.metrics`). They are objects with state (clients, registries), so they are
    arguments of the producer rather than configuration values.

    ``on_recovered`` (with ``ProducerConfig.spool_dir``) is called with the
    :class:`PendingRecord` of each record recovered from the spool once it is terminal (its
    ``result()`` has the outcome); see docs/spool.md.
    """

    def __init__(
        self,
        config: ProducerConfig | None = None,
        *,
        transport: Transport | None = None,
        metrics_sinks: Sequence[MetricsSink] = (),
        on_recovered: Callable[[PendingRecord], object] | None = None,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = ProducerConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        # set by SyncProducer.close(timeout=...): a shorter bound for this close than the config's
        self._close_timeout: float | None = None
        for sink in metrics_sinks:
            if not isinstance(sink, MetricsSink):
                raise TypeError(
                    f"metrics_sinks takes MetricsSink objects (with open() and publish()), "
                    f"not {type(sink).__name__}"
                )
        self._metrics_sinks = tuple(metrics_sinks)
        self._uploader: Uploader | None = None
        self._transport_override = transport
        self._transport: Transport | None = None
        self._pipelines: dict[str, Pipeline] = {}
        self._intakes: dict[str, StreamIntake] = {}  # each pipeline's intake, by stream
        # what submit's common case admits to: ``_intakes`` while the producer is open (and
        # admitting needs no spool commit), empty otherwise
        self._admitting: dict[str, StreamIntake] = {}
        self._task_group: anyio.abc.TaskGroup | None = None  # the stages' task group
        self._stages_scope: anyio.CancelScope | None = None
        self._shut_down_event: anyio.Event | None = None
        # streams' first batches waiting for their shard map (submit_many), and the event that
        # closing waits on for them to be admitted (set once none waits)
        self._map_waits = 0
        self._map_waits_over: anyio.Event | None = None
        self._state = "new"  # new → open → closing → closed
        self._metrics = Metrics()
        self._metrics.collect = self._count_received
        self._metrics.gauge = self._sample_pending
        self._failure: BaseException | None = None
        self._clock: Callable[[], float] = anyio.current_time
        # the per-record part of admission, and the outstanding records (the safety net)
        self._intake = Intake(
            config.max_outstanding_records,
            config.max_outstanding_bytes,
            config.max_user_record_size,
            self._clock,
            self._wake_waiters,
        )
        # the waits for room (the rule is the intake's): submit, submit_many, the spool's
        # recovery, and SyncProducer through submit
        self._admission = Admission(self._intake, config.admission_timeout, self._not_open)
        self._tenants = TenantAdmission(config)
        # with a fleet cap: the producer-wide bucket every stream's Limiter also takes from;
        # its rates are this producer's grant (set by the fleet worker, unlimited until then)
        self._fleet_bucket: TokenBucket | None = None
        if config.fleet is not None:
            self._fleet_bucket = TokenBucket(UNLIMITED, UNLIMITED, 0.0, burst=BURST_SECONDS)
        self._fleet_worker: FleetWorker | None = None
        # the durable spool (spool_dir), the syncer submits wait for (spool_fsync="commit"),
        # and the recovery of what a previous process left in it
        self._spool: Spool | None = None
        self._commit: SpoolSyncer | None = None
        if config.spool_dir is not None:
            self._spool = Spool(config.spool_dir, config.spool_max_bytes, config.spool_fsync)
        self._on_recovered = on_recovered
        self._recovery_done: anyio.Event | None = None

    def __repr__(self) -> str:
        return (
            f"<Producer {self._state} streams={sorted(self._pipelines)} "
            f"outstanding={len(self._intake.outstanding)}>"
        )

    # -- lifecycle ------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self, None]:
        if self._state != "new":
            raise RuntimeError("a Producer can be entered only once")
        try:
            async with self._open_transport() as transport, anyio.create_task_group() as tg:
                self._transport = transport
                # the stages run in a task group of their own (a task of ``tg``), so that
                # aclose() can stop them from inside the ``async with`` block without
                # cancelling the caller's code in it
                self._task_group = await tg.start(self._host_stages)
                clock, base, offset = _backend_clock()
                self._clock = self._metrics.clock = clock
                self._intake.use_clock(clock, base, offset)
                self._metrics.start()  # its first second, and the gauges' (UserRecordsPending)
                if self._spool is not None:
                    await self._open_spool(self._spool, self._task_group)
                if self._metrics_sinks and self.config.metrics_level != "none":
                    self._uploader = Uploader(self._metrics, self._metrics_sinks, self.config)
                    self._task_group.start_soon(self._uploader.run)
                if self.config.fleet is not None:
                    self._fleet_worker = FleetWorker(
                        self.config.fleet, self.config, self._fleet_demand, self._apply_fleet_rates
                    )
                    # the bootstrap rate applies now
                    await self._task_group.start(self._fleet_worker.run)
                idle = self.config.stream_idle_timeout
                if idle is not None and idle != math.inf:
                    self._task_group.start_soon(self._prune_idle_streams, idle)
                self._state = "open"
                if self._commit is None:
                    self._admitting = self._intakes
                cancelled = False
                try:
                    yield self
                except anyio.get_cancelled_exc_class():
                    cancelled = True
                    raise
                finally:
                    await self._shut_down(cancelled)
        except BaseExceptionGroup as group:
            # unwrap a lone stage failure so the caller sees the real error (the stages' task
            # groups nest: one group per level)
            lone: BaseException = group
            while isinstance(lone, BaseExceptionGroup) and len(lone.exceptions) == 1:
                lone = lone.exceptions[0]
            if lone is not group:
                raise lone from None
            raise
        finally:
            self._state = "closed"
            self._admitting = {}
            self._fail_closed()  # the safety net, also when opening the transport failed
            self._freeze_clock()
            if self._spool is not None:
                self._spool.close()

    async def _open_spool(self, spool: Spool, group: anyio.abc.TaskGroup) -> None:
        """Take the spool directory, read what a previous process left there, and start
        sending it (new records wait until all of it is admitted)."""
        self._intake.spool = spool
        recovered = await anyio.to_thread.run_sync(spool.open)
        if spool.corrupt_entries:
            self._metrics.add("SpoolCorruptEntries", spool.corrupt_entries, None, None, None)
        if self.config.spool_fsync != "off":
            syncer = SpoolSyncer(spool, self.config.spool_fsync_interval)
            group.start_soon(syncer.run)
            if self.config.spool_fsync == "commit":
                self._commit = syncer
        if recovered:
            self._intake.recovering = True
            self._recovery_done = anyio.Event()
            group.start_soon(self._admit_recovered, spool, recovered)

    async def _admit_recovered(self, spool: Spool, recovered: list[RecoveredSegment]) -> None:
        """Admit the records recovered from the spool, oldest first, as ordinary records
        (waiting for room as ``submit`` does, without ``admission_timeout``)."""
        intake = self._intake
        try:
            for batch in recovered:
                admitted = 0
                for entry in batch.entries:
                    # (started before the producer is open: "new" goes on)
                    if self._state in ("closing", "closed"):
                        return  # the rest stays in the spool, for the next producer
                    try:
                        record = intake.make_record(
                            entry.stream, entry.data, entry.partition_key, entry.explicit_hash_key
                        )
                        record.tenant = entry.tenant
                        pipeline = self._pipelines.get(entry.stream) or self._open_pipeline(
                            entry.stream
                        )
                    except (errors.InvalidRecordError, errors.RecordTypeError) as exc:
                        logger.error(
                            "spool %s: a recovered record of stream %r is dropped: %s",
                            spool.directory,
                            entry.stream,
                            exc,
                            extra={"spool_dir": str(spool.directory), "stream": entry.stream},
                        )
                        spool.finished(batch.segment, False)
                        continue
                    record.spool_segment = batch.segment
                    if not intake.has_room(record, pipeline.intake, recovered=True):
                        try:
                            await self._admission.wait(record, pipeline.intake, recovered=True)
                        except errors.ProducerClosedError:
                            return  # the rest stays in the spool, for the next producer
                    if self._on_recovered is not None:
                        record.on_done = self._on_recovered
                    self._enqueue(entry.stream, pipeline, record)
                    self._metrics.add("UserRecordsRecovered", 1, entry.stream, None, None)
                    admitted += 1
                    if admitted % CHECKPOINT_EVERY == 0:
                        await anyio.lowlevel.checkpoint()
                logger.info(
                    "spool %s: %d record(s) recovered from segment %s are admitted%s",
                    spool.directory,
                    admitted,
                    batch.segment.path.name,
                    f" ({batch.corrupt} corrupt entries skipped)" if batch.corrupt else "",
                    extra={
                        "spool_dir": str(spool.directory),
                        "records": admitted,
                        "corrupt": batch.corrupt,
                    },
                )
        finally:
            intake.recovering = False
            self._wake_waiters()
            if self._recovery_done is not None:
                self._recovery_done.set()

    async def _host_stages(
        self, *, task_status: anyio.abc.TaskStatus[anyio.abc.TaskGroup] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as stages:
            self._stages_scope = stages.cancel_scope
            task_status.started(stages)
            await anyio.sleep_forever()

    async def aclose(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Close the producer now, as leaving its ``async with`` block does (the KPL's
        ``destroy()``): no more puts, a flush bounded by ``close_timeout`` (or ``timeout``
        seconds, if shorter), then what is left fails with ``ProducerClosed``. For code that
        cannot end the block where it wants the producer closed (a shutdown hook, another
        task); the block's own exit then has nothing left to do. Idempotent; a producer never
        opened just closes."""
        if self._state == "new":
            self._state = "closed"
            return
        if timeout is not None:
            bound = max(0.0, timeout)
            self._close_timeout = (
                bound if self._close_timeout is None else min(bound, self._close_timeout)
            )
        await self._shut_down(cancelled=False)

    def _stop_tenant_waits(self) -> None:
        """Records waiting for their tenant's quota give up now (closing begins)."""
        self._tenants.close()

    async def _shut_down(self, cancelled: bool) -> None:
        """Close once: whoever comes second (the ``async with`` exit after :meth:`aclose`, or a
        second ``aclose``) waits for the first."""
        done = self._shut_down_event
        if done is not None:
            await done.wait()
            return
        done = self._shut_down_event = anyio.Event()
        if self._map_waits:
            # first batches waiting for their stream's map were called before the close: they
            # are admitted (record by record) before it begins, as without the wait they would
            # have been; woken, each is admitted or waits for room before it yields (shielded:
            # a loop iteration)
            self._map_waits_over = anyio.Event()
            for pipeline in self._pipelines.values():
                pipeline.wake_map_waiters()
            with anyio.CancelScope(shield=True):
                await self._map_waits_over.wait()
        self._state = "closing"
        self._admitting = {}
        self._admission.close()  # waits for room end now (the spool's recovery among them)
        closing_at = anyio.current_time()
        try:
            await self._close(cancelled)
        finally:
            try:
                if self._fleet_worker is not None:
                    # shielded; by what is left of close_timeout at the latest
                    bound = self.config.close_timeout
                    if self._close_timeout is not None:
                        bound = min(bound, self._close_timeout)
                    await self._fleet_worker.aclose(deadline=closing_at + bound)
                if self._uploader is not None:
                    self._uploader.abort()
            finally:
                if self._stages_scope is not None:
                    self._stages_scope.cancel()
                done.set()

    async def _prune_idle_streams(self, idle_timeout: float) -> None:
        """Close the pipeline of every stream that has had nothing outstanding and no new
        record for ``idle_timeout`` seconds (checked every quarter of it)."""
        seen: dict[str, tuple[int, float]] = {}  # stream -> (records received, idle since)
        while True:
            await anyio.sleep(idle_timeout / 4)
            now = self._clock()
            for stream, pipeline in list(self._pipelines.items()):
                received = pipeline.received
                last = seen.get(stream)
                if pipeline.outstanding_records or last is None or last[0] != received:
                    seen[stream] = (received, now)
                elif now - last[1] >= idle_timeout:
                    self._count_received()  # its last admissions still count
                    del self._pipelines[stream]
                    del self._intakes[stream]
                    del seen[stream]
                    pipeline.stop()
                    logger.info(
                        "stream %s idle for %g s: its pipeline is closed until the next put",
                        stream,
                        idle_timeout,
                        extra={"stream": stream},
                    )
            for stream in [s for s in seen if s not in self._pipelines]:
                del seen[stream]

    async def _close(self, cancelled: bool) -> None:
        """Flush, fail what is left, send the last metrics report: all within one deadline,
        ``close_timeout`` from now (the last report gets at most ``CLOSE_GRACE`` more)."""
        self._stop_tenant_waits()
        close_timeout = self.config.close_timeout
        if self._close_timeout is not None:
            close_timeout = min(close_timeout, self._close_timeout)
        deadline = self._clock() + close_timeout
        if not cancelled and self._failure is None:
            with anyio.CancelScope(deadline=deadline, shield=True):
                await self.flush()
        self._fail_closed()
        if self._uploader is not None:
            if cancelled:
                # Left by cancellation (a timed-out close, a crashed stage): the last interval
                # holds the failures, so the report still goes out, briefly, before the
                # cancellation carries on.
                bound = min(close_timeout, FINAL_REPORT_WHEN_CANCELLED)
                deadline = self._clock() + bound
            await self._uploader.close(deadline)  # shielded inside

    def _freeze_clock(self) -> None:
        """After close, read the metrics at the time the producer closed: the backend's clock
        is gone once its event loop has ended (trio raises outside ``trio.run``)."""
        try:
            closed_at = self._clock()
        except RuntimeError:  # pragma: no cover - closed outside the event loop
            closed_at = self._metrics.clock()

        def clock() -> float:
            return closed_at

        self._clock = self._metrics.clock = clock
        self._intake.use_clock(clock)

    @asynccontextmanager
    async def _open_transport(self) -> AsyncGenerator[Transport, None]:
        if self._transport_override is not None:
            yield self._transport_override
        else:
            async with open_transport(self.config) as transport:
                yield transport

    async def _guard(self, stage: Callable[[], Any]) -> None:
        """Run a stage; if it crashes, fail every outstanding record, then re-raise."""
        try:
            await stage()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            if _only_closed_streams(exc) and (
                self._state in ("closing", "closed")
                or anyio.current_effective_deadline() == -math.inf
            ):
                # a neighbouring stage was cancelled first while the producer shut down, or
                # while a scope around the producer was cancelled: not a crash
                return
            self._failure = exc
            self._state = "closing"
            self._admitting = {}
            self._admission.close()
            logger.error(
                "a pipeline stage crashed (%s: %s); failing %d outstanding record(s)",
                type(exc).__name__,
                exc,
                len(self._intake.outstanding),
                exc_info=exc,
                extra={"records": len(self._intake.outstanding)},
            )
            self._fail_outstanding(
                errors.PIPELINE_FAILED, f"a pipeline stage failed: {type(exc).__name__}: {exc}"
            )
            raise

    async def _wait_first_map(self, pipeline: Pipeline) -> None:
        """Wait for ``pipeline``'s first shard map (or its first error) at most
        ``FIRST_MAP_WAIT``, or ``admission_timeout`` if shorter; closing ends the wait and
        waits for the batch to be admitted (see _shut_down)."""
        wait = FIRST_MAP_WAIT
        if self._admission.timeout is not None:
            wait = min(wait, self._admission.timeout)
        self._map_waits += 1
        try:
            with anyio.move_on_after(wait):
                await pipeline.first_map_answered()
        finally:
            self._map_waits -= 1
            if not self._map_waits and self._map_waits_over is not None:
                self._map_waits_over.set()

    def _open_pipeline(self, stream: str) -> Pipeline:
        """Validate a stream name seen for the first time and start its pipeline."""
        _check_stream_name(stream)
        if self._task_group is None or self._transport is None:
            raise errors.ProducerClosedError("the producer is not open")
        pipeline = Pipeline(
            stream,
            self.config.for_stream(stream),  # with the stream's own settings, if any
            self._transport,
            self._metrics,
            self._intake.finish,
            shared_bucket=self._fleet_bucket,
            place_unplaced=self._intake.place_unplaced,
            finish_items=self._intake.finish_items,
        )
        pipeline.on_room = self._wake_waiters
        self._pipelines[stream] = pipeline
        self._intakes[stream] = pipeline.intake
        pipeline.start(self._task_group, self._guard)
        return pipeline

    # -- putting --------------------------------------------------------------------------

    async def put_record(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None = None,
        explicit_hash_key: str | int | None = None,
        *,
        tenant: str | None = None,
    ) -> RecordResult:
        """Put one record and wait until it is terminal.

        ``partition_key`` defaults to a random key (the record then lands on a random shard).
        ``explicit_hash_key`` (a decimal string or int in [0, 2**128)) overrides the hash of the
        partition key for shard placement. ``tenant`` (1..256 characters) puts the record for
        that tenant: it draws from the tenant's quota (``tenant_quotas``) and queues fairly
        with other tenants' records on its shard (see docs/tenants.md).

        :returns: the :class:`RecordResult` on success.
        :raises ~anykpl.errors.RecordFailedError: when the record failed for good; its
            ``result`` carries every attempt.
        :raises ~anykpl.errors.InvalidRecordError: bad input; nothing was enqueued.
        :raises ~anykpl.errors.RecordTypeError: wrong argument types; nothing was enqueued.
        :raises ~anykpl.errors.ProducerClosedError: the producer is closed or closing.
        :raises ~anykpl.errors.BackpressureTimeout: no room within ``admission_timeout`` (or
            the tenant's tokens come later than that).
        :raises ~anykpl.errors.TenantQuotaExceeded: the tenant is over its quota and
            ``tenant_overflow`` is ``"reject"``; nothing was enqueued.
        """
        pending = await self.submit(stream, data, partition_key, explicit_hash_key, tenant=tenant)
        return await pending

    async def submit(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None = None,
        explicit_hash_key: str | int | None = None,
        *,
        tenant: str | None = None,
    ) -> PendingRecord:
        """Admit one record and return its :class:`PendingRecord` handle at once.

        Waits only for its tenant's tokens (with ``tenant=``, see :meth:`put_record`) and for
        room under ``max_outstanding_records``/``max_outstanding_bytes`` (backpressure), up to
        ``admission_timeout`` in all. ``await`` the handle for the result.
        Raises like :meth:`put_record`, except that record failures come from the handle.
        """
        if tenant is None:
            # the common case (the producer open, the stream's pipeline running, no spool
            # commit to wait for), one compiled call: admitted now, or None for the general path
            stream_intake = self._admitting.get(stream)
            if stream_intake is not None:
                admitted_now = self._intake.admit_now(
                    stream_intake, stream, data, partition_key, explicit_hash_key
                )
                if admitted_now is not None:
                    return admitted_now
        if self._state != "open":
            raise self._not_open()
        intake = self._intake
        record = intake.make_record(stream, data, partition_key, explicit_hash_key)
        if tenant is not None:
            record.tenant = _check_tenant(tenant)
        pipeline = self._pipelines.get(stream) or self._open_pipeline(stream)
        # the tenant's quota first: a record that waits for its tokens holds no room meanwhile
        reservation = None if tenant is None else await self._admit_tenant(record, tenant)
        try:
            if not intake.has_room(record, pipeline.intake):
                waited = 0.0 if reservation is None else reservation.wait
                await self._admission.wait(record, pipeline.intake, waited=waited)
            else:
                # with room, admission needs no wait; a loop of submits yields now and then
                # (Intake.checkpoint_due)
                if not intake.checkpoint_due(pipeline.intake):
                    intake.since_checkpoint += 1
                else:
                    intake.since_checkpoint = 0
                    await anyio.lowlevel.checkpoint()
                    if self._state != "open":
                        raise self._not_open()
                    # checked (and its shard predicted) again: the shard map may have become
                    # ready, or the room gone, meanwhile
                    if not intake.has_room(record, pipeline.intake):
                        waited = 0.0 if reservation is None else reservation.wait
                        await self._admission.wait(record, pipeline.intake, waited=waited)
            self._enqueue(stream, pipeline, record)  # with a spool, SpoolError can refuse it
        except BaseException:
            if reservation is not None:  # not enqueued after all: the tenant's tokens go back
                self._tenants.release(reservation, self._clock())
            raise
        if self._commit is not None:
            await self._commit.wait()
        return record

    def submit_nowait(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None = None,
        explicit_hash_key: str | int | None = None,
    ) -> PendingRecord:
        """Admit one record now, or raise :class:`anyio.WouldBlock` if :meth:`submit` would
        have to wait for it: no room for it yet (backpressure), or a spool with
        ``spool_fsync="commit"`` (the record is durable only after a sync). Nothing is
        enqueued then. Never yields to the event loop, so a loop of calls should yield now and
        then. Records for a tenant go through :meth:`submit` (they may wait for their quota).

        :raises anyio.WouldBlock: :meth:`submit` would wait; the record was not admitted.
        :raises: as :meth:`submit` otherwise.
        """
        if self._state != "open":
            raise self._not_open()
        intake = self._intake
        record = intake.make_record(stream, data, partition_key, explicit_hash_key)
        pipeline = self._pipelines.get(stream) or self._open_pipeline(stream)
        if self._commit is not None or not intake.has_room(record, pipeline.intake):
            raise anyio.WouldBlock
        self._enqueue(stream, pipeline, record)
        return record

    def _enqueue(self, stream: str, pipeline: Pipeline, record: Record) -> None:
        """Admit ``record``: it is outstanding from now on, and in its stream's pipeline."""
        if pipeline.stopped:
            # the stream went idle and its pipeline closed while the caller waited: the record
            # goes to the new pipeline, counted in its backlog (admitted all the same: it
            # waited its turn)
            pipeline = self._pipelines.get(stream) or self._open_pipeline(stream)
            self._intake.has_room(record, pipeline.intake)
        self._intake.enqueue(pipeline.intake, record)

    async def submit_many(
        self,
        stream: str,
        records: Iterable[BatchRecord],
        *,
        tenant: str | None = None,
    ) -> PendingBatch:
        """Admit many records of one stream in one call and return the batch's handle.

        Each item of ``records`` is the record's data (``bytes``, ``bytearray`` or
        ``memoryview``; a random partition key), or a tuple ``(data, partition_key)`` or
        ``(data, partition_key, explicit_hash_key)``. The same results and backpressure as
        :meth:`submit`, with the per-call cost paid once for the batch: for a firehose.

        The :class:`~anykpl.PendingBatch` is the sequence of the records' handles, in order,
        and a handle of its own: ``batch.done()``, ``batch.failed``, and ``await batch`` for a
        :class:`~anykpl.BatchResult` with every failure (a batch never raises for a failed
        record), so the caller need not look at each record.

        The fastest form is a list of ``(bytes, str)`` pairs: where the stream's shard map is
        ready, no ``tenant`` or spool is involved and the whole batch fits now, it is admitted
        in columns (a stream's first such batch waits for its shard map, one ListShards, for
        up to a second or ``admission_timeout`` if shorter; nothing is sent to a stream before
        its map in any case), with no per-record object built unless a handle is asked for
        (``batch[i]``, iterating the batch) or a record must be retried: about 40 % less work
        than the same batch record by record in the pure-Python build. Any other batch goes
        record by record, with the same results.

        Every record is validated before any is admitted: bad input raises at once (the
        message names the item, ``records[3]: ...``) and nothing is enqueued. Then each is
        admitted in order, waiting for room as :meth:`submit` does; if ``admission_timeout``
        runs out part-way, :class:`~anykpl.errors.BackpressureTimeout` is raised and its
        ``admitted`` holds the handles of the records admitted before it (they go on).

        :raises: as :meth:`submit`.
        """
        if self._state != "open":
            raise self._not_open()
        if stream not in self._pipelines:
            _check_stream_name(stream)  # the batch's, not records[0]'s, and for an empty one
        checked_tenant = None if tenant is None else _check_tenant(tenant)
        intake = self._intake
        if checked_tenant is None and (type(records) is list or type(records) is tuple):
            # the common case, no record made per item: a list of (data, key) that fits now
            # in a stream whose shard map is ready (Intake.admit_columns); None otherwise
            open_pipeline = self._pipelines.get(stream)
            if (
                open_pipeline is None
                and records
                and intake.spool is None
                and self._shut_down_event is None
                and intake.valid_pairs(records)
            ):
                # The stream's first batch of valid pairs: its pipeline opens, and the batch
                # waits for the shard map (one ListShards) to go in columns, rather than go
                # record by record and then wait for the map in the Aggregator (nothing is sent
                # before it)
                open_pipeline = self._open_pipeline(stream)
                if intake.takes_columns(open_pipeline.intake):
                    await self._wait_first_map(open_pipeline)
                    if self._state != "open":
                        raise self._not_open()
            if open_pipeline is not None and not open_pipeline.stopped:
                columns = intake.admit_columns(open_pipeline.intake, stream, records)
                if columns is not None:
                    await anyio.lowlevel.checkpoint()
                    return PendingBatch(ColumnRecords(columns), columns.counter)
        counter = BatchCounter()
        made = intake.make_records(stream, records, counter)
        batch = PendingBatch(made, counter)
        if not made:
            await anyio.lowlevel.checkpoint()
            return batch
        if checked_tenant is not None:
            for record in made:
                record.tenant = checked_tenant
        pipeline = self._pipelines.get(stream) or self._open_pipeline(stream)
        position = 0
        try:
            while True:
                if checked_tenant is None and self._state == "open" and not pipeline.stopped:
                    # the common case, one compiled call: every record that fits now
                    position = intake.admit_ready(pipeline.intake, made, position)
                if position == len(made):
                    break
                record = made[position]
                reservation = None
                try:
                    if checked_tenant is not None:
                        reservation = await self._admit_tenant(record, checked_tenant)
                    if self._state != "open":
                        raise self._not_open()
                    if not intake.has_room(record, pipeline.intake):
                        waited = 0.0 if reservation is None else reservation.wait
                        await self._admission.wait(record, pipeline.intake, waited=waited)
                    self._enqueue(stream, pipeline, record)
                except BaseException:
                    if reservation is not None:
                        self._tenants.release(reservation, self._clock())
                    raise
                position += 1
                if pipeline.stopped:  # it went idle while this call waited: _enqueue reopened it
                    pipeline = self._pipelines[stream]
        except (
            errors.BackpressureTimeout,
            errors.ProducerClosedError,
            errors.SpoolError,
            errors.TenantQuotaExceeded,
        ) as exc:
            # the records before this one are admitted and go on: their handles go with it
            # (Intake.admit_ready names them itself, as ``position`` is its caller's)
            admitted = exc.admitted or tuple(made[:position])
            position = len(admitted)
            if position and isinstance(exc, errors.ProducerClosedError):
                exc = errors.ProducerClosedError(
                    f"the producer is {self._state}: {position} of the batch's {len(made)} "
                    f"records were admitted before it began closing (their handles are in "
                    f"exc.admitted; they go on), the other {len(made) - position} were not "
                    "enqueued"
                )
                exc.admitted = admitted
                raise exc from None
            exc.admitted = admitted
            raise
        finally:
            if self._commit is not None:
                await self._commit.wait()  # one sync for the batch (what it admitted of it)
        # one checkpoint for the batch: the stages run, and cancellation gets in
        await anyio.lowlevel.checkpoint()
        return batch

    def _not_open(self) -> errors.ProducerClosedError:
        if self._state == "new":
            return errors.ProducerClosedError(
                "the producer is not started: use it as `async with Producer(...) as producer`"
            )
        return errors.ProducerClosedError(f"the producer is {self._state}; nothing was enqueued")

    async def _admit_tenant(self, record: Record, tenant: str) -> Reservation:
        """Take the record's tokens from its tenant's quota, waiting for them if need be."""
        reservation = await self._tenants.admit(tenant, record.size, self._clock())
        if reservation.wait > 0.0 and self._state != "open":
            self._tenants.release(reservation, self._clock())
            raise self._not_open()
        return reservation

    def _wake_waiters(self) -> None:
        """Wake the submits waiting for room (records finished, or a backlog limit grew)."""
        self._admission.wake()

    def _fail_closed(self) -> None:
        self._fail_outstanding(
            errors.PRODUCER_CLOSED, "the producer closed before the record was put"
        )

    def _fail_outstanding(self, code: str, message: str) -> None:
        self._intake.take_all_items()  # a column batch's unresolved items too, as records
        if not self._intake.outstanding:
            return
        if self._spool is not None:
            # the producer's end, not the records': they stay spooled for the next producer
            self._intake.keep_spooled = True
            message += (
                f"; it stays in the spool ({self._spool.directory}) and is sent by the next "
                "producer opened on it"
            )
        now = anyio.current_time() if self._task_group is not None else 0.0
        attempt = AttemptRecord(now, now, False, code, message)
        by_stream: dict[str, list[Record]] = {}
        for record in self._intake.outstanding:
            by_stream.setdefault(record.stream, []).append(record)
        for pipeline in self._pipelines.values():
            pipeline.fail_all(by_stream.pop(pipeline.stream, ()), attempt)
        for failing in by_stream.values():  # no pipeline (cannot happen; the safety net)
            for record in failing:
                record.add_attempt(attempt)
            self._intake.finish(failing, False)

    # -- flushing -------------------------------------------------------------------------

    async def flush(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 (the KPL's flush(timeout) shape)
        *,
        stream: str | None = None,
    ) -> None:
        """Send everything buffered now and wait until every record put so far is terminal;
        with ``stream``, only that stream's records (the KPL's ``flush(stream)``, which waits
        for nothing).

        Records put while the flush waits are not waited for.

        :raises ~anykpl.errors.FlushTimeout: if ``timeout`` seconds pass first (nothing is
            failed; the records carry on).
        """
        recovery = self._recovery_done
        if recovery is not None and not recovery.is_set():
            # records recovered from the spool count as put before this flush
            started = anyio.current_time()
            with anyio.move_on_after(timeout if timeout is not None else math.inf):
                await recovery.wait()
            if not recovery.is_set():
                raise errors.FlushTimeout(
                    f"flush timed out after {timeout} s while the records recovered from the "
                    "spool were still being admitted"
                )
            if timeout is not None:
                timeout = max(0.0, timeout - (anyio.current_time() - started))
        # the column batches admitted before it, too
        live = self._intake.live_column_batches()
        if stream is not None:
            live = [batch for batch in live if batch.stream == stream]
        if stream is None:
            snapshot = list(self._intake.outstanding)
            pipelines = list(self._pipelines.values())
        else:
            snapshot = [record for record in self._intake.outstanding if record.stream == stream]
            owner = self._pipelines.get(stream)
            pipelines = [] if owner is None else [owner]
        if not snapshot and not live:
            await anyio.lowlevel.checkpoint()
            return
        for pipeline in pipelines:
            pipeline.flush()
        try:
            with anyio.fail_after(timeout if timeout is not None else math.inf):
                for batch in live:
                    if batch.counter.remaining:
                        await batch.counter.wait()
                for record in snapshot:
                    await record.wait_done()
        except TimeoutError:
            # a live column batch's counter counts its items, those made records (in the
            # snapshot, if they were before it began) too: each once
            counters = {id(batch.counter) for batch in live}
            left = sum(1 for r in snapshot if not r.done() and id(r.batch) not in counters)
            left += sum(batch.counter.remaining for batch in live)
            raise errors.FlushTimeout(
                f"flush timed out after {timeout} s with {left} record(s) not yet terminal"
            ) from None

    # -- introspection --------------------------------------------------------------------

    @property
    def outstanding_records(self) -> int:
        """Admitted records that are not yet terminal (the KPL's
        ``getOutstandingRecordsCount``)."""
        return len(self._intake.outstanding)

    @property
    def oldest_record_age(self) -> float:
        """Seconds since the oldest record that is not yet terminal was admitted; 0.0 when
        none is (the KPL's ``getOldestRecordTimeInMillis``, in seconds). A steady climb says
        the producer falls behind what it is given."""
        oldest = self._intake.oldest_arrival()
        if oldest is None or self._state not in ("open", "closing"):
            return 0.0
        return max(0.0, self._clock() - oldest)

    def statistics(self) -> ProducerStatistics:
        """A frozen snapshot of the producer's state and counters."""
        running = self._state in ("open", "closing")
        now = self._clock() if running else None
        return ProducerStatistics(
            outstanding_records=len(self._intake.outstanding),
            outstanding_bytes=self._intake.outstanding_bytes,
            streams={name: p.statistics(now) for name, p in self._pipelines.items()},
            errors_by_code=self._metrics.by_error_code(),
            metrics=self._metrics.snapshot(),
            tenants=self._tenants.statistics(now),
            fleet=None if self._fleet_worker is None else self._fleet_worker.statistics(),
            spool=None if self._spool is None else self._spool.statistics(),
            oldest_record_age=self.oldest_record_age,
        )

    def _fleet_demand(self) -> FleetDemand:
        """The fleet worker's view of the load, in the units of the grants (Kinesis records
        and their bytes, as the service counts them): what every stream's Limiter was offered
        so far, retries included, and what waits in them now; and whether callers wait for
        room while the fleet's bucket holds records back (the fleet's rate, not Kinesis, is
        what holds the producer back)."""
        offered_records = offered_bytes = backlog = refusals = 0
        holding = False
        now = self._clock()
        for pipeline in self._pipelines.values():
            records, nbytes, queued, refused, held = pipeline.demand(now)
            offered_records += records
            offered_bytes += nbytes
            backlog += queued
            refusals += refused
            holding = holding or held
        # the queued bytes are not tracked record by record (that would cost on the hot path):
        # the mean size of what was offered stands in for them
        mean_size = offered_bytes / offered_records if offered_records else 0.0
        admission = self._admission
        return FleetDemand(
            offered_records,
            offered_bytes,
            backlog,
            int(backlog * mean_size),
            admission_waits=admission.waits,
            admission_waiting=admission.waiting,
            fleet_refusals=refusals,
            fleet_holding=holding,
        )

    def _apply_fleet_rates(
        self, records_per_second: float | None, bytes_per_second: float | None
    ) -> None:
        """Set the shared bucket to this producer's fleet grant (``None``: unlimited; 0: send
        nothing, as a worker that does not know its share of the fleet's budget yet)."""
        bucket = self._fleet_bucket
        if bucket is None:
            return
        records = UNLIMITED if records_per_second is None else max(STOPPED, records_per_second)
        nbytes = UNLIMITED if bytes_per_second is None else max(STOPPED, bytes_per_second)
        faster = records > bucket.records_per_second or nbytes > bucket.bytes_per_second
        now = self._clock()
        bucket.set_rates(records, nbytes, now)
        if records <= STOPPED or nbytes <= STOPPED:
            # the bucket keeps at least one token of capacity, which would let one record of
            # any size through: a member with no share sends nothing at all
            bucket.empty(now, records=records <= STOPPED, nbytes=nbytes <= STOPPED)
        if faster:
            # shards waiting for the shared tokens planned their wait at the old rate
            for pipeline in self._pipelines.values():
                pipeline.wake_limiter()

    def metrics(self, name: str | None = None, window: float | None = None) -> list[MetricValue]:
        """The KPL metrics kept in process, like the KPL's ``getMetrics``.

        Every metric at every level (global, per stream, per shard; ``metrics_level`` and
        ``metrics_granularity`` filter only what sinks receive), as statistic sets: count, sum,
        min, max and mean, sorted by name and dimensions.

        Args:
            name: only this metric (a KPL name such as ``"UserRecordsPut"``).
            window: only the last ``window`` seconds (0 < window <= 60, one-second
                resolution); ``None``: everything since the producer started.
        """
        if window is not None and not (isinstance(window, (int, float)) and 0 < window <= 60):
            raise ValueError(f"window must be None or in (0, 60] seconds, got {window!r}")
        return self._metrics.query(name, window)

    def _count_received(self) -> None:
        """``Metrics.collect``: the admissions since the last call, into the current bucket.
        Called when a one-second bucket closes and before a read, never once per put (the hot
        path): see anykpl/_core/_metrics.py for how close to their second this dates them."""
        for name, p in self._pipelines.items():
            received = p.take_received()
            if received:
                self._metrics.add_to_bucket("UserRecordsReceived", received, name, None, None)

    def _sample_pending(self) -> None:
        """``Metrics.gauge``: one sample of ``UserRecordsPending`` per stream (its user records
        admitted and not yet terminal) as each one-second bucket closes."""
        for name, p in self._pipelines.items():
            self._metrics.sample_to_bucket("UserRecordsPending", p.outstanding_records, name)


def _check_stream_name(stream: object) -> None:
    """A stream name, or a stream ARN (``arn:aws:kinesis:<region>:<account>:stream/<name>``,
    sent as ``StreamARN``: cross-account access, as in the KPL 0.15.9)."""
    if type(stream) is not str:
        raise errors.RecordTypeError(f"stream must be a str, not {type(stream).__name__}")
    if stream.startswith("arn:"):
        if len(stream) > _MAX_STREAM_ARN_LENGTH or not _STREAM_ARN.fullmatch(stream):
            shown = stream if len(stream) <= 200 else f"{stream[:200]}..."
            raise errors.InvalidRecordError(
                f"invalid stream ARN {shown!r}: expected "
                f"arn:<partition>:kinesis:<region>:<12-digit account>:stream/<stream name>"
            )
        return
    if not _STREAM_NAME.fullmatch(stream):
        shown = stream if len(stream) <= 200 else f"{stream[:200]}..."
        raise errors.InvalidRecordError(
            f"invalid stream name {shown!r}: 1..128 characters of a-z, A-Z, 0-9, '_', '.' "
            f"and '-' (or a stream ARN)"
        )


def _check_tenant(tenant: object) -> str:
    if type(tenant) is not str:
        raise errors.RecordTypeError(f"tenant must be a str or None, not {type(tenant).__name__}")
    if not 0 < len(tenant) <= MAX_TENANT_LENGTH:
        raise errors.InvalidRecordError(
            f"tenant must be 1..{MAX_TENANT_LENGTH} characters, got {len(tenant)}"
        )
    if not tenant.isascii():
        try:
            tenant.encode()
        except UnicodeEncodeError as exc:
            raise errors.InvalidRecordError(f"tenant is not valid Unicode: {exc}") from None
    return tenant


def _only_closed_streams(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_closed_streams(e) for e in exc.exceptions)
    return isinstance(
        exc,
        (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.get_cancelled_exc_class()),
    )


def _backend_clock() -> tuple[Callable[[], float], Callable[[], float] | None, float]:
    """The running backend's clock, bound once: ``anyio.current_time()`` looks the backend up
    on every call, which costs more than the rest of a record's admission. Same time base.
    With it, where the clock is a builtin's reading plus an offset, that builtin and the
    offset (:meth:`Intake.use_clock`); ``None`` and 0.0 otherwise."""
    if running_trio():
        import trio

        clock = trio.lowlevel.current_clock()
        offset = getattr(clock, "offset", None)
        if type(clock).__name__ == "SystemClock" and type(offset) is float:
            # trio's default clock is ``offset + perf_counter()``, which trio.current_time()
            # reaches through three Python calls (profiled: a third of a record's admission
            # on trio); the same sum, with one call. Any other clock (a MockClock in tests)
            # is asked through trio.
            return offset_clock(time.perf_counter, offset), time.perf_counter, offset
        return trio.current_time, None, 0.0
    import asyncio

    loop = asyncio.get_running_loop()
    if getattr(loop.time, "__func__", None) is asyncio.BaseEventLoop.time:
        # the standard loops' clock is ``time.monotonic()`` behind a Python method (a tenth
        # of a record's admission, profiled); the same clock, called directly. Any other loop
        # (uvloop keeps a clock of its own), or a loop whose clock a test replaced, is asked
        # as it is.
        return time.monotonic, None, 0.0
    return loop.time, None, 0.0
