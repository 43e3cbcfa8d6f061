"""ProducerConfig and its companions (FleetConfig, StreamSettings, TenantQuota): defaults
against the KPL's, bounds, types, secrets, ``replace`` and the docs. Reading the KPL's
``.properties`` files is tested in ``test_kpl_properties.py``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest

from anykpl import config as config_module
from anykpl.config import ProducerConfig
from anykpl.errors import ConfigError

KPL_DEFAULTS: dict[str, Any] = {
    "region": None,
    "endpoint_url": None,
    "verify_certificate": True,
    "max_connections": 24,
    "connect_timeout": 6.0,
    "request_timeout": 6.0,
    "aggregation_enabled": True,
    "aggregation_max_count": 4294967295,
    "aggregation_max_size": 51200,
    "collection_max_count": 500,
    "collection_max_size": 5242880,
    "fail_if_throttled": False,
    "record_max_buffered_time": 0.1,
    "record_ttl": 30.0,
    "max_user_record_size": 1048576,
    "metrics_level": "detailed",
    "metrics_granularity": "shard",
    "metrics_namespace": "KinesisProducerLibrary",
    "metrics_upload_delay": 60.0,
    "min_connections": 1,
}

TEN_YEARS = 10 * 365.25 * 24 * 3600.0


# --- Defaults -----------------------------------------------------------------------------


def test_defaults_equal_the_kpl_defaults() -> None:
    config = ProducerConfig()
    assert {name: getattr(config, name) for name in KPL_DEFAULTS} == KPL_DEFAULTS


def test_rate_limit_default_is_100_not_the_kpls_150() -> None:
    assert ProducerConfig().rate_limit == 100.0
    doc = ProducerConfig.__doc__ or ""
    assert "150" in doc
    assert "97 %" in doc


def test_defaults_beyond_the_kpl() -> None:
    config = ProducerConfig()
    assert config.profile is None
    assert config.aws_access_key_id is None
    assert config.aws_secret_access_key is None
    assert config.aws_session_token is None
    assert config.http_backend == "auto"
    assert config.max_outstanding_records == 100_000
    assert config.max_outstanding_bytes == 128 * 1024 * 1024
    assert config.admission_timeout is None
    assert config.max_outstanding_time is None
    assert config.close_timeout == 30.0
    assert config.retry_backoff_initial == 0.05
    assert config.retry_backoff_max == 5.0
    assert config.container_partition_key == "a"


# --- Bounds -------------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("max_connections", 0, "1..256"),
    ("max_connections", 257, "1..256"),
    ("connect_timeout", 0.09, "0.1..300"),
    ("connect_timeout", 300.5, "0.1..300"),
    ("request_timeout", 0.0, "0.1..600"),
    ("request_timeout", 601, "0.1..600"),
    ("aggregation_max_count", 0, "1..9223372036854775807"),
    ("aggregation_max_count", 2**63, "1..9223372036854775807"),
    ("aggregation_max_size", 63, "64..10485760"),
    ("aggregation_max_size", 10485761, "64..10485760"),
    ("collection_max_count", 0, "1..500"),
    ("collection_max_count", 501, "1..500"),
    ("collection_max_size", 52223, "52224..5242880"),
    ("collection_max_size", 5242881, "52224..5242880"),
    ("rate_limit", 0.5, "1..9223372036854775807"),
    ("rate_limit", 2**64, "1..9223372036854775807"),
    ("record_max_buffered_time", -0.001, "0..9223372036854776"),
    ("record_max_buffered_time", 1e16, "0..9223372036854776"),
    ("record_ttl", 0.099, ">= 0.1"),
    ("max_user_record_size", 63, "64..10485760"),
    ("max_user_record_size", 10485761, "64..10485760"),
    ("metrics_upload_delay", 0.0005, "0.001..60"),
    ("metrics_upload_delay", 60.001, "0.001..60"),
    ("min_connections", 0, "1..16"),
    ("min_connections", 17, "1..16"),
    ("max_outstanding_records", 0, ">= 1"),
    ("max_outstanding_bytes", 1023, ">= 1024"),
    ("admission_timeout", 0, "> 0"),
    ("admission_timeout", -1.0, "> 0"),
    ("max_outstanding_time", 0, "> 0"),
    ("max_outstanding_time", -1.0, "> 0"),
    ("close_timeout", -0.1, ">= 0"),
    ("stream_idle_timeout", 0, "> 0"),
    ("stream_idle_timeout", -1.0, "> 0"),
    ("retry_backoff_initial", -0.01, "0..60"),
    ("retry_backoff_initial", 61, "0..60"),
    ("retry_backoff_max", 0.01, ">= retry_backoff_initial"),
    ("retry_backoff_max", math.inf, "finite"),
    ("metrics_namespace", "", "1..255 characters"),
    ("metrics_namespace", "n" * 256, "1..255 characters"),
    ("metrics_namespace", "AWS/Kinesis", "AWS/"),
    ("container_partition_key", "", "1..256 characters"),
    ("container_partition_key", "k" * 257, "1..256 characters"),
    ("region", "US-EAST-1", "^([a-z]+-([a-z]+-)?[a-z]+-[0-9])?$"),
    ("region", "us-east", "^([a-z]+-([a-z]+-)?[a-z]+-[0-9])?$"),
    ("endpoint_url", "localhost:4567", "http:// or https://"),
    ("endpoint_url", "ftp://localhost", "http:// or https://"),
    ("endpoint_url", "http://", "with a host"),
    ("endpoint_url", "http://localhost:99999", "http:// or https://"),
    ("profile", "", "non-empty"),
    ("http_backend", "curl", "'auto', 'aiohttp', 'httpx'"),
    ("wire_protocol", "xml", "'json', 'cbor', 'auto'"),
    ("proxy_url", "proxy.internal:3128", "http:// or https://"),
    ("proxy_url", "socks5://proxy.internal:1080", "http:// or https://"),
    ("proxy_url", "http://", "with a host"),
    ("proxy_url", "http://proxy.internal:3128/path", "with a host"),
    ("proxy_url", "http://proxy.internal:99999", "with a host"),
    ("metrics_level", "all", "'none', 'summary', 'detailed'"),
    ("metrics_granularity", "host", "'global', 'stream', 'shard'"),
]


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    OUT_OF_RANGE,
    ids=[f"{name}={value!r}"[:60] for name, value, _ in OUT_OF_RANGE],
)
def test_out_of_range_value_names_field_value_and_range(
    name: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(**{name: value})
    error = caught.value
    assert error.field == name
    assert error.value == value
    assert allowed in error.allowed
    message = str(error)
    assert name in message
    assert repr(value) in message
    assert allowed in message


AT_THE_BOUNDS = [
    ("max_connections", 1),
    ("max_connections", 256),
    ("connect_timeout", 0.1),
    ("connect_timeout", 300),
    ("request_timeout", 600.0),
    ("aggregation_max_count", 2**63 - 1),
    ("aggregation_max_size", 64),
    ("aggregation_max_size", 1048576),
    ("aggregation_max_size", 10485760),
    ("collection_max_count", 1),
    ("collection_max_size", 52224),
    ("rate_limit", 1),
    ("rate_limit", 150),
    ("rate_limit", 2**63 - 1),
    ("record_max_buffered_time", 0),
    ("record_max_buffered_time", (2**63 - 1) / 1000),
    ("record_ttl", 0.1),
    ("max_user_record_size", 10485760),
    ("metrics_upload_delay", 0.001),
    ("min_connections", 16),
    ("max_outstanding_records", 1),
    ("max_outstanding_bytes", 1024),
    ("admission_timeout", 0.001),
    ("admission_timeout", math.inf),
    ("max_outstanding_time", 0.5),
    ("max_outstanding_time", math.inf),
    ("close_timeout", 0),
    ("close_timeout", math.inf),
    ("stream_idle_timeout", 0.001),
    ("stream_idle_timeout", math.inf),
    ("stream_idle_timeout", None),
    ("retry_backoff_initial", 0),
    ("retry_backoff_max", 0.05),
    ("metrics_namespace", "n" * 255),
    ("metrics_namespace", "MyApp/AWS/x"),
    ("container_partition_key", "k" * 256),
    ("region", "us-east-1"),
    ("region", "us-gov-west-1"),
    ("region", "cn-north-1"),
    ("endpoint_url", "http://localhost:4567"),
    ("endpoint_url", "https://kinesis.us-east-1.amazonaws.com"),
    ("http_backend", "httpx"),
    ("wire_protocol", "cbor"),
    ("proxy_url", "http://proxy.internal:3128"),
    ("proxy_url", "https://user:pass@proxy.internal"),
    ("metrics_level", "none"),
    ("metrics_granularity", "global"),
]


@pytest.mark.parametrize(("name", "value"), AT_THE_BOUNDS)
def test_values_at_the_bounds_are_accepted(name: str, value: object) -> None:
    stored = getattr(ProducerConfig(**{name: value}), name)
    assert stored == (float(value) if isinstance(stored, float) else value)  # type: ignore[arg-type]


# --- Types --------------------------------------------------------------------------------

BOOL_FIELDS = [
    "verify_certificate",
    "aggregation_enabled",
    "fail_if_throttled",
    "adaptive",
    "adaptive_batching",
    "container_key_from_records",
]
INT_FIELDS = [
    "max_connections",
    "aggregation_max_count",
    "aggregation_max_size",
    "collection_max_count",
    "collection_max_size",
    "max_user_record_size",
    "min_connections",
    "max_outstanding_records",
    "max_outstanding_bytes",
    "spool_max_bytes",
]
FLOAT_FIELDS = [
    "connect_timeout",
    "request_timeout",
    "rate_limit",
    "record_max_buffered_time",
    "record_ttl",
    "metrics_upload_delay",
    "admission_timeout",
    "max_outstanding_time",
    "close_timeout",
    "stream_idle_timeout",
    "retry_backoff_initial",
    "retry_backoff_max",
    "adaptive_increase",
    "adaptive_floor",
    "adaptive_window",
    "retry_budget",
    "spool_fsync_interval",
]
#: float fields no integer fits (tested with floats only)
FRACTION_FIELDS = ["adaptive_decrease"]
#: fields holding objects (FleetConfig, TenantQuota), tested in tests/test_config.py's own section
OBJECT_FIELDS = ["fleet", "tenant_quotas", "default_tenant_quota", "streams"]
STR_FIELDS = [
    "region",
    "endpoint_url",
    "profile",
    "ca_bundle",
    "http_backend",
    "wire_protocol",
    "proxy_url",
    "metrics_level",
    "metrics_granularity",
    "metrics_namespace",
    "container_partition_key",
    "tenant_overflow",
    "spool_dir",
    "spool_fsync",
]


def test_a_proxy_urls_password_is_never_shown() -> None:
    config = ProducerConfig(proxy_url="http://ops:hunter2@proxy.internal:3128")
    assert "hunter2" not in repr(config)
    assert "proxy_url='http://ops:***@proxy.internal:3128'" in repr(config)
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(proxy_url="http://ops:hunter2@proxy.internal:3128/path")
    assert "hunter2" not in str(caught.value)
    assert "ops:***@proxy.internal" in str(caught.value)

    class Url:  # a URL object, as yarl's or pydantic's: its str() holds the password
        def __str__(self) -> str:
            return "http://ops:hunter2@proxy.internal:3128"

        __repr__ = __str__

    with pytest.raises(ConfigError, match="proxy_url=a Url is invalid") as caught:
        ProducerConfig(proxy_url=Url())  # type: ignore[arg-type]
    assert "hunter2" not in str(caught.value)
    for bad in ("http://ops:hunter2@proxy internal:1", "http://ops:hunter2@proxy:0"):
        with pytest.raises(ConfigError) as caught:
            ProducerConfig(proxy_url=bad)
        assert "hunter2" not in str(caught.value)
        assert caught.value.__cause__ is None
        assert caught.value.__context__ is None


def test_type_lists_cover_every_field() -> None:
    names = {f.name for f in dataclasses.fields(ProducerConfig)}
    secrets = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
    typed = set(BOOL_FIELDS + INT_FIELDS + FLOAT_FIELDS + FRACTION_FIELDS + STR_FIELDS)
    typed |= set(OBJECT_FIELDS)
    assert typed | secrets == names


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_bool_fields_reject_non_bools(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=.* allowed True or False$"):
        ProducerConfig(**{name: value})


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("value", [True, 100.5, "100", None, math.nan, math.inf])
def test_int_fields_reject_bools_fractions_and_non_numbers(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=.* allowed an integer"):
        ProducerConfig(**{name: value})


@pytest.mark.parametrize("name", INT_FIELDS)
def test_int_fields_accept_whole_floats_and_store_ints(name: str) -> None:
    value = getattr(ProducerConfig(), name)
    stored = getattr(ProducerConfig(**{name: float(value)}), name)
    assert type(stored) is int
    assert stored == value


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [True, "1", math.nan, b"1"])
def test_float_fields_reject_bools_nan_and_non_numbers(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}="):
        ProducerConfig(**{name: value})


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_float_fields_accept_ints_and_store_floats(name: str) -> None:
    value = 1 if name == "adaptive_floor" else 5
    stored = getattr(ProducerConfig(**{name: value}), name)
    assert type(stored) is float
    assert stored == float(value)


@pytest.mark.parametrize("name", STR_FIELDS)
def test_str_fields_reject_non_strings(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=5 "):
        ProducerConfig(**{name: 5})


@pytest.mark.parametrize("name", ["connect_timeout", "rate_limit", "record_ttl"])
def test_huge_ints_for_float_fields_are_config_errors(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}="):
        ProducerConfig(**{name: 10**400})


# Python refuses to print an int of more than 4,300 digits (sys.get_int_max_str_digits), so these
# values once broke the error message itself: a bare ValueError instead of a ConfigError.
HUGE = 10**5000
UNBOUNDED_INT_FIELDS = ["max_outstanding_records", "max_outstanding_bytes", "spool_max_bytes"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        *[
            pytest.param(name, HUGE, id=f"{name}-huge")
            for name in INT_FIELDS + FLOAT_FIELDS + FRACTION_FIELDS
            if name not in UNBOUNDED_INT_FIELDS
        ],
        *[
            pytest.param(name, -HUGE, id=f"{name}-minus-huge")
            for name in INT_FIELDS + FLOAT_FIELDS + FRACTION_FIELDS
        ],
    ],
)
def test_ints_too_long_to_print_are_config_errors_naming_the_field(name: str, value: int) -> None:
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(**{name: value})
    assert caught.value.field == name
    assert caught.value.value == value
    sign = "a negative" if value < 0 else "an"
    assert str(caught.value).startswith(f"{name}=<{sign} integer of 5001 digits> is invalid")
    assert len(str(caught.value)) < 200


def test_long_ints_are_described_but_short_ones_printed_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"^max_connections=<an integer of 51 digits> "):
        ProducerConfig(max_connections=10**50)
    with pytest.raises(ConfigError, match=rf"^max_connections={10**49} "):
        ProducerConfig(max_connections=10**49)


@pytest.mark.parametrize("name", UNBOUNDED_INT_FIELDS)
def test_repr_describes_an_int_too_long_to_print(name: str) -> None:
    config = ProducerConfig(**{name: HUGE})
    assert getattr(config, name) == HUGE
    assert f"{name}=<an integer of 5001 digits>" in repr(config)


def test_repr_is_the_dataclass_repr() -> None:
    config = ProducerConfig(
        region="eu-west-1",
        max_outstanding_records=10**40,
        tenant_quotas={"a": config_module.TenantQuota(records_per_second=5)},
    )
    text = repr(config)
    assert text.startswith("ProducerConfig(region='eu-west-1', endpoint_url=None, profile=None, ")
    namespace = {"ProducerConfig": ProducerConfig, "TenantQuota": config_module.TenantQuota}
    assert eval(text, namespace) == config


def test_other_configs_reject_ints_too_long_to_print() -> None:
    with pytest.raises(ConfigError, match=r"^records_per_second=<an integer of 5001 digits> "):
        config_module.TenantQuota(records_per_second=HUGE)
    with pytest.raises(ConfigError, match=r"^burst=<a negative integer of 5001 digits> "):
        config_module.TenantQuota(records_per_second=1, burst=-HUGE)
    with pytest.raises(ConfigError, match=r"^sync_interval=<an integer of 5001 digits> "):
        config_module.FleetConfig(bucket="bucket-1", records_per_second=1, sync_interval=HUGE)
    with pytest.raises(ConfigError, match=r"^tenant_quotas=<a dict> is invalid"):
        ProducerConfig(tenant_quotas={"a": HUGE})  # type: ignore[dict-item]


def test_none_is_rejected_where_it_is_not_allowed() -> None:
    with pytest.raises(ConfigError, match=r"^record_ttl=None "):
        ProducerConfig(record_ttl=None)  # type: ignore[arg-type]


# --- Special cases ------------------------------------------------------------------------


def test_empty_region_means_none() -> None:
    assert ProducerConfig(region="").region is None


@pytest.mark.parametrize("ttl", [1e9, 1e20, (2**63 - 1) / 1000, math.inf])
def test_huge_record_ttl_is_clamped_to_ten_years(ttl: float) -> None:
    assert ProducerConfig(record_ttl=ttl).record_ttl == TEN_YEARS


def test_record_ttl_below_ten_years_is_kept() -> None:
    assert ProducerConfig(record_ttl=86400.0 * 365).record_ttl == 86400.0 * 365


def test_retry_backoff_max_may_equal_initial() -> None:
    config = ProducerConfig(retry_backoff_initial=60, retry_backoff_max=60)
    assert config.retry_backoff_max == config.retry_backoff_initial == 60.0


def test_credentials_must_come_in_pairs() -> None:
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(aws_access_key_id="AKIDEXAMPLE")
    assert caught.value.field == "aws_secret_access_key"
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(aws_secret_access_key="secret")
    assert caught.value.field == "aws_access_key_id"
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(aws_session_token="token")
    assert caught.value.field == "aws_access_key_id"
    full = ProducerConfig(
        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", aws_session_token="tok"
    )
    assert full.aws_session_token == "tok"


# --- Secrets, immutability, replace -------------------------------------------------------


def test_repr_hides_secrets() -> None:
    config = ProducerConfig(
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="wJalrXUtnFEMI-SECRET",
        aws_session_token="FwoGZXIvYXdzE-TOKEN",
    )
    text = repr(config)
    assert "SECRET" not in text
    assert "TOKEN" not in text
    assert "aws_secret_access_key" not in text
    assert "aws_session_token" not in text
    assert "AKIDEXAMPLE" in text
    assert config.aws_secret_access_key == "wJalrXUtnFEMI-SECRET"


@pytest.mark.parametrize("name", ["aws_secret_access_key", "aws_session_token"])
def test_error_messages_hide_secrets(name: str) -> None:
    # A wrong type reaches the error path with a value that must not be echoed.
    values: dict[str, Any] = {"aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "ok"}
    values[name] = b"TOP-SECRET"
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(**values)
    assert caught.value.field == name
    assert "TOP-SECRET" not in str(caught.value)
    assert "TOP-SECRET" not in repr(caught.value.value)


def test_frozen() -> None:
    config = ProducerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rate_limit = 150.0  # type: ignore[misc]
    assert not hasattr(config, "__dict__")


def test_equal_and_hashable() -> None:
    assert ProducerConfig(rate_limit=150) == ProducerConfig(rate_limit=150.0)
    assert hash(ProducerConfig()) == hash(ProducerConfig())


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        ProducerConfig("us-east-1")  # type: ignore[call-arg]


def test_replace_returns_a_changed_copy() -> None:
    config = ProducerConfig()
    changed = config.replace(rate_limit=150, region="eu-west-1")
    assert changed.rate_limit == 150.0
    assert changed.region == "eu-west-1"
    assert config.rate_limit == 100.0
    assert config.region is None


def test_replace_validates() -> None:
    with pytest.raises(ConfigError, match=r"^max_connections=0 .*1\.\.256"):
        ProducerConfig().replace(max_connections=0)
    with pytest.raises(ConfigError, match=r"^retry_backoff_max="):
        ProducerConfig().replace(retry_backoff_initial=10.0)


def test_replace_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError):
        ProducerConfig().replace(no_such_field=1)


# --- The docs and the exports -------------------------------------------------------------


def test_docstring_documents_every_field() -> None:
    # cleandoc: Python 3.13 strips the docstring's indentation when it compiles it, 3.12 and
    # older keep it
    doc = inspect.cleandoc(ProducerConfig.__doc__ or "")
    attributes = doc.split("Attributes:")[1]
    for f in dataclasses.fields(ProducerConfig):
        assert re.search(rf"^    {f.name}: ", attributes, re.MULTILINE), f.name


def test_every_fields_docstring_states_its_default_as_the_code_has_it() -> None:
    """The ``Attributes:`` entry of each field says its default ("Default ``None``",
    "Default 1048576", "``"wait"`` ... (the default", "Default: none" for an empty mapping),
    and it is the dataclass's default: the docstrings, and the configuration reference made from
    them, stay in step with the code."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    try:
        from gen_config_reference import _docstring_fields
    finally:
        sys.path.pop(0)
    entries = _docstring_fields(ProducerConfig)
    stated = re.compile(
        r"\bDefault:? (?:``(?P<literal>[^`]+)``|(?P<number>-?[0-9][0-9,]*(?:\.[0-9]+)?)\b"
        r"|(?P<none>none)\b)"
        r"|``(?P<choice>[^`]+)``[^`]*?\(the default\b"
    )
    for f in dataclasses.fields(ProducerConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        match = stated.search(entries[f.name])
        assert match is not None, f"{f.name}: its docstring does not say its default"
        if match["none"] is not None:
            assert default in ({}, ()), f.name
            continue
        raw = match["literal"] or match["choice"] or match["number"].replace(",", "")
        assert ast.literal_eval(raw) == default, (f.name, raw, default)


def test_docs_page_documents_every_field() -> None:
    page = Path(__file__).parents[1] / "docs" / "configuration.md"
    text = page.read_text(encoding="utf-8")
    for f in dataclasses.fields(ProducerConfig):
        assert f"`{f.name}`" in text, f.name


def test_module_all() -> None:
    assert config_module.__all__ == (
        "FleetConfig",
        "ProducerConfig",
        "StreamSettings",
        "TenantQuota",
    )


@pytest.mark.parametrize(("interval", "lease"), [(1.0, 1.0), (1.0, 1.99), (5.0, 9.0)])
def test_a_fleet_lease_must_be_at_least_two_sync_intervals(interval: float, lease: float) -> None:
    # a grant that expires before its worker's next read drops it to the safe rate every cycle
    with pytest.raises(ConfigError, match="lease"):
        config_module.FleetConfig(
            bucket="bucket-1", records_per_second=10, sync_interval=interval, lease=lease
        )
    fleet = config_module.FleetConfig(
        bucket="bucket-1", records_per_second=10, sync_interval=interval, lease=2 * interval
    )
    assert fleet.lease == 2 * interval
    assert config_module.FleetConfig(bucket="bucket-1", records_per_second=10).lease == 15.0


# --- ca_bundle -------------------------------------------------------------------------------


def test_ca_bundle_defaults_to_none_and_takes_a_file_as_str_or_path(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n", encoding="ascii")
    assert ProducerConfig().ca_bundle is None
    assert ProducerConfig(ca_bundle=str(bundle)).ca_bundle == str(bundle)
    # a path object is stored as a str: the config stays hashable and its repr plain
    assert ProducerConfig(ca_bundle=bundle).ca_bundle == str(bundle)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", r"the path of an existing PEM file of CA certificates$"),
        ("  ", r"the path of an existing PEM file of CA certificates$"),
        (1, r"the path of an existing PEM file of CA certificates$"),
        (True, r"the path of an existing PEM file of CA certificates$"),
        ("missing.pem", r"the path of an existing PEM file of CA certificates$"),
        (".", r"\(not a directory: aiobotocore loads one file; concatenate"),
    ],
)
def test_ca_bundle_must_name_an_existing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: object, why: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^ca_bundle=.* allowed None or .*{why}") as caught:
        ProducerConfig(ca_bundle=value)  # type: ignore[arg-type]
    assert caught.value.field == "ca_bundle"


# -- per-stream settings ----------------------------------------------------------------------


def test_stream_settings_apply_to_their_stream_only() -> None:
    settings = config_module.StreamSettings(record_ttl=60, aggregation_enabled=False)
    config = ProducerConfig(record_max_buffered_time=0.5, streams={"s": settings})
    mine = config.for_stream("s")
    assert mine.record_ttl == 60.0
    assert type(mine.record_ttl) is float  # validated like the producer's field
    assert mine.aggregation_enabled is False
    assert mine.record_max_buffered_time == 0.5  # the producer's, not overridden
    assert config.for_stream("other") is config
    assert config.record_ttl == 30.0


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"record_ttl": -1}, "record_ttl"),
        ({"collection_max_size": 10**9}, "collection_max_size"),
        ({"rate_limit": 0}, "rate_limit"),
        ({"aggregation_enabled": "yes"}, "aggregation_enabled"),
        ({"record_ttl": 10**5000}, "record_ttl"),
    ],
)
def test_bad_stream_settings_name_the_stream_and_the_field(
    settings: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        ProducerConfig(streams={"orders": config_module.StreamSettings(**settings)})
    assert caught.value.field == f"streams['orders'].{field}"
    assert len(str(caught.value)) < 300


@pytest.mark.parametrize(
    "streams", [{"s": {"record_ttl": 5}}, {"": config_module.StreamSettings()}, ["s"]]
)
def test_streams_takes_stream_settings_by_stream(streams: Any) -> None:
    with pytest.raises(ConfigError, match=r"^streams="):
        ProducerConfig(streams=streams)


def test_stream_settings_are_frozen_and_hashable() -> None:
    given = {"s": config_module.StreamSettings(record_ttl=5)}
    config = ProducerConfig(streams=given)
    given["t"] = config_module.StreamSettings()
    assert list(config.streams) == ["s"]
    assert hash(config) == hash(
        ProducerConfig(streams={"s": config_module.StreamSettings(record_ttl=5)})
    )


# --- The spool ----------------------------------------------------------------------------


def test_spool_settings() -> None:
    config = ProducerConfig(spool_dir=Path("/var/spool/anykpl"), spool_fsync="commit")
    assert config.spool_dir == Path("/var/spool/anykpl")
    assert config.spool_max_bytes == 512 * 1024 * 1024
    with pytest.raises(ConfigError, match=r"^spool_dir='' "):
        ProducerConfig(spool_dir="")
    with pytest.raises(ConfigError, match=r"^spool_fsync='always' .*'off', 'commit', 'interval'"):
        ProducerConfig(spool_fsync="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^spool_max_bytes=1048576 .*>= 4194304"):
        ProducerConfig(spool_max_bytes=1 << 20)
