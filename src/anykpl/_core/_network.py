"""How much the network path to Kinesis carries: a window of bytes in flight, opened by
answers and closed by request timeouts and stalls (pure, clock passed in).

The shard limits say what Kinesis accepts; they say nothing of the path to it. A link slower
than the producer's requests (a congested uplink, a shaped VPN, a proxy) makes every request
outlast ``request_timeout``: each is retried whole, times out again, and the records expire
with nothing delivered. Measured before this window existed (``benchmarks/network_faults.py
--scenario bandwidth``, 60,000 records of 100 B offered at once over 2 Mbit/s): 59,728 expired,
after 155,600 attempts that timed out, and the callers were never slowed.

So the Sender keeps the bytes in flight (Σ partition key + data of the requests sent and not
answered) under :attr:`NetworkWindow.window`, splitting a request bigger than
:attr:`NetworkWindow.request_bytes`, and admission bounds the backlog by what the path has
delivered (:meth:`NetworkWindow.delivery_rate`). The rules are TCP's (RFC 5681) with requests
for segments and ``request_timeout`` for the retransmission timer:

- No limit until a request times out or the path stalls: a path that never keeps a request
  unanswered for long sends exactly as before (the defaults must not deliver less than the
  KPL's plain Sender).
- A timeout of a request sent after the last cut: the threshold becomes half the bytes that
  were in flight when it was sent, and the window :data:`MIN_WINDOW` (one cut per round trip:
  the requests in flight with it time out together, and are one signal).
- A stall is a cut too, found before any timeout: the oldest request in flight (sent after the
  last cut) unanswered for :data:`STALL_FRACTION` of the read timeout (the config's
  ``request_timeout``; a request may take ``connect_timeout`` more), and the answers of that
  span, at their pace, would not answer what is in flight within a read timeout (the bytes
  answered over the span, over :data:`STALL_FRACTION`, fall short of the bytes in flight).
  The threshold becomes half the bytes in flight, the window :data:`MIN_WINDOW`. A link far
  slower than what is offered stalls this way well before its first request times out, and
  everything admitted meanwhile (a timeout × the offered rate) could only expire. Latency
  does not stall: each request is answered after a round trip, and what is in flight was
  sent within the last one; nor does a service that answers in time what is in flight. (The
  Sender abandons the requests in flight that the cut window does not hold.) Measured with
  ``--scenario bandwidth`` (6,000 records of 100 B offered at 3,500/s over 1 Mbit/s,
  ``record_ttl`` 4 s, request and connect timeouts 1 s; both backends, emulator and moto):
  53-75 % expired when only timeouts cut the window, none with stalls.
- Each answer (any answer: a throttle is the shard's business, not the path's) opens the
  window by its request's bytes below the threshold (slow start: it doubles per round trip)
  and by about one request per round trip above it; past :data:`UNLIMITED_WINDOW` it is
  unlimited again. An answer that took :data:`STALL_FRACTION` of the read timeout or longer
  opens nothing: the requests in flight are as many as the path carries in time (a window
  grown past that meets timeouts, each a cut and requests sent again). Nor does an answer
  open it beyond what the path carries within that span at the pace of the answers over its
  request's time (the bytes answered while the request was in flight, over the time it
  took): on a slow link a larger window keeps its oldest request unanswered for the span
  with too few answers meanwhile, a stall, and its newest requests are abandoned half sent.
  The cost: one answer cannot tell latency from a queue, so a path whose round trip alone
  is half that span or longer (a quarter of the read timeout: 1.5 s with the defaults),
  cut once, keeps one request in flight until no request has waited for
  :data:`RELEASE_AFTER` seconds; a path that slow is not a healthy one. Measured with
  ``--scenario bandwidth`` (9,000 records of 100 B offered at once over 1 Mbit/s,
  ``record_ttl`` 6 s, request and connect timeouts 1 s; emulator, both backends, 4 runs
  each): without this bound the window doubled past what the path carried, stalled about
  once a second, and half the records had an abandoned attempt, 0-450 of them delivered
  twice, 670-810 records/s; with it, 810-830 records/s (one run 635), none delivered twice.
- While nothing is answered, one request every :data:`PROBE_INTERVAL` seconds goes anyway (a
  black hole that lifts is found by the next probe, not by the requests stuck in it).
- A window that has kept no request waiting and seen no timeout for :data:`RELEASE_AFTER`
  seconds says nothing about the path: it is unlimited again. (A lightly loaded producer
  answers too few bytes to grow it by the rules above; without this one timeout on a healthy
  path would split its requests and cap its admission for hours.)

Admission follows the delivered rate only while the window binds: from a cut until
:data:`RATE_SPAN` seconds after the last request it kept waiting. At all times, whatever the
window, what a stream holds admitted is also bounded by what the path has *proven* it
delivers (:meth:`NetworkWindow.admission_bytes`): ``max_outstanding_time`` of the best
delivery rate measured since the last cut, or of :data:`UNPROVEN_RATE` if that is more.
Without it, a burst offered before the first request could stall (60,000 records of 100 B
submitted at once, over 2 Mbit/s) is admitted whole within a second, and what the link
cannot carry within ``record_ttl`` expires (6-19 % of them, measured). On a healthy path
the bound is far above what is held: the first answers (a round trip) prove tens of MB/s, and
admission waits, if ever, for one round trip at the start of a burst larger than the unproven
rate's (960 KiB with the defaults).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import takewhile

__all__ = ("MIN_WINDOW", "UNPROVEN_RATE", "NetworkWindow")

#: the window after a timeout, and the smallest request it splits to (bytes)
MIN_WINDOW = 64 * 1024
#: a window this large is no limit: unlimited again (bytes)
UNLIMITED_WINDOW = 256 * 1024 * 1024
#: with requests in flight and none answered for this long, one more goes (seconds)
PROBE_INTERVAL = 2.0
#: the span the delivery rate is measured over, and how long after the window last kept a
#: request waiting (or was cut) admission follows it (seconds)
RATE_SPAN = 5.0
#: no timeout and no request kept waiting for this long: the window is unlimited again (seconds)
RELEASE_AFTER = 10.0
#: the delivery rate a path is taken to have before it has proven one (bytes/s): with the
#: default ``max_outstanding_time`` (15 s) a stream holds 960 KiB before its first answers
UNPROVEN_RATE = 64 * 1024
#: the bound on admission holds at least this long of the proven rate (seconds): with a
#: shorter ``max_outstanding_time``, a round trip longer than it would keep the proven rate
#: from ever growing (what is admitted in a round trip is all a round trip can prove)
MIN_ADMISSION_HORIZON = 1.0
#: the share of the read timeout that the oldest request in flight goes unanswered before the
#: path may count as stalled (a cut), and the share of the bytes in flight the answers of that
#: span must reach for it not to; and the share of the read timeout an answer took that opens
#: the window no more
STALL_FRACTION = 0.5


class NetworkWindow:
    """The bytes in flight the path carries (module docstring). Owned by a stream's Sender."""

    __slots__ = (
        "_answered",
        "_first_send",
        "_keep",
        "_last_answer",
        "_last_cut",
        "_last_refused",
        "_last_send",
        "_proven",
        "_sends",
        "_stall_after",
        "floor_rate",
        "in_flight",
        "stalls",
        "threshold",
        "timeouts",
        "window",
    )

    def __init__(self, request_timeout: float, read_timeout: float | None = None) -> None:
        """``request_timeout``: how long a request may take in all (connecting included);
        ``read_timeout``: how long the HTTP client waits for an answer to bytes it sent (the
        measure of a stall; ``request_timeout`` if not given)."""
        self.window = math.inf  # bytes that may be in flight
        self.threshold = math.inf  # slow start below it, one request per round trip above
        self.in_flight = 0
        self.timeouts = 0  # cuts, for statistics
        self.stalls = 0  # of them, stalls (the rest: timeouts)
        self._stall_after = STALL_FRACTION * (read_timeout or request_timeout)
        #: when each request in flight was sent (send time → how many)
        self._sends: dict[float, int] = {}
        #: the delivery rate assumed when nothing was answered lately: the smallest window per
        #: timeout (bytes/s)
        self.floor_rate = MIN_WINDOW / request_timeout
        #: (when, bytes, sent at) of the answers of the last few seconds
        self._answered: deque[tuple[float, int, float]] = deque()
        self._keep = max(RATE_SPAN, self._stall_after)  # seconds of answers kept
        self._last_cut = -math.inf
        self._last_refused = -math.inf  # when the window last kept a request waiting
        self._last_send = -math.inf
        self._last_answer = -math.inf
        self._first_send = math.inf
        self._proven = 0.0  # the best delivery rate measured since the last cut (bytes/s)

    def __repr__(self) -> str:
        return f"<NetworkWindow {self.in_flight}/{self.window} bytes in flight>"

    @property
    def limited(self) -> bool:
        return self.window != math.inf

    @property
    def request_bytes(self) -> float:
        """The largest request worth sending now: half the window (two in flight), or no
        limit."""
        window = self.window
        return window if window == math.inf else max(MIN_WINDOW, window / 2)

    def room(self, size: int, now: float) -> bool:
        """Whether a request of ``size`` bytes may go now."""
        if self.in_flight == 0:
            return True
        self.check_stall(now)
        if self.in_flight + size <= self.window:
            return True
        self._last_refused = now
        # a probe, while what is in flight has gone unanswered for a while
        return now >= self.next_probe()  # the same sum as the wait: no float mismatch

    def next_probe(self) -> float:
        """When :meth:`room` says yes to any request (if nothing is answered before)."""
        return max(self._last_send, self._last_answer) + PROBE_INTERVAL

    def sent(self, size: int, now: float) -> int:
        """A request of ``size`` bytes went at ``now``; returns the bytes in flight with it
        (for :meth:`timed_out`). Its end is told with its send time (``sent_at``)."""
        self.in_flight += size
        self._last_send = now
        if now < self._first_send:
            self._first_send = now
        self._sends[now] = self._sends.get(now, 0) + 1
        return self.in_flight

    def _ended(self, size: int, sent_at: float) -> None:
        self.in_flight -= size
        count = self._sends.pop(sent_at, 0)
        if count > 1:
            self._sends[sent_at] = count - 1

    def check_stall(self, now: float) -> bool:
        """Cut the window if the path has stalled (module docstring): the oldest request in
        flight (sent after the last cut) unanswered for :data:`STALL_FRACTION` of the read
        timeout, and the bytes answered meanwhile, over :data:`STALL_FRACTION`, fewer than
        the bytes in flight. Whether it cut."""
        oldest = self._oldest_since_cut()
        span = self._stall_after
        if now - oldest < span:  # (none since the cut: oldest is inf)
            return False
        since = now - span
        recent = takewhile(lambda answer: answer[0] >= since, reversed(self._answered))
        answered = sum(answer[1] for answer in recent)
        if answered >= STALL_FRACTION * self.in_flight:
            return False
        self.stalls += 1
        self._cut(self.in_flight, now)
        return True

    def next_stall_check(self, now: float) -> float:
        """When :meth:`check_stall` could find a stall next (if nothing goes or ends before):
        once the oldest request in flight sent after the last cut has waited the stall span,
        and then every quarter span while it waits on (its answers might slow); ``inf``
        with no such request."""
        oldest = self._oldest_since_cut()
        if oldest == math.inf:
            return math.inf
        at = oldest + self._stall_after
        return at if at > now else now + self._stall_after / 4

    def _oldest_since_cut(self) -> float:
        """When the oldest request in flight sent after the last cut went (``inf``: none)."""
        last_cut = self._last_cut
        return min((sent_at for sent_at in self._sends if sent_at >= last_cut), default=math.inf)

    def answered(self, size: int, sent_at: float, now: float) -> None:
        """A request of ``size`` bytes sent at ``sent_at`` got an answer (whatever it said)."""
        self._ended(size, sent_at)
        self._last_answer = now
        self._answered.append((now, size, sent_at))
        self._recent_answers(now)
        window = self.window
        if window == math.inf:
            return
        took = now - sent_at
        if took >= self._stall_after:
            pass  # as slow as a stall: the path carries no more than is in flight
        else:
            grown = window + (size if window < self.threshold else max(size * size / window, 1.0))
            if took > 0.0:
                # no further than the path carries within the stall span at the pace of the
                # answers over this request's time: on a slow link a larger window is what the
                # stall rule cuts, and its newest requests are abandoned half sent
                answers = takewhile(lambda answer: answer[0] > sent_at, reversed(self._answered))
                pace = sum(answer[1] for answer in answers) / took
                grown = min(grown, max(window, pace * self._stall_after))
            window = grown
        if window >= UNLIMITED_WINDOW or now - self._binding_since() >= RELEASE_AFTER:
            window = math.inf
        self.window = window

    def _recent_answers(self, now: float) -> deque[tuple[float, int, float]]:
        """The answers kept, those older than the span they are kept for dropped first."""
        answered = self._answered
        while answered and answered[0][0] < now - self._keep:
            answered.popleft()
        return answered

    def _binding_since(self) -> float:
        """When the window last limited anything: a cut, or a request kept waiting."""
        return max(self._last_cut, self._last_refused)

    def timed_out(self, size: int, sent_at: float, flight: int, now: float) -> None:
        """A request of ``size`` bytes, sent at ``sent_at`` with ``flight`` bytes in flight,
        got no answer within its timeout."""
        self._ended(size, sent_at)
        if sent_at < self._last_cut:
            return  # in flight at the last cut: part of the same signal
        self._cut(flight, now)

    def _cut(self, flight: int, now: float) -> None:
        self._last_cut = now
        self._proven = 0.0  # what the path delivered before says nothing now
        self.timeouts += 1
        self.threshold = max(float(MIN_WINDOW), flight / 2)
        self.window = float(MIN_WINDOW)

    def failed(self, size: int, sent_at: float) -> None:
        """A request of ``size`` bytes sent at ``sent_at`` ended without an answer, but not by
        a timeout (a reset connection, say): no news about the path's capacity."""
        self._ended(size, sent_at)

    def delivery_rate(self, now: float) -> float | None:
        """Bytes/s the path delivered over the last :data:`RATE_SPAN` seconds (at least
        :attr:`floor_rate`) while the window binds (a cut or a request kept waiting within
        :data:`RATE_SPAN` seconds); ``None`` while it does not. (A stall found now is a cut:
        :meth:`check_stall`.)"""
        self.check_stall(now)
        if self.window == math.inf or now - self._binding_since() > RATE_SPAN:
            return None
        answered = self._recent_answers(now)
        since = now - RATE_SPAN
        delivered = sum(size for when, size, _ in answered if when >= since) / RATE_SPAN
        return max(delivered, self.floor_rate)

    def admission_bytes(self, now: float, horizon: float) -> float:
        """The most bytes a stream may hold admitted (module docstring): ``horizon`` seconds
        (at least :data:`MIN_ADMISSION_HORIZON`) of the best delivery rate measured since the
        last cut, or of :data:`UNPROVEN_RATE` if that is more. The rate is the bytes answered
        over the last :data:`RATE_SPAN` seconds, or since the first request went (or the last
        cut) if that is sooner, counting only requests sent since then, each for the share of
        its time (sent to answered) within the span."""
        self.check_stall(now)
        answered = self._recent_answers(now)
        start = max(self._first_send, self._last_cut)
        span = min(RATE_SPAN, now - start)
        if answered and span > 0.0:
            # the answers of the span to requests sent since the start (those in flight at a
            # cut, answered just after it, crossed the path before it), each for the part of
            # its time that falls in the span: requests answered together after a long
            # while carried their bytes over that while, not within the span
            since = now - span
            delivered = 0.0
            for when, size, sent in reversed(answered):  # in the order they were answered
                if when < since:
                    break
                if sent >= start:
                    took = when - sent
                    delivered += (
                        size if took <= 0.0 or sent >= since else size * (when - since) / took
                    )
            rate = delivered / span
            if rate > self._proven:
                self._proven = rate
        horizon = max(horizon, MIN_ADMISSION_HORIZON)
        return horizon * max(float(UNPROVEN_RATE), self._proven)

    def split(self, sizes: list[int]) -> list[int]:
        """Where to cut a request whose records have ``sizes`` (bytes each) into parts of at
        most :attr:`request_bytes` (each part holds at least one record): the end index of
        each part, the last being ``len(sizes)``."""
        limit = self.request_bytes
        ends: list[int] = []
        total = 0
        for index, size in enumerate(sizes):
            if total and total + size > limit:
                ends.append(index)
                total = 0
            total += size
        ends.append(len(sizes))
        return ends
