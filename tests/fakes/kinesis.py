"""A fake Kinesis transport for unit tests: shards with hash ranges, per-record throttling and
faults on demand, and a log of everything it stored. No network, no event-loop specifics.

The hash-key space comes from ``anykpl._core._limits``, the one place the service's numbers live, so
the fake and the producer cannot disagree about where a shard ends."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from anykpl._core import _wire
from anykpl._core._limits import MAX_HASH_KEY


def even_ranges(count: int) -> list[tuple[int, int]]:
    """``count`` shards splitting the hash-key space evenly, as CreateStream does."""
    step = (MAX_HASH_KEY + 1) // count
    last = count - 1
    return [(i * step, MAX_HASH_KEY if i == last else (i + 1) * step - 1) for i in range(count)]


@dataclass
class FakeShard:
    shard_id: str
    start: int
    end: int
    open: bool = True
    records: list[tuple[str, bytes, str]] = field(default_factory=list)  # (pk, data, seq)


@dataclass
class StoredUserRecord:
    partition_key: str
    explicit_hash_key: str | None
    data: bytes
    shard_id: str


class FakeKinesis:
    """Implements the producer's Transport protocol.

    ``fail_request`` (exception or None) fails the next whole requests; ``entry_error`` is a
    callable (shard_id, index) -> (code, message) | None deciding per-record failures;
    ``delay`` is added to each call; ``list_shards_error`` fails ListShards.
    """

    def __init__(self, shard_count: int = 4) -> None:
        self.shards: list[FakeShard] = [
            FakeShard(f"shardId-{i:012d}", start, end)
            for i, (start, end) in enumerate(even_ranges(shard_count))
        ]
        self.requests: list[list[dict[str, Any]]] = []
        self.request_errors: list[BaseException] = []
        self.entry_error: Callable[[str, int], tuple[str, str] | None] | None = None
        self.delay = 0.0
        self.list_shards_calls: list[dict[str, Any]] = []
        self.list_shards_errors: list[BaseException] = []
        self.page_size = 1000
        self.drop_response_entry = False
        self.hang = False
        self._sequence = 0

    # -- transport --------------------------------------------------------------------

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        self.requests.append(records)
        if self.delay:
            await anyio.sleep(self.delay)
        if self.hang:
            await anyio.sleep_forever()
        if self.request_errors:
            raise self.request_errors.pop(0)
        results: list[dict[str, Any]] = []
        failed = 0
        for index, entry in enumerate(records):
            hash_key = int(entry["ExplicitHashKey"])
            shard = next(s for s in self.shards if s.open and s.start <= hash_key <= s.end)
            error = self.entry_error(shard.shard_id, index) if self.entry_error else None
            if error is not None:
                failed += 1
                results.append({"ErrorCode": error[0], "ErrorMessage": error[1]})
                continue
            self._sequence += 1
            sequence = str(self._sequence)
            data = entry["Data"]
            shard.records.append((entry["PartitionKey"], bytes(data), sequence))
            results.append({"ShardId": shard.shard_id, "SequenceNumber": sequence})
        if self.drop_response_entry:
            results = results[:-1]
        return {"FailedRecordCount": failed, "Records": results}

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]:
        self.list_shards_calls.append(kwargs)
        await anyio.lowlevel.checkpoint()
        if self.list_shards_errors:
            raise self.list_shards_errors.pop(0)
        start = int(kwargs.get("NextToken", "0"))
        page = self.shards[start : start + self.page_size]
        response: dict[str, Any] = {
            "Shards": [
                {
                    "ShardId": s.shard_id,
                    "HashKeyRange": {
                        "StartingHashKey": str(s.start),
                        "EndingHashKey": str(s.end),
                    },
                    "SequenceNumberRange": (
                        {"StartingSequenceNumber": "0"}
                        if s.open
                        else {"StartingSequenceNumber": "0", "EndingSequenceNumber": "9"}
                    ),
                }
                for s in page
            ]
        }
        if start + self.page_size < len(self.shards):
            response["NextToken"] = str(start + self.page_size)
        return response

    # -- test helpers -------------------------------------------------------------------

    def split(self, shard_id: str) -> None:
        """Close ``shard_id`` and open two children splitting its range."""
        parent = next(s for s in self.shards if s.shard_id == shard_id)
        parent.open = False
        middle = (parent.start + parent.end) // 2
        n = len(self.shards)
        self.shards.append(FakeShard(f"shardId-{n:012d}", parent.start, middle))
        self.shards.append(FakeShard(f"shardId-{n + 1:012d}", middle + 1, parent.end))

    def user_records(self) -> list[StoredUserRecord]:
        """Everything stored, deaggregated like the KCL."""
        out = []
        for shard in self.shards:
            for pk, data, _ in shard.records:
                for r in _wire.deaggregate(data, pk):
                    stored = StoredUserRecord(
                        r.partition_key, r.explicit_hash_key, r.data, shard.shard_id
                    )
                    out.append(stored)
        return out


def hash_of(partition_key: str) -> int:
    """The hash key Kinesis derives from ``partition_key`` (MD5, big-endian)."""
    return int.from_bytes(hashlib.md5(partition_key.encode()).digest(), "big")
