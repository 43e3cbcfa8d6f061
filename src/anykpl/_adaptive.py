"""Adaptive per-shard rate control: AIMD on the Limiter's refill rate, pure and clock-injected.

The KPL's limiter is a static cap: ``Limiter::add_error()`` in aws/kinesis/core/limiter.h is an
empty ``// TODO react to throttling errors``. Several producers on one stream then each send a
shard's full rate, and the service throttles the excess forever. This controller closes that
loop, per shard (see docs/adaptive.md for the picture and a worked example):

- **Ceiling.** The token bucket's configured rate (``rate_limit`` percent of the shard's
  limits) stays the ceiling; the controller only chooses a *fraction* of it, applied to records
  and bytes alike.
- **Decrease.** Per-record ProvisionedThroughputExceeded results for the shard are a congestion
  event: the fraction becomes ``decrease × min(current fraction, fraction actually sent)``.
  Basing the cut on the rate actually sent matters when a producer sends less than its
  allowance: cutting an allowance it does not use would change nothing. A batch of 300
  throttled records is one event, not 300: throttles for requests that were sent before the
  last cut, or that arrive within ``window`` seconds of it, do not cut again (TCP's "one
  decrease per round trip").
- **Increase.** While no throttles arrive the fraction grows by ``increase`` (a fraction of the
  ceiling) per second, back to 1 — and faster the longer no throttle arrives: the increase
  doubles after ``ACCELERATION`` seconds, triples after twice as long. Near the rate where the
  shard last throttled the growth is slow, which keeps congestion events (and so throttled
  records) rare; a producer that has the shard to itself again is soon back at the ceiling.
- **Floor.** The fraction never drops below ``floor``, so a cut shard keeps probing.

Why AIMD rather than CUBIC (botocore's adaptive mode): the point of the controller is sharing a
shard between independent producers, and additive-increase/multiplicative-decrease is the rule
that provably converges to a *fair* split without coordination (Chiu and Jain, 1989): every cut
shrinks the gap between two producers' rates by the factor ``decrease``, and every increase
leaves it unchanged. CUBIC converges too, but its growth depends on the time since the last cut
and on the rate before it, and it is tuned for round trips of many milliseconds over the open
internet; AIMD has two parameters a user can reason about ("30 % off per congestion event,
0.5 % of the shard back per second"). We borrow one idea from CUBIC's probing: the longer no
throttle arrives, the faster the increase (it stays additive, and the same for every producer,
so the fairness argument holds). The defaults are botocore's 0.7 for ``decrease`` (TCP's 0.5
wastes a quarter of a shard when producers cut together) and 0.5 % of the ceiling per second
for ``increase``, measured with ``benchmarks/shared_stream.py`` (four producers, two shards):
N producers cause about N² × increase ÷ (1 − decrease) congestion events per second per shard,
and each costs a few throttled aggregates. An increase of 0.05 per second throttled 7 % of the
Kinesis records, 0.02 about 3 %, 0.005 about 1 %; the shard's own burst allowance kept the
shards 100 % used in every case. See docs/adaptive.md.
"""

from __future__ import annotations

import math

__all__ = ("RateController",)

#: The additive increase doubles after this many seconds without a throttle, triples after twice
#: as long, and so on: slow near the rate where the shard last throttled, faster once the
#: producer has it to itself.
ACCELERATION = 10.0

#: How often the sent rate is sampled, and how many samples make the measured rate (so the
#: measured rate covers about the last second).
SAMPLE_INTERVAL = 0.25
SAMPLES = 5


class RateController:
    """The AIMD state of one shard. Rates are fractions of the shard's ceiling."""

    __slots__ = (
        "_cut_at",
        "_cut_fraction",
        "_samples",
        "bytes_ceiling",
        "cuts",
        "decrease",
        "floor",
        "increase",
        "next_sample",
        "records_ceiling",
        "throttled",
        "window",
    )

    def __init__(
        self,
        *,
        records_ceiling: float,
        bytes_ceiling: float,
        decrease: float,
        increase: float,
        floor: float,
        window: float,
    ) -> None:
        self.records_ceiling = records_ceiling
        self.bytes_ceiling = bytes_ceiling
        self.decrease = decrease
        self.increase = increase
        self.floor = floor
        self.window = window
        self._cut_at = -math.inf
        self._cut_fraction = 1.0
        # (time, records sent, bytes sent) samples of the shard's cumulative counters
        self._samples: list[tuple[float, float, float]] = []
        self.next_sample = -math.inf
        self.cuts = 0
        self.throttled = 0

    def __repr__(self) -> str:
        return f"<RateController cuts={self.cuts} throttled={self.throttled}>"

    def fraction(self, now: float) -> float:
        """The share of the ceiling allowed at ``now``."""
        elapsed = now - self._cut_at
        if elapsed == math.inf:
            return 1.0
        fraction = self._cut_fraction + self.increase * elapsed * (1.0 + elapsed / ACCELERATION)
        return 1.0 if fraction >= 1.0 else fraction

    def recovering(self, now: float) -> bool:
        """Whether the rate is below the ceiling at ``now`` (the caller re-applies it)."""
        return self.fraction(now) < 1.0

    def sample(self, now: float, records_sent: float, bytes_sent: float) -> None:
        """Record the shard's cumulative sent counters (call when ``now >= next_sample``)."""
        samples = self._samples
        if samples and now - samples[-1][0] > 2 * SAMPLE_INTERVAL:
            # the shard was idle (it is sampled only while records wait): a sample from
            # before the pause would average the pause into the rate
            samples.clear()
        samples.append((now, records_sent, bytes_sent))
        if len(samples) > SAMPLES:
            del samples[0]
        self.next_sample = now + SAMPLE_INTERVAL

    def measured(self, now: float) -> float | None:
        """The fraction of the ceiling sent over about the last second: the larger of the
        records and bytes fractions (``None`` without two recent samples)."""
        samples = self._samples
        if len(samples) < 2 or now - samples[-1][0] > 2 * SAMPLE_INTERVAL:
            return None
        (start, records0, bytes0), (end, records1, bytes1) = samples[0], samples[-1]
        elapsed = end - start
        if elapsed <= 0:
            return None
        return max(
            (records1 - records0) / elapsed / self.records_ceiling,
            (bytes1 - bytes0) / elapsed / self.bytes_ceiling,
        )

    def throttled_at(self, now: float, sent_at: float, records: int) -> bool:
        """``records`` Kinesis records of a request sent at ``sent_at`` were throttled; return
        whether this cut the rate (a new congestion event)."""
        self.throttled += records
        if sent_at < self._cut_at or now - self._cut_at < self.window:
            return False  # the same congestion event as the last cut
        current = self.fraction(now)
        measured = self.measured(now)
        base = current if measured is None or measured > current else measured
        cut = self.decrease * base
        self._cut_fraction = cut if cut > self.floor else self.floor
        self._cut_at = now
        self.cuts += 1
        return True
