"""The network window (``_core/_network.py``): unlimited until a request times out, then TCP's
rules with requests for segments."""

from __future__ import annotations

import math

from anykpl._core._network import (
    MIN_WINDOW,
    PROBE_INTERVAL,
    RATE_SPAN,
    RELEASE_AFTER,
    UNLIMITED_WINDOW,
    NetworkWindow,
)

MB = 1024 * 1024


def test_no_limit_and_no_split_until_a_timeout() -> None:
    window = NetworkWindow(request_timeout=12.0)
    for i in range(100):
        window.sent(5 * MB, float(i))
    assert window.room(5 * MB, 0.0)
    assert not window.limited
    assert window.request_bytes == math.inf
    assert window.split([MB] * 10) == [10]
    assert window.delivery_rate(1.0) is None
    for i in range(100):
        window.answered(5 * MB, 10.0 + i)
    assert not window.limited
    assert window.in_flight == 0


def test_a_timeout_closes_the_window_once_per_round_trip() -> None:
    window = NetworkWindow(request_timeout=12.0)
    flights = [window.sent(MB, 0.0) for _ in range(8)]
    assert flights[-1] == 8 * MB
    window.timed_out(MB, 0.0, flights[-1], 12.0)
    assert window.window == MIN_WINDOW
    assert window.threshold == 4 * MB  # half of what was in flight with it
    # the others, sent before the cut, time out with it: one signal, not seven more cuts
    for flight in flights[:-1]:
        window.timed_out(MB, 0.0, flight, 12.1)
    assert (window.threshold, window.timeouts, window.in_flight) == (4 * MB, 1, 0)
    # a request sent after the cut that times out cuts again
    flight = window.sent(MIN_WINDOW, 13.0)
    window.timed_out(MIN_WINDOW, 13.0, flight, 25.0)
    assert window.timeouts == 2
    assert window.threshold == MIN_WINDOW


def test_requests_are_split_to_fit_and_wait_for_room() -> None:
    window = NetworkWindow(request_timeout=12.0)
    window.timed_out(0, 0.0, 8 * MB, 12.0)
    assert window.request_bytes == MIN_WINDOW  # half the window, but no less than the minimum
    sizes = [40 * 1024] * 5  # 200 KiB: parts of at most 64 KiB, each at least one record
    assert window.split(sizes) == [1, 2, 3, 4, 5]
    assert window.split([MB, 10]) == [1, 2]  # a record bigger than the limit goes alone
    assert window.room(MB, 13.0)  # nothing in flight: anything goes
    window.sent(MIN_WINDOW, 13.0)
    assert not window.room(1, 13.5)  # full
    assert window.next_probe() == 13.0 + PROBE_INTERVAL
    assert window.room(1, 13.0 + PROBE_INTERVAL)  # nothing answered for a while: a probe


def test_answers_open_the_window_fast_then_slowly_then_lift_it() -> None:
    window = NetworkWindow(request_timeout=12.0)
    window.timed_out(0, 0.0, 4 * MB, 12.0)  # threshold 2 MiB
    now = 13.0
    while window.window < window.threshold:  # slow start: by each answer's bytes
        before = window.window
        window.sent(MIN_WINDOW, now)
        window.answered(MIN_WINDOW, now)
        assert window.window == before + MIN_WINDOW
    before = window.window
    window.sent(MIN_WINDOW, now)
    window.answered(MIN_WINDOW, now)
    assert window.window - before == MIN_WINDOW * MIN_WINDOW / before  # one request per window
    window.window = UNLIMITED_WINDOW - 1
    window.threshold = 0.0
    window.sent(MB, now)
    window.answered(MB, now)
    assert not window.limited


def test_the_delivery_rate_is_what_was_answered_lately_and_never_nothing() -> None:
    window = NetworkWindow(request_timeout=10.0)
    window.timed_out(0, 0.0, 4 * MB, 10.0)
    assert window.delivery_rate(10.0) == MIN_WINDOW / 10.0  # nothing answered yet: the floor
    for second in range(5):
        window.sent(MB, 11.0 + second)
        assert not window.room(8 * MB, 11.0 + second)  # the window keeps the next one waiting
        window.answered(MB, 11.0 + second)
    assert window.delivery_rate(15.0) == 5 * MB / RATE_SPAN
    window.sent(MB, 16.0)
    assert not window.room(8 * MB, 17.0)
    assert window.delivery_rate(17.0 + RATE_SPAN) == MIN_WINDOW / 10.0  # kept one waiting lately
    assert window.delivery_rate(17.0 + RATE_SPAN + 0.1) is None  # not lately: no cap


def test_admission_follows_the_delivered_rate_only_while_the_window_binds() -> None:
    window = NetworkWindow(request_timeout=10.0)
    window.timed_out(0, 0.0, 4 * MB, 10.0)
    assert window.delivery_rate(10.0 + RATE_SPAN) is not None  # a cut binds for a while
    # a light load: every request fits, none waits, so the path is not what limits it
    window.sent(1000, 16.0)
    assert window.room(1000, 16.0)
    assert window.limited
    assert window.delivery_rate(16.0) is None


def test_a_window_that_keeps_nothing_waiting_is_lifted_after_a_while() -> None:
    # one timeout on a healthy path, then a light load: 1 KB answered per second grows the
    # window by a few bytes per answer, so the rules alone would keep it for hours
    window = NetworkWindow(request_timeout=6.0)
    window.timed_out(0, 0.0, 8 * MB, 6.0)
    window.threshold = float(MIN_WINDOW)  # above the threshold: the slow growth
    now = 7.0
    while now < 6.0 + RELEASE_AFTER - 1:
        assert window.room(1000, now)
        window.sent(1000, now)
        window.answered(1000, now + 0.1)
        assert window.limited
        now += 1.0
    window.sent(1000, now)
    window.answered(1000, 6.0 + RELEASE_AFTER)
    assert not window.limited
    assert window.split([MB] * 10) == [10]
    assert window.delivery_rate(6.0 + RELEASE_AFTER) is None


def test_a_window_that_keeps_requests_waiting_is_not_lifted() -> None:
    window = NetworkWindow(request_timeout=6.0)
    window.timed_out(0, 0.0, 8 * MB, 6.0)
    window.threshold = float(MIN_WINDOW)
    for second in range(7, 60):
        # a slow path: the window fills, and a request waits for an answer
        sent = []
        while window.room(MIN_WINDOW, float(second)):
            window.sent(MIN_WINDOW, float(second))
            sent.append(MIN_WINDOW)
        for size in sent:
            window.answered(size, second + 0.9)
    assert window.limited
    assert window.delivery_rate(59.9) is not None


def test_a_failure_that_is_not_a_timeout_changes_nothing_but_the_flight() -> None:
    window = NetworkWindow(request_timeout=12.0)
    window.sent(MB, 0.0)
    window.failed(MB)
    assert (window.in_flight, window.limited) == (0, False)
