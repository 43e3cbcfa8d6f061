"""anykpl: a pure-Python port of the Amazon Kinesis Producer Library on anyio.

General layout (one private module per stage; follow a record top to bottom):

- ``_producer.py``: the :class:`Producer` facade — validation, admission (backpressure),
  flush, close, idle streams; it asks its pipelines, never their stages.
- ``_pipeline.py``: one stream's stages, the anyio memory object streams between them, their
  task group, and the stream's statistics (``_statistics.py`` holds every snapshot type).
- ``_aggregator.py``: user records → Kinesis records per predicted shard (``_wire.py`` is the
  KPL aggregation format).
- ``_shard_map.py``: ListShards cache and shard prediction.
- ``_limiter.py``: per-shard token buckets (``_token_bucket.py``), adaptive control
  (``_adaptive.py``).
- ``_collector.py``: Kinesis records → PutRecords requests.
- ``_sender.py``: the Kinesis transport, the only place botocore errors are seen; ``_aws.py``
  makes every AWS client.
- ``_retrier.py``: outcome classification, results, retries with backoff.
- ``_records.py``: :class:`PendingRecord`, :class:`RecordResult`, :class:`Attempt`;
  ``_batch.py``: :class:`PendingBatch` and :class:`BatchResult`, ``submit_many``'s handle.
- ``_sync.py``: :class:`SyncProducer`, the blocking facade (a Producer in a portal thread).
- ``_metrics.py``: the KPL's metrics, counted in process; ``metrics/`` (public): the upload
  task and the sinks that ship them (``MetricsSink``, ``CloudWatchSink``, ``PrometheusSink``,
  ``OpenTelemetrySink``), one module each.
- ``_limits.py``: Kinesis service limits, the one source of each number.
- ``_intake.py``: the per-record part of admission (validation, room, enqueue, finish).
- ``_spool.py``: the durable spool (``spool_dir``): segment files on disk, recovery.
- ``_tenants.py``: tenant quotas (per-tenant token buckets with reservations), checked at
  admission.
- ``_fleet/``: fleet-wide caps shared through S3 — pure allocation, documents and worker
  state, and the async shell (:class:`FleetWorker`, one per producer with a ``FleetConfig``;
  :class:`FleetAllocator`, run standalone by ``fleet_allocator.py``, the
  ``anykpl fleet-allocator`` command). Its ``__init__`` maps it.

Public modules: this package, :mod:`anykpl.errors`, :mod:`anykpl.config` and
:mod:`anykpl.metrics`. Tools users run live apart (``emulator/``, ``demo/``, ``bench/``,
``cli.py``); the core never imports them.
"""

from . import errors as errors
from ._core._metrics import MetricKey as MetricKey
from ._core._metrics import MetricValue as MetricValue
from ._core._records import PendingRecord as PendingRecord
from ._core._results import Attempt as Attempt
from ._core._results import RecordResult as RecordResult
from ._fleet import FleetStatistics as FleetStatistics
from ._runtime._batch import BatchResult as BatchResult
from ._runtime._batch import PendingBatch as PendingBatch
from ._runtime._producer import Producer as Producer
from ._runtime._spool import SpoolStatistics as SpoolStatistics
from ._runtime._statistics import ProducerStatistics as ProducerStatistics
from ._runtime._statistics import ShardStatistics as ShardStatistics
from ._runtime._statistics import StreamStatistics as StreamStatistics
from ._runtime._tenants import TenantStatistics as TenantStatistics
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
