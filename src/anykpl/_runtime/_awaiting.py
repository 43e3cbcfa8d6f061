"""Waiting for records and batches: the coroutines behind ``await pending``,
``pending.wait()`` and a batch's wait, and what an await of a result that is already there
does.

Kept out of the compiled build on purpose: a coroutine compiled by mypyc passes a
cancellation on to what it awaits with ``throw(type, value, traceback)``, which Python 3.12
and later deprecate (mypyc/mypyc#1214); a cancelled ``await pending`` would then warn, and fail
a test run that turns warnings into errors. What never suspends stays compiled: an ``await``
of a record that is already done, with no checkpoint due, runs no coroutine at all
(``_records._ready``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Awaitable, Callable, Generator
from types import FunctionType
from typing import TYPE_CHECKING, Any

import anyio

from .._core import _records
from .._core._records import (
    PENDING,
    RESOLVED_YIELD_EVERY,
    SUCCEEDED,
    _modules,
    _resolved_awaits,
    _trio,
    resolved_checkpoint,
)
from .._core._results import Attempt, RecordResult

if TYPE_CHECKING:
    from .._core._records import BatchCounter, Record

__all__ = (
    "batch_done",
    "checkpoint",
    "find_trio",
    "new_event",
    "checkpoint_or_nothing",
    "record_done",
    "record_result",
    "record_wait",
    "result_after",
)


def interpreted_await(record: Record) -> Generator[Any, None, RecordResult]:
    """``Record.__await__`` where the core runs interpreted (the pure build; installed by
    :func:`use_interpreted_await`): the same steps as ``Record.__await__`` and ``_ready``, in
    one generator rather than a method that makes one (440 of 45,250 instructions per record
    of that build's idiomatic loop, ``hot_path.py --await-each --keys 10000`` under
    callgrind). The compiled build keeps its own: a call there costs little, and a generator
    compiled by mypyc is what ``_ready`` avoids."""
    if record._state == PENDING:
        return (yield from record_result(record).__await__())
    # resolved_checkpoint's common answers without its call: where no full checkpoint is due,
    # nothing to await outside trio, and in a trio task (its run context known) a checkpoint
    # only if the task is cancelled
    count = _resolved_awaits[0] + 1
    if count < RESOLVED_YIELD_EVERY and "trio" not in _modules:
        _resolved_awaits[0] = count
    elif count < RESOLVED_YIELD_EVERY and _run_context is not None:
        _resolved_awaits[0] = count
        task = _run_context.__dict__.get("task")
        if task is not None and task._cancel_status.effectively_cancelled:
            return (yield from result_after(_trio[1].lowlevel.checkpoint(), record).__await__())
    else:
        checkpoint = resolved_checkpoint()
        if checkpoint is not None:
            return (yield from result_after(checkpoint, record).__await__())
    if record._state == SUCCEEDED:
        # Record.build_result's common case, inline (a call less per record: 760 instructions
        # of 39,000, callgrind)
        a = record.last_attempt
        if a is not None and not record._earlier_attempts:
            delay = a.start - record.arrival
            duration = a.end - a.start
            return _new_tuple(
                RecordResult,
                (
                    True,
                    record.shard_id,
                    record.sequence_number,
                    record.sub_sequence_number,
                    (
                        _new_tuple(
                            Attempt,
                            (
                                delay if delay > 0.0 else 0.0,
                                duration if duration > 0.0 else 0.0,
                                True,
                                None,
                                None,
                            ),
                        ),
                    ),
                ),
            )
        return record.build_result()
    return record.result()


def use_interpreted_await() -> None:
    """Give the core's records :func:`interpreted_await` where they are interpreted (their
    ``__await__`` a Python function: the pure build)."""
    if isinstance(vars(_records.Record)["__await__"], FunctionType):
        _records.Record.__await__ = interpreted_await  # type: ignore[method-assign,assignment]


async def record_result(record: Record) -> RecordResult:
    """``await record`` while it is pending: its result once it is terminal (raises its
    failure)."""
    if not record.done():
        await record.waiter().wait()
    return record.result()


async def result_after(checkpoint: Awaitable[None], record: Record) -> RecordResult:
    """``await record`` once it is done, where ``checkpoint`` is to be awaited first (see
    ``_records.resolved_checkpoint``)."""
    await checkpoint
    return record.result()


async def checkpoint_or_nothing(checkpoint: Awaitable[None] | None) -> None:
    """Await ``checkpoint``, if any."""
    if checkpoint is not None:
        await checkpoint


async def record_wait(record: Record) -> RecordResult:
    """``pending.wait()``: a coroutine (for ``create_task``, ``start_soon`` and the like)
    that is ``await pending``."""
    return await record


async def record_done(record: Record) -> None:
    """Wait until ``record`` is terminal, without raising its failure."""
    if not record.done():
        await record.waiter().wait()


async def batch_done(counter: BatchCounter) -> None:
    """Wait until no record of a batch is pending."""
    if counter.remaining:
        await counter.waiter().wait()


#: builds a named tuple from a tuple of its fields (a named tuple's own ``__new__`` is a
#: Python function)
_new_tuple = tuple.__new__

#: the event a waiter sleeps on, and a full checkpoint
new_event = anyio.Event
checkpoint = anyio.lowlevel.checkpoint

#: trio's run context, where :func:`interpreted_await` checks a trio task's cancel status
#: itself (set by :func:`find_trio` where trio's layout is the one known here, ``_trio[2]``);
#: ``None`` before and otherwise
_run_context: Any = None


def find_trio(slot: list[Any]) -> Callable[[], Any]:
    """Look trio's run context up once, into ``slot`` (``_records._trio``: ``[current task,
    trio module, fast, run context]``), and return the first: a function giving the calling
    thread's trio task, ``None`` outside trio. ``fast`` only where the run context is the
    thread-local known here (and then also :data:`_run_context`)."""
    global _run_context
    _run_context = None
    trio = sys.modules["trio"]
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT, CancelStatus
    except ImportError:  # another layout: the public check only, with trio's own test
        slot[:] = [public_trio_task(trio), trio, False, None]
        return slot[0]  # type: ignore[no-any-return]
    fast = hasattr(trio.lowlevel.Task, "_cancel_status") and hasattr(
        CancelStatus, "effectively_cancelled"
    )
    run_context: object = GLOBAL_RUN_CONTEXT
    if not isinstance(run_context, threading.local):  # not the layout known here either
        slot[:] = [public_trio_task(trio), trio, False, None]
        return slot[0]  # type: ignore[no-any-return]

    def current_task() -> Any:
        # this thread's values of the thread-local: a missing key raises no AttributeError
        # (getattr with a default raised and caught one, 0.5 µs per await outside trio)
        return run_context.__dict__.get("task")

    slot[:] = [current_task, trio, fast, run_context]
    if fast:
        _run_context = run_context
    return current_task


def public_trio_task(trio: Any) -> Callable[[], Any]:
    """The current-task function of :func:`find_trio` where trio's module layout is not
    the one known here: only whether the caller is in a trio task (``True`` or ``None``)."""

    def in_trio_task() -> Any:
        return True if trio.lowlevel.in_trio_task() else None

    return in_trio_task
