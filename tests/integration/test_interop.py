"""Interop: the producer against kinesalite and kinesis-mock, with a reshard mid-run (issue 11).

Both emulators are installed from npm (pinned versions, cached per machine: see
``interop_servers``) and started on 127.0.0.1. Each run puts a few thousand records of mixed
sizes (some with explicit hash keys, a few too large to aggregate) through the public API at a
steady pace, reshards the stream while they flow — SplitShard on kinesalite, which has no
UpdateShardCount; UpdateShardCount 2 → 4 on kinesis-mock — then reads every shard back, closed
parents included, and deaggregates with AWS's ``aws_kinesis_agg``. Judged from the stream:

- every record succeeds, and none is missing: the Kinesis record its result names (shard,
  sequence number, sub-sequence number) holds it;
- none is misplaced: that copy is one a KCL reader keeps — the record's effective hash key (its
  explicit hash key, or the MD5 of its partition key) lies in the shard's range, and so does
  every other user record of its aggregate (the KCL drops a whole aggregate otherwise);
- no record has more stored copies than attempts (each attempt puts at most one copy);
- a copy a KCL reader keeps is a duplicate only after an attempt whose outcome was unknown
  (the service may have stored it): a ``Wrong Shard`` retry of a copy the KCL would keep is a
  needless duplicate.

Another puts a few thousand ``(data, partition_key)`` records with ``submit_many`` in batches
of 500 once the shard map is ready, so they take the column path, and judges them from the
stream the same way: each stored exactly once, under its own key, where its handle says, in an
aggregate a KCL reader keeps.

Only a machine without node or npm skips this module; a failed install fails it.
"""

from __future__ import annotations

import base64
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import boto3
import pytest
from aws_kinesis_agg import deaggregator, messages_pb2

from anykpl import PendingBatch, PendingRecord, Producer, RecordResult, errors
from anykpl._core._limits import MAX_HASH_KEY

from . import interop_servers
from .interop_servers import CREDENTIALS, REGION
from .test_end_to_end import md5_hash_key, uid_of

pytestmark = pytest.mark.anyio

MISSING = interop_servers.missing_tools()
if MISSING:
    pytest.skip(
        f"the interop tests need node and npm to install kinesalite and kinesis-mock; "
        f"{' and '.join(MISSING)} not found on PATH",
        allow_module_level=True,
    )

RECORDS = 3000


# -- the emulators ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def npm_prefix() -> Path:
    started = time.monotonic()
    prefix = interop_servers.install()
    print(f"interop emulators ready in {prefix} ({time.monotonic() - started:.1f} s)")
    return prefix


@pytest.fixture(scope="module", params=["kinesalite", "kinesis-mock"])
def server(
    request: pytest.FixtureRequest, npm_prefix: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[interop_servers.Server]:
    workdir = tmp_path_factory.mktemp(request.param)
    with interop_servers.run(request.param, npm_prefix, workdir) as running:
        yield running


def client_for(url: str) -> Any:
    return boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)


def wait_active(client: Any, stream: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        time.sleep(0.02)
    raise AssertionError(f"{stream} was not ACTIVE within {timeout:.0f} s")


async def new_stream(server: interop_servers.Server, shards: int) -> tuple[Any, str]:
    """A client of ``server`` and the name of a new stream of ``shards`` shards, ACTIVE."""
    stream = f"interop-{random.randrange(1 << 32):08x}"
    client = client_for(server.url)
    client.create_stream(StreamName=stream, ShardCount=shards)
    await anyio.to_thread.run_sync(wait_active, client, stream)
    return client, stream


def open_shards(client: Any, stream: str) -> list[dict[str, Any]]:
    shards = client.list_shards(StreamName=stream)["Shards"]
    return [s for s in shards if "EndingSequenceNumber" not in s["SequenceNumberRange"]]


def reshard(name: str, client: Any, stream: str) -> list[str]:
    """Double the stream's shards; returns what was done. kinesalite has no UpdateShardCount
    (UnknownOperationException), so it splits each open shard at its middle, one at a time
    (the stream is UPDATING meanwhile); kinesis-mock scales uniformly."""
    done = []
    if name == "kinesis-mock":
        client.update_shard_count(
            StreamName=stream, TargetShardCount=4, ScalingType="UNIFORM_SCALING"
        )
        done.append("UpdateShardCount 2 -> 4")
    else:
        for shard in open_shards(client, stream):
            start = int(shard["HashKeyRange"]["StartingHashKey"])
            end = int(shard["HashKeyRange"]["EndingHashKey"])
            client.split_shard(
                StreamName=stream,
                ShardToSplit=shard["ShardId"],
                NewStartingHashKey=str((start + end + 1) // 2),
            )
            done.append(f"SplitShard {shard['ShardId']}")
            wait_active(client, stream)
    wait_active(client, stream)
    return done


# -- what was sent ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    partition_key: str
    explicit_hash_key: str | None
    data: bytes

    @property
    def hash_key(self) -> int:
        if self.explicit_hash_key is not None:
            return int(self.explicit_hash_key)
        return md5_hash_key(self.partition_key)


def partition_keys(count: int) -> list[str]:
    """``count`` partition keys; one in ten has characters that JSON escapes (the producer
    writes PutRecords bodies itself, see _transport._botocore.put_records_body: a raw record
    carries its key in the request) and characters of several bytes in UTF-8."""
    return [f"device-{i:03d}" + ("" if i % 10 else ' "d\u00e9\\\U0001f600\t') for i in range(count)]


def numbered(uid: int, size: int, rng: random.Random) -> bytes:
    """``size`` random bytes (at least the id's 8) that start with the record's id."""
    head = f"{uid:07d}|".encode()
    return head + rng.randbytes(max(0, size - len(head)))


def workload(seed: int) -> dict[int, Sent]:
    """Mixed sizes: mostly small, some of a few KiB, a few over the 50 KiB aggregate limit;
    one in ten with an explicit hash key. The data starts with the record's id."""
    rng = random.Random(seed)
    keys = partition_keys(400)
    sent = {}
    for uid in range(RECORDS):
        roll = rng.random()
        size = (
            rng.randint(60_000, 80_000)
            if roll < 0.005
            else rng.randint(1_000, 8_000)
            if roll < 0.1
            else rng.randint(10, 300)
        )
        data = numbered(uid, size, rng)
        ehk = str(rng.randint(0, MAX_HASH_KEY)) if rng.random() < 0.1 else None
        sent[uid] = Sent(rng.choice(keys), ehk, data)
    return sent


# -- reading back, as a KCL reader would ------------------------------------------------


@dataclass(frozen=True)
class Copy:
    """One stored copy of a user record."""

    uid: int
    shard_id: str
    sequence_number: str
    sub_sequence_number: int
    kept: bool  # a KCL reader delivers it (it and its aggregate lie in the shard's range)
    in_range: bool  # its own hash key lies in the shard's range


def read_stream(client: Any, stream: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every shard (closed parents too) from TRIM_HORIZON to its end: a closed shard ends when
    NextShardIterator is gone, an open one at an empty response 0 ms behind the tip."""
    shards = {s["ShardId"]: s for s in client.list_shards(StreamName=stream)["Shards"]}
    records = []
    for shard_id in shards:
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        for _ in range(10_000):
            if not iterator:
                break
            response = client.get_records(ShardIterator=iterator, Limit=10_000)
            records.extend({**r, "ShardId": shard_id} for r in response["Records"])
            iterator = response.get("NextShardIterator")
            if not response["Records"] and response.get("MillisBehindLatest", 0) == 0:
                break
        else:
            raise AssertionError(f"{shard_id} never reached its end")
    return shards, records


def user_records(record: dict[str, Any]) -> tuple[bool, list[tuple[str, str | None, bytes]]]:
    """Whether a Kinesis record is an aggregate, and the (partition key, explicit hash key,
    data) of each of its user records, deaggregated by ``aws_kinesis_agg`` (which applies the
    KCL's checks: magic, length, MD5). Its deaggregator reports EHK table entry 0 for records
    without an EHK index where the KCL reports none, so whether a record has one is read from
    the same protobuf message."""
    found = list(deaggregator.iter_deaggregate_records([record], data_format="Boto3"))
    if not found[0]["kinesis"].get("aggregated"):
        return False, [(record["PartitionKey"], None, bytes(record["Data"]))]
    message = messages_pb2.AggregatedRecord.FromString(bytes(record["Data"])[4:-16])
    users = []
    for user, inner in zip(found, message.records, strict=True):
        has_ehk = inner.HasField("explicit_hash_key_index")
        users.append(
            (
                user["kinesis"]["partitionKey"],
                user["kinesis"]["explicitHashKey"] if has_ehk else None,
                base64.b64decode(user["kinesis"]["data"]),
            )
        )
    return True, users


def stored_copies(
    shards: dict[str, dict[str, Any]], records: list[dict[str, Any]], sent: dict[int, Sent]
) -> dict[int, list[Copy]]:
    """Every stored copy of every user record, by record id."""
    copies: dict[int, list[Copy]] = {}
    for record in records:
        shard_id = record["ShardId"]
        start = int(shards[shard_id]["HashKeyRange"]["StartingHashKey"])
        end = int(shards[shard_id]["HashKeyRange"]["EndingHashKey"])
        aggregated, users = user_records(record)
        found = []
        for partition_key, explicit_hash_key, data in users:
            uid = int(data.split(b"|", 1)[0])
            original = sent[uid]
            assert (partition_key, data) == (original.partition_key, original.data), uid
            if aggregated:
                # the EHK an aggregate carries is the one a KCL reader goes by
                assert explicit_hash_key == original.explicit_hash_key, uid
                hash_key = (
                    int(explicit_hash_key)
                    if explicit_hash_key is not None
                    else md5_hash_key(partition_key)
                )
            else:
                hash_key = original.hash_key  # GetRecords does not return a raw record's EHK
            found.append((uid, start <= hash_key <= end))
        kept = all(in_range for _, in_range in found)  # the KCL drops a whole aggregate
        for index, (uid, in_range) in enumerate(found):
            copies.setdefault(uid, []).append(
                Copy(uid, shard_id, record["SequenceNumber"], index, kept, in_range)
            )
    return copies


# -- the test -----------------------------------------------------------------------------


def outcome(handle: PendingRecord) -> RecordResult:
    try:
        return handle.result()
    except errors.RecordFailedError as exc:
        return exc.result


def acknowledged_copy(result: RecordResult, mine: list[Copy]) -> Copy | None:
    """The stored copy a successful result names (shard, sequence number, sub-sequence
    number), if it is there."""
    named = (result.shard_id, result.sequence_number, result.sub_sequence_number)
    for copy in mine:
        if (copy.shard_id, copy.sequence_number, copy.sub_sequence_number) == named:
            return copy
    return None


# codes after which the record may have been stored anyway (the request's fate is unknown);
# the others say it was not stored, or (Wrong Shard) stored where a KCL reader drops it
NOT_STORED = {
    errors.WRONG_SHARD,
    errors.EXPIRED,
    "ProvisionedThroughputExceededException",
    "ResourceNotFoundException",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("aggregation", "first_keys"),
    [(True, False), (False, False), (True, True)],
    # first-keys: aggregates under their first user records' keys (container_key_from_records)
    ids=["aggregated", "raw", "first-keys"],
)
async def test_reshard_mid_run_loses_misplaces_and_multiplies_nothing(
    server: interop_servers.Server, aggregation: bool, first_keys: bool, anyio_backend: str
) -> None:
    client, stream = await new_stream(server, shards=2)
    sent = workload(seed=11 + aggregation)
    handles: dict[int, PendingRecord] = {}
    resharded: list[str] = []
    started = time.monotonic()

    async with Producer(
        region=REGION,
        endpoint_url=server.url,
        aggregation_enabled=aggregation,
        container_key_from_records=first_keys,
        record_max_buffered_time=0.05,
        **CREDENTIALS,
    ) as producer:

        async def put(uids: range) -> None:
            for uid in uids:
                record = sent[uid]
                handles[uid] = await producer.submit(
                    stream, record.data, record.partition_key, record.explicit_hash_key
                )
                if uid % 50 == 0:
                    await anyio.sleep(0.02)  # a steady source over about a second and a half

        third = RECORDS // 3
        await put(range(third))
        async with anyio.create_task_group() as tg:
            tg.start_soon(put, range(third, RECORDS))
            resharded = await anyio.to_thread.run_sync(
                partial(reshard, server.name, client, stream)
            )
        await producer.flush()
    put_seconds = time.monotonic() - started

    results = {uid: outcome(handle) for uid, handle in handles.items()}
    shards, records = await anyio.to_thread.run_sync(read_stream, client, stream)
    copies = stored_copies(shards, records, sent)

    where = f"{server.name}, {anyio_backend}, aggregation {'on' if aggregation else 'off'}"
    closed = {s for s, d in shards.items() if "EndingSequenceNumber" in d["SequenceNumberRange"]}
    assert (len(closed), len(shards)) == (2, 6), f"{where}: no reshard? {resharded} {shards}"
    # mid-run: records were acknowledged both in the parents and in the children
    landed = {r.shard_id for r in results.values() if r.success}
    assert landed & closed, (
        f"{where}: nothing landed before the reshard: {sorted(map(str, landed))}"
    )
    assert landed - closed, f"{where}: nothing landed after the reshard: {sorted(map(str, landed))}"

    failed = {uid: r.attempts[-1].error_code for uid, r in results.items() if not r.success}
    missing, misplaced, multiplied, duplicated = [], [], [], []
    for uid, result in results.items():
        mine = copies.get(uid, [])
        if len(mine) > len(result.attempts):
            multiplied.append((uid, len(mine), [a.error_code for a in result.attempts]))
        unknown_fate = sum(
            not a.success and a.error_code not in NOT_STORED for a in result.attempts
        )
        kept = [c for c in mine if c.kept]
        if len(kept) > 1 + unknown_fate:
            duplicated.append(
                (
                    uid,
                    [(c.shard_id, c.sub_sequence_number) for c in kept],
                    [a.error_code for a in result.attempts],
                )
            )
        if not result.success:
            continue
        acknowledged = acknowledged_copy(result, mine)
        if acknowledged is None:
            missing.append(uid)
        elif not acknowledged.kept:
            misplaced.append((uid, result.shard_id, acknowledged.in_range))

    codes = sorted({str(code) for code in failed.values()})
    report = (
        f"{where} ({RECORDS} records, {sum(len(c) for c in copies.values())} copies stored, "
        f"{resharded}, {put_seconds:.1f} s): {len(failed)} failed {codes}, "
        f"{len(missing)} successes missing {missing[:5]}, "
        f"{len(misplaced)} misplaced (uid, shard, own key in range) {misplaced[:5]}, "
        f"{len(multiplied)} with more copies than attempts (uid, copies, attempts) "
        f"{multiplied[:3]}, {len(duplicated)} needless duplicates a KCL reader keeps "
        f"(uid, copies, attempts) {duplicated[:3]}"
    )
    print(report)
    assert len(results) == RECORDS
    assert not failed, report
    assert not missing, report
    assert not misplaced, report
    assert not multiplied, report
    assert not duplicated, report


# -- submit_many's column path ------------------------------------------------------------

COLUMN_RECORDS = 4001  # one put first (the shard map ready), then 8 batches of 500
COLUMN_BATCH = 500


def firehose_workload(seed: int) -> dict[int, Sent]:
    """(data, partition key) only: from the id's 8 bytes to a few hundred, one in ten of a few
    KiB, under 300 keys."""
    rng = random.Random(seed)
    keys = partition_keys(300)
    return {
        uid: Sent(
            rng.choice(keys),
            None,
            numbered(
                uid, rng.randint(1_000, 5_000) if rng.random() < 0.1 else rng.randint(8, 400), rng
            ),
        )
        for uid in range(COLUMN_RECORDS)
    }


@pytest.mark.timeout(60)
async def test_submit_many_in_columns_stores_each_record_once_where_its_result_says(
    server: interop_servers.Server, anyio_backend: str
) -> None:
    """Batches of ``(data, partition_key)`` submitted once the shard map is ready take
    the column path (aggregated from columns, handles made on first use). Judged from the
    stream: each record is stored exactly once, under its own key, in the Kinesis record and at
    the sub-sequence number its handle names (made after the batch was done, or, for a few in
    every other batch, while their records were in flight), in an aggregate a KCL reader
    keeps."""
    client, stream = await new_stream(server, shards=4)
    sent = firehose_workload(seed=13)
    batches: list[tuple[range, PendingBatch]] = []
    early: list[tuple[int, PendingRecord]] = []
    started = time.monotonic()

    async with Producer(
        region=REGION, endpoint_url=server.url, record_max_buffered_time=0.05, **CREDENTIALS
    ) as producer:
        warm_up = await producer.put_record(stream, sent[0].data, sent[0].partition_key)
        for start in range(1, COLUMN_RECORDS, COLUMN_BATCH):
            uids = range(start, min(start + COLUMN_BATCH, COLUMN_RECORDS))
            # a batch takes the column path only with room for all of it at once (else it is
            # admitted record by record, waiting for room): two batches at most outstanding,
            # about 500 KB, stay within a stream's first bound (UNPROVEN_RATE over the backlog
            # horizon, 960 KiB), and the next one's items still share aggregates with them
            if len(batches) >= 2:
                await batches[-2][1]
            admitted = len(producer._intake.column_batches)
            batch = await producer.submit_many(
                stream, [(sent[uid].data, sent[uid].partition_key) for uid in uids]
            )
            assert len(producer._intake.column_batches) == admitted + 1, (
                f"batch {len(batches)} did not take the column path"
            )
            if len(batches) % 2:  # a few handles made while their records are in flight
                early.extend((uids[i], batch[i]) for i in range(0, len(uids), 97))
            batches.append((uids, batch))
        outcomes = [await batch for _, batch in batches]
    put_seconds = time.monotonic() - started

    handles = [
        (uid, handle) for uids, batch in batches for uid, handle in zip(uids, batch, strict=True)
    ]
    assert [uid_of(handle.data) for _, handle in handles] == list(range(1, COLUMN_RECORDS))
    # every handle's result: the warm-up's, each made after its batch was done, and each made
    # while its record was in flight
    results = [(0, warm_up), *((uid, outcome(handle)) for uid, handle in handles + early)]
    shards, records = await anyio.to_thread.run_sync(read_stream, client, stream)
    copies = stored_copies(shards, records, sent)  # checks each copy's key and data

    failed = {uid: r.attempts[-1].error_code for uid, r in results if not r.success}
    missing, misplaced = [], []
    for uid, result in results:
        acknowledged = acknowledged_copy(result, copies.get(uid, []))
        if acknowledged is None:
            missing.append(
                (uid, result.shard_id, result.sequence_number, result.sub_sequence_number)
            )
        elif not acknowledged.kept:
            misplaced.append((uid, result.shard_id, acknowledged.in_range))
    duplicated = {uid: len(mine) for uid, mine in copies.items() if len(mine) > 1}
    dropped = [c for mine in copies.values() for c in mine if not c.kept]
    aggregates = sum(user_records(r)[0] for r in records)
    report = (
        f"{server.name}, {anyio_backend} ({COLUMN_RECORDS} records, {len(records)} Kinesis "
        f"records of which {aggregates} aggregates, {sum(map(len, copies.values()))} copies "
        f"stored, in {sorted({r['ShardId'] for r in records})}, {put_seconds:.1f} s): "
        f"{len(failed)} failed {sorted(map(str, set(failed.values())))}, "
        f"{len(missing)} missing (uid, shard, sequence number, sub-sequence number) {missing[:5]}, "
        f"{len(misplaced)} misplaced (uid, shard, own key in range) {misplaced[:5]}, "
        f"{len(dropped)} copies in aggregates a KCL reader drops {dropped[:3]}, "
        f"{len(duplicated)} stored more than once (uid: copies) {list(duplicated.items())[:5]}"
    )
    print(report)
    assert [(o.succeeded, o.failed, o.failures) for o in outcomes] == [
        (len(u), 0, ()) for u, _ in batches
    ]
    assert not failed, report
    assert not missing, report
    assert not misplaced, report
    assert not dropped, report
    assert not duplicated, report
    # read back in full, from every shard, and aggregated
    assert sorted(copies) == list(range(COLUMN_RECORDS)), report
    assert len(shards) == 4, report
    assert {r["ShardId"] for r in records} == set(shards), report
    assert len(records) < COLUMN_RECORDS // 10, report  # aggregated, many to a Kinesis record
