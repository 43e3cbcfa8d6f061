"""Adaptive per-shard rate control that never trades a record for politeness.

The KPL's limiter is a static cap: ``Limiter::add_error()`` in aws/kinesis/core/limiter.h is an
empty ``// TODO react to throttling errors``. Several producers on one stream then each send a
shard's full rate, and the service throttles the excess forever. This controller closes that
loop per shard, under one rule above all: it must not deliver less than the static limiter
would (docs/adaptive.md has the picture and worked examples). Pure and clock-injected; the
Limiter applies its fraction, and never lets it starve the shard's queue of its TTL
(``_limiter.py``, the deadline floor).

The controller keeps a *fraction* of the shard's ceiling (``rate_limit`` percent of the shard's
limits), applied to records and bytes alike, and learns from every PutRecords outcome for its
shard: Kinesis records sent, throttled (ProvisionedThroughputExceeded) and accepted.

**Congestion: AIMD.** A *round* is the outcomes of the requests sent since the rate last
changed (at least ``window`` seconds and ``ROUND_RECORDS`` records). A round with throttled
records cuts the fraction by ``decrease``; while none come, it grows by ``increase`` of the
ceiling per second, a little faster the longer no cut comes. Additive increase with
multiplicative decrease is what lets independent producers on one shard converge on a fair
split without coordination (Chiu and Jain, 1989), and growing slowly near the rate where they
met is what keeps their throttled records rare.

**Noise: the likelihood guard.** Throttles that do not depend on our rate (a noisy neighbour, a
hot partition) look like congestion at any one rate, and AIMD answers them by cutting round
after round: the first version of this module cut every shard to its floor under a quarter of
records throttled at random (20,000 records: 30.6 s and 554 expired, against 5.0 s with the
static limiter). Only a change of rate tells the two apart, and AIMD's cuts are such changes.
So from the first throttle of a *throttled period* the controller counts, per rate it sent at,
the records sent and throttled, and weighs two explanations by likelihood, each at its most
likely parameter: *congestion* (the shard accepts ``c`` of the ceiling from us, so a share
``1 - c/f`` is throttled at rate ``f``) and *noise* (a share ``p`` at every rate). When noise
wins by ``EVIDENCE`` (a log-likelihood ratio), the cuts of the period are undone and only
throttles clearly beyond the noise level cut from then on. The verdict is checked twice over:
the throttled share must stay near the noise level at the same rate (``NOISE_CHECK_*``), and
every ``NOISE_HOLD`` seconds a probe cut to ``PROBE_SHARE`` must fail to lower it. To one of
several producers sharing a shard, throttles the others cause can look like noise while the
others hold their rates; without these checks that producer would keep the shard congested.

**Sampling finer while throttled.** A shard of 50 KB aggregates sends twenty Kinesis records a
second, so the guard needed seconds of them at two or three cut rates (1.2-1.6 times the static
limiter's time on a 7 s job under noise). While the controller is ``sampling`` (through a
throttled period) the Limiter sends the shard's aggregates in pieces of ``SAMPLE_SIZE`` (5
KiB): ten times the outcomes per second for the same bytes. Pieces of one aggregate are
throttled together under congestion, though, and independently under noise; so noise is only
judged, and a noise verdict only kept, while the throttles pass a test of dispersion
(``_clustered``), without which producers sharing a shard took each other's throttles for noise.

**Recovery: back to what was good, gently at first.** The controller remembers the highest rate
it held for ``GOOD_HOLD`` seconds without a throttle (for ``GOOD_MEMORY`` seconds). Once
``probe_delay`` has passed after a cut without another, it climbs towards ``GOOD_SHARE`` of that
rate, starting with a step of ``CLIMB_STEP`` and doubling the step every ``CLIMB_DOUBLING``
seconds (slow start on the increment): a shard whose storm has passed is back near its old rate
within two seconds, while producers sharing a shard, whose climb meets throttles within a round
or two, overshoot by a few percent of their rate. A climb that meets throttles doubles the
delay before the next one, up to ``PROBE_DELAY_MAX``.

Why not CUBIC (botocore's adaptive retry mode): its convex probe past the last congestion point
returns producers that share a shard to it within a second or two; ``tests/adaptive_sim.py``
measured 10-18 % of records throttled with four producers on a shard, against about 2 % here.
Why not DCTCP's cut in proportion to the throttled share alone: under noise it still compounds,
round after round (1.3-2.6 times the static limiter's time in the same simulation). The
simulation, its scenarios and the figures behind each constant are in docs/adaptive.md.
"""

from __future__ import annotations

import math

__all__ = ("CONGESTION", "NOISE", "RateController")

#: A round (the outcomes of requests sent since the last change of rate) needs this many
#: Kinesis records, and ``window`` seconds, before it can change the rate.
ROUND_RECORDS = 1

#: The log-likelihood ratio at which the noise explanation of a period's throttles wins...
EVIDENCE = 5.0
#: ... once the period has sent at rates this far apart (the lowest a share of the highest):
#: a cut from a rate to 0.7 of it moves the throttled share little when others share the shard
#: and hold their rates, but a cut to half of it does.
NOISE_SPREAD = 0.5
#: ... and counted this many records.
NOISE_RECORDS = 20
#: Throttles of half the records or more are never taken for noise. Producers that share a
#: shard and each take the others' throttles for noise would otherwise settle where the KPL's
#: static limiter does (measured: 56 % throttled with four producers on two shards), since
#: to each of them the throttled share no longer depends on its own rate.
NOISE_MAX = 0.5
#: Rates are counted in steps of this share of the ceiling for the evidence.
_BIN = 0.02
#: Noise is only judged once this many responses carried two or more of the shard's records
#: and their throttles look independent (see ``RateController._clustered``).
DISPERSION_REQUESTS = 5
#: ... at this many standard deviations of the chi-square statistic above its mean. A check
#: of a noise verdict comes every 40 records, several times a second while sampling, and each
#: false alarm sends the shard back to cutting: it asks for more (the pieces of an aggregate
#: that producers sharing a shard have throttled together give about five times the mean).
DISPERSION_SIGMAS = 3.0
DISPERSION_SIGMAS_CHECK = 5.0
_EPSILON = 0.01

#: A throttled period ends after this many seconds without a throttle, with at least
#: ``CLEAN_RECORDS`` records sent meanwhile; one that starts within ``PERIOD_MEMORY`` seconds
#: of the last one's end keeps that one's highest rate, its records per rate (the evidence) and
#: its verdict if it was noise.
CLEAN_TIME = 1.0
CLEAN_RECORDS = 20
PERIOD_MEMORY = 5.0

#: Under a noise verdict, every ``NOISE_CHECK_RECORDS`` records the throttled share is checked
#: against the verdict's: far fewer throttles (less likely than ``NOISE_CHECK_SIGNIFICANCE``
#: under the noise level) end the verdict.
NOISE_CHECK_RECORDS = 40
NOISE_CHECK_SIGNIFICANCE = 0.001
#: Every ``NOISE_HOLD`` seconds a probe cuts to ``PROBE_SHARE`` of the rate and is judged on the
#: next ``PROBE_RECORDS`` records (or what ``PROBE_TIME`` seconds bring): throttles that fell
#: (less likely than ``PROBE_SIGNIFICANCE`` under the noise level) mean congestion after all.
NOISE_HOLD = 5.0
PROBE_SHARE = 0.75
PROBE_RECORDS = 20
PROBE_TIME = 1.5
PROBE_SIGNIFICANCE = 0.01
#: Under a noise verdict, a round cuts for congestion beyond the noise only when its throttles
#: are less likely than this under the noise level. Rounds come four times a second per shard;
#: at two standard deviations (the first version) one in forty cut, and the climbs back kept
#: a shard under noise 5-10 % below its rate.
EXCESS_SIGNIFICANCE = 0.001

#: The known-good rate: held this long without a throttle, remembered this long. The climb
#: after a cut goes back to ``GOOD_SHARE`` of it once the probe delay has passed: first by
#: ``CLIMB_STEP`` of the rate, the step doubling every ``CLIMB_DOUBLING`` seconds.
GOOD_HOLD = 3.0
GOOD_MEMORY = 60.0
GOOD_SHARE = 0.95
CLIMB_STEP = 0.02
CLIMB_DOUBLING = 0.25
PROBE_DELAY = 0.5
PROBE_DELAY_MAX = 2.0

#: The additive increase doubles after this many seconds without a cut, triples after twice as
#: long, and so on.
ACCELERATION = 10.0

NOISE = "noise"
CONGESTION = "congestion"


def _lower_tail(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    q = 1.0 - p
    return sum(math.comb(n, i) * p**i * q ** (n - i) for i in range(k + 1))


def _upper_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return 1.0 - _lower_tail(k - 1, n, p) if k > 0 else 1.0


def _no_dispersion() -> list[float]:
    """Counts for ``RateController._clustered``, none yet: the responses that carried two or more
    of the shard's records, their records, their throttles, and the sum of throttled² / records."""
    return [0, 0, 0, 0.0]


def noise_evidence(bins: dict[int, list[int]]) -> tuple[float, float]:
    """(log-likelihood ratio of noise over congestion, the share throttled) for records
    counted per rate (``bins``: rate in steps of ``_BIN`` -> [sent, throttled]).

    Noise throttles one share ``p`` at every rate; congestion means the shard accepts ``c`` of
    the ceiling from us, so a share ``1 - c/f`` is throttled at rate ``f``. Each explanation is
    taken at its most likely parameter (``c`` by moments: accepted = sum of n * c / f)."""
    sent = throttled = 0
    scaled = 0.0
    for step, (n, t) in bins.items():
        sent += n
        throttled += t
        scaled += n / (step * _BIN)
    if len(bins) < 2 or not sent:
        return 0.0, throttled / sent if sent else 0.0
    p = min(1.0 - _EPSILON, max(_EPSILON, throttled / sent))
    capacity = (sent - throttled) / scaled
    log_p, log_q = math.log(p), math.log(1.0 - p)
    ratio = 0.0
    for step, (n, t) in bins.items():
        expected = min(1.0 - _EPSILON, max(_EPSILON, 1.0 - capacity / (step * _BIN)))
        ratio += t * (log_p - math.log(expected)) + (n - t) * (log_q - math.log(1.0 - expected))
    return ratio, throttled / sent


class _Segment:
    """The fraction's curve from one change (a cut, an undo, a probe) to the next."""

    __slots__ = ("delay", "goal", "increase", "low", "start")

    def __init__(
        self, start: float, low: float, goal: float, delay: float, increase: float
    ) -> None:
        self.start = start
        self.low = low  # where it starts
        self.goal = goal  # the climb's goal (<= low: no climb)
        self.delay = delay  # the climb starts this long after ``start``
        self.increase = increase  # 0: flat (a probe holds its rate)

    def at(self, when: float) -> float:
        t = when - self.start
        if t <= 0.0 or not self.increase:
            return self.low
        fraction = self.low + self.increase * t * (1.0 + t / ACCELERATION)
        if self.goal > fraction and t > self.delay:
            # the doublings counted up to 64 (past the goal from any start; 2.0 ** 1024, a climb
            # looked at minutes on, overflows)
            steps = 2.0 ** min((t - self.delay) / CLIMB_DOUBLING, 64.0) - 1.0
            climbed = self.low * (1.0 + CLIMB_STEP * steps)
            if climbed > fraction:
                fraction = climbed if climbed < self.goal else self.goal
        return 1.0 if fraction >= 1.0 else fraction


class RateController:
    """The rate control state of one shard. Rates are fractions of the shard's ceiling."""

    __slots__ = (
        "_bins",
        "_clean_sent",
        "_dispersion",
        "_ended",
        "_good",
        "_good_at",
        "_high",
        "_last_throttle_at",
        "_noise_counts",
        "_noise_dispersion",
        "_probe_after",
        "_probe_at",
        "_probe_delay",
        "_round_sent",
        "_round_throttled",
        "_segments",
        "bytes_ceiling",
        "cuts",
        "decrease",
        "evidence",
        "floor",
        "increase",
        "noise",
        "records_ceiling",
        "support",
        "throttled",
        "verdict",
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
        #: the least fraction the Limiter applies anyway (its deadline floor): a cut below it
        #: would not lower what the shard sends, only what the climb back starts from
        self.support = 0.0
        self.window = window
        # the curve: the latest segment rules now, the one before says what the fraction was
        # for requests sent before the latest change
        self._segments: list[_Segment] = []
        # the known-good rate and when it was last confirmed
        self._good = 0.0
        self._good_at = -math.inf
        self._probe_delay = PROBE_DELAY
        self._last_throttle_at = -math.inf
        self._clean_sent = 0
        self._round_sent = 0
        self._round_throttled = 0
        # the throttled period: verdict None outside one, CONGESTION or NOISE in one; the
        # records counted per rate; the highest rate of the period (a noise verdict goes back
        # to it); the last period's end (time, highest rate, verdict, noise share)
        self.verdict: str | None = None
        self._bins: dict[int, list[int]] = {}
        # the period's dispersion counts (``_no_dispersion``)
        self._dispersion = _no_dispersion()
        self._high = 1.0
        self._ended: (
            tuple[float, float, str | None, float, dict[int, list[int]], list[float]] | None
        ) = None
        # under a noise verdict: the records since the last check, and the probe (when it is
        # due, and its records so far, None while not probing)
        self._noise_counts = [0, 0]
        self._noise_dispersion = _no_dispersion()
        self._probe_at = math.inf
        self._probe_after: list[int] | None = None
        self.evidence = 0.0  # the period's log-likelihood ratio, noise over congestion
        self.noise = 0.0  # the share of records throttled whatever the rate
        self.cuts = 0
        self.throttled = 0

    def __repr__(self) -> str:
        return (
            f"<RateController cuts={self.cuts} throttled={self.throttled} "
            f"verdict={self.verdict} noise={self.noise:.2f}>"
        )

    @property
    def noise_share(self) -> float:
        """The share of the shard's records throttled whatever the rate (0 unless the
        throttles of the current period were judged to be noise)."""
        return self.noise if self.verdict == NOISE else 0.0

    @property
    def sampling(self) -> bool:
        """Whether the shard is in a throttled period. The Limiter then sends its aggregates
        in smaller pieces: more outcomes per second tell noise from congestion sooner, and
        their dispersion (``_clustered``) tells them apart at all."""
        return self.verdict is not None

    @staticmethod
    def _clustered(dispersion: list[float], sigmas: float = DISPERSION_SIGMAS) -> bool:
        """Whether the period's throttles come in clusters within a response rather than
        independently of each other.

        A shard over its limit throttles the records of a request that come after its tokens
        ran out, so the pieces of one aggregate are throttled together; noise throttles each
        record on its own. Counted as independent trials, clustered throttles make the
        likelihood guard far too sure of itself (four producers sharing a stream took each
        other's throttles for noise, 35-47 % of their bytes throttled, once aggregates were
        split). A chi-square test of dispersion over the responses that carried two or more
        of the shard's records: under independent throttles at the period's share ``p`` the
        statistic has about one degree of freedom per response."""
        responses, sent, throttled, squares = dispersion
        if responses < DISPERSION_REQUESTS or not throttled or throttled == sent:
            return False
        p = throttled / sent
        # sum over responses of (t - n p)^2 / (n p (1 - p)), from the running sums
        chi2 = (squares - 2.0 * p * throttled + p * p * sent) / (p * (1.0 - p))
        return chi2 > responses + sigmas * math.sqrt(2.0 * responses)

    # -- the curve ------------------------------------------------------------------------

    def fraction(self, now: float) -> float:
        """The share of the ceiling allowed at ``now``."""
        if not self._segments:
            return 1.0
        return self._segments[-1].at(now)

    def _fraction_at(self, when: float) -> float:
        """The fraction as it was at ``when`` (as far as the kept segments tell)."""
        segments = self._segments
        for segment in reversed(segments):
            if segment.start <= when:
                return segment.at(when)
        return segments[0].low if segments else 1.0

    def _set(self, now: float, low: float, *, flat: bool = False) -> None:
        """Change the rate to ``low`` at ``now``; it grows from there unless ``flat``."""
        low = max(low, self.floor, self.support)
        good = self._good if now - self._good_at <= GOOD_MEMORY else 0.0
        increase = 0.0 if flat else self.increase
        segment = _Segment(now, low, GOOD_SHARE * good, self._probe_delay, increase)
        self._segments = [*self._segments[-1:], segment]
        self._round_sent = self._round_throttled = 0

    # -- outcomes -------------------------------------------------------------------------

    def outcome(self, now: float, sent_at: float, sent: int, throttled: int) -> bool:
        """``sent`` Kinesis records of a request sent at ``sent_at`` came back, ``throttled``
        of them ProvisionedThroughputExceeded (records failed for other reasons are not in
        ``sent``). Returns whether the fraction changed."""
        if not sent:
            return False
        if self._last_throttle_at == -math.inf:
            # the first outcome: nothing was held without a throttle before it
            self._last_throttle_at = now
        self.throttled += throttled
        current = self._segments[-1].start if self._segments else -math.inf
        this_round = sent_at >= current
        if this_round:
            self._round_sent += sent
            self._round_throttled += throttled
        if throttled:
            self._last_throttle_at = now
            self._clean_sent = 0
        else:
            self._clean_sent += sent
            if now - self._last_throttle_at >= GOOD_HOLD:
                self._confirm_good(now)
        if self.verdict is None:
            if not throttled:
                return False
            self._start_period(sent_at, now)
        if this_round and self.verdict == CONGESTION:
            step = max(1, round(self._fraction_at(sent_at) / _BIN))
            counts = self._bins.get(step)
            if counts is None:
                counts = self._bins[step] = [0, 0]
            counts[0] += sent
            counts[1] += throttled
        if this_round and sent >= 2 and self.verdict is not None:
            # the period's, or under a noise verdict the current check's
            dispersion = self._dispersion if self.verdict == CONGESTION else self._noise_dispersion
            dispersion[0] += 1
            dispersion[1] += sent
            dispersion[2] += throttled
            dispersion[3] += throttled * throttled / sent
        if self.verdict == NOISE and self._probe_at <= now:
            return self._probe(now, sent_at, sent, throttled)
        if (
            not throttled
            and now - self._last_throttle_at >= CLEAN_TIME
            and self._clean_sent >= CLEAN_RECORDS
        ):
            self._end_period(now)
            return False
        if not this_round or now - current < self.window or self._round_sent < ROUND_RECORDS:
            return False
        return self._round(now)

    def _confirm_good(self, now: float) -> None:
        """No throttle for ``GOOD_HOLD`` seconds: the rate held since then is good."""
        held = self._fraction_at(now - GOOD_HOLD)
        if held >= self._good or now - self._good_at > GOOD_MEMORY:
            self._good = held
        self._good_at = now
        if held >= GOOD_SHARE * self._good:
            self._probe_delay = PROBE_DELAY

    def _to_congestion(self) -> None:
        """The throttles are congestion: gather the evidence afresh."""
        self.verdict = CONGESTION
        self._bins = {}
        self._dispersion = _no_dispersion()
        self.noise = 0.0

    def _start_period(self, sent_at: float, now: float) -> None:
        self._to_congestion()
        self._high = self._fraction_at(sent_at)
        self.evidence = 0.0
        ended = self._ended
        if ended is not None and now - ended[0] <= PERIOD_MEMORY:
            # Throttles paused for a second, at a low rate: the last period's highest rate
            # stays the rate a noise verdict goes back to (noise that pauses by chance must
            # not leave the rate it was cut to as the new normal), its records keep counting
            # as evidence (rare throttles pause often: each pause used to restart the cuts
            # from nothing), and its verdict carries on if it was noise.
            _, high, verdict, noise, bins, dispersion = ended
            self._high = max(self._high, high)
            self._bins = bins
            self._dispersion = dispersion
            if verdict == NOISE:
                self._to_noise(now, noise)

    def _end_period(self, now: float) -> None:
        self._ended = (now, self._high, self.verdict, self.noise, self._bins, self._dispersion)
        self.verdict = None
        self.evidence = 0.0
        self.noise = 0.0
        self._probe_after = None
        self._probe_at = math.inf

    def _round(self, now: float) -> bool:
        """A round of outcomes is complete: act on it."""
        sent, throttled = self._round_sent, self._round_throttled
        current = self.fraction(now)
        if self.verdict == NOISE:
            return self._noise_round(now, current, sent, throttled)
        # CONGESTION, unless the share throttled stays the same however far the rate falls
        evidence, share = noise_evidence(self._bins)
        self.evidence = evidence
        if (
            evidence >= EVIDENCE
            and share < NOISE_MAX
            and min(self._bins) <= NOISE_SPREAD * max(self._bins)
            and sum(n for n, _ in self._bins.values()) >= NOISE_RECORDS
            and not self._clustered(self._dispersion)
        ):
            self._high = max(self._high, _BIN * max(self._bins))
            self._to_noise(now, share)
            self._set(now, self._high)
            return True
        if not throttled:
            self._round_sent = self._round_throttled = 0
            return False
        self._cut(now, current, current * self.decrease)
        return True

    def _noise_round(self, now: float, current: float, sent: int, throttled: int) -> bool:
        counts = self._noise_counts
        counts[0] += sent
        counts[1] += throttled
        if counts[0] >= NOISE_CHECK_RECORDS:
            if (
                _lower_tail(counts[1], counts[0], self.noise) < NOISE_CHECK_SIGNIFICANCE
                or counts[1] >= NOISE_MAX * counts[0]
                or self._clustered(self._noise_dispersion, DISPERSION_SIGMAS_CHECK)
            ):
                # Far fewer throttles than the noise verdict said, at the same rate: they were
                # not noise (producers sharing the shard changed their rates) or the noise is
                # gone. Or half or more throttled: producers that took each other's throttles
                # for noise. Or throttles that come together: a shard out of tokens. Either
                # way, throttles are congestion again.
                self._to_congestion()
                self._round_sent = self._round_throttled = 0
                return False
            # the noise level follows what this window saw (weighted like three windows)
            self.noise = (3.0 * self.noise + counts[1] / counts[0]) / 4.0
            self._noise_counts = [0, 0]
            self._noise_dispersion = _no_dispersion()
        noise = self.noise
        excess = throttled / sent - noise - 2.0 * math.sqrt(noise * (1.0 - noise) / sent)
        if excess <= 0.0 or _upper_tail(throttled, sent, noise) >= EXCESS_SIGNIFICANCE:
            self._round_sent = self._round_throttled = 0
            return False
        # congestion beyond the noise: cut in proportion to it
        cut = (1.0 - self.decrease) * min(1.0, excess / (1.0 - noise))
        self._cut(now, current, current * (1.0 - cut))
        return True

    def _to_noise(self, now: float, share: float) -> None:
        """The throttles are noise: from now on only throttles beyond the noise level cut."""
        self.verdict = NOISE
        self.noise = share
        self._noise_counts = [0, 0]
        self._noise_dispersion = _no_dispersion()
        self._probe_at = now + NOISE_HOLD
        self._probe_after = None
        # the period's highest rate is good under this noise: the climb returns to it after
        # a cut for congestion beyond the noise
        self._good, self._good_at = self._high, now

    def _cut(self, now: float, current: float, target: float) -> None:
        segment = self._segments[-1] if self._segments else None
        if segment is not None and segment.goal > segment.low and current > segment.low * 1.05:
            # the climb met throttles: wait longer before the next one
            self._probe_delay = min(PROBE_DELAY_MAX, 2.0 * self._probe_delay)
        self._set(now, target)
        self.cuts += 1

    def _probe(self, now: float, sent_at: float, sent: int, throttled: int) -> bool:
        """The probe of a noise verdict: cut to ``PROBE_SHARE`` and see whether the throttled
        share falls below what the noise would give."""
        after = self._probe_after
        if after is None:
            self._probe_after = [0, 0]
            self._set(now, PROBE_SHARE * self.fraction(now), flat=True)
            self._probe_at = now  # the probe's start
            return True
        if sent_at < self._probe_at:
            return False
        after[0] += sent
        after[1] += throttled
        if after[0] < PROBE_RECORDS and now - self._probe_at < PROBE_TIME:
            return False
        self._probe_after = None
        if _lower_tail(after[1], after[0], self.noise) < PROBE_SIGNIFICANCE:
            # the share fell with our rate: congestion after all; the probe's cut stays
            self._to_congestion()
            self._set(now, self.fraction(now))
            return True
        self._probe_at = now + NOISE_HOLD
        self._set(now, self._high)
        return True
