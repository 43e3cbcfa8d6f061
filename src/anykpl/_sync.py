"""SyncProducer: the blocking facade for code that has no event loop (scripts, Django, Flask,
Jupyter, thread pools).

Why a portal thread. The producer is async all the way down (its stages are tasks, its network
is async), so blocking callers need an event loop to run it in. The SyncProducer starts one of
its own — ``anyio.from_thread.start_blocking_portal``, on asyncio or trio — in a daemon thread
that lives as long as the SyncProducer, and runs one ordinary :class:`~anykpl.Producer` inside
it. The caller's threads never run async code; they hand records over and wait on plain locks.
Running our own loop (rather than borrowing a running one) is what makes it work unchanged in
Jupyter, whose kernel already runs an asyncio loop in the main thread.

Admission is the Producer's own. ``submit`` hands its record to the loop and blocks the calling
thread on a plain lock until the record is admitted or refused. Handing over is one dict entry
under a lock (``_admitting``, the records handed over and not yet taken, in order) and, when no
callback that takes them is already scheduled, one thread-safe callback (asyncio's
``call_soon_threadsafe``, trio's ``run_sync_soon``): no task and no portal round trip per record,
and one wake-up of the loop for a burst from many threads (a wake-up per record halved trio's
throughput from eight threads: its scheduling lock and socket write are taken per call). In the
loop, the callback takes the records in order and tries ``Producer.submit_nowait`` for each, the
non-blocking try; a record that cannot be admitted at once — no room on its shard yet, a spool
that commits, a ``tenant=`` (it may wait for its quota), a ``submit_many`` batch — waits in a
task of its own, in ``Producer.submit`` (or ``submit_many``): the same waits, bounds and errors
as on the async producer, and a hot partition key's callers wait while the other threads'
records go on. A calling thread has one record in admission at a time, so each thread's records
keep their order. Whoever removes a record from ``_admitting`` owns its answer: the loop
(admitting it), its caller (withdrawing it when its ``timeout`` runs out first), or a close
(refusing it, when the loop will never take it).

Results. The record's :class:`concurrent.futures.Future` is completed where the record is
resolved: on admission the record's completion hook (``Record.on_done``, one slot) is set, and
the stage that resolves the record calls it. No task, no polling: a record that finishes while
an older one is still retrying completes its future at once, and every future of a flushed
record is done when ``Producer.flush`` returns. A ``submit_many`` batch's future is completed
by the batch's hook (``set_done_hook``), where its last record is resolved. ``put_record`` is
``submit`` followed by ``future.result(timeout)``. ``flush``, ``statistics`` and ``metrics`` go
through ``BlockingPortal.call``: rare calls, a task each.

Futures are completed in the loop thread, so a future's done callbacks run there: they must be
quick and must not call the SyncProducer (that raises ``RuntimeError`` instead of deadlocking).

Shutdown (``close``, leaving a ``with`` block, or at interpreter exit). (1) Under the lock the
SyncProducer stops taking calls (``ProducerClosedError``), and the close request is scheduled
behind every record already handed to the loop, which are admitted first. (2) In the loop,
``Producer.aclose(timeout=bound)``, the bound being ``config.close_timeout`` unless
``close(timeout=...)`` says otherwise: as on the async producer, records still waiting for room
or for their tenant's quota give up with ``ProducerClosedError``, the rest is flushed within the
bound and what is left after it fails with ``ProducerClosed``. (3) Every future still held is
completed (every record is terminal once the Producer is closed). (4) The portal is stopped and
its thread joined. The closing thread waits at most the bound plus ``_CLOSE_GRACE`` for steps
2-3; if the loop is wedged (a future callback that blocks, say) it abandons the daemon thread
rather than hang the interpreter: it logs how many records are lost (a warning only if none is),
refuses the records the loop has not taken, and every later call raises
``ProducerClosedError`` at once instead of waiting on the wedged loop.

At interpreter exit. A SyncProducer still open when the interpreter exits is closed by an
``atexit`` hook, registered when the first SyncProducer is created (so it runs before the
program's own hooks registered earlier). By then Python has joined its non-daemon threads and
``concurrent.futures`` has shut its thread pools down, asyncio's default executor among them,
and a new connection's DNS lookup (``loop.getaddrinfo``) runs in that executor: so the asyncio
loop gets a default executor of its own (``_OwnThreads``), whose first thread is started with
the loop (Python 3.12.0-3.12.1 refuse new threads at exit). trio resolves names in its own
threads.

If a pipeline stage crashes, the Producer fails every record and its block raises; the
SyncProducer then behaves as closed and its next ``close`` re-raises that error.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError as FutureCancelledError
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import AbstractContextManager, suppress
from functools import partial
from queue import Empty, SimpleQueue
from types import TracebackType
from typing import Any, cast

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal

from . import errors
from ._compat import running_trio
from ._core._metrics import MetricValue
from ._core._records import Record, RecordResult
from ._runtime._batch import BatchResult, PendingBatch, set_done_hook
from ._runtime._handle import PendingRecord
from ._runtime._producer import BatchRecord, Producer
from ._runtime._statistics import ProducerStatistics
from ._transport._protocol import Transport
from .config import ProducerConfig
from .metrics import MetricsSink

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ("SyncProducer",)

logger = logging.getLogger("anykpl.sync")

_CLOSE_GRACE = 5.0  # seconds a closing thread waits beyond the close bound before giving up
# A timed call's record can be withdrawn until the loop takes it, which it does within a few
# milliseconds: a timeout shorter than this (``timeout=0``: "only if there is room now") waits
# this long for the loop to take it, then the loop bounds the wait for room by the timeout.
_TAKE_GRACE = 0.05
_ABANDON_CHECK = 0.25  # seconds between a waiting caller's checks that close abandoned the loop


def _not_admitted() -> errors.ProducerClosedError:
    return errors.ProducerClosedError(
        "the producer closed before the record was admitted; nothing was enqueued"
    )


class _Admission:
    """One record (or one ``submit_many`` batch) on its way from a caller's thread into the
    Producer, and the answer it gets there."""

    __slots__ = ("args", "deadline", "error", "future", "items", "signal", "tenant")

    def __init__(
        self,
        args: tuple[str, bytes | bytearray | memoryview, str | None, str | int | None],
        tenant: str | None,
        deadline: float | None,
        items: list[BatchRecord] | None = None,
    ) -> None:
        self.args = args
        self.items = items  # a submit_many batch (args then holds only its stream)
        self.tenant = tenant
        self.deadline = deadline  # time.monotonic() value, or None
        self.error: BaseException | None = None
        # Running at once, so that Future.cancel() is refused: like cancelling an ``await``
        # of a PendingRecord, it could not withdraw a record that was admitted.
        self.future: Future[Any] = Future()  # of a RecordResult, or a batch's BatchResult
        self.future.set_running_or_notify_cancel()
        # held until the record is admitted or refused: the caller blocks on it
        self.signal = threading.Lock()
        self.signal.acquire()

    def answer(self, error: BaseException | None = None) -> None:
        """Release the caller: admitted (its future is set up), or refused with ``error``."""
        self.error = error
        self.signal.release()


class _OwnThreads(ThreadPoolExecutor):
    """The default executor of a SyncProducer's asyncio loop (``loop.getaddrinfo``,
    ``asyncio.to_thread``), on ``_WORKERS`` daemon threads of its own, all started with the
    loop. Unlike ``concurrent.futures``' pools, which Python shuts down before the exit hook
    closes the producer, it still works then (module docstring), and it needs no new thread
    then (Python 3.12.0-3.12.1 refuse to start one). The calls are rare: a host name lookup
    per new connection, an SSL context per client."""

    _WORKERS = 2

    def __init__(self) -> None:
        super().__init__(max_workers=1)  # the base's bookkeeping only: it starts no thread
        self._calls: SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = SimpleQueue()
        self._stopping = threading.Lock()
        self._stopped = False
        self._workers = [
            threading.Thread(target=self._work, name="anykpl-sync-executor", daemon=True)
            for _ in range(self._WORKERS)
        ]
        for worker in self._workers:
            worker.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._stopping:
            if self._stopped:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._calls.put((future, partial(fn, *args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`ThreadPoolExecutor.shutdown`: refuse new calls, let the workers finish
        the calls queued (or cancel them), and with ``wait`` join the workers."""
        with self._stopping:
            if not self._stopped:
                self._stopped = True
                if cancel_futures:
                    cancelled: list[Future[Any]] = []
                    with suppress(Empty):
                        while (call := self._calls.get_nowait()) is not None:
                            cancelled.append(call[0])
                    for future in cancelled:
                        future.cancel()
                for _ in self._workers:
                    self._calls.put(None)  # after the calls queued: they are still run
        if wait:
            for worker in self._workers:
                if worker is not threading.current_thread():
                    worker.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn = call
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, call  # no reference held while idle


# Every open SyncProducer, in creation order (a dict as an ordered set): closed by the exit
# hook, and made unusable at once in a forked child (gunicorn --preload, multiprocessing with
# fork) instead of waiting on a loop thread the child lacks.
_live: dict[SyncProducer, None] = {}
_live_lock = threading.Lock()
_exit_hook_registered = False

# The portals of loop threads that close() abandoned, never collected: collecting one would stop
# its portal and join its thread from whichever thread collects it (hanging there, or failing
# with "cannot join current thread" in the loop thread itself).
_abandoned_portals: list[AbstractContextManager[BlockingPortal]] = []


def _close_all_at_exit() -> None:
    with _live_lock:
        producers = list(_live)
    for producer in reversed(producers):
        producer._close_at_exit()


def _register(producer: SyncProducer) -> None:
    """Track ``producer`` until it closes; the first one registers the exit hook (after
    whatever ``atexit`` hooks the program registered before it, so that those run after ours:
    ``atexit`` runs the last registered first)."""
    global _exit_hook_registered
    with _live_lock:
        _live[producer] = None
        if not _exit_hook_registered:
            _exit_hook_registered = True
            atexit.register(_close_all_at_exit)


def _unregister(producer: SyncProducer) -> None:
    with _live_lock:
        _live.pop(producer, None)


def _after_fork_in_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # it may have been held by a thread that is gone
    for producer in list(_live):
        producer._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SyncProducer(AbstractContextManager["SyncProducer"]):
    """A thread-safe, blocking :class:`~anykpl.Producer` for code without an event loop.

    ``SyncProducer(config)`` or ``SyncProducer(**overrides)`` (``ProducerConfig`` field names),
    or both, as for :class:`~anykpl.Producer`. It starts at once — an event loop in a daemon
    thread, running a Producer — and must be closed: ``with SyncProducer(...) as producer:``,
    or :meth:`close`; one that is still open when the interpreter exits is closed by an exit
    hook (flushing, bounded by ``config.close_timeout``)::

        with SyncProducer(region="us-east-1") as producer:
            result = producer.put_record("stream", b"data", partition_key="key")
            future = producer.submit("stream", b"more", partition_key="key")
            producer.flush()

    Every method may be called from any number of threads at once.

    ``backend`` is ``"asyncio"`` (the default) or ``"trio"``, with ``backend_options`` passed to
    :func:`anyio.run` (``{"use_uvloop": True}``, say). ``transport`` and ``metrics_sinks`` are
    as for :class:`~anykpl.Producer`.
    """

    def __init__(
        self,
        config: ProducerConfig | None = None,
        *,
        backend: str = "asyncio",
        backend_options: dict[str, Any] | None = None,
        transport: Transport | None = None,
        metrics_sinks: Sequence[MetricsSink] = (),
        **overrides: Any,
    ) -> None:
        # built here, so that configuration errors raise in the caller before any thread starts
        self._producer = Producer(
            config, transport=transport, metrics_sinks=metrics_sinks, **overrides
        )
        self.config = self._producer.config
        self.backend = backend
        self._lock = threading.Lock()
        # Taking calls: False once close() began, the producer failed, or after a fork.
        self._open = True
        # The loop's run is over (or out of reach): every record is terminal.
        self._ended = False
        # records handed to the loop and not yet taken by it, in order (a dict as an ordered
        # set), and whether a callback that takes them is scheduled (module docstring); under
        # _lock
        self._admitting: dict[_Admission, None] = {}
        self._take_scheduled = False
        # the loop's tasks for records that wait (for room, for their tenant's quota)
        self._waiting: TaskGroup | None = None
        # admitted records whose future is not done yet; only the loop thread changes it
        self._futures: dict[Record, Future[RecordResult]] = {}
        # likewise for submit_many's batches
        self._batch_futures: dict[PendingBatch, Future[BatchResult]] = {}
        self._close_requested: anyio.Event | None = None
        self._close_bound = self.config.close_timeout
        self._closer: threading.Thread | None = None
        self._closed = threading.Event()
        self._loop_thread: int | None = None
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._run_error: Exception | None = None  # raised once, by close()
        self._closed_reason = ""  # for ProducerClosedError messages
        self._final_statistics: ProducerStatistics | None = None  # taken as the loop ends
        self._final_metrics: list[MetricValue] | None = None  # likewise
        self._abandoned = False  # close gave up on a wedged loop thread

        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal(
            backend, backend_options
        )
        self._portal = self._portal_cm.__enter__()
        try:
            self._run_future, _ = self._portal.start_task(self._run)
        except BaseException:
            self._open = False
            self._ended = True
            self._portal_cm.__exit__(*sys.exc_info())
            raise
        _register(self)

    def __repr__(self) -> str:
        return f"<SyncProducer {self._lifecycle()} backend={self.backend} {self._producer!r}>"

    def _lifecycle(self) -> str:
        return "open" if self._open else "closed" if self._ended else "closing"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- putting --------------------------------------------------------------------------

    def put_record(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None = None,
        explicit_hash_key: str | int | None = None,
        *,
        tenant: str | None = None,
        timeout: float | None = None,
    ) -> RecordResult:
        """Put one record and block until it is terminal, or for at most ``timeout`` seconds.

        Arguments as for :meth:`Producer.put_record <anykpl.Producer.put_record>`
        (``tenant`` included: the wait for the tenant's quota is part of admission).

        :returns: the :class:`~anykpl.RecordResult` on success.
        :raises ~anykpl.errors.RecordFailedError: the record failed for good.
        :raises errors.PutTimeout: ``timeout`` ran out after admission; the record is still in
            flight (``exc.future`` gives its outcome later). Do not put it again.
        :raises ~anykpl.errors.BackpressureTimeout: ``timeout`` (or ``admission_timeout``) ran
            out while waiting for room or for the tenant's quota; nothing was enqueued.
        :raises ~anykpl.errors.TenantQuotaExceeded: the tenant is over its quota and
            ``tenant_overflow`` is ``"reject"``; nothing was enqueued.
        :raises ~anykpl.errors.InvalidRecordError, ~anykpl.errors.RecordTypeError: bad input;
            nothing was enqueued.
        :raises ~anykpl.errors.ProducerClosedError: the producer is closed or closing.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self._admit(stream, data, partition_key, explicit_hash_key, tenant, deadline)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return future.result(remaining)
        except FutureTimeoutError:
            if future.done():  # it finished just as the wait ran out
                return future.result()
            raise errors.PutTimeout(
                f"the record was not terminal within timeout={timeout} s; it is still in "
                "flight (exc.future has its outcome)",
                future,
            ) from None

    def submit(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None = None,
        explicit_hash_key: str | int | None = None,
        *,
        tenant: str | None = None,
        timeout: float | None = None,
    ) -> Future[RecordResult]:
        """Admit one record and return a :class:`concurrent.futures.Future` of its result.

        Blocks only until the record is admitted: while its tenant (``tenant=``) waits for its
        quota, and while there is no room under
        ``max_outstanding_records``/``max_outstanding_bytes`` (backpressure), for at most
        ``timeout`` seconds (and ``admission_timeout``). The future's result is the
        :class:`~anykpl.RecordResult`; on failure its exception is
        :class:`~anykpl.errors.RecordFailedError`. The future cannot be cancelled: an admitted
        record is delivered or fails. Its done callbacks run in the producer's event-loop
        thread.

        Raises like :meth:`put_record`, except that record failures come from the future.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._admit(stream, data, partition_key, explicit_hash_key, tenant, deadline)

    def _admit(
        self,
        stream: str,
        data: bytes | bytearray | memoryview,
        partition_key: str | None,
        explicit_hash_key: str | int | None,
        tenant: str | None,
        deadline: float | None,
    ) -> Future[RecordResult]:
        return self._enqueue((stream, data, partition_key, explicit_hash_key), tenant, deadline)

    def _enqueue(
        self,
        args: tuple[str, bytes | bytearray | memoryview, str | None, str | int | None],
        tenant: str | None,
        deadline: float | None,
        items: list[BatchRecord] | None = None,
    ) -> Future[Any]:
        """Hand one record (or ``items``, a batch) to the loop; block until it is admitted."""
        self._check_thread()
        item = _Admission(args, tenant, deadline, items)
        with self._lock:
            if not self._open:
                raise self._closed_error()
            self._admitting[item] = None
            # scheduled under the lock: nothing can come between the flag and the callback
            # (an interrupt would leave the flag set and no callback), and a close() comes after
            if not self._take_scheduled:
                if not self._call_soon(self._admit_handed_over):  # pragma: no cover - loop gone
                    del self._admitting[item]
                    raise self._closed_error()
                self._take_scheduled = True
        until = None if deadline is None else max(deadline, time.monotonic() + _TAKE_GRACE)
        if not self._wait_for_answer(item, until):
            with self._lock:
                withdrawn = item in self._admitting
                if withdrawn:
                    del self._admitting[item]
            if withdrawn:
                raise errors.BackpressureTimeout(
                    "the record was not admitted within the timeout; nothing was enqueued"
                )
            # the loop has it, and bounds its wait for room by the same deadline
            self._wait_for_answer(item, None)
        if item.error is not None:
            try:
                raise item.error
            finally:
                item.error = None  # no reference cycle through the traceback
        return item.future

    def _wait_for_answer(self, item: _Admission, until: float | None) -> bool:
        """Block until ``item`` is answered (True) or ``until`` (a ``time.monotonic()`` value)
        passes (False); raise if a close abandons the loop meanwhile (it will never answer)."""
        while True:
            wait = _ABANDON_CHECK
            if until is not None:
                wait = max(0.0, min(wait, until - time.monotonic()))
            if item.signal.acquire(timeout=wait):
                return True
            if self._abandoned:
                with self._lock:  # _abandon answered the records the loop had not taken
                    pass
                if item.signal.acquire(blocking=False):
                    return True
                raise self._closed_error(
                    "the record was in its hands, and its outcome will never be known"
                )
            if until is not None and time.monotonic() >= until:
                return False

    def submit_many(
        self, stream: str, records: Iterable[BatchRecord], *, tenant: str | None = None
    ) -> Future[BatchResult]:
        """Admit many records of one stream in one call; return a
        :class:`concurrent.futures.Future` of the batch's :class:`~anykpl.BatchResult`.

        Items and admission as for :meth:`Producer.submit_many
        <anykpl.Producer.submit_many>`: every item is validated before any is admitted (bad
        input raises, naming the item, and nothing is enqueued), then the records are admitted
        in order, blocking while there is no room (backpressure) for at most
        ``admission_timeout``; if it runs out part-way,
        :class:`~anykpl.errors.BackpressureTimeout` is raised and its ``admitted`` holds the
        handles of the records admitted before it (they go on: ``done()`` and ``result()``
        tell their outcome once :meth:`flush` returns). The future is done when every record
        of the batch is terminal; it never raises for a failed record (the failures are in the
        result) and cannot be cancelled. For a firehose: one call into the event loop per
        batch, not per record.

        :raises: as :meth:`submit`.
        """
        items = list(records)  # read in the caller's thread: the iterable is the caller's
        return self._enqueue((stream, b"", None, None), tenant, None, items)

    # -- flushing, closing, statistics ----------------------------------------------------

    def flush(self, timeout: float | None = None, *, stream: str | None = None) -> None:
        """Block until every record admitted so far is terminal and its future done (with
        ``stream``, every record of that stream).

        Records submitted while the flush waits are not waited for. After close, returns at
        once (everything is terminal then).

        :raises ~anykpl.errors.FlushTimeout: if ``timeout`` seconds pass first (nothing is
            failed; the records carry on).
        :raises ~anykpl.errors.ProducerClosedError: :meth:`close` gave up on a wedged event
            loop, so the records it held are not terminal and never will be.
        """
        self._check_thread()
        if self._abandoned:
            raise self._closed_error("its records are lost")
        if self._ended:
            return
        try:
            self._portal.call(partial(self._producer.flush, timeout, stream=stream))
        except RuntimeError:
            if self._lifecycle() == "closed":
                return  # the portal stopped meanwhile: everything is terminal
            raise

    def close(self, timeout: float | None = None) -> None:
        """Flush, then close: fail whatever is still outstanding after ``timeout`` seconds
        (``config.close_timeout`` by default) with ``ProducerClosed``, stop the event loop and
        join its thread. Never hangs. Idempotent; other threads calling it meanwhile wait.

        :raises Exception: the error of a pipeline stage that crashed, once.
        """
        self._check_thread()
        with self._lock:
            closer = self._closer is None
            if closer:
                self._closer = threading.current_thread()
                self._open = False
                if timeout is not None:
                    self._close_bound = timeout
        if not closer:
            self._closed.wait()
            return
        try:
            self._shut_down()
        finally:
            self._closed.set()
        error, self._run_error = self._run_error, None
        if error is not None:
            raise error

    def statistics(self) -> ProducerStatistics:
        """A frozen snapshot of the producer's state and counters (see
        :meth:`Producer.statistics <anykpl.Producer.statistics>`)."""
        self._check_thread()
        if not self._ended:
            with suppress(RuntimeError):  # the portal stopped meanwhile
                return self._portal.call(self._producer.statistics)
        if self._final_statistics is not None:
            return self._final_statistics
        if self._abandoned:
            raise self._closed_error("its statistics are out of reach")
        return self._producer.statistics()

    @property
    def outstanding_records(self) -> int:
        """Admitted records that are not yet terminal (see :attr:`Producer.outstanding_records
        <anykpl.Producer.outstanding_records>`); once closed, as many as close left. Read as
        :meth:`statistics` reads them (and raises as it does)."""
        return self.statistics().outstanding_records

    @property
    def oldest_record_age(self) -> float:
        """Seconds since the oldest record that is not yet terminal was admitted, 0.0 when
        none is (see :attr:`Producer.oldest_record_age <anykpl.Producer.oldest_record_age>`);
        once closed, as close left it. Read as :meth:`statistics` reads it."""
        return self.statistics().oldest_record_age

    def metrics(self, name: str | None = None, window: float | None = None) -> list[MetricValue]:
        """The KPL metrics kept in process (see :meth:`Producer.metrics
        <anykpl.Producer.metrics>`): every metric at every level, cumulative since the producer
        started, or over the last ``window`` seconds; only ``name`` if given.

        After close, the cumulative metrics taken as the producer closed (so they count every
        record), filtered by ``name``.

        :raises ValueError: ``window`` is not in (0, 60].
        :raises ~anykpl.errors.ProducerClosedError: a ``window`` was asked for after close (a
            closed producer has no "last seconds"), or close gave up on a wedged event loop
            before the metrics could be taken.
        """
        self._check_thread()
        if window is not None and not (isinstance(window, (int, float)) and 0 < window <= 60):
            raise ValueError(f"window must be None or in (0, 60] seconds, got {window!r}")
        if not self._ended:
            with suppress(RuntimeError):  # the portal stopped meanwhile
                return self._portal.call(self._producer.metrics, name, window)
        final = self._final_metrics
        if final is None or window is not None:
            raise self._closed_error(
                "its metrics are out of reach"
                if final is None
                else "ask for window=None to get the metrics taken as it closed"
            )
        return [value for value in final if name is None or value.name == name]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has started (or the producer failed)."""
        return not self._open

    def _shut_down(self) -> None:
        _unregister(self)
        bound = self._close_bound
        self._call_soon(self._request_close)
        try:
            self._run_future.exception(bound + _CLOSE_GRACE if math.isfinite(bound) else None)
        except FutureCancelledError:
            pass
        except FutureTimeoutError:
            self._abandon(bound + _CLOSE_GRACE)
            return
        self._portal_cm.__exit__(None, None, None)

    def _abandon(self, waited: float) -> None:
        """The loop thread is wedged: leave it, and make every later call fail at once."""
        _abandoned_portals.append(self._portal_cm)
        with self._lock:
            self._abandoned = True
            self._open = False
            self._ended = True
            self._closed_reason = (
                f" (its event loop did not stop within {waited:.1f} s and was abandoned)"
            )
            # taken, so that a loop that recovers does not admit them after all, and refused
            # under the lock (a caller that sees _abandoned takes it and finds its answer)
            self._refuse(self._take_admitting())
        # read from this thread while the loop thread may still change it: a count for the log
        outstanding = len(self._futures) + sum(batch.pending for batch in list(self._batch_futures))
        if outstanding:
            logger.error(
                "SyncProducer: the event loop did not close within %.1f s; abandoning its "
                "thread with %d record(s) not yet terminal: they are lost",
                waited,
                outstanding,
                extra={"records": outstanding},
            )
        else:
            logger.warning(
                "SyncProducer: the event loop did not close within %.1f s; abandoning its "
                "thread (every admitted record was already terminal)",
                waited,
            )

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception:
            logger.exception("SyncProducer: error while closing at interpreter exit")

    def _forked(self) -> None:
        """In a forked child: the loop thread does not exist here, so nothing may wait on it."""
        self._open = False
        self._ended = True
        self._closed_reason = (
            " (it was created in the parent process, before a fork: create one in each process)"
        )
        self._closer = threading.current_thread()
        self._closed.set()
        self._lock = threading.Lock()  # it may have been held by a thread that is gone
        _live.pop(self, None)

    # -- thread-side helpers ---------------------------------------------------------------

    def _check_thread(self) -> None:
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(
                "SyncProducer methods block, so they cannot be called from the producer's own "
                "event-loop thread (a future's done callback runs there): it would deadlock"
            )

    def _closed_error(
        self, consequence: str = "nothing was enqueued"
    ) -> errors.ProducerClosedError:
        return errors.ProducerClosedError(
            f"the SyncProducer is {self._lifecycle()}{self._closed_reason}; {consequence}"
        )

    def _call_soon(self, callback: Callable[[], object]) -> bool:
        """Run ``callback`` in the loop thread soon, without waiting; False once the loop is
        gone."""
        schedule = self._schedule
        if schedule is None:  # pragma: no cover - set before the constructor returns
            return False
        try:
            schedule(callback)
        except RuntimeError:  # the loop has finished (trio's RunFinishedError too)
            return False
        return True

    # -- in the event-loop thread ---------------------------------------------------------

    async def _run(self, *, task_status: TaskStatus[None]) -> None:
        self._loop_thread = threading.get_ident()
        self._schedule = _thread_safe_scheduler()
        if not running_trio():
            import asyncio

            asyncio.get_running_loop().set_default_executor(_OwnThreads())
        self._close_requested = anyio.Event()
        try:
            async with self._producer as producer, anyio.create_task_group() as waiting:
                self._waiting = waiting
                try:
                    task_status.started()
                    await self._close_requested.wait()
                    # the records waiting for room or for their tenant's quota give up,
                    # the rest is flushed within the bound, what is left fails
                    await producer.aclose(timeout=self._close_bound)
                finally:
                    # before the group closes to new tasks (a record taken from now on is
                    # refused: the producer is closed, or failed)
                    self._waiting = None
        except Exception as exc:
            self._run_error = exc
            self._closed_reason = f" (the producer failed: {type(exc).__name__}: {exc})"
            raise
        finally:
            self._finish_run()

    def _request_close(self) -> None:
        assert self._close_requested is not None
        self._close_requested.set()

    def _admit_handed_over(self) -> None:
        """In the loop: take the records handed over, in order, and admit each (a callback, so
        one for every burst from the calling threads, and it never raises)."""
        with self._lock:
            taken = self._admitting
            self._admitting = {}
            self._take_scheduled = False
        for item in taken:
            self._admit_one(item)

    def _admit_one(self, item: _Admission) -> None:
        """Admit ``item`` now if it fits (``Producer.submit_nowait``), or start a task that
        waits for it; answer its caller."""
        try:
            if item.tenant is None and item.items is None:
                try:
                    pending = self._producer.submit_nowait(*item.args)
                except anyio.WouldBlock:
                    pass
                else:
                    self._hand_over(pending, item)
                    item.answer()
                    return
            waiting = self._waiting
            if waiting is None:
                raise _not_admitted()
            try:
                waiting.start_soon(self._admit_waiting, item)
            except RuntimeError:  # pragma: no cover - the group is closing: _waiting is None then
                raise _not_admitted() from None
        except BaseException as exc:  # a callback: the caller gets every error
            item.answer(exc)

    async def _admit_waiting(self, item: _Admission) -> None:
        """``Producer.submit`` one record, within its caller's deadline, or
        ``Producer.submit_many`` a batch: the producer's own waits; answer its caller."""
        producer = self._producer
        error: BaseException | None = None
        try:
            if item.items is not None:
                batch = await producer.submit_many(item.args[0], item.items, tenant=item.tenant)
                self._hand_over_batch(batch, item.future)
                return
            if item.deadline is None:
                pending = await producer.submit(*item.args, tenant=item.tenant)
            else:
                with anyio.fail_after(max(0.0, item.deadline - time.monotonic())):
                    pending = await producer.submit(*item.args, tenant=item.tenant)
        except TimeoutError as exc:
            error = (
                exc
                if isinstance(exc, errors.AnyKplError)
                else errors.BackpressureTimeout(
                    "the record was not admitted within the timeout (no room, or its tenant "
                    "over its quota); nothing was enqueued"
                )
            )
        except Exception as exc:
            error = exc
        except BaseException:
            error = _not_admitted()
            raise
        else:
            self._hand_over(pending, item)
        finally:
            item.answer(error)

    def _hand_over(self, handle: PendingRecord, item: _Admission) -> None:
        """The admitted record completes its caller's future when it is terminal."""
        pending = cast(Record, handle)  # the producer's handles are its records
        if pending.done():  # pragma: no cover - resolved within submit (a crash, say)
            _complete(pending, item.future)
        else:
            self._futures[pending] = item.future
            pending.on_done = self._record_done

    def _hand_over_batch(self, batch: PendingBatch, future: Future[BatchResult]) -> None:
        """The admitted batch completes its caller's future when its last record is terminal."""
        if batch.done():
            future.set_result(batch.result())
        else:
            self._batch_futures[batch] = future
            set_done_hook(batch, partial(self._batch_done, batch))

    def _batch_done(self, batch: PendingBatch) -> None:
        """The completion hook of a batch (runs where its last record is resolved)."""
        self._batch_futures.pop(batch).set_result(batch.result())

    def _record_done(self, pending: Record) -> None:
        """The completion hook of every admitted record (runs where the record is resolved)."""
        _complete(pending, self._futures.pop(pending))

    def _take_admitting(self) -> list[_Admission]:
        """Take every record the loop has not taken (under the lock)."""
        taken = list(self._admitting)
        self._admitting.clear()
        return taken

    @staticmethod
    def _refuse(taken: list[_Admission]) -> None:
        for item in taken:
            item.answer(_not_admitted())

    def _finish_run(self) -> None:
        """The Producer is closed, so every record is terminal: complete every future, and
        refuse the records the loop never took."""
        with self._lock:
            self._open = False
            taken = self._take_admitting()
        self._refuse(taken)
        try:
            # taken here, in the loop: the Producer's snapshots may need the loop's clock
            self._final_statistics = self._producer.statistics()
            self._final_metrics = self._producer.metrics()
        except Exception:  # pragma: no cover - statistics() then tries again in the caller
            logger.exception("SyncProducer: could not take the final statistics")
        # The Producer resolved every record as it closed, and each hook completed its future;
        # this is the safety net.
        batch_futures = self._batch_futures
        while batch_futures:  # pragma: no cover
            batch, batch_future = batch_futures.popitem()
            set_done_hook(batch, None)
            if batch.done():
                batch_future.set_result(batch.result())
            else:
                batch_future.set_exception(
                    errors.ProducerClosedError("the producer closed without resolving the batch")
                )
        futures = self._futures
        while futures:  # pragma: no cover
            pending, future = futures.popitem()
            pending.on_done = None
            if pending.done():
                _complete(pending, future)
            else:
                future.set_exception(
                    errors.ProducerClosedError("the producer closed without resolving the record")
                )
        self._ended = True
        # thread idents are reused once a thread ends: forget ours before it does (and after
        # the last future callback, which runs here)
        self._loop_thread = None


def _complete(pending: Record, future: Future[RecordResult]) -> None:
    try:
        result = pending.result()
    except errors.RecordFailedError as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _thread_safe_scheduler() -> Callable[[Callable[[], object]], object]:
    """The running loop's "call this soon, from any thread" (no task, no waiting).

    On asyncio the callbacks run in a context of the loop's in which sniffio (when installed)
    names asyncio: anyio finds its backend by the current task, and a callback has none."""
    if running_trio():
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio
    import contextvars

    context = contextvars.copy_context()
    try:
        import sniffio
    except ImportError:  # pragma: no cover - anyio then asks asyncio for the running loop
        pass
    else:
        context.run(sniffio.current_async_library_cvar.set, "asyncio")
    return partial(asyncio.get_running_loop().call_soon_threadsafe, context=context)
