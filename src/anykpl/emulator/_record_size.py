"""A stream's maximum record size, as the service has it since it took records up to 10 MiB.

Kinesis Data Streams keeps a maximum record size per stream: 1 MiB (1,024 KiB) by default,
raised to at most 10 MiB (10,240 KiB) with ``CreateStream``'s or ``UpdateMaxRecordSize``'s
``MaxRecordSizeInKiB``, and shown by ``DescribeStreamSummary``. A record (data + partition key)
over its stream's maximum is refused with ``ValidationException``. The API reference for
PutRecords (botocore 1.43's model) now says "each record in the request can be as large as
10 MiB, up to a limit of 10 MiB for the entire request". The emulator applies that 10 MiB to
streams whose maximum was raised and, by its own choice, keeps the 5 MiB that every stream had
before for the others: the producer never needs more there, and a test that a request over
5 MiB is refused still means what it did. A shard still takes 1 MiB/s: the service lets a
large record through by bursting ("the tank is temporarily drained, then refills"), which the
write path models as debt on the shard's byte bucket (``_Bucket``).

moto knows none of this: the emulator keeps the size on moto's stream object and answers the
three calls itself around moto.
"""

from __future__ import annotations

from typing import Any

from .._core._limits import DEFAULT_MAX_RECORD_SIZE, LARGEST_MAX_RECORD_SIZE, PUT_RECORDS_MAX_BYTES

__all__ = (
    "LARGE_PUT_RECORDS_MAX_BYTES",
    "check_size_in_kib",
    "max_record_size",
    "put_records_max_bytes",
    "set_max_record_size",
)

#: the attribute on moto's stream object that holds the maximum, in bytes
_ATTRIBUTE = "anykpl_max_record_size"
#: the PutRecords limit for a stream whose maximum record size was raised
LARGE_PUT_RECORDS_MAX_BYTES = 10 * 1024 * 1024
_LOWEST_KIB = DEFAULT_MAX_RECORD_SIZE // 1024
_HIGHEST_KIB = LARGEST_MAX_RECORD_SIZE // 1024


def max_record_size(stream: Any) -> int:
    """The stream's maximum record size, in bytes (data + partition key)."""
    size: int = getattr(stream, _ATTRIBUTE, DEFAULT_MAX_RECORD_SIZE)
    return size


def put_records_max_bytes(stream: Any) -> int:
    """The largest PutRecords request the stream takes (see the module's docstring)."""
    if max_record_size(stream) > DEFAULT_MAX_RECORD_SIZE:
        return LARGE_PUT_RECORDS_MAX_BYTES
    return PUT_RECORDS_MAX_BYTES


def check_size_in_kib(value: object) -> int:
    """``MaxRecordSizeInKiB`` as the service validates it: an integer in 1024..10240."""
    from ._write_path import KinesisError  # (the write path imports this module)

    if isinstance(value, bool) or not isinstance(value, int):
        raise KinesisError(400, "SerializationException", "MaxRecordSizeInKiB must be an integer")
    if not _LOWEST_KIB <= value <= _HIGHEST_KIB:
        raise KinesisError(
            400,
            "ValidationException",
            f"1 validation error detected: Value '{value}' at 'maxRecordSizeInKiB' failed to "
            f"satisfy constraint: Member must have value between {_LOWEST_KIB} and "
            f"{_HIGHEST_KIB}",
        )
    return value


def set_max_record_size(stream: Any, size_in_kib: int) -> None:
    setattr(stream, _ATTRIBUTE, size_in_kib * 1024)
