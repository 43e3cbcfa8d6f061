"""Reading a stream back as a consumer would, and judging it against what was acknowledged:
on any stream, the service's or a local one (``anykpl demo`` and the ``kinesis_emulator``
fixture use it).

"Nothing lost" is proved from the stream itself (docs/demo.md), never by counting callbacks: every
shard — open or closed — is read from ``TRIM_HORIZON`` with GetRecords, each Kinesis record is
deaggregated the way the KCL does it (:func:`anykpl._core._wire.deaggregate`), and the user records
that come out are compared with the ones the producer acknowledged.

Reading uses a plain synchronous botocore client: botocore is installed wherever anykpl is
(aiobotocore depends on it), it needs no event loop, and the demo reads only after the producer
has closed. Call it from a worker thread (``anyio.to_thread.run_sync``) inside async code.

When a shard is finished. A GetRecords page that comes back empty with ``MillisBehindLatest``
0 means the reader has caught up with the shard's tip; no ``NextShardIterator`` means the shard
is closed and fully read. An empty page with ``MillisBehindLatest`` above 0 is normal on the
service (the iterator crossed a stretch of the shard with no records) and reading goes on.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._core._wire import deaggregate

__all__ = (
    "ReadRecord",
    "Verdict",
    "count_user_records",
    "judge",
    "list_shard_ids",
    "read_user_records",
)

#: The error codes GetRecords answers when a shard's five reads per second (or 2 MiB/s) are
#: used up; reading waits and tries again.
_READ_THROTTLED = frozenset(
    {"ProvisionedThroughputExceededException", "ThrottlingException", "LimitExceededException"}
)


@dataclass(frozen=True, slots=True)
class ReadRecord:
    """One user record as a consumer sees it.

    Attributes:
        shard_id: the shard it was read from.
        sequence_number: the sequence number of the Kinesis record that carried it.
        sub_sequence_number: its position inside that Kinesis record (0 when sent on its own).
        partition_key: its partition key.
        data: its data.
    """

    shard_id: str
    sequence_number: str
    sub_sequence_number: int
    partition_key: str
    data: bytes


def list_shard_ids(client: Any, stream: str) -> list[str]:
    """Every shard of ``stream`` that ListShards returns (closed ones included), in order."""
    shard_ids: list[str] = []
    request: dict[str, Any] = {"StreamName": stream}
    while True:
        page = client.list_shards(**request)
        shard_ids.extend(shard["ShardId"] for shard in page["Shards"])
        token = page.get("NextToken")
        if not token:
            return shard_ids
        # a NextToken names the stream itself; ListShards rejects both together
        request = {"NextToken": token}


def read_user_records(
    client: Any,
    stream: str,
    *,
    limit: int = 1000,
    pace: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[ReadRecord]:
    """Every user record in ``stream``, shard by shard, from ``TRIM_HORIZON`` to the tip.

    ``client`` is a botocore (or boto3) Kinesis client. ``limit`` is GetRecords' ``Limit``
    (Kinesis records per page). ``pace`` is the least time between two GetRecords calls on
    one shard: 0 for local endpoints, 0.2 against the service (five reads per shard per
    second). A throttled read waits (doubling from ``max(pace, 0.2)`` up to 5 s) and tries
    again.
    """
    for shard_id in list_shard_ids(client, stream):
        iterator: str | None = client.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        backoff = max(pace, 0.2)
        while iterator:
            try:
                page = client.get_records(ShardIterator=iterator, Limit=limit)
            except Exception as exc:  # botocore's ClientError, without importing botocore here
                code = getattr(exc, "response", {}).get("Error", {}).get("Code")
                if code not in _READ_THROTTLED:
                    raise
                sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = max(pace, 0.2)
            records = page["Records"]
            for record in records:
                decoded = deaggregate(
                    record["Data"], record["PartitionKey"], record.get("ExplicitHashKey")
                )
                for index, user_record in enumerate(decoded):
                    yield ReadRecord(
                        shard_id,
                        record["SequenceNumber"],
                        index,
                        user_record.partition_key,
                        user_record.data,
                    )
            if not records and page.get("MillisBehindLatest", 0) == 0:
                break  # caught up with the tip of an open shard
            iterator = page.get("NextShardIterator")  # None: a closed shard, read to its end
            if iterator and pace:
                sleep(pace)


def count_user_records(
    client: Any,
    stream: str,
    *,
    keep: Callable[[str, bytes], bool] | None = None,
    limit: int = 1000,
    pace: float = 0.0,
) -> tuple[Counter[tuple[str, bytes]], int]:
    """How many times each ``(partition_key, data)`` user record is in ``stream``.

    ``keep(partition_key, data)`` filters what is counted (for example, only this run's
    records when the stream also holds earlier ones). Returns the counter and how many user
    records ``keep`` left out. ``limit`` and ``pace`` are :func:`read_user_records`'s.
    """
    found: Counter[tuple[str, bytes]] = Counter()
    left_out = 0
    for record in read_user_records(client, stream, limit=limit, pace=pace):
        if keep is None or keep(record.partition_key, record.data):
            found[(record.partition_key, record.data)] += 1
        else:
            left_out += 1
    return found, left_out


@dataclass(frozen=True)
class Verdict:
    """What the stream holds compared with what the producer reported.

    Attributes:
        acknowledged: user records the producer acknowledged (put successfully).
        present: acknowledged records found in the stream (at least once).
        missing: acknowledged records not found: these are lost records.
        duplicates: extra copies of records found more than once. A retry after a request
            whose response was lost writes a record twice; Kinesis is at-least-once, so
            duplicates are counted, not failures.
        failed: records the producer reported as failed.
        failed_present: failed records that are in the stream anyway (a request can store its
            records and still time out on the way back); not an error either.
        unexpected: records in the stream that were neither acknowledged nor failed: data
            nobody put, which means corruption.
        examples_missing: a few of the missing records, for the report.
        examples_unexpected: a few of the unexpected records, for the report.
    """

    acknowledged: int
    present: int
    missing: int
    duplicates: int
    failed: int
    failed_present: int
    unexpected: int
    examples_missing: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    examples_unexpected: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        """True when the producer acknowledged something and every acknowledged record is in
        the stream, and nothing in it is unexplained."""
        return self.acknowledged > 0 and self.missing == 0 and self.unexpected == 0

    @property
    def exit_code(self) -> int:
        """0 when :attr:`ok`, 1 otherwise."""
        return 0 if self.ok else 1


def judge(
    acknowledged: Collection[tuple[str, bytes]],
    found: Counter[tuple[str, bytes]],
    failed: Collection[tuple[str, bytes]] = (),
    *,
    examples: int = 5,
) -> Verdict:
    """Compare the acknowledged (and failed) records with the ones read back.

    Every record is identified by its ``(partition_key, data)``, so the records put must be
    distinct (the demo puts a device id and a per-device sequence number in each reading).
    """
    acknowledged = set(acknowledged)
    failed = set(failed) - acknowledged
    present = 0
    duplicates = 0
    missing: list[tuple[str, bytes]] = []
    for record in acknowledged:
        copies = found.get(record, 0)
        if copies:
            present += 1
            duplicates += copies - 1
        else:
            missing.append(record)
    failed_present = 0
    unexpected: list[tuple[str, bytes]] = []
    for record, copies in found.items():
        if record in acknowledged:
            continue
        if record in failed:
            failed_present += 1
            duplicates += copies - 1
        else:
            unexpected.extend([record] * copies)
    missing.sort()
    unexpected.sort()
    return Verdict(
        acknowledged=len(acknowledged),
        present=present,
        missing=len(missing),
        duplicates=duplicates,
        failed=len(failed),
        failed_present=failed_present,
        unexpected=len(unexpected),
        examples_missing=tuple(missing[:examples]),
        examples_unexpected=tuple(unexpected[:examples]),
    )
