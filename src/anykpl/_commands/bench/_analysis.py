"""The arithmetic of a benchmark case, with no I/O: percentiles, and a shard's achieved rates
and shares of its limits from the emulator's per-second rows.

A shard's write limits are two (records/s and bytes/s) and whichever the traffic comes closer
to is the one that binds: 100-byte records sent one per Kinesis record hit the record limit at
a tenth of the byte limit, the same records aggregated hit the byte limit. So a shard's
*utilisation* is the larger of its two shares, and the bench's bar (docs/bench.md: ≥ 97 % of
each shard's limit) is judged on the worst shard's utilisation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._core import _limits

if TYPE_CHECKING:
    from ._workload import CaseRun, Snapshot

__all__ = (
    "ShardWindow",
    "full_seconds",
    "percentiles",
    "per_100k",
    "shard_window",
    "summarise",
    "summarise_external",
)


def percentiles(
    values: Iterable[float], points: Sequence[float] = (50.0, 90.0, 99.0)
) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` of ``values``, linearly interpolated between
    the closest ranks (numpy's default method); ``None`` for each point when there are none."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for point in points:
        if not 0.0 <= point <= 100.0:
            raise ValueError(f"a percentile is in [0, 100], got {point}")
        name = f"p{point:g}"
        if not ordered:
            out[name] = None
            continue
        rank = (len(ordered) - 1) * point / 100.0
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        out[name] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


def full_seconds(start: float, end: float) -> range:
    """The whole seconds of emulator uptime that lie entirely inside ``[start, end]``: the
    per-second rows to count (a row's second ``s`` covers ``[s, s + 1)``)."""
    return range(math.ceil(start), math.floor(end))


@dataclass(frozen=True, slots=True)
class ShardWindow:
    """What one shard accepted over the measured seconds, against its limits.

    Attributes:
        seconds: how many whole seconds were measured.
        records_per_second: accepted Kinesis records per second, averaged over those seconds.
        bytes_per_second: accepted bytes (data + partition key) per second, likewise.
        record_share: ``records_per_second`` as a share of the record limit.
        byte_share: ``bytes_per_second`` as a share of the byte limit.
        utilisation: the larger of the two shares: the share of the limit that binds.
        binding_limit: ``"records"`` or ``"bytes"``, whichever share is larger.
        worst_second_utilisation: the lowest utilisation of any single measured second.
        throttled_records: records the shard throttled in those seconds.
        throttled_bytes: their bytes.
    """

    seconds: int
    records_per_second: float
    bytes_per_second: float
    record_share: float
    byte_share: float
    utilisation: float
    binding_limit: str
    worst_second_utilisation: float
    throttled_records: int
    throttled_bytes: int


def shard_window(
    rows: Iterable[Sequence[float]],
    seconds: range,
    limit_records: float,
    limit_bytes: float,
) -> ShardWindow:
    """Sum one shard's per-second rows ``[second, accepted_records, accepted_bytes,
    throttled_records, throttled_bytes]`` over ``seconds``; a second without a row saw no
    traffic and counts as zero (the emulator only keeps rows for seconds with traffic)."""
    if not seconds:
        raise ValueError("no whole second to measure: make the measured window longer")
    if limit_records <= 0 or limit_bytes <= 0:
        raise ValueError("limits must be positive")
    by_second = {int(row[0]): row for row in rows}
    records = bytes_ = throttled_records = throttled_bytes = 0.0
    worst = math.inf
    for second in seconds:
        row = by_second.get(second)
        if row is None:
            worst = 0.0
            continue
        records += row[1]
        bytes_ += row[2]
        throttled_records += row[3]
        throttled_bytes += row[4]
        worst = min(worst, max(row[1] / limit_records, row[2] / limit_bytes))
    n = len(seconds)
    record_share = records / n / limit_records
    byte_share = bytes_ / n / limit_bytes
    return ShardWindow(
        seconds=n,
        records_per_second=records / n,
        bytes_per_second=bytes_ / n,
        record_share=record_share,
        byte_share=byte_share,
        utilisation=max(record_share, byte_share),
        binding_limit="bytes" if byte_share > record_share else "records",
        worst_second_utilisation=worst,
        throttled_records=int(throttled_records),
        throttled_bytes=int(throttled_bytes),
    )


def per_100k(cpu_seconds: float, records: int) -> float | None:
    """CPU seconds per 100,000 records, or ``None`` when no record was counted."""
    if records <= 0:
        return None
    return cpu_seconds / records * 100_000


def _stream_shards(stats: Mapping[str, Any] | None, stream: str) -> list[Mapping[str, Any]]:
    if stats is None:
        return []
    return [shard for shard in stats.get("shards", ()) if shard.get("stream") == stream]


def _milliseconds(seconds: Sequence[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {
        name: None if value is None else round(value * 1000, 1)
        for name, value in percentiles(seconds).items()
    }
    out["max"] = round(max(seconds) * 1000, 1) if seconds else None
    out["samples"] = len(seconds)
    return out


def _difference(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    out = {code: count - before.get(code, 0) for code, count in after.items()}
    return {code: count for code, count in sorted(out.items()) if count}


def summarise(run: CaseRun) -> dict[str, Any]:
    """Everything measured in one case, as the JSON-ready dictionary ``bench.json`` lists."""
    case, start, end = run.case, run.start, run.end
    elapsed = end.clock - start.clock
    user_records = end.user_records_put - start.user_records_put
    kinesis_records = end.kinesis_records_put - start.kinesis_records_put
    if start.emulator is None or end.emulator is None:
        raise ValueError("the emulator's statistics are missing")
    seconds = full_seconds(float(start.emulator["uptime"]), float(end.emulator["uptime"]))
    totals = {shard["shard_id"]: shard for shard in _stream_shards(run.final_emulator, run.stream)}
    shards: list[dict[str, Any]] = []
    enforced = True
    for shard in _stream_shards(end.emulator, run.stream):
        limit_records = shard.get("limit_records")
        limit_bytes = shard.get("limit_bytes")
        if limit_records is None or limit_bytes is None:
            enforced = False
        window = shard_window(
            shard["per_second"],
            seconds,
            limit_records or _limits.SHARD_RECORDS_PER_SECOND,
            limit_bytes or _limits.SHARD_BYTES_PER_SECOND,
        )
        row: dict[str, Any] = {"shard_id": shard["shard_id"], **dataclasses.asdict(window)}
        whole = totals.get(shard["shard_id"], shard)
        row["throttled_records_total"] = int(whole["throttled_records"])
        shards.append(row)
    if not shards:
        raise ValueError(f"the emulator reports no shard of stream {run.stream!r}")
    worst = min(shards, key=lambda row: float(row["utilisation"]))
    # every request the emulator saw in the window (one stream runs at a time)
    before, after = start.emulator["totals"], end.emulator["totals"]
    requests = after["requests"] - before["requests"]
    sent = sum(
        after[name] - before[name]
        for name in ("accepted_records", "throttled_records", "failed_records")
    )
    uptime = float(end.emulator["uptime"]) - float(start.emulator["uptime"])

    return {
        "record_size": case.record_size,
        "aggregation": case.aggregation,
        "stream": run.stream,
        "measured_by": "emulator",
        "shards_count": len(shards),
        "limits_enforced": enforced,
        "measured_seconds": round(elapsed, 3),
        "emulator_seconds": len(seconds),
        "user_records_per_second": round(user_records / elapsed, 1),
        "user_records_per_kinesis_record": (
            round(user_records / kinesis_records, 2) if kinesis_records else None
        ),
        "requests_per_second": round(requests / uptime, 1),
        "kinesis_records_per_request": round(sent / requests, 1) if requests else None,
        "kinesis_records_per_second_per_shard": round(_mean(shards, "records_per_second"), 1),
        "bytes_per_second_per_shard": round(_mean(shards, "bytes_per_second"), 1),
        "record_share": round(_mean(shards, "record_share"), 4),
        "byte_share": round(_mean(shards, "byte_share"), 4),
        "utilisation": round(float(worst["utilisation"]), 4),
        "utilisation_mean": round(_mean(shards, "utilisation"), 4),
        "binding_limit": worst["binding_limit"],
        "worst_second_utilisation": round(
            min(float(row["worst_second_utilisation"]) for row in shards), 4
        ),
        "throttled_records": sum(int(row["throttled_records"]) for row in shards),
        "throttled_records_total": sum(int(row["throttled_records_total"]) for row in shards),
        "producer_errors_by_code": _difference(end.errors_by_code, start.errors_by_code),
        **_producer_side(run, start, end, user_records),
        "shards": [
            {
                name: _round(value, 4) if isinstance(value, float) else value
                for name, value in row.items()
            }
            for row in shards
        ],
    }


def summarise_external(run: CaseRun) -> dict[str, Any]:
    """The same dictionary as :func:`summarise`, for an outside endpoint, which has no
    statistics to ask: every figure comes from the producer's side. Each shard's rates are the
    Kinesis records and bytes the producer saw acknowledged, over the measured window; shares
    are of the service's documented limits (1000 records/s, 1 MiB/s per shard), which the
    endpoint may or may not enforce (``limits_enforced`` is None: unknown); throttles are the
    producer's ``ProvisionedThroughputExceededException`` counts, for the whole stream. What
    only the emulator knows (requests per second, the worst second) is None."""
    from ...errors import THROTTLED

    case, start, end = run.case, run.start, run.end
    elapsed = end.clock - start.clock
    if elapsed <= 0:
        raise ValueError("the measured window is empty")
    user_records = end.user_records_put - start.user_records_put
    kinesis_records = end.kinesis_records_put - start.kinesis_records_put
    shards: list[dict[str, Any]] = []
    for shard_id, (records_after, bytes_after) in end.shards.items():
        records_before, bytes_before = start.shards.get(shard_id, (0.0, 0.0))
        records_per_second = (records_after - records_before) / elapsed
        bytes_per_second = (bytes_after - bytes_before) / elapsed
        record_share = records_per_second / _limits.SHARD_RECORDS_PER_SECOND
        byte_share = bytes_per_second / _limits.SHARD_BYTES_PER_SECOND
        shards.append(
            {
                "shard_id": shard_id,
                "records_per_second": round(records_per_second, 1),
                "bytes_per_second": round(bytes_per_second, 1),
                "record_share": round(record_share, 4),
                "byte_share": round(byte_share, 4),
                "utilisation": round(max(record_share, byte_share), 4),
                "binding_limit": "bytes" if byte_share > record_share else "records",
            }
        )
    if not shards:
        raise ValueError(f"the producer acknowledged no record of stream {run.stream!r}")
    worst = min(shards, key=lambda row: float(row["utilisation"]))
    errors = _difference(end.errors_by_code, start.errors_by_code)

    return {
        "record_size": case.record_size,
        "aggregation": case.aggregation,
        "stream": run.stream,
        "measured_by": "producer",
        "shards_count": len(shards),
        "limits_enforced": None,
        "measured_seconds": round(elapsed, 3),
        "emulator_seconds": None,
        "user_records_per_second": round(user_records / elapsed, 1),
        "user_records_per_kinesis_record": (
            round(user_records / kinesis_records, 2) if kinesis_records else None
        ),
        "requests_per_second": None,
        "kinesis_records_per_request": None,
        "kinesis_records_per_second_per_shard": round(_mean(shards, "records_per_second"), 1),
        "bytes_per_second_per_shard": round(_mean(shards, "bytes_per_second"), 1),
        "record_share": round(_mean(shards, "record_share"), 4),
        "byte_share": round(_mean(shards, "byte_share"), 4),
        "utilisation": round(float(worst["utilisation"]), 4),
        "utilisation_mean": round(_mean(shards, "utilisation"), 4),
        "binding_limit": worst["binding_limit"],
        "worst_second_utilisation": None,
        "throttled_records": errors.get(THROTTLED, 0),
        "throttled_records_total": int(run.final_errors_by_code.get(THROTTLED, 0)),
        "producer_errors_by_code": errors,
        **_producer_side(run, start, end, user_records),
        "shards": shards,
    }


def _mean(shards: Sequence[Mapping[str, Any]], name: str) -> float:
    return sum(float(row[name]) for row in shards) / len(shards)


def _producer_side(
    run: CaseRun, start: Snapshot, end: Snapshot, user_records: float
) -> dict[str, Any]:
    """The figures the producer's process measures itself, in either mode."""
    return {
        "producer_errors_by_code_total": dict(sorted(run.final_errors_by_code.items())),
        "failed_samples": run.failed_samples,
        "latency_ms": _milliseconds(run.latencies),
        "producer_latency_ms": _milliseconds(run.producer_latencies),
        "cpu_seconds": round(end.cpu - start.cpu, 3),
        "cpu_seconds_per_100k": _round(per_100k(end.cpu - start.cpu, int(user_records)), 3),
        "submitted_user_records": run.submitted,
        "max_outstanding_records": run.max_outstanding_records,
        "max_outstanding_bytes": run.max_outstanding_bytes,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
