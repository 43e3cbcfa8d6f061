"""Deaggregation for consumers: the user records in what a Kinesis reader gets.

A KPL-format producer (the KPL, anykpl) packs many user records into one Kinesis record. Every
consumer that does not use the KCL must unpack them: a Lambda handler, a GetRecords loop, a
Firehose transform. This module does it as the KCL's ``AggregatorUtil`` does, from:

- a Lambda event for a Kinesis trigger (:func:`deaggregate_lambda_event`);
- the ``Records`` of a GetRecords response, from boto3, botocore or aiobotocore
  (:func:`deaggregate_records`);
- one Kinesis record's bytes and keys (:func:`deaggregate`).

A record that is not aggregated (no magic prefix, or a checksum that does not match: the KCL's
rule) is one user record with the Kinesis record's own keys. Each user record comes back as a
:class:`UserRecord`, with the sequence number of the Kinesis record that carried it and its
position inside it (``sub_sequence_number``, as the KCL numbers them).

**The shard's range.** After a resharding, an aggregate can be stored in a shard whose hash-key
range does not hold all of its user records. Given the shard's range (``hash_range``), a
:class:`Deaggregator` applies the KCL's rule: an aggregate with any user record outside the
range is dropped whole, and its user records are counted in
:attr:`Deaggregator.dropped_out_of_range`. A producer that retries such a record (anykpl's
``Wrong Shard``, docs/errors.md) has put each user record again where it belongs, so a reader
that drops them reads it from the retry (docs/errors.md says when one can still be read
twice: a retry anykpl could not rule out). Without a range nothing is dropped.

**Corrupt input** — bytes that claim to be an aggregate (magic prefix and a matching checksum)
but whose protobuf is broken, or a Lambda record whose data is not base64 — raises
:class:`~anykpl.errors.AggregationFormatError` by default (``on_corrupt="raise"``); with
``on_corrupt="skip"`` the Kinesis record is skipped and counted in :attr:`Deaggregator.corrupt`.
It never passes corrupt bytes on as a user record's data.

Pure and synchronous; nothing here needs an event loop or an AWS client.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import errors
from ._core._intake import _parse_explicit_hash_key
from ._core._limits import MAX_HASH_KEY
from ._core._records import partition_key_hash
from ._core._wire import unpack

__all__ = (
    "Deaggregator",
    "UserRecord",
    "deaggregate",
    "deaggregate_lambda_event",
    "deaggregate_records",
)

OnCorrupt = Literal["raise", "skip"]


@dataclass(frozen=True, slots=True)
class UserRecord:
    """One user record, as a consumer reads it.

    Attributes:
        partition_key: its partition key.
        explicit_hash_key: its explicit hash key (a decimal string), or ``None``.
        data: its data.
        sequence_number: the sequence number of the Kinesis record that carried it (``None``
            when the caller gave none).
        sub_sequence_number: its position in that Kinesis record, from 0 (0 for a record that
            was not aggregated).
        aggregated: whether it came out of an aggregate.
    """

    partition_key: str
    explicit_hash_key: str | None
    data: bytes
    sequence_number: str | None = None
    sub_sequence_number: int = 0
    aggregated: bool = False

    @property
    def hash_key(self) -> int:
        """The hash key that places it in a shard: its explicit hash key, else the MD5 of its
        partition key (as a 128-bit integer)."""
        if self.explicit_hash_key is not None:
            # the producer's rule for an explicit hash key (InvalidRecordError, a ValueError)
            return _parse_explicit_hash_key(self.explicit_hash_key)
        return partition_key_hash(self.partition_key)


class Deaggregator:
    """Deaggregates Kinesis records and counts what it dropped or skipped.

    Args:
        hash_range: the shard's ``(starting, ending)`` hash keys (integers, or the decimal
            strings of ListShards' ``HashKeyRange``), to apply the KCL's rule (see the module's
            docstring); ``None``: keep every user record.
        on_corrupt: ``"raise"`` (the default) or ``"skip"`` a corrupt Kinesis record.

    Attributes:
        records_in: Kinesis records read.
        user_records_out: user records returned.
        dropped_out_of_range: user records dropped by the KCL's rule.
        corrupt: Kinesis records skipped as corrupt (``on_corrupt="skip"``).
    """

    def __init__(
        self,
        *,
        hash_range: tuple[int | str, int | str] | None = None,
        on_corrupt: OnCorrupt = "raise",
    ) -> None:
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', not {on_corrupt!r}")
        self.hash_range: tuple[int, int] | None = None
        if hash_range is not None:
            low, high = (int(key) for key in hash_range)
            if not 0 <= low <= high <= MAX_HASH_KEY:
                raise ValueError(
                    f"hash_range must be (starting, ending) hash keys with "
                    f"0 <= starting <= ending <= 2**128 - 1, not {hash_range!r}"
                )
            self.hash_range = (low, high)
        self.on_corrupt = on_corrupt
        self.records_in = 0
        self.user_records_out = 0
        self.dropped_out_of_range = 0
        self.corrupt = 0

    def __repr__(self) -> str:
        return (
            f"<Deaggregator records_in={self.records_in} out={self.user_records_out} "
            f"dropped_out_of_range={self.dropped_out_of_range} corrupt={self.corrupt}>"
        )

    def record(
        self,
        data: bytes | bytearray | memoryview,
        partition_key: str,
        explicit_hash_key: str | None = None,
        sequence_number: str | None = None,
    ) -> list[UserRecord]:
        """The user records in one Kinesis record."""
        self.records_in += 1
        try:
            decoded, aggregated = unpack(data, partition_key, explicit_hash_key)
        except errors.AggregationFormatError as exc:
            return self._corrupt(exc)
        except TypeError:  # data that is not bytes (a base64 str, None)
            return self._corrupt(f"a record whose data is a {type(data).__name__}, not bytes")
        records = [
            UserRecord(
                user.partition_key,
                user.explicit_hash_key,
                user.data,
                sequence_number,
                index,
                aggregated,
            )
            for index, user in enumerate(decoded)
        ]
        if self.hash_range is not None and aggregated:
            low, high = self.hash_range
            try:
                outside = any(not low <= r.hash_key <= high for r in records)
            except ValueError:  # an explicit hash key that is not a decimal
                return self._corrupt("an aggregate whose explicit hash key is not a decimal number")
            if outside:
                # the KCL's rule: the whole aggregate goes (AggregatorUtil.deaggregate)
                self.dropped_out_of_range += len(records)
                return []
        self.user_records_out += len(records)
        return records

    def records(self, records: Iterable[Mapping[str, Any]]) -> Iterator[UserRecord]:
        """The user records in the ``Records`` of a GetRecords response (each a mapping with
        ``Data``, ``PartitionKey``, ``SequenceNumber`` and maybe ``ExplicitHashKey``, as boto3,
        botocore and aiobotocore return them)."""
        for record in records:
            try:
                data = record["Data"]
                partition_key = record["PartitionKey"]
            except KeyError as exc:
                self._bad(f"a GetRecords record without {exc.args[0]!r}")
                continue
            except TypeError:
                self._bad(f"a GetRecords record that is a {type(record).__name__}")
                continue
            yield from self.record(
                data, partition_key, record.get("ExplicitHashKey"), record.get("SequenceNumber")
            )

    def lambda_event(self, event: Mapping[str, Any]) -> list[UserRecord]:
        """The user records in a Lambda event from a Kinesis trigger (``event["Records"]``,
        each with a ``kinesis`` mapping: base64 ``data``, ``partitionKey``,
        ``sequenceNumber``), in the event's order."""
        out: list[UserRecord] = []
        try:
            entries = event["Records"]
        except (KeyError, TypeError):
            raise ValueError("not a Lambda event for a Kinesis trigger: no 'Records'") from None
        if not isinstance(entries, list):
            raise ValueError(
                f"not a Lambda event for a Kinesis trigger: its 'Records' is a "
                f"{type(entries).__name__}, not a list"
            )
        for entry in entries:
            try:
                kinesis = entry["kinesis"]
                encoded = kinesis["data"]
                partition_key = kinesis["partitionKey"]
            except (KeyError, TypeError) as exc:
                self._bad(f"a Lambda event record without its kinesis data ({exc!r})")
                continue
            try:
                data = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError, TypeError):
                self._bad("a Lambda event record whose data is not base64")
                continue
            out.extend(
                self.record(
                    data,
                    partition_key,
                    kinesis.get("explicitHashKey"),
                    kinesis.get("sequenceNumber"),
                )
            )
        return out

    def _bad(self, what: str) -> None:
        """A Kinesis record that never reached :meth:`record` (a malformed entry): read, and
        corrupt."""
        self.records_in += 1
        self._corrupt(what)

    def _corrupt(self, problem: str | errors.AggregationFormatError) -> list[UserRecord]:
        """A corrupt Kinesis record: raised (``on_corrupt="raise"``), or skipped and counted."""
        if self.on_corrupt == "raise":
            if isinstance(problem, errors.AggregationFormatError):
                raise problem
            raise errors.AggregationFormatError(problem)
        self.corrupt += 1
        return []


def deaggregate(
    data: bytes | bytearray | memoryview,
    partition_key: str,
    explicit_hash_key: str | None = None,
    *,
    sequence_number: str | None = None,
    hash_range: tuple[int | str, int | str] | None = None,
) -> list[UserRecord]:
    """The user records in one Kinesis record (see :class:`Deaggregator`).

    :raises ~anykpl.errors.AggregationFormatError: the record claims to be an aggregate and is
        corrupt.
    """
    return Deaggregator(hash_range=hash_range).record(
        data, partition_key, explicit_hash_key, sequence_number
    )


def deaggregate_records(
    records: Iterable[Mapping[str, Any]],
    *,
    hash_range: tuple[int | str, int | str] | None = None,
    on_corrupt: OnCorrupt = "raise",
) -> list[UserRecord]:
    """The user records in the ``Records`` of a GetRecords response (see
    :meth:`Deaggregator.records`); for counts of what was dropped, use a
    :class:`Deaggregator`."""
    return list(Deaggregator(hash_range=hash_range, on_corrupt=on_corrupt).records(records))


def deaggregate_lambda_event(
    event: Mapping[str, Any], *, on_corrupt: OnCorrupt = "raise"
) -> list[UserRecord]:
    """The user records in a Lambda event from a Kinesis trigger (see
    :meth:`Deaggregator.lambda_event`).

    :raises ValueError: ``event`` is not such an event.
    :raises ~anykpl.errors.AggregationFormatError: a record is corrupt (``on_corrupt="raise"``).
    """
    return Deaggregator(on_corrupt=on_corrupt).lambda_event(event)
