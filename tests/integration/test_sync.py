"""SyncProducer end to end against the local emulator: many threads, the stream read back.

As in test_end_to_end.py, "nothing lost" is judged from the stream itself: every shard is read
back with GetRecords and deaggregated, and each user record must be there exactly once, with
its partition key and data, in the shard whose hash key range holds it. The SyncProducer runs
asyncio or trio underneath; the test itself is plain threads.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from anykpl import BatchResult, RecordResult
from anykpl._sync import SyncProducer
from anykpl.errors import InvalidRecordError, ProducerClosedError

from .test_end_to_end import (
    MAX_HASH_KEY,
    Sent,
    assert_success,
    check_read_back,
    make_sent,
    read_stream,
)

THREADS = 12
PER_THREAD = 250
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.timeout(60)
def test_many_threads_every_record_arrives_once(
    backend: str, make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    rng = random.Random(20240607)
    keys = [f"sensor-{i:03d}" for i in range(300)]
    sent: dict[int, Sent] = {}
    for uid in range(THREADS * PER_THREAD):
        explicit_hash_key = str(rng.randint(0, MAX_HASH_KEY)) if rng.random() < 0.05 else None
        sent[uid] = make_sent(
            uid,
            keys[uid % len(keys)],
            size=rng.randint(80, 120),
            explicit_hash_key=explicit_hash_key,
        )
    uids = list(sent)
    rng.shuffle(uids)
    shares = [uids[t::THREADS] for t in range(THREADS)]

    results: dict[int, RecordResult] = {}
    futures: dict[int, Future[RecordResult]] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()

    with SyncProducer(
        backend=backend, record_max_buffered_time=0.02, close_timeout=10.0, **producer_options
    ) as producer:

        def worker(share: list[int]) -> None:
            try:
                for n, uid in enumerate(share):
                    record = sent[uid]
                    args = (stream, record.data, record.partition_key, record.explicit_hash_key)
                    if n % 25 == 0:
                        result = producer.put_record(*args, timeout=30)
                        with lock:
                            results[uid] = result
                    else:
                        future = producer.submit(*args)
                        with lock:
                            futures[uid] = future
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(share,)) for share in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        producer.flush(timeout=30)
        assert all(future.done() for future in futures.values())
        for uid, future in futures.items():
            results[uid] = future.result()
        assert producer.statistics().outstanding_records == 0

    assert len(results) == len(sent)
    for result in results.values():
        assert_success(result)

    arrived = check_read_back(read_stream(kinesis_client, stream), sent)
    missing = set(sent) - set(arrived)
    duplicated = {uid: n for uid, n in arrived.items() if n > 1}
    assert not missing, f"{len(missing)} records lost, e.g. {sorted(missing)[:10]}"
    assert not duplicated, f"{len(duplicated)} records duplicated, e.g. {duplicated}"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.timeout(60)
def test_submit_many_from_threads_delivers_every_batch(
    backend: str, make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    sent = {uid: make_sent(uid, f"device-{uid % 97}") for uid in range(4 * 6 * 250 + 1)}
    final = sent[4 * 6 * 250]
    uids = list(sent)[:-1]
    batches = [uids[start : start + 250] for start in range(0, len(uids), 250)]
    futures: list[Future[BatchResult]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    # a backlog of 300 records: most batches wait for room part of the way (backpressure)
    with SyncProducer(
        backend=backend, max_outstanding_records=300, close_timeout=10.0, **producer_options
    ) as producer:
        with pytest.raises(InvalidRecordError, match=r"records\[1\]"):
            producer.submit_many(stream, [b"fine", (b"no key", "")])

        def worker(mine: list[list[int]]) -> None:
            try:
                for batch in mine:
                    items = [(sent[uid].data, sent[uid].partition_key) for uid in batch]
                    future = producer.submit_many(stream, items)
                    with lock:
                        futures.append(future)
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(batches[t::4],)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures
        # the last batch is left to the close: its future completes as the producer flushes
        last = producer.submit_many(stream, [(final.data, final.partition_key)])
    assert last.result(timeout=0) == BatchResult(1, 0, ())
    assert [future.result(timeout=30) for future in futures] == [BatchResult(250, 0, ())] * 24
    with pytest.raises(ProducerClosedError):
        producer.submit_many(stream, [b"late"])

    arrived = check_read_back(read_stream(kinesis_client, stream), sent)
    assert set(arrived) == set(sent)
    assert set(arrived.values()) == {1}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.timeout(60)
def test_a_script_that_forgets_close_loses_nothing(
    backend: str, make_stream: Any, kinesis_client: Any, moto_endpoint: str
) -> None:
    # The emulator by host name, not by address: the producer's first connection then resolves
    # it (on asyncio through the loop's default executor) while the interpreter exits, since
    # the script ends before the shard map or any batch has gone out.
    endpoint = moto_endpoint.replace("127.0.0.1", "localhost")
    stream = make_stream(2)
    sent = {uid: make_sent(uid, f"key-{uid}") for uid in range(50)}
    records = [(record.data, record.partition_key) for record in sent.values()]
    script = textwrap.dedent(
        f"""
        from anykpl import SyncProducer

        producer = SyncProducer(
            backend={backend!r},
            region="us-east-1",
            endpoint_url={endpoint!r},
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            close_timeout=20.0,
        )
        for data, partition_key in {records!r}:
            producer.submit({stream!r}, data, partition_key=partition_key)
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    arrived = check_read_back(read_stream(kinesis_client, stream), sent)
    missing = set(sent) - set(arrived)
    assert not missing, f"{len(missing)} records lost; the script said: {completed.stderr}"
    assert all(n == 1 for n in arrived.values()), arrived


def test_flush_of_one_stream(make_stream: Any, producer_options: dict[str, Any]) -> None:
    first, second = make_stream(1), make_stream(1)
    # the KPL's batching: records wait for their buffered time unless flushed
    options = {
        **producer_options,
        "record_max_buffered_time": 30.0,
        "record_ttl": 120.0,
        "adaptive_batching": False,
    }
    with SyncProducer(**options) as producer:
        warm = [producer.submit(s, b"warm", "k") for s in (first, second)]
        producer.flush()
        assert all(f.result().success for f in warm)
        ones = [producer.submit(first, b"1", f"k{i}") for i in range(10)]
        twos = [producer.submit(second, b"2", f"k{i}") for i in range(10)]
        producer.flush(timeout=10, stream=first)
        assert all(f.done() and f.result().success for f in ones)
        assert not any(f.done() for f in twos)
        producer.flush(timeout=10)
        assert all(f.done() and f.result().success for f in twos)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_outstanding_records_and_the_oldest_records_age(
    backend: str, make_stream: Any, producer_options: dict[str, Any]
) -> None:
    """SyncProducer has the KPL's getOutstandingRecordsCount and getOldestRecordTimeInMillis
    too (read in the producer's thread), and keeps them as close left them."""
    stream = make_stream(1)
    options = {
        **producer_options,
        "record_max_buffered_time": 30.0,
        "record_ttl": 120.0,
        "adaptive_batching": False,
    }
    producer = SyncProducer(backend=backend, **options)
    with producer:
        assert (producer.outstanding_records, producer.oldest_record_age) == (0, 0.0)
        futures = [producer.submit(stream, b"x", f"k{i}") for i in range(5)]
        time.sleep(0.5)
        assert producer.outstanding_records == 5
        assert 0.4 <= producer.oldest_record_age < 10.0
        producer.flush(timeout=10)
        assert all(f.result().success for f in futures)
        assert (producer.outstanding_records, producer.oldest_record_age) == (0, 0.0)
    assert (producer.outstanding_records, producer.oldest_record_age) == (0, 0.0)
