"""SyncProducer over a fake Kinesis transport, on asyncio and trio underneath.

These tests are synchronous: the SyncProducer runs its own event loop in a portal thread, and
every test joins that thread (``close``) before it ends, so none leaks.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from anykpl import ProducerConfig, RecordResult, SyncProducer, _sync, errors
from anykpl._core._collector import Collector
from anykpl._core._limits import MAX_HASH_KEY as MAX_HASH
from anykpl.errors import PutTimeout
from anykpl.metrics import MetricsReport

from .fakes import FakeKinesis, LateMapKinesis

STREAM = "stream"
ROOT = Path(__file__).resolve().parents[1]

FAST: dict[str, Any] = {
    "record_max_buffered_time": 0.01,
    "retry_backoff_initial": 0.001,
    "retry_backoff_max": 0.01,
    "close_timeout": 2.0,
}


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def producer(backend: str, fake_kinesis: FakeKinesis) -> Iterator[SyncProducer]:
    with SyncProducer(transport=fake_kinesis, backend=backend, **FAST) as producer:
        yield producer


def portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "-portal-" in t.name]


def stored(fake: FakeKinesis) -> Counter[bytes]:
    return Counter(r.data for r in fake.user_records())


# -- putting ------------------------------------------------------------------------------------


def test_put_record_blocks_until_terminal(
    producer: SyncProducer, fake_kinesis: FakeKinesis
) -> None:
    result = producer.put_record(STREAM, b"hello", partition_key="k")
    assert isinstance(result, RecordResult)
    assert result.success
    assert result.shard_id is not None
    assert result.sequence_number is not None
    assert result.attempts[-1].success
    assert stored(fake_kinesis) == Counter({b"hello": 1})


def test_submit_returns_a_future_done_after_flush(
    producer: SyncProducer, fake_kinesis: FakeKinesis
) -> None:
    futures = [producer.submit(STREAM, b"%d" % i, partition_key=f"k{i}") for i in range(300)]
    assert all(isinstance(f, Future) for f in futures)
    producer.flush()
    assert all(f.done() for f in futures)
    assert all(f.result().success for f in futures)
    assert stored(fake_kinesis) == Counter(b"%d" % i for i in range(300))


def test_futures_complete_without_a_flush(producer: SyncProducer) -> None:
    futures = [producer.submit(STREAM, b"x", partition_key=f"k{i}") for i in range(50)]
    assert all(f.result(timeout=5).success for f in futures)


def test_many_threads_put_and_submit(producer: SyncProducer, fake_kinesis: FakeKinesis) -> None:
    threads, per_thread = 12, 150
    results: list[RecordResult] = []
    futures: list[Future[RecordResult]] = []
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                data = b"%d-%d" % (t, i)
                if i % 10 == 0:
                    results.append(producer.put_record(STREAM, data, partition_key=f"{t}-{i}"))
                else:
                    futures.append(producer.submit(STREAM, data, partition_key=f"{t}-{i}"))
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures
    producer.flush()
    assert len(results) + len(futures) == threads * per_thread
    assert all(r.success for r in results)
    assert all(f.result().success for f in futures)
    expected = Counter(b"%d-%d" % (t, i) for t in range(threads) for i in range(per_thread))
    assert stored(fake_kinesis) == expected


def test_a_failed_record_raises_from_put_record_and_from_the_future(
    producer: SyncProducer, fake_kinesis: FakeKinesis
) -> None:
    fake_kinesis.entry_error = lambda shard, index: ("KMSAccessDeniedException", "no key")
    with pytest.raises(errors.RecordFailedError) as raised:
        producer.put_record(STREAM, b"x", partition_key="k")
    assert raised.value.error_code == "KMSAccessDeniedException"
    future = producer.submit(STREAM, b"y", partition_key="k")
    producer.flush()
    exc = future.exception()
    assert isinstance(exc, errors.RecordFailedError)
    assert exc.result.attempts[-1].error_code == "KMSAccessDeniedException"


def test_bad_input_raises_at_the_call(producer: SyncProducer, fake_kinesis: FakeKinesis) -> None:
    with pytest.raises(errors.RecordTypeError):
        producer.submit(STREAM, "text", partition_key="k")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidRecordError):
        producer.put_record("bad stream name!", b"x", partition_key="k")
    with pytest.raises(errors.InvalidRecordError):
        producer.submit(STREAM, b"x", partition_key="")
    producer.flush()
    assert producer.statistics().outstanding_records == 0
    assert fake_kinesis.requests == []


def test_the_future_cannot_be_cancelled(producer: SyncProducer, fake_kinesis: FakeKinesis) -> None:
    fake_kinesis.delay = 0.1
    future = producer.submit(STREAM, b"x", partition_key="k")
    assert not future.cancel()
    assert future.result(timeout=5).success


def test_a_retrying_record_does_not_hold_back_later_futures(
    producer: SyncProducer, fake_kinesis: FakeKinesis
) -> None:
    first_shard = fake_kinesis.shards[0].shard_id

    def throttle_first_shard(shard: str, index: int) -> tuple[str, str] | None:
        return (errors.THROTTLED, "slow down") if shard == first_shard else None

    fake_kinesis.entry_error = throttle_first_shard
    slow = producer.submit(STREAM, b"slow", partition_key="k", explicit_hash_key=0)
    fast = [
        producer.submit(STREAM, b"%d" % i, partition_key="k", explicit_hash_key=MAX_HASH)
        for i in range(20)
    ]
    assert all(f.result(timeout=5).success for f in fast)
    assert not slow.done()
    fake_kinesis.entry_error = None
    assert slow.result(timeout=5).success


def test_a_retrying_record_does_not_slow_down_other_puts(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    # A future is completed where its record is resolved, not by polling: a put_record on one
    # shard takes as long while another shard's record is being retried as it does without.
    # (Polling every 50 ms held each put here for about 50 ms: 0.5 s for the ten.)
    first_shard = fake_kinesis.shards[0].shard_id
    options = {**FAST, "record_max_buffered_time": 0.001}
    with SyncProducer(transport=fake_kinesis, backend=backend, **options) as producer:
        producer.put_record(STREAM, b"warm-up", partition_key="k", explicit_hash_key=MAX_HASH)
        fake_kinesis.entry_error = lambda shard, index: (
            (errors.THROTTLED, "slow down") if shard == first_shard else None
        )
        slow = producer.submit(STREAM, b"slow", partition_key="k", explicit_hash_key=0)
        started = time.monotonic()
        for i in range(10):
            producer.put_record(STREAM, b"%d" % i, partition_key="k", explicit_hash_key=MAX_HASH)
        elapsed = time.monotonic() - started
        assert not slow.done()
        fake_kinesis.entry_error = None
        assert slow.result(timeout=5).success
    assert elapsed < 0.25, f"ten put_record calls took {elapsed:.3f} s"


# -- timeouts -----------------------------------------------------------------------------------


def test_put_record_timeout_leaves_the_record_in_flight(
    producer: SyncProducer, fake_kinesis: FakeKinesis
) -> None:
    fake_kinesis.delay = 0.3
    with pytest.raises(PutTimeout) as raised:
        producer.put_record(STREAM, b"late", partition_key="k", timeout=0.05)
    assert isinstance(raised.value, TimeoutError)
    assert isinstance(raised.value, errors.AnyKplError)
    assert not raised.value.retriable
    assert raised.value.future.result(timeout=5).success
    assert stored(fake_kinesis) == Counter({b"late": 1})


def test_admission_timeout_enqueues_nothing(backend: str, fake_kinesis: FakeKinesis) -> None:
    with SyncProducer(
        transport=fake_kinesis, backend=backend, max_outstanding_records=1, **FAST
    ) as producer:
        fake_kinesis.delay = 0.5
        first = producer.submit(STREAM, b"first", partition_key="k")
        started = time.monotonic()
        with pytest.raises(errors.BackpressureTimeout):
            producer.put_record(STREAM, b"second", partition_key="k", timeout=0.05)
        with pytest.raises(errors.BackpressureTimeout):
            producer.submit(STREAM, b"third", partition_key="k", timeout=0.05)
        assert time.monotonic() - started < 1.0
        assert first.result(timeout=5).success
        producer.flush()
    assert stored(fake_kinesis) == Counter({b"first": 1})


def test_flush_timeout(producer: SyncProducer, fake_kinesis: FakeKinesis) -> None:
    fake_kinesis.delay = 0.5
    future = producer.submit(STREAM, b"x", partition_key="k")
    with pytest.raises(errors.FlushTimeout):
        producer.flush(timeout=0.05)
    producer.flush()
    assert future.result().success


# -- closing ------------------------------------------------------------------------------------


def test_close_flushes_and_joins_the_thread(backend: str, fake_kinesis: FakeKinesis) -> None:
    before = set(portal_threads())
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    assert len(set(portal_threads()) - before) == 1
    futures = [producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(100)]
    producer.close()
    assert producer.closed
    assert set(portal_threads()) <= before
    assert all(f.result(timeout=0).success for f in futures)
    assert stored(fake_kinesis) == Counter(b"%d" % i for i in range(100))


def test_use_after_close(backend: str, fake_kinesis: FakeKinesis) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    producer.put_record(STREAM, b"x", partition_key="k")
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(errors.ProducerClosedError):
        producer.put_record(STREAM, b"x", partition_key="k")
    with pytest.raises(errors.ProducerClosedError):
        producer.submit(STREAM, b"x", partition_key="k")
    producer.flush()  # nothing outstanding: returns at once
    statistics = producer.statistics()
    assert statistics.outstanding_records == 0
    assert statistics.streams[STREAM].user_records_received == 1


def test_context_manager(backend: str, fake_kinesis: FakeKinesis) -> None:
    with SyncProducer(transport=fake_kinesis, backend=backend, **FAST) as producer:
        future = producer.submit(STREAM, b"x", partition_key="k")
        assert not producer.closed
    assert producer.closed
    assert future.result(timeout=0).success
    with pytest.raises(errors.ProducerClosedError):
        producer.submit(STREAM, b"x", partition_key="k")


def test_close_with_a_hanging_transport_is_bounded(backend: str, fake_kinesis: FakeKinesis) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    producer.put_record(STREAM, b"warm-up", partition_key="k")
    fake_kinesis.hang = True
    futures = [producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(20)]
    started = time.monotonic()
    producer.close(timeout=0.2)
    assert time.monotonic() - started < 2.0
    for future in futures:
        exc = future.exception(timeout=0)
        assert isinstance(exc, errors.RecordFailedError)
        assert exc.error_code == errors.PRODUCER_CLOSED


class HangingFinalReportSink:
    """A metrics sink whose last report never goes out (until cancelled)."""

    @asynccontextmanager
    async def _open(self) -> AsyncIterator[None]:
        yield

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]:
        return self._open()

    async def publish(self, report: MetricsReport) -> None:
        if report.final:
            await anyio.sleep_forever()


def test_close_timeout_bounds_the_producers_own_closing_steps(
    backend: str, fake_kinesis: FakeKinesis, caplog: pytest.LogCaptureFixture
) -> None:
    # close(timeout=0.2) hands what is left of its bound to the Producer's close, which bounds
    # the last metrics report by it: not by close_timeout (3 s here).
    producer = SyncProducer(
        transport=fake_kinesis,
        backend=backend,
        metrics_sinks=[HangingFinalReportSink()],
        **{**FAST, "close_timeout": 3.0, "metrics_upload_delay": 10.0},
    )
    futures = [producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(20)]
    producer.flush()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="anykpl.sync"):
        producer.close(timeout=0.2)
    assert time.monotonic() - started < 1.5
    assert all(f.result(timeout=0).success for f in futures)
    assert not [r for r in caplog.records if r.name == "anykpl.sync"]
    assert producer.config.close_timeout == 3.0  # the caller's configuration is unchanged


def _wedge_the_loop_with_a_callback(
    producer: SyncProducer, release: threading.Event
) -> Future[RecordResult]:
    """A future whose done callback blocks the event loop until ``release`` is set (the
    producer without adaptive batching, so that the record is not done before the callback is
    added: a callback added to a done future runs in the calling thread)."""
    wedged = threading.Event()

    def block(future: Future[RecordResult]) -> None:
        wedged.set()
        release.wait(10)

    future = producer.submit(STREAM, b"wedge", partition_key="k", explicit_hash_key=MAX_HASH)
    future.add_done_callback(block)
    assert wedged.wait(5)
    return future


def _clean_up_abandoned(producer: SyncProducer, release: threading.Event) -> None:
    """Unwedge the loop, let its close finish, and join the thread close() abandoned."""
    release.set()
    producer._run_future.exception(timeout=5)
    _sync._abandoned_portals.remove(producer._portal_cm)
    producer._portal_cm.__exit__(None, None, None)


def test_an_abandoned_close_says_what_is_lost_and_later_calls_fail_at_once(
    backend: str,
    fake_kinesis: FakeKinesis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_sync, "_CLOSE_GRACE", 0.2)
    first_shard = fake_kinesis.shards[0].shard_id
    fake_kinesis.entry_error = lambda shard, index: (
        (errors.THROTTLED, "slow down") if shard == first_shard else None
    )
    producer = SyncProducer(
        transport=fake_kinesis, backend=backend, adaptive_batching=False, **FAST
    )
    release = threading.Event()
    try:
        retrying = producer.submit(STREAM, b"retrying", partition_key="k", explicit_hash_key=0)
        _wedge_the_loop_with_a_callback(producer, release)
        queued: list[BaseException] = []

        def submit_while_wedged() -> None:
            try:
                producer.submit(STREAM, b"queued", partition_key="k")
            except BaseException as exc:
                queued.append(exc)

        submitter = threading.Thread(target=submit_while_wedged)
        submitter.start()
        with caplog.at_level(logging.WARNING, logger="anykpl.sync"):
            started = time.monotonic()
            producer.close(timeout=0.1)
            assert time.monotonic() - started < 2.0
        submitter.join(5)
        # the admission that never ran is refused, not left hanging
        assert len(queued) == 1
        assert isinstance(queued[0], errors.ProducerClosedError)
        [record] = [r for r in caplog.records if r.name == "anykpl.sync"]
        assert record.levelno == logging.ERROR
        assert "1 record(s) not yet terminal: they are lost" in record.getMessage()
        assert producer.closed
        assert not retrying.done()
        started = time.monotonic()
        calls: list[Any] = [
            producer.flush,
            producer.statistics,
            producer.metrics,
            lambda: producer.submit(STREAM, b"x", partition_key="k"),
            lambda: producer.put_record(STREAM, b"x", partition_key="k"),
        ]
        for call in calls:
            with pytest.raises(errors.ProducerClosedError, match="abandoned"):
                call()
        producer.close()  # returns at once too
        assert time.monotonic() - started < 0.5
    finally:
        _clean_up_abandoned(producer, release)
    # once the loop recovered, its close failed what was left
    exc = retrying.exception(timeout=0)
    assert isinstance(exc, errors.RecordFailedError)
    assert exc.error_code == errors.PRODUCER_CLOSED
    assert stored(fake_kinesis) == Counter({b"wedge": 1})  # "queued" was never admitted


def test_an_abandoned_close_with_nothing_outstanding_only_warns(
    backend: str,
    fake_kinesis: FakeKinesis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_sync, "_CLOSE_GRACE", 0.2)
    producer = SyncProducer(
        transport=fake_kinesis, backend=backend, adaptive_batching=False, **FAST
    )
    release = threading.Event()
    try:
        future = _wedge_the_loop_with_a_callback(producer, release)
        with caplog.at_level(logging.WARNING, logger="anykpl.sync"):
            producer.close(timeout=0.1)
        [record] = [r for r in caplog.records if r.name == "anykpl.sync"]
        assert record.levelno == logging.WARNING
        assert "every admitted record was already terminal" in record.getMessage()
        assert "lost" not in record.getMessage()
        assert future.result(timeout=0).success
    finally:
        _clean_up_abandoned(producer, release)


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_an_abandoned_close_frees_a_thread_whose_record_the_loop_held(
    backend: str, fake_kinesis: FakeKinesis, monkeypatch: pytest.MonkeyPatch, timeout: float | None
) -> None:
    # The loop took the second record (it waits there for room), then wedged: the thread
    # waiting for its answer is told once close() abandons the loop, not when the loop recovers.
    monkeypatch.setattr(_sync, "_CLOSE_GRACE", 0.2)
    monkeypatch.setattr(_sync, "_ABANDON_CHECK", 0.05)
    producer = SyncProducer(
        transport=fake_kinesis,
        backend=backend,
        adaptive_batching=False,
        max_outstanding_records=1,
        **FAST,
    )
    fake_kinesis.delay = 0.3
    release = threading.Event()
    wedged = threading.Event()

    def block(future: Future[RecordResult]) -> None:
        wedged.set()
        release.wait(10)

    try:
        producer.submit(STREAM, b"wedge", partition_key="k").add_done_callback(block)
        outcome: list[BaseException] = []

        def second() -> None:
            try:
                producer.submit(STREAM, b"second", partition_key="k", timeout=timeout)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        assert wedged.wait(5)
        started = time.monotonic()
        producer.close(timeout=0.1)
        thread.join(2)
        assert not thread.is_alive()
        assert time.monotonic() - started < 1.5
        (error,) = outcome
        assert isinstance(error, errors.ProducerClosedError), error
        assert "abandoned" in str(error)
    finally:
        _clean_up_abandoned(producer, release)


def test_timeout_zero_admits_a_record_that_fits_now_and_refuses_one_that_does_not(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    with SyncProducer(
        transport=fake_kinesis, backend=backend, max_outstanding_records=1, **FAST
    ) as producer:
        fake_kinesis.delay = 0.5
        first = producer.submit(STREAM, b"first", partition_key="k", timeout=0)
        started = time.monotonic()
        with pytest.raises(errors.BackpressureTimeout, match="nothing was enqueued"):
            producer.submit(STREAM, b"second", partition_key="k", timeout=0)
        assert time.monotonic() - started < 0.3
        assert first.result(timeout=5).success
    assert stored(fake_kinesis) == Counter({b"first": 1})


def test_the_loops_own_executor_refuses_work_after_shutdown_and_joins_its_threads() -> None:
    executor = _sync._OwnThreads()
    assert executor.submit(pow, 2, 10).result(timeout=5) == 1024
    executor.shutdown(wait=True)
    assert not any(worker.is_alive() for worker in executor._workers)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(pow, 2, 10)
    executor.shutdown()  # again: nothing happens


def test_close_from_several_threads(backend: str, fake_kinesis: FakeKinesis) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    futures = [producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(50)]
    closers = [threading.Thread(target=producer.close) for _ in range(4)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()
    assert all(f.result(timeout=0).success for f in futures)
    assert not any(t.is_alive() for t in portal_threads() if t.name.endswith(f"{id(producer)}"))


def test_a_crashing_stage_fails_records_and_close_raises(
    backend: str, fake_kinesis: FakeKinesis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_put(self: Collector, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Collector, "put", broken_put)
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    with pytest.raises(errors.RecordFailedError) as raised:
        producer.put_record(STREAM, b"x", partition_key="k")
    assert raised.value.error_code == errors.PIPELINE_FAILED
    deadline = time.monotonic() + 5
    while not producer.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(errors.ProducerClosedError, match="RuntimeError"):
        producer.submit(STREAM, b"y", partition_key="k")
    with pytest.raises(RuntimeError, match="boom"):
        producer.close()
    producer.close()  # raised once


# -- configuration and threads -----------------------------------------------------------------


def test_configuration(fake_kinesis: FakeKinesis) -> None:
    before = set(portal_threads())
    with pytest.raises(errors.ConfigError):
        SyncProducer(transport=fake_kinesis, close_timeout=-1.0)
    assert set(portal_threads()) <= before  # no thread started for a bad configuration
    config = ProducerConfig(record_ttl=5.0)
    with SyncProducer(config, transport=fake_kinesis, record_ttl=7.0) as producer:
        assert producer.config.record_ttl == 7.0
        assert producer.backend == "asyncio"
        assert "SyncProducer open" in repr(producer)


def test_calling_from_the_loop_thread_raises(backend: str, fake_kinesis: FakeKinesis) -> None:
    seen: list[BaseException] = []
    # the KPL's batching: the record waits for its deadline, so the callback is added before
    # the future is done and runs in the loop's thread (with adaptive batching the record may
    # be done before add_done_callback, which then calls it in this thread)
    with SyncProducer(
        transport=fake_kinesis, backend=backend, adaptive_batching=False, **FAST
    ) as producer:

        def callback(future: Future[RecordResult]) -> None:
            try:
                producer.put_record(STREAM, b"nested", partition_key="k")
            except BaseException as exc:
                seen.append(exc)

        future = producer.submit(STREAM, b"x", partition_key="k")
        future.add_done_callback(callback)
        producer.flush()
    assert len(seen) == 1
    assert isinstance(seen[0], RuntimeError)
    assert "deadlock" in str(seen[0])
    assert stored(fake_kinesis) == Counter({b"x": 1})


def test_statistics(producer: SyncProducer) -> None:
    producer.put_record(STREAM, b"x", partition_key="k")
    statistics = producer.statistics()
    assert statistics.outstanding_records == 0
    assert statistics.streams[STREAM].user_records_received == 1


def test_metrics(backend: str, fake_kinesis: FakeKinesis) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    try:
        for i in range(3):
            producer.put_record(STREAM, b"x", partition_key=f"k{i}")
        values = producer.metrics()
        assert {"UserRecordsPut", "UserRecordsReceived"} <= {v.name for v in values}
        [put] = [v for v in producer.metrics("UserRecordsPut") if v.stream is None]
        assert put.sum == 3
        assert all(v.name == "UserRecordsPut" for v in producer.metrics("UserRecordsPut", 60))
        with pytest.raises(ValueError, match="window"):
            producer.metrics(window=0)
    finally:
        producer.close()
    # after close: the cumulative metrics taken as the producer closed
    [put] = [v for v in producer.metrics("UserRecordsPut") if v.stream is None]
    assert put.sum == 3
    assert {v.name for v in producer.metrics()} >= {"UserRecordsPut", "UserRecordsReceived"}
    with pytest.raises(errors.ProducerClosedError, match="window=None"):
        producer.metrics(window=10)


def test_a_forked_child_cannot_use_the_parents_producer(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    try:
        producer._forked()  # what os.register_at_fork runs in a child
        with pytest.raises(errors.ProducerClosedError, match="fork"):
            producer.submit(STREAM, b"x", partition_key="k")
        producer.close()  # returns at once: there is nothing to close in a child
    finally:
        producer._shut_down()  # this is the parent really: stop the loop and join its thread


# -- interpreter exit ---------------------------------------------------------------------------


def test_the_atexit_hook_closes(backend: str, fake_kinesis: FakeKinesis) -> None:
    producer = SyncProducer(transport=fake_kinesis, backend=backend, **FAST)
    future = producer.submit(STREAM, b"x", partition_key="k")
    producer._close_at_exit()
    assert producer.closed
    assert future.result(timeout=0).success


@pytest.mark.parametrize("backend_name", ["asyncio", "trio"])
def test_an_unclosed_producer_is_flushed_at_interpreter_exit(backend_name: str) -> None:
    # The fake resolves a host name before each PutRecords, as a new connection does: on
    # asyncio through the loop's default executor, which Python shuts down before running
    # atexit hooks (the producer's exit hook must run before that).
    script = textwrap.dedent(
        f"""
        import atexit
        import anyio
        from tests.fakes import FakeKinesis
        from anykpl._sync import SyncProducer

        class ResolvingKinesis(FakeKinesis):
            async def put_records(self, stream, records):
                await anyio.getaddrinfo("localhost", 443)
                return await super().put_records(stream, records)

        fake = ResolvingKinesis()
        atexit.register(lambda: print("stored", len(fake.user_records()), flush=True))
        producer = SyncProducer(
            transport=fake, backend={backend_name!r}, record_max_buffered_time=5.0
        )
        for i in range(100):
            producer.submit("stream", b"%d" % i, partition_key=str(i))
        print("leaving", flush=True)
        """
    )
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["leaving", "stored", "100"]
    assert completed.stderr == ""
    assert time.monotonic() - started < 15


def test_close_makes_a_tenant_quota_waiter_give_up_at_once_and_still_flushes(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    from anykpl import TenantQuota

    producer = SyncProducer(
        transport=fake_kinesis,
        backend=backend,
        record_max_buffered_time=10.0,  # only the close's flush sends the plain record
        tenant_quotas={"slow": TenantQuota(records_per_second=0.01)},
        close_timeout=5.0,
    )
    first = producer.submit("stream", b"first", partition_key="k", tenant="slow")  # the burst
    plain = producer.submit("stream", b"plain", partition_key="k")
    outcome: list[str] = []

    def blocked() -> None:
        try:
            producer.submit("stream", b"second", partition_key="k", tenant="slow")
            outcome.append("admitted")
        except errors.AnyKplError as exc:
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=blocked)
    thread.start()
    deadline = time.monotonic() + 5
    while producer.statistics().tenants["slow"].waiting == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    started = time.monotonic()
    producer.close()
    thread.join()
    assert time.monotonic() - started < 2.0  # not the whole close_timeout
    assert outcome == ["ProducerClosedError"]
    # the rest was flushed, not failed
    assert first.result(timeout=0).success
    assert plain.result(timeout=0).success


def test_close_makes_a_thread_waiting_for_room_give_up_at_once_as_the_async_producer_does(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    # The SyncProducer admits through the Producer, so its close ends the waits for room as
    # Producer.aclose does: the waiting record is refused (nothing enqueued), the admitted one
    # is flushed.
    producer = SyncProducer(
        transport=fake_kinesis,
        backend=backend,
        max_outstanding_records=1,
        close_timeout=5.0,
    )
    fake_kinesis.delay = 0.5  # the first record is in flight while the second waits
    first = producer.submit(STREAM, b"first", partition_key="k")
    outcome: list[str] = []

    def blocked() -> None:
        try:
            producer.submit(STREAM, b"second", partition_key="k")
            outcome.append("admitted")
        except errors.AnyKplError as exc:
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.1)
    assert outcome == []  # it waits for room at the call
    started = time.monotonic()
    producer.close()
    thread.join()
    assert time.monotonic() - started < 2.0
    assert outcome == ["ProducerClosedError"]
    assert first.result(timeout=0).success
    assert stored(fake_kinesis) == Counter({b"first": 1})


def test_a_batch_cut_short_by_close_hands_back_what_it_admitted(
    backend: str, fake_kinesis: FakeKinesis
) -> None:
    # close() begins while submit_many waits for room for its second record: the first is
    # admitted (and flushed by the close), and the error says so, with its handle
    producer = SyncProducer(
        transport=fake_kinesis, backend=backend, max_outstanding_records=1, close_timeout=5.0
    )
    fake_kinesis.delay = 0.5
    caught: list[errors.ProducerClosedError] = []

    def batch() -> None:
        with pytest.raises(errors.ProducerClosedError) as error:
            producer.submit_many(STREAM, [(b"a", "k"), (b"b", "k"), (b"c", "k")])
        caught.append(error.value)

    thread = threading.Thread(target=batch)
    thread.start()
    time.sleep(0.1)
    assert caught == []  # it waits for room for b"b"
    producer.close()
    thread.join()
    (error,) = caught
    assert "1 of the batch's 3 records were admitted" in str(error), error
    assert [handle.data for handle in error.admitted] == [b"a"]
    assert error.admitted[0].result().success
    assert stored(fake_kinesis) == Counter({b"a": 1})


@pytest.mark.parametrize("tenant", [None, "t1"])
def test_a_thread_waiting_on_a_hot_shard_holds_up_no_other_thread(
    backend: str, fake_kinesis: FakeKinesis, tenant: str | None
) -> None:
    # One admitter serves every thread: while it waited for a hot shard's room (in submit),
    # every other thread's record waited behind it. Now a record that must wait does so in a
    # task of its own, and the other threads' records go on (with tenants too).
    from anykpl import TenantQuota

    hot_shard = fake_kinesis.shards[0].shard_id
    fake_kinesis.entry_error = lambda shard, index: (
        (errors.THROTTLED, "slow down") if shard == hot_shard else None
    )
    quotas = {"t1": TenantQuota(records_per_second=1e6)} if tenant else {}
    with SyncProducer(
        transport=fake_kinesis,
        backend=backend,
        max_outstanding_records=8,
        record_ttl=60.0,
        tenant_quotas=quotas,
        **FAST,
    ) as producer:
        # the shard map is ready from here on (records admitted before go by the stream's rule)
        producer.put_record(STREAM, b"warm-up", partition_key="w", explicit_hash_key=MAX_HASH)
        hot: list[Future[RecordResult]] = []

        def put_hot() -> None:
            for i in range(
                10
            ):  # the shard may hold 7 (the 8th record is the reserve): the 8th waits
                hot.append(
                    producer.submit(
                        STREAM, b"hot%d" % i, partition_key="h", explicit_hash_key=0, tenant=tenant
                    )
                )

        thread = threading.Thread(target=put_hot)
        thread.start()
        deadline = time.monotonic() + 5
        while len(hot) < 7:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.05)
        assert len(hot) == 7  # the hot thread waits at the call
        started = time.monotonic()
        for i in range(3):
            result = producer.put_record(
                STREAM, b"cold%d" % i, partition_key="c", explicit_hash_key=MAX_HASH, timeout=5
            )
            assert result.success
        assert time.monotonic() - started < 1.0
        assert len(hot) == 7
        stats = producer.statistics().streams[STREAM].shards
        assert stats[hot_shard].admission_waits >= 1
        assert stats[hot_shard].outstanding_records == 7
        fake_kinesis.entry_error = None  # the hot shard recovers: its thread goes on
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert all(future.result(timeout=5).success for future in hot)


# -- submit_many and an abandoned loop ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_abandoned_loop_counts_a_pending_batch_as_lost(
    backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_sync, "_CLOSE_GRACE", 0.2)
    fake = FakeKinesis()
    first = fake.shards[0].shard_id
    fake.entry_error = lambda shard, index: (errors.THROTTLED, "slow") if shard == first else None
    producer = SyncProducer(transport=fake, backend=backend, adaptive_batching=False, **FAST)
    release = threading.Event()
    try:
        batch = producer.submit_many(STREAM, [(b"retrying", "k", 0)])  # retried on and on
        _wedge_the_loop_with_a_callback(producer, release)
        with caplog.at_level(logging.WARNING, logger="anykpl.sync"):
            producer.close(timeout=0.1)
        [record] = [r for r in caplog.records if r.name == "anykpl.sync"]
        assert not batch.done()
        assert "1 record(s) not yet terminal: they are lost" in record.getMessage()
    finally:
        _clean_up_abandoned(producer, release)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_batch_waiting_for_a_wedged_loop_is_refused_when_it_is_abandoned(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sync, "_CLOSE_GRACE", 0.2)
    producer = SyncProducer(
        transport=FakeKinesis(), backend=backend, adaptive_batching=False, **FAST
    )
    release = threading.Event()
    outcome: list[object] = []
    try:
        _wedge_the_loop_with_a_callback(producer, release)

        def call() -> None:
            try:
                outcome.append(producer.submit_many(STREAM, [(b"x", "k")]))
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        time.sleep(0.05)
        producer.close(timeout=0.1)
        caller.join(2)
        assert not caller.is_alive()
        [refused] = outcome
        assert isinstance(refused, errors.ProducerClosedError)
    finally:
        _clean_up_abandoned(producer, release)


def test_a_first_batch_handed_over_before_close_is_admitted(backend: str) -> None:
    """A stream's first submit_many waits in the loop for the stream's shard map; a close that
    comes meanwhile admits it first and delivers it, promptly."""
    fake = LateMapKinesis(0.3)
    producer = SyncProducer(transport=fake, backend=backend, **FAST)
    future = producer.submit_many(STREAM, [(b"x%d" % i, "k") for i in range(10)])
    started = time.monotonic()
    producer.close()
    assert time.monotonic() - started < 2.0
    assert future.result(timeout=5).succeeded == 10
    assert stored(fake) == Counter(b"x%d" % i for i in range(10))
