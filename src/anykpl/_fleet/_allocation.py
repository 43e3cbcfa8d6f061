"""The allocator's maths: each generation of grants from the previous grants document and the
workers' reports.

Targets are max-min fair shares of the demand (Doorman's FAIR_SHARE, :func:`water_fill`), and
Doorman's safety invariant bounds every grant (:func:`allocate_dimension`): the grants that may
be in force never sum over the cap less the bootstrap budget, which the workers outside a grant
share by rank (:func:`~anykpl._fleet._worker_state.budget_share`). Pure and clock-injected:
S3's time comes in as bounds ``(earliest, latest)``. docs/fleet.md ("Allocation") explains the
invariant, learning mode and start-up.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ._clock import TIMESTAMP_RESOLUTION
from ._documents import INCARNATION_TAG, GrantsDocument, Outstanding, WorkerEntry, WorkerReport
from ._rates import Rates, max_of
from ._worker_state import LEFTOVER_LEASES

__all__ = (
    "HEADROOM",
    "Allocator",
    "ObservedReport",
    "allocate_dimension",
    "in_force",
    "water_fill",
)

#: A worker is granted up to its demand times this, so it can grow before the next allocation.
HEADROOM: Final = 1.25
#: A worker whose report is older than this many sync intervals gets no new grant.
CURRENT_REPORTS: Final = 1.25
#: Grants outlive the allocator's lease by this many sync intervals: a successor takes over
#: when the lease runs out, and the workers read its first grants within an interval.
GRACE: Final = 1.0
#: Grants are rounded down to this many significant digits.
SIGNIFICANT_DIGITS: Final = 9
#: A relative margin kept below the cap against floating-point rounding.
_ROUNDING: Final = 1e-9


@dataclass(frozen=True, slots=True)
class ObservedReport:
    """A worker report as the allocator read it, with S3's ``LastModified`` of the object."""

    report: WorkerReport
    last_modified: float


def water_fill(capacity: float, demands: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``capacity``: nobody gets more than it demands, and nobody who
    gets less than it demands gets less than anybody else (Doorman's FAIR_SHARE)."""
    shares: dict[str, float] = {}
    remaining = max(0.0, capacity)
    ordered = sorted(demands.items(), key=lambda item: (item[1], item[0]))
    for index, (key, demand) in enumerate(ordered):
        give = min(max(0.0, demand), remaining / (len(ordered) - index))
        shares[key] = give
        remaining = max(0.0, remaining - give)
    return shares


def allocate_dimension(
    capacity: float,
    targets: Mapping[str, float],
    in_force: Mapping[str, float],
    in_use: Mapping[str, float],
) -> dict[str, float]:
    """New grants in one dimension, bounded by Doorman's invariant.

    ``capacity``: what grants may take (the cap less the bootstrap budget, which the rates
    applied outside grants share); ``targets``: what each worker to be granted should get;
    ``in_force``: every worker's largest grant that may still apply (workers not in
    ``targets`` included); ``in_use``: the rates workers last reported applying outside a
    grant (their budget rates).

    Reductions apply at once. An increase takes only capacity that is free now: the capacity
    minus, for every worker, the most it may apply while this generation is the newest — so
    the sum of ``max(grant in force, new grant)`` never exceeds ``capacity``.
    """
    limit = capacity * (1 - _ROUNDING)
    new = {j: min(t, in_force.get(j, 0.0)) for j, t in targets.items()}
    everyone = set(in_force) | set(targets)
    # Grants in force already exceed the capacity (the cap was lowered, or a document was
    # lost): nothing more can be done for the instant, but the new grants alone fit.
    granted = sum(new.values())
    if granted > limit:
        for j in new:
            new[j] *= limit / granted
    used = sum(max(in_force.get(k, 0.0), new.get(k, 0.0)) for k in everyone)
    free = limit - used
    if free > 0:
        deficits = {j: targets[j] - new[j] for j in new if targets[j] > new[j]}
        for j, extra in water_fill(free, deficits).items():
            new[j] += extra
    # A worker without a grant in force that would get less than the rate it runs now only
    # because the capacity is not free yet gets no grant yet: granting it a sliver would stall
    # it, while its budget rate goes on within the budget.
    for j, rate in list(new.items()):
        if in_force.get(j, 0.0) <= 0 and (
            rate < min(targets[j], in_use.get(j, 0.0)) * (1 - 1e-6) or rate < limit * 1e-6
        ):
            new[j] = 0.0  # (nor a crumb that rounding left free)
    return new


def in_force(
    previous: GrantsDocument | None, worker_id: str, acked: int | None, now_earliest: float
) -> list[Outstanding]:
    """A worker's grants from ``previous`` and before that may still apply: not surely
    expired at S3 time ``now_earliest``, and not older than the last one it reported applying
    (a worker never goes back to an older generation)."""
    if previous is None:
        return []
    entry = previous.workers.get(worker_id)
    if entry is None:
        return []
    candidates = list(entry.outstanding)
    if entry.grant is not None:
        candidates.append(
            Outstanding(previous.generation, entry.grant, previous.expires_at, entry.incarnation)
        )
    floor = -1 if acked is None else acked
    return [c for c in candidates if c.generation >= floor and c.expires_at > now_earliest]


def _made_for(previous: GrantsDocument | None, worker_id: str, incarnation: str) -> bool:
    """Whether ``worker_id``'s grants in ``previous`` were made for ``incarnation`` (none, or
    named for it: grants that do not say for which process, as an older allocator wrote them,
    are not freed by a mark)."""
    entry = previous.workers.get(worker_id) if previous is not None else None
    return entry is None or entry.names(incarnation)


def _next_allocation(
    began: tuple[float, float] | None, interval: float, issued_at: float
) -> float | None:
    """When the allocator's next reads are due to begin, an interval after these ``began``
    (``None`` if not known): the workers time their reports to fall between the document's
    writing and then (``FleetWorker._locked_start``)."""
    if began is None:
        return None
    return max(issued_at, (began[0] + began[1]) / 2 + interval)


def _short(rate: float) -> float:
    """``rate`` rounded down to nine significant digits: a grants document of thousands of
    workers stays small (a DynamoDB item holds 400 KB), and a grant is never rounded up."""
    if rate <= 0 or not math.isfinite(rate):
        return rate
    scale = 10.0 ** (SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(rate)))
    short = math.floor(rate * scale) / scale
    return math.nextafter(short, 0.0) if short > rate else short


class Allocator:
    """Computes each generation of grants from the previous document and the reports.

    Stateless apart from learning mode (and what :meth:`duplicates` remembers): everything it
    needs about grants in force is in the previous document, so any member can take over from
    any other.
    """

    #: incarnations remembered per worker id, to tell two processes sharing it from restarts
    REMEMBERED_INCARNATIONS: Final = 4

    def __init__(
        self,
        *,
        allocator_id: str,
        cap: Rates,
        lease: float,
        bootstrap_fraction: float,
        sync_interval: float | None = None,
    ) -> None:
        self.allocator_id = allocator_id
        self.cap = cap
        self.configured_lease = lease
        self.configured_interval = lease / 3 if sync_interval is None else sync_interval
        #: the sync interval asked of the fleet now (longer while the store is slow), and
        #: what follows from it: see :meth:`use_interval`
        self.interval: float
        self.lease: float
        self.current_age: float
        self.grace: float
        self.use_interval(self.configured_interval)
        self.bootstrap_fraction = bootstrap_fraction
        #: S3 time until which the allocator echoes grants instead of reallocating
        self.learning_until: float | None = None
        self._incarnations: dict[str, list[str]] = {}  # worker id -> recent, newest last
        self._duplicated: set[str] = set()

    def __repr__(self) -> str:
        return f"<Allocator {self.allocator_id} cap={tuple(self.cap)}>"

    def use_interval(self, interval: float, previous: float | None = None) -> None:
        """Ask ``interval`` of the fleet from the next document on (``previous``: what the
        last document asked, which the workers may still keep to).

        The lease — how long grants last, and how old a report may be and still count —
        stretches with the interval (the configured lease × interval ÷ configured interval);
        a report older than 1.25 intervals (of the longer of the
        two) gets its worker no new grant: it missed its last report and may be dead, and a
        dead worker's share comes back only once its grants expire. Grants outlive the lease
        by an interval, so that a successor taking over an expired lease publishes new grants,
        and the workers read them, before the old ones run out — the lease as this cycle
        renewed it, before the interval changed: when it shrinks, the grants last the longer
        lease once more (grants that ran out before the lease did left a fleet whose
        allocator died just then without any for a minute).
        """
        self.interval = interval
        longer = max(interval, previous or interval)
        self.lease = self.configured_lease * max(1.0, longer / self.configured_interval)
        self.current_age = CURRENT_REPORTS * longer
        self.grace = GRACE * interval

    def fresh(
        self, reports: Iterable[ObservedReport], now: tuple[float, float]
    ) -> list[ObservedReport]:
        """The reports not surely older than a lease by S3's clock (``now``: its bounds)."""
        return [r for r in reports if not self.is_stale(r.last_modified, now)]

    def is_stale(self, last_modified: float, now: tuple[float, float]) -> bool:
        """Whether an object written at ``last_modified`` is surely older than a lease."""
        return now[0] - (last_modified + TIMESTAMP_RESOLUTION) > self.lease

    def take_over(
        self,
        previous: GrantsDocument | None,
        reports: Iterable[ObservedReport],
        now: tuple[float, float],
        unread: Collection[str] = (),
    ) -> bool:
        """Start allocating after acquiring the lease; return whether grants may be in force.

        A readable ``previous`` document bounds every grant that may still be in force (each
        worker's outstanding grants and acknowledgements are in it): the new allocator goes on
        as the one before it would have, with no learning mode (Doorman learns because its new
        master cannot know the leases out there). When that document is missing or unreadable
        while a worker reports a grant (or a report could not be read: it may say so), it runs
        in learning mode for one lease: it echoes what the workers report applying and gives
        new workers their bootstrap only; and a document written in learning mode bounds
        nothing (the one before it was lost), so it is learnt until it expires. The allocator
        that finds its own last document gone learns likewise (:meth:`allocate`).
        """
        granted = self._granted(reports, now, unread)
        if previous is not None and previous.expires_at > now[0]:
            # (a document of learning mode does not bound what is in force: the one before it
            # was lost, and the grants in it may be; it is learnt until it expires, which is
            # after every one of those)
            self.learning_until = previous.expires_at if previous.learning else None
            return True
        if previous is None and granted:
            self.learning_until = now[1] + self.lease
            return True
        self.learning_until = None
        return False

    def _granted(
        self, reports: Iterable[ObservedReport], now: tuple[float, float], unread: Collection[str]
    ) -> bool:
        """Whether a fresh report says its worker applies a grant (or one could not be read:
        it may say so)."""
        return bool(unread) or any(r.report.mode == "granted" for r in self.fresh(reports, now))

    def step_down(self) -> None:
        """The lease was lost: a later acquisition is a new takeover."""
        self.learning_until = None

    def duplicates(self, reports: Iterable[ObservedReport]) -> list[str]:
        """The worker ids found shared by two processes or more, each once: reports read
        cycle after cycle whose ``incarnation`` goes back to one seen before. A restart only
        ever brings a new incarnation; two processes with one ``worker_id`` overwrite each
        other's report, and get one grant that each applies — a fleet that exceeds its cap."""
        found: list[str] = []
        present: set[str] = set()
        for observed in reports:
            worker_id, incarnation = observed.report.worker_id, observed.report.incarnation
            present.add(worker_id)
            seen = self._incarnations.setdefault(worker_id, [])
            if seen and seen[-1] == incarnation:
                continue
            if incarnation in seen:
                seen.remove(incarnation)
                if worker_id not in self._duplicated:
                    self._duplicated.add(worker_id)
                    found.append(worker_id)
            seen.append(incarnation)
            del seen[: -self.REMEMBERED_INCARNATIONS]
        for worker_id in set(self._incarnations) - present:
            del self._incarnations[worker_id]
        return found

    def _generation(self, previous: GrantsDocument | None, reports: Iterable[WorkerReport]) -> int:
        return 1 + max(
            [previous.generation if previous else 0]
            + [r.generation for r in reports if r.generation is not None]
        )

    def gather(
        self,
        previous: GrantsDocument | None,
        reports: Sequence[ObservedReport],
        now: tuple[float, float],
        began: tuple[float, float] | None = None,
    ) -> GrantsDocument:
        """A document without grants that tells the fleet's size: written by the first
        allocator of a starting fleet while it waits a cycle for every member's report, so
        that the members' bootstrap rates already share the cap × ``bootstrap_fraction``."""
        fresh = {r.report.worker_id: r.report for r in self.fresh(reports, now)}
        issued_at = (now[0] + now[1]) / 2
        return GrantsDocument(
            generation=self._generation(previous, fresh.values()),
            allocator=self.allocator_id,
            issued_at=issued_at,
            expires_at=issued_at + self.lease + self.grace,
            learning=False,
            cap=self.cap,
            workers={
                w: WorkerEntry(grant=None, acked=r.generation) for w, r in sorted(fresh.items())
            },
            fleet_size=len(fresh),
            sync_interval=self.interval,
            bootstrap_fraction=self.bootstrap_fraction,
            leftover_after=LEFTOVER_LEASES * self.configured_lease,
            next_allocation_at=_next_allocation(began, self.interval, issued_at),
        )

    def learning(self, now: tuple[float, float]) -> bool:
        return self.learning_until is not None and now[0] < self.learning_until

    def allocate(
        self,
        previous: GrantsDocument | None,
        reports: Sequence[ObservedReport],
        now: tuple[float, float],
        unread: Collection[str] = (),
        left: Mapping[str, str] | None = None,
        began: tuple[float, float] | None = None,
    ) -> GrantsDocument:
        """The next generation of grants. ``now`` bounds S3's time (earliest, latest).

        ``began``: S3's time when the reads of ``reports`` began: the next reads begin an
        interval later (the document's ``next_allocation_at``).

        ``unread``: workers whose fresh report was listed but could not be read in time (a
        slow or failing store): each keeps its grant in ``previous``, within the invariant,
        and counts in the fleet's size.

        ``left``: the workers marked as left (worker id -> the incarnation that wrote the
        mark). A worker writes its mark only after it stopped applying any grant, so what it
        had (if its grants were made for that incarnation) is free in this generation, not
        when its grants expire, and that incarnation's report no longer counts. A report that
        is merely gone (deleted as a leftover, or by hand) frees nothing.
        """
        left = left or {}
        if previous is None and not self.learning(now) and self._granted(reports, now, unread):
            # the last document is gone (deleted, or unreadable) while grants of it may be in
            # force: as after a takeover without one, learn for a lease
            self.learning_until = now[1] + self.lease
        # (a process that marked itself as left applies nothing: its report, if it is still
        # there, no longer counts)
        observed = [
            r
            for r in self.fresh(reports, now)
            if left.get(r.report.worker_id) != r.report.incarnation
        ]
        fresh = {r.report.worker_id: r.report for r in observed}
        # granted anew: the workers that reported in the last cycle or so (or could not be
        # read); the others still count in the fleet, their grants in force still count
        current = {
            r.report.worker_id
            for r in observed
            if now[0] - (r.last_modified + TIMESTAMP_RESOLUTION) <= self.current_age
        }
        echoed: dict[str, Rates] = {}
        if previous is not None and previous.expires_at > now[0]:
            for w in unread:
                last = previous.grant_for(w)
                marked = w in left and _made_for(previous, w, left[w])
                if w not in fresh and last is not None and not marked:
                    echoed[w] = last
        learning = self.learning(now)
        acks: dict[str, int | None] = {}
        for worker_id in set(fresh) | set(previous.workers if previous else ()):
            reported = fresh[worker_id].generation if worker_id in fresh else None
            entry = previous.workers.get(worker_id) if previous is not None else None
            earlier = entry.acked if entry is not None else None
            acks[worker_id] = max_of((reported, earlier))
        # a process that marked itself as left applies none of the grants made for it, and its
        # successor under the same worker id never applies one of those: they are free, each
        # grant by the process it names (an entry names the process of its newest grant; an
        # earlier grant may be another's — a departed process's late report can put its name
        # back on the entry while its successor applies a grant of its own)
        held = {
            w: [
                o
                for o in in_force(previous, w, acks[w], now[0])
                if not (w in left and o.made_for(left[w]))
            ]
            for w in acks
        }
        generation = self._generation(previous, fresh.values())
        fleet = max(1, len(fresh) + len(echoed))
        grants: dict[str, list[float | None]] = {w: [None, None] for w in (*current, *echoed)}
        for i, cap in enumerate(self.cap):
            if cap is None:
                continue
            # the bootstrap budget is never granted: the workers outside a grant share it
            capacity = cap * (1 - self.bootstrap_fraction)
            floor = capacity * self.bootstrap_fraction / fleet
            force = {w: max((o.rates[i] or 0.0 for o in held[w]), default=0.0) for w in held}
            use = {w: (r.has[i] or 0.0) for w, r in fresh.items()}
            if previous is None:
                # no document says what is in force (a takeover after grants.json was lost):
                # what the workers report applying under a grant is, current or not
                for w, r in fresh.items():
                    if r.mode == "granted":
                        force[w] = max(force.get(w, 0.0), use[w])
            if learning:
                targets = {}
                for w in current:
                    r = fresh[w]
                    echo = previous.grant_for(w) if previous is not None else None
                    if echo is not None and previous is not None and previous.expires_at > now[0]:
                        targets[w] = echo[i] or 0.0
                    elif r.mode == "granted":
                        targets[w] = use[w]
                    else:
                        targets[w] = floor
            else:
                # shared over every fresh worker, granted to the current ones: the share of a
                # worker that missed one report (late, or dead) is held back, not handed to the
                # others only to be taken back, acknowledgement by acknowledgement, at its next
                # report (a dead worker's grants in force outlast its fresh report anyway)
                # (less what the workers whose report could not be read keep: their grants
                # are echoed below, and sharing the whole capacity over the others as well
                # booked it twice — the invariant then kept the workers in force at the larger
                # share, and a newcomer below it, for as long as the store failed some reads)
                kept = sum(last[i] or 0.0 for last in echoed.values())
                wants = {w: max((fresh[w].wants[i] or 0.0) * HEADROOM, floor) for w in fresh}
                shared = water_fill(max(0.0, capacity - kept), wants)
                targets = {w: t for w, t in shared.items() if w in current}
            targets.update({w: last[i] or 0.0 for w, last in echoed.items()})
            for w, rate in allocate_dimension(capacity, targets, force, use).items():
                grants[w][i] = rate
        workers: dict[str, WorkerEntry] = {}
        for w in sorted(acks):
            outstanding = tuple(sorted(held[w], key=lambda o: o.generation))
            grant: Rates | None = None
            if w in grants:
                values = [None if v is None else _short(v) for v in grants[w]]
                if all(v is None or v > 0 for v in values):
                    grant = Rates(values[0], values[1])
            if grant is None and not outstanding and w not in fresh and w not in echoed:
                continue  # gone, and nothing of it in force: forget it
            # the process the grant is for: the one that reported (an unread worker's grant is
            # the one its previous entry named)
            incarnation = None
            if w in fresh:
                incarnation = fresh[w].incarnation[:INCARNATION_TAG]
            elif previous is not None and w in previous.workers:
                incarnation = previous.workers[w].incarnation
            workers[w] = WorkerEntry(
                grant=grant, acked=acks[w], outstanding=outstanding, incarnation=incarnation
            )
        issued_at = (now[0] + now[1]) / 2
        return GrantsDocument(
            generation=generation,
            allocator=self.allocator_id,
            issued_at=issued_at,
            expires_at=issued_at + self.lease + self.grace,
            learning=learning,
            cap=self.cap,
            workers=workers,
            fleet_size=len(fresh) + len(echoed),
            sync_interval=self.interval,
            bootstrap_fraction=self.bootstrap_fraction,
            leftover_after=LEFTOVER_LEASES * self.configured_lease,
            next_allocation_at=_next_allocation(began, self.interval, issued_at),
        )
