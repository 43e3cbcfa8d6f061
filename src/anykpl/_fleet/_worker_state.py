"""The worker's state machine: which rate a worker applies now — its grant, or its share of
the fleet's bootstrap budget — and when that changes by time alone.

Pure and clock-injected: times are the caller's local monotonic clock, and a grant's expiry
is converted from S3's time through :class:`~anykpl._fleet._clock.ServerClock`. docs/fleet.md
("The rate a worker applies") draws the states and proves the budget's bound.
"""

from __future__ import annotations

import math
from typing import Final

from ._clock import ServerClock
from ._documents import GrantsDocument
from ._rates import Mode, Rates, min_of

__all__ = ("LEFTOVER_LEASES", "WorkerState", "budget_share")

#: A report stale for this many leases is a crashed worker's leftover: the allocator deletes
#: it. A worker's rank in the budget holds only while its report is there to be counted.
LEFTOVER_LEASES: Final = 10


def budget_share(rank: int) -> float:
    """The share of the bootstrap budget of a worker of rank ``rank``: 1 / (rank × (rank + 1)).

    A worker's rank is the number of reports it listed after its own report was written, so
    it is at least its place among the workers alive now, ordered by when they last listed:
    every one that listed before it had its report there to be counted. The shares of places
    1, 2, 3, … are 1/2, 1/6, 1/12, … and sum to less than 1, so the workers outside a grant
    never apply more than the budget together, whatever the fleet's size.
    """
    return 1.0 / (rank * (rank + 1))


class WorkerState:
    """Which rate a worker applies now.

    * ``granted``: an unexpired grant, the newest generation it has read (it never goes back
      to an older one), within this worker's own cap (:meth:`receive`);
    * else its **budget rate**: the cap × ``bootstrap_fraction`` × :func:`budget_share` of its
      rank (:meth:`learn_rank`), and nothing at all before it knows its rank or once its
      report may have been deleted as a leftover. The allocator never grants that budget, so
      grants and budget rates together stay within the cap. Before any grant the mode is
      ``bootstrap`` (for one lease from the start, and for as long as S3 answers that no
      grants exist yet or it reads unexpired grants); after, or when nothing answers for a
      lease, ``safe``;
    * in ``safe`` after a grant, with ``safe_fraction`` > 0 (off by default), the worker may
      keep up to the cap × ``safe_fraction`` ÷ the fleet size it last knew, but no more than
      its last grant: a fleet that chose it may then exceed its cap while a member is cut off.

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
        incarnation: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        #: this process's incarnation: it takes only grants made for it (``None``: any)
        self.incarnation = incarnation
        self.cap = cap
        self.safe_fraction = safe_fraction
        self.bootstrap_fraction = bootstrap_fraction
        self.lease = lease
        self.bootstrap_until = started_at + lease
        self.generation: int | None = None
        self.grant: Rates | None = None
        self.grant_expires_at: float | None = None
        self.fleet_size: int | None = None
        #: the reports listed after this worker's report was written (its own included)
        self.rank: int | None = None
        #: the budget's share of the cap: its own, or less if the allocator says so
        self.budget_fraction = bootstrap_fraction
        #: seconds after which the allocator deletes a report as a leftover: from its own
        #: lease, or less if the allocator says so
        self.leftover_after = LEFTOVER_LEASES * lease
        #: local time until which the rank holds: the report may be deleted as a leftover after
        self.rank_until = -math.inf
        self._report_sent_at = -math.inf  # local time the last report written was sent

    def __repr__(self) -> str:
        return f"<WorkerState {self.worker_id} generation={self.generation} rank={self.rank}>"

    def report_written(self, sent_at: float) -> None:
        """This worker's report, sent at local time ``sent_at``, is in the store."""
        if self.rank is not None and sent_at >= self.rank_until:
            # its report may have been deleted meanwhile, and others may have listed without
            # it: the rank must be learned again, from a listing after this report
            self.rank = None
        self._report_sent_at = max(self._report_sent_at, sent_at)
        self._renew_rank()

    def _renew_rank(self) -> None:
        # the allocator deletes a report stale for leftover_after seconds; a lease of margin
        # for the clocks and the whole-second LastModified
        self.rank_until = self._report_sent_at + self.leftover_after - self.lease

    def forget_rank(self) -> None:
        """This worker's report may have been deleted (by its own clean-up, or as a leftover):
        its rank must be learned again, from a listing after its next report."""
        self.rank = None
        self._report_sent_at = -math.inf
        self.rank_until = -math.inf

    def learn_rank(self, listed: int, listed_after: float) -> None:
        """A listing sent at local time ``listed_after`` counted ``listed`` reports. It sets
        the rank only if this worker's report was written before it (it counted itself)."""
        if listed_after < self._report_sent_at or self._report_sent_at == -math.inf:
            return
        self.rank = max(1, listed)

    def needs_rank(self, now: float) -> bool:
        """Whether a listing would tell this worker something: it has no rank yet, or runs
        outside a grant (the fleet may have shrunk since it listed)."""
        return self.rank is None or self.mode(now) != "granted"

    def receive(self, grants: GrantsDocument, clock: ServerClock, now: float) -> bool:
        """Take in a grants document read at local time ``now``; return whether its grant is
        applied from now on.

        The grant is applied within this worker's own caps, whatever the document says (its
        allocator may have been started with other caps: see :meth:`foreign_cap`): no more
        than its cap in each dimension, and in a dimension its own configuration caps but the
        document does not, its budget rate.
        """
        self.fleet_size = grants.fleet_size_for(self.worker_id)
        # members with other settings than the allocator's: the budget and the rank hold by
        # the stricter of the two
        if grants.bootstrap_fraction is not None:
            self.budget_fraction = min(self.budget_fraction, grants.bootstrap_fraction)
        if grants.leftover_after is not None and grants.leftover_after < self.leftover_after:
            self.leftover_after = grants.leftover_after
            self._renew_rank()
        expires = clock.earliest_local(grants.expires_at, now)
        if expires is None or expires <= now:
            return False
        if self.grant is None:
            # an allocator is alive: a worker it has not granted yet stays in bootstrap
            self.bootstrap_until = max(self.bootstrap_until, expires)
        if self.generation is not None and grants.generation <= self.generation:
            return False
        # (a grant made for an earlier process of this worker id is not this one's: that
        # process may have left, and the allocator given its share to others)
        grant = grants.grant_for(self.worker_id, self.incarnation)
        if grant is None:
            return False
        self.generation = grants.generation
        self.grant = grant
        self.grant_expires_at = expires
        return True

    def foreign_cap(self, grants: GrantsDocument) -> bool:
        """Whether ``grants`` was written for other caps than this worker's own."""
        return any(
            (mine is None) != (theirs is None)
            or (mine is not None and theirs is not None and not math.isclose(mine, theirs))
            for mine, theirs in zip(self.cap, grants.cap, strict=True)
        )

    def no_grants_yet(self, now: float) -> None:
        """S3 answered that there is no grants document: the fleet is starting. A worker
        without a grant stays in bootstrap while S3 answers."""
        self.bootstrap_until = max(self.bootstrap_until, now + self.lease)

    def mode(self, now: float) -> Mode:
        if self.grant is not None:
            assert self.grant_expires_at is not None
            if now < self.grant_expires_at:
                return "granted"
            return "safe"
        return "bootstrap" if now < self.bootstrap_until else "safe"

    def budget(self, now: float) -> Rates:
        """The budget rate at local time ``now``: 0 without a rank that holds."""
        share = 0.0
        if self.rank is not None and now < self.rank_until:
            share = self.budget_fraction * budget_share(self.rank)
        return Rates(*(None if c is None else c * share for c in self.cap))

    def rates(self, now: float) -> tuple[Mode, Rates]:
        """The mode and the rates to apply at local time ``now``."""
        mode = self.mode(now)
        budget = self.budget(now)
        if mode == "granted":
            assert self.grant is not None
            return mode, Rates(*(self._within_cap(i, budget[i]) for i in range(2)))
        if mode == "safe" and self.grant is not None and self.safe_fraction > 0:
            # opted in: keep part of the last grant, beyond what the cap guarantees
            fleet = self.fleet_size or 1
            return mode, Rates(
                *(
                    None
                    if c is None
                    else max(
                        budget[i] or 0.0,
                        min_of((c * self.safe_fraction / fleet, self.grant[i])) or 0.0,
                    )
                    for i, c in enumerate(self.cap)
                )
            )
        return mode, budget

    def _within_cap(self, dimension: int, budget: float | None) -> float | None:
        assert self.grant is not None
        own, granted = self.cap[dimension], self.grant[dimension]
        if granted is None:  # the document does not cap this dimension: the budget rate
            return budget
        return granted if own is None else min(granted, own)

    def next_change(self, now: float) -> float | None:
        """The next local time at which :meth:`rates` changes by time alone, if any."""
        mode = self.mode(now)
        times = [self.rank_until] if self.rank is not None else []
        if mode == "granted":
            assert self.grant_expires_at is not None
            times.append(self.grant_expires_at)
        elif mode == "bootstrap":
            times.append(self.bootstrap_until)
        future = [t for t in times if t > now]
        return min(future) if future else None
