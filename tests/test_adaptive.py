"""The adaptive rate controller: AIMD on a virtual clock, no event loop."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anykpl._adaptive import ACCELERATION, SAMPLE_INTERVAL, RateController


def make(
    *,
    decrease: float = 0.8,
    increase: float = 0.05,
    floor: float = 0.05,
    window: float = 0.25,
) -> RateController:
    return RateController(
        records_ceiling=1000.0,
        bytes_ceiling=1_000_000.0,
        decrease=decrease,
        increase=increase,
        floor=floor,
        window=window,
    )


def feed(controller: RateController, start: float, end: float, fraction: float) -> None:
    """Samples of a shard sending ``fraction`` of its byte ceiling from ``start`` to ``end``."""
    t = start
    while t <= end + 1e-9:
        sent = fraction * 1_000_000.0 * (t - start)
        controller.sample(t, 0.0, sent)
        t += SAMPLE_INTERVAL


def test_starts_at_the_ceiling_and_stays_there_without_throttles() -> None:
    controller = make()
    assert controller.fraction(0.0) == 1.0
    assert controller.fraction(1e6) == 1.0
    assert not controller.recovering(5.0)
    assert controller.cuts == 0


def test_a_throttle_cuts_by_the_decrease_factor() -> None:
    controller = make()
    assert controller.throttled_at(10.0, 9.9, 3)
    assert controller.fraction(10.0) == pytest.approx(0.8)
    assert controller.cuts == 1
    assert controller.throttled == 3
    assert controller.recovering(10.0)


def test_one_congestion_event_per_window() -> None:
    controller = make(window=0.25)
    assert controller.throttled_at(10.0, 9.95, 300)
    # more throttles within the window: the same event
    assert not controller.throttled_at(10.1, 10.05, 300)
    assert not controller.throttled_at(10.2, 10.15, 1)
    assert controller.cuts == 1
    assert controller.throttled == 601
    # after the window, a request sent after the cut is a new event
    assert controller.throttled_at(10.3, 10.26, 1)
    assert controller.cuts == 2


def test_requests_sent_before_the_cut_never_cut_again() -> None:
    controller = make(window=0.0)
    assert controller.throttled_at(10.0, 9.0, 1)
    # a slow request sent before the cut reports its throttles late
    assert not controller.throttled_at(12.0, 9.5, 1)
    assert controller.cuts == 1
    assert controller.throttled_at(12.0, 10.5, 1)


def test_additive_recovery_to_the_ceiling_speeding_up_without_throttles() -> None:
    controller = make(increase=0.05)
    controller.throttled_at(10.0, 10.0, 1)  # → 0.8
    # 0.05 per second at first, twice that after ACCELERATION seconds
    assert controller.fraction(11.0) == pytest.approx(0.8 + 0.05 * (1 + 1 / ACCELERATION))
    assert controller.fraction(13.0) == pytest.approx(0.8 + 0.05 * 3 * (1 + 3 / ACCELERATION))
    assert controller.fraction(14.0) == 1.0
    assert not controller.recovering(14.0)


def test_recovery_from_the_floor_takes_tens_of_seconds_not_minutes() -> None:
    controller = make(increase=0.005, floor=0.05, window=0.0)
    for step in range(20):
        controller.throttled_at(float(step), float(step), 1)
    assert controller.fraction(19.0) == pytest.approx(0.05)
    assert controller.fraction(19.0 + 30.0) < 1.0
    assert controller.fraction(19.0 + 45.0) == 1.0


def test_the_cut_applies_to_the_rate_actually_sent() -> None:
    controller = make()
    feed(controller, 0.0, 1.0, 0.25)  # allowed 100 %, sending 25 %
    assert controller.measured(1.0) == pytest.approx(0.25)
    controller.throttled_at(1.0, 1.0, 1)
    assert controller.fraction(1.0) == pytest.approx(0.8 * 0.25)


def test_measured_uses_the_larger_of_records_and_bytes() -> None:
    controller = make()
    controller.sample(0.0, 0.0, 0.0)
    controller.sample(0.5, 300.0, 50_000.0)  # 60 % of records, 10 % of bytes
    assert controller.measured(0.5) == pytest.approx(0.6)


def test_stale_samples_are_not_a_measurement() -> None:
    controller = make()
    feed(controller, 0.0, 1.0, 0.1)
    assert controller.measured(1.0) is not None
    assert controller.measured(5.0) is None
    controller.throttled_at(5.0, 5.0, 1)
    assert controller.fraction(5.0) == pytest.approx(0.8)  # from the current fraction


def test_floor_keeps_probing() -> None:
    controller = make(floor=0.05, window=0.0)
    now = 0.0
    for _ in range(100):
        now += 0.01
        controller.throttled_at(now, now, 1)
    assert controller.fraction(now) == pytest.approx(0.05)


@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_fraction_stays_between_floor_and_ceiling(events: list[tuple[float, bool]]) -> None:
    controller = make(floor=0.05, window=0.1)
    now = 0.0
    for gap, throttled in events:
        now += gap
        if throttled:
            controller.throttled_at(now, now - 0.01, 1)
        assert 0.05 <= controller.fraction(now) <= 1.0


def test_two_producers_converge_to_a_fair_split() -> None:
    """Chiu–Jain: two AIMD senders on one shard, both throttled whenever together they exceed
    it, end up with about equal shares whatever they start with."""
    a, b = make(window=0.0), make(window=0.0)
    a.throttled_at(0.0, 0.0, 1)  # a at 0.8
    for _ in range(8):
        b.throttled_at(0.0, 0.0, 1)  # b near the floor
    now, step = 0.0, 0.05
    for _ in range(4000):
        now += step
        if a.fraction(now) + b.fraction(now) > 1.0:
            a.throttled_at(now, now, 1)
            b.throttled_at(now, now, 1)
    assert abs(a.fraction(now) - b.fraction(now)) < 0.05


def test_an_idle_pause_is_not_averaged_into_the_measured_rate() -> None:
    controller = make()
    feed(controller, 0.0, 0.5, 0.1)  # a little traffic, then a minute without records
    controller.sample(60.0, 0.0, 50_000.0)
    controller.sample(60.25, 0.0, 50_000.0 + 250_000.0)  # a burst at 100 %
    controller.sample(60.5, 0.0, 50_000.0 + 500_000.0)
    assert controller.measured(60.5) == pytest.approx(1.0)
    controller.throttled_at(60.5, 60.5, 1)
    assert controller.fraction(60.5) == pytest.approx(0.8)
