"""How much the network path to Kinesis carries: a window of bytes in flight, opened by
answers and closed by request timeouts (pure, clock passed in).

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

- No limit until a request times out: a path that never times a request out sends exactly as
  before (the defaults must not deliver less than the KPL's plain Sender).
- A timeout of a request sent after the last cut: the threshold becomes half the bytes that
  were in flight when it was sent, and the window :data:`MIN_WINDOW` (one cut per round trip:
  the requests in flight with it time out together, and are one signal).
- Each answer (any answer: a throttle is the shard's business, not the path's) opens the
  window by its request's bytes below the threshold (slow start: it doubles per round trip)
  and by about one request per round trip above it; past :data:`UNLIMITED_WINDOW` it is
  unlimited again.
- While nothing is answered, one request every :data:`PROBE_INTERVAL` seconds goes anyway (a
  black hole that lifts is found by the next probe, not by the requests stuck in it).
- A window that has kept no request waiting and seen no timeout for :data:`RELEASE_AFTER`
  seconds says nothing about the path: it is unlimited again. (A lightly loaded producer
  answers too few bytes to grow it by the rules above; without this one timeout on a healthy
  path would split its requests and cap its admission for hours.)

Admission follows the delivered rate only while the window binds: from a cut until
:data:`RATE_SPAN` seconds after the last request it kept waiting.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ("MIN_WINDOW", "NetworkWindow")

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


class NetworkWindow:
    """The bytes in flight the path carries (module docstring). Owned by a stream's Sender."""

    __slots__ = (
        "_answered",
        "_last_answer",
        "_last_cut",
        "_last_refused",
        "_last_send",
        "floor_rate",
        "in_flight",
        "threshold",
        "timeouts",
        "window",
    )

    def __init__(self, request_timeout: float) -> None:
        self.window = math.inf  # bytes that may be in flight
        self.threshold = math.inf  # slow start below it, one request per round trip above
        self.in_flight = 0
        self.timeouts = 0  # cuts, for statistics
        #: the delivery rate assumed when nothing was answered lately: the smallest window per
        #: timeout (bytes/s)
        self.floor_rate = MIN_WINDOW / request_timeout
        self._answered: deque[tuple[float, int]] = deque()  # (when, bytes) of answers
        self._last_cut = -math.inf
        self._last_refused = -math.inf  # when the window last kept a request waiting
        self._last_send = -math.inf
        self._last_answer = -math.inf

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
        if self.in_flight == 0 or self.in_flight + size <= self.window:
            return True
        self._last_refused = now
        # a probe, while what is in flight has gone unanswered for a while
        return now >= self.next_probe()  # the same sum as the wait: no float mismatch

    def next_probe(self) -> float:
        """When :meth:`room` says yes to any request (if nothing is answered before)."""
        return max(self._last_send, self._last_answer) + PROBE_INTERVAL

    def sent(self, size: int, now: float) -> int:
        """A request of ``size`` bytes went; returns the bytes in flight with it (for
        :meth:`answered` and :meth:`timed_out`)."""
        self.in_flight += size
        self._last_send = now
        return self.in_flight

    def answered(self, size: int, now: float) -> None:
        """A request of ``size`` bytes got an answer (whatever it said)."""
        self.in_flight -= size
        self._last_answer = now
        answered = self._answered
        answered.append((now, size))
        while answered[0][0] < now - RATE_SPAN:
            answered.popleft()
        window = self.window
        if window == math.inf:
            return
        if window < self.threshold:
            window += size
        else:
            window += max(size * size / window, 1.0)
        if window >= UNLIMITED_WINDOW or now - self._binding_since() >= RELEASE_AFTER:
            window = math.inf
        self.window = window

    def _binding_since(self) -> float:
        """When the window last limited anything: a cut, or a request kept waiting."""
        return max(self._last_cut, self._last_refused)

    def timed_out(self, size: int, sent_at: float, flight: int, now: float) -> None:
        """A request of ``size`` bytes, sent at ``sent_at`` with ``flight`` bytes in flight,
        got no answer within its timeout."""
        self.in_flight -= size
        if sent_at < self._last_cut:
            return  # in flight at the last cut: part of the same signal
        self._last_cut = now
        self.timeouts += 1
        self.threshold = max(float(MIN_WINDOW), flight / 2)
        self.window = float(MIN_WINDOW)

    def failed(self, size: int) -> None:
        """A request of ``size`` bytes ended without an answer, but not by a timeout (a reset
        connection, say): no news about the path's capacity."""
        self.in_flight -= size

    def delivery_rate(self, now: float) -> float | None:
        """Bytes/s the path delivered over the last :data:`RATE_SPAN` seconds (at least
        :attr:`floor_rate`) while the window binds (a cut or a request kept waiting within
        :data:`RATE_SPAN` seconds); ``None`` while it does not."""
        if self.window == math.inf or now - self._binding_since() > RATE_SPAN:
            return None
        answered = self._answered
        while answered and answered[0][0] < now - RATE_SPAN:
            answered.popleft()
        delivered = sum(size for _, size in answered) / RATE_SPAN
        return max(delivered, self.floor_rate)

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
