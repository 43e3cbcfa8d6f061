"""A worker's demand: what the producer tells its worker (:class:`FleetDemand`) and the
estimate the worker reports (:class:`DemandEstimator`).

Workers report demand, not the rate they achieved — achieved rate is capped by the grant, so
it would keep the status quo. Pure and clock-injected. See docs/fleet.md ("The S3 objects").
"""

from __future__ import annotations

from typing import Final, NamedTuple

from ._rates import Rates

__all__ = ("DEMAND_SMOOTHING", "DemandEstimator", "FleetDemand")

#: The weight of the newest sample in the EWMA of the offered load.
DEMAND_SMOOTHING: Final = 0.5


class FleetDemand(NamedTuple):
    """What the producer tells its worker, in the units of the grants (Kinesis records and
    their bytes, as the service counts them: an aggregate is one record): the totals offered
    to its Limiters so far (retries included) and the backlog waiting in them now."""

    admitted_records: int
    admitted_bytes: int
    backlog_records: int
    backlog_bytes: int
    #: the times a caller began to wait for room at admission so far, and the callers waiting
    #: now (backpressure)
    admission_waits: int = 0
    admission_waiting: int = 0
    #: the records the fleet's bucket refused so far, and whether it holds records back now:
    #: a producer whose callers wait while the fleet's rate holds it back wants more than it
    #: admits, however little it admits (one that Kinesis holds back would not send more)
    fleet_refusals: int = 0
    fleet_holding: bool = False


class DemandEstimator:
    """A worker's demand: EWMA of its offered load plus its backlog ÷ the sync interval.

    The offered load is what the producer *admitted* per second — not what it sent, which its
    grant caps. When backpressure holds callers back, admissions follow sending, and then the
    backlog (records admitted and not yet finished, up to ``max_outstanding_records``) is what
    says the worker wants more. But admission holds a shard's backlog to what the shard
    delivers in ``max_outstanding_time`` at the rate it sends now: at a small rate (a member
    starting on its bootstrap share), a small backlog. So :attr:`held` says that callers waited for
    room since the last sample while the fleet's bucket held records back (the fleet's rate,
    not Kinesis, held the producer back): the worker then wants all it can get (the caller says how
    much that is: :class:`~anykpl._fleet._worker.FleetWorker` reports its cap). A sample
    whose window was held back in part (held in it, or at its start) measured what the rate
    let through: it is not averaged into the next one, which starts the average afresh.
    """

    __slots__ = ("_censored", "_last", "_last_at", "_sampled", "held", "offered", "sync_interval")

    def __init__(self, sync_interval: float) -> None:
        self.sync_interval = sync_interval
        self._last: FleetDemand | None = None
        self._last_at = 0.0
        self._sampled = False
        # whether the last sample's admissions were held back, for part of its window at least
        self._censored = False
        self.offered = (0.0, 0.0)
        #: whether callers waited for room at admission since the previous sample (or wait
        #: now) while the fleet's bucket held records back
        self.held = False

    def update(self, demand: FleetDemand, now: float) -> tuple[Rates, Rates]:
        """Take a sample at local time ``now``; return ``(offered, wants)`` per second."""
        last = self._last
        # held back when the window now ending began: what it admitted was partly what the
        # rate let through
        was_held = self.held
        if last is not None and now > self._last_at:
            elapsed = now - self._last_at
            records = max(0, demand.admitted_records - last.admitted_records) / elapsed
            nbytes = max(0, demand.admitted_bytes - last.admitted_bytes) / elapsed
            # (what it admitted while callers were held back was what its rate let through,
            # not what it was offered: such a sample is not averaged into the next one)
            if self._sampled and not self._censored:
                a = DEMAND_SMOOTHING
                records = a * records + (1 - a) * self.offered[0]
                nbytes = a * nbytes + (1 - a) * self.offered[1]
            self.offered = (records, nbytes)
            self._sampled = True
        if last is None or now > self._last_at:
            # (the counts start with the producer: before the first sample, from zero)
            waits, refusals = (
                (0, 0) if last is None else (last.admission_waits, last.fleet_refusals)
            )
            waited = demand.admission_waits > waits or demand.admission_waiting > 0
            fleet = demand.fleet_refusals > refusals or demand.fleet_holding
            self.held = waited and fleet
            self._censored = self.held or was_held
            self._last, self._last_at = demand, now
        wants_records = self.offered[0] + max(0, demand.backlog_records) / self.sync_interval
        wants_bytes = self.offered[1] + max(0, demand.backlog_bytes) / self.sync_interval
        return Rates(*self.offered), Rates(wants_records, wants_bytes)
