"""Fleet-wide caps: producers share one cap through S3 (docs/fleet.md draws the loop).

Pure, synchronous and clock-injected — no I/O, no clock read, tested without an event loop:

- ``_rates.py``: :class:`Rates` (records and bytes per second) and the worker's modes.
- ``_clock.py``: :class:`ServerClock`, bounds on S3's time from its whole-second stamps.
- ``_demand.py``: :class:`FleetDemand` (what a producer tells its worker) and the
  :class:`DemandEstimator` a worker reports.
- ``_documents.py``: the report, lease and grants documents, their JSON and its validation.
- ``_allocation.py``: the :class:`Allocator` — fair shares bounded by Doorman's invariant.
- ``_worker_state.py``: :class:`WorkerState`, which rate a worker applies now, and
  :func:`budget_share`, a worker's share of the bootstrap budget by its rank.
- ``_statistics.py``: :class:`FleetStatistics`, the snapshot ``ProducerStatistics.fleet``
  carries.

The async shell, which only moves those documents through S3, sleeps and applies rates:

- ``_store.py``: :class:`S3Store`, the few S3 calls, bounded in time and feeding S3's clock.
- ``_member.py``: :class:`Member`, what every member shares — errors, the lease, allocating,
  the cycle loop, closing — with the sync cycle an abstract method.
- ``_worker.py``: :class:`FleetWorker`, a producer's member (one per ``FleetConfig``).
- ``_standalone_allocator.py``: :class:`FleetAllocator`, the allocator without a producer
  (``anykpl fleet-allocator``).

This package re-exports the names the rest of anykpl, its tests and its benchmarks use.
"""

from ._allocation import HEADROOM as HEADROOM
from ._allocation import Allocator as Allocator
from ._allocation import ObservedReport as ObservedReport
from ._allocation import allocate_dimension as allocate_dimension
from ._allocation import in_force as in_force
from ._allocation import water_fill as water_fill
from ._clock import ServerClock as ServerClock
from ._demand import DemandEstimator as DemandEstimator
from ._demand import FleetDemand as FleetDemand
from ._documents import MAX_DOCUMENT_BYTES as MAX_DOCUMENT_BYTES
from ._documents import DocumentError as DocumentError
from ._documents import GrantsDocument as GrantsDocument
from ._documents import LeaseDocument as LeaseDocument
from ._documents import Outstanding as Outstanding
from ._documents import WorkerEntry as WorkerEntry
from ._documents import WorkerReport as WorkerReport
from ._documents import lease_expiry as lease_expiry
from ._documents import parse_grants as parse_grants
from ._documents import parse_lease as parse_lease
from ._documents import parse_report as parse_report
from ._rates import Rates as Rates
from ._standalone_allocator import FleetAllocator as FleetAllocator
from ._statistics import FleetStatistics as FleetStatistics
from ._worker import FleetWorker as FleetWorker
from ._worker_state import LEFTOVER_LEASES as LEFTOVER_LEASES
from ._worker_state import WorkerState as WorkerState
from ._worker_state import budget_share as budget_share

__all__ = (
    "HEADROOM",
    "LEFTOVER_LEASES",
    "MAX_DOCUMENT_BYTES",
    "Allocator",
    "DemandEstimator",
    "DocumentError",
    "FleetAllocator",
    "FleetDemand",
    "FleetStatistics",
    "FleetWorker",
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
    "budget_share",
    "in_force",
    "lease_expiry",
    "parse_grants",
    "parse_lease",
    "parse_report",
    "water_fill",
)
