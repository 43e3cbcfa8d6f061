"""Producer configuration: :class:`ProducerConfig`, frozen and validated, and the KPL's
``.properties`` files, read by :meth:`ProducerConfig.from_kpl_properties`.

Ported from the KPL's ``KinesisProducerConfiguration.java`` (whose setters hold the validation
that counts; ``aws/kinesis/core/configuration.h`` repeats the same ranges) and from the sample
``default_config.properties``. Field names are the snake_case of the KPL property names, and the
defaults and bounds are the KPL's, except where we deliberately differ:

* **Durations are float seconds**, not integer milliseconds. ``from_kpl_properties`` converts the
  KPL's milliseconds, so ``RecordTtl = 30000`` becomes ``record_ttl=30.0``.
* **rate_limit defaults to 100 %, not 150 %.** The KPL overshoots on purpose and lets the service
  throttle the excess; we send exactly a shard's capacity. The field's documentation says why.
* **record_ttl is clamped to ten years.** The KPL converts the TTL to nanoseconds on a signed
  64-bit steady clock, so values above about 9.2e12 ms overflow and every record expires at
  once (KPL issues #54 and #56, open PR #145). We accept any large value, including ``math.inf``,
  and store at most ten years, which keeps deadline arithmetic finite.
* **collection_max_size is capped at 5 MiB**, the PutRecords request limit. The KPL accepts up
  to 2^63-1 bytes, but the service rejects any request over 5 MiB.
* **region is None instead of ""** when not set. It then comes from botocore's usual chain
  (environment, shared config, instance metadata), not only from EC2 instance metadata.
* **Booleans in properties files must be "true" or "false"** (case-insensitive). Java's
  ``Boolean.valueOf`` silently reads any other word, "yes" included, as false; we raise
  :class:`~anykpl.errors.ConfigError` instead.
* Properties that only configure the Java wrapper, the native daemon or the C++ SDK are accepted
  and ignored. A warning is issued only when such a property has a value other than the KPL
  default, because only then did the file ask for something we do not do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, get_args
from urllib.parse import urlsplit

from ._core._limits import (
    DEFAULT_MAX_RECORD_SIZE,
    LARGEST_MAX_RECORD_SIZE,
    MAX_PARTITION_KEY_LENGTH,
    MAX_TENANT_LENGTH,
    MIN_SPOOL_BYTES,
    PUT_RECORDS_MAX_BYTES,
    PUT_RECORDS_MAX_RECORDS,
)
from ._kpl_properties import KPL_PROPERTY_NAMES as KPL_PROPERTY_NAMES
from ._kpl_properties import read_kpl_properties
from .errors import ConfigError

__all__ = ("FleetConfig", "ProducerConfig", "StreamSettings", "TenantQuota")

HttpBackend = Literal["auto", "aiohttp", "httpx"]
WireProtocol = Literal["json", "cbor", "auto"]
TenantOverflow = Literal["wait", "reject"]
SpoolFsync = Literal["off", "commit", "interval"]
MetricsLevel = Literal["none", "summary", "detailed"]
MetricsGranularity = Literal["global", "stream", "shard"]

#: The KPL validates its long-valued properties against Java's Long.MAX_VALUE.
_INT64_MAX: Final = 2**63 - 1
#: RecordMaxBufferedTime's KPL maximum, Long.MAX_VALUE milliseconds, in seconds.
_MAX_MILLISECONDS_IN_SECONDS: Final = _INT64_MAX / 1000
#: record_ttl values above this are stored as this (see the module docstring).
_RECORD_TTL_CLAMP: Final = 10 * 365.25 * 24 * 3600.0
#: The KPL's Region pattern (KinesisProducerConfiguration.setRegion).
_REGION_PATTERN: Final = re.compile(r"[a-z]+-([a-z]+-)?[a-z]+-[0-9]")
#: Fields whose values never appear in a repr or an error message.
_SECRET_FIELDS: Final = frozenset({"aws_secret_access_key", "aws_session_token"})
#: Integers with more digits than this are described ("<an integer of 5000 digits>"), not
#: printed, in error messages and reprs. Python refuses to print an int of more than 4,300
#: digits (sys.get_int_max_str_digits) at all.
_MAX_SHOWN_DIGITS: Final = 50


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantQuota:
    """One tenant's share of the producer: a token bucket in records and bytes per second.

    A dimension left at ``None`` is not limited. ``burst`` is how many seconds of the rate the
    bucket holds (a tenant that was idle may send that much at once). Validated when built;
    an invalid value raises :class:`~anykpl.errors.ConfigError`.

    Attributes:
        records_per_second: user records per second, > 0, or ``None`` (unlimited).
        bytes_per_second: bytes (data + partition key) per second, > 0, or ``None``.
        burst: seconds of the rate the bucket holds, 0.001..3600. Default 1.0.
    """

    records_per_second: float | None = None
    bytes_per_second: float | None = None
    burst: float = 1.0

    def __post_init__(self) -> None:
        for name in ("records_per_second", "bytes_per_second"):
            if getattr(self, name) is not None:
                _check_number(self, name, 0.0, None, unit="per second", open_low=True)
        _check_number(self, "burst", 0.001, 3600.0)

    def describe(self) -> str:
        """The quota in words, as error messages give it: ``"100 records/s, 10000 bytes/s,
        burst 1 s"``."""
        parts = []
        if self.records_per_second is not None:
            parts.append(f"{self.records_per_second:g} records/s")
        if self.bytes_per_second is not None:
            parts.append(f"{self.bytes_per_second:g} bytes/s")
        parts.append(f"burst {self.burst:g} s")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSettings:
    """Settings of one stream that differ from the producer's (``ProducerConfig.streams``);
    ``None`` keeps the producer's value. Each is validated as the producer's field of the same
    name, together with the producer's other fields (``record_ttl`` against
    ``record_max_buffered_time``, and so on).

    Attributes:
        record_max_buffered_time: see :class:`ProducerConfig`.
        record_ttl: see :class:`ProducerConfig`.
        aggregation_enabled: see :class:`ProducerConfig`.
        aggregation_max_count: see :class:`ProducerConfig`.
        aggregation_max_size: see :class:`ProducerConfig`.
        collection_max_count: see :class:`ProducerConfig`.
        collection_max_size: see :class:`ProducerConfig`.
        rate_limit: see :class:`ProducerConfig`.
        fail_if_throttled: see :class:`ProducerConfig`.
        max_outstanding_time: see :class:`ProducerConfig`.
        adaptive: see :class:`ProducerConfig`.
        adaptive_batching: see :class:`ProducerConfig`.
    """

    record_max_buffered_time: float | None = None
    record_ttl: float | None = None
    aggregation_enabled: bool | None = None
    aggregation_max_count: int | None = None
    aggregation_max_size: int | None = None
    collection_max_count: int | None = None
    collection_max_size: int | None = None
    rate_limit: float | None = None
    fail_if_throttled: bool | None = None
    max_outstanding_time: float | None = None
    adaptive: bool | None = None
    adaptive_batching: bool | None = None

    def overrides(self) -> dict[str, Any]:
        """The settings given (not ``None``), by field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """A fleet-wide cap shared by every producer that names the same store — an S3
    ``bucket`` or a DynamoDB ``table`` — and ``prefix`` (see ``docs/fleet.md``).

    Attributes:
        bucket: the S3 bucket holding the coordination objects (it must exist). Give it or
            ``table``, not both. Default ``None``.
        table: the DynamoDB table holding them instead (it must exist: ``anykpl fleet-table
            create`` makes one). Default ``None``.
        prefix: key prefix of the coordination objects (in a table, the partition key of the
            fleet's items). Default ``"anykpl-fleet"``.
        records_per_second: the fleet's cap in Kinesis records per second (as the service
            counts them: an aggregate is one record), or ``None``.
        bytes_per_second: the fleet's cap in bytes per second (data + partition keys of the
            Kinesis records), or ``None``. At least one of the two caps must be given.
        sync_interval: seconds between a worker's demand reports (with ±10 % jitter), and
            between the allocator's grants. Default 5.0, 0.05..300.
        worker_id: this producer's name in the fleet, unique to this process: two processes
            with one name share one grant, and each applies it whole. Default ``None``: a
            random one.
        lease: seconds an allocator's lease and its grants last. Default ``None``: three
            sync intervals; at least two, at most 3600 s (a grant must outlive the interval
            until its worker reads the next one, jitter and S3's one-second clock included).
        endpoint_url: the store's endpoint (S3's or DynamoDB's), such as the emulator's URL.
            Default ``None``: the service's endpoint for the producer's region.
        elect: whether this producer may take the allocator's role. Default ``True``; set
            ``False`` when ``anykpl fleet-allocator`` runs the allocator.
        safe_fraction: a worker whose grant expired without a newer one (S3 unreachable, no
            allocator) may keep up to the cap × this fraction ÷ the fleet size it last knew,
            but no more than its last grant, beside its budget rate: the fleet may then exceed
            its cap while a member is cut off. Default 0.0 (off: the cap holds), 0..1.
        bootstrap_fraction: the fleet's bootstrap budget, as a fraction of the cap: the
            workers outside a grant (starting, or cut off) share it by rank, and the grants
            share the rest of the cap. Default 0.04, 0..1 (open at both ends).
    """

    bucket: str | None = None
    table: str | None = None
    prefix: str = "anykpl-fleet"
    records_per_second: float | None = None
    bytes_per_second: float | None = None
    sync_interval: float = 5.0
    worker_id: str | None = None
    lease: float | None = None
    endpoint_url: str | None = None
    elect: bool = True
    safe_fraction: float = 0.0
    bootstrap_fraction: float = 0.04

    def __post_init__(self) -> None:
        if (self.bucket is None) == (self.table is None):
            _fail("bucket", self.bucket, "an S3 bucket, or else a DynamoDB table (one of the two)")
        if self.bucket is not None:
            _check_str(self, "bucket", 3, 63)
        else:
            _check_str(self, "table", 3, 255)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(self.table)):
                _fail("table", self.table, "a DynamoDB table name: 3..255 of A-Z a-z 0-9 _ . -")
        _check_str(self, "prefix", 1, 512)
        for name in ("records_per_second", "bytes_per_second"):
            if getattr(self, name) is not None:
                _check_number(self, name, 0.0, None, unit="per second", open_low=True)
        if self.records_per_second is None and self.bytes_per_second is None:
            _fail("records_per_second", None, "a cap in records_per_second or bytes_per_second")
        interval = _check_number(self, "sync_interval", 0.05, 300.0)
        if self.worker_id is not None:
            _check_str(self, "worker_id", 1, 128)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.worker_id):
                _fail("worker_id", self.worker_id, "None or 1..128 of A-Z a-z 0-9 _ . -")
        if self.lease is None:
            object.__setattr__(self, "lease", 3 * interval)
        else:
            _check_number(self, "lease", 2 * interval, 3600.0)
        _check_endpoint_url(self)
        _check_bool(self, "elect")
        _check_number(self, "safe_fraction", 0.0, 1.0, unit="fraction")
        _check_number(self, "bootstrap_fraction", 0.0, 1.0, unit="fraction", open_low=True)
        if self.bootstrap_fraction >= 1.0:  # the grants would have nothing to share
            _fail("bootstrap_fraction", self.bootstrap_fraction, "a fraction in (0, 1)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerConfig:
    """Everything a :class:`~anykpl.Producer` can be configured with: frozen and validated.

    Every value is checked when the object is built; an invalid one raises
    :class:`~anykpl.errors.ConfigError` naming the field, the value and what is allowed. Types
    are checked too: boolean fields take only ``True`` or ``False``; integer fields take ``int``
    (not ``bool``) or a ``float`` without a fractional part; duration and percentage fields take
    ``int`` or ``float`` (never NaN). Durations are seconds. Build a changed copy with
    :meth:`replace`, or read a KPL ``.properties`` file with :meth:`from_kpl_properties`.

    Attributes:
        region: AWS region to send to, such as ``"us-east-1"``. Default ``None``: botocore's
            chain decides (``AWS_REGION``/``AWS_DEFAULT_REGION``, the shared config, instance
            metadata). When given it must match the KPL's pattern
            ``^([a-z]+-([a-z]+-)?[a-z]+-[0-9])?$``; ``""`` means ``None``. KPL: ``Region``.
        endpoint_url: Kinesis endpoint URL, such as ``"http://localhost:4567"`` for the
            emulator. Default ``None`` (the region's AWS endpoint). Must start with ``http://``
            or ``https://``. KPL: ``KinesisEndpoint`` and ``KinesisPort`` (host and port; the
            KPL always uses TLS).
        profile: Named profile from the shared AWS config files. Default ``None`` (botocore's
            default profile). Non-empty when given. No KPL property.
        aws_access_key_id: Explicit access key ID. Default ``None`` (botocore's credential
            chain). Given together with ``aws_secret_access_key``. No KPL property (the KPL
            takes a Java credentials provider).
        aws_secret_access_key: Explicit secret access key. Default ``None``. Given together with
            ``aws_access_key_id``. Never shown in ``repr`` or in error messages.
        aws_session_token: Session token for temporary credentials. Default ``None``. Needs the
            key ID and the secret. Never shown in ``repr`` or in error messages.
        verify_certificate: Verify the endpoint's TLS certificate. Default ``True``; do not turn
            it off in production. KPL: ``VerifyCertificate``.
        ca_bundle: Path of a PEM file of CA certificates to check the endpoint's certificate
            with (a ``str`` or a path object; it must be an existing file). Default ``None``:
            botocore's chain (``AWS_CA_BUNDLE``, the profile's ``ca_bundle``), then certifi's
            bundle. Ignored when ``verify_certificate`` is ``False``. A directory of
            certificates is refused: aiobotocore loads one file (concatenate the PEM files).
            KPL: ``CaCertFile`` (``CaCertPath``, a directory, is not supported).
        http_backend: HTTP client under aiobotocore: ``"aiohttp"``, ``"httpx"``, or ``"auto"``
            (the default: aiohttp under asyncio, httpx under trio, where aiohttp cannot run;
            and the PutRecords requests anykpl signs itself, every one after a stream's first,
            go through anykpl's own HTTP/1.1 client, a fifth to a tenth of the CPU per
            request, unless a proxy applies). Naming ``"aiohttp"`` or ``"httpx"`` sends every
            request through that session. No KPL property.
        wire_protocol: How PutRecords (and ListShards) bodies are written: ``"auto"`` (the
            default: Kinesis's CBOR protocol where the endpoint is shown to take it, JSON
            elsewhere), ``"cbor"`` (``application/x-amz-cbor-1.1``, what the AWS SDK for Java
            sends: each record's data as raw bytes, a request about a quarter smaller and no
            base64) or ``"json"`` (each record's data in base64, what botocore sends). With
            ``"auto"``, only AWS's endpoints and anykpl's emulator, which store CBOR data as
            sent, are asked: once per endpoint, a CBOR PutRecords to a stream that does not
            exist must come back as a CBOR error; every other endpoint (kinesalite parses CBOR
            but stores its data wrongly) stays JSON. A stream's first PutRecords and first
            ListShards go through botocore in JSON either way (anykpl learns the requests'
            route from them), and so does every request when anykpl cannot sign requests
            itself. Answers are read with ``cbor2``. ``docs/cbor.md``. No KPL property.
        proxy_url: HTTP proxy for every AWS call the producer makes (Kinesis, the fleet's S3,
            a ``CloudWatchSink``), such as ``"http://proxy.internal:3128"`` or
            ``"http://user:password@proxy.internal:3128"``: ``http://`` or ``https://`` (the
            scheme of the hop to the proxy; HTTPS endpoints are reached through it with
            ``CONNECT``). Default ``None``: botocore's environment (``HTTPS_PROXY``,
            ``HTTP_PROXY``, ``NO_PROXY``). Its password is never shown in ``repr`` or in
            error messages. KPL: ``ProxyHost``, ``ProxyPort``, ``ProxyUserName`` and
            ``ProxyPassword``.
        max_connections: Maximum parallel HTTP connections to Kinesis, the size of the
            connection pool. Default 24, 1..256. KPL: ``MaxConnections``.
        connect_timeout: Seconds allowed to open a connection, TLS included. Default 6.0,
            0.1..300. KPL: ``ConnectTimeout`` (milliseconds).
        request_timeout: Seconds allowed for a whole request, from sending to the last byte of
            the response. A timed-out PutRecords may still have succeeded, so retrying it can
            create duplicates: too low a value makes duplicates more likely. Default 6.0,
            0.1..600. KPL: ``RequestTimeout`` (milliseconds).
        aggregation_enabled: Pack several user records bound for the same predicted shard into
            one Kinesis record, in the KPL's aggregation format. Default ``True``.
            KPL: ``AggregationEnabled``.
        aggregation_max_count: Maximum user records in one aggregated record. Default
            4294967295, 1..2^63-1. KPL: ``AggregationMaxCount``.
        aggregation_max_size: Maximum bytes of one aggregated Kinesis record. A user record
            larger than this by itself is sent alone. Records put with a tenant are aggregated
            up to 16 KiB at most (one turn of a shard's fair queue, see docs/tenants.md).
            Default 51200, 64..10485760. Above 1048576 only for a stream whose maximum record
            size was raised (``CreateStream``'s or ``UpdateMaxRecordSize``'s
            ``MaxRecordSizeInKiB``, up to 10 MiB; per stream with ``streams``): the service
            refuses a larger record with ``ValidationException``,
            and its records fail. KPL: ``AggregationMaxSize``.
        collection_max_count: Maximum Kinesis records in one PutRecords request. Default 500,
            1..500. KPL: ``CollectionMaxCount``.
        collection_max_size: Maximum bytes (partition keys plus data) in one PutRecords request;
            a larger single record is still sent, alone. Default 5242880, 52224..5242880. The
            KPL allows up to 2^63-1; the service took at most 5 MiB per request until it took
            records up to 10 MiB, and its PutRecords reference now says 10 MiB. anykpl fills
            requests to 5 MiB, which every stream takes, and sends a larger record alone.
            KPL: ``CollectionMaxSize``.
        fail_if_throttled: Fail a throttled record (ProvisionedThroughputExceededException) at
            once instead of retrying it, so the application can react, for example by sending
            it elsewhere. Default ``False``. KPL: ``FailIfThrottled``.
        rate_limit: Per-shard cap on the send rate, as a percentage of the shard's write limits
            (1000 records/s and 1 MiB/s), applied to records and bytes alike. Default 100.0,
            1..2^63-1. KPL: ``RateLimit``, whose default is 150. The KPL's 150 % deliberately
            sends more than a shard accepts and relies on retries to make up for what the
            service throttles; every throttled record costs bandwidth and CPU, and each retry
            risks reordering and duplicates. We would rather have a lone producer send exactly
            the shard's capacity (our bar is at least 97 % of a shard with zero throttled
            records) and leave overshoot to users who set 150 explicitly.
        record_max_buffered_time: Longest time, in seconds, a record may wait in the producer
            to be batched before it is sent; records go sooner when a batch fills up. It also
            sets the retry deadline (half of it) and the Collector's deadline extension.
            Default 0.1, 0..9.2e15 (2^63-1 ms). KPL: ``RecordMaxBufferedTime`` (milliseconds).
        record_ttl: Seconds a record may take, retries included, before it fails as
            ``Expired``. Default 30.0, at least 0.1, no upper bound: values above ten years
            (``math.inf`` included) are stored as ten years, so huge values mean "retry
            forever" without overflowing, unlike the KPL, which expired every record at once
            above about 9.2e12 ms. KPL: ``RecordTtl`` (milliseconds).
        max_user_record_size: Largest user record accepted, in bytes: its data plus its
            partition key (UTF-8), as the service counts a record against its limit (the KPL's
            Java check counts the data alone). Raise it only for streams configured with a
            larger maximum record size. Default 1048576, 64..10485760. KPL:
            ``MaxUserRecordSize``.
        metrics_level: Which metrics are uploaded to the metrics sinks: ``"none"``,
            ``"summary"`` or ``"detailed"``. Default ``"detailed"``. ``producer.metrics()`` and
            ``statistics()`` always see every metric. KPL: ``MetricsLevel``.
        metrics_granularity: Deepest dimension uploaded to the metrics sinks: ``"global"``,
            ``"stream"`` or ``"shard"``. Default ``"shard"``. KPL: ``MetricsGranularity``.
        metrics_namespace: CloudWatch namespace for the metrics. Default
            ``"KinesisProducerLibrary"``, 1..255 characters, must not start with ``"AWS/"``.
            KPL: ``MetricsNamespace``.
        metrics_upload_delay: Seconds between uploads to the metrics sinks (there are none
            unless ``Producer(metrics_sinks=[...])`` names them). Default 60.0, 0.001..60.
            KPL: ``MetricsUploadDelay`` (milliseconds).
        min_connections: Accepted for compatibility and unused, as in the KPL, which sends it to
            its native code but never reads it. Default 1, 1..16. KPL: ``MinConnections``.
        max_outstanding_records: Most user records admitted and not yet finished; ``submit``
            and ``put_record`` wait for room beyond it (backpressure). Its last 20 % is kept
            for quiet shards, so that a hot partition key cannot take all of it
            (docs/admission.md). Default 100000, at least 1. No KPL property (the KPL's
            buffer is unbounded).
        max_outstanding_bytes: Most bytes of user data admitted and not yet finished, shared
            between shards as ``max_outstanding_records`` is. Default 134217728 (128 MiB), at
            least 1024. No KPL property.
        max_outstanding_time: Seconds of a shard's delivery that may be admitted and not yet
            finished: ``submit`` and ``put_record`` wait while the outstanding records of the
            record's own predicted shard would take longer than this to deliver at the rate
            the shard accepts now (its current rate in the Limiter, less throttles judged to
            be noise); records of other shards do not wait for it. Records whose shard is not
            known yet (the shard map loading) are held to the whole stream's delivery. This is
            what turns sustained overload into backpressure at the call rather than expiry
            later: a backlog a shard cannot send before ``record_ttl`` is never admitted.
            Default ``None``: half of ``record_ttl``. Greater than 0; ``math.inf`` turns it
            off. No KPL property.
        adaptive_batching: Send a stream's records at once while none of its PutRecords
            requests is in flight, and otherwise when the last one returns, a size limit
            fills, or ``record_max_buffered_time`` passes, whichever comes first (Nagle's
            rule). A service that awaits each ``put_record`` then waits about one round trip
            instead of the whole buffering time, and under load batches still fill, because
            requests are in flight. Records waiting for a shard's tokens keep gathering until
            their deadline. While the stream is at its capacity (two or more active shards
            using, together, 90 % of their rates) and its least mean latency (its
            outstanding records over what its shards can send) is at least a quarter of
            ``record_max_buffered_time``, records are paced so that every shard's records
            wait alike: each leaves no sooner than 80 % of that latency after its admission,
            at most ``record_max_buffered_time`` (docs/batching.md). Default ``True``;
            ``False`` is the KPL's batching (every record waits for its deadline unless a
            batch fills). No KPL property.
        admission_timeout: Seconds ``submit`` and ``put_record`` wait for room under the
            outstanding limits, and for their tenant's quota (``tenant_quotas``), before
            raising :class:`~anykpl.errors.BackpressureTimeout`; a put whose quota wait alone
            would be longer is refused at once. Default ``None`` (wait as long as it takes);
            greater than 0 when given. No KPL property.
        close_timeout: Seconds closing the producer spends flushing before it fails what is
            left. Default 30.0, at least 0. No KPL property.
        stream_idle_timeout: Seconds a stream may go without records, with nothing
            outstanding, before its pipeline (tasks, shard map, rate state) is closed; the
            next put for the stream opens it again (and lists its shards again). Default 300.0;
            ``None`` or ``inf`` keeps every stream open until the producer closes; greater
            than 0 when given. No KPL property (the KPL keeps every stream it has seen).
        retry_backoff_initial: Base, in seconds, of the per-shard exponential backoff with full
            jitter that spaces retries, on top of the rate limit. Default 0.05, 0..60. No KPL
            property (the KPL retries without backoff).
        retry_backoff_max: Ceiling, in seconds, of that backoff. Default 5.0, at least
            ``retry_backoff_initial``, finite. No KPL property.
        container_partition_key: Partition key of aggregated Kinesis records; the shard is
            chosen by the explicit hash key, so the key only matters to consumers that read it.
            Default ``"a"``, 1..256 characters. No KPL property (the KPL hard-codes ``"a"``).
        container_key_from_records: Give each aggregated Kinesis record the partition key of
            its first user record instead of ``container_partition_key``. Default ``False``.
            Lambda's ``ParallelizationFactor`` splits a shard's records by partition key: with
            one constant key every aggregate of a shard goes to one batch at a time, in order;
            with this on, aggregates spread over the concurrent batches, and the order of one
            user key's records across aggregates is no longer kept by Lambda (within an
            aggregate it is). The shard is still chosen by the explicit hash key. No KPL
            property.
        adaptive: Adaptive per-shard rate control: per-record throttles
            (ProvisionedThroughputExceeded) for a shard cut that shard's rate, which recovers
            toward the ``rate_limit`` ceiling while no throttles arrive (AIMD; see
            ``docs/adaptive.md``). Several producers sharing a stream then settle on a fair
            split instead of throttling each other. Default ``True``. No KPL property (the
            KPL's limiter is static).
        adaptive_decrease: The factor a congestion event multiplies the shard's rate by,
            applied to the lower of the current rate and the rate actually sent. Default 0.7
            (botocore's adaptive mode uses 0.7 too), 0.1..0.99.
        adaptive_increase: How fast a cut shard's rate recovers: a fraction of the ceiling per
            second right after the cut, twice that after 10 s without throttles, three times
            after 20 s, and so on (a producer that has the shard to itself again is back at
            the ceiling within about 40 s from the floor). Default 0.005, 0.001..10. Larger
            values recover faster and throttle more: N producers sharing a shard cause about
            N² × increase ÷ (1 − decrease) congestion events per second.
        adaptive_floor: The lowest rate a cut can reach, as a fraction of the ceiling; the
            shard keeps probing at this rate. Default 0.05, 0.001..1.
        adaptive_window: Seconds during which further throttles for a shard are the same
            congestion event as the one that cut it (throttles for requests sent before the
            cut never count again). Default 0.25, 0..60.
        retry_budget: Retries allowed per stream, as a share of successes: each PutRecords
            outcome that delivered records for a shard earns this many retries, each outcome
            whose records for a shard are retried spends one (not one per record), and 10
            more are earned per second whatever the traffic (at most 500 held). Once spent,
            failed records wait ``retry_backoff_max`` before they retry, so a storm cannot
            multiply the traffic; nothing fails because of it. Default 0.2, 0..100; ``None``
            turns the budget off.
        fleet: A fleet-wide cap shared with other producers through S3
            (:class:`FleetConfig`). Default ``None`` (no cap).
        tenant_quotas: Per-tenant quotas, tenant name → :class:`TenantQuota`, for records
            put with ``tenant=``. Default: none.
        default_tenant_quota: The quota of a tenant not in ``tenant_quotas``. Default
            ``None`` (such tenants are not limited, but still queue fairly).
        tenant_overflow: What a put over its tenant's quota does: ``"wait"`` for tokens (the
            default) or ``"reject"`` at once with :class:`~anykpl.errors.TenantQuotaExceeded`.
        spool_dir: A directory for the durable spool: every admitted record is written there
            before ``submit`` returns and stays until it is terminal, so records survive a
            crash or ``kill -9`` of the process; a producer opened on the directory later sends
            what it finds there first (see docs/spool.md). Created if missing; one producer at
            a time owns it. Default ``None`` (no spool: records live in memory only).
        spool_max_bytes: Most bytes of segment files the spool may hold; ``submit`` waits for
            room beyond it (backpressure, like ``max_outstanding_bytes``). Default 536870912
            (512 MiB), at least 4 MiB. Only with ``spool_dir``.
        spool_fsync: When the spool's files are synced to disk, which decides whether records
            also survive power loss (without a sync they survive the process, not the
            machine): ``"off"`` (the default: the kernel writes them back in its own time),
            ``"commit"`` (each ``submit`` returns once its record is synced; concurrent submits
            share one sync) or ``"interval"`` (every ``spool_fsync_interval`` seconds). What
            each costs is in docs/spool.md.
        spool_fsync_interval: Seconds between syncs with ``spool_fsync="interval"``. Default
            1.0, 0.001..3600.
        streams: Per-stream settings, stream name (or ARN, as given to ``put_record``) →
            :class:`StreamSettings`: record-level settings of that stream that differ from
            the fields above (buffering time, TTL, aggregation, collection, rate limit...).
            Default: none. No KPL property (the KPL has one configuration per producer).
    """

    # Connection / AWS
    region: str | None = None
    endpoint_url: str | None = None
    profile: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    verify_certificate: bool = True
    ca_bundle: str | None = None
    http_backend: HttpBackend = "auto"
    wire_protocol: WireProtocol = "auto"
    proxy_url: str | None = None
    max_connections: int = 24
    connect_timeout: float = 6.0
    request_timeout: float = 6.0

    # KPL pipeline
    aggregation_enabled: bool = True
    aggregation_max_count: int = 4294967295
    aggregation_max_size: int = 51200
    collection_max_count: int = PUT_RECORDS_MAX_RECORDS
    collection_max_size: int = PUT_RECORDS_MAX_BYTES
    fail_if_throttled: bool = False
    rate_limit: float = 100.0
    record_max_buffered_time: float = 0.1
    record_ttl: float = 30.0
    max_user_record_size: int = DEFAULT_MAX_RECORD_SIZE
    metrics_level: MetricsLevel = "detailed"
    metrics_granularity: MetricsGranularity = "shard"
    metrics_namespace: str = "KinesisProducerLibrary"
    metrics_upload_delay: float = 60.0
    min_connections: int = 1

    # Beyond the KPL
    max_outstanding_records: int = 100_000
    max_outstanding_bytes: int = 128 * 1024 * 1024
    max_outstanding_time: float | None = None
    adaptive_batching: bool = True
    admission_timeout: float | None = None
    close_timeout: float = 30.0
    stream_idle_timeout: float | None = 300.0
    retry_backoff_initial: float = 0.05
    retry_backoff_max: float = 5.0
    container_partition_key: str = "a"
    container_key_from_records: bool = False

    # Rate control beyond the KPL
    adaptive: bool = True
    adaptive_decrease: float = 0.7
    adaptive_increase: float = 0.005
    adaptive_floor: float = 0.05
    adaptive_window: float = 0.25
    retry_budget: float | None = 0.2
    fleet: FleetConfig | None = None
    tenant_quotas: Mapping[str, TenantQuota] = field(default_factory=dict)
    default_tenant_quota: TenantQuota | None = None
    tenant_overflow: TenantOverflow = "wait"
    streams: Mapping[str, StreamSettings] = field(default_factory=dict)

    # The durable spool
    spool_dir: str | os.PathLike[str] | None = None
    spool_max_bytes: int = 512 * 1024 * 1024
    spool_fsync: SpoolFsync = "off"
    spool_fsync_interval: float = 1.0

    def __post_init__(self) -> None:
        # Connection / AWS
        region = _optional_str(self, "region", allow_empty=True)
        if region == "":
            object.__setattr__(self, "region", None)
        elif region is not None and not _REGION_PATTERN.fullmatch(region):
            _fail("region", region, "None or a region matching ^([a-z]+-([a-z]+-)?[a-z]+-[0-9])?$")
        _check_endpoint_url(self)
        _optional_str(self, "profile")
        _check_credentials(self)
        _check_bool(self, "verify_certificate")
        _check_ca_bundle(self)
        _check_choice(self, "http_backend", get_args(HttpBackend))
        _check_choice(self, "wire_protocol", get_args(WireProtocol))
        if self.wire_protocol != "json" and importlib.util.find_spec("cbor2") is None:
            _fail(
                "wire_protocol",
                self.wire_protocol,
                "'json', or 'cbor' and 'auto' with cbor2 installed (pip install cbor2)",
            )
        _check_proxy_url(self)
        _check_int(self, "max_connections", 1, 256)
        _check_number(self, "connect_timeout", 0.1, 300.0)
        _check_number(self, "request_timeout", 0.1, 600.0)

        # KPL pipeline
        _check_bool(self, "aggregation_enabled")
        _check_int(self, "aggregation_max_count", 1, _INT64_MAX)
        _check_int(self, "aggregation_max_size", 64, LARGEST_MAX_RECORD_SIZE)
        _check_int(self, "collection_max_count", 1, PUT_RECORDS_MAX_RECORDS)
        _check_int(self, "collection_max_size", 52224, PUT_RECORDS_MAX_BYTES)
        _check_bool(self, "fail_if_throttled")
        _check_bool(self, "adaptive_batching")
        _check_number(self, "rate_limit", 1.0, _INT64_MAX, unit="percent")
        _check_number(self, "record_max_buffered_time", 0.0, _MAX_MILLISECONDS_IN_SECONDS)
        ttl = _check_number(self, "record_ttl", 0.1, None, allow_inf=True)
        if ttl > _RECORD_TTL_CLAMP:
            object.__setattr__(self, "record_ttl", _RECORD_TTL_CLAMP)
        _check_int(self, "max_user_record_size", 64, LARGEST_MAX_RECORD_SIZE)
        _check_choice(self, "metrics_level", get_args(MetricsLevel))
        _check_choice(self, "metrics_granularity", get_args(MetricsGranularity))
        namespace = _check_str(self, "metrics_namespace", 1, 255)
        if namespace.startswith("AWS/"):
            _fail("metrics_namespace", namespace, 'a namespace that does not start with "AWS/"')
        _check_number(self, "metrics_upload_delay", 0.001, 60.0)
        _check_int(self, "min_connections", 1, 16)

        # Beyond the KPL
        _check_int(self, "max_outstanding_records", 1, None)
        _check_int(self, "max_outstanding_bytes", 1024, None)
        if self.max_outstanding_time is not None:
            _check_number(self, "max_outstanding_time", 0.0, None, allow_inf=True, open_low=True)
        if self.admission_timeout is not None:
            _check_number(self, "admission_timeout", 0.0, None, allow_inf=True, open_low=True)
        _check_number(self, "close_timeout", 0.0, None, allow_inf=True)
        if self.stream_idle_timeout is not None:
            _check_number(self, "stream_idle_timeout", 0.0, None, allow_inf=True, open_low=True)
        initial = _check_number(self, "retry_backoff_initial", 0.0, 60.0)
        backoff_max = _check_number(self, "retry_backoff_max", 0.0, None)
        if backoff_max < initial:
            _fail(
                "retry_backoff_max",
                backoff_max,
                f"a finite number of seconds >= retry_backoff_initial ({initial!r})",
            )
        _check_str(self, "container_partition_key", 1, MAX_PARTITION_KEY_LENGTH)
        _check_bool(self, "container_key_from_records")

        # Rate control beyond the KPL
        _check_bool(self, "adaptive")
        _check_number(self, "adaptive_decrease", 0.1, 0.99, unit="fraction")
        _check_number(self, "adaptive_increase", 0.001, 10.0, unit="fraction")
        _check_number(self, "adaptive_floor", 0.001, 1.0, unit="fraction")
        _check_number(self, "adaptive_window", 0.0, 60.0)
        if self.retry_budget is not None:
            _check_number(self, "retry_budget", 0.0, 100.0, unit="fraction")
        if self.fleet is not None and not isinstance(self.fleet, FleetConfig):
            _fail("fleet", self.fleet, "None or a FleetConfig")
        _check_tenant_quotas(self)
        _check_streams(self)
        if self.default_tenant_quota is not None and not isinstance(
            self.default_tenant_quota, TenantQuota
        ):
            _fail("default_tenant_quota", self.default_tenant_quota, "None or a TenantQuota")
        _check_choice(self, "tenant_overflow", get_args(TenantOverflow))

        # The durable spool
        spool_dir = self.spool_dir
        if spool_dir is not None and (
            not isinstance(spool_dir, (str, os.PathLike)) or not os.fspath(spool_dir)
        ):
            _fail("spool_dir", spool_dir, "None or a directory path (str or os.PathLike)")
        _check_int(self, "spool_max_bytes", MIN_SPOOL_BYTES, None)
        _check_choice(self, "spool_fsync", get_args(SpoolFsync))
        _check_number(self, "spool_fsync_interval", 0.001, 3600.0)

    def __repr__(self) -> str:
        # The dataclass repr, except that an integer too long to print is described instead
        # (max_outstanding_records and max_outstanding_bytes have no upper bound).
        shown = ", ".join(
            f"{f.name}={_shown(getattr(self, f.name))!r}"
            if f.name != "proxy_url" or self.proxy_url is None
            else f"proxy_url={_masked_url(self.proxy_url)!r}"
            for f in dataclasses.fields(self)
            if f.repr
        )
        return f"{type(self).__qualname__}({shown})"

    def for_stream(self, stream: str) -> ProducerConfig:
        """The configuration of ``stream``: this one with its :class:`StreamSettings` (from
        ``streams``) applied; this one when it has none."""
        settings = self.streams.get(stream)
        if settings is None:
            return self
        return dataclasses.replace(self, streams={}, **settings.overrides())

    def replace(self, **changes: Any) -> ProducerConfig:
        """Return a copy with ``changes`` applied, validated like a new object.

        Raises:
            ConfigError: a changed value is invalid.
            TypeError: a name in ``changes`` is not a field.
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kpl_properties(cls, path: str | os.PathLike[str], **overrides: Any) -> ProducerConfig:
        """Read a KPL ``.properties`` file, such as the KPL sample's
        ``default_config.properties``, into a :class:`ProducerConfig`.

        Every property name the KPL knows is accepted (see ``KPL_PROPERTY_NAMES``). Durations
        in milliseconds become seconds; ``KinesisEndpoint`` and ``KinesisPort`` become
        ``endpoint_url`` (``"https://host:port"``, or the endpoint as given plus the port when
        it already has an ``http://`` or ``https://`` scheme). Properties that configure only
        the KPL's Java wrapper or native daemon are ignored, with a :class:`UserWarning` when
        their value differs from the KPL default. Unknown properties are ignored with a
        :class:`UserWarning`. Fields missing from the file keep this class's defaults.

        The file follows ``java.util.Properties``: ``#`` and ``!`` comments, ``key=value``,
        ``key: value`` or ``key value``, backslash escapes and line continuations. It is read
        as UTF-8, or as ISO-8859-1 (Java's encoding for properties files) when it is not valid
        UTF-8. A stray ``;`` at the end of a value, as in the KPL sample's
        ``MaxUserRecordSize = 1048576;``, is tolerated.

        Args:
            path: the ``.properties`` file.
            **overrides: field values that win over the file's.

        Raises:
            ConfigError: a value is invalid; the message names the KPL property and the field.
            OSError: the file cannot be read.
        """
        values, sources = read_kpl_properties(Path(os.fspath(path)))
        values.update(overrides)
        for name in overrides:
            sources.pop(name, None)
        try:
            return cls(**values)
        except ConfigError as error:
            if error.field not in sources:
                raise
            source = sources[error.field]
            raise _config_error(
                error.field, error.value, f"{error.allowed} (from {source})"
            ) from None


# --- Validation helpers ---------------------------------------------------------------------


def _fail(name: str, value: object, allowed: str) -> NoReturn:
    raise _config_error(name, "<redacted>" if name in _SECRET_FIELDS else value, allowed)


class _Described:
    """Stands for a value in a repr or a message: shows a description of it instead."""

    __slots__ = ("_description",)

    def __init__(self, description: str) -> None:
        self._description = description

    def __repr__(self) -> str:
        return self._description


def _digit_count(number: int) -> int:
    """The decimal digits of ``abs(number)``, without converting it to a string."""
    number = abs(number)
    digits = max(int((number.bit_length() - 1) * math.log10(2)), 0)
    while 10**digits <= number:
        digits += 1
    return max(digits, 1)


def _shown(value: object) -> object:
    """``value``, or a description of it when it is an integer too long to print."""
    if isinstance(value, int) and value.bit_length() > 3 * _MAX_SHOWN_DIGITS:
        digits = _digit_count(value)
        if digits > _MAX_SHOWN_DIGITS:
            sign = "a negative" if value < 0 else "an"
            return _Described(f"<{sign} integer of {digits} digits>")
    return value


def _config_error(name: str, value: object, allowed: str) -> ConfigError:
    """A ConfigError whose message describes an integer too long to print; ``value`` keeps the
    value itself."""
    try:
        error = ConfigError(name, _shown(value), allowed)
    except ValueError:  # a container holding an integer too long to print
        error = ConfigError(name, _Described(f"<a {type(value).__name__}>"), allowed)
    error.value = value
    return error


def _format_bound(bound: float) -> str:
    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return repr(bound)


def _describe(kind: str, low: float, high: float | None, *, open_low: bool = False) -> str:
    if high is not None:
        return f"{kind} in {_format_bound(low)}..{_format_bound(high)}"
    return f"{kind} {'>' if open_low else '>='} {_format_bound(low)}"


def _check_bool(config: Any, name: str) -> None:
    value = getattr(config, name)
    if type(value) is not bool:
        _fail(name, value, "True or False")


def _check_int(config: Any, name: str, low: int, high: int | None) -> int:
    value = getattr(config, name)
    allowed = _describe("an integer", low, high)
    if isinstance(value, bool):
        _fail(name, value, allowed)
    if isinstance(value, float):
        if not value.is_integer():  # also rejects NaN and infinities
            _fail(name, value, allowed)
        number = int(value)
    elif isinstance(value, int):
        number = int(value)
    else:
        _fail(name, value, allowed)
    if number < low or (high is not None and number > high):
        _fail(name, value, allowed)
    object.__setattr__(config, name, number)
    return number


def _check_number(
    config: Any,
    name: str,
    low: float,
    high: float | None,
    *,
    unit: str = "seconds",
    allow_inf: bool = False,
    open_low: bool = False,
) -> float:
    value = getattr(config, name)
    kinds = {"percent": "a percentage", "fraction": "a fraction", "per second": "a rate"}
    kind = kinds.get(unit, f"a number of {unit}")
    if high is None and not allow_inf:
        kind = kind.replace("a ", "a finite ", 1)
    allowed = _describe(kind, low, high, open_low=open_low)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, allowed)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        _fail(name, value, allowed)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        _fail(name, value, allowed)
    # Compare with float(high): float(2**63 - 1) rounds up to 2**63, and must still pass.
    if number < low or (open_low and number == low) or (high is not None and number > float(high)):
        _fail(name, value, allowed)
    object.__setattr__(config, name, number)
    return number


def _check_str(config: Any, name: str, min_length: int, max_length: int) -> str:
    value = getattr(config, name)
    if not isinstance(value, str) or not min_length <= len(value) <= max_length:
        _fail(name, value, f"a string of {min_length}..{max_length} characters")
    return value


def _optional_str(config: Any, name: str, *, allow_empty: bool = False) -> str | None:
    value = getattr(config, name)
    if value is None:
        return None
    if not isinstance(value, str) or (value == "" and not allow_empty):
        _fail(name, value, "None or a non-empty string")
    return value


def _check_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if not isinstance(value, str) or value not in choices:
        _fail(name, value, "one of " + ", ".join(repr(choice) for choice in choices))


def _check_endpoint_url(config: Any) -> None:
    url = _optional_str(config, "endpoint_url")
    if url is None:
        return
    allowed = "None or an http:// or https:// URL with a host"
    if not url.startswith(("http://", "https://")):
        _fail("endpoint_url", url, allowed)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a malformed port)
    except ValueError:
        _fail("endpoint_url", url, allowed)
    if not parts.hostname:
        _fail("endpoint_url", url, allowed)


def _check_proxy_url(config: ProducerConfig) -> None:
    url: object = config.proxy_url
    if url is None:
        return
    allowed = "None or an http:// or https:// URL with a host (and a port in 1..65535)"
    if not isinstance(url, str):
        # a URL object (yarl's, pydantic's) would show its password: name its type instead
        shown = url if isinstance(url, (int, float)) else _Described(f"a {type(url).__name__}")
        _fail("proxy_url", shown, allowed)
    if _proxy_url_problem(url):
        _fail("proxy_url", _masked_url(url), allowed)


def _proxy_url_problem(url: str) -> bool:
    """Whether ``url`` is not a proxy URL anykpl takes (see ``proxy_url``)."""
    if not url.startswith(("http://", "https://")) or any(
        character.isspace() or not character.isprintable() for character in url
    ):
        return True
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return True
    return (
        not parts.hostname
        or port == 0
        or parts.path not in ("", "/")
        or bool(parts.query or parts.fragment)
    )


def _masked_url(url: str) -> str:
    """``url`` with the password of its user info, if any, replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a malformed URL>"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _check_ca_bundle(config: ProducerConfig) -> None:
    value = config.ca_bundle
    if value is None:
        return
    allowed = "None or the path of an existing PEM file of CA certificates"
    # a str or a path object, stored as a str (the config stays hashable and printable)
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path.strip():
        _fail("ca_bundle", value, allowed)
    # aiobotocore hands the path to SSLContext.load_verify_locations as cafile: a directory
    # (the KPL's CaCertPath, a libcurl CAPATH) fails there, at the first request
    if os.path.isdir(path):
        _fail(
            "ca_bundle",
            value,
            allowed + " (not a directory: aiobotocore loads one file; concatenate the "
            "certificates into one PEM file)",
        )
    if not os.path.isfile(path):
        _fail("ca_bundle", value, allowed)
    object.__setattr__(config, "ca_bundle", path)


def _check_tenant_quotas(config: ProducerConfig) -> None:
    quotas = config.tenant_quotas
    allowed = (
        f"a mapping of tenant names (1..{MAX_TENANT_LENGTH} characters) to TenantQuota objects"
    )
    if not isinstance(quotas, Mapping):
        _fail("tenant_quotas", quotas, allowed)
    for tenant, quota in quotas.items():
        if (
            not isinstance(tenant, str)
            or not 0 < len(tenant) <= MAX_TENANT_LENGTH
            or not isinstance(quota, TenantQuota)
        ):
            _fail("tenant_quotas", {tenant: quota}, allowed)
    # a read-only, hashable copy: the config is frozen (and hashable), and a caller's dict must
    # not change it later
    object.__setattr__(config, "tenant_quotas", _FrozenMapping(quotas))


def _check_streams(config: ProducerConfig) -> None:
    streams = config.streams
    allowed = "a mapping of stream names (or ARNs) to StreamSettings objects"
    if not isinstance(streams, Mapping):
        _fail("streams", streams, allowed)
    for stream, settings in streams.items():
        if not isinstance(stream, str) or not stream or not isinstance(settings, StreamSettings):
            _fail("streams", {stream: settings}, allowed)
        # each stream's settings are validated with the producer's other fields, as the
        # stream's pipeline will use them
        try:
            config.for_stream(stream)
        except ConfigError as error:
            raise _config_error(
                f"streams[{stream!r}].{error.field}", error.value, error.allowed
            ) from None
    object.__setattr__(config, "streams", _FrozenMapping(streams))


class _FrozenMapping(Mapping[str, Any]):
    """A read-only, hashable copy of a mapping."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _check_credentials(config: ProducerConfig) -> None:
    key_id = _optional_str(config, "aws_access_key_id")
    secret = _optional_str(config, "aws_secret_access_key")
    token = _optional_str(config, "aws_session_token")
    # botocore needs both halves of a key pair; a lone half would fail at the first request.
    if (key_id is None) != (secret is None):
        missing = "aws_access_key_id" if key_id is None else "aws_secret_access_key"
        other = "aws_secret_access_key" if key_id is None else "aws_access_key_id"
        _fail(missing, None, f"a non-empty string whenever {other} is set")
    if token is not None and key_id is None:
        _fail(
            "aws_access_key_id",
            None,
            "a non-empty string, with aws_secret_access_key, whenever aws_session_token is set",
        )
