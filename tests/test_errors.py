"""The exception tree and the retriable-code table."""

from __future__ import annotations

import pytest

from anykpl import RecordResult, errors
from anykpl._core._records import Attempt


@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (errors.ConfigError, (ValueError,)),
        (errors.InvalidRecordError, (ValueError,)),
        (errors.RecordTypeError, (TypeError,)),
        (errors.ProducerClosedError, ()),
        (errors.BackpressureTimeout, (TimeoutError,)),
        (errors.TenantQuotaExceeded, ()),
        (errors.FlushTimeout, (TimeoutError,)),
        (errors.AggregationFormatError, (ValueError,)),
        (errors.RecordFailedError, ()),
    ],
)
def test_hierarchy(cls: type[Exception], bases: tuple[type[Exception], ...]) -> None:
    assert issubclass(cls, errors.AnyKplError)
    assert issubclass(errors.AnyKplError, Exception)
    for base in bases:
        assert issubclass(cls, base)


def test_every_exported_exception_is_an_anykpl_error() -> None:
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.AnyKplError), name


@pytest.mark.parametrize(
    ("cls", "retriable"),
    [
        (errors.AnyKplError, False),
        (errors.ConfigError, False),
        (errors.InvalidRecordError, False),
        (errors.RecordTypeError, False),
        (errors.ProducerClosedError, False),
        (errors.BackpressureTimeout, True),
        (errors.TenantQuotaExceeded, True),
        (errors.FlushTimeout, True),
        (errors.AggregationFormatError, False),
        (errors.RecordFailedError, False),
    ],
)
def test_retriable_flag(cls: type[errors.AnyKplError], retriable: bool) -> None:
    assert cls.retriable is retriable


def test_config_error_names_field_value_and_range() -> None:
    exc = errors.ConfigError("rate_limit", 0.5, "1 to 9223372036854775807 percent")
    assert exc.field == "rate_limit"
    assert exc.value == 0.5
    assert exc.allowed == "1 to 9223372036854775807 percent"
    message = str(exc)
    assert "rate_limit" in message
    assert "0.5" in message
    assert "1 to 9223372036854775807 percent" in message
    assert isinstance(exc, ValueError)


def test_config_error_from_producer_config() -> None:
    from anykpl import ProducerConfig

    with pytest.raises(errors.ConfigError) as info:
        ProducerConfig(record_ttl=-1.0)
    assert info.value.field == "record_ttl"
    assert info.value.value == -1.0
    assert "record_ttl" in str(info.value)


@pytest.mark.parametrize(
    "code",
    [
        "ResourceNotFoundException",
        "AccessDeniedException",
        "AccessDenied",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "ValidationException",
        "InvalidArgumentException",
        "KMSAccessDeniedException",
        "KMSDisabledException",
        "KMSInvalidStateException",
        "KMSNotFoundException",
        "KMSOptInRequired",
        "KMSInvalidKeyUsageException",
        errors.RECORD_COUNT_MISMATCH,
        errors.EXPIRED,
        errors.PRODUCER_CLOSED,
        errors.PIPELINE_FAILED,
    ],
)
def test_not_retriable_codes(code: str) -> None:
    assert not errors.is_retriable(code)


@pytest.mark.parametrize(
    "code",
    [
        errors.THROTTLED,
        "InternalFailure",
        "ServiceUnavailable",
        "HTTP500",
        "HTTP502",
        "HTTP503",
        errors.TIMEOUT,
        errors.CONNECTION_ERROR,
        errors.WRONG_SHARD,
        "SomeCodeFromTheFuture",
    ],
)
def test_retriable_codes(code: str) -> None:
    assert errors.is_retriable(code)


def test_synthetic_codes_are_the_kpls() -> None:
    assert errors.EXPIRED == "Expired"
    assert errors.WRONG_SHARD == "Wrong Shard"
    assert errors.RECORD_COUNT_MISMATCH == "Record Count Mismatch"
    assert errors.THROTTLED == "ProvisionedThroughputExceededException"


def test_record_failed_error_carries_the_result() -> None:
    result = RecordResult(
        success=False,
        shard_id=None,
        sequence_number=None,
        sub_sequence_number=None,
        attempts=(
            Attempt(0.1, 0.2, False, errors.THROTTLED, "slow down"),
            Attempt(0.0, 0.0, False, errors.EXPIRED, "Record has reached expiration"),
        ),
    )
    exc = errors.RecordFailedError(result)
    assert exc.result is result
    assert exc.error_code == errors.EXPIRED
    assert "2 attempt(s)" in str(exc)
    assert "Expired: Record has reached expiration" in str(exc)
    assert not exc.retriable


def test_record_failed_error_without_attempts() -> None:
    result = RecordResult(False, None, None, None, ())
    exc = errors.RecordFailedError(result)
    assert exc.error_code is None
    assert "no attempts" in str(exc)


def test_tenant_quota_exceeded_names_the_tenant_and_its_quota() -> None:
    from anykpl import TenantQuota

    quota = TenantQuota(records_per_second=100, bytes_per_second=65536, burst=0.5)
    exc = errors.TenantQuotaExceeded("acme", quota, 0.25)
    assert (exc.tenant, exc.quota, exc.retry_after) == ("acme", quota, 0.25)
    message = str(exc)
    assert "'acme'" in message
    assert "100 records/s, 65536 bytes/s, burst 0.5 s" in message
    assert "0.250 s" in message
    assert "nothing was enqueued" in message
