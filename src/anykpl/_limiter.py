"""The Limiter: per-shard token buckets between the Aggregator and the Collector.

Mirrors aws/kinesis/core/limiter.h: one limiter per predicted shard, created on first use,
with a deadline-ordered queue (the KPL's ``TimeSensitiveQueue``) and a two-dimensional token
bucket (``_token_bucket.py``). A Kinesis record costs one record token and its size in byte
tokens. Records are released in deadline order; the first one that does not fit stops its
shard (head of line by deadline). Records whose TTL passes while they wait are failed with
``Expired`` ("Expiration reached while waiting in limiter"). Records without a predicted shard
(the shard map was not ready) skip the limiter, as in the KPL.

Where we differ: the KPL polls every limiter every 25 ms; our task sleeps until the earliest
moment a queued record can get its tokens or expires, or until new input arrives — but a
saturated shard waits at least ``MIN_REFILL_WAIT`` (the KPL's 25 ms) for its tokens. Waking for
each token instead releases one small record per millisecond per shard, each already past its
deadline, so the Collector sends each alone: ``anykpl bench`` measured 1.5–2 records per
PutRecords and 30 % of a shard's record limit for 100-byte records with aggregation off. A 25 ms
refill releases 25 records per shard at a time, which the Collector batches. The rate is
``rate_limit`` percent of the shard's limits (default 100 %, see ``ProducerConfig.rate_limit``),
and it also applies with aggregation off (KPL issue #127).
"""

from __future__ import annotations

import heapq
import math

from . import _limits
from ._records import KinesisRecord
from ._token_bucket import BURST_SECONDS, TokenBucket

__all__ = ("Limiter",)


EXPIRY_SCAN_INTERVAL = 0.25

#: The shortest wait for tokens of a saturated shard (the KPL's ``kDrainDelayMillis``).
MIN_REFILL_WAIT = 0.025


class _ShardLimiter:
    __slots__ = ("blocked_until", "bucket", "next_expiry_scan", "queue")

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self.queue: list[tuple[float, int, KinesisRecord]] = []
        self.next_expiry_scan = -math.inf
        # a saturated shard is not drained again before this, whatever arrives meanwhile
        self.blocked_until = -math.inf


class Limiter:
    """Per-stream limiter state. Pure: the caller passes times and moves the output."""

    def __init__(self, *, rate_limit_percent: float, burst: float = BURST_SECONDS) -> None:
        self.burst = burst
        self.multiplier = rate_limit_percent / 100.0
        self._shards: dict[str, _ShardLimiter] = {}
        self._waiting: set[str] = set()
        self._counter = 0
        self.queued = 0

    def __repr__(self) -> str:
        return f"<Limiter {len(self._shards)} shard(s) {self.queued} queued>"

    def _shard(self, shard: str, now: float) -> _ShardLimiter:
        limiter = self._shards.get(shard)
        if limiter is None:
            limiter = self._shards[shard] = _ShardLimiter(
                TokenBucket(
                    _limits.SHARD_RECORDS_PER_SECOND * self.multiplier,
                    _limits.SHARD_BYTES_PER_SECOND * self.multiplier,
                    now,
                    burst=self.burst,
                )
            )
        return limiter

    def put(self, records: list[KinesisRecord], now: float, out: list[KinesisRecord]) -> None:
        """Queue ``records``; those with no predicted shard go straight to ``out``."""
        for kr in records:
            shard = kr.predicted_shard
            if shard is None:
                out.append(kr)
                continue
            limiter = self._shard(shard, now)
            self._counter += 1
            heapq.heappush(limiter.queue, (kr.deadline, self._counter, kr))
            self._waiting.add(shard)
            self.queued += 1

    def drain(self, now: float, out: list[KinesisRecord], expired: list[KinesisRecord]) -> float:
        """Release what the buckets allow into ``out`` and expired records into ``expired``;
        return when to drain again (``inf`` if nothing waits)."""
        next_wake = math.inf
        done: list[str] = []
        released = 0
        for shard in self._waiting:
            limiter = self._shards[shard]
            if now < limiter.blocked_until:
                next_wake = min(next_wake, limiter.blocked_until)
                continue
            queue, bucket = limiter.queue, limiter.bucket
            while queue:
                kr = queue[0][2]
                if kr.expiration < now:
                    heapq.heappop(queue)
                    expired.append(kr)
                    released += 1
                    continue
                if bucket.try_take(1, kr.size, now):
                    heapq.heappop(queue)
                    out.append(kr)
                    released += 1
                    continue
                wake = limiter.blocked_until = now + max(
                    MIN_REFILL_WAIT, bucket.time_until(1, kr.size, now)
                )
                # A record deeper in the queue may expire while the head waits for tokens:
                # scan for expiries at most every EXPIRY_SCAN_INTERVAL (the KPL's limiter
                # checks on every 25 ms poll; an O(n) scan per drain would be too costly).
                if now >= limiter.next_expiry_scan:
                    keep = [item for item in queue if item[2].expiration >= now]
                    if len(keep) != len(queue):
                        expired.extend(item[2] for item in queue if item[2].expiration < now)
                        released += len(queue) - len(keep)
                        heapq.heapify(keep)
                        limiter.queue = queue = keep
                    limiter.next_expiry_scan = now + EXPIRY_SCAN_INTERVAL
                if queue:
                    next_wake = min(next_wake, wake, limiter.next_expiry_scan)
                break
            if not queue:
                done.append(shard)
        for shard in done:
            self._waiting.discard(shard)
        self.queued -= released
        return next_wake

    def queue_depths(self) -> dict[str, int]:
        return {shard: len(lim.queue) for shard, lim in self._shards.items() if lim.queue}

    def rates(self) -> dict[str, tuple[float, float]]:
        return {
            shard: (lim.bucket.records_per_second, lim.bucket.bytes_per_second)
            for shard, lim in self._shards.items()
        }

    def token_levels(self, now: float) -> dict[str, tuple[float, float]]:
        return {shard: lim.bucket.levels(now) for shard, lim in self._shards.items()}

    def take_all(self) -> list[KinesisRecord]:
        """Remove and return every queued record (used when failing everything)."""
        records = [item[2] for lim in self._shards.values() for item in lim.queue]
        for lim in self._shards.values():
            lim.queue.clear()
        self._waiting.clear()
        self.queued = 0
        return records
