"""The CloudWatch sink: :class:`CloudWatchSink`, ``PutMetricData`` with statistic sets, as the
KPL uploads its metrics (``aws/metrics/metrics_manager.cc``), and the batching that keeps each
call within the KPL's limits (:func:`cloudwatch_batches`).

The aiobotocore client comes from the producer's factory (``anykpl/_transport/_aws.py``),
imported when the sink opens, so ``import anykpl`` never loads the SDK for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote_plus

from .._core._metrics import MetricValue
from ._sink import MetricsReport

if TYPE_CHECKING:
    from ..config import ProducerConfig

__all__ = (
    "CLOUDWATCH_MAX_DATUMS",
    "CLOUDWATCH_MAX_PAYLOAD",
    "CloudWatchSink",
    "cloudwatch_batches",
    "cloudwatch_datum",
    "estimated_size",
    "request_size",
)

logger = logging.getLogger("anykpl.metrics")


#: The KPL's limits per PutMetricData call (metrics_manager.cc): at most 20 metric data and
#: about 38 KiB of payload. CloudWatch now accepts 1000 data and 1 MB, but these work with every
#: endpoint (older regions, emulators) and keep each call small.
CLOUDWATCH_MAX_DATUMS: Final = 20
CLOUDWATCH_MAX_PAYLOAD: Final = 38 * 1024


#: A query-encoded timestamp, the longest form: ``2026-11-21T10%3A00%3A00.123456Z``.
_TIMESTAMP_SIZE: Final = 32


def _pair_size(key: str, value: object) -> int:
    """``&key=value``, form-encoded."""
    return 2 + len(key) + len(quote_plus(str(value)))


def request_size(namespace: str) -> int:
    """``Action=PutMetricData&Version=2010-08-01&Namespace=...``."""
    return (
        _pair_size("Action", "PutMetricData")
        + _pair_size("Version", "2010-08-01")
        + _pair_size("Namespace", namespace)
        - 1
    )


def estimated_size(datum: Mapping[str, Any], index: int = 1000) -> int:
    """A datum's size in the query protocol's form encoding (the largest of CloudWatch's
    encodings; botocore now sends CBOR, about 30 % smaller), as the ``index``-th datum of a
    request. Exact but for the timestamp, counted at its longest."""
    prefix = f"MetricData.member.{index}."
    size = _pair_size(prefix + "MetricName", datum["MetricName"])
    if "Dimensions" in datum and not datum["Dimensions"]:
        size += _pair_size(prefix + "Dimensions", "")  # an empty list is still sent
    for number, dimension in enumerate(datum.get("Dimensions", ()), 1):
        stem = f"{prefix}Dimensions.member.{number}."
        size += _pair_size(stem + "Name", dimension["Name"])
        size += _pair_size(stem + "Value", dimension["Value"])
    if "Timestamp" in datum:
        size += 2 + len(prefix) + len("Timestamp") + _TIMESTAMP_SIZE
    for name, value in datum.get("StatisticValues", {}).items():
        size += _pair_size(f"{prefix}StatisticValues.{name}", value)
    if "Value" in datum:
        size += _pair_size(prefix + "Value", datum["Value"])
    if "Unit" in datum:
        size += _pair_size(prefix + "Unit", datum["Unit"])
    return size


def cloudwatch_batches(
    data: Sequence[Mapping[str, Any]],
    max_datums: int = CLOUDWATCH_MAX_DATUMS,
    max_payload: int = CLOUDWATCH_MAX_PAYLOAD,
    namespace: str = "KinesisProducerLibrary",
) -> list[list[Mapping[str, Any]]]:
    """Split metric data into PutMetricData calls of ≤ ``max_datums`` data and ≤
    ``max_payload`` bytes of query-encoded body (``namespace`` included)."""
    batches: list[list[Mapping[str, Any]]] = []
    batch: list[Mapping[str, Any]] = []
    empty = size = request_size(namespace)
    for datum in data:
        datum_size = estimated_size(datum, len(batch) + 1)
        if batch and (len(batch) >= max_datums or size + datum_size > max_payload):
            batches.append(batch)
            batch, size = [], empty
            datum_size = estimated_size(datum, 1)
        batch.append(datum)
        size += datum_size
    if batch:
        batches.append(batch)
    return batches


def cloudwatch_datum(value: MetricValue, timestamp: datetime) -> dict[str, Any]:
    """One ``MetricDatum`` with a ``StatisticValues`` statistic set."""
    return {
        "MetricName": value.name,
        "Dimensions": [{"Name": name, "Value": v} for name, v in value.dimensions],
        "Timestamp": timestamp,
        "StatisticValues": {
            "SampleCount": float(value.count),
            "Sum": float(value.sum),
            "Minimum": float(value.min),
            "Maximum": float(value.max),
        },
        "Unit": value.unit,
    }


class CloudWatchSink:
    """Uploads the metrics to CloudWatch like the KPL: ``PutMetricData`` with statistic sets
    (``SampleCount``, ``Sum``, ``Minimum``, ``Maximum``), at most 20 data and about 38 KiB per
    call, in ``namespace`` (default: the config's ``metrics_namespace``).

    The aiobotocore client takes the producer's region, profile, credentials, TLS verification,
    timeouts and HTTP backend, unless the sink has its own: ``region``, and ``profile`` or keys
    (``aws_access_key_id`` with ``aws_secret_access_key``, and ``aws_session_token`` for
    temporary ones) — the KPL's ``MetricsCredentialsProvider``, for metrics that go to another
    account or role. Given a profile or keys, the sink uses those alone (none of the producer's
    credentials). ``endpoint_url`` is CloudWatch's own endpoint (the KPL's
    ``CloudwatchEndpoint``/``CloudwatchPort``); default ``None``: botocore's chain
    (``AWS_ENDPOINT_URL_CLOUDWATCH``, then the region's endpoint) — never the Kinesis
    ``endpoint_url``. Failed calls are logged on ``anykpl.metrics`` and counted in
    :attr:`failures`; the data of a failed call is dropped, as the KPL drops it.

    After a connection-level failure (the endpoint unreachable, a timeout) the rest of that
    upload is dropped with one log line rather than tried call after call.

    Attributes:
        calls: successful PutMetricData calls.
        failures: failed PutMetricData calls.
        data_sent: metric data uploaded.
        data_dropped: metric data dropped (failed calls and the rest of their upload).
    """

    def __init__(
        self,
        *,
        namespace: str | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        max_datums: int = CLOUDWATCH_MAX_DATUMS,
        max_payload: int = CLOUDWATCH_MAX_PAYLOAD,
    ) -> None:
        if not 1 <= max_datums <= 1000:
            raise ValueError(f"max_datums must be in 1..1000, got {max_datums}")
        if (aws_access_key_id is None) != (aws_secret_access_key is None):
            raise ValueError(
                "CloudWatchSink needs aws_access_key_id and aws_secret_access_key together"
            )
        if aws_session_token is not None and aws_access_key_id is None:
            raise ValueError("CloudWatchSink's aws_session_token needs its keys as well")
        for name, value in (
            ("profile", profile),
            ("aws_access_key_id", aws_access_key_id),
            ("aws_secret_access_key", aws_secret_access_key),
            ("aws_session_token", aws_session_token),
        ):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"CloudWatchSink's {name} must be a non-empty string or None")
        self.profile = profile
        self.aws_access_key_id = aws_access_key_id
        # the secrets stay out of repr and vars() listings of public attributes
        self._secret_access_key = aws_secret_access_key
        self._session_token = aws_session_token
        if namespace is not None and (not 1 <= len(namespace) <= 255 or namespace[:4] == "AWS/"):
            raise ValueError(f"invalid CloudWatch namespace {namespace!r}")
        self.namespace = namespace
        self.endpoint_url = endpoint_url
        self.region = region
        self.max_datums = max_datums
        self.max_payload = max_payload
        self.calls = 0
        self.failures = 0
        self.data_sent = 0
        self.data_dropped = 0
        self._client: Any = None
        self._namespace = namespace or "KinesisProducerLibrary"

    def __repr__(self) -> str:
        return f"<CloudWatchSink namespace={self._namespace!r} endpoint={self.endpoint_url!r}>"

    @asynccontextmanager
    async def open(self, config: ProducerConfig) -> AsyncIterator[None]:
        from .._transport._aws import create_client

        self._namespace = self.namespace or config.metrics_namespace
        if self.profile is not None or self.aws_access_key_id is not None:
            # its own credentials (MetricsCredentialsProvider), none of the producer's
            config = dataclasses.replace(
                config,
                profile=self.profile,
                aws_access_key_id=self.aws_access_key_id,
                aws_secret_access_key=self._secret_access_key,
                aws_session_token=self._session_token,
            )
        async with create_client(
            config,
            "cloudwatch",
            max_pool_connections=2,
            region=self.region,
            endpoint_url=self.endpoint_url,
        ) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def publish(self, report: MetricsReport) -> None:
        if self._client is None or not report.values:
            return
        from botocore.exceptions import ConnectionError, HTTPClientError

        data = [cloudwatch_datum(value, report.timestamp) for value in report.values]
        batches = cloudwatch_batches(data, self.max_datums, self.max_payload, self._namespace)
        for number, batch in enumerate(batches):
            try:
                await self._client.put_metric_data(Namespace=self._namespace, MetricData=batch)
            except (ConnectionError, HTTPClientError) as exc:
                # the endpoint is unreachable: the rest of this upload would only fail the
                # same way, one log line each (the next upload tries again)
                dropped = sum(len(rest) for rest in batches[number:])
                self.failures += 1
                self.data_dropped += dropped
                logger.warning(
                    "PutMetricData failed, %d metric data of this upload dropped (%d call(s) "
                    "not attempted): %s: %s",
                    dropped,
                    len(batches) - number - 1,
                    type(exc).__name__,
                    exc,
                )
                return
            except Exception as exc:
                self.failures += 1
                self.data_dropped += len(batch)
                logger.warning(
                    "PutMetricData failed (%d metric data dropped): %s: %s",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
            else:
                self.calls += 1
                self.data_sent += len(batch)
