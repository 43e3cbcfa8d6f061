"""The two-dimensional token bucket: a pure core, driven with virtual times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anykpl._core._token_bucket import TokenBucket


def test_starts_full() -> None:
    bucket = TokenBucket(1000, 1024 * 1024, now=5.0)
    assert bucket.records_capacity == 1000
    assert bucket.bytes_capacity == 1024 * 1024
    assert bucket.levels(5.0) == (1000, 1024 * 1024)


def test_capacity_is_burst_seconds_of_the_rate() -> None:
    bucket = TokenBucket(1000, 1024 * 1024, now=0.0, burst=0.5)
    assert (bucket.records_capacity, bucket.bytes_capacity) == (500, 512 * 1024)
    bucket.set_rates(100, 1000, now=0.0)
    assert (bucket.records_capacity, bucket.bytes_capacity) == (50, 500)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(1, 1, now=0.0, burst=0)


def test_capacity_is_at_least_one_token() -> None:
    bucket = TokenBucket(0.5, 0.25, now=0.0)
    assert bucket.records_capacity == 1.0
    assert bucket.bytes_capacity == 1.0


@pytest.mark.parametrize(("records", "nbytes"), [(0, 1), (1, 0), (-1, 1), (1, -5)])
def test_rates_must_be_positive(records: float, nbytes: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(records, nbytes, now=0.0)


@pytest.mark.parametrize(
    ("records", "nbytes"), [(0, 1), (1, 0), (-1, 1), (1, -5), (float("nan"), 1), (1, 0.0)]
)
def test_set_rates_rejects_what_the_constructor_rejects(records: float, nbytes: float) -> None:
    # a fleet grant of 0 once reached set_rates, and the next wait divided by zero
    bucket = TokenBucket(10, 100, now=0.0)
    with pytest.raises(ValueError, match="positive"):
        bucket.set_rates(records, nbytes, now=1.0)
    assert (bucket.records_per_second, bucket.bytes_per_second) == (10, 100)
    assert bucket.try_take(10, 100, now=1.0)
    assert bucket.time_until(10, 100, now=1.0) == pytest.approx(1.0)


def test_refill_is_linear_and_capped() -> None:
    bucket = TokenBucket(10, 100, now=0.0)
    assert bucket.try_take(10, 100, now=0.0)
    assert bucket.levels(0.0) == (0, 0)
    assert bucket.levels(0.5) == pytest.approx((5, 50))
    assert bucket.levels(100.0) == (10, 100)


def test_time_going_backwards_does_not_refill_or_drain() -> None:
    bucket = TokenBucket(10, 100, now=10.0)
    assert bucket.try_take(10, 100, now=10.0)
    assert bucket.levels(9.0) == (0, 0)
    assert bucket.levels(10.1) == pytest.approx((1, 10))


def test_try_take_is_atomic_over_both_dimensions() -> None:
    bucket = TokenBucket(10, 100, now=0.0)
    # records are plentiful, bytes are not: nothing may be taken from either
    assert bucket.try_take(1, 90, now=0.0)
    assert bucket.levels(0.0) == (9, 10)
    assert not bucket.try_take(1, 11, now=0.0)
    assert bucket.levels(0.0) == (9, 10)
    # bytes are plentiful, records are not
    bucket = TokenBucket(2, 1000, now=0.0)
    assert bucket.try_take(2, 1, now=0.0)
    assert not bucket.try_take(1, 1, now=0.0)
    assert bucket.levels(0.0) == (0, 999)


def test_time_until_is_exact() -> None:
    bucket = TokenBucket(10, 100, now=0.0)
    assert bucket.time_until(1, 1, now=0.0) == 0.0
    assert bucket.try_take(10, 100, now=0.0)
    # records need 0.3 s, bytes need 0.5 s: the later one decides
    assert bucket.time_until(3, 50, now=0.0) == pytest.approx(0.5)
    assert bucket.time_until(3, 10, now=0.0) == pytest.approx(0.3)
    assert not bucket.try_take(3, 50, now=0.49)
    assert bucket.try_take(3, 50, now=0.5)


def test_oversized_take_goes_into_debt_only_when_full() -> None:
    bucket = TokenBucket(10, 100, now=0.0)
    assert bucket.try_take(1, 1, now=0.0)
    # not full: a take bigger than the capacity must wait until the bucket is full
    assert not bucket.try_take(1, 250, now=0.0)
    assert bucket.time_until(1, 250, now=0.0) == pytest.approx(0.01)
    assert bucket.try_take(1, 250, now=0.01)
    records, nbytes = bucket.levels(0.01)
    assert nbytes == pytest.approx(-150)
    assert records == pytest.approx(8.1)
    # the debt is paid back at the rate before anything else gets through
    assert bucket.time_until(1, 1, now=0.01) == pytest.approx(1.51)
    assert not bucket.try_take(1, 1, now=1.5)
    assert bucket.try_take(1, 1, now=1.52)


def test_oversized_record_count_also_goes_into_debt() -> None:
    bucket = TokenBucket(2, 1000, now=0.0)
    assert bucket.try_take(5, 1, now=0.0)
    assert bucket.levels(0.0)[0] == -3
    assert bucket.time_until(1, 1, now=0.0) == pytest.approx(2.0)


def test_set_rates_clamps_levels_to_the_new_capacity() -> None:
    bucket = TokenBucket(100, 1000, now=0.0)
    bucket.set_rates(10, 100, now=0.0)
    assert bucket.records_capacity == 10
    assert bucket.bytes_capacity == 100
    assert bucket.levels(0.0) == (10, 100)
    assert bucket.try_take(10, 100, now=0.0)
    bucket.set_rates(20, 200, now=1.0)
    # the refill up to the change happens at the old rate
    assert bucket.levels(1.0) == pytest.approx((10, 100))
    assert bucket.levels(1.5) == pytest.approx((20, 200))


def test_repr_mentions_levels() -> None:
    assert "TokenBucket" in repr(TokenBucket(10, 100, now=0.0))


# -- properties -------------------------------------------------------------------------

_takes = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=0.5),  # time step
        st.floats(min_value=0.0, max_value=1.0),  # records, as a fraction of the capacity
        st.floats(min_value=0.0, max_value=1.0),  # bytes, as a fraction of the capacity
    ),
    min_size=1,
    max_size=60,
)
_rates = st.tuples(
    st.floats(min_value=1.0, max_value=2000.0), st.floats(min_value=1.0, max_value=2e6)
)


def _run(
    rates: tuple[float, float], takes: list[tuple[float, float, float]], oversize: float = 1.0
) -> tuple[TokenBucket, list[tuple[float, float, float]], float]:
    """Drive a bucket; return it, the granted takes as (time, records, bytes), and the last
    time it saw."""
    records_rate, bytes_rate = rates
    bucket = TokenBucket(records_rate, bytes_rate, now=0.0)
    now = 0.0
    granted = []
    for step, records_fraction, bytes_fraction in takes:
        now += step
        records = records_fraction * bucket.records_capacity * oversize
        nbytes = bytes_fraction * bucket.bytes_capacity * oversize
        if bucket.try_take(records, nbytes, now):
            granted.append((now, records, nbytes))
    return bucket, granted, now


def _window_sums(granted: list[tuple[float, float, float]]):  # type: ignore[no-untyped-def]
    for i in range(len(granted)):
        records = nbytes = 0.0
        for j in range(i, len(granted)):
            records += granted[j][1]
            nbytes += granted[j][2]
            yield granted[j][0] - granted[i][0], records, nbytes


@settings(max_examples=200, deadline=None)
@given(_rates, _takes)
def test_never_grants_more_than_capacity_plus_rate_times_window(
    rates: tuple[float, float], takes: list[tuple[float, float, float]]
) -> None:
    bucket, granted, _ = _run(rates, takes)
    for window, records, nbytes in _window_sums(granted):
        assert records <= bucket.records_capacity + bucket.records_per_second * window + 1e-6
        assert nbytes <= bucket.bytes_capacity * (1 + 1e-9) + bucket.bytes_per_second * window


@settings(max_examples=200, deadline=None)
@given(_rates, _takes)
def test_oversized_takes_keep_the_average_rate(
    rates: tuple[float, float], takes: list[tuple[float, float, float]]
) -> None:
    # takes up to 3x the capacity: a window may see one take's overshoot, never more
    bucket, granted, _ = _run(rates, takes, oversize=3.0)
    biggest_records = max([bucket.records_capacity] + [g[1] for g in granted])
    biggest_bytes = max([bucket.bytes_capacity] + [g[2] for g in granted])
    for window, records, nbytes in _window_sums(granted):
        assert records <= biggest_records + bucket.records_per_second * window + 1e-6
        assert nbytes <= biggest_bytes * (1 + 1e-9) + bucket.bytes_per_second * window


@settings(max_examples=300, deadline=None)
@given(
    _rates,
    _takes,
    st.floats(min_value=0.0, max_value=2.0),
    st.floats(min_value=0.0, max_value=2.0),
)
def test_time_until_matches_try_take(
    rates: tuple[float, float],
    takes: list[tuple[float, float, float]],
    records_fraction: float,
    bytes_fraction: float,
) -> None:
    bucket, _, now = _run(rates, takes)
    records = records_fraction * bucket.records_capacity
    nbytes = bytes_fraction * bucket.bytes_capacity
    wait = bucket.time_until(records, nbytes, now)
    assert wait >= 0.0
    if wait > 1e-6:
        early, _, _ = _run(rates, takes)  # the same bucket again: a compiled one cannot be copied
        before = early.levels(now + wait - 1e-6)
        assert not early.try_take(records, nbytes, now + wait - 1e-6)
        assert early.levels(now + wait - 1e-6) == before  # a failed take takes nothing
    assert bucket.try_take(records, nbytes, now + wait + 1e-9)
