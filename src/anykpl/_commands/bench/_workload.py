"""One benchmark case: a lone producer saturating a fresh stream on the emulator.

The workload is closed-loop. ``submitters`` tasks call :meth:`Producer.submit` back to back;
``submit`` returns at once while the producer has room and waits when it has
``max_outstanding_records``/``max_outstanding_bytes`` admitted (backpressure). So the offered
load is always above the stream's capacity and the producer's limiter, not the workload, sets
the pace; the outstanding limits are sized to ``buffer`` seconds of the stream's capacity,
which by Little's law is also about how long a record waits in a saturated producer.

Each submitter cycles through partition keys chosen so that every shard gets the same number
of records (a lone producer's buffer is shared by every shard: with skewed keys it fills with
the busier shard's records and starves the other, which would measure the workload, not the
producer).

The case runs ``warmup`` seconds unmeasured (the shard map loads, connections open, the token
buckets settle), then snapshots the emulator's statistics, the producer's counters and this
process's CPU time, runs ``duration`` seconds, and snapshots again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..._core import _limits
from ..._core._metrics import MetricKey
from ..._core._records import partition_key_hash
from ..._runtime._handle import PendingRecord
from ..._runtime._producer import Producer
from ..._runtime._statistics import ProducerStatistics
from ...config import ProducerConfig

__all__ = ("Case", "CaseRun", "Snapshot", "expected_user_rate", "keys_per_shard", "run_case")

#: Partition keys per shard the workload cycles through.
KEYS_PER_SHARD = 64
#: Latency samples to aim for per case; every n-th record is sampled to stay near it.
TARGET_SAMPLES = 20_000


@dataclass(frozen=True, slots=True)
class Case:
    """One cell of the benchmark grid, and how to run it."""

    record_size: int
    aggregation: bool
    shards: int
    duration: float
    warmup: float
    submitters: int
    buffer: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Counters at one edge of the measured window."""

    clock: float
    cpu: float
    user_records_put: float
    kinesis_records_put: float
    errors_by_code: Mapping[str, int]
    emulator: Mapping[str, Any] | None
    #: the producer's own count per shard of the stream: shard id -> (Kinesis records put,
    #: their data bytes), from ``statistics().metrics`` (what an outside endpoint is measured by)
    shards: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class CaseRun:
    """The raw measurements of one case, before analysis."""

    case: Case
    stream: str
    max_outstanding_records: int
    max_outstanding_bytes: int
    start: Snapshot
    end: Snapshot
    #: the emulator's statistics once the producer has closed (the whole case)
    final_emulator: Mapping[str, Any] | None
    #: the producer's errors once it has closed (the whole case)
    final_errors_by_code: Mapping[str, int]
    #: user records admitted during the measured window
    submitted: int
    #: call-to-result seconds of the sampled records that succeeded
    latencies: list[float] = field(default_factory=list)
    #: admission-to-result seconds of the same records (time inside the producer)
    producer_latencies: list[float] = field(default_factory=list)
    #: sampled records that failed
    failed_samples: int = 0


def keys_per_shard(ranges: Sequence[tuple[int, int]], count: int = KEYS_PER_SHARD) -> list[str]:
    """``count`` partition keys for each hash key range, interleaved shard by shard (the first
    key of each shard, then the second of each, ...), so that cycling through the list sends
    every shard the same number of records."""
    buckets: list[list[str]] = [[] for _ in ranges]
    n = 0
    while min(len(b) for b in buckets) < count:
        key = f"k{n:06d}"
        n += 1
        hash_key = partition_key_hash(key)
        for bucket, (low, high) in zip(buckets, ranges, strict=True):
            if low <= hash_key <= high and len(bucket) < count:
                bucket.append(key)
                break
        if n > 1000 * count * len(ranges):
            raise RuntimeError("could not find partition keys for every shard")
    return [bucket[i] for i in range(count) for bucket in buckets]


def expected_user_rate(record_size: int, key_size: int, aggregation: bool) -> float:
    """User records per second one shard can take: bytes-bound when records aggregate,
    otherwise the lower of the two limits."""
    size = record_size + key_size
    by_bytes = _limits.SHARD_BYTES_PER_SECOND / size
    if aggregation and size < ProducerConfig().aggregation_max_size:
        return by_bytes
    return min(float(_limits.SHARD_RECORDS_PER_SECOND), by_bytes)


#: Where the emulator's producer sends, and with what: the spawned emulator's defaults.
EMULATOR_CONNECTION: Mapping[str, Any] = {
    "region": "us-east-1",
    "aws_access_key_id": "bench",
    "aws_secret_access_key": "bench",
}


def producer_config(
    case: Case,
    endpoint_url: str | None,
    key_size: int,
    connection: Mapping[str, Any] = EMULATOR_CONNECTION,
) -> ProducerConfig:
    """The producer under test: defaults, except the outstanding limits (``buffer`` seconds of
    the stream's capacity), the endpoint, and ``connection`` (region and credentials: the
    emulator's, or for an outside endpoint the region and botocore's chain)."""
    rate = expected_user_rate(case.record_size, key_size, case.aggregation) * case.shards
    records = max(1, round(case.buffer * rate))
    return ProducerConfig(
        endpoint_url=endpoint_url,
        aggregation_enabled=case.aggregation,
        max_outstanding_records=records,
        max_outstanding_bytes=max(1024, records * (case.record_size + key_size)),
        **connection,
    )


def _global(statistics: ProducerStatistics, name: str) -> float:
    return float(statistics.metrics.get(MetricKey(name), 0.0))


def _shard_counts(statistics: ProducerStatistics, stream: str) -> dict[str, tuple[float, float]]:
    counts: dict[str, list[float]] = {}
    for key, value in statistics.metrics.items():
        if key.stream != stream or key.shard is None or key.error_code is not None:
            continue
        if key.name == "KinesisRecordsPut":
            counts.setdefault(key.shard, [0.0, 0.0])[0] += value
        elif key.name == "KinesisRecordsDataPut":
            counts.setdefault(key.shard, [0.0, 0.0])[1] += value
    return {shard: (records, data) for shard, (records, data) in sorted(counts.items())}


async def run_case(
    case: Case,
    endpoint_url: str | None,
    stream: str,
    keys: Sequence[str],
    emulator_stats: Callable[[], Mapping[str, Any] | None],
    connection: Mapping[str, Any] = EMULATOR_CONNECTION,
) -> CaseRun:
    """Drive one producer into ``stream`` for the warm-up and the measured window; returns the
    raw measurements. ``emulator_stats`` is called in a worker thread (it returns None for an
    outside endpoint, which is then measured by the producer's own counts)."""
    key_size = len(keys[0].encode())
    config = producer_config(case, endpoint_url, key_size, connection)
    data = bytes(case.record_size)
    total_expected = (
        expected_user_rate(case.record_size, key_size, case.aggregation)
        * case.shards
        * case.duration
    )
    sample_every = max(1, round(total_expected / TARGET_SAMPLES))
    samples: list[tuple[float, float, PendingRecord]] = []
    submitted = 0
    clock = anyio.current_time
    start_time = clock()
    window_start = start_time + case.warmup
    window_end = window_start + case.duration

    async def submit_forever(offset: int, producer: Producer) -> None:
        nonlocal submitted
        submit = producer.submit
        n = len(keys)
        i = offset
        countdown = sample_every
        while True:
            key = keys[i % n]
            i += 1
            countdown -= 1
            if countdown:
                await submit(stream, data, key)
                submitted += 1
                continue
            countdown = sample_every
            called = clock()
            pending = await submit(stream, data, key)
            submitted += 1
            if window_start <= called < window_end:
                samples.append((called, clock(), pending))

    async def snapshot(producer: Producer) -> Snapshot:
        emulator = await anyio.to_thread.run_sync(emulator_stats)
        statistics = producer.statistics()
        return Snapshot(
            clock=clock(),
            cpu=time.process_time(),
            user_records_put=_global(statistics, "UserRecordsPut"),
            kinesis_records_put=_global(statistics, "KinesisRecordsPut"),
            errors_by_code=dict(statistics.errors_by_code),
            emulator=emulator,
            shards=_shard_counts(statistics, stream),
        )

    async with Producer(config) as producer, anyio.create_task_group() as tg:
        for offset in range(case.submitters):
            # spread the submitters over the key list so they do not move in lockstep
            tg.start_soon(submit_forever, offset * len(keys) // case.submitters, producer)
        await anyio.sleep_until(window_start)
        start = await snapshot(producer)
        submitted_before = submitted
        await anyio.sleep_until(window_end)
        end = await snapshot(producer)
        submitted_in_window = submitted - submitted_before
        tg.cancel_scope.cancel()
        # leaving the producer flushes: every sampled record gets its result
    final_errors = dict(producer.statistics().errors_by_code)
    final_emulator = await anyio.to_thread.run_sync(emulator_stats)

    run = CaseRun(
        case=case,
        stream=stream,
        max_outstanding_records=config.max_outstanding_records,
        max_outstanding_bytes=config.max_outstanding_bytes,
        start=start,
        end=end,
        final_emulator=final_emulator,
        final_errors_by_code=final_errors,
        submitted=submitted_in_window,
    )
    for called, admitted, pending in samples:
        try:
            result = pending.result()
        except Exception:  # failed, or (never here) not done
            run.failed_samples += 1
            continue
        inside = sum(a.delay + a.duration for a in result.attempts)
        run.producer_latencies.append(inside)
        run.latencies.append(admitted - called + inside)
    return run
