"""The handle a caller gets for a record: :class:`PendingRecord`, a read-only protocol over the
producer's :class:`~anykpl._core._records.Record`, which only the stages change.

Not in the core, which the compiled build compiles: a protocol compiled by mypyc is no longer
one that ``typing.runtime_checkable`` (and so ``isinstance``) accepts.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any, Protocol, runtime_checkable

from .._core._results import RecordResult

__all__ = ("PendingRecord",)


@runtime_checkable
class PendingRecord(Protocol):
    """A record that was admitted by :meth:`Producer.submit`, and its result handle.

    ``await pending`` returns the :class:`RecordResult` once the record succeeded, or raises
    :class:`~anykpl.errors.RecordFailedError` once it failed. Cancelling an ``await`` cancels
    only the wait, never the record: it is delivered (or fails) all the same.

    Read-only: what the record is (``stream``, ``partition_key``, ``explicit_hash_key``,
    ``data``, ``tenant``) and how it ended. The producer's own record object is one; what the
    pipeline keeps in it is not part of the handle.
    """

    @property
    def stream(self) -> str:
        """The stream it was put to (a name or an ARN)."""

    @property
    def partition_key(self) -> str:
        """Its partition key."""

    @property
    def explicit_hash_key(self) -> str | None:
        """Its explicit hash key (decimal), or ``None``."""

    @property
    def data(self) -> bytes:
        """Its data."""

    @property
    def tenant(self) -> str | None:
        """The tenant it was put for, or ``None``."""

    def done(self) -> bool:
        """Whether the record is terminal (succeeded or failed)."""

    def result(self) -> RecordResult:
        """The record's result.

        :raises RuntimeError: if the record is not done yet.
        :raises ~anykpl.errors.RecordFailedError: if it failed.
        """

    def wait(self) -> Coroutine[Any, Any, RecordResult]:
        """Wait until the record is terminal; same as ``await pending``: ``await
        pending.wait()``, a coroutine."""

    def __await__(self) -> Generator[Any, None, RecordResult]: ...
