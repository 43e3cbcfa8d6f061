"""Reading the KPL's ``.properties`` files (``src/anykpl/_kpl_properties.py``): the property
table against the KPL's setters, ``ProducerConfig.from_kpl_properties`` on the KPL sample's file
and on every mapped, ignored, unknown and invalid property, and ``java.util.Properties`` syntax.
The defaults themselves are checked in ``test_config.py``, whose table this file reuses."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from anykpl import _kpl_properties
from anykpl.config import KPL_PROPERTY_NAMES, ProducerConfig
from anykpl.errors import ConfigError

from .test_config import KPL_DEFAULTS, TEN_YEARS

# A copy of the KPL sample's default_config.properties (java/amazon-kinesis-producer-sample/),
# newest layout: long comment blocks, every property at its KPL default, the two properties the
# sample leaves commented out, ThreadingModel, and MaxUserRecordSize with its stray semicolon.
KPL_SAMPLE_PROPERTIES = r"""# You can load a properties file with
# KinesisProducerConfiguration.fromPropertiesFile(String)
#
# Fields the file does not mention keep their default values.
#
# Every value that is loaded is checked against the constraints of its field.
# An invalid value makes the loader throw an IllegalArgumentException.


# Enable aggregation. With aggregation, several user records are packed into
# one Kinesis record. Without it, every user record is sent in a Kinesis
# record of its own.
#
# With small records, aggregation lets you put many more records into a shard
# before it starts to throttle you.
#
# Default: true
AggregationEnabled = true

# Maximum number of user records to pack into one aggregated record.
#
# Normally there is no need to change this. To limit the time records spend
# buffering, look at RecordMaxBufferedTime instead.
#
# Default: 4294967295
# Minimum: 1
# Maximum (inclusive): 9223372036854775807
AggregationMaxCount = 4294967295

# Maximum number of bytes to pack into one aggregated Kinesis record.
#
# Normally there is no need to change this. To limit the time records spend
# buffering, look at RecordMaxBufferedTime instead.
#
# A record that is larger than this limit by itself bypasses the aggregator.
# The backend rejects records over 1MB, so larger values lead to rejections.
#
# Default: 51200
# Minimum: 64
# Maximum (inclusive): 1048576
AggregationMaxSize = 51200

# Maximum number of Kinesis records to put into one PutRecords request.
#
# Normally there is no need to change this. To limit the time records spend
# buffering, look at RecordMaxBufferedTime instead.
#
# Default: 500
# Minimum: 1
# Maximum (inclusive): 500
CollectionMaxCount = 500

# Maximum amount of data to send in one PutRecords request.
#
# Normally there is no need to change this. To limit the time records spend
# buffering, look at RecordMaxBufferedTime instead.
#
# Records larger than the limit are still sent, but alone.
#
# Default: 5242880
# Minimum: 52224
# Maximum (inclusive): 9223372036854775807
CollectionMaxSize = 5242880

# Timeout (milliseconds) for establishing TLS connections.
#
# Default: 6000
# Minimum: 100
# Maximum (inclusive): 300000
ConnectTimeout = 6000

# Use a custom Kinesis and CloudWatch endpoint.
#
# Mostly for testing. Only host names or IP addresses are accepted, no
# protocols and no paths. TLS cannot be turned off: the KPL always uses TLS.
#
# Expected pattern: ^([A-Za-z0-9-\\.]+)?$
# KinesisEndpoint =

# If true, throttled puts are not retried: throttled records fail as soon as
# the throttling error arrives, so you can react at once, for example by
# sending the record to a backup shard with a different hash key.
#
# If false, throttled puts are retried automatically, with backoff for the
# shards that throttled. Records can still expire (see RecordTtl) if
# throttling delays them for too long.
#
# Default: false
FailIfThrottled = false

# Minimum level of logs. Messages below this level are not logged. The native
# daemon logs to stderr.
#
# Default: info
# Expected pattern: info|warning|error
LogLevel = info

# Maximum number of connections to open to the backend. HTTP requests are sent
# in parallel over several connections.
#
# Setting this too high can hurt latency and use more resources without
# adding throughput.
#
# Default: 24
# Minimum: 1
# Maximum (inclusive): 256
MaxConnections = 24

# Controls the granularity of the metrics uploaded to CloudWatch. Greater
# granularity produces more metrics.
#
# With "shard", metrics are emitted with the stream name and the shard id as
# dimensions, then again with only the stream name, and once more without
# either. Two streams with two shards each therefore produce 7 CloudWatch
# metrics for one metric: one per shard, one per stream and one overall.
#
# With "stream", per-shard metrics are not uploaded; with "global", only the
# total over all streams and shards is uploaded.
#
# Consider a coarser granularity if you do not need shard-level metrics, or if
# you have many shards. With a single stream, "global" carries the same data
# as "stream".
#
# Default: shard
# Expected pattern: global|stream|shard
MetricsGranularity = shard

# Controls how many metrics are uploaded to CloudWatch.
#
# "none" disables all metrics.
#
# "summary" enables UserRecordsPut, KinesisRecordsPut, ErrorsByCode,
# AllErrors and BufferingTime.
#
# "detailed" enables all the others as well.
#
# Default: detailed
# Expected pattern: none|summary|detailed
MetricsLevel = detailed

# The namespace to upload metrics under.
#
# Applications sharing an AWS account should each use their own namespace. If
# you also run the KCL, using its application name here puts the metrics of
# both under the same namespace.
#
# Default: KinesisProducerLibrary
# Expected pattern: (?!AWS/).{1,255}
MetricsNamespace = KinesisProducerLibrary

# Delay (milliseconds) between metrics uploads.
#
# For testing only. In production there is no benefit in changing it.
#
# Default: 60000
# Minimum: 1
# Maximum (inclusive): 60000
MetricsUploadDelay = 60000

# Minimum number of connections to keep open to the backend.
#
# In general there is no need to increase this.
#
# Default: 1
# Minimum: 1
# Maximum (inclusive): 16
MinConnections = 1

# Server port to connect to. Only useful with KinesisEndpoint.
#
# Default: 443
# Minimum: 1
# Maximum (inclusive): 65535
KinesisPort = 443

# Limits the put rate for a shard, as a percentage of the backend limits.
#
# The rate limit keeps the producer from sending faster than a shard accepts,
# which saves the bandwidth and CPU spent on requests that will be throttled.
#
# Kinesis limits both records and bytes per second; this applies to both.
#
# The default of 150% lets one producer instance saturate a shard completely.
# It is an aggressive setting: lower it if you would rather see fewer
# throttling errors than saturate the shard.
#
# Default: 150
# Minimum: 1
# Maximum (inclusive): 9223372036854775807
RateLimit = 150

# Maximum time (milliseconds) a record may spend buffered before it is sent.
# Records may go sooner because of the other buffering limits.
#
# This gives coarse ordering: two records are reordered by no more than twice
# this amount, without failures and retries and with equal network latency.
#
# The deadline is met on a best-effort basis, usually to within 10ms when the
# CPU is not overloaded. Failures and retries add to the time records spend
# in the library; use RecordTtl to drop records that arrive too late.
#
# Setting this too low can hurt throughput.
#
# Default: 100
# Maximum (inclusive): 9223372036854775807
RecordMaxBufferedTime = 100

# Time-to-live of records (milliseconds). Records not put successfully within
# this time fail.
#
# Useful when late records are of no use. Network latency comes on top once
# records leave the library. To retry for ever instead, set a large value such
# as INT_MAX; this risks head-of-line blocking during network trouble or
# throttling. You may also set FailIfThrottled to true to stop retries on
# throttling.
#
# Default: 30000
# Minimum: 100
# Maximum (inclusive): 9223372036854775807
RecordTtl = 30000

# Which region to send records to.
#
# Without a region, on EC2 the region of the instance is used. The region is
# also used to sign requests.
#
# Expected pattern: ^([a-z]+-([a-z]+-)?[a-z]+-[0-9])?$
# Region =

# Maximum total time (milliseconds) from the start of an HTTP request to the
# end of its response. Requests that take longer time out.
#
# A timed-out request may still have succeeded at the backend, so retrying it
# can create duplicates; too low a timeout makes duplicates more likely.
#
# Default: 6000
# Minimum: 100
# Maximum (inclusive): 600000
RequestTimeout = 6000

# Verify the endpoint's certificate. Do not disable unless you use a custom
# endpoint for testing. Never disable this in production.
#
# Default: true
VerifyCertificate = true

# The threading model of the native process.
# Enum:
# PER_REQUEST: a thread for each request. Under heavy load this can create a
#              very large number of threads and exhaust resources.
#
# POOLED: a thread pool whose size ThreadPoolSize controls, fed by a queue.
#         This bounds the number of threads, but under extreme load latency
#         can grow much more than with PER_REQUEST.
#
# Default = PER_REQUEST
ThreadingModel = PER_REQUEST

# Maximum number of threads in the native process's thread pool.
#
# Default: 0
#ThreadPoolSize = 0

# Maximum size (bytes) of the data of one user record. Records with more data
# are rejected when they are added.
#
# Default: 1048576
# Minimum: 64
# Maximum (inclusive): 1048576
MaxUserRecordSize = 1048576;
"""


def write_properties(tmp_path: Path, text: str, name: str = "kpl.properties") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(tmp_path: Path, text: str, **overrides: Any) -> ProducerConfig:
    return ProducerConfig.from_kpl_properties(write_properties(tmp_path, text), **overrides)


# --- from_kpl_properties ------------------------------------------------------------------


def test_kpl_sample_file_parses_without_warnings(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load(tmp_path, KPL_SAMPLE_PROPERTIES)
    # The sample asks for the KPL's 150 %; everything else is a KPL default, which is ours too.
    assert config == ProducerConfig(rate_limit=150.0)
    assert {name: getattr(config, name) for name in KPL_DEFAULTS} == KPL_DEFAULTS


def test_accepts_path_objects_and_strings(tmp_path: Path) -> None:
    path = write_properties(tmp_path, "RateLimit = 80\n")
    assert ProducerConfig.from_kpl_properties(path).rate_limit == 80.0
    assert ProducerConfig.from_kpl_properties(str(path)).rate_limit == 80.0


def test_every_mapped_property(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        AggregationEnabled = FALSE
        AggregationMaxCount = 100
        AggregationMaxSize = 1048576
        CollectionMaxCount = 250
        CollectionMaxSize = 1048576
        ConnectTimeout = 1500
        RequestTimeout = 600000
        FailIfThrottled = True
        MaxConnections = 64
        MinConnections = 16
        MetricsGranularity = stream
        MetricsLevel = summary
        MetricsNamespace = MyApp
        MetricsUploadDelay = 1
        RateLimit = 90
        RecordMaxBufferedTime = 250
        RecordTtl = 120000
        Region = us-west-2
        VerifyCertificate = false
        MaxUserRecordSize = 2097152
        KinesisEndpoint = localhost
        KinesisPort = 4567
        """,
    )
    assert config == ProducerConfig(
        aggregation_enabled=False,
        aggregation_max_count=100,
        aggregation_max_size=1048576,
        collection_max_count=250,
        collection_max_size=1048576,
        connect_timeout=1.5,
        request_timeout=600.0,
        fail_if_throttled=True,
        max_connections=64,
        min_connections=16,
        metrics_granularity="stream",
        metrics_level="summary",
        metrics_namespace="MyApp",
        metrics_upload_delay=0.001,
        rate_limit=90.0,
        record_max_buffered_time=0.25,
        record_ttl=120.0,
        region="us-west-2",
        verify_certificate=False,
        max_user_record_size=2097152,
        endpoint_url="https://localhost:4567",
    )


@pytest.mark.parametrize(
    ("line", "name", "seconds"),
    [
        ("ConnectTimeout = 100", "connect_timeout", 0.1),
        ("RequestTimeout = 2500", "request_timeout", 2.5),
        ("MetricsUploadDelay = 60000", "metrics_upload_delay", 60.0),
        ("RecordMaxBufferedTime = 0", "record_max_buffered_time", 0.0),
        ("RecordMaxBufferedTime = 5", "record_max_buffered_time", 0.005),
        ("RecordTtl = 100", "record_ttl", 0.1),
        ("RecordTtl = 3600000", "record_ttl", 3600.0),
    ],
)
def test_milliseconds_become_seconds(tmp_path: Path, line: str, name: str, seconds: float) -> None:
    assert getattr(load(tmp_path, line), name) == seconds


def test_record_ttl_at_the_kpl_maximum_does_not_overflow(tmp_path: Path) -> None:
    # Long.MAX_VALUE ms: the C++ KPL overflowed its clock here and expired everything at once.
    config = load(
        tmp_path, "RecordTtl = 9223372036854775807\nRecordMaxBufferedTime = 9223372036854775807"
    )
    assert config.record_ttl == TEN_YEARS
    assert config.record_max_buffered_time == (2**63 - 1) / 1000


@pytest.mark.parametrize(
    ("line", "key", "name"),
    [
        ("RecordTtl = " + "9" * 400, "RecordTtl", "record_ttl"),
        (
            "RecordMaxBufferedTime = " + "9" * 400,
            "RecordMaxBufferedTime",
            "record_max_buffered_time",
        ),
        ("RateLimit = " + "9" * 400, "RateLimit", "rate_limit"),
        ("AggregationMaxCount = " + "9" * 5000, "AggregationMaxCount", "aggregation_max_count"),
        ("ConnectTimeout = -" + "9" * 5000, "ConnectTimeout", "connect_timeout"),
        ("MaxConnections = 9223372036854775808", "MaxConnections", "max_connections"),
        ("MetricsUploadDelay = -9223372036854775809", "MetricsUploadDelay", "metrics_upload_delay"),
    ],
)
def test_numbers_outside_javas_long_range_name_property_and_field(
    tmp_path: Path, line: str, key: str, name: str
) -> None:
    # Long.valueOf throws for these; the KPL reports the property, and so do we.
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, line)
    assert caught.value.field == name
    assert caught.value.value == line.split("=")[1].strip()
    message = str(caught.value)
    assert f"{name}=" in message
    assert f"KPL property {key}=" in message
    assert "-9223372036854775808..9223372036854775807, Java's long range" in message
    assert len(message) < 400


def test_leading_zeros_do_not_make_a_number_too_long(tmp_path: Path) -> None:
    config = load(tmp_path, f"AggregationMaxCount = {'0' * 5000}5\nRecordTtl = +{'0' * 400}1000")
    assert config.aggregation_max_count == 5
    assert config.record_ttl == 1.0


def test_long_port_and_ignored_numbers_are_reported_not_crashed_on(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "KinesisEndpoint = localhost\nKinesisPort = " + "9" * 5000)
    assert caught.value.field == "endpoint_url"
    assert "KinesisPort='99999" in str(caught.value)
    assert "(5000 characters)" in str(caught.value)
    with pytest.warns(
        UserWarning, match=r"CloudwatchPort .*\(5000 characters\).*ignored"
    ) as record:
        assert load(tmp_path, "CloudwatchPort = " + "9" * 5000) == ProducerConfig()
    assert all(len(str(w.message)) < 400 for w in record)


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("KinesisEndpoint = localhost\nKinesisPort = 4567", "https://localhost:4567"),
        (
            "KinesisEndpoint = kinesis.eu-west-1.amazonaws.com",
            "https://kinesis.eu-west-1.amazonaws.com:443",
        ),
        ("KinesisEndpoint = 127.0.0.1\nKinesisPort = 443", "https://127.0.0.1:443"),
        ("KinesisPort = 8443\nKinesisEndpoint = my-kinesis.local", "https://my-kinesis.local:8443"),
        ("KinesisEndpoint = http://localhost:4567", "http://localhost:4567"),
        ("KinesisEndpoint = http://localhost\nKinesisPort = 4567", "http://localhost:4567"),
        ("KinesisEndpoint = https://localhost", "https://localhost"),
        # The sample's "KinesisPort = 443" line left in place does not fight the URL's port.
        ("KinesisEndpoint = http://localhost:4567\nKinesisPort = 443", "http://localhost:4567"),
        ("KinesisEndpoint = http://localhost:4567\nKinesisPort = 4567", "http://localhost:4567"),
        ("KinesisEndpoint =\nKinesisPort = 443", None),
    ],
)
def test_kinesis_endpoint_and_port_make_endpoint_url(
    tmp_path: Path, text: str, url: str | None
) -> None:
    assert load(tmp_path, text).endpoint_url == url


def test_kinesis_port_without_endpoint_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="KinesisPort .*accepted and ignored.*KinesisEndpoint"):
        config = load(tmp_path, "KinesisPort = 4567")
    assert config.endpoint_url is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("KinesisEndpoint = localhost\nKinesisPort = 0", "KinesisPort"),
        ("KinesisEndpoint = localhost\nKinesisPort = 65536", "KinesisPort"),
        ("KinesisEndpoint = localhost\nKinesisPort = https", "KinesisPort"),
        ("KinesisEndpoint = local host", "KinesisEndpoint"),
        ("KinesisEndpoint = localhost/path", "KinesisEndpoint"),
        ("KinesisEndpoint = ftp://localhost", "KinesisEndpoint"),
        ("KinesisEndpoint = http://localhost:4567\nKinesisPort = 4568", "KinesisPort"),
    ],
)
def test_bad_kinesis_endpoint_or_port(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert caught.value.field == "endpoint_url"
    assert fragment in str(caught.value)
    assert "endpoint_url" in str(caught.value)


@pytest.mark.parametrize(
    ("line", "key", "name"),
    [
        ("RecordTtl = 50", "RecordTtl", "record_ttl"),
        ("RecordTtl = thirty", "RecordTtl", "record_ttl"),
        ("RecordTtl = 1.5", "RecordTtl", "record_ttl"),
        ("MaxConnections = 0", "MaxConnections", "max_connections"),
        ("MaxConnections = 24x", "MaxConnections", "max_connections"),
        ("AggregationEnabled = yes", "AggregationEnabled", "aggregation_enabled"),
        ("VerifyCertificate = 1", "VerifyCertificate", "verify_certificate"),
        (
            "AggregationMaxCount = 9223372036854775808",
            "AggregationMaxCount",
            "aggregation_max_count",
        ),
        ("CollectionMaxSize = 1024", "CollectionMaxSize", "collection_max_size"),
        ("ConnectTimeout = 99", "ConnectTimeout", "connect_timeout"),
        ("RequestTimeout = 600001", "RequestTimeout", "request_timeout"),
        ("RateLimit = 0", "RateLimit", "rate_limit"),
        ("MetricsLevel = Detailed", "MetricsLevel", "metrics_level"),
        ("MetricsGranularity = host", "MetricsGranularity", "metrics_granularity"),
        ("MetricsNamespace = AWS/Kinesis", "MetricsNamespace", "metrics_namespace"),
        ("MetricsUploadDelay = 0", "MetricsUploadDelay", "metrics_upload_delay"),
        ("MinConnections = 17", "MinConnections", "min_connections"),
        ("Region = us_east_1", "Region", "region"),
        ("MaxUserRecordSize = 63;", "MaxUserRecordSize", "max_user_record_size"),
    ],
)
def test_invalid_property_value_names_property_and_field(
    tmp_path: Path, line: str, key: str, name: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, line)
    assert caught.value.field == name
    message = str(caught.value)
    assert key in message
    assert name in message


def test_invalid_milliseconds_error_shows_the_file_value_and_unit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "RecordTtl = 50")
    message = str(caught.value)
    assert "record_ttl=0.05" in message
    assert "RecordTtl='50'" in message
    assert "milliseconds" in message


def test_unknown_property_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=re.escape("unknown KPL property 'RateLimitt' ignored")):
        config = load(tmp_path, "RateLimitt = 80\nRateLimit = 90")
    assert config.rate_limit == 90.0


def test_old_property_names_are_unknown(tmp_path: Path) -> None:
    # Names from KPL versions before 0.12 (CustomEndpoint, Port) are not accepted by the KPL
    # today either.
    with pytest.warns(UserWarning, match="unknown KPL property 'CustomEndpoint'"):
        load(tmp_path, "CustomEndpoint = localhost")


IGNORED_AT_DEFAULT = [
    "CloudwatchEndpoint =",
    "CloudwatchPort = 443",
    "ThreadingModel = PER_REQUEST",
    "ThreadPoolSize = 0",
    "LogLevel = info",
    "CredentialsRefreshDelay = 5000",
    "EnableCoreDumps = false",
    "NativeExecutable =",
    "TempDirectory =",
    "CaCertPath =",
    "StsEndpoint =",
    "StsPort = 443",
    "UserRecordTimeoutInMillis = 0",
    "EnableOldestFutureTracker = TRUE",
    "ReturnUserRecordOnFailure = false",
    "EnableDaemonHealthCheck = false",
    "DaemonHealthCheckTimeoutMs = 30000",
    "GlueSchemaRegistryPropertiesFilePath =",
    "GlueSchemaRegistryConfiguration =",
    "GlueSchemaRegistryCredentialsProvider =",
    "CredentialsProvider =",
    "MetricsCredentialsProvider =",
]


def test_ignored_list_covers_every_ignored_property() -> None:
    ignored = {key for key, name in KPL_PROPERTY_NAMES.items() if name is None}
    assert {line.split("=")[0].strip() for line in IGNORED_AT_DEFAULT} == ignored


@pytest.mark.parametrize("line", IGNORED_AT_DEFAULT)
def test_ignored_property_at_its_kpl_default_does_not_warn(tmp_path: Path, line: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(tmp_path, line) == ProducerConfig()


@pytest.mark.parametrize(
    "line",
    [
        "LogLevel = debug",
        "ThreadingModel = POOLED",
        "ThreadPoolSize = 128",
        "CloudwatchEndpoint = monitoring.local",
        "CaCertPath = /etc/ssl/certs",
        "EnableDaemonHealthCheck = true",
        "UserRecordTimeoutInMillis = 5000",
        "CredentialsRefreshDelay = abc",
        "GlueSchemaRegistryPropertiesFilePath = /etc/kpl/gsr.properties",
        "GlueSchemaRegistryConfiguration = x",
        "CredentialsProvider = DefaultCredentialsProvider",
    ],
)
def test_ignored_property_with_a_non_default_value_warns(tmp_path: Path, line: str) -> None:
    key = line.split("=")[0].strip()
    with pytest.warns(UserWarning, match=rf"KPL property {key} .*accepted and ignored: \w"):
        assert load(tmp_path, line) == ProducerConfig()


def test_each_ignored_key_warns_once(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="accepted and ignored") as record:
        load(tmp_path, "LogLevel = debug\nLogLevel = trace\nThreadPoolSize = 8\n")
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert any("LogLevel" in m and "'trace'" in m for m in messages)


def test_proxy_password_is_not_repeated_in_the_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="ProxyPassword .*no effect without ProxyHost") as record:
        assert load(tmp_path, "ProxyPassword = hunter2") == ProducerConfig()
    assert all("hunter2" not in str(w.message) for w in record)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("ProxyHost = proxy.internal", "http://proxy.internal:443"),
        ("ProxyHost = proxy.internal\nProxyPort = 3128", "http://proxy.internal:3128"),
        (
            "ProxyHost = 10.0.0.1\nProxyPort = 3128\nProxyUserName = ops\nProxyPassword = p@ss:w",
            "http://ops:p%40ss%3Aw@10.0.0.1:3128",
        ),
        ("ProxyHost = proxy.internal\nProxyUserName = ops", "http://ops@proxy.internal:443"),
        # as Java's Properties reads them: a password's ';' and trailing space are its own
        (
            "ProxyHost = proxy.internal\nProxyUserName = ops\nProxyPassword = se cret; ",
            "http://ops:se%20cret%3B%20@proxy.internal:443",
        ),
    ],
)
def test_the_kpl_proxy_properties_become_proxy_url(
    tmp_path: Path, lines: str, expected: str
) -> None:
    """The KPL's proxy is an HTTP proxy at ProxyHost:ProxyPort (the AWS SDK's default scheme),
    with ProxyUserName and ProxyPassword as its credentials."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(tmp_path, lines).proxy_url == expected
    assert KPL_PROPERTY_NAMES["ProxyHost"] == "proxy_url"


def test_a_bad_proxy_property_names_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ProxyPort"):
        load(tmp_path, "ProxyHost = proxy.internal\nProxyPort = 0")
    with pytest.raises(ConfigError, match="ProxyHost"):
        load(tmp_path, "ProxyHost = http://proxy.internal")
    with pytest.warns(UserWarning, match="ProxyPort .*no effect without ProxyHost"):
        assert load(tmp_path, "ProxyPort = 3128") == ProducerConfig()


def test_warnings_point_at_the_caller(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="ignored") as record:
        load(tmp_path, "Unknown = 1\nKinesisPort = 4567")
    assert [w.filename for w in record] == [__file__, __file__]


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    config = load(tmp_path, KPL_SAMPLE_PROPERTIES, rate_limit=100, region="eu-central-1")
    assert config.rate_limit == 100.0
    assert config.region == "eu-central-1"


def test_overrides_rescue_an_invalid_file_value(tmp_path: Path) -> None:
    assert load(tmp_path, "RecordTtl = 50", record_ttl=1.0).record_ttl == 1.0


def test_invalid_override_is_reported_as_a_field_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "RateLimit = 90", rate_limit=0)
    assert caught.value.field == "rate_limit"
    assert "RateLimit" not in str(caught.value)


def test_empty_region_and_endpoint_in_the_file_mean_none(tmp_path: Path) -> None:
    config = load(tmp_path, "Region =\nKinesisEndpoint =\n")
    assert config.region is None
    assert config.endpoint_url is None


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        ProducerConfig.from_kpl_properties(tmp_path / "missing.properties")


# --- The .properties syntax ---------------------------------------------------------------


def test_properties_syntax(tmp_path: Path) -> None:
    text = (
        "# comment\n"
        "! another comment\n"
        "   # indented comment\n"
        "\n"
        "\t\n"
        "RateLimit:80\n"
        "MaxConnections 32\n"
        "  MetricsNamespace   =   My App  \n"
        "Region=eu-west-1\r\n"
        "MetricsLevel = \\\n"
        "    summary\n"
        "# a comment ending in a backslash is not continued \\\n"
        "MinConnections = 2\n"
        "Metrics\\u004eamespace = Escaped\\u0020Name\n"
        "RecordTtl = 1000\n"
        "RecordTtl = 2000\n"
    )
    config = load(tmp_path, text)
    assert config.rate_limit == 80.0
    assert config.max_connections == 32
    assert config.region == "eu-west-1"
    assert config.metrics_level == "summary"
    assert config.min_connections == 2
    assert config.metrics_namespace == "Escaped Name"  # a repeated key keeps its last value
    assert config.record_ttl == 2.0


def test_properties_escaped_separators_and_even_backslashes() -> None:
    parse = _kpl_properties._parse_properties
    assert parse("a\\=b = c") == {"a=b": "c"}
    assert parse("a\\ b:c") == {"a b": "c"}
    assert parse("key = ends with two \\\\\nnext = 1") == {"key": "ends with two \\", "next": "1"}
    assert parse("key = \\t\\n\\x") == {"key": "\t\nx"}
    assert parse("key") == {"key": ""}
    assert parse("key = last \\") == {"key": "last "}


def test_cr_only_line_endings(tmp_path: Path) -> None:
    config = load(tmp_path, "RateLimit = 80\rMaxConnections = 8\r")
    assert (config.rate_limit, config.max_connections) == (80.0, 8)


def test_latin1_files_are_read(tmp_path: Path) -> None:
    path = tmp_path / "latin1.properties"
    path.write_bytes("MetricsNamespace = Caf\xe9\n".encode("iso-8859-1"))
    assert ProducerConfig.from_kpl_properties(path).metrics_namespace == "Caf\xe9"


def test_utf8_bom_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.properties"
    path.write_bytes("\ufeffRateLimit = 80\n".encode())
    assert ProducerConfig.from_kpl_properties(path).rate_limit == 80.0


def test_stray_semicolons_and_trailing_whitespace_are_tolerated(tmp_path: Path) -> None:
    config = load(tmp_path, "MaxUserRecordSize = 2097152 ;  \nFailIfThrottled = true;\n")
    assert config.max_user_record_size == 2097152
    assert config.fail_if_throttled is True


# --- The property table and the docs ------------------------------------------------------

# The KPL's property names are the setters of KinesisProducerConfiguration: its fromProperties
# takes each key "Key" for which the class has a method "setKey" (a setter taking a Java object,
# such as setCredentialsProvider, counts as found and ignores the value). This is every
# "public KinesisProducerConfiguration setXxx(" in
# java/amazon-kinesis-producer/src/main/java/software/amazon/kinesis/producer/
# KinesisProducerConfiguration.java of awslabs/amazon-kinesis-producer at KPL v1.0.7 (commit
# 0c641b6ce1f6c88f74db7103ef86b4150d91ad64; unchanged at 11c4a64f of 2026-03-31), copied from
# the source, not from our table.
KPL_SETTER_NAMES = {
    "AggregationEnabled",
    "AggregationMaxCount",
    "AggregationMaxSize",
    "CaCertFile",
    "CaCertPath",
    "CloudwatchEndpoint",
    "CloudwatchPort",
    "CollectionMaxCount",
    "CollectionMaxSize",
    "ConnectTimeout",
    "CredentialsProvider",
    "CredentialsRefreshDelay",
    "DaemonHealthCheckTimeoutMs",
    "EnableCoreDumps",
    "EnableDaemonHealthCheck",
    "EnableOldestFutureTracker",
    "FailIfThrottled",
    "GlueSchemaRegistryConfiguration",
    "GlueSchemaRegistryCredentialsProvider",
    "GlueSchemaRegistryPropertiesFilePath",
    "KinesisEndpoint",
    "KinesisPort",
    "LogLevel",
    "MaxConnections",
    "MaxUserRecordSize",
    "MetricsCredentialsProvider",
    "MetricsGranularity",
    "MetricsLevel",
    "MetricsNamespace",
    "MetricsUploadDelay",
    "MinConnections",
    "NativeExecutable",
    "ProxyHost",
    "ProxyPassword",
    "ProxyPort",
    "ProxyUserName",
    "RateLimit",
    "RecordMaxBufferedTime",
    "RecordTtl",
    "Region",
    "RequestTimeout",
    "ReturnUserRecordOnFailure",
    "StsEndpoint",
    "StsPort",
    "TempDirectory",
    "ThreadPoolSize",
    "ThreadingModel",
    "UserRecordTimeoutInMillis",
    "VerifyCertificate",
}


def test_kpl_property_names_cover_the_kpl_table() -> None:
    assert set(KPL_PROPERTY_NAMES) == KPL_SETTER_NAMES
    fields = {f.name for f in dataclasses.fields(ProducerConfig)}
    assert {name for name in KPL_PROPERTY_NAMES.values() if name is not None} <= fields


def test_kpl_property_names_is_read_only() -> None:
    with pytest.raises(TypeError):
        KPL_PROPERTY_NAMES["Foo"] = "bar"  # type: ignore[index]


def test_every_kpl_name_is_snake_case_of_its_field() -> None:
    for key, name in KPL_PROPERTY_NAMES.items():
        if name is None or key.startswith(("Kinesis", "Proxy")):  # one URL from several
            continue
        if key == "CaCertFile":  # botocore's name for it, as in AWS_CA_BUNDLE
            assert name == "ca_bundle"
            continue
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
        assert snake == name


def test_docs_page_documents_every_kpl_property() -> None:
    page = Path(__file__).parents[1] / "docs" / "configuration.md"
    text = page.read_text(encoding="utf-8")
    for key in KPL_PROPERTY_NAMES:
        assert f"`{key}`" in text, key


# --- CaCertFile and CaCertPath -------------------------------------------------------------


def test_kpl_ca_cert_file_sets_ca_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n", encoding="ascii")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(tmp_path, f"CaCertFile = {bundle}").ca_bundle == str(bundle)
        # the KPL default, empty, keeps botocore's chain
        assert load(tmp_path, "CaCertFile =").ca_bundle is None
    assert KPL_PROPERTY_NAMES["CaCertFile"] == "ca_bundle"


def test_kpl_ca_cert_file_that_does_not_exist_names_the_property(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(ConfigError, match=r"\(from KPL property CaCertFile=") as caught:
        load(tmp_path, f"CaCertFile = {missing}")
    assert caught.value.field == "ca_bundle"


def test_kpl_ca_cert_path_a_directory_is_refused_with_a_warning_saying_what_to_do(
    tmp_path: Path,
) -> None:
    with pytest.warns(UserWarning, match="CaCertPath .* concatenate them into one PEM file"):
        assert load(tmp_path, "CaCertPath = /etc/ssl/certs") == ProducerConfig()
