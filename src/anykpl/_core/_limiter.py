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

Beyond the KPL (see docs/adaptive.md, docs/fleet.md and docs/tenants.md):

- **Adaptive control**: a :class:`~anykpl._core._adaptive.RateController` per shard lowers the
  shard's rate below that ceiling when its records are throttled, and lets it recover.
- **A shared bucket**: with a fleet cap, every record released by any shard of any stream also
  takes tokens from one producer-wide bucket whose rate is this producer's fleet grant. A record
  the shared bucket refuses reserves its tokens anyway (the bucket goes into debt, and the
  record waits until the debt is paid), so shards with small records cannot take every refill
  from a bigger one; and the shards take turns starting the drain.
- **Fair queuing across tenants**: records put with a ``tenant`` wait in a lane of their own
  within their shard, and the lanes are served by deficit round robin (bytes), so a tenant
  with a backlog cannot hold back a quiet tenant's records on the same shard. Records without
  a tenant share one lane; a shard that never sees a tenant keeps the plain deadline queue.

The queues live in ``_shard_queue.py`` behind one interface (push, release, expire, take all),
so the flow here is the KPL's whichever queue a shard has: a bucket and a queue per shard, and
``drain`` asks each waiting shard's queue to release what ``_ShardLimiter.admit`` gives tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from . import _limits
from ._adaptive import RateController
from ._records import KinesisRecord
from ._shard_queue import DeadlineQueue, FairQueue, QueuedRecord, ShardQueue
from ._token_bucket import BURST_SECONDS, TokenBucket

__all__ = (
    "AdaptiveSettings",
    "Limiter",
    "LimiterShardStatistics",
    "LimiterStatistics",
    "ShardCounters",
)

logger = logging.getLogger("anykpl.limiter")

EXPIRY_SCAN_INTERVAL = 0.25

#: The shortest wait for tokens of a saturated shard (the KPL's ``kDrainDelayMillis``).
MIN_REFILL_WAIT = 0.025

#: Pacing at capacity (``Limiter.plan_pace``, docs/batching.md): a record is released no
#: sooner than ``PACE_SHARE`` of the stream's least mean latency after it was admitted (its
#: records' mean arrival, for an aggregate), while the stream is at its capacity and that
#: latency is at least ``PACE_FROM`` of ``record_max_buffered_time``.
PACE_SHARE = 0.8
PACE_FROM = 0.25
PACE_CAPACITY = 0.9
PACE_CAPACITY_OFF = 0.8
PACE_SMOOTHING = 0.2
PACE_WINDOW = 0.5
PACE_INTERVAL = 0.1

#: A change of the adaptive fraction smaller than this is not applied to the bucket yet.
_RATE_STEP = 0.005

#: The deadline floor plans for queued records to leave the Limiter this long before their
#: expiration (the Collector's buffering and the request itself come after).
DEADLINE_MARGIN = 1.0

#: Through a shard's throttled period (``RateController.sampling``) its aggregates leave in
#: pieces of at most this many bytes: ten times the outcomes per second of 50 KB aggregates,
#: for a few header bytes more, and more pieces per response for the dispersion test. 10 KiB
#: measured the same under noise, 1.31-1.51 % against 1.49-1.77 % throttled with four
#: producers sharing a stream (benchmarks/shared_stream.py, one run per backend each).
SAMPLE_SIZE = 5 * 1024

# QueuedRecord without its generated __new__ (a Python call): this is once per Kinesis record
_new_queued = tuple.__new__


@dataclass(frozen=True, slots=True)
class LimiterShardStatistics:
    """One shard of the Limiter: its rate, what it released and waited, its rate control."""

    rate: tuple[float, float]
    records_sent: int
    bytes_sent: int
    token_wait: float
    queued: int
    cuts: int
    noise: float


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """The Limiter of one stream (``Limiter.statistics``)."""

    ceiling: tuple[float, float]
    shards: Mapping[str, LimiterShardStatistics]
    token_levels: Mapping[str, tuple[float, float]]
    queue_depths: Mapping[str, int]
    offered_records: int
    offered_bytes: int
    queued: int


class AdaptiveSettings:
    """The adaptive controller's parameters (``ProducerConfig.adaptive_*``)."""

    __slots__ = ("decrease", "floor", "increase", "window")

    def __init__(self, *, decrease: float, increase: float, floor: float, window: float) -> None:
        self.decrease = decrease
        self.increase = increase
        self.floor = floor
        self.window = window


class ShardCounters:
    """What one shard's limiter has done (for ``statistics()``)."""

    __slots__ = ("bytes_sent", "records_sent", "token_wait", "user_records_sent")

    def __init__(self) -> None:
        self.records_sent = 0  # Kinesis records released
        self.bytes_sent = 0
        self.user_records_sent = 0  # the user records they carry
        self.token_wait = 0.0  # user-record seconds spent waiting for tokens


class _ShardLimiter:
    """One shard's bucket and queue (the KPL's ``ShardLimiter``)."""

    __slots__ = (
        "active_at",
        "blocked_until",
        "bucket",
        "controller",
        "counters",
        "fraction",
        "need",
        "next_expiry_scan",
        "next_need_at",
        "offered_bytes",
        "offered_records",
        "pace",
        "queue",
        "shared",
        "shared_refusals",
    )

    def __init__(
        self, bucket: TokenBucket, controller: RateController | None, shared: TokenBucket | None
    ) -> None:
        self.bucket = bucket
        self.controller = controller
        self.shared = shared
        self.fraction = 1.0  # the adaptive fraction last applied to the bucket
        self.counters = ShardCounters()
        # a DeadlineQueue until the shard's first record with a tenant, then a FairQueue
        self.queue: ShardQueue = DeadlineQueue()
        self.next_expiry_scan = -math.inf
        # Kinesis records and bytes put for the shard (its share of the stream's load)
        self.offered_records = 0
        self.offered_bytes = 0
        # the deadline floor: the fraction the queue needs, planned again at next_need_at
        self.need = 0.0
        self.next_need_at = -math.inf
        # a saturated shard is not drained again before this, whatever arrives meanwhile
        self.blocked_until = -math.inf
        # pacing at capacity (see Limiter.plan_pace): the delay applied now, and when the
        # shard last released a record
        self.pace = 0.0
        self.active_at = -math.inf
        # the records the shared (fleet) bucket refused so far: a fleet worker's sign that the
        # fleet's rate is what holds it back
        self.shared_refusals = 0

    def scan_expiries(self, now: float, expired: list[KinesisRecord]) -> None:
        """Move the queued records whose TTL has passed into ``expired`` (an O(n) scan: at
        most every EXPIRY_SCAN_INTERVAL)."""
        self.queue.expire(now, expired)
        self.next_expiry_scan = now + EXPIRY_SCAN_INTERVAL

    def admit(self, item: QueuedRecord, now: float) -> bool:
        """Take the tokens for ``item``'s record from the shard's bucket and the shared one,
        and count it released; or block the shard until they could be there.

        The shared bucket is *reserved*, not just tried: a record it refuses takes its tokens
        anyway, pushing the bucket into debt, and waits until the debt is paid (Go's
        ``rate.Reserve``). Every other shard then finds the bucket empty until the record's
        turn has come. With a plain try, shards with small records would take every refill,
        and a bigger record on another shard (or stream) would never find enough tokens."""
        kr = item.record
        pace = self.pace
        if pace and not kr.shared_paid:
            # (not a record that holds a reservation of the shared bucket: it goes at once)
            gate = kr.mean_arrival() + pace
            if now < gate < kr.expiration - DEADLINE_MARGIN:
                self.blocked_until = gate
                return False
        bucket, size, shared = self.bucket, kr.size, self.shared
        if not bucket.try_take(1, size, now):
            wait = bucket.time_until(1, size, now)
        elif (
            shared is not None
            and not kr.shared_paid
            and (wait := shared.reserve(1, size, now)) > 0.0
        ):
            bucket.refund(1, size)
            kr.shared_paid = True  # it goes once its shard's tokens are there, after the wait
            self.shared_refusals += 1
        else:
            counters = self.counters
            users = kr.user_records
            counters.records_sent += 1
            counters.bytes_sent += size
            counters.user_records_sent += users
            counters.token_wait += (now - item.queued_at) * users
            self.active_at = now
            return True
        self.blocked_until = now + (wait if wait > MIN_REFILL_WAIT else MIN_REFILL_WAIT)
        return False


class Limiter:
    """Per-stream limiter state. Pure: the caller passes times and moves the output."""

    def __init__(
        self,
        *,
        rate_limit_percent: float,
        burst: float = BURST_SECONDS,
        adaptive: AdaptiveSettings | None = None,
        shared: TokenBucket | None = None,
        stream: str = "",
    ) -> None:
        self.burst = burst
        self.multiplier = rate_limit_percent / 100.0
        self.records_ceiling = _limits.SHARD_RECORDS_PER_SECOND * self.multiplier
        self.bytes_ceiling = _limits.SHARD_BYTES_PER_SECOND * self.multiplier
        self.adaptive = adaptive
        self.shared = shared
        self.stream = stream
        self._shards: dict[str, _ShardLimiter] = {}
        self._waiting: set[str] = set()
        self._counter = 0
        self._turn = 0  # which waiting shard drains first while the shared bucket binds
        self.queued = 0
        # pacing at capacity (plan_pace): the delay, when it is planned next, the counts it
        # was planned from last (time, Kinesis records, bytes, user records released), and,
        # smoothed, the user records/s the shards can release and the share of their rates
        # they used
        self.pace = 0.0
        self._next_pace = -math.inf
        self._paced: tuple[float, int, int, int] | None = None
        self._capacity = math.inf
        self._capacity_use = 0.0
        # Kinesis records (and bytes) put so far: the offered load a fleet worker reports
        self.offered_records = 0
        self.offered_bytes = 0

    def __repr__(self) -> str:
        return f"<Limiter {len(self._shards)} shard(s) {self.queued} queued>"

    def waiting_lanes(self) -> AbstractSet[str | tuple[str, str]]:
        """The lanes with Kinesis records waiting for tokens, keyed as the Aggregator keys its
        aggregates: a shard (its records without a tenant, or all of them on a shard that
        never saw a tenant) or ``(shard, tenant)``. A tenant whose lane is empty is not held
        back by the others' backlog on its shard: its next Kinesis record joins the round
        robin at once (adaptive batching, docs/batching.md). Do not modify."""
        waiting = self._waiting
        lanes: set[str | tuple[str, str]] | None = None  # a copy, once a shard has tenants
        for shard in waiting:
            queue = self._shards[shard].queue
            if type(queue) is DeadlineQueue:
                continue
            assert isinstance(queue, FairQueue)
            if lanes is None:
                lanes = set(waiting)
            lanes.discard(shard)
            for tenant in queue.turns:
                lanes.add(shard if tenant is None else (shard, tenant))
        return waiting if lanes is None else lanes

    def _shard(self, shard: str, now: float) -> _ShardLimiter:
        limiter = self._shards.get(shard)
        if limiter is None:
            adaptive = self.adaptive
            controller = None
            if adaptive is not None:
                controller = RateController(
                    records_ceiling=self.records_ceiling,
                    bytes_ceiling=self.bytes_ceiling,
                    decrease=adaptive.decrease,
                    increase=adaptive.increase,
                    floor=adaptive.floor,
                    window=adaptive.window,
                )
            limiter = self._shards[shard] = _ShardLimiter(
                TokenBucket(self.records_ceiling, self.bytes_ceiling, now, burst=self.burst),
                controller,
                self.shared,
            )
        return limiter

    def put(self, records: list[KinesisRecord], now: float, out: list[KinesisRecord]) -> None:
        """Queue ``records``; those with no predicted shard go straight to ``out``."""
        self.offered_records += len(records)
        for kr in records:
            self.offered_bytes += kr.size
            shard = kr.predicted_shard
            if shard is None:
                out.append(kr)
                continue
            limiter = self._shard(shard, now)
            limiter.offered_records += 1
            limiter.offered_bytes += kr.size
            if limiter.fraction < 1.0:
                limiter.next_need_at = -math.inf  # the deadline floor must count it
            self._counter += 1
            queue = limiter.queue
            if kr.tenant is not None and type(queue) is DeadlineQueue:
                queue = limiter.queue = FairQueue(queue)
            queue.push(_new_queued(QueuedRecord, (kr.deadline, self._counter, kr, now)))
            self._waiting.add(shard)
            self.queued += 1

    # -- releasing ------------------------------------------------------------------------

    def drain(self, now: float, out: list[KinesisRecord], expired: list[KinesisRecord]) -> float:
        """Release what the buckets allow into ``out`` and expired records into ``expired``;
        return when to drain again (``inf`` if nothing waits)."""
        next_wake = math.inf
        done: list[str] = []
        released = 0
        first_expired = len(expired)
        pace = self.pace
        waiting: list[str] | set[str] = self._waiting
        if self.shared is not None and len(waiting) > 1:
            # take turns at the shared bucket: the first shard drained could take all of it
            order = sorted(waiting)
            self._turn = (self._turn + 1) % len(order)
            waiting = order[self._turn :] + order[: self._turn]
        for shard in waiting:
            limiter = self._shards[shard]
            controller = limiter.controller
            rising = False
            if controller is not None:
                fraction = controller.fraction(now)
                if fraction < 1.0:
                    fraction = self._deadline_floor(limiter, fraction, now)
                if fraction < 1.0 or limiter.fraction < 1.0:
                    self._apply_fraction(limiter, fraction, now)
                    rising = limiter.fraction < 1.0
            if now >= limiter.blocked_until:
                # not a shard that adaptive control has cut: it shares its capacity with other
                # producers, and the tokens gathered while a pace held it would leave in a
                # burst that their records would meet as throttles
                limiter.pace = pace if limiter.fraction >= 1.0 else 0.0
                queue = limiter.queue
                before = len(queue)
                start = len(out)
                if queue.release(now, limiter.admit, out, expired) and (
                    now >= limiter.next_expiry_scan
                ):
                    # A record deeper in the queue may expire while the head waits for
                    # tokens: scan for expiries at most every EXPIRY_SCAN_INTERVAL (the KPL's
                    # limiter checks on every 25 ms poll; an O(n) scan per drain would be too
                    # costly).
                    limiter.scan_expiries(now, expired)
                if controller is not None and controller.sampling and len(out) > start:
                    self._split(limiter, out, start)
                left = len(queue)
                released += before - left
                if not left:
                    done.append(shard)
                    continue
                wake = min(limiter.blocked_until, limiter.next_expiry_scan)
            else:
                # blocked (for its tokens, or a pace) as long as a shared bucket at no rate
                # at all may hold it: its records still expire when their TTL passes
                queue = limiter.queue
                if now >= limiter.next_expiry_scan:
                    before = len(queue)
                    limiter.scan_expiries(now, expired)
                    released += before - len(queue)
                    if not queue:
                        done.append(shard)
                        continue
                wake = min(limiter.blocked_until, limiter.next_expiry_scan)
            if rising:
                # a cut shard wakes to raise its rate even if it needs no tokens before then
                wake = min(wake, now + 4 * MIN_REFILL_WAIT)
            next_wake = min(next_wake, wake)
        for shard in done:
            self._waiting.discard(shard)
        self.queued -= released
        shared = self.shared
        if shared is not None:
            for kr in expired[first_expired:]:
                if kr.shared_paid:  # its reservation of the shared bucket was never used
                    shared.refund(1, kr.size)
                    kr.shared_paid = False
        return next_wake

    # -- pacing at capacity ---------------------------------------------------------------

    def unpace(self, now: float) -> None:
        """A flush: no pace until the next plan (``PACE_INTERVAL`` from now), and the shards
        that a pace held drain again at once."""
        self._set_pace(0.0)
        self._next_pace = now + PACE_INTERVAL

    def _set_pace(self, pace: float) -> None:
        """A new pace; the shards that one twice as long (or more) may be holding drain again
        at its measure (the plan moves the pace a little every time: releasing the held shards
        on every small step would only wake them early)."""
        self.pace = pace
        for limiter in self._shards.values():
            if limiter.pace > 2.0 * pace:
                limiter.pace = pace
                limiter.blocked_until = -math.inf

    def plan_pace(self, now: float, outstanding: int, longest: float) -> None:
        """Plan :attr:`pace` again (every ``PACE_INTERVAL`` seconds): ``PACE_SHARE`` of the
        least mean latency the stream's ``outstanding`` user records can have while it is at
        its capacity, at most ``longest`` (``record_max_buffered_time``) and the buckets'
        burst; none otherwise. Called before each drain, so after an idle spell (no shard
        active) the pace is gone before anything is released.

        Little's law gives that latency: the outstanding records over the user records per
        second the shards can release (their rates, at the user records per Kinesis record
        and per byte they released lately). The stream is at its capacity when two or more
        shards released records in the last ``PACE_WINDOW`` seconds and, smoothed, they used
        ``PACE_CAPACITY`` of their rates (then down to ``PACE_CAPACITY_OFF``, so that the
        pace's own small cost in throughput does not turn it off). A latency under
        ``PACE_FROM`` of ``longest`` is not paced: its spread is a few milliseconds, and the
        pace would cost the median more than it saves the tail."""
        if now < self._next_pace:
            return
        self._next_pace = now + PACE_INTERVAL
        since = now - PACE_WINDOW
        records = size = users = 0
        records_rate = bytes_rate = 0.0
        active = 0
        for limiter in self._shards.values():
            counters = limiter.counters
            records += counters.records_sent
            size += counters.bytes_sent
            users += counters.user_records_sent
            if limiter.active_at >= since:
                active += 1
                records_rate += limiter.bucket.records_per_second
                bytes_rate += limiter.bucket.bytes_per_second
        last = self._paced
        self._paced = (now, records, size, users)
        if last is None:
            return
        elapsed = now - last[0]
        sent, sent_bytes, sent_users = records - last[1], size - last[2], users - last[3]
        use = 0.0
        capacity = math.inf  # user records per second
        if records_rate:
            use = sent / elapsed / records_rate
            if sent:
                capacity = records_rate * sent_users / sent
        if bytes_rate:
            use = max(use, sent_bytes / elapsed / bytes_rate)
            if sent_bytes:
                capacity = min(capacity, bytes_rate * sent_users / sent_bytes)
        self._capacity_use += PACE_SMOOTHING * (use - self._capacity_use)
        if capacity != math.inf:
            if self._capacity == math.inf:
                self._capacity = capacity
            self._capacity += PACE_SMOOTHING * (capacity - self._capacity)
        pace = 0.0
        threshold = PACE_CAPACITY_OFF if self.pace else PACE_CAPACITY
        if active >= 2 and self._capacity_use >= threshold and self._capacity != math.inf:
            latency = outstanding / self._capacity
            if latency >= PACE_FROM * longest:
                # (no longer than the buckets hold tokens: a held shard loses none)
                pace = min(PACE_SHARE * latency, longest, self.burst)
        self._set_pace(pace)

    def _split(self, limiter: _ShardLimiter, out: list[KinesisRecord], start: int) -> None:
        """Split the aggregates just released for ``limiter``'s shard into ``SAMPLE_SIZE``
        pieces while it is in a throttled period (``RateController.sampling``). The tokens were
        taken for the whole; each piece adds its own 20-byte header and container key (well
        under 1 % at this size), and records are far from binding."""
        released = out[start:]
        pieces: list[KinesisRecord] = []
        for kr in released:
            pieces.extend(kr.split(SAMPLE_SIZE))
        if len(pieces) > len(released):
            limiter.counters.records_sent += len(pieces) - len(released)
            out[start:] = pieces

    # -- adaptive control -----------------------------------------------------------------

    def _apply_fraction(self, limiter: _ShardLimiter, fraction: float, now: float) -> None:
        if abs(fraction - limiter.fraction) < _RATE_STEP and fraction < 1.0:
            return
        if fraction > limiter.fraction:
            # tokens now come faster than when the shard's wait was planned: plan it again
            limiter.blocked_until = -math.inf
        limiter.fraction = fraction
        limiter.bucket.set_rates(
            self.records_ceiling * fraction, self.bytes_ceiling * fraction, now
        )

    def unblock(self) -> None:
        """Forget every shard's planned wait (the next drain plans it again)."""
        for limiter in self._shards.values():
            limiter.blocked_until = -math.inf

    def _deadline_floor(self, limiter: _ShardLimiter, fraction: float, now: float) -> float:
        """``fraction``, raised to what the shard's queued records need to be released before
        their TTL (at most 1): politeness never makes a record expire."""
        if now >= limiter.next_need_at:
            limiter.next_need_at = now + EXPIRY_SCAN_INTERVAL
            limiter.need = self._deadline_need(limiter, now)
            if limiter.controller is not None:
                # the controller cuts no lower than what the shard sends anyway: throttles
                # while the floor holds the rate up say nothing about lower rates, and its
                # climb back, once the queue has drained, starts from the rate really sent
                limiter.controller.support = limiter.need
        return fraction if fraction > limiter.need else limiter.need

    def _deadline_need(self, limiter: _ShardLimiter, now: float) -> float:
        """The smallest fraction of the ceiling that releases every queued record of the shard
        ``DEADLINE_MARGIN`` before its expiration (records in expiration order: the first
        ``k`` of them need ``k`` records and their bytes within the time the ``k``-th has)."""
        if not limiter.queue:
            return 0.0
        pending = sorted((item.record.expiration, item.record.size) for item in limiter.queue)
        records_ceiling, bytes_ceiling = self.records_ceiling, self.bytes_ceiling
        need = 0.0
        total = 0
        for count, (expiration, size) in enumerate(pending, 1):
            total += size
            left = expiration - now - DEADLINE_MARGIN
            if left <= MIN_REFILL_WAIT:
                return 1.0
            rate = max(count / records_ceiling, total / bytes_ceiling) / left
            if rate > need:
                if rate >= 1.0:
                    return 1.0
                need = rate
        return need

    def outcome(
        self,
        shard: str,
        sent: int,
        throttled: int,
        accepted_records: int,
        accepted_bytes: int,
        sent_at: float,
        now: float,
    ) -> None:
        """A PutRecords outcome for the Kinesis records predicted for ``shard``: ``sent`` came
        back, ``throttled`` of them ProvisionedThroughputExceeded, ``accepted_records``
        (``accepted_bytes``) put. Adaptive control learns from what was sent and throttled
        (``_adaptive.py``); the accepted counts complete the Retrier's report."""
        limiter = self._shards.get(shard)
        if limiter is None or limiter.controller is None:
            return
        controller = limiter.controller
        if controller.outcome(now, sent_at, sent, throttled):
            fraction = controller.fraction(now)
            if fraction < 1.0:
                limiter.next_need_at = -math.inf
                fraction = self._deadline_floor(limiter, fraction, now)
            self._apply_fraction(limiter, fraction, now)
            logger.debug(
                "rate of %s set to %.0f %% of the ceiling (cut %d, throttles: %s)",
                shard,
                100 * limiter.fraction,
                controller.cuts,
                controller.verdict or "undecided",
                extra={"stream": self.stream, "shard": shard, "fraction": limiter.fraction},
            )

    def released_kinesis_records(self) -> int:
        """Kinesis records the shards released so far."""
        return sum(lim.counters.records_sent for lim in self._shards.values())

    @property
    def released_user_records(self) -> int:
        """User records carried by the Kinesis records released so far (with
        :meth:`released_kinesis_records`, the aggregation ratio that turns a rate in Kinesis
        records into one in user records)."""
        return sum(lim.counters.user_records_sent for lim in self._shards.values())

    def shard_deliverable(self, shard: str) -> tuple[float, float]:
        """(Kinesis records/s, bytes/s) ``shard`` can deliver now: its current rate (its
        ceiling if it has not been used yet) less the share of its records throttled as
        noise. The shared (fleet) bucket bounds the shards together: :meth:`shared_rates`."""
        limiter = self._shards.get(shard)
        if limiter is None:
            return self.records_ceiling, self.bytes_ceiling
        bucket, controller = limiter.bucket, limiter.controller
        accepted = 1.0 if controller is None else 1.0 - controller.noise
        return bucket.records_per_second * accepted, bucket.bytes_per_second * accepted

    def shared_rates(self) -> tuple[float, float] | None:
        """(records/s, bytes/s) of the shared (fleet) bucket, which every shard of every
        stream also takes from; ``None`` without one."""
        shared = self.shared
        if shared is None:
            return None
        return shared.records_per_second, shared.bytes_per_second

    def aggregation_ratio(self, shard: str, samples: int) -> float | None:
        """User records per Kinesis record that ``shard`` released, once it released
        ``samples`` Kinesis records; before that the stream's, once all its shards together
        did; ``None`` until then."""
        limiter = self._shards.get(shard)
        if limiter is not None:
            counters = limiter.counters
            if counters.records_sent >= samples:
                return counters.user_records_sent / counters.records_sent
        kinesis = self.released_kinesis_records()
        if kinesis >= samples:
            return self.released_user_records / kinesis
        return None

    # -- introspection --------------------------------------------------------------------

    def shared_holds(self, now: float) -> tuple[int, bool]:
        """The records the shared (fleet) bucket refused so far, and whether it holds records
        back now (records wait, and it has no token for one)."""
        shared = self.shared
        if shared is None:
            return 0, False
        refusals = sum(lim.shared_refusals for lim in self._shards.values())
        return refusals, self.queued > 0 and shared.time_until(1, 1, now) > 0.0

    def queue_depths(self) -> dict[str, int]:
        depths = {shard: len(lim.queue) for shard, lim in self._shards.items()}
        return {shard: depth for shard, depth in depths.items() if depth}

    def rates(self) -> dict[str, tuple[float, float]]:
        return {
            shard: (lim.bucket.records_per_second, lim.bucket.bytes_per_second)
            for shard, lim in self._shards.items()
        }

    def token_levels(self, now: float) -> dict[str, tuple[float, float]]:
        return {shard: lim.bucket.levels(now) for shard, lim in self._shards.items()}

    def statistics(self, now: float | None) -> LimiterStatistics:
        """A frozen snapshot (token levels only with ``now``: none once closed)."""
        shards = {}
        for shard, lim in self._shards.items():
            counters, controller = lim.counters, lim.controller
            shards[shard] = LimiterShardStatistics(
                rate=(lim.bucket.records_per_second, lim.bucket.bytes_per_second),
                records_sent=counters.records_sent,
                bytes_sent=counters.bytes_sent,
                token_wait=counters.token_wait,
                queued=len(lim.queue),
                cuts=0 if controller is None else controller.cuts,
                noise=0.0 if controller is None else controller.noise_share,
            )
        return LimiterStatistics(
            ceiling=(self.records_ceiling, self.bytes_ceiling),
            shards=shards,
            token_levels={} if now is None else self.token_levels(now),
            queue_depths=self.queue_depths(),
            offered_records=self.offered_records,
            offered_bytes=self.offered_bytes,
            queued=self.queued,
        )

    def take_all(self) -> list[KinesisRecord]:
        """Remove and return every queued record (used when failing everything)."""
        records: list[KinesisRecord] = []
        for lim in self._shards.values():
            records.extend(lim.queue.take_all())
        self._waiting.clear()
        self.queued = 0
        return records
