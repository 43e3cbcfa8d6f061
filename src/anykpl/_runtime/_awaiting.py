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

from collections.abc import Awaitable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._core._records import BatchCounter, PendingRecord, RecordResult

__all__ = (
    "batch_done",
    "checkpoint_or_nothing",
    "record_done",
    "record_result",
    "record_wait",
    "result_after",
)


async def record_result(record: PendingRecord) -> RecordResult:
    """``await record`` while it is pending: its result once it is terminal (raises its
    failure)."""
    if not record.done():
        await record._waiter().wait()
    return record.result()


async def result_after(checkpoint: Awaitable[None], record: PendingRecord) -> RecordResult:
    """``await record`` once it is done, where ``checkpoint`` is to be awaited first (see
    ``_records.resolved_checkpoint``)."""
    await checkpoint
    return record.result()


async def checkpoint_or_nothing(checkpoint: Awaitable[None] | None) -> None:
    """Await ``checkpoint``, if any."""
    if checkpoint is not None:
        await checkpoint


async def record_wait(record: PendingRecord) -> RecordResult:
    """``pending.wait()``: a coroutine (for ``create_task``, ``start_soon`` and the like)
    that is ``await pending``."""
    return await record


async def record_done(record: PendingRecord) -> None:
    """Wait until ``record`` is terminal, without raising its failure."""
    if not record.done():
        await record._waiter().wait()


async def batch_done(counter: BatchCounter) -> None:
    """Wait until no record of a batch is pending."""
    if counter.remaining:
        await counter._waiter().wait()
