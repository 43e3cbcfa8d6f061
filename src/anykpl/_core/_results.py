"""What a record's handle answers with: :class:`RecordResult` and its :class:`Attempt` values.

Plain values with no behaviour, apart from the handle that builds them (``_records.py``), so
:mod:`anykpl.errors` can name them without importing anything that imports it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ("Attempt", "RecordResult")


class Attempt(NamedTuple):
    """One try at putting a record (an immutable named tuple).

    Attributes:
        delay: seconds from the record's arrival (first attempt) or from the end of the previous
            attempt to the start of this one (the KPL's definition).
        duration: seconds the attempt took (the PutRecords call, or 0 for an attempt that ended
            without a call, such as an expiry in the limiter).
        success: whether the attempt put the record.
        error_code: the error code on failure (a Kinesis code, an SDK exception name, or one of
            the KPL's synthetic codes ``Expired``, ``Wrong Shard``, ``Record Count Mismatch``).
        error_message: the error message on failure.
    """

    delay: float
    duration: float
    success: bool
    error_code: str | None = None
    error_message: str | None = None


class RecordResult(NamedTuple):
    """The outcome of one user record (an immutable named tuple).

    Results and attempts are named tuples rather than dataclasses: they are built once per
    record, and tuples of plain values are cheap to build and are untracked by the garbage
    collector, which matters when a caller holds hundreds of thousands of them.

    Attributes:
        success: whether the record was put.
        shard_id: the shard the record landed in (on success).
        sequence_number: the sequence number of the Kinesis record that carried it.
        sub_sequence_number: the record's position inside that (aggregated) Kinesis record; 0 for
            a record sent on its own.
        attempts: every attempt, in order.
    """

    success: bool
    shard_id: str | None
    sequence_number: str | None
    sub_sequence_number: int | None
    attempts: tuple[Attempt, ...]
