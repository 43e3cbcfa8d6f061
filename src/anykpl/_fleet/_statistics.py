"""The frozen snapshot of a producer's place in its fleet: :class:`FleetStatistics`, which
``FleetWorker.statistics()`` answers and ``ProducerStatistics.fleet`` carries.

A module of its own so that the public statistics type does not drag the S3 shell along with
it. See docs/fleet.md ("Statistics and logs").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ._rates import Mode

__all__ = ("FleetStatistics", "Role")

Role = Literal["allocator", "worker"]


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
        sync_interval: the interval it keeps to now: the configured one, or longer while the
            store is slow (the allocator asks it of the fleet, or the member backs off while
            the store refuses its calls as overloaded).
        rank: its rank in the bootstrap budget (the reports it listed after writing its own),
            or ``None`` before it listed.
        requests: the store requests it made since the start, by kind (``"GetObject"``,
            ``"PutObject"``, ``"ListObjectsV2"``, ``"DeleteObject"``): what the fleet costs.
        requests_per_minute: the same, per minute since the start.
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
    sync_interval: float = 0.0
    rank: int | None = None
    requests: Mapping[str, int] = field(default_factory=dict)
    requests_per_minute: Mapping[str, float] = field(default_factory=dict)
