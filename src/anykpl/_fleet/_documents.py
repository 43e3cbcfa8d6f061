"""The fleet's three S3 documents — a worker's report, the allocator's lease, the grants —
their JSON form, and the validation that turns anything else into :class:`DocumentError`.

Every object read from S3 is untrusted: another version, a hand edit, an integer of thousands
of digits, a zero rate. Parsing checks every field and names it in the error. Pure: bytes in,
frozen dataclasses out. docs/fleet.md ("The S3 objects") shows each document.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ._clock import TIMESTAMP_RESOLUTION
from ._rates import Mode, Rates, max_of

__all__ = (
    "DOCUMENT_VERSION",
    "INCARNATION_TAG",
    "MAX_DOCUMENT_BYTES",
    "DocumentError",
    "GrantsDocument",
    "LeaseDocument",
    "Outstanding",
    "WorkerEntry",
    "WorkerReport",
    "lease_expiry",
    "parse_grants",
    "parse_lease",
    "parse_report",
)

#: The version of the JSON documents; a document of another version is rejected.
DOCUMENT_VERSION: Final = 1
#: Documents larger than this are rejected unread.
MAX_DOCUMENT_BYTES: Final = 4 << 20
#: How much of a worker's incarnation a grant names (24 random bits: two processes of one
#: worker id, one after the other, are told apart but for one chance in sixteen million).
INCARNATION_TAG: Final = 6
_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_MODES: Final = ("bootstrap", "granted", "safe")
_DIMENSIONS: Final = ("records_per_second", "bytes_per_second")
_KIND_REPORT: Final = "anykpl-fleet-report"
_KIND_LEASE: Final = "anykpl-fleet-lease"
_KIND_GRANTS: Final = "anykpl-fleet-grants"


class DocumentError(ValueError):
    """A coordination object that is not a valid document (junk, another version, too big)."""


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
    #: the last report of a worker that left: it applies nothing from now on
    left: bool = False

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
                **({"left": True} if self.left else {}),
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
    #: the start of the incarnation it was made for (``None``: not said): a mark that this
    #: process left frees it, and only it — a worker id's entry names the process its newest
    #: grant is for, which need not be the one an earlier grant was for
    incarnation: str | None = None

    def made_for(self, incarnation: str) -> bool:
        """Whether this grant says it was made for ``incarnation``."""
        return self.incarnation is not None and incarnation.startswith(self.incarnation)


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
    #: the start (:data:`INCARNATION_TAG` characters) of the incarnation whose report ``grant``
    #: was made for: a process that restarted under the same worker id takes no grant made
    #: for the one before it (``None``: not said, any incarnation takes it)
    incarnation: str | None = None

    def names(self, incarnation: str) -> bool:
        """Whether this entry says its grant was made for ``incarnation``."""
        return self.incarnation is not None and incarnation.startswith(self.incarnation)

    def reserved(self) -> Rates:
        """The most this worker may apply while the document is the newest: the larger of its
        new grant and every earlier one in force, per dimension (``None`` if uncapped)."""
        grants = [o.rates for o in self.outstanding]
        if self.grant is not None:
            grants.append(self.grant)
        return Rates(*(max_of(g[i] for g in grants) for i in range(2)))


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
    #: the sync interval the allocator asks of the fleet now: the configured one, or longer
    #: while the store is slow (``None`` in a document that does not say)
    sync_interval: float | None = None
    #: the share of the cap the grants leave to the workers outside a grant (``None``: the
    #: document does not say); a worker takes the smaller of this and its own
    bootstrap_fraction: float | None = None
    #: seconds after which the allocator deletes a report as a crashed worker's leftover
    leftover_after: float | None = None
    #: when the allocator's next reads of the reports are due to begin (``None``: not said):
    #: the workers time their reports to fall between this document's writing and then
    next_allocation_at: float | None = None

    def grant_for(self, worker_id: str, incarnation: str | None = None) -> Rates | None:
        """``worker_id``'s new grant; with ``incarnation``, only if it was made for that
        process (a grant made for an earlier process of the same id is not its own)."""
        entry = self.workers.get(worker_id)
        if entry is None:
            return None
        if incarnation is None or entry.incarnation is None or entry.names(incarnation):
            return entry.grant
        return None

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
                "sync_interval": self.sync_interval,
                "bootstrap_fraction": self.bootstrap_fraction,
                "leftover_after": self.leftover_after,
                **(
                    {}
                    if self.next_allocation_at is None
                    else {"next_allocation_at": self.next_allocation_at}
                ),
                # (an earlier grant that does not say for which process was made for the
                # entry's; in a document without this, written before they said, for none)
                "outstanding_named": True,
                "workers": {
                    worker_id: {
                        "grant": None if e.grant is None else _rates_json(e.grant),
                        **({} if e.incarnation is None else {"incarnation": e.incarnation}),
                        "acked": e.acked,
                        "outstanding": [
                            {
                                "generation": o.generation,
                                "expires_at": o.expires_at,
                                **_rates_json(o.rates),
                                # (said only where it is not the entry's, to keep it small)
                                **(
                                    {}
                                    if o.incarnation == e.incarnation
                                    else {"incarnation": o.incarnation}
                                ),
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
    left = doc.get("left", False)
    if not isinstance(left, bool):
        raise DocumentError(f"left must be true or false, not {_short(left)}")
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
        left=left,
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
    named = doc.get("outstanding_named") is True
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
        incarnation = _optional_identifier(raw, "incarnation")
        outstanding = tuple(
            Outstanding(
                generation=_integer(o, "generation"),
                rates=_rates(o, True, f"{worker_id}.outstanding.", positive=True),
                expires_at=_number(o, "expires_at"),
                # (not said: the entry's, or, in a document of an older version, unknown — a
                # mark frees none of those)
                incarnation=(
                    _optional_identifier(o, "incarnation")
                    if "incarnation" in o or not named
                    else incarnation
                ),
            )
            for o in (_as_object(item, "outstanding") for item in outstanding_raw)
        )
        workers[worker_id] = WorkerEntry(
            grant=grant,
            acked=_integer(raw, "acked", optional=True),
            outstanding=outstanding,
            incarnation=incarnation,
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
        sync_interval=_optional_number(doc, "sync_interval"),
        bootstrap_fraction=_optional_number(doc, "bootstrap_fraction"),
        leftover_after=_optional_number(doc, "leftover_after"),
        next_allocation_at=_optional_number(doc, "next_allocation_at"),
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


def _optional_identifier(doc: Mapping[str, Any], name: str) -> str | None:
    return None if doc.get(name) is None else _identifier(doc, name)


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


def _optional_number(doc: Mapping[str, Any], name: str) -> float | None:
    """A positive number, or ``None`` where the document does not say."""
    return None if doc.get(name) is None else _number(doc, name, positive=True)


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
