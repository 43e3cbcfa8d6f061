"""Column batches against the emulator (in its own process), on both backends: a
``submit_many`` of ``(data, partition_key)`` pairs once the stream's shard map is ready takes
the column path (no record made per item, ``Intake.admit_columns``; each batch that does adds
one entry to the intake's ``column_batches``). Its records are put through injected faults,
failed by a close while they are in flight, and waited for by ``flush``.

Judged from the stream, read back and deaggregated by AWS's ``aws_kinesis_agg``
(``test_interop.stored_copies``, which checks each user record's key and data, and whether a
KCL reader keeps its copy), as ``test_interop`` judges it: each succeeded record is stored in
the Kinesis record, at the sub-sequence number, its handle names; no record has more copies
than attempts, nor a second copy a KCL reader keeps unless an attempt's fate was unknown.
"""

from __future__ import annotations

import re
from collections import Counter

import anyio
import boto3
import pytest

from anykpl import PendingBatch, Producer, RecordResult, errors
from anykpl.emulator import EmulatorClient, Faults, spawn

from .conftest import CREDENTIALS, REGION
from .test_end_to_end import payload, uid_of
from .test_interop import NOT_STORED, Sent, acknowledged_copy, outcome, read_stream, stored_copies

pytestmark = pytest.mark.anyio

STREAM = "columns"
SHARDS = 4
BATCH = 500  # records of one submit_many


def column_workload(batches: int) -> dict[int, Sent]:
    """Record 0 (put alone first) and ``batches`` batches' worth more, of about 100 bytes under
    500 partition keys; each record's data starts with its id."""
    return {
        uid: Sent(f"device-{uid % 500}", None, payload(uid)) for uid in range(batches * BATCH + 1)
    }


def retrying_producer(url: str) -> Producer:
    """A producer against ``url`` with small aggregates (many Kinesis records to fail) and
    quick retries."""
    return Producer(
        region=REGION,
        endpoint_url=url,
        aggregation_max_size=4096,
        retry_backoff_initial=0.01,
        retry_backoff_max=0.05,
        **CREDENTIALS,
    )


async def submit_in_columns(
    producer: Producer, sent: dict[int, Sent]
) -> tuple[RecordResult, list[PendingBatch]]:
    """Put record 0 and wait for it (records wait for the shard map: it is ready once the put
    returns), then submit the others in batches of 500; each must take the column path."""
    first, *rest = sent.values()
    warm_up = await producer.put_record(STREAM, first.data, first.partition_key)
    batches = []
    for start in range(0, len(rest), BATCH):
        before = len(producer._intake.column_batches)
        items = [(s.data, s.partition_key) for s in rest[start : start + BATCH]]
        batches.append(await producer.submit_many(STREAM, items))
        assert len(producer._intake.column_batches) == before + 1, (
            f"batch {len(batches) - 1} went the per-record way"
        )
    return warm_up, batches


def results_of(warm_up: RecordResult, batches: list[PendingBatch]) -> dict[int, RecordResult]:
    """Every record's result by its id. Each batch is done, and its counts agree with its
    handles: each record is terminal once, a success or a RecordFailedError listed among the
    batch's failures."""
    results = {0: warm_up}
    for batch in batches:
        assert (batch.done(), batch.pending) == (True, 0)
        assert batch.succeeded + batch.failed == len(batch)
        assert all(handle.done() for handle in batch)
        summary = batch.result()
        outcomes = [outcome(handle) for handle in batch]
        failed_at = [position for position, result in enumerate(outcomes) if not result.success]
        assert (summary.succeeded, summary.failed) == (len(batch) - len(failed_at), len(failed_at))
        assert [position for position, _ in summary.failures] == failed_at
        for position in failed_at:
            with pytest.raises(errors.RecordFailedError):
                batch[position].result()
        for handle, result in zip(batch, outcomes, strict=True):
            results[uid_of(handle.data)] = result
    return results


async def check_stream(
    url: str, sent: dict[int, Sent], results: dict[int, RecordResult]
) -> dict[int, int]:
    """Read the stream back and judge it (see the module docstring); returns how many copies of
    each record id are stored."""
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
    shards, records = await anyio.to_thread.run_sync(read_stream, client, STREAM)
    copies = stored_copies(shards, records, sent)
    missing, misplaced, multiplied, duplicated = [], [], [], []
    for uid, result in results.items():
        mine = copies.get(uid, [])
        codes = [attempt.error_code for attempt in result.attempts]
        if len(mine) > len(result.attempts):
            multiplied.append((uid, len(mine), codes))
        unknown_fate = sum(
            not a.success and a.error_code not in NOT_STORED for a in result.attempts
        )
        if sum(copy.kept for copy in mine) > 1 + unknown_fate:
            duplicated.append((uid, len(mine), codes))
        if result.success:
            acknowledged = acknowledged_copy(result, mine)
            if acknowledged is None:
                missing.append((uid, result.shard_id, result.sequence_number))
            elif not acknowledged.kept:
                misplaced.append((uid, result.shard_id))
    assert not missing, f"{len(missing)} successes not where their handles say: {missing[:3]}"
    assert not misplaced, f"{len(misplaced)} successes a KCL reader drops: {misplaced[:3]}"
    assert not multiplied, f"{len(multiplied)} with more copies than attempts: {multiplied[:3]}"
    assert not duplicated, f"{len(duplicated)} needless duplicates: {duplicated[:3]}"
    return {uid: len(mine) for uid, mine in copies.items()}


@pytest.mark.timeout(60)
async def test_through_faults_each_column_record_is_put_where_its_handle_says() -> None:
    """10 % of the requests refused (half of them after storing their records), 5 % of the
    Kinesis records failed and 5 % throttled: every record of 8 column batches is put, the
    failed Kinesis records' items retried as records."""
    sent = column_workload(8)
    faults = Faults(error_rate=0.1, record_failure_rate=0.05, record_throttle_rate=0.05, seed=7)
    with spawn(streams={STREAM: SHARDS}, faults=faults) as url:
        async with Producer(
            region=REGION,
            endpoint_url=url,
            # small aggregates and requests: many of each (about 250 and 60), so each kind of
            # fault surely hits Kinesis records of column items
            aggregation_max_size=2048,
            collection_max_count=5,
            retry_backoff_initial=0.01,
            retry_backoff_max=0.05,
            **CREDENTIALS,
        ) as producer:
            warm_up, batches = await submit_in_columns(producer, sent)
            for batch in batches[::2]:
                list(batch)  # handles made while their records are in flight
            for batch in batches:
                await batch
        results = results_of(warm_up, batches)
        totals = EmulatorClient(url).stats()["totals"]
        copies = await check_stream(url, sent, results)
    column = [results[uid] for uid in sent if uid]
    retried = [result for result in column if len(result.attempts) > 1]
    codes = Counter(a.error_code for r in column for a in r.attempts if not a.success)
    report = (
        f"{len(retried)} of {len(column)} column records retried, failed attempts "
        f"{dict(codes)}, {sum(copies.values())} copies stored, emulator {totals}"
    )
    print(report)
    assert all(result.success for result in results.values()), report
    # the faults hit column items: requests refused (only they answer ServiceUnavailable),
    # Kinesis records failed and throttled, and a good share of the items were retried
    assert codes["ServiceUnavailable"], report
    assert codes["InternalFailure"], report
    assert totals["failed_records"] > 1, report  # more than the warm-up's
    assert codes[errors.THROTTLED], report
    assert totals["injected_throttled_records"] > 1, report
    assert len(retried) >= len(column) // 40, report


@pytest.mark.timeout(60)
async def test_closing_with_column_batches_in_flight_ends_each_record_once() -> None:
    """12 column batches in flight when the producer closes, with a close timeout (0.3 s)
    about as long as a request takes (0.2 to 0.4 s): the close ends every batch, some records
    put, the others failed as closed, most batches partly both, and nothing hangs."""
    sent = column_workload(12)
    faults = Faults(latency=0.2, latency_jitter=0.2, seed=3)
    with spawn(streams={STREAM: SHARDS}, faults=faults) as url:
        with anyio.fail_after(10):
            async with Producer(
                region=REGION,
                endpoint_url=url,
                close_timeout=0.3,
                # many Kinesis records in many requests, the close's flush sends them at once:
                # about half are answered within the close timeout
                aggregation_max_size=4096,
                collection_max_count=10,
                **CREDENTIALS,
            ) as producer:
                warm_up, batches = await submit_in_columns(producer, sent)
                list(batches[1])  # handles made while their records are in flight
                early = batches[5][250]
                assert sum(batch.pending for batch in batches) > len(sent) // 2
                closing = anyio.current_time()
            closed_in = anyio.current_time() - closing
            assert all(batch.done() for batch in batches)
            assert early.done()
            awaited = [await batch for batch in batches]
        assert awaited == [batch.result() for batch in batches]
        results = results_of(warm_up, batches)
        copies = await check_stream(url, sent, results)
    column = [results[uid] for uid in sent if uid]
    failed = [result for result in column if not result.success]
    for result in column:
        # a record ends with its deciding attempt (a late answer adds nothing)
        assert result.success == result.attempts[-1].success
    assert all(result.attempts[-1].error_code == errors.PRODUCER_CLOSED for result in failed)
    split = [(batch.succeeded, batch.failed) for batch in batches]
    report = (
        f"closed in {closed_in:.2f} s: {len(column) - len(failed)} column records put, "
        f"{len(failed)} failed, (put, failed) by batch {split}, "
        f"{sum(copies.values())} copies stored"
    )
    print(report)
    assert closed_in < 0.3 + 2, report
    assert 0 < len(failed) < len(column), report
    assert any(put and failed for put, failed in split), report


@pytest.mark.timeout(60)
async def test_flush_returns_once_every_column_batch_is_done() -> None:
    """Each request answered 0.2 s late, one Kinesis record in ten failed (its items retried as
    records): ``flush`` returns only when every batch is done."""
    sent = column_workload(8)
    faults = Faults(latency=0.2, record_failure_rate=0.1, seed=5)
    with spawn(streams={STREAM: SHARDS}, faults=faults) as url:
        async with retrying_producer(url) as producer:
            warm_up, batches = await submit_in_columns(producer, sent)
            early = batches[2][17]  # a handle made while its record is in flight
            assert sum(batch.pending for batch in batches) > len(sent) // 2
            await producer.flush()
            assert [batch.pending for batch in batches] == [0] * len(batches)
            assert all(batch.done() for batch in batches)
            assert early.done()
            results = results_of(warm_up, batches)
        await check_stream(url, sent, results)
    assert all(result.success for result in results.values())
    assert any(len(result.attempts) > 1 for result in results.values())


@pytest.mark.timeout(60)
async def test_flush_timeout_counts_the_column_records_not_yet_terminal() -> None:
    """Each request answered 0.5 s late, one Kinesis record in five failed (its items retried
    as records): ``flush(timeout=...)`` raises FlushTimeout naming how many records are not
    yet terminal, whether none was answered yet, some were answered while it waited, or
    failed items were already being retried as records when it began."""
    sent = column_workload(8)
    faults = Faults(latency=0.5, record_failure_rate=0.2, seed=5)
    with spawn(streams={STREAM: SHARDS}, faults=faults) as url:
        async with retrying_producer(url) as producer:
            warm_up, batches = await submit_in_columns(producer, sent)
            counted: list[tuple[int, int]] = []  # (what the message says, records pending)
            # timing out at about 0.2 s (no answer yet), 0.8 s (the first answers came at
            # 0.5 s; the failed items' retries are answered at about 1 s) and 0.9 s
            for timeout in (0.2, 0.6, 0.1):
                with pytest.raises(errors.FlushTimeout) as info:
                    await producer.flush(timeout=timeout)
                pending = sum(batch.pending for batch in batches)
                found = re.search(r"with (\d+) record\(s\) not yet terminal", str(info.value))
                assert found, info.value
                counted.append((int(found[1]), pending))
            await producer.flush()
            results = results_of(warm_up, batches)
        await check_stream(url, sent, results)
    assert all(result.success for result in results.values())
    column = len(sent) - 1
    assert counted[0][1] == column, counted
    assert 0 < counted[1][1] < column, counted
    assert 0 < counted[2][1] < column, counted
    assert [said for said, _ in counted] == [pending for _, pending in counted], counted


@pytest.mark.timeout(60)
async def test_a_streams_first_batches_go_in_columns_once_its_map_answers() -> None:
    """A producer whose first call on the stream is ``submit_many`` (each PutRecords answered
    0.05 s late): the first batch waits for the shard map, and every batch takes the column
    path; each record is stored where its handle says."""
    sent = column_workload(4)
    faults = Faults(latency=0.05, seed=9)
    records = list(sent.values())
    with spawn(streams={STREAM: SHARDS}, faults=faults) as url:
        async with retrying_producer(url) as producer:
            batches = []
            for start in range(0, len(records), BATCH):
                items = [(s.data, s.partition_key) for s in records[start : start + BATCH]]
                batches.append(await producer.submit_many(STREAM, items))
                assert len(producer._intake.column_batches) == len(batches), (
                    f"batch {len(batches) - 1} went the per-record way"
                )
            await producer.flush()
            results = {
                uid_of(handle.data): outcome(handle) for batch in batches for handle in batch
            }
        await check_stream(url, sent, results)
    assert len(results) == len(sent)
    assert all(result.success for result in results.values())
