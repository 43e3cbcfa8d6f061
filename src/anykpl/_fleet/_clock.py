"""S3's clock: bounds on S3's time, learnt from the whole-second ``Date`` and
``Last-Modified`` stamps of its answers and the local monotonic clock.

Reports are aged, and grants and leases expire, by S3's time, never by comparing two
machines' wall clocks. Pure and clock-injected: the caller passes every local time. See
docs/fleet.md ("S3's clock").
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ("TIMESTAMP_RESOLUTION", "ServerClock")

#: S3's ``LastModified`` and ``Date`` carry whole seconds.
TIMESTAMP_RESOLUTION: Final = 1.0
#: How far the local clock may drift from S3's per second of age of an observation.
_DRIFT: Final = 2e-4


class ServerClock:
    """Bounds on S3's time, learnt from its timestamps and the local monotonic clock.

    Each observation says: S3 stamped ``stamp`` (whole seconds, so its time was in
    ``[stamp, stamp + 1)``) at some moment between ``sent_at`` and ``received_at`` on the local
    clock. So ``offset = S3 time − local time`` lies in ``[stamp − received_at,
    stamp + 1 − sent_at]``. The clock keeps the intersection of every observation, widened by
    a drift allowance as it ages, so it narrows to about a round trip once observations have
    fallen at different fractions of a second — which :meth:`probe_time` arranges, by naming
    the moment at which one more observation halves the uncertainty. An observation that
    contradicts the intersection (S3's clock stepped) replaces it.
    """

    __slots__ = ("_at", "_high", "_low", "steps")

    def __init__(self) -> None:
        self._at = 0.0  # local time of the last observation
        self._low = -math.inf
        self._high = math.inf
        #: observations that contradicted the others and replaced them
        self.steps = 0

    def __repr__(self) -> str:
        if not self.known:
            return "<ServerClock unknown>"
        return f"<ServerClock ±{(self._high - self._low) / 2:.3f} s>"

    @property
    def known(self) -> bool:
        return self._high != math.inf

    def observe(self, stamp: float, sent_at: float, received_at: float) -> None:
        """Record that S3 stamped ``stamp`` during ``[sent_at, received_at]`` (local)."""
        if not (math.isfinite(stamp) and math.isfinite(sent_at) and math.isfinite(received_at)):
            return
        received_at = max(received_at, sent_at)
        low = stamp - received_at
        high = stamp + TIMESTAMP_RESOLUTION - sent_at
        if self.known:
            widen = _DRIFT * abs(received_at - self._at)
            new_low, new_high = max(low, self._low - widen), min(high, self._high + widen)
            if new_low <= new_high:
                low, high = new_low, new_high
            else:
                self.steps += 1
        self._low, self._high, self._at = low, high, received_at

    def offsets(self, now: float) -> tuple[float, float] | None:
        """``(lowest, highest)`` possible ``S3 time − local time`` at local time ``now``."""
        if not self.known:
            return None
        widen = _DRIFT * abs(now - self._at)
        return self._low - widen, self._high + widen

    def width(self, now: float) -> float | None:
        """How uncertain S3's time is at local time ``now`` (seconds), or ``None``."""
        offsets = self.offsets(now)
        return None if offsets is None else offsets[1] - offsets[0]

    def bounds(self, now: float) -> tuple[float, float] | None:
        """``(earliest, latest)`` S3 time it can be at local time ``now``, or ``None``."""
        offsets = self.offsets(now)
        if offsets is None:
            return None
        return now + offsets[0], now + offsets[1]

    def earliest_local(self, server_time: float, now: float) -> float | None:
        """The first local time at which S3's time *may* have reached ``server_time``."""
        offsets = self.offsets(now)
        return None if offsets is None else server_time - offsets[1]

    def surely_local(self, server_time: float, now: float) -> float | None:
        """The local time by which S3's time has *surely* reached ``server_time``."""
        offsets = self.offsets(now)
        return None if offsets is None else server_time - offsets[0]

    def probe_time(self, now: float, delay: float = 0.0) -> float | None:
        """The first local time, at least ``delay`` after ``now``, at which S3 stamping a
        request halves the uncertainty: when S3's time, if the offset is the middle of its
        bounds, crosses a whole second."""
        offsets = self.offsets(now)
        if offsets is None or not math.isfinite(offsets[1] - offsets[0]):
            return None
        middle = (offsets[0] + offsets[1]) / 2
        second = math.ceil(now + delay + middle)
        return second - middle
