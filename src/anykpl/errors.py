"""The exceptions anykpl raises, and the error codes a record's attempts can carry.

The hierarchy (and whether anykpl or the caller may retry)::

    AnyKplError                              base of everything anykpl raises
    ├── ConfigError (ValueError)             invalid ProducerConfig value      not retriable
    ├── InvalidRecordError (ValueError)      bad input at put_record/submit    not retriable
    ├── RecordTypeError (TypeError)          wrong argument type (str data)    not retriable
    ├── ProducerClosedError                  put after (or during) close       not retriable
    ├── BackpressureTimeout (TimeoutError)   admission_timeout ran out         caller may retry
    ├── TenantQuotaExceeded                  tenant over its quota, with       caller decides
    │                                        tenant_overflow="reject"; nothing was enqueued
    │                                        (.retry_after says when its tokens are back)
    ├── FlushTimeout (TimeoutError)          flush(timeout=...) ran out        caller may retry
    ├── PutTimeout (TimeoutError)            SyncProducer.put_record(timeout=)  not retriable
    │                                        ran out after admission; the record is still in
    │                                        flight (.future); putting it again duplicates it
    ├── AggregationFormatError (ValueError)  corrupt aggregated record         not retriable
    ├── SpoolError (OSError)                 spool_dir unusable (not writable,  not retriable
    │   │                                    disk full); nothing was enqueued
    │   └── SpoolLockedError                 another producer owns spool_dir    not retriable
    └── RecordFailedError                    a record failed; .result has every Attempt

Record-level outcomes are not exceptions until they reach the caller: the Sender translates
botocore errors into an error *code* at its boundary (nowhere else), the Retrier classifies the
code, and the final :class:`RecordFailedError` carries the attempts. :func:`is_retriable` is the
single place that says which codes are retried.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    # a module of plain values that imports nothing: errors.py imports nothing of anykpl's
    from ._core._results import RecordResult

__all__ = (
    "AggregationFormatError",
    "AnyKplError",
    "BackpressureTimeout",
    "ConfigError",
    "FlushTimeout",
    "InvalidRecordError",
    "ProducerClosedError",
    "PutTimeout",
    "RecordFailedError",
    "RecordTypeError",
    "SpoolError",
    "SpoolLockedError",
    "TenantQuotaExceeded",
    "is_retriable",
)


class AnyKplError(Exception):
    """Base class of every exception anykpl raises."""

    retriable: bool = False


class ConfigError(AnyKplError, ValueError):
    """A configuration value is invalid. Not retriable: fix the configuration.

    ``field``, ``value`` and ``allowed`` say which field, what it was given and what it accepts.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: allowed {allowed}")


class InvalidRecordError(AnyKplError, ValueError):
    """A record was rejected at the call (empty or long partition key, bad explicit hash key,
    too large, bad stream name). Nothing was enqueued. Not retriable."""


class RecordTypeError(AnyKplError, TypeError):
    """A record argument has the wrong type (for example ``str`` data). Nothing was enqueued."""


class ProducerClosedError(AnyKplError):
    """The producer is closed or closing, or was never started. Nothing was enqueued by the
    call that raised it, except, from ``submit_many``, the records admitted before the producer
    began closing: their handles are in ``admitted`` (they go on, and the close flushes them)."""

    #: handles of the records ``submit_many`` admitted before the producer began closing
    admitted: tuple[Any, ...] = ()


class BackpressureTimeout(AnyKplError, TimeoutError):
    """``admission_timeout`` ran out while waiting for room under ``max_outstanding_*``.
    Nothing was enqueued by the call that raised it, except, from ``submit_many``, the records
    before the one that waited: their handles are in ``admitted`` (they go on). Retriable by
    the caller."""

    retriable = True
    #: handles of the records ``submit_many`` admitted before it ran out of time
    admitted: tuple[Any, ...] = ()


class SpoolError(AnyKplError, OSError):
    """The spool directory (``spool_dir``) cannot be used: it cannot be created or written,
    or a new segment cannot be allocated (a full disk). Raised when the producer opens, or by
    the ``submit`` whose record needed the new segment; that record was not enqueued (from
    ``submit_many``, ``admitted`` holds the handles of the records admitted before it)."""

    #: handles of the records ``submit_many`` admitted before it
    admitted: tuple[Any, ...] = ()


class SpoolLockedError(SpoolError):
    """Another producer (in this process or another) owns the spool directory. One producer at
    a time owns a ``spool_dir``; a lock left by a process that is gone is taken over."""


class _Quota(Protocol):
    """What :class:`TenantQuotaExceeded` says of a quota: :class:`anykpl.TenantQuota` is one.
    A protocol rather than the class, which is validated with :class:`ConfigError` from here."""

    @property
    def records_per_second(self) -> float | None: ...
    @property
    def bytes_per_second(self) -> float | None: ...
    @property
    def burst(self) -> float: ...
    def describe(self) -> str: ...


class TenantQuotaExceeded(AnyKplError):
    """A record put with ``tenant=`` found its tenant over its quota, and
    ``tenant_overflow="reject"`` said to refuse it rather than wait. Nothing was enqueued and
    nothing was taken from the quota, except, from ``submit_many``, the records before the one
    refused: their handles are in ``admitted`` (they go on).

    ``tenant`` and ``quota`` (its :class:`~anykpl.TenantQuota`) say whose quota it was;
    ``retry_after`` is how many seconds until the tenant's tokens would cover this record.
    The producer never retries it; the caller decides: put it again after ``retry_after``,
    shed it, or answer its own caller with "slow down" (an HTTP 429, say). ``retriable`` is
    ``True``: the same put can succeed later.
    """

    retriable = True
    #: handles of the records ``submit_many`` admitted before the one refused
    admitted: tuple[Any, ...] = ()

    def __init__(self, tenant: str, quota: _Quota, retry_after: float) -> None:
        self.tenant = tenant
        self.quota = quota
        self.retry_after = retry_after
        super().__init__(
            f"tenant {tenant!r} is over its quota ({quota.describe()}); nothing was "
            f"enqueued: its tokens cover this record again in {retry_after:.3f} s"
        )


class FlushTimeout(AnyKplError, TimeoutError):
    """``flush(timeout=...)`` ran out before every record was terminal. The records continue;
    nothing was failed. Retriable by the caller."""

    retriable = True


class PutTimeout(AnyKplError, TimeoutError):
    """``SyncProducer.put_record(timeout=...)`` ran out after the record was admitted but before
    it was terminal. The record was *not* withdrawn: it is still in flight and will be delivered
    or fail as usual. ``future`` is its :class:`concurrent.futures.Future`, to wait again or to
    check later. Not retriable: putting the record again would duplicate it.

    (A ``timeout`` that runs out while the record still waits for room raises
    :class:`BackpressureTimeout` instead: then nothing was enqueued.)
    """

    def __init__(self, message: str, future: Future[RecordResult]) -> None:
        super().__init__(message)
        self.future = future


class AggregationFormatError(AnyKplError, ValueError):
    """Bytes that claim to be a KPL aggregated record (magic prefix) are corrupt: bad checksum,
    truncated or invalid protobuf. Not retriable."""


class RecordFailedError(AnyKplError):
    """A record ended in failure. ``result`` is its :class:`~anykpl.RecordResult`, whose
    ``attempts`` hold every attempt with its error code and message. Not retriable by anykpl
    any more (it already retried what was retriable)."""

    def __init__(self, result: RecordResult) -> None:
        self.result = result
        last = result.attempts[-1] if result.attempts else None
        detail = f"{last.error_code}: {last.error_message}" if last else "no attempts"
        super().__init__(f"record failed after {len(result.attempts)} attempt(s): {detail}")

    @property
    def error_code(self) -> str | None:
        """The error code of the last attempt."""
        return self.result.attempts[-1].error_code if self.result.attempts else None


# Error codes. Kinesis's own per-record codes and exception names pass through unchanged; these
# are the synthetic ones the KPL defines (aws/kinesis/core/retrier.cc) plus our transport codes.
EXPIRED = "Expired"
WRONG_SHARD = "Wrong Shard"
RECORD_COUNT_MISMATCH = "Record Count Mismatch"
THROTTLED = "ProvisionedThroughputExceededException"
PRODUCER_CLOSED = "ProducerClosed"
PIPELINE_FAILED = "PipelineFailed"
TIMEOUT = "Timeout"
CONNECTION_ERROR = "ConnectionError"

# Codes that end a record at once. The KPL retries everything until the TTL (retrier.cc); we
# fail fast where a retry cannot help (docs/errors.md).
_NON_RETRIABLE = frozenset(
    {
        "ResourceNotFoundException",
        "AccessDeniedException",
        "AccessDenied",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "InvalidArgumentException",
        "ValidationException",
        "SerializationException",
        "InvalidParameterValue",
        "InvalidParameterCombination",
        "MissingParameter",
        "KMSAccessDeniedException",
        "KMSDisabledException",
        "KMSInvalidStateException",
        "KMSNotFoundException",
        "KMSOptInRequired",
        "KMSInvalidKeyUsageException",
        "ParamValidationError",
        "NoCredentialsError",
        RECORD_COUNT_MISMATCH,
        EXPIRED,
        PRODUCER_CLOSED,
        PIPELINE_FAILED,
    }
)


def is_retriable(error_code: str) -> bool:
    """Whether a record that failed with ``error_code`` is retried (until its TTL).

    Retriable: throttling, InternalFailure, ServiceUnavailable, 5xx, timeouts, connection
    errors, Wrong Shard, and any code we do not know (as the KPL does). Not retriable: missing
    streams, access and signature errors, validation and KMS access errors, Record Count
    Mismatch, and our terminal codes.
    """
    return error_code not in _NON_RETRIABLE
