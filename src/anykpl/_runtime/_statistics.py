"""The frozen snapshots ``statistics()`` returns.

Each object that owns state answers for it with a frozen snapshot (anyio's memory streams and
trio's channels do the same): the Limiter a :class:`~anykpl._core._limiter.LimiterStatistics`,
the Retrier a :class:`~anykpl._core._retrier.RetrierStatistics` (each defined beside its owner),
the Pipeline of a stream its :class:`StreamStatistics` built from them, and the Producer the
:class:`ProducerStatistics` of every stream. Nothing reads another object's fields to build
them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._core._metrics import MetricKey
    from .._core._tenant_quotas import TenantStatistics
    from .._fleet import FleetStatistics
    from ._spool import SpoolStatistics

__all__ = (
    "ProducerStatistics",
    "ShardStatistics",
    "StreamStatistics",
)


@dataclass(frozen=True, slots=True)
class ShardStatistics:
    """A snapshot of one shard's rate control (one per shard the Limiter has seen).

    Attributes:
        rate: (records/s, bytes/s) the Limiter allows the shard now.
        ceiling: (records/s, bytes/s) the most it ever allows (``rate_limit`` percent of the
            shard's limits); ``rate`` is lower while adaptive control has it cut.
        cuts: congestion events that cut the rate (adaptive control).
        throttled_records: Kinesis records throttled by the service for this shard.
        records_sent: Kinesis records the Limiter released for this shard.
        bytes_sent: their bytes.
        token_wait: user-record seconds spent waiting for the shard's tokens (summed over
            records: 10 records waiting 0.1 s each make 1.0).
        backoff: user-record seconds spent waiting out retry backoff.
        queued: Kinesis records waiting for tokens now.
        noise: the share of the shard's records the service throttles whatever the rate, as
            adaptive control judges it (0 unless its throttles are judged to be noise; only
            throttles beyond it cut the rate). See docs/adaptive.md.
        outstanding_records: user records admitted for this shard (as predicted when they
            were admitted) and not yet terminal.
        outstanding_bytes: their data + partition key bytes.
        backlog_limit: (user records, bytes) the shard may hold now: ``max_outstanding_time``
            seconds of what it delivers (``inf`` while unknown or turned off). Records for
            this shard wait at the call beyond it; other shards' records do not.
        admission_waits: records for this shard that had to wait for room at the call
            (its backlog limit, or the producer's caps and their reserve for quiet shards).
    """

    rate: tuple[float, float]
    ceiling: tuple[float, float]
    cuts: int
    throttled_records: int
    records_sent: int
    bytes_sent: int
    token_wait: float
    backoff: float
    queued: int
    noise: float = 0.0
    outstanding_records: int = 0
    outstanding_bytes: int = 0
    backlog_limit: tuple[float, float] = (math.inf, math.inf)
    admission_waits: int = 0


@dataclass(frozen=True, slots=True)
class StreamStatistics:
    """A snapshot of one stream's pipeline.

    Attributes:
        shard_map_state: ``INVALID``, ``UPDATING`` or ``READY``.
        open_shards: the open shards the map knows.
        aggregator_queue_depths: user records buffered per predicted shard.
        limiter_queue_depths: Kinesis records waiting for tokens per shard.
        token_levels: (records, bytes) tokens available per shard.
        rates: (records/s, bytes/s) the limiter allows per shard.
        requests_in_flight: PutRecords requests sent and not yet classified.
        retry_backoff_records: user records waiting out a retry backoff.
        outstanding_records: user records admitted for this stream and not yet terminal.
        outstanding_bytes: their data + partition key bytes.
        backlog_limit: (user records, bytes) the stream may hold now: ``max_outstanding_time``
            seconds of what its shards deliver (``inf`` while unknown or turned off). It
            binds the records admitted while the shard map is not ready; once it is, each
            shard's own limit does (``shards``).
        user_records_received: user records admitted for this stream.
        shards: rate control per shard: rate, ceiling, cuts, throttles, waits.
        retry_budget_exhausted: retries that found the retry budget spent (and waited
            ``retry_backoff_max``).
        pace: seconds a record waits at least before its shard sends it, from its admission:
            pacing at capacity (adaptive batching; see docs/batching.md), as last planned
            (every 0.1 s while records flow). 0 when the stream was not at its capacity.
        held_records: user records stored in a shard the map has not listed yet (after a
            split, under load), waiting for its refresh to say whether a reader keeps them
            (see docs/stages/retrier.md).
        path_limit_bytes: the bytes the stream may hold by what the network path to Kinesis
            has proven it delivers: ``max_outstanding_time`` of the best rate its requests
            were answered at since the last timeout or stall (64 KiB/s before any answer); a
            shard holding less than an equal part of it is not held back by it (see
            docs/admission.md). ``inf`` when turned off.
    """

    shard_map_state: str
    open_shards: tuple[str, ...]
    aggregator_queue_depths: Mapping[str, int]
    limiter_queue_depths: Mapping[str, int]
    token_levels: Mapping[str, tuple[float, float]]
    rates: Mapping[str, tuple[float, float]]
    requests_in_flight: int
    retry_backoff_records: int
    outstanding_records: int
    outstanding_bytes: int
    backlog_limit: tuple[float, float]
    user_records_received: int
    shards: Mapping[str, ShardStatistics]
    retry_budget_exhausted: int
    pace: float = 0.0
    held_records: int = 0
    path_limit_bytes: float = math.inf


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    """A frozen snapshot returned by :meth:`Producer.statistics`.

    Attributes:
        outstanding_records: admitted records not yet terminal.
        outstanding_bytes: their data + partition key bytes.
        oldest_record_age: seconds since the oldest of them was admitted (0.0 when none is):
            the KPL's ``getOldestRecordTimeInMillis``, in seconds. Growing steadily, it says the
            producer falls behind what it is given.
        streams: per-stream pipeline statistics.
        errors_by_code: Kinesis-record errors seen, by error code.
        metrics: the KPL metric counters (``MetricKey`` → sum) at global, stream and shard level.
        tenants: per-tenant quota statistics (:class:`~anykpl.TenantStatistics`) of the
            tenants records were put for (idle ones not named in ``tenant_quotas`` are
            forgotten once there are many; see docs/tenants.md).
        fleet: this producer's place in its fleet (:class:`~anykpl._fleet.FleetStatistics`:
            role, mode, the rate applied, the grant's expiry, S3 errors), or ``None`` without
            ``ProducerConfig.fleet`` (see docs/fleet.md).
        spool: the durable spool (:class:`~anykpl.SpoolStatistics`: bytes and segments on
            disk, records recovered and their outcomes, corrupt entries skipped), or ``None``
            without ``ProducerConfig.spool_dir`` (see docs/spool.md).
    """

    outstanding_records: int
    outstanding_bytes: int
    streams: Mapping[str, StreamStatistics]
    errors_by_code: Mapping[str, int]
    metrics: Mapping[MetricKey, float]
    tenants: Mapping[str, TenantStatistics] = field(default_factory=dict)
    fleet: FleetStatistics | None = None
    spool: SpoolStatistics | None = None
    oldest_record_age: float = 0.0
