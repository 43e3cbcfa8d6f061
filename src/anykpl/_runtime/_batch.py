"""The handle of a :meth:`Producer.submit_many` batch: its records' handles, and the batch's
own completion, so a firehose need not look at every record to learn that all went well.

Each record of the batch counts itself out of the batch's :class:`BatchCounter` when it
becomes terminal (``Record.resolve``, compiled code), so :meth:`PendingBatch.done` and
the counts are one read each, however big the batch. Results are built only when asked for:
:meth:`PendingBatch.result` builds one for each failed record, none for the others.

A batch admitted in columns (``Intake.admit_columns``: no record made per item) holds a
:class:`ColumnRecords` instead of a list: each handle is made the first time it is asked for,
from the batch's columns and the outcome of the Kinesis record that carried it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple, overload

from .._core._records import BatchCounter, ColumnBatch, Record, RecordResult
from ._handle import PendingRecord

__all__ = ("BatchResult", "ColumnRecords", "PendingBatch", "set_done_hook")


class BatchResult(NamedTuple):
    """The outcome of a :meth:`Producer.submit_many` batch (an immutable named tuple).

    Attributes:
        succeeded: how many of its records were put.
        failed: how many failed.
        failures: ``(position in the batch, RecordResult)`` of each failed record, in batch
            order; each result carries every attempt, with its error code and message.
    """

    succeeded: int
    failed: int
    failures: tuple[tuple[int, RecordResult], ...]


class PendingBatch(Sequence[PendingRecord]):
    """The records admitted by one :meth:`Producer.submit_many` call, in order.

    A sequence of their :class:`PendingRecord` handles (``batch[3]``, ``len(batch)``, ``for
    pending in batch``), and a handle of its own: :meth:`done` says whether every record is
    terminal, :attr:`succeeded` and :attr:`failed` count them so far, and ``await batch``
    waits for all of them and returns a :class:`BatchResult`. Awaiting a batch never raises for
    a failed record: the failures are in the result. Cancelling an ``await`` cancels only the
    wait, never the records.
    """

    __slots__ = ("_counter", "_records")

    def __init__(self, records: Sequence[Record], counter: BatchCounter) -> None:
        self._records = records
        self._counter = counter

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> PendingRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[PendingRecord]: ...

    def __getitem__(self, index: int | slice) -> PendingRecord | list[PendingRecord]:
        if isinstance(index, slice):
            handles: list[PendingRecord] = [*self._records[index]]
            return handles
        return self._records[index]

    def __iter__(self) -> Iterator[PendingRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        counter = self._counter
        return (
            f"<PendingBatch {len(self._records)} record(s): {self.succeeded} succeeded, "
            f"{counter.failed} failed, {counter.remaining} pending>"
        )

    def done(self) -> bool:
        """Whether every record of the batch is terminal (succeeded or failed)."""
        return not self._counter.remaining

    @property
    def succeeded(self) -> int:
        """How many records of the batch have succeeded so far."""
        counter = self._counter
        return len(self._records) - counter.remaining - counter.failed

    @property
    def failed(self) -> int:
        """How many records of the batch have failed so far."""
        return self._counter.failed

    @property
    def pending(self) -> int:
        """How many records of the batch are not terminal yet."""
        return self._counter.remaining

    def result(self) -> BatchResult:
        """The batch's result.

        :raises RuntimeError: if a record of the batch is not done yet.
        """
        counter = self._counter
        if counter.remaining:
            raise RuntimeError(
                f"{counter.remaining} record(s) of the batch are not done yet; await it"
            )
        failures: list[tuple[int, RecordResult]] = []
        if counter.failed:
            for position, pending in enumerate(self._records):
                outcome = pending.build_result()
                if not outcome.success:
                    failures.append((position, outcome))
        return BatchResult(self.succeeded, counter.failed, tuple(failures))

    async def wait(self) -> BatchResult:
        """Wait until every record of the batch is terminal; same as ``await batch``."""
        await self._counter.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, BatchResult]:
        return self.wait().__await__()


class ColumnRecords(Sequence[Record]):
    """A column batch's handles as a sequence, each made the first time it is asked for
    (:meth:`ColumnBatch.handle`): a batch whose caller never looks at its records makes none."""

    __slots__ = ("_columns",)

    def __init__(self, columns: ColumnBatch) -> None:
        self._columns = columns

    def __len__(self) -> int:
        return len(self._columns)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> list[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | list[Record]:
        handle = self._columns.handle
        if isinstance(index, slice):
            return [handle(i) for i in range(*index.indices(len(self._columns)))]
        if index < 0:
            index += len(self._columns)
        if not 0 <= index < len(self._columns):
            raise IndexError("batch index out of range")
        return handle(index)

    def __iter__(self) -> Iterator[Record]:
        handle = self._columns.handle
        return (handle(i) for i in range(len(self._columns)))


def set_done_hook(batch: PendingBatch, hook: Callable[[], None] | None) -> None:
    """Have ``hook`` called once, where the batch's last record is resolved (``None``: no
    more). One slot, the runtime's: ``SyncProducer`` completes a batch's future with it."""
    batch._counter.on_done = hook
