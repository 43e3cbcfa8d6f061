"""The worker's state machine: which rate a worker applies now — its grant, the bootstrap
rate or the safe rate — and when that changes by time alone.

Pure and clock-injected: times are the caller's local monotonic clock, and a grant's expiry
is converted from S3's time through :class:`~anykpl._fleet._clock.ServerClock`. docs/fleet.md
("The rate a worker applies") draws the states.
"""

from __future__ import annotations

import math

from ._clock import ServerClock
from ._documents import GrantsDocument
from ._rates import Mode, Rates, min_of

__all__ = ("WorkerState",)


class WorkerState:
    """Which rate a worker applies now.

    * an unexpired grant, the newest generation it has read (it never goes back to an older
      one), within this worker's own cap (:meth:`receive`);
    * else, before any grant, the bootstrap rate: the cap × ``bootstrap_fraction`` ÷ the fleet
      size it knows — for one lease from the start, and for as long as S3 answers that no
      grants exist yet or it reads unexpired grants (an allocator is alive, it has just not
      granted this worker yet);
    * else the safe rate: the cap × ``safe_fraction`` ÷ the fleet size it last knew, but no
      more than the last grant it applied, or than the bootstrap rate if it never had one.

    Times are local (the caller's monotonic clock); a grant's expiry is converted from S3's
    time with :meth:`ServerClock.earliest_local`, so it ends no later than S3 says.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        cap: Rates,
        lease: float,
        safe_fraction: float,
        bootstrap_fraction: float,
        started_at: float,
    ) -> None:
        self.worker_id = worker_id
        self.cap = cap
        self.safe_fraction = safe_fraction
        self.bootstrap_fraction = bootstrap_fraction
        self.lease = lease
        self.bootstrap_until = started_at + lease
        self.generation: int | None = None
        self.grant: Rates | None = None
        self.grant_expires_at: float | None = None
        self.fleet_size: int | None = None

    def __repr__(self) -> str:
        return f"<WorkerState {self.worker_id} generation={self.generation}>"

    def receive(self, grants: GrantsDocument, clock: ServerClock, now: float) -> bool:
        """Take in a grants document read at local time ``now``; return whether its grant is
        applied from now on.

        The grant is applied within this worker's own caps, whatever the document says (its
        allocator may have been started with other caps: see :meth:`foreign_cap`): no more
        than its cap in each dimension, and in a dimension its own configuration caps but the
        document does not, its safe share (the cap × ``safe_fraction`` ÷ the fleet size).
        """
        self.fleet_size = grants.fleet_size_for(self.worker_id)
        expires = clock.earliest_local(grants.expires_at, now)
        if expires is None or expires <= now:
            return False
        if self.grant is None:
            # an allocator is alive: a worker it has not granted yet waits at its bootstrap
            # rate rather than moving to the safe rate
            self.bootstrap_until = max(self.bootstrap_until, expires)
        if self.generation is not None and grants.generation <= self.generation:
            return False
        grant = grants.grant_for(self.worker_id)
        if grant is None:
            return False
        self.generation = grants.generation
        self.grant = Rates(*(self._within_cap(i, grant[i]) for i in range(2)))
        self.grant_expires_at = expires
        return True

    def _within_cap(self, dimension: int, granted: float | None) -> float | None:
        own = self.cap[dimension]
        if granted is None:  # the document does not cap this dimension
            return None if own is None else own * self.safe_fraction / (self.fleet_size or 1)
        return granted if own is None else min(granted, own)

    def foreign_cap(self, grants: GrantsDocument) -> bool:
        """Whether ``grants`` was written for other caps than this worker's own."""
        return any(
            (mine is None) != (theirs is None)
            or (mine is not None and theirs is not None and not math.isclose(mine, theirs))
            for mine, theirs in zip(self.cap, grants.cap, strict=True)
        )

    def no_grants_yet(self, now: float) -> None:
        """S3 answered that there is no grants document: the fleet is starting. A worker
        without a grant stays at its bootstrap rate while S3 answers."""
        self.bootstrap_until = max(self.bootstrap_until, now + self.lease)

    def mode(self, now: float) -> Mode:
        if self.grant is not None:
            assert self.grant_expires_at is not None
            if now < self.grant_expires_at:
                return "granted"
            return "safe"
        return "bootstrap" if now < self.bootstrap_until else "safe"

    def rates(self, now: float) -> tuple[Mode, Rates]:
        """The mode and the rates to apply at local time ``now``."""
        mode = self.mode(now)
        if mode == "granted":
            assert self.grant is not None
            return mode, self.grant
        fleet = self.fleet_size or 1
        bootstrap = Rates(
            *(None if c is None else c * self.bootstrap_fraction / fleet for c in self.cap)
        )
        if mode == "bootstrap":
            return mode, bootstrap
        # safe: never more than the last grant, or the bootstrap rate if there was none
        ceiling = bootstrap if self.grant is None else self.grant
        return mode, Rates(
            *(
                None if c is None else min_of((c * self.safe_fraction / fleet, ceiling[i]))
                for i, c in enumerate(self.cap)
            )
        )

    def next_change(self, now: float) -> float | None:
        """The next local time at which :meth:`rates` changes by time alone, if any."""
        mode = self.mode(now)
        if mode == "granted":
            return self.grant_expires_at
        if mode == "bootstrap":
            return self.bootstrap_until
        return None
