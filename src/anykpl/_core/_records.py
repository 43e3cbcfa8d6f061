"""Records and their results: the per-record objects of the hot path.

A user record *is* its :class:`Record`: one small slotted object carries the record's data,
hash key, deadlines and attempt history, and is the one-shot handle the caller awaits (typed
for the caller as the read-only :class:`~anykpl.PendingRecord`). No task,
no future and no event exist per record unless somebody awaits a record that is not yet done
(the event is created lazily). A Kinesis record (:class:`KinesisRecord`) owns the handles of the
user records it carries; the Retrier resolves them when the PutRecords outcome arrives.

A ``submit_many`` batch admitted in columns (:class:`ColumnBatch`) has no record per item: its
Kinesis records carry *chunks* of it, ``(batch, positions)``, and a success resolves each chunk
with one count. A handle is made when asked for (:meth:`ColumnBatch.handle`), and every other
outcome makes the Kinesis record's items records first (:attr:`KinesisRecord.records`), which
then go the per-record way.

Attempt history follows the KPL (aws/kinesis/core/user_record.cc, ``to_put_record_result``):
an attempt's ``delay`` is the time from the record's arrival (first attempt) or from the end of
the previous attempt (later attempts) to the attempt's start; ``duration`` is the attempt's own
length. Attempts are stored as shared :class:`AttemptRecord` objects — one per Kinesis record
per try, shared by every user record in the aggregate — and turned into public
:class:`Attempt` values only when a result is asked for.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator
from hashlib import md5
from types import FunctionType
from typing import Any, Final, Protocol

from .. import errors
from .._compat import gc_untracker, mypyc_attr
from ._results import Attempt, RecordResult
from ._wire import AggregateBuilder, KeyFacts

__all__ = (
    "Attempt",
    "BatchCounter",
    "ColumnBatch",
    "Event",
    "KinesisRecord",
    "Record",
    "RecordResult",
    "ShardBacklog",
    "Waiting",
    "use_waiting",
)

logger = logging.getLogger("anykpl.records")


class Event(Protocol):
    """The event a waiter sleeps on (``anyio.Event``, made by the runtime)."""

    def set(self) -> None: ...
    def wait(self) -> Awaitable[None]: ...


class Waiting(Protocol):
    """What waiting takes of the event loop: the coroutines behind ``await``, the
    :class:`Event` a waiter sleeps on, a checkpoint and trio's run context. The runtime's
    ``_awaiting`` module is the one (``_runtime/__init__.py`` gives it, :func:`use_waiting`):
    the core imports no event loop, and a record is awaited only where a runtime made it."""

    def new_event(self) -> Event: ...
    def checkpoint(self) -> Awaitable[None]: ...
    def find_trio(self, slot: list[Any]) -> Callable[[], Any]: ...
    def record_result(self, record: Record) -> Coroutine[Any, Any, RecordResult]: ...
    def result_after(
        self, checkpoint: Awaitable[None], record: Record
    ) -> Coroutine[Any, Any, RecordResult]: ...
    def checkpoint_or_nothing(
        self, checkpoint: Awaitable[None] | None
    ) -> Coroutine[Any, Any, None]: ...
    def record_wait(self, record: Record) -> Coroutine[Any, Any, RecordResult]: ...
    def record_done(self, record: Record) -> Coroutine[Any, Any, None]: ...
    def batch_done(self, counter: BatchCounter) -> Coroutine[Any, Any, None]: ...


_waiting: Final[list[Waiting]] = []


def use_waiting(waiting: Waiting) -> None:
    """Give the core its :class:`Waiting`."""
    _waiting[:] = [waiting]


# Final: the compiled build keeps these in C variables instead of looking them up in the
# module's dictionary on every use (they are read once or more per record); an imported name
# (``Attempt``) and a module's attribute (``sys.modules``) are such look-ups too
_new_tuple: Final = tuple.__new__
_Attempt: Final = Attempt
_RecordResult: Final = RecordResult
_modules: Final = sys.modules


@mypyc_attr(acyclic=True)
class AttemptRecord:
    """One try of one Kinesis record, shared by all the user records it carried.

    Acyclic (compiled build): it holds numbers and strings only, so it stays out of the garbage
    collector, as :class:`Record` does.
    """

    __slots__ = ("code", "end", "message", "start", "success")

    def __init__(
        self, start: float, end: float, success: bool, code: str | None, message: str | None
    ) -> None:
        self.start = start
        self.end = end
        self.success = success
        self.code = code
        self.message = message


class BatchCounter:
    """How many records of one :meth:`Producer.submit_many` batch are still pending, and how
    many failed: what :class:`~anykpl.PendingBatch` reports without looking at each record.

    Every record of the batch points to it (``Record.batch``) and counts itself out
    when it becomes terminal, once. It refers to no record, so no cycle runs through it.
    ``on_done``, if set, is called once, where the last record is resolved (SyncProducer's
    batch future; it is cleared before the call).
    """

    __slots__ = ("_event", "failed", "on_done", "remaining")

    def __init__(self) -> None:
        self.remaining = 0
        self.failed = 0
        self._event: Event | None = None
        self.on_done: Callable[[], None] | None = None

    def record_done(self, success: bool) -> None:
        """One record of the batch became terminal."""
        self.records_done(1, success)

    def records_done(self, count: int, success: bool) -> None:
        """``count`` records of the batch became terminal, all succeeded or all failed."""
        if not success:
            self.failed += count
        self.remaining -= count
        if not self.remaining:
            event = self._event
            if event is not None:
                self._event = None
                event.set()
            on_done = self.on_done
            if on_done is not None:
                self.on_done = None
                try:
                    on_done()
                except Exception:
                    # as a record's hook: the stage resolving the batch must go on
                    logger.exception("the completion hook of a batch failed")

    def wait(self) -> Awaitable[None]:
        """Wait until no record of the batch is pending (``await counter.wait()``)."""
        if self.remaining:
            return _waiting[0].batch_done(self)
        return _waiting[0].checkpoint_or_nothing(resolved_checkpoint())

    def waiter(self) -> Event:
        """The event set when no record of the batch is pending (made on first use); only
        while some is."""
        event = self._event
        if event is None:
            event = self._event = _waiting[0].new_event()
        return event


def _ready(record: Record) -> Generator[Any, None, RecordResult]:
    """``await`` of a record that is done, where nothing is to be awaited first: a generator
    that ends at its first step with the record's result (or raises its failure). Compiled
    like the rest of this module, which is safe because it never suspends: nothing can be
    thrown into it (see ``_runtime/_awaiting.py``). The ``yield`` after the returns makes it
    a generator at no cost of its own (``yield from ()`` first was a twentieth of an await)."""
    if record._state == SUCCEEDED:
        return record.build_result()
    return record.result()
    yield  # type: ignore[unreachable]


#: Awaiting a handle whose result is already there does what awaiting a done future does in
#: the running library, not a full checkpoint (a trip through the event loop, 3-4 µs per
#: record, more than the rest of a record's path): under trio a cancellation check, as trio's
#: own cheap operations do; under asyncio nothing, as a done ``asyncio.Future``. One such await
#: in ``RESOLVED_YIELD_EVERY`` is a full checkpoint, so a loop over done handles lets other
#: tasks run and, under asyncio, is cancelled within that many awaits: 256 awaits take 0.1-0.2
#: ms, and a checkpoint among them is 2-3 % of their work (8-10 % among 64, compiled build).
RESOLVED_YIELD_EVERY: Final = 256
_resolved_awaits: Final = [0]
#: trio's run context, once trio is imported: ``[current task, trio module, fast, run
#: context]``, the first a function giving the calling thread's trio task (``None`` outside
#: trio). ``fast``: the cancellation check reads the task's cancel status directly, which is
#: what ``trio.lowlevel.checkpoint_if_cancelled`` reads, without its coroutine and its second
#: look-up of the task (0.2 µs against 0.8 µs per await, see the CHANGELOG); and it finds the
#: task in trio's run context (the thread-local that ``current task`` reads) itself, without a
#: call into that interpreted function. Checked once against the trio installed, and the
#: public functions otherwise.
_trio: Final[list[Any]] = [None, None, False, None]


def resolved_checkpoint() -> Awaitable[None] | None:
    """What an await whose result is already there awaits (``None``: nothing). A plain
    function returning the backend's awaitable: no coroutine frame of its own on a path that
    every awaited record takes."""
    count = _resolved_awaits[0] + 1
    if count >= RESOLVED_YIELD_EVERY:
        _resolved_awaits[0] = 0
        return _waiting[0].checkpoint()
    _resolved_awaits[0] = count
    current_task = _trio[0]
    if current_task is None:
        if "trio" not in _modules:
            return None
        current_task = _waiting[0].find_trio(_trio)
    if not _trio[2]:
        if current_task() is None:
            return None
        return _trio[1].lowlevel.checkpoint_if_cancelled()  # type: ignore[no-any-return]
    # what ``current_task`` does: this thread's values of the thread-local (a trio task: a
    # guest run on asyncio too); typed, so that the compiled build reads the dictionary
    # directly rather than through a method call
    values: dict[str, Any] = _trio[3].__dict__
    task = values.get("task")
    if task is None:
        return None
    if task._cancel_status.effectively_cancelled:
        return _trio[1].lowlevel.checkpoint()  # type: ignore[no-any-return]
    return None


#: What an infinite limit is in the whole-number forms of :func:`at_least` and
#: :func:`at_most`: more than any count of records or bytes.
UNBOUNDED: Final = 1 << 62


def at_least(limit: float) -> int:
    """The least whole number not below ``limit``: for a whole count ``n``, ``n >= limit``
    exactly when ``n >= at_least(limit)``. Admission compares counts with limits as whole
    numbers: in the pure build a whole number compared with a float takes the interpreter's
    slow path (a fiftieth of a record's admission for four such comparisons)."""
    return UNBOUNDED if limit >= UNBOUNDED else math.ceil(limit)


def at_most(limit: float) -> int:
    """The greatest whole number not above ``limit``: ``n > limit`` exactly when ``n >
    at_most(limit)`` (see :func:`at_least`)."""
    return UNBOUNDED if limit >= UNBOUNDED else math.floor(limit)


class ShardBacklog:
    """The admitted, unfinished user records of one predicted shard (or of a stream's records
    admitted before their shard was known), and the most it may hold: what admission per
    shard compares (``Intake.has_room``).

    Every admitted record points to the backlog it was counted in (``Record.backlog``)
    and counts itself out when it becomes terminal (``Intake.finish``), once, wherever it went
    meanwhile (a retry after a reshard may send it to another shard). Like
    :class:`BatchCounter`, it refers to no record.
    """

    __slots__ = (
        "full_bytes",
        "full_records",
        "limit_bytes",
        "limit_records",
        "outstanding_bytes",
        "outstanding_records",
        "shard",
        "waits",
    )

    def __init__(self, shard: str | None, limit_records: float, limit_bytes: float) -> None:
        self.shard = shard  # None: the stream's records admitted before the shard map was ready
        self.outstanding_records = 0
        self.outstanding_bytes = 0
        # set here first, so that the compiled build knows them always set (no check per read)
        self.limit_records = self.limit_bytes = 0.0
        self.full_records = self.full_bytes = 0
        self.set_limits(limit_records, limit_bytes)
        self.waits = 0  # records that had to wait for room here (``Admission.wait``)

    def set_limits(self, limit_records: float, limit_bytes: float) -> None:
        """Planned by the stream's pipeline: ``max_outstanding_time`` of what the shard
        delivers. ``full_records`` and ``full_bytes`` are the same limits as whole numbers:
        the backlog is full at ``full_records`` records, and over ``full_bytes`` bytes."""
        self.limit_records = limit_records
        self.limit_bytes = limit_bytes
        self.full_records = at_least(limit_records)
        self.full_bytes = at_most(limit_bytes)

    def __repr__(self) -> str:
        return (
            f"<ShardBacklog {self.shard} {self.outstanding_records} records / "
            f"{self.outstanding_bytes} bytes of {self.limit_records:g} / {self.limit_bytes:g}>"
        )


#: A record's states (``Record._state``); the intake resolves records itself where nothing
#: waits on them (``Intake.finish``).
PENDING: Final = 0
SUCCEEDED: Final = 1
FAILED: Final = 2


# Acyclic in the compiled build: a Record is not a container the cyclic garbage collector
# tracks (mypyc leaves out its GC header and traverse function). One record each lives from
# submit to its PutRecords response, so tracked records filled the collector's older
# generations and set off full collections over everything the process holds (a quarter of a
# firehose's CPU, see the CHANGELOG). What makes that safe: a record refers to strings, bytes,
# numbers and AttemptRecords only, apart from three slots that may lead back to it, each
# cleared when the record becomes terminal (``resolve`` clears ``_event`` and ``on_done``,
# ``Intake.finish`` clears ``spool_segment``), so no cycle runs through a finished record; and
# no subclass can add one (a compiled class takes no interpreted subclasses). In the pure-Python
# package ``mypyc_attr`` does nothing at run time; there the intake makes each record it builds
# untracked after the fact where the interpreter allows it (``untrack_record``, CPython).
@mypyc_attr(acyclic=True)
class Record:
    """A user record in the producer: what it is, where the pipeline has it, its attempts, and the
    one-shot handle its caller awaits. Users see it as a :class:`~anykpl.PendingRecord`
    (``_runtime/_handle.py``), which reads; the stages change it through its methods and fields
    below."""

    __slots__ = (
        "_earlier_attempts",
        "_event",
        "_state",
        "arrival",
        "backlog",
        "batch",
        "data",
        "deadline",
        "expiration",
        "explicit_hash_key",
        "hash_key",
        "key_facts",
        "last_attempt",
        "on_done",
        "outstanding_slot",
        "partition_key",
        "predicted_shard",
        "sequence_number",
        "shard_id",
        "size",
        "spool_segment",
        "stream",
        "sub_sequence_number",
        "tenant",
    )

    def __init__(
        self,
        stream: str,
        partition_key: str,
        data: bytes,
        hash_key: int,
        explicit_hash_key: str | None,
        arrival: float,
        deadline: float,
        expiration: float,
        size: int | None = None,
        key_facts: KeyFacts | None = None,
        backlog: ShardBacklog | None = None,
        outstanding_slot: int = -1,
    ) -> None:
        self.stream = stream
        self.partition_key = partition_key
        self.data = data
        self.hash_key = hash_key
        self.explicit_hash_key = explicit_hash_key
        self.arrival = arrival
        self.deadline = deadline
        self.expiration = expiration
        # data + UTF-8 partition key: what the record counts towards the limits
        self.size = len(data) + len(partition_key.encode()) if size is None else size
        # (the admission that places it on building it: ``backlog``'s shard)
        self.predicted_shard: str | None = None if backlog is None else backlog.shard
        # its partition key's facts from the producer's key cache (Intake.make_record), for
        # the aggregator; None for a record with an explicit hash key
        self.key_facts = key_facts
        self.shard_id: str | None = None
        self.sequence_number: str | None = None
        self.sub_sequence_number: int | None = None
        # the tenant it was put for (tenant quotas and the Limiter's fair queue), or None
        self.tenant: str | None = None
        # the spool segment that holds the record on disk (``spool_dir``), until it is terminal
        self.spool_segment: Any = None
        # The latest attempt in a slot and earlier ones in a tuple: no list per record, since
        # most records succeed at the first attempt (every allocation here costs GC time).
        self.last_attempt: AttemptRecord | None = None
        self._earlier_attempts: tuple[AttemptRecord, ...] = ()
        self._state = PENDING
        self._event: Event | None = None
        # Called once, with the record, when it becomes terminal (SyncProducer completes its
        # futures with it). Private: one slot and one check per record, no callback list.
        self.on_done: Callable[[Record], object] | None = None
        # the counter of the submit_many batch it came in, or None
        self.batch: BatchCounter | None = None
        # the shard backlog it was admitted into (Intake.enqueue), None until then
        self.backlog = backlog
        # its place in the producer's outstanding records (OutstandingRecords), -1: none
        self.outstanding_slot = outstanding_slot

    def __repr__(self) -> str:
        state = ("pending", "succeeded", "failed")[self._state]
        return (
            f"<PendingRecord stream={self.stream!r} partition_key={self.partition_key!r} "
            f"{len(self.data)} bytes {state} after {len(self._attempts())} attempt(s)>"
        )

    def done(self) -> bool:
        """Whether the record is terminal (succeeded or failed)."""
        return self._state != PENDING

    def result(self) -> RecordResult:
        """The record's result.

        :raises RuntimeError: if the record is not done yet.
        :raises ~anykpl.errors.RecordFailedError: if it failed.
        """
        if self._state == PENDING:
            raise RuntimeError("the record is not done yet; await it")
        # Built on each call, not cached: a cached result would keep three more objects alive
        # per record for the garbage collector to walk (see the CHANGELOG's measurements).
        result = self.build_result()
        if self._state == FAILED:
            raise errors.RecordFailedError(result)
        return result

    def wait(self) -> Coroutine[Any, Any, RecordResult]:
        """Wait until the record is terminal; same as ``await pending``: ``await
        pending.wait()``, a coroutine."""
        return _waiting[0].record_wait(self)

    def wait_done(self) -> Awaitable[None]:
        """Wait until the record is terminal, without raising its failure."""
        return _waiting[0].record_done(self)

    def waiter(self) -> Event:
        """The event set when the record becomes terminal (made on first use); only while it
        is pending."""
        event = self._event
        if event is None:
            event = self._event = _waiting[0].new_event()
        return event

    def __await__(self) -> Generator[Any, None, RecordResult]:
        # the pure build replaces this with _runtime/_awaiting.interpreted_await, one frame
        if self._state == PENDING:
            return _waiting[0].record_result(self).__await__()
        checkpoint = resolved_checkpoint()
        if checkpoint is not None:
            return _waiting[0].result_after(checkpoint, self).__await__()
        return _ready(self)

    # -- used by the pipeline -------------------------------------------------------------

    def build_result(self) -> RecordResult:
        success = self._state == SUCCEEDED
        a = self.last_attempt
        if success and a is not None and not self._earlier_attempts:
            # The common case, built with tuple.__new__ directly: a named tuple's generated
            # __new__ is a Python function, and this runs once per record.
            delay = a.start - self.arrival
            duration = a.end - a.start
            attempt = _new_tuple(
                _Attempt,
                (
                    delay if delay > 0.0 else 0.0,
                    duration if duration > 0.0 else 0.0,
                    True,
                    None,
                    None,
                ),
            )
            return _new_tuple(
                _RecordResult,
                (True, self.shard_id, self.sequence_number, self.sub_sequence_number, (attempt,)),
            )
        attempts = []
        previous_end = self.arrival
        for a in self._attempts():
            attempts.append(
                Attempt(
                    delay=max(0.0, a.start - previous_end),
                    duration=max(0.0, a.end - a.start),
                    success=a.success,
                    error_code=a.code,
                    error_message=a.message,
                )
            )
            previous_end = a.end
        return RecordResult(
            success=success,
            shard_id=self.shard_id if success else None,
            sequence_number=self.sequence_number if success else None,
            sub_sequence_number=self.sub_sequence_number if success else None,
            attempts=tuple(attempts),
        )

    def _attempts(self) -> tuple[AttemptRecord, ...]:
        last = self.last_attempt
        return self._earlier_attempts if last is None else (*self._earlier_attempts, last)

    def add_attempt(self, attempt: AttemptRecord) -> None:
        if self._state != PENDING:
            # already terminal (failed at close while its request was in flight): its history
            # ends with the attempt that decided it
            return
        last = self.last_attempt
        if last is not None:
            self._earlier_attempts = (*self._earlier_attempts, last)
        self.last_attempt = attempt

    def resolve(self, success: bool) -> None:
        self._state = SUCCEEDED if success else FAILED
        batch = self.batch
        if batch is not None:
            batch.record_done(success)
        event = self._event
        if event is not None:
            self._event = None  # its waiters hold it; a record holds nothing that leads back
            event.set()
        on_done = self.on_done
        if on_done is not None:
            self.on_done = None
            try:
                on_done(self)
            except Exception:
                # it runs inside the stage that resolves a whole batch: the other records of
                # the batch must still be resolved
                logger.exception("the completion hook of %r failed", self)


#: Makes a record the intake built untracked by the cyclic garbage collector, as the compiled
#: build's records are by construction (``untrack_record(id(record))``, see above and
#: ``gc_untracker``): ``None`` where there is nothing to do (the compiled build) or no way to do
#: it (an interpreter other than CPython).
untrack_record: Final = gc_untracker(Record("", "", b"", 0, None, 0.0, 0.0, 0.0))

#: Whether the intake builds its commonest records with :data:`new_record` and a store per
#: slot (``Intake.admit_now``) rather than by calling the class: where ``__init__`` is a Python
#: function (the pure package), whose call the interpreter makes through the type's slot with
#: the arguments in a tuple, 1,400 instructions of a record's 40,000 (callgrind); a compiled
#: class is called (a C function) and refuses ``object.__new__``.
BUILD_BY_STORES: Final = isinstance(vars(Record)["__init__"], FunctionType)
#: ``object.__new__``: a record with no slot set yet (see :data:`BUILD_BY_STORES`)
new_record: Final[Callable[[type[Record]], Record]] = object.__new__


class ColumnBatch:
    """The records of one ``submit_many`` call kept in columns (data, key facts, size): no
    :class:`Record` is made for them unless a handle is asked for (:meth:`handle`) or a Kinesis
    record carrying them takes another way than success (:meth:`take`). Resolved chunk by
    chunk (:meth:`resolve_chunk`): ``outcomes`` holds one entry per chunk put."""

    __slots__ = (
        "_index",
        "adopt",
        "arrival",
        "counter",
        "datas",
        "deadline",
        "expiration",
        "facts",
        "materialized",
        "nbytes",
        "orphaned",
        "outcomes",
        "records",
        "runs",
        "sizes",
        "stream",
    )

    def __init__(
        self,
        stream: str,
        datas: list[bytes],
        facts: list[KeyFacts],
        sizes: list[int],
        counter: BatchCounter,
        arrival: float,
        deadline: float,
        expiration: float,
    ) -> None:
        self.stream = stream
        self.datas = datas
        self.facts = facts
        self.sizes = sizes
        self.counter = counter
        self.arrival = arrival
        self.deadline = deadline
        self.expiration = expiration
        self.records: list[Record | None] = [None] * len(datas)
        self.outcomes: list[tuple[list[int], str, str, int, AttemptRecord]] = []
        self.materialized = 0  # handles made for positions not resolved yet
        self.nbytes = 0  # its items' bytes (data and keys), as admitted
        # positions taken over while their chunks still ride in Kinesis records (closing):
        # a chunk resolved later looks at each position
        self.orphaned = False
        # the positions of each shard backlog they were admitted to
        self.runs: dict[ShardBacklog, list[int]] = {}
        self._index: dict[int, tuple[str, str, int, AttemptRecord]] | None = None
        # the producer's OutstandingRecords.adopt: a record the per-record path takes over joins the
        # outstanding list (it is counted there already, as an item)
        self.adopt: Callable[[Record], None] | None = None

    def __len__(self) -> int:
        return len(self.datas)

    def _outcome_of(self, position: int) -> tuple[str, str, int, AttemptRecord] | None:
        index = self._index
        if index is None:
            index = self._index = {}
            for positions, shard, sequence_number, first, attempt in self.outcomes:
                for offset, at in enumerate(positions):
                    index[at] = (shard, sequence_number, first + offset, attempt)
        return index.get(position)

    def handle(self, position: int) -> Record:
        """The handle of the record at ``position`` (made on first use)."""
        record = self.records[position]
        if record is not None:
            return record
        facts = self.facts[position]
        record = Record(
            self.stream,
            facts.key,
            self.datas[position],
            facts.hash_key,
            None,
            self.arrival,
            self.deadline,
            self.expiration,
            self.sizes[position],
            facts,
        )
        outcome = self._outcome_of(position)
        if outcome is None:
            self.materialized += 1  # pending: its chunk resolves it
        else:
            record.shard_id, record.sequence_number, record.sub_sequence_number = outcome[:3]
            record.last_attempt = outcome[3]
            record._state = SUCCEEDED
        if untrack_record is not None:
            untrack_record(id(record))  # as the intake's records: no cycle runs through it
        self.records[position] = record
        return record

    def take(self, position: int, backlog: ShardBacklog | None) -> Record:
        """The record at ``position`` (pending), taken over by the per-record path: its
        Kinesis record took another way than success. Its chunk will not resolve it."""
        record = self.handle(position)
        if record._state != PENDING or record.outstanding_slot >= 0:
            return record  # taken over already (closing), or resolved: once
        self.materialized -= 1
        record.batch = self.counter
        record.backlog = backlog
        record.predicted_shard = None if backlog is None else backlog.shard
        adopt = self.adopt
        if adopt is not None:
            adopt(record)
        return record

    def take_unresolved(self) -> list[Record]:
        """Every record not resolved yet, taken over by the per-record path (the producer
        fails them: closing); their chunks, wherever they ride, skip them from now on."""
        resolved: set[int] = set()
        for positions, *_ in self.outcomes:
            resolved.update(positions)
        taken: list[Record] = []
        self.orphaned = True
        for backlog, positions in self.runs.items():
            for position in positions:
                if position in resolved:
                    continue
                record = self.records[position]
                if record is not None and (
                    record._state != PENDING or record.outstanding_slot >= 0
                ):
                    continue
                taken.append(self.take(position, backlog))
        return taken

    def resolve_chunk(
        self,
        positions: list[int],
        shard: str,
        sequence_number: str,
        first: int,
        attempt: AttemptRecord,
    ) -> tuple[int, int]:
        """The records at ``positions`` were put, in one Kinesis record at ``shard`` under
        ``sequence_number``, with subsequence numbers from ``first`` on. Returns how many of
        them the per-record path had taken over (closing), and their bytes: those are counted
        out by ``Intake.finish``, not as items."""
        self.outcomes.append((positions, shard, sequence_number, first, attempt))
        index = self._index
        if index is not None:
            for offset, at in enumerate(positions):
                index[at] = (shard, sequence_number, first + offset, attempt)
        if not self.materialized and not self.orphaned:
            self.counter.records_done(len(positions), True)
            return NONE_TAKEN
        records = self.records
        counted = 0
        taken = taken_bytes = 0
        for offset, at in enumerate(positions):
            record = records[at]
            if record is None:
                counted += 1
                continue
            if record._state != PENDING or record.outstanding_slot >= 0:
                # taken over (closing): failed already, or the per-record path resolves it
                # and counts it out (Intake.finish): exactly once
                taken += 1
                taken_bytes += self.sizes[at]
                continue
            self.materialized -= 1
            record.add_attempt(attempt)
            record.shard_id = shard
            record.sequence_number = sequence_number
            record.sub_sequence_number = first + offset
            record.batch = self.counter
            record.resolve(True)
        if counted:
            self.counter.records_done(counted, True)
        return (taken, taken_bytes)


#: :meth:`ColumnBatch.resolve_chunk`'s answer where no item was taken over
NONE_TAKEN: Final = (0, 0)


class KinesisRecord:
    """One Kinesis record: a single user record sent raw, or an aggregate of several.

    It owns the handles of its user records. ``deadline`` and ``expiration`` are the earliest of
    its records' (aws/kinesis/utils/time_sensitive.h), ``size`` is what the record counts
    towards a PutRecords request (partition key + data, as the service counts it), and
    ``predicted_shard`` is the shard the aggregator predicted, or ``None`` when the shard map
    was not ready (such records bypass the limiter, as in the KPL).
    """

    __slots__ = (
        "_builder",
        "_data",
        "_records",
        "chunks",
        "deadline",
        "expiration",
        "explicit_hash_key",
        "item_backlog",
        "item_bytes",
        "item_sizes",
        "nitems",
        "partition_key",
        "predicted_shard",
        "shared_paid",
        "size",
        "tenant",
    )

    def __init__(
        self,
        records: list[Record],
        data: bytes,
        partition_key: str,
        explicit_hash_key: str,
        predicted_shard: str | None,
        deadline: float,
        expiration: float,
    ) -> None:
        self._records = records
        self._data: bytes | None = data
        self._builder: AggregateBuilder | None = None
        self.partition_key = partition_key
        self.explicit_hash_key = explicit_hash_key
        self.predicted_shard = predicted_shard
        self.deadline = deadline
        self.expiration = expiration
        # data + UTF-8 partition key, as the service counts a record against its limits
        self.size = len(data) + _utf8_length(partition_key)
        # every user record of an aggregate has the same tenant (the Aggregator keeps tenants
        # apart), so the Limiter can queue the Kinesis record fairly by tenant
        self.tenant = records[0].tenant if records else None
        # the Limiter reserved its tokens in the producer-wide (fleet) bucket already
        self.shared_paid = False
        # a column batch's items instead of records (Aggregator.put_items): its chunks,
        # (batch, positions); how many items and their bytes as admitted; their data sizes'
        # total, smallest and largest (UserRecordsDataPut); the shard backlog they count in
        self.chunks: list[tuple[ColumnBatch, list[int]]] | None = None
        self.nitems = 0
        self.item_bytes = 0
        self.item_sizes: tuple[int, int, int] = (0, 0, 0)
        self.item_backlog: ShardBacklog | None = None

    @property
    def records(self) -> list[Record]:
        """Its user records' handles (a column batch's items made records on first use here:
        every way but success takes them per record, see :meth:`ColumnBatch.take`)."""
        chunks = self.chunks
        if chunks is not None:
            self.chunks = None
            backlog = self.item_backlog
            records: list[Record] = []
            for columns, positions in chunks:
                for position in positions:
                    records.append(columns.take(position, backlog))
            self._records = records
            self.nitems = 0
            self.item_bytes = 0
        return self._records

    @property
    def user_records(self) -> int:
        """How many user records it carries (made records or not)."""
        return len(self._records) or self.nitems

    def mean_arrival(self) -> float:
        """When its user records were admitted, on average (the Limiter's pacing)."""
        chunks = self.chunks
        if chunks is not None:
            total = 0.0
            for columns, positions in chunks:
                total += columns.arrival * len(positions)
            return total / self.nitems
        records = self._records
        return sum(r.arrival for r in records) / len(records)

    def __repr__(self) -> str:
        return (
            f"<KinesisRecord {self.user_records} user record(s) {self.size} bytes "
            f"predicted={self.predicted_shard}>"
        )

    @classmethod
    def aggregate(
        cls,
        records: list[Record],
        builder: AggregateBuilder,
        partition_key: str,
        explicit_hash_key: str,
        predicted_shard: str,
        deadline: float,
        expiration: float,
    ) -> KinesisRecord:
        """An aggregate of ``records``, built by ``builder``. Its bytes are made only when they
        are sent (:attr:`data`): until then the user records' own bytes are the only copy of
        the payload, so ``max_outstanding_bytes`` counts what is really held."""
        kr = cls(
            records, b"", partition_key, explicit_hash_key, predicted_shard, deadline, expiration
        )
        kr._data = None
        kr._builder = builder
        kr.size = builder.size + _utf8_length(partition_key)
        return kr

    @property
    def data(self) -> bytes:
        """The Kinesis record's bytes (an aggregate is serialized on first use)."""
        data = self._data
        if data is None:
            assert self._builder is not None
            data = self._data = self._builder.serialize()
            self._builder = None
        return data

    def split(self, max_size: int) -> list[KinesisRecord]:
        """This aggregate as smaller ones of at most ``max_size`` bytes, its user records in
        order (itself alone if it is not an aggregate, already serialized, or small enough)."""
        builder = self._builder
        if builder is None or self.user_records < 2 or builder.size <= max_size:
            return [self]  # (a column batch's items stay items)
        records = self.records
        pieces: list[KinesisRecord] = []
        part: list[Record] = []
        current = AggregateBuilder()
        for record in records:
            pk, ehk = record.partition_key, record.explicit_hash_key
            if not current.add_within(pk, ehk, record.data, max_size):
                if part:
                    pieces.append(self._piece(part, current))
                    part, current = [], AggregateBuilder()
                # it starts the next piece, whatever its size (bigger than a piece: it goes
                # alone, raw)
                current.add_within(pk, ehk, record.data, math.inf)
            part.append(record)
        pieces.append(self._piece(part, current))
        return pieces

    def _piece(self, records: list[Record], builder: AggregateBuilder) -> KinesisRecord:
        first = records[0]
        if len(records) == 1:
            piece = KinesisRecord.single(first)
        else:
            shard = self.predicted_shard
            assert shard is not None  # an unserialized aggregate always has one
            piece = KinesisRecord.aggregate(
                records,
                builder,
                self.partition_key,
                first.explicit_hash_key or str(first.hash_key),
                shard,
                min(r.deadline for r in records),
                min(r.expiration for r in records),
            )
        piece.shared_paid = self.shared_paid
        return piece

    def release(self) -> None:
        """Drop the serialized bytes of an aggregate once its request is done (the user
        records keep their own)."""
        if self._builder is None and self.user_records > 1:
            self._data = b""

    @classmethod
    def single(cls, record: Record) -> KinesisRecord:
        """A Kinesis record carrying one user record, sent raw with the user's partition key and
        the record's hash key as explicit hash key (always set, as in kinesis_record.cc)."""
        return cls(
            [record],
            record.data,
            record.partition_key,
            record.explicit_hash_key or str(record.hash_key),
            record.predicted_shard,
            record.deadline,
            record.expiration,
        )


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def partition_key_hash(partition_key: str | bytes) -> int:
    """The KPL's hash key of a partition key: MD5 of its UTF-8 bytes as a big-endian uint128."""
    if isinstance(partition_key, str):
        partition_key = partition_key.encode()
    return int.from_bytes(md5(partition_key, usedforsecurity=False).digest(), "big")
