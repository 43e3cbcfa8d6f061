"""Fleet-wide caps: the allocator's maths, the worker's state machine and the S3 documents.

Pure, synchronous and clock-injected: nothing here does I/O or reads a clock. The async shell
that moves these documents through S3 is ``_coordinator.py``; ``docs/fleet.md`` draws the
control loop.

This replaces the loop of the DynamoDB Bulk Executor's rate limiter
(``tools/bulk_executor/.../rate_limiter/DistributedDynamoDBMonitorWorker.py`` and
``DistributedDynamoDBMonitorAggregator.py`` in awslabs/amazon-dynamodb-tools), where each
worker reported its achieved rate and multiplied its limit by ``aggregate_max / aggregate``.
Its layout is kept — one object per worker, so workers never contend; one writer of the
summary; jittered periods measured start to start; each worker deletes its own object on a
clean shutdown — and the design follows Doorman's leases (youtube/doorman,
``doc/algorithms.md``) instead of scaling limits. Where we differ from the Bulk Executor, and
why (its failure modes, numbered as in ``reference/ratelimit.md`` §2):

* **Grants expire** (its mode 1: a dead aggregator's frozen ratio kept being applied and
  ratcheted limits up or down). A worker applies a grant only while it is unexpired and only if
  its generation is newer than the last one applied; afterwards it falls back to a *safe rate*,
  the cap × ``safe_fraction`` ÷ the fleet size it last knew, but never more than the last grant
  it applied (``reference/ratelimit.md``, Recommendation C.4) — nor, if it never had one, than
  its bootstrap rate.
* **Workers report demand, not achieved rate** (its mode 2: achieved rate is capped by the limit,
  so it keeps the status quo and idle workers were scaled up). Demand is an EWMA of the *offered*
  load — records admitted, not sent — plus the backlog ÷ the sync interval, so a worker held
  back by its grant says so.
* **The allocator hands out shares whose sum never exceeds the cap** (its modes 2 and 7: limits
  summed to many times the cap, with no fairness). Targets are max-min fair shares of the
  demand (Doorman's FAIR_SHARE, water-filling), and Doorman's safety invariant bounds every
  grant: ``new grant ≤ cap − Σ over the other workers of max(their grant in force, their new
  grant)``. A reduction applies at once; an increase waits until capacity is free. Unlike
  Doorman, whose clients receive their lease in the RPC's answer, our workers read grants from
  S3 whenever they next look, so a worker's earlier grants stay *in force* until they expire or
  until the worker reports (``generation`` in its report) that it applied a later one. Every
  grants document lists, per worker, the earlier grants still in force, so any allocator — a
  new one included — can check the invariant from the last document alone.
* **A new worker starts with a small bootstrap grant** (its mode 3: N workers × cap/10 went over
  the cap at start-up). The bootstrap is the cap × ``bootstrap_fraction`` ÷ the fleet size the
  worker knows, and like any grant it expires: a worker that gets no grant within one lease (no
  allocator, S3 unreachable) moves to the safe rate. Every grants document says how many
  workers reported (``fleet_size``), and a fleet's first allocator writes one *without grants*
  as soon as it holds the lease, while it waits a cycle for every member's report: so the
  members of a starting fleet learn N at their second cycle. Only until then — about one sync
  interval — may N of them together run at N × the cap × ``bootstrap_fraction`` (the fleet
  size is 1 before a worker has read any grants). A worker joining a running fleet learns N
  from its first read.
* **Staleness is judged by S3's clock** (its mode 4: two machines' wall clocks). Reports are
  aged by their ``LastModified`` against S3's own time, which :class:`ServerClock` tracks from
  the ``Date`` headers of S3's answers (and, where a server sends none, such as moto, from the
  ``Last-Modified`` of the objects the worker writes). Both have one-second resolution; the
  clock keeps *bounds* on S3's time, and each side errs on its safe side: a worker treats its
  grant as expired as soon as S3's time *may* have passed ``expires_at``, the allocator treats
  it as expired only once S3's time *surely* has.
* **One allocator, elected through S3 conditional writes** (its mode 6: two aggregators would
  both write). The lease object is created with ``If-None-Match: *`` and renewed with
  ``If-Match``, and ``grants.json`` is written with ``If-Match`` on the ETag of the document the
  allocator built on, so even two allocators that both believe they hold the lease cannot
  interleave their grants. After a takeover the new allocator runs in **learning mode**
  (Doorman): it echoes the grants in force and gives new workers their bootstrap only. Doorman
  learns for one maximum lease because its new master cannot know the leases out there; ours
  can (the last grants document bounds every grant before it), so it learns only until that
  document expires, and for one lease only when the document is missing or unreadable.
* Leftover objects of crashed workers are deleted by the allocator once they are long stale
  (its mode 5), and errors are logged once per kind and counted (its mode 8; see the shell).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

__all__ = (
    "DEMAND_SMOOTHING",
    "DOCUMENT_VERSION",
    "HEADROOM",
    "TIMESTAMP_RESOLUTION",
    "Allocator",
    "DemandEstimator",
    "DocumentError",
    "FleetDemand",
    "FleetStatistics",
    "GrantsDocument",
    "LeaseDocument",
    "ObservedReport",
    "Outstanding",
    "Rates",
    "ServerClock",
    "WorkerEntry",
    "WorkerReport",
    "WorkerState",
    "allocate_dimension",
    "in_force",
    "lease_expiry",
    "parse_grants",
    "parse_lease",
    "parse_report",
    "water_fill",
)

Mode = Literal["bootstrap", "granted", "safe"]
Role = Literal["allocator", "worker"]

#: S3's ``LastModified`` and ``Date`` carry whole seconds.
TIMESTAMP_RESOLUTION: Final = 1.0
#: The version of the JSON documents; a document of another version is rejected.
DOCUMENT_VERSION: Final = 1
#: A worker is granted up to its demand times this, so it can grow before the next allocation.
HEADROOM: Final = 1.25
#: The weight of the newest sample in the EWMA of the offered load.
DEMAND_SMOOTHING: Final = 0.5
#: Documents larger than this are rejected unread.
MAX_DOCUMENT_BYTES: Final = 4 << 20
#: A relative margin kept below the cap against floating-point rounding.
_ROUNDING: Final = 1e-9
#: How far the local clock may drift from S3's per second of age of an observation.
_DRIFT: Final = 2e-4
_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_MODES: Final = ("bootstrap", "granted", "safe")
_DIMENSIONS: Final = ("records_per_second", "bytes_per_second")
_KIND_REPORT: Final = "anykpl-fleet-report"
_KIND_LEASE: Final = "anykpl-fleet-lease"
_KIND_GRANTS: Final = "anykpl-fleet-grants"


class Rates(NamedTuple):
    """Records and bytes per second; ``None`` is "no limit" in that dimension."""

    records_per_second: float | None
    bytes_per_second: float | None


class FleetDemand(NamedTuple):
    """What the producer tells its worker, in the units of the grants (Kinesis records and
    their bytes, as the service counts them: an aggregate is one record): the totals offered
    to its Limiters so far (retries included) and the backlog waiting in them now."""

    admitted_records: int
    admitted_bytes: int
    backlog_records: int
    backlog_bytes: int


@dataclass(frozen=True, slots=True)
class FleetStatistics:
    """A snapshot of a producer's place in its fleet (``ProducerStatistics.fleet``).

    Attributes:
        worker_id: this producer's name in the fleet.
        role: ``"allocator"`` while it holds the allocator's lease, else ``"worker"``.
        mode: ``"bootstrap"`` (no grant yet), ``"granted"`` (an unexpired grant) or
            ``"safe"`` (the grant expired, or none came within a lease).
        records_per_second: the rate applied now, or ``None`` (unlimited).
        bytes_per_second: the rate applied now, or ``None`` (unlimited).
        grant_expires_at: when the grant applied now expires, on the producer's clock
            (``anyio.current_time()``), or ``None`` when no grant applies.
        fleet_size: the workers it knows of (from the last grants it read), at least 1.
        s3_errors: S3 calls that failed since the start.
        last_error: the last of them (``"operation: code: message"``), or ``None``.
        generation: the generation of the grant applied last, or ``None``.
    """

    worker_id: str
    role: Role
    mode: Mode
    records_per_second: float | None
    bytes_per_second: float | None
    grant_expires_at: float | None
    fleet_size: int
    s3_errors: int
    last_error: str | None
    generation: int | None


class DocumentError(ValueError):
    """A coordination object that is not a valid document (junk, another version, too big)."""


# -- S3's clock ---------------------------------------------------------------------------


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


# -- demand -------------------------------------------------------------------------------


class DemandEstimator:
    """A worker's demand: EWMA of its offered load plus its backlog ÷ the sync interval.

    The offered load is what the producer *admitted* per second — not what it sent, which its
    grant caps. When backpressure holds callers back, admissions follow sending, and then the
    backlog (records admitted and not yet finished, up to ``max_outstanding_records``) is what
    says the worker wants more.
    """

    __slots__ = ("_last", "_last_at", "_sampled", "offered", "sync_interval")

    def __init__(self, sync_interval: float) -> None:
        self.sync_interval = sync_interval
        self._last: FleetDemand | None = None
        self._last_at = 0.0
        self._sampled = False
        self.offered = (0.0, 0.0)

    def update(self, demand: FleetDemand, now: float) -> tuple[Rates, Rates]:
        """Take a sample at local time ``now``; return ``(offered, wants)`` per second."""
        last = self._last
        if last is not None and now > self._last_at:
            elapsed = now - self._last_at
            records = max(0, demand.admitted_records - last.admitted_records) / elapsed
            nbytes = max(0, demand.admitted_bytes - last.admitted_bytes) / elapsed
            if self._sampled:
                a = DEMAND_SMOOTHING
                records = a * records + (1 - a) * self.offered[0]
                nbytes = a * nbytes + (1 - a) * self.offered[1]
            self.offered = (records, nbytes)
            self._sampled = True
        if last is None or now > self._last_at:
            self._last, self._last_at = demand, now
        wants_records = self.offered[0] + max(0, demand.backlog_records) / self.sync_interval
        wants_bytes = self.offered[1] + max(0, demand.backlog_bytes) / self.sync_interval
        return Rates(*self.offered), Rates(wants_records, wants_bytes)


# -- the documents ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """``<prefix>/workers/<worker_id>.json``: one worker's demand and what it applies now."""

    worker_id: str
    incarnation: str
    sequence: int
    mode: Mode
    generation: int | None  # of the last grant applied
    has: Rates
    wants: Rates
    offered: Rates
    backlog: tuple[int, int]  # (records, bytes)

    def to_json(self) -> bytes:
        return _dump(
            {
                "kind": _KIND_REPORT,
                "version": DOCUMENT_VERSION,
                "worker_id": self.worker_id,
                "incarnation": self.incarnation,
                "sequence": self.sequence,
                "mode": self.mode,
                "generation": self.generation,
                "has": _rates_json(self.has),
                "wants": _rates_json(self.wants),
                "offered": _rates_json(self.offered),
                "backlog": {"records": self.backlog[0], "bytes": self.backlog[1]},
            }
        )


@dataclass(frozen=True, slots=True)
class LeaseDocument:
    """``<prefix>/allocator.json``: who allocates, until when (S3 time, epoch seconds)."""

    holder: str
    incarnation: str
    acquired_at: float
    renewed_at: float
    expires_at: float
    lease: float

    def to_json(self) -> bytes:
        return _dump(
            {
                "kind": _KIND_LEASE,
                "version": DOCUMENT_VERSION,
                "holder": self.holder,
                "incarnation": self.incarnation,
                "acquired_at": self.acquired_at,
                "renewed_at": self.renewed_at,
                "expires_at": self.expires_at,
                "lease": self.lease,
            }
        )


@dataclass(frozen=True, slots=True)
class Outstanding:
    """An earlier grant to a worker that may still be in force."""

    generation: int
    rates: Rates
    expires_at: float


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One worker in a grants document.

    ``grant`` is its new grant (``None``: none — a worker dropped as stale, kept only while an
    earlier grant of its may be in force); ``acked`` the last generation it reported applying;
    ``outstanding`` its earlier grants that may still be in force.
    """

    grant: Rates | None
    acked: int | None
    outstanding: tuple[Outstanding, ...] = ()

    def reserved(self) -> Rates:
        """The most this worker may apply while the document is the newest: the larger of its
        new grant and every earlier one in force, per dimension (``None`` if uncapped)."""
        grants = [o.rates for o in self.outstanding]
        if self.grant is not None:
            grants.append(self.grant)
        return Rates(*(_max_of(g[i] for g in grants) for i in range(2)))


@dataclass(frozen=True, slots=True)
class GrantsDocument:
    """``<prefix>/grants.json``: one generation of grants, in force until ``expires_at``.

    Times are S3's (epoch seconds). For every dimension with a cap, the sum over the workers of
    :meth:`WorkerEntry.reserved` never exceeds the cap. ``fleet_size`` is how many workers'
    fresh reports the allocator read (``None`` in a document that does not say); the document
    a fleet's first allocator writes while it gathers reports has no grants, only that.
    """

    generation: int
    allocator: str
    issued_at: float
    expires_at: float
    learning: bool
    cap: Rates
    workers: Mapping[str, WorkerEntry]
    fleet_size: int | None = None

    def grant_for(self, worker_id: str) -> Rates | None:
        entry = self.workers.get(worker_id)
        return None if entry is None else entry.grant

    def fleet_size_for(self, worker_id: str) -> int:
        """The fleet size a worker should assume after reading this document: the workers
        that reported, and itself if it was not among them (at least 1). A worker listed only
        for its earlier grants in force (no grant now) was maybe not among them: it counts
        itself once more, which errs on the low side of the rates."""
        entry = self.workers.get(worker_id)
        if self.fleet_size is None:  # then the workers granted stand in for those that reported
            return max(1, self.granted + (0 if entry is not None and entry.grant else 1))
        counted = entry is not None and (entry.grant is not None or not entry.outstanding)
        return max(1, self.fleet_size + (0 if counted else 1))

    @property
    def granted(self) -> int:
        """How many workers have a grant in this document."""
        return sum(1 for e in self.workers.values() if e.grant is not None)

    def total_granted(self) -> Rates:
        """The sum of the new grants per dimension (``None`` where uncapped)."""
        return Rates(
            *(
                None
                if self.cap[i] is None
                else sum((e.grant[i] or 0.0) for e in self.workers.values() if e.grant)
                for i in range(2)
            )
        )

    def total_reserved(self) -> Rates:
        """The sum over workers of what may be in force (``None`` where uncapped)."""
        return Rates(
            *(
                None
                if self.cap[i] is None
                else sum((e.reserved()[i] or 0.0) for e in self.workers.values())
                for i in range(2)
            )
        )

    def to_json(self) -> bytes:
        return _dump(
            {
                "kind": _KIND_GRANTS,
                "version": DOCUMENT_VERSION,
                "generation": self.generation,
                "allocator": self.allocator,
                "issued_at": self.issued_at,
                "expires_at": self.expires_at,
                "learning": self.learning,
                "cap": _rates_json(self.cap),
                "fleet_size": self.fleet_size,
                "workers": {
                    worker_id: {
                        "grant": None if e.grant is None else _rates_json(e.grant),
                        "acked": e.acked,
                        "outstanding": [
                            {
                                "generation": o.generation,
                                "expires_at": o.expires_at,
                                **_rates_json(o.rates),
                            }
                            for o in e.outstanding
                        ],
                    }
                    for worker_id, e in sorted(self.workers.items())
                },
            }
        )


def parse_report(data: bytes) -> WorkerReport:
    """Read a worker report; raise :class:`DocumentError` for anything else."""
    doc = _load(data, _KIND_REPORT)
    mode = doc.get("mode")
    if mode not in _MODES:
        raise DocumentError(f"mode must be one of {_MODES}, not {mode!r}")
    backlog = _object(doc, "backlog")
    return WorkerReport(
        worker_id=_identifier(doc, "worker_id"),
        incarnation=_identifier(doc, "incarnation"),
        sequence=_integer(doc, "sequence"),
        mode=mode,
        generation=_integer(doc, "generation", optional=True),
        has=_rates(_object(doc, "has"), True, "has."),
        wants=_rates(_object(doc, "wants"), False, "wants."),
        offered=_rates(_object(doc, "offered"), False, "offered."),
        backlog=(_integer(backlog, "records"), _integer(backlog, "bytes")),
    )


def parse_lease(data: bytes) -> LeaseDocument:
    """Read the allocator's lease; raise :class:`DocumentError` for anything else."""
    doc = _load(data, _KIND_LEASE)
    lease = _number(doc, "lease")
    if lease <= 0:
        raise DocumentError("lease must be positive")
    return LeaseDocument(
        holder=_identifier(doc, "holder"),
        incarnation=_identifier(doc, "incarnation"),
        acquired_at=_number(doc, "acquired_at"),
        renewed_at=_number(doc, "renewed_at"),
        expires_at=_number(doc, "expires_at"),
        lease=lease,
    )


def parse_grants(data: bytes) -> GrantsDocument:
    """Read a grants document; raise :class:`DocumentError` for anything else."""
    doc = _load(data, _KIND_GRANTS)
    cap = _rates(_object(doc, "cap"), True, "cap.", positive=True)
    if cap.records_per_second is None and cap.bytes_per_second is None:
        raise DocumentError("cap: at least one dimension must be capped")
    issued_at, expires_at = _number(doc, "issued_at"), _number(doc, "expires_at")
    if expires_at < issued_at:
        raise DocumentError("expires_at is before issued_at")
    learning = doc.get("learning")
    if not isinstance(learning, bool):
        raise DocumentError("learning must be true or false")
    raw_workers = _object(doc, "workers")
    workers: dict[str, WorkerEntry] = {}
    for worker_id, raw in raw_workers.items():
        if not isinstance(worker_id, str) or not _ID.fullmatch(worker_id):
            raise DocumentError(f"invalid worker id {worker_id!r}")
        if not isinstance(raw, dict):
            raise DocumentError(f"workers.{worker_id} must be an object")
        grant_raw = raw.get("grant")
        grant = (
            None
            if grant_raw is None
            else _rates(_as_object(grant_raw, "grant"), True, f"{worker_id}.", positive=True)
        )
        outstanding_raw = raw.get("outstanding", [])
        if not isinstance(outstanding_raw, list) or len(outstanding_raw) > 256:
            raise DocumentError(f"workers.{worker_id}.outstanding must be a short list")
        outstanding = tuple(
            Outstanding(
                generation=_integer(o, "generation"),
                rates=_rates(o, True, f"{worker_id}.outstanding.", positive=True),
                expires_at=_number(o, "expires_at"),
            )
            for o in (_as_object(item, "outstanding") for item in outstanding_raw)
        )
        workers[worker_id] = WorkerEntry(
            grant=grant, acked=_integer(raw, "acked", optional=True), outstanding=outstanding
        )
    return GrantsDocument(
        generation=_integer(doc, "generation"),
        allocator=_identifier(doc, "allocator"),
        issued_at=issued_at,
        expires_at=expires_at,
        learning=learning,
        cap=cap,
        workers=workers,
        fleet_size=_integer(doc, "fleet_size", optional=True),
    )


def lease_expiry(lease: LeaseDocument | None, last_modified: float, default_lease: float) -> float:
    """When a lease object expires, in S3 time.

    The holder wrote it at some moment in ``[last_modified, last_modified + 1)``. Its own
    ``expires_at`` (from its estimate of S3's time, finer than a second) is used when it is
    consistent with that; junk is judged by ``LastModified`` alone, conservatively.
    """
    if lease is None:
        return last_modified + TIMESTAMP_RESOLUTION + default_lease
    low = last_modified + lease.lease
    high = low + TIMESTAMP_RESOLUTION
    return min(max(lease.expires_at, low), high)


# -- the allocator ------------------------------------------------------------------------


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
    cap: float,
    targets: Mapping[str, float],
    in_force: Mapping[str, float],
    in_use: Mapping[str, float],
) -> dict[str, float]:
    """New grants in one dimension, bounded by Doorman's invariant.

    ``targets``: what each worker to be granted should get; ``in_force``: every worker's
    largest grant that may still apply (workers not in ``targets`` included); ``in_use``: rates
    applied outside any grant (bootstrap, safe), as the workers last reported them.

    Reductions apply at once. An increase takes only capacity that is free now: the cap minus,
    for every worker, the most it may apply while this generation is the newest — so the sum
    of ``max(grant in force, new grant)`` never exceeds the cap, and room is kept for the
    bootstrap and safe rates in use too.
    """
    limit = cap * (1 - _ROUNDING)
    new = {j: min(t, max(in_force.get(j, 0.0), in_use.get(j, 0.0))) for j, t in targets.items()}
    everyone = set(in_force) | set(targets)

    def committed() -> float:
        return sum(max(in_force.get(k, 0.0), new.get(k, 0.0)) for k in everyone)

    # A worker keeps up to the rate it applies outside a grant, which is not in force as a
    # grant: trim those keeps first if they would break the invariant.
    excess = committed() - limit
    if excess > 0:
        above = {j: new[j] - in_force.get(j, 0.0) for j in new if new[j] > in_force.get(j, 0.0)}
        total_above = sum(above.values())
        if total_above > 0:
            keep = max(0.0, 1 - excess / total_above)
            for j, extra in above.items():
                new[j] = in_force.get(j, 0.0) + extra * keep
    # Grants in force already exceed the cap (the cap was lowered, or a document was lost):
    # nothing more can be done for the instant, but the new grants alone fit.
    granted = sum(new.values())
    if granted > limit:
        for j in new:
            new[j] *= limit / granted
    used = sum(max(in_force.get(k, 0.0), in_use.get(k, 0.0), new.get(k, 0.0)) for k in everyone)
    free = limit - used
    if free > 0:
        deficits = {j: targets[j] - new[j] for j in new if targets[j] > new[j]}
        for j, extra in water_fill(free, deficits).items():
            new[j] += extra
    # A worker without a grant in force that would get less than the rate it runs now only
    # because the capacity is not free yet gets no grant yet: granting it a sliver would stall
    # it, while its bootstrap or safe rate is already counted above.
    for j, rate in list(new.items()):
        if in_force.get(j, 0.0) <= 0 and rate < min(targets[j], in_use.get(j, 0.0)) * (1 - 1e-6):
            new[j] = 0.0
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
        candidates.append(Outstanding(previous.generation, entry.grant, previous.expires_at))
    floor = -1 if acked is None else acked
    return [c for c in candidates if c.generation >= floor and c.expires_at > now_earliest]


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
    ) -> None:
        self.allocator_id = allocator_id
        self.cap = cap
        self.lease = lease
        self.bootstrap_fraction = bootstrap_fraction
        #: S3 time until which the allocator echoes grants instead of reallocating
        self.learning_until: float | None = None
        self._incarnations: dict[str, list[str]] = {}  # worker id -> recent, newest last
        self._duplicated: set[str] = set()

    def __repr__(self) -> str:
        return f"<Allocator {self.allocator_id} cap={tuple(self.cap)}>"

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
    ) -> bool:
        """Start allocating after acquiring the lease; return whether grants may be in force.

        If grants of the previous allocator may still be in force, run in learning mode
        (Doorman): echo the grants in force and give new workers their bootstrap only, until
        they have all expired — at ``expires_at`` of the last document, which bounds every
        grant before it; or, when that document is missing or unreadable while a worker
        reports a grant, for one lease.
        """
        granted = any(r.report.mode == "granted" for r in self.fresh(reports, now))
        if previous is not None and previous.expires_at > now[0]:
            self.learning_until = previous.expires_at
            return True
        if previous is None and granted:
            self.learning_until = now[1] + self.lease
            return True
        self.learning_until = None
        return False

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
            expires_at=issued_at + self.lease,
            learning=False,
            cap=self.cap,
            workers={
                w: WorkerEntry(grant=None, acked=r.generation) for w, r in sorted(fresh.items())
            },
            fleet_size=len(fresh),
        )

    def learning(self, now: tuple[float, float]) -> bool:
        return self.learning_until is not None and now[0] < self.learning_until

    def allocate(
        self,
        previous: GrantsDocument | None,
        reports: Sequence[ObservedReport],
        now: tuple[float, float],
    ) -> GrantsDocument:
        """The next generation of grants. ``now`` bounds S3's time (earliest, latest)."""
        fresh = {r.report.worker_id: r.report for r in self.fresh(reports, now)}
        learning = self.learning(now)
        acks: dict[str, int | None] = {}
        for worker_id in set(fresh) | set(previous.workers if previous else ()):
            reported = fresh[worker_id].generation if worker_id in fresh else None
            entry = previous.workers.get(worker_id) if previous is not None else None
            earlier = entry.acked if entry is not None else None
            acks[worker_id] = _max_of((reported, earlier))
        held = {w: in_force(previous, w, acks[w], now[0]) for w in acks}
        generation = self._generation(previous, fresh.values())
        fleet = max(1, len(fresh))
        grants: dict[str, list[float | None]] = {w: [None, None] for w in fresh}
        for i, cap in enumerate(self.cap):
            if cap is None:
                continue
            floor = cap * self.bootstrap_fraction / fleet
            force = {w: max((o.rates[i] or 0.0 for o in held[w]), default=0.0) for w in held}
            use = {w: (r.has[i] or 0.0) for w, r in fresh.items()}
            if learning:
                targets = {}
                for w, r in fresh.items():
                    echo = previous.grant_for(w) if previous is not None else None
                    if echo is not None and previous is not None and previous.expires_at > now[0]:
                        targets[w] = echo[i] or 0.0
                    elif r.mode == "granted":
                        targets[w] = use[w]
                    else:
                        targets[w] = floor
            else:
                wants = {w: max((r.wants[i] or 0.0) * HEADROOM, floor) for w, r in fresh.items()}
                targets = water_fill(cap, wants)
            for w, rate in allocate_dimension(cap, targets, force, use).items():
                grants[w][i] = rate
        workers: dict[str, WorkerEntry] = {}
        for w in sorted(acks):
            outstanding = tuple(sorted(held[w], key=lambda o: o.generation))
            grant: Rates | None = None
            if w in grants:
                values = grants[w]
                if all(v is None or v > 0 for v in values):
                    grant = Rates(values[0], values[1])
            if grant is None and not outstanding and w not in fresh:
                continue  # gone, and nothing of it in force: forget it
            workers[w] = WorkerEntry(grant=grant, acked=acks[w], outstanding=outstanding)
        issued_at = (now[0] + now[1]) / 2
        return GrantsDocument(
            generation=generation,
            allocator=self.allocator_id,
            issued_at=issued_at,
            expires_at=issued_at + self.lease,
            learning=learning,
            cap=self.cap,
            workers=workers,
            fleet_size=len(fresh),
        )


# -- the worker ---------------------------------------------------------------------------


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
                None if c is None else _min_of((c * self.safe_fraction / fleet, ceiling[i]))
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


# -- JSON helpers -------------------------------------------------------------------------


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=False, separators=(",", ":"), sort_keys=False).encode()


def _rates_json(rates: Rates) -> dict[str, float | None]:
    return {"records_per_second": rates[0], "bytes_per_second": rates[1]}


def _reject_constant(name: str) -> Any:
    raise DocumentError(f"{name} is not a number JSON allows")


def _load(data: bytes, kind: str) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray)):
        raise DocumentError("a document is bytes")
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"document is {len(data)} bytes, over {MAX_DOCUMENT_BYTES}")
    try:
        doc = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except DocumentError:
        raise
    except (ValueError, RecursionError) as exc:
        # any parsing error: invalid UTF-8 or JSON, nesting too deep, or an integer longer
        # than Python converts (``sys.get_int_max_str_digits()``, 4300 digits by default)
        raise DocumentError(f"not JSON: {_short(str(exc), 200)}") from None
    if not isinstance(doc, dict):
        raise DocumentError("a document is a JSON object")
    if doc.get("kind") != kind:
        raise DocumentError(f"kind must be {kind!r}, not {doc.get('kind')!r}")
    version = doc.get("version")
    if version != DOCUMENT_VERSION or isinstance(version, bool):
        raise DocumentError(f"version {version!r} is not {DOCUMENT_VERSION}")
    return doc


def _as_object(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DocumentError(f"{name} must be an object")
    return value


def _object(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _as_object(doc.get(name), name)


def _identifier(doc: Mapping[str, Any], name: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise DocumentError(f"{name} must be 1..128 of A-Z a-z 0-9 _ . -, not {value!r}")
    return value


def _short(value: object, limit: int = 40) -> str:
    """``value`` for an error message: its repr, or a string as it is, cut to ``limit``."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _number(doc: Mapping[str, Any], name: str, *, positive: bool = False) -> float:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DocumentError(f"{name} must be a number, not {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        kind = "positive" if positive else "not negative"
        raise DocumentError(f"{name} must be finite and {kind}, not {_short(value)}")
    return number


def _integer(doc: Mapping[str, Any], name: str, *, optional: bool = False) -> Any:
    value = doc.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DocumentError(f"{name} must be a whole number, not {_short(value)}")
    return value


def _rates(
    doc: Mapping[str, Any], optional: bool = False, where: str = "", *, positive: bool = False
) -> Rates:
    """Both dimensions of a rate; ``positive``: a rate to apply, so 0 is junk too (a zero
    rate would stall every Limiter, and no allocator writes one)."""
    values: list[float | None] = []
    for name in _DIMENSIONS:
        if doc.get(name) is None:
            if not optional:
                raise DocumentError(f"{where}{name} is missing")
            values.append(None)
        else:
            try:
                values.append(_number(doc, name, positive=positive))
            except DocumentError as exc:
                raise DocumentError(f"{where}{exc}") from None
    return Rates(values[0], values[1])


def _max_of(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _min_of(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return min(present) if present else None
