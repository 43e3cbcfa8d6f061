"""Limits: the one source of truth for every number the service imposes, and for the
producer's own bounds on what it stores. The producer and the emulator both import these;
nothing else spells them out."""

from __future__ import annotations

from typing import Final

#: Per-shard write limits.
SHARD_RECORDS_PER_SECOND: Final = 1000
SHARD_BYTES_PER_SECOND: Final = 1024 * 1024

#: PutRecords request limits.
PUT_RECORDS_MAX_RECORDS: Final = 500
PUT_RECORDS_MAX_BYTES: Final = 5 * 1024 * 1024

#: The default maximum size of one record (data + partition key), and the largest a stream can
#: be configured to accept.
DEFAULT_MAX_RECORD_SIZE: Final = 1024 * 1024
LARGEST_MAX_RECORD_SIZE: Final = 10 * 1024 * 1024

#: Partition keys are 1..256 Unicode characters.
MAX_PARTITION_KEY_LENGTH: Final = 256

#: Hash keys are unsigned 128-bit integers.
MAX_HASH_KEY: Final = (1 << 128) - 1

#: The KPL's per-shard flush trigger in the Collector (aws/kinesis/core/collector.h).
COLLECTOR_SHARD_FLUSH_BYTES: Final = 256 * 1024

# -- the producer's own bounds -----------------------------------------------------------------

#: Tenant names (``put_record(..., tenant=...)`` and ``tenant_quotas``) are 1..256 characters.
MAX_TENANT_LENGTH: Final = 256

#: The smallest ``spool_max_bytes``: room for a few segments.
MIN_SPOOL_BYTES: Final = 4 * 1024 * 1024

#: A spool segment file is a sixteenth of ``spool_max_bytes``, within these bounds.
MIN_SEGMENT_BYTES: Final = 256 * 1024
MAX_SEGMENT_BYTES: Final = 4 * 1024 * 1024
