"""A record's completion hook, and what makes it safe to keep records out of the garbage
collector in the compiled build (the rest of the record is tested through the producer in
test_producer.py)."""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

import anyio
import pytest

from anykpl import PendingRecord, errors
from anykpl._core import _records as records_module
from anykpl._core._records import AttemptRecord, Record
from anykpl._runtime import _awaiting


def make_record() -> Record:
    return Record("stream", "key", b"data", 1, None, 0.0, 0.0, 0.0)


def hook_of(record: Record) -> object:
    return record.on_done


@pytest.mark.parametrize("success", [True, False])
def test_the_hook_is_called_once_with_the_terminal_record(success: bool) -> None:
    record = make_record()
    record.add_attempt(AttemptRecord(0.0, 0.1, success, None if success else "Code", "msg"))
    seen: list[tuple[Record, bool]] = []
    record.on_done = lambda r: seen.append((r, r.done()))
    record.resolve(success)
    assert seen == [(record, True)]
    assert hook_of(record) is None  # cleared: it holds nothing once it has run
    record.resolve(success)  # resolved again (the producer never does): no second call
    assert len(seen) == 1
    if success:
        assert record.result().success
    else:
        with pytest.raises(errors.RecordFailedError):
            record.result()


def test_a_record_without_a_hook_resolves() -> None:
    record = make_record()
    record.resolve(True)
    assert record.done()


def test_a_failing_hook_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    # the hook runs inside the stage that resolves a whole batch: it must not stop the batch
    def broken(record: Record) -> None:
        raise RuntimeError("hook broke")

    records = [make_record() for _ in range(3)]
    for record in records:
        record.on_done = broken
    with caplog.at_level(logging.ERROR, logger="anykpl.records"):
        for record in records:
            record.resolve(True)
    assert all(record.done() for record in records)
    assert len(caplog.records) == 3
    assert "completion hook" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is not None


def test_records_are_out_of_the_garbage_collector_exactly_when_compiled() -> None:
    # @mypyc_attr(acyclic=True): the compiled build leaves records and attempts untracked (no
    # GC header, no traverse); a class of the pure package is tracked, and the intake makes the
    # records it builds untracked after the fact (untrack_record, on CPython; the producer's
    # records are checked in tests/integration/test_end_to_end.py)
    compiled = not records_module.__file__.endswith(".py")
    assert gc.is_tracked(make_record()) is not compiled
    assert gc.is_tracked(AttemptRecord(0.0, 0.1, True, None, None)) is not compiled
    cpython = sys.implementation.name == "cpython"
    assert (records_module.untrack_record is not None) is (cpython and not compiled)
    untrack = records_module.untrack_record
    if untrack is not None:
        record = make_record()
        untrack(id(record))
        assert not gc.is_tracked(record)
        untrack(id(record))  # once more: nothing happens
        assert not gc.is_tracked(record)


@pytest.mark.anyio
@pytest.mark.parametrize("success", [True, False])
async def test_a_terminal_record_holds_nothing_that_leads_back_to_it(success: bool) -> None:
    # What the untracked (compiled) record relies on: the slots that may lead to objects that
    # refer back to it (the waiters' event, the completion hook, the spool segment) are empty
    # once it is terminal, so no reference cycle runs through a finished record.
    record = make_record()
    outcomes: list[object] = []

    async def waiter() -> None:
        try:
            outcomes.append(await record)
        except errors.RecordFailedError as exc:
            outcomes.append(exc.result.success)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert record._event is not None  # two waiters share one event
        record.on_done = lambda r: outcomes.append("hook")
        record.add_attempt(AttemptRecord(0.0, 0.1, success, None if success else "Code", "m"))
        record.resolve(success)
        assert record._event is None
        assert record.on_done is None
        assert record.spool_segment is None
    assert len(outcomes) == 3
    assert outcomes[0] == "hook"
    if success:
        assert all(o == record.result() for o in outcomes[1:])
    else:
        assert outcomes[1:] == [False, False]
    # nothing but this frame (and getrefcount's argument) refers to the record any more
    assert sys.getrefcount(record) == 2


def resolved_record() -> Record:
    record = make_record()
    record.add_attempt(AttemptRecord(0.0, 0.1, True, None, ""))
    record.resolve(True)
    return record


def test_records_are_awaited_in_one_frame_exactly_when_interpreted() -> None:
    # the pure build's records take _awaiting.interpreted_await; the compiled build's keep
    # their own (Record.__await__, _ready)
    compiled = not records_module.__file__.endswith(".py")
    assert (Record.__await__ is _awaiting.interpreted_await) is not compiled


@pytest.mark.anyio
@pytest.mark.parametrize("shape", ["first attempt", "retried", "failed", "never tried"])
async def test_awaiting_a_done_record_gives_its_result(shape: str) -> None:
    # what ``await record`` gives for a record that is already done, in each shape its
    # result has: the same as ``result()``, delays measured from its arrival
    record = Record("stream", "key", b"data", 1, None, 10.0, 10.1, 40.0)
    if shape == "retried":
        record.add_attempt(AttemptRecord(10.2, 10.5, False, "ProvisionedThroughputExceeded", "m"))
    if shape != "never tried":
        record.add_attempt(AttemptRecord(10.7, 11.0, shape != "failed", None, None))
    record.shard_id, record.sequence_number, record.sub_sequence_number = "shardId-0", "49", 3
    record.resolve(shape not in ("failed", "never tried"))
    if shape in ("failed", "never tried"):
        with pytest.raises(errors.RecordFailedError) as raised:
            await record
        assert raised.value.result == record.build_result()
        return
    result = await record
    assert result == record.result()
    assert type(result) is type(record.result())
    assert (result.success, result.shard_id, result.sequence_number) == (True, "shardId-0", "49")
    assert result.sub_sequence_number == 3
    assert type(result.attempts[-1]) is type(record.result().attempts[-1])
    assert result.attempts[-1].delay == pytest.approx(0.2 if shape == "retried" else 0.7)
    assert result.attempts[-1].duration == pytest.approx(0.3)
    assert len(result.attempts) == (2 if shape == "retried" else 1)


@pytest.mark.anyio
async def test_a_cancelled_loop_over_done_records_ends(anyio_backend_name: str) -> None:
    # awaiting a done record checks for cancellation under trio (as trio's cheap operations
    # do) and not at all under asyncio (as a done future); the full checkpoint that one await
    # in RESOLVED_YIELD_EVERY makes delivers it there
    record = resolved_record()
    awaited = 0
    with anyio.CancelScope() as scope:
        scope.cancel()
        while awaited <= records_module.RESOLVED_YIELD_EVERY:
            await record
            awaited += 1
    assert scope.cancelled_caught
    if anyio_backend_name == "trio":
        assert awaited == 0
    else:
        assert awaited < records_module.RESOLVED_YIELD_EVERY
    assert (await record).success  # outside the cancelled scope it returns at once


@pytest.mark.anyio
@pytest.mark.autojump  # trio only
@pytest.mark.parametrize("layout", ["known", "unknown"])
async def test_under_trio_a_done_record_checks_for_cancellation(layout: str) -> None:
    # the check reads the task's cancel status where trio's layout is the one known here
    # (the trio installed must be such a one), and asks trio's public function otherwise
    import trio

    _awaiting.find_trio(records_module._trio)
    assert records_module._trio[2] is True
    known = list(records_module._trio)
    assert _awaiting._run_context is known[3]
    if layout == "unknown":  # in place, as find_trio fills it (the awaits hold the list)
        records_module._trio[:] = [_awaiting.public_trio_task(trio), trio, False, None]
        _awaiting._run_context = None
    try:
        record = resolved_record()
        with anyio.CancelScope() as scope:
            assert (await record).success  # not cancelled: returns the result
            scope.cancel()
            await record
            pytest.fail("a cancelled await of a done record returned")
        assert scope.cancelled_caught
    finally:
        records_module._trio[:] = known
        _awaiting._run_context = known[3]


@pytest.mark.anyio
async def test_a_cancelled_wait_for_a_pending_record_or_batch_warns_of_nothing() -> None:
    # with warnings as errors (pytest's filterwarnings here): the compiled build's coroutines
    # passed a cancellation on with throw()'s three-argument form, deprecated since Python
    # 3.12, so these coroutines are interpreted ones (anykpl._runtime._awaiting)
    record = make_record()
    counter = records_module.BatchCounter()
    counter.remaining = 1
    for wait in (lambda: record, record.wait, record.wait_done, counter.wait):
        with anyio.move_on_after(0.01) as scope:
            await wait()
        assert scope.cancelled_caught
    assert not record.done()
    record.add_attempt(AttemptRecord(0.0, 0.1, True, None, ""))
    record.resolve(True)
    assert (await record).success
    counter.record_done(True)
    await counter.wait()


@pytest.mark.anyio
async def test_wait_is_a_coroutine_for_the_tools_that_need_one() -> None:
    # pending.wait() is a coroutine, as an async method's call is: a task group starts it
    record = make_record()
    results: list[object] = []

    async def keep(wait: Any) -> None:
        results.append(await wait)

    async with anyio.create_task_group() as tg:
        tg.start_soon(record.wait)
        tg.start_soon(keep, record.wait())
        await anyio.sleep(0.01)
        record.add_attempt(AttemptRecord(0.0, 0.1, True, None, ""))
        record.resolve(True)
    assert len(results) == 1
    assert getattr(results[0], "success", None) is True


@pytest.mark.anyio
async def test_a_loop_over_done_records_lets_other_tasks_run() -> None:
    # a done record's await checks for cancellation only, but one in RESOLVED_YIELD_EVERY
    # yields, so a long loop over done handles cannot starve the other tasks
    records = [resolved_record() for _ in range(10 * records_module.RESOLVED_YIELD_EVERY)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        before = ticks
        for record in records:
            await record
        ran = ticks - before
        tg.cancel_scope.cancel()
    assert 5 <= ran <= 15, ran


def test_without_trio_a_done_records_await_still_yields_and_ends_when_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that has not imported trio (this one has): the pure build's await of a done
    record asks nothing on asyncio, but one await in RESOLVED_YIELD_EVERY still makes the
    full checkpoint that lets other tasks run and delivers a cancellation."""
    monkeypatch.setattr(_awaiting, "_modules", {})
    asked: list[object] = []
    resolved_checkpoint = _awaiting.resolved_checkpoint

    def counted() -> object:
        asked.append(None)
        return resolved_checkpoint()

    monkeypatch.setattr(_awaiting, "resolved_checkpoint", counted)

    async def main() -> None:
        await test_a_loop_over_done_records_lets_other_tasks_run()
        await test_a_cancelled_loop_over_done_records_ends("asyncio")

    anyio.run(main, backend="asyncio")
    if vars(Record)["__await__"] is _awaiting.interpreted_await:  # the pure build's await
        assert 10 <= len(asked) <= 12, len(asked)


def test_a_batch_hook_runs_once_where_its_last_record_resolves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = records_module.BatchCounter()
    counter.remaining = 2
    calls: list[int] = []
    counter.on_done = lambda: calls.append(counter.failed)
    counter.record_done(False)
    assert calls == []
    counter.record_done(True)
    assert calls == [1]
    assert counter.on_done is None

    failing = records_module.BatchCounter()
    failing.remaining = 1

    def boom() -> None:
        raise ValueError("boom")

    failing.on_done = boom
    with caplog.at_level(logging.ERROR, logger="anykpl"):
        failing.record_done(True)  # logged, not raised: the stage resolving it goes on
    assert "completion hook of a batch failed" in caplog.text


def test_the_producers_record_is_what_a_caller_reads_as_a_pending_record() -> None:
    # PendingRecord is a protocol, checked at run time too (on the compiled build as well: it
    # lives outside the compiled core, where mypyc would make it a plain class)
    record = make_record()
    assert isinstance(record, PendingRecord)
    assert not isinstance(object(), PendingRecord)
    assert (record.stream, record.partition_key, record.data) == ("stream", "key", b"data")


def test_trios_current_task_is_the_calling_threads_and_none_outside_trio() -> None:
    # what a done record's await asks on every await once trio is imported, also under
    # asyncio: the thread's trio task, read without raising (an AttributeError per await
    # outside trio cost 0.5 µs)
    import threading

    import trio

    slot: list[Any] = [None, None, False, None]
    current_task = _awaiting.find_trio(slot)
    assert slot[0] is current_task
    assert current_task() is None  # this thread runs no trio
    seen: list[object] = []

    async def main() -> None:
        seen.append(current_task() is trio.lowlevel.current_task())
        other = threading.Thread(target=lambda: seen.append(current_task()))
        other.start()
        other.join()

    trio.run(main)
    assert seen == [True, None]  # inside trio its task; another thread meanwhile none
    assert current_task() is None
