"""The network window (``_core/_network.py``): unlimited until a request times out or the path
stalls, then TCP's rules with requests for segments."""

from __future__ import annotations

import math
import random

import pytest

from anykpl._core._network import (
    MIN_ADMISSION_HORIZON,
    MIN_WINDOW,
    PROBE_INTERVAL,
    RATE_SPAN,
    RELEASE_AFTER,
    STALL_FRACTION,
    UNLIMITED_WINDOW,
    UNPROVEN_RATE,
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
        window.answered(5 * MB, float(i), 10.0 + i)
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
        window.answered(MIN_WINDOW, now, now)
        assert window.window == before + MIN_WINDOW
    before = window.window
    window.sent(MIN_WINDOW, now)
    window.answered(MIN_WINDOW, now, now)
    assert window.window - before == MIN_WINDOW * MIN_WINDOW / before  # one request per window
    window.window = UNLIMITED_WINDOW - 1
    window.threshold = 0.0
    window.sent(MB, now)
    window.answered(MB, now, now)
    assert not window.limited


def test_the_delivery_rate_is_what_was_answered_lately_and_never_nothing() -> None:
    window = NetworkWindow(request_timeout=10.0)
    window.timed_out(0, 0.0, 4 * MB, 10.0)
    assert window.delivery_rate(10.0) == MIN_WINDOW / 10.0  # nothing answered yet: the floor
    for second in range(5):
        window.sent(MB, 11.0 + second)
        assert not window.room(8 * MB, 11.0 + second)  # the window keeps the next one waiting
        window.answered(MB, 11.0 + second, 11.0 + second)
    assert window.delivery_rate(15.0) == 5 * MB / RATE_SPAN
    window.sent(MB, 16.0)
    assert not window.room(8 * MB, 17.0)
    window.failed(MB, 16.0)  # (left in flight unanswered, it would be a stall: a cut)
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
        window.answered(1000, now, now + 0.1)
        assert window.limited
        now += 1.0
    window.sent(1000, now)
    window.answered(1000, now, 6.0 + RELEASE_AFTER)
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
            window.answered(size, float(second), second + 0.9)
    assert window.limited
    assert window.delivery_rate(59.9) is not None


def test_a_failure_that_is_not_a_timeout_changes_nothing_but_the_flight() -> None:
    window = NetworkWindow(request_timeout=12.0)
    window.sent(MB, 0.0)
    window.failed(MB, 0.0)
    assert (window.in_flight, window.limited) == (0, False)


KB = 1024


def test_a_stalled_path_is_cut_before_any_request_times_out() -> None:
    # a slow link: a small request is answered, then the big ones sent after it are not
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    window.sent(4 * KB, 0.0)
    window.answered(4 * KB, 0.0, 0.05)
    sends = [0.1, 0.2, 0.3, 0.4]
    for sent_at in sends:
        assert window.room(50 * KB, sent_at)
        window.sent(50 * KB, sent_at)
    window.sent(KB, 0.45)
    window.answered(KB, 0.45, 0.55)  # a small one gets through: not enough
    stall = 0.1 + STALL_FRACTION * 1.0
    assert not window.check_stall(stall - 0.01)  # the oldest has not waited long enough yet
    assert not window.limited
    assert window.delivery_rate(stall - 0.01) is None
    # admission follows the path from the stall on: nothing delivered yet, so the floor
    assert window.delivery_rate(stall) == MIN_WINDOW / 2.0
    assert (window.window, window.threshold) == (MIN_WINDOW, 100 * KB)  # half of the flight
    assert (window.stalls, window.timeouts) == (1, 1)
    assert not window.room(50 * KB, stall)  # the window is full
    # the requests in flight at the cut are part of the same signal: no more cuts
    assert not window.check_stall(stall + 0.5)
    for sent_at in sends:
        window.timed_out(50 * KB, sent_at, 200 * KB, sent_at + 2.0)
    assert (window.timeouts, window.threshold, window.in_flight) == (1, 100 * KB, 0)
    # a request sent after the cut that stalls in turn cuts again
    window.sent(MIN_WINDOW, 3.0)
    assert window.check_stall(3.0 + STALL_FRACTION)
    assert (window.stalls, window.threshold) == (2, MIN_WINDOW)


def test_latency_is_not_a_stall() -> None:
    # 200 ms ± 50 ms to every answer, a request every 10 ms, 1 s read timeout: never a cut
    rng = random.Random(5)
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    pending: list[tuple[float, float, int]] = []  # (answer at, sent at, size)
    now = 0.0
    while now < 30.0:
        for answer in [p for p in pending if p[0] <= now]:
            pending.remove(answer)
            window.answered(answer[2], answer[1], answer[0])
        size = rng.choice([KB, 100 * KB, 5 * 1024 * KB])
        assert window.room(size, now)
        window.sent(size, now)
        pending.append((now + rng.uniform(0.15, 0.25), now, size))
        assert window.delivery_rate(now) is None
        now += 0.01
    assert (window.limited, window.timeouts) == (False, 0)


def test_a_burst_answered_after_a_round_trip_is_not_a_stall() -> None:
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    for _ in range(24):
        window.sent(5 * 1024 * KB, 0.0)
    assert not window.check_stall(0.45)
    for _ in range(24):
        window.answered(5 * 1024 * KB, 0.0, 0.45)
    assert not window.check_stall(0.9)
    assert not window.limited


def test_a_service_that_answers_within_the_read_timeout_does_not_stall() -> None:
    # each request takes 0.9 of the read timeout (longer than the stall span), one is sent
    # every 50 ms: at the pace answers come, what is in flight is answered in time. (Until
    # answers have come for a stall span, nothing answered then is a stall: checked after.)
    for share, stalls in ((0.9, False), (1.2, True)):
        window = NetworkWindow(request_timeout=12.0, read_timeout=6.0)
        took = share * 6.0
        stalled = False
        for step in range(2000):
            now = step * 0.05
            if now >= took:
                window.answered(MB, now - took, now)
            if now >= took + STALL_FRACTION * 6.0:
                stalled = stalled or window.check_stall(now)
            window.sent(MB, now)
        assert stalled is stalls, share


def test_an_answer_as_slow_as_a_stall_opens_nothing() -> None:
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    window.timed_out(0, 0.0, 4 * MB, 2.0)
    window.sent(MIN_WINDOW, 3.0)
    window.answered(MIN_WINDOW, 3.0, 3.0 + STALL_FRACTION)
    assert window.window == MIN_WINDOW
    window.sent(MIN_WINDOW, 4.0)
    window.answered(MIN_WINDOW, 4.0, 4.1)
    assert window.window == 2 * MIN_WINDOW  # slow start


def test_an_answer_opens_the_window_no_further_than_the_path_carries_in_the_stall_span() -> None:
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)  # stall span: 0.5 s
    window.timed_out(0, 0.0, 4 * MB, 2.0)
    # 50 KB answered after 0.45 s: the path carries 55.6 KB in the span, less than the window
    window.sent(50_000, 3.0)
    window.answered(50_000, 3.0, 3.45)
    assert window.window == MIN_WINDOW
    # two requests answered over 0.4 s: the pace is both of them; slow start opens by the
    # second's bytes only as far as that pace carries in the span (80 KB / 0.4 s * 0.5 s)
    window.sent(40_000, 4.0)
    window.sent(40_000, 4.0)
    window.answered(40_000, 4.0, 4.35)
    assert window.window == MIN_WINDOW  # 40 KB over 0.35 s: 57 KB, less than it is
    window.answered(40_000, 4.0, 4.4)
    assert window.window == pytest.approx(100_000)
    # a fast path opens by the answer's bytes, as before
    window.sent(10_000, 5.0)
    window.answered(10_000, 5.0, 5.01)
    assert window.window == pytest.approx(110_000)


def open_over_latency(round_trip: float, rounds: int) -> float:
    """The window after ``rounds`` round trips of a path that only delays (stall span 0.5 s),
    cut once, each round as many 64 KiB requests as the window holds, answered together."""
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    window.timed_out(0, 0.0, 64 * MIN_WINDOW, 2.0)  # threshold: 32 requests
    now = 3.0
    for _ in range(rounds):
        count = max(1, int(window.window // MIN_WINDOW))
        for _ in range(count):
            window.sent(MIN_WINDOW, now)
        for _ in range(count):
            window.answered(MIN_WINDOW, now, now + round_trip)
        now += round_trip
    return window.window


def test_latency_below_half_the_stall_span_still_opens_the_window() -> None:
    # slow start, if not quite doubling: the first answers of a round carry less than the round
    assert open_over_latency(0.2, 8) >= 32 * MIN_WINDOW
    assert open_over_latency(0.05, 4) == 16 * MIN_WINDOW  # doubling, as before the bound
    # the documented cost: a round trip of half the span or more keeps one request in flight
    assert open_over_latency(0.3, 20) < 2 * MIN_WINDOW


def test_requests_sent_at_the_same_instant_are_each_in_flight() -> None:
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    window.sent(KB, 0.0)
    window.sent(KB, 0.0)
    window.answered(KB, 0.0, 0.1)
    assert window.check_stall(0.7)  # the other one, still unanswered


def test_the_next_stall_check_is_when_the_oldest_has_waited_the_span() -> None:
    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    assert window.next_stall_check(0.0) == math.inf  # nothing in flight
    window.sent(KB, 1.0)
    window.sent(KB, 1.2)
    assert window.next_stall_check(1.2) == 1.0 + STALL_FRACTION
    # answered lately, so no stall then: looked at again every quarter span
    window.sent(KB, 1.3)
    window.answered(KB, 1.3, 1.4)
    assert not window.check_stall(1.5)
    assert window.next_stall_check(1.5) == 1.5 + STALL_FRACTION / 4
    # after a cut, only the requests sent since count
    window.timed_out(0, 1.0, 2 * KB, 1.6)
    assert window.next_stall_check(1.6) == math.inf
    window.sent(KB, 2.0)
    assert window.next_stall_check(2.0) == 2.0 + STALL_FRACTION


# -- what admission may hold: what the path has proven it delivers ---------------------------


def test_before_anything_is_answered_admission_holds_the_horizon_of_the_unproven_rate() -> None:
    window = NetworkWindow(request_timeout=6.0)
    assert window.admission_bytes(-math.inf, 15.0) == 15.0 * UNPROVEN_RATE
    window.sent(MB, 0.0)
    assert window.admission_bytes(2.0, 2.0) == 2.0 * UNPROVEN_RATE  # nothing answered yet


def test_admission_holds_the_horizon_of_the_best_rate_proven_since_the_first_request() -> None:
    window = NetworkWindow(request_timeout=6.0)
    window.sent(MB, 0.0)
    window.answered(MB, 0.0, 0.05)
    # 1 MB answered 0.1 s after the first request went: 10 MB/s proven, 15 s of it
    assert window.admission_bytes(0.1, 15.0) == 15.0 * 10 * MB
    # a quiet path keeps what it proved: a burst after a pause is not held back
    assert window.admission_bytes(100.0, 15.0) == 15.0 * 10 * MB


def test_over_a_slow_path_admission_holds_what_it_carries_in_the_horizon() -> None:
    # a link of 100 KB/s: the requests sent together are answered together, late
    window = NetworkWindow(request_timeout=60.0)
    for _ in range(10):
        window.sent(100_000, 0.0)
    for _ in range(10):
        window.answered(100_000, 0.0, 10.0)
    # 1 MB answered 10 s after they went: 100 KB/s, their bytes spread over the 10 s (not 1 MB
    # within the last RATE_SPAN)
    assert window.admission_bytes(10.0, 30.0) == 30.0 * 100_000
    # and never less than the unproven rate's
    slower = NetworkWindow(request_timeout=60.0)
    slower.sent(100_000, 0.0)
    slower.answered(100_000, 0.0, 10.0)
    assert slower.admission_bytes(10.0, 30.0) == 30.0 * UNPROVEN_RATE


def test_a_cut_forgets_what_was_proven_and_the_answers_in_flight_at_it() -> None:
    window = NetworkWindow(request_timeout=6.0)
    window.sent(MB, 0.0)
    window.answered(MB, 0.0, 0.1)
    assert window.admission_bytes(0.1, 15.0) == 15.0 * 10 * MB
    flights = [window.sent(MB, 1.0) for _ in range(4)]
    window.timed_out(MB, 1.0, flights[-1], 7.0)  # a cut
    assert window.admission_bytes(7.0, 15.0) == 15.0 * UNPROVEN_RATE
    # requests sent before the cut answered just after it crossed the path before it
    for _ in range(3):
        window.answered(MB, 1.0, 7.1)
    assert window.admission_bytes(7.2, 15.0) == 15.0 * UNPROVEN_RATE
    # a request sent after the cut and answered proves the path again
    window.sent(MB, 7.2)
    window.answered(MB, 7.2, 8.2)
    assert window.admission_bytes(9.2, 15.0) == pytest.approx(15.0 * MB / 2.2)  # since the cut


def test_admission_holds_at_least_a_second_of_the_rate_however_short_the_horizon() -> None:
    # what is admitted in a round trip is all that round trip can prove: a horizon shorter than
    # the round trip would keep the proven rate from ever growing
    window = NetworkWindow(request_timeout=6.0)
    assert window.admission_bytes(0.0, 0.01) == MIN_ADMISSION_HORIZON * UNPROVEN_RATE
    window.sent(MB, 0.0)
    window.answered(MB, 0.0, 0.1)
    assert window.admission_bytes(0.2, 0.01) == pytest.approx(MIN_ADMISSION_HORIZON * MB / 0.2)
