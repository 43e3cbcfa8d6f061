"""anykpl: a pure-Python port of the Amazon Kinesis Producer Library on anyio.

The package in layers (docs/architecture.md draws them; tests/test_layout.py keeps them):

- ``_core/``: the sans-IO core, what happens to a record, with time passed in and no event
  loop, network or SDK; exactly what the compiled build compiles. The stages, one module each
  (``_aggregator.py`` with the KPL's format in ``_wire.py``, ``_shard_map.py``, ``_limiter.py``
  with ``_token_bucket.py``, ``_shard_queue.py`` and ``_adaptive.py``, ``_collector.py``,
  ``_retrier.py``), the per-record part of admission (``_intake.py``), the records and their
  results (``_records.py``, ``_results.py``), the KPL's metrics (``_metrics.py``) and every
  limit (``_limits.py``).
- ``_runtime/``: the producer around the core: :class:`Producer` (``_producer.py``: lifecycle,
  flush, close), admission's waits (``_admission.py``, tenants in ``_tenants.py``), each
  stream's tasks (``_pipeline.py``, the Sender in ``_sender.py``, ListShards in
  ``_shard_refresh.py``), the handles (``_handle.py``: :class:`PendingRecord`; ``_batch.py``)
  and awaiting them (``_awaiting.py``), the durable spool (``_spool.py``) and the snapshots
  ``statistics()`` returns (``_statistics.py``).
- ``_transport/``: :class:`Transport` (``_protocol.py``), and the producer's own on
  aiobotocore (``_botocore.py``: request bodies, botocore's errors as codes, the only place
  they are seen; ``_aws.py`` makes every AWS client).
- ``_sync.py``: :class:`SyncProducer`, the blocking facade (a Producer in a portal thread).
- ``_fleet/``: fleet-wide caps through S3 or DynamoDB, a pure core and its async shell (its
  ``__init__`` maps it).
- ``_commands/``: the tools the ``anykpl`` command runs (demo, bench, the fleet's commands);
  the library never imports them.

Public modules: this package, :mod:`anykpl.errors` (imports nothing of the package),
:mod:`anykpl.config`, :mod:`anykpl.metrics`, :mod:`anykpl.aggregation` and
:mod:`anykpl.readback` (for consumers), :mod:`anykpl.schema_registry`, :mod:`anykpl.testing`
(the ``kinesis_emulator`` fixture) and :mod:`anykpl.emulator`.
"""

from . import errors as errors
from ._core._metrics import MetricKey as MetricKey
from ._core._metrics import MetricValue as MetricValue
from ._core._results import Attempt as Attempt
from ._core._results import RecordResult as RecordResult
from ._core._tenant_quotas import TenantStatistics as TenantStatistics
from ._fleet import FleetStatistics as FleetStatistics
from ._runtime._batch import BatchResult as BatchResult
from ._runtime._batch import PendingBatch as PendingBatch
from ._runtime._handle import PendingRecord as PendingRecord
from ._runtime._producer import Producer as Producer
from ._runtime._spool import SpoolStatistics as SpoolStatistics
from ._runtime._statistics import ProducerStatistics as ProducerStatistics
from ._runtime._statistics import ShardStatistics as ShardStatistics
from ._runtime._statistics import StreamStatistics as StreamStatistics
from ._sync import SyncProducer as SyncProducer
from ._transport._protocol import Transport as Transport
from .config import FleetConfig as FleetConfig
from .config import ProducerConfig as ProducerConfig
from .config import StreamSettings as StreamSettings
from .config import TenantQuota as TenantQuota

__version__ = "0.1.0.dev0"

__all__ = (
    "Attempt",
    "BatchResult",
    "FleetConfig",
    "FleetStatistics",
    "MetricKey",
    "MetricValue",
    "PendingBatch",
    "PendingRecord",
    "Producer",
    "ProducerConfig",
    "ProducerStatistics",
    "RecordResult",
    "ShardStatistics",
    "SpoolStatistics",
    "StreamSettings",
    "StreamStatistics",
    "SyncProducer",
    "TenantQuota",
    "TenantStatistics",
    "Transport",
    "errors",
)

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("anykpl._"):
        _obj.__module__ = "anykpl"
del _name, _obj
