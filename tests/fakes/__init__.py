"""Fakes of the AWS services the producer talks to, for unit tests: no network, no event-loop
specifics. One module per fake; integration tests use the emulator or moto's server instead.

- ``kinesis``: FakeKinesis, the producer's Transport over shards with hash ranges, with faults
  and throttling on demand, and helpers to lay out and read back shards;
- ``gated``: GatedKinesis, a FakeKinesis whose PutRecords calls wait at a gate, and
  LateMapKinesis, one whose ListShards answers late;
- ``s3``: FakeS3, a bucket with S3's conditional writes and clock, for the fleet.

Service limits (the hash-key space, shard limits) come from ``anykpl._core._limits``, never
re-declared. The ``fake_kinesis`` fixture is in ``tests/conftest.py``.
"""

from __future__ import annotations

from .gated import GatedKinesis, LateMapKinesis
from .kinesis import FakeKinesis, FakeShard, StoredUserRecord, even_ranges, hash_of
from .s3 import SERVER_EPOCH, FakeBody, FakeS3

__all__ = (
    "SERVER_EPOCH",
    "FakeBody",
    "FakeKinesis",
    "FakeS3",
    "FakeShard",
    "GatedKinesis",
    "LateMapKinesis",
    "StoredUserRecord",
    "even_ranges",
    "hash_of",
)
