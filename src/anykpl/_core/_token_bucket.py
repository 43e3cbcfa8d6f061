"""A two-dimensional token bucket (records and bytes), pure and clock-injected.

Mirrors aws/utils/token_bucket.h as the KPL's per-shard limiter uses it (limiter.h): one stream
of tokens for records and one for bytes, refilled continuously with time, and a take that
succeeds only if *both* have enough (``try_take`` checks both before taking either).

Where we differ, and why:

- Capacity is ``burst`` seconds of the configured rate in each dimension; the Limiter uses
  ``BURST_SECONDS``, half a second (the KPL uses 1000 records and a flat 10 MiB). A lone
  producer can then burst at most half a second's worth above the rate, which keeps it under the
  shard's limit instead of relying on the service to throttle — and leaves the shard's own burst
  allowance (a second's worth on the emulator) half unused, as a reserve that absorbs network
  jitter: requests released evenly by this bucket do not arrive evenly, and with equal
  capacities on both sides every arrival that bunches up behind a late one was throttled
  (measured on the emulator: a lone producer at 100 % with a one-second capacity had a few
  throttled aggregates per minute; with half a second, none).
- A take larger than the capacity (a 5 MiB record on a 1 MiB/s bucket) would never fit; the KPL
  raised its byte capacity to 10 MiB for that reason (#677). We let such a take through once the
  bucket is full and push the balance into debt, so it never deadlocks and the rate still holds
  on average.
- Time is whatever the caller passes as ``now`` (``anyio.current_time()`` in the pipeline, a
  virtual clock in tests); the bucket never reads a clock itself.
"""

from __future__ import annotations

__all__ = ("BURST_SECONDS", "TokenBucket")

#: The Limiter's buckets hold this many seconds of their rate.
BURST_SECONDS = 0.5

# Float tolerance: refilling for exactly ``time_until(...)`` seconds can come out a hair short
# of the tokens needed, which would make the limiter wake at once and find nothing to do.
_EPSILON = 1e-9


class TokenBucket:
    """Records and bytes tokens, refilled at ``records_per_second`` and ``bytes_per_second``,
    holding ``burst`` seconds of each.

    Both start full (as the KPL's do in effect).
    """

    __slots__ = (
        "_bytes",
        "_records",
        "_updated",
        "burst",
        "bytes_capacity",
        "bytes_per_second",
        "records_capacity",
        "records_per_second",
    )

    def __init__(
        self, records_per_second: float, bytes_per_second: float, now: float, burst: float = 1.0
    ) -> None:
        _check_rates(records_per_second, bytes_per_second)
        if burst <= 0:
            raise ValueError("token bucket burst must be positive")
        self.burst = float(burst)
        self.records_per_second = float(records_per_second)
        self.bytes_per_second = float(bytes_per_second)
        self.records_capacity = max(1.0, self.records_per_second * self.burst)
        self.bytes_capacity = max(1.0, self.bytes_per_second * self.burst)
        self._records = self.records_capacity
        self._bytes = self.bytes_capacity
        self._updated = now

    def __repr__(self) -> str:
        return (
            f"<TokenBucket records={self._records:.1f}/{self.records_capacity:.0f} "
            f"bytes={self._bytes:.0f}/{self.bytes_capacity:.0f}>"
        )

    def _refill(self, now: float) -> None:
        elapsed = now - self._updated
        if elapsed > 0:
            self._records = min(
                self.records_capacity, self._records + elapsed * self.records_per_second
            )
            self._bytes = min(self.bytes_capacity, self._bytes + elapsed * self.bytes_per_second)
            self._updated = now

    def levels(self, now: float) -> tuple[float, float]:
        """The (records, bytes) tokens available at ``now``; bytes may be negative (debt)."""
        self._refill(now)
        return self._records, self._bytes

    def empty(self, now: float, *, records: bool = True, nbytes: bool = True) -> None:
        """Drop the tokens on hand in the dimensions named (debt stays): a bucket whose rate
        just fell to almost nothing lets nothing more through."""
        self._refill(now)
        if records:
            self._records = min(self._records, 0.0)
        if nbytes:
            self._bytes = min(self._bytes, 0.0)

    def try_take(self, records: float, nbytes: float, now: float) -> bool:
        """Take ``records`` and ``nbytes`` tokens if both are available; return whether it did.

        A take bigger than a capacity succeeds once that dimension is full, leaving debt.
        """
        self._refill(now)
        need_records = min(records, self.records_capacity)
        need_bytes = min(nbytes, self.bytes_capacity)
        if self._records >= need_records - _EPSILON and self._bytes >= need_bytes - _EPSILON:
            self._records -= records
            self._bytes -= nbytes
            return True
        return False

    def reserve(self, records: float, nbytes: float, now: float) -> float:
        """Take ``records`` and ``nbytes`` tokens now, into debt if need be, and return how
        many seconds until the balance is paid back (0 if there was enough). Takes made while
        in debt wait behind it: grants come in the order of the reservations."""
        self._refill(now)
        self._records -= records
        self._bytes -= nbytes
        wait = 0.0
        if self._records < -_EPSILON:
            wait = -self._records / self.records_per_second
        if self._bytes < -_EPSILON:
            wait = max(wait, -self._bytes / self.bytes_per_second)
        return wait

    def refund(self, records: float, nbytes: float) -> None:
        """Give back tokens taken by :meth:`try_take` that were not used (capped at capacity)."""
        self._records = min(self.records_capacity, self._records + records)
        self._bytes = min(self.bytes_capacity, self._bytes + nbytes)

    def time_until(self, records: float, nbytes: float, now: float) -> float:
        """Seconds from ``now`` until ``try_take(records, nbytes)`` would succeed (0 if now)."""
        self._refill(now)
        need_records = min(records, self.records_capacity) - self._records
        need_bytes = min(nbytes, self.bytes_capacity) - self._bytes
        wait = 0.0
        if need_records > _EPSILON:
            wait = need_records / self.records_per_second
        if need_bytes > _EPSILON:
            wait = max(wait, need_bytes / self.bytes_per_second)
        return wait

    def set_rates(self, records_per_second: float, bytes_per_second: float, now: float) -> None:
        """Change the refill rates (and capacities) from ``now`` on. Raises ``ValueError`` for
        a rate that is not positive, as the constructor does, and leaves the bucket as it was."""
        _check_rates(records_per_second, bytes_per_second)
        self._refill(now)
        self.records_per_second = float(records_per_second)
        self.bytes_per_second = float(bytes_per_second)
        self.records_capacity = max(1.0, self.records_per_second * self.burst)
        self.bytes_capacity = max(1.0, self.bytes_per_second * self.burst)
        self._records = min(self._records, self.records_capacity)
        self._bytes = min(self._bytes, self.bytes_capacity)


def _check_rates(records_per_second: float, bytes_per_second: float) -> None:
    # (not rate > 0) rejects NaN too: a bucket that refills at NaN or 0 never lets a take through
    if not (records_per_second > 0 and bytes_per_second > 0):
        raise ValueError(
            f"token bucket rates must be positive, not {records_per_second!r} records/s "
            f"and {bytes_per_second!r} bytes/s"
        )
