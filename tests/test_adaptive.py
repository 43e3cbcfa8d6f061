"""The adaptive rate controller on a virtual clock, no event loop.

The scenario tests drive it through ``tests/adaptive_sim.py`` (a shard and its producers,
simulated) for each case issue 10 names: throttles that come whatever the rate, recovery after
a throttle storm, and producers that really share a shard. The deadline floor is the Limiter's
and is tested in ``test_limiter.py``.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anykpl._core._adaptive import (
    CONGESTION,
    NOISE,
    RateController,
    _lower_tail,
    _Segment,
    noise_evidence,
)

from . import adaptive_sim as sim

SEEDS = range(1, 5)


def make(**overrides: float) -> RateController:
    return sim.controller(**overrides)


def feed(c: RateController, start: float, end: float, sent: int, throttled: int) -> float:
    """A round of outcomes every 0.25 s from ``start`` to ``end``; returns the time reached."""
    now = start
    while now < end:
        now += 0.25
        c.outcome(now, now - 0.1, sent, throttled)
    return now


# -- the pieces -----------------------------------------------------------------------------


def test_starts_at_the_ceiling_and_stays_there_without_throttles() -> None:
    c = make()
    feed(c, 0.0, 10.0, 10, 0)
    assert c.fraction(10.0) == 1.0
    assert c.cuts == 0
    assert c.verdict is None


def test_a_throttled_round_cuts_by_the_decrease_factor_once_per_round() -> None:
    c = make(decrease=0.7)
    c.outcome(1.0, 0.9, 10, 3)
    assert c.fraction(1.0) == pytest.approx(0.7)
    # sent before the cut: the same congestion event
    c.outcome(1.05, 0.95, 10, 10)
    assert c.fraction(1.05) == pytest.approx(0.7, abs=1e-3)
    # a new round, but before the window has passed
    c.outcome(1.2, 1.05, 10, 10)
    assert c.cuts == 1
    c.outcome(1.3, 1.1, 10, 10)
    assert c.cuts == 2
    assert c.verdict == CONGESTION


def test_lower_tail() -> None:
    assert _lower_tail(0, 10, 0.5) == pytest.approx(0.5**10)
    assert _lower_tail(10, 10, 0.3) == pytest.approx(1.0)
    assert _lower_tail(2, 20, 0.25) == pytest.approx(0.0913, abs=1e-4)


def test_evidence_tells_noise_from_congestion() -> None:
    # a quarter throttled at every rate: noise
    noise = {50: [40, 10], 35: [40, 10], 25: [40, 10]}
    ratio, share = noise_evidence(noise)
    assert ratio > 5
    assert share == pytest.approx(0.25)
    # the shard accepts 40 % of the ceiling: 60 % throttled at 1.0, 20 % at 0.5, none at 0.35
    congestion = {50: [40, 24], 25: [40, 8], 17: [40, 0]}
    ratio, _ = noise_evidence(congestion)
    assert ratio < -5
    # one rate alone says nothing
    assert noise_evidence({50: [100, 25]}) == (0.0, 0.25)


@given(
    st.lists(
        st.tuples(st.floats(0.05, 0.5), st.integers(1, 30), st.integers(0, 30)),
        min_size=1,
        max_size=100,
    )
)
def test_fraction_stays_between_floor_and_ceiling(rounds: list[tuple[float, int, int]]) -> None:
    c = make(floor=0.05)
    now = 0.0
    for gap, sent, throttled in rounds:
        now += gap
        c.outcome(now, now - 0.05, sent, min(sent, throttled))
        assert 0.05 <= c.fraction(now) <= 1.0


# -- the scenarios --------------------------------------------------------------------------


def _static_and_adaptive(seed: int, backlog: int, **run: object) -> tuple[float, float]:
    times = []
    for controller in (None, make()):
        producer = sim.SimProducer(controller, backlog=backlog)
        times.append(sim.run([producer], 300.0, seed=seed, **run))  # type: ignore[arg-type]
    return times[0], times[1]


@pytest.mark.parametrize(("noise", "bound"), [(0.1, 1.3), (0.25, 1.2), (0.4, 1.2)])
def test_rate_independent_throttles_cost_little(noise: float, bound: float) -> None:
    """A share of records throttled whatever the rate (a noisy neighbour): the first version
    cut every shard to its floor and kept it there. Now the likelihood guard sees that the
    share does not fall with the rate, undoes the cuts and ignores the noise: the backlog is
    delivered in at most 1.2 times the static limiter's time (1.05-1.16 here; what the
    evidence costs is the rounds cut before it is in). Rare throttles (a tenth) pause long
    enough to end a throttled period: the next one keeps its evidence (it was thrown away,
    and the rate cut again from scratch: 1.35 times here)."""
    ratios = []
    for seed in SEEDS:
        static, adaptive = _static_and_adaptive(seed, 600, noise=noise)
        ratios.append(adaptive / static)
    assert max(ratios) <= bound, ratios


def test_noise_is_recognised_and_the_rate_goes_back_up() -> None:
    producer = sim.SimProducer(make())
    sim.run([producer], 8.0, noise=0.25, seed=3)
    c = producer.controller
    assert c is not None
    assert c.verdict == NOISE
    assert c.noise == pytest.approx(0.25, abs=0.1)
    assert c.fraction(8.0) >= 0.7


def test_storm_recovery() -> None:
    """After 5 s at its ceiling, the shard's limit drops to 30 % for 10 s. Alone on the shard
    again, the rate is back at >= 90 % of the ceiling within 3 s, and the backlog takes at
    most 1.15 times as long as with the static limiter (which never cuts, and delivers what
    the shard accepts)."""

    def limit(now: float) -> float:
        return 0.3 if 5.0 <= now < 15.0 else 1.0

    for seed in SEEDS:
        static, adaptive = _static_and_adaptive(seed, 1000, limit=limit)
        assert adaptive / static <= 1.15
        cut, recovered = _storm_watch(seed, limit)
        assert cut < 0.5  # it did cut during the storm
        assert recovered <= 3.0


def _storm_watch(seed: int, limit: Callable[[float], float]) -> tuple[float, float]:
    """The lowest fraction during the storm, and the seconds after it to >= 90 %."""
    producer = sim.SimProducer(make())
    lowest = 1.0
    recovered = math.inf

    def watch(now: float) -> None:
        nonlocal lowest, recovered
        fraction = producer.fraction(now)
        if 5.0 <= now < 15.0:
            lowest = min(lowest, fraction)
        elif now >= 15.0 and recovered == math.inf and fraction >= 0.9:
            recovered = now - 15.0

    sim.run([producer], 25.0, limit=limit, seed=seed, on_step=watch)
    return lowest, recovered


def _share(n: int, seed: int) -> tuple[float, float, float]:
    producers = [sim.SimProducer(make()) for _ in range(n)]
    marks: list[tuple[int, int, int]] = []

    def mark(now: float) -> None:
        if not marks and now >= 10.0:
            marks.extend((p.delivered, p.throttled, p.sent) for p in producers)

    sim.run(producers, 40.0, seed=seed, on_step=mark)
    delivered = [p.delivered - m[0] for p, m in zip(producers, marks, strict=True)]
    throttled = sum(p.throttled - m[1] for p, m in zip(producers, marks, strict=True))
    sent = sum(p.sent - m[2] for p, m in zip(producers, marks, strict=True))
    fair = sum(delivered) / n
    return throttled / sent, min(delivered) / fair, sum(delivered) / (30.0 * sim.CEILING)


def test_producers_sharing_a_shard_throttle_little_and_fairly() -> None:
    """Four producers, each able to fill the shard: after a 10 s warm-up, the shard is full,
    few records are throttled, and nobody gets less than half its fair share."""
    results = [_share(4, seed) for seed in SEEDS]
    assert statistics.mean(r[0] for r in results) <= 0.03
    assert min(r[1] for r in results) >= 0.5
    assert min(r[2] for r in results) >= 0.95


def test_static_producers_sharing_a_shard_throttle_most_of_what_they_send() -> None:
    """The reference the controller is for: without it, most of what four producers send to a
    shard is throttled."""
    producers = [sim.SimProducer(None) for _ in range(4)]
    sim.run(producers, 20.0, seed=1)
    assert sum(p.throttled for p in producers) / sum(p.sent for p in producers) > 0.5


def _verdicts(clustered: bool, seed: int) -> list[str | None]:
    """A lone producer's verdicts, response by response, with a quarter of its records
    throttled whatever its rate: each record on its own (noise), or the five records of a
    response together (what a shard over its limit does to the pieces of an aggregate)."""
    rng = random.Random(seed)
    c = make()
    verdicts = []
    now = 0.0
    while now < 20.0:
        now += 0.1
        if clustered:
            throttled = 5 if rng.random() < 0.25 else 0
        else:
            throttled = sum(rng.random() < 0.25 for _ in range(5))
        c.outcome(now, now - 0.05, 5, throttled)
        verdicts.append(c.verdict)
    return verdicts


@pytest.mark.parametrize("seed", SEEDS)
def test_throttles_that_come_together_are_not_taken_for_noise(seed: int) -> None:
    assert NOISE in _verdicts(clustered=False, seed=seed)
    assert NOISE not in _verdicts(clustered=True, seed=seed)


def test_the_controller_samples_through_a_throttled_period() -> None:
    """From the first throttle until a clean second ends the period, the Limiter splits the
    shard's aggregates (more outcomes, and the dispersion that tells congestion from noise);
    outside one it does not."""
    rng = random.Random(3)
    c = make()
    assert not c.sampling
    now = 0.0
    seen = set()
    while now < 20.0:
        now += 0.1
        noisy = now < 10.0
        c.outcome(now, now - 0.05, 5, sum(rng.random() < 0.25 for _ in range(5)) if noisy else 0)
        seen.add((noisy, c.verdict, c.sampling))
    assert (True, CONGESTION, True) in seen
    assert (True, NOISE, True) in seen
    assert c.verdict is None
    assert not c.sampling
    assert all(sampling == (verdict is not None) for _, verdict, sampling in seen)


def _until_noise_verdict(c: RateController, rng: random.Random, records: int) -> float:
    """A response of ``records`` records every 0.1 s, a quarter of them throttled one by one,
    until ``c`` judges the throttles noise (within 20 s); returns the time then."""
    now = 0.0
    while c.verdict != NOISE:
        now += 0.1
        c.outcome(now, now - 0.05, records, sum(rng.random() < 0.25 for _ in range(records)))
        assert now < 20.0
    return now


def test_a_noise_verdict_ends_when_the_throttles_come_together() -> None:
    """Producers sharing a shard can take each other's throttles for noise while the others
    hold their rates; the pieces of an aggregate, throttled together, give it away."""
    rng = random.Random(5)
    c = make()
    now = _until_noise_verdict(c, rng, 5)
    # the same share of throttles, but whole responses at a time
    start = now
    while c.verdict == NOISE:
        now += 0.1
        c.outcome(now, now - 0.05, 5, 5 if rng.random() < 0.25 else 0)
        assert now - start < 5.0, "the verdict outlived the clustered throttles"
    assert c.verdict == CONGESTION


def _under_noise(seed: int) -> tuple[int, float]:
    """A lone producer with a quarter of its records throttled whatever its rate, one response
    of 20 records every 0.1 s for 60 s: the cuts after the noise verdict, and the mean rate
    from the verdict on."""
    rng = random.Random(seed)
    c = make()
    now = _until_noise_verdict(c, rng, 20)
    cuts, rates = c.cuts, []
    while now < 60.0:
        now += 0.1
        c.outcome(now, now - 0.05, 20, sum(rng.random() < 0.25 for _ in range(20)))
        rates.append(c.fraction(now))
    return c.cuts - cuts, statistics.fmean(rates)


@pytest.mark.parametrize("seed", SEEDS)
def test_under_a_noise_verdict_chance_does_not_cut(seed: int) -> None:
    """Rounds come four times a second: a cut for throttles two standard deviations above the
    noise came every few seconds by chance (and each climb back cost a shard some of its
    rate); a cut now needs throttles less likely than EXCESS_SIGNIFICANCE under the noise."""
    cuts, mean = _under_noise(seed)
    assert cuts <= 2  # 12-19 with the first version's rule (measured, seeds 1-8)
    assert mean >= 0.97


def test_chance_cut_under_noise_at_two_standard_deviations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above fails with the first version's rule (any excess past 2 sigma cut)."""
    monkeypatch.setattr("anykpl._core._adaptive.EXCESS_SIGNIFICANCE", 1.0)
    assert all(_under_noise(seed)[0] >= 10 for seed in SEEDS)


# -- recovery after an early storm, and a shard that accepts less than the ceiling ------------


def _storm_then_clean(start: float, storm: float) -> tuple[RateController, float]:
    """A lone producer: clean rounds until ``start``, throttled rounds (half of each) for
    ``storm`` seconds, clean rounds for 3 s after the last throttle; returns the controller
    and the time of the last throttled outcome."""
    c = make()
    now = feed(c, 0.0, start, 10, 0) if start > 0 else 0.0
    last = feed(c, now, now + storm, 10, 5)
    feed(c, last, last + 3.0, 10, 0)
    return c, last


def test_a_storm_after_a_long_clean_history_is_recovered_within_three_seconds() -> None:
    c, last = _storm_then_clean(10.0, 1.0)
    assert c.cuts >= 3
    assert c.fraction(last + 3.0) >= 0.9


def test_cuts_stop_at_the_rate_the_limiter_applies_anyway() -> None:
    """While the Limiter's deadline floor holds the shard at a rate (``support``), throttles
    cut no lower: the shard sends that rate whatever the controller says. Cut to the bottom
    instead, the climb after a storm started far below what had been sent (a storm that ended
    0.2 s after the last cut took 2.7-3.1 s to recover in tests/integration/test_delivery.py;
    1.9 s now)."""
    c, last = _storm_then_clean(10.0, 0.0)  # a clean history: a good rate to climb back to
    c.support = 0.32
    now = last
    while now < last + 3.0:  # a storm: half of every round throttled
        now = feed(c, now, now + 0.25, 10, 5)
        assert c.fraction(now) >= 0.32
    assert c.cuts >= 3
    assert c.fraction(now) == pytest.approx(0.32)
    c.support = 0.0  # the queue drained: the floor is gone, the climb starts from 0.32
    feed(c, now, now + 3.0, 10, 0)
    assert c.fraction(now + 3.0) >= 0.9


@pytest.mark.parametrize("seed", SEEDS)
def test_a_shard_that_accepts_half_the_ceiling_throttles_little(seed: int) -> None:
    """A lone producer whose shard accepts only half of its ceiling (what sharing it with an
    equal producer that holds its rate looks like) for 60 s: it settles near that half
    without climbing to the ceiling again and again."""
    producer = sim.SimProducer(make())
    sim.run([producer], 60.0, limit=lambda now: 0.5, seed=seed)
    assert producer.throttled / producer.sent <= 0.03
    assert producer.delivered >= 0.9 * 0.5 * sim.CEILING * 60.0


def test_a_slow_climb_looked_at_much_later_reaches_its_goal() -> None:
    # a segment whose own increase is tiny climbs by doublings: looked at long after its start
    # (minutes of a shard with nothing to send), the doubling stops at its goal (no overflow)
    segment = _Segment(start=0.0, low=0.1, goal=0.9, delay=1.0, increase=1e-12)
    assert segment.at(0.5) == pytest.approx(0.1)
    assert 0.1 < segment.at(2.0) < 0.9
    assert segment.at(3_600.0) == 0.9
