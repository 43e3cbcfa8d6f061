"""What the emulator can be told: shard limits, faults, throttle storms, scheduled reshards and
the HTTP server's own limits.

Each is a small frozen dataclass that travels three ways: as Python arguments (``Emulator``,
``spawn``), as JSON over the control endpoint (``EmulatorClient``), and as command-line specs
(``anykpl emulator --storm ... --reshard ...``). ``to_json``/``from_json`` and ``parse`` are the
only conversions, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .._core._limits import (
    PUT_RECORDS_MAX_BYTES,
    PUT_RECORDS_MAX_RECORDS,
    SHARD_BYTES_PER_SECOND,
    SHARD_RECORDS_PER_SECOND,
)

__all__ = ("Faults", "HttpLimits", "Limits", "Reshard", "Storm", "from_json", "to_json")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Limits:
    """Per-shard write limits, as the service enforces them (data + partition key bytes).

    Each shard has a records bucket and a bytes bucket holding one second of its rate; a record
    is stored only if both hold enough for it, otherwise it gets
    ``ProvisionedThroughputExceededException``. ``enabled=False`` accepts any rate.
    """

    enabled: bool = True
    records_per_second: float = SHARD_RECORDS_PER_SECOND
    bytes_per_second: float = SHARD_BYTES_PER_SECOND

    @classmethod
    def off(cls) -> Limits:
        return cls(enabled=False)

    def __post_init__(self) -> None:
        for name in ("records_per_second", "bytes_per_second"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Faults:
    """Faults injected into the write path (PutRecord and PutRecords); the control plane
    (ListShards, GetRecords, S3, ...) is never faulted.

    Attributes:
        error_rate: share of write requests answered with a whole-request 500 or 503
            (``InternalFailure`` / ``ServiceUnavailable``), chosen evenly.
        record_failure_rate: share of records answered with a per-record ``InternalFailure``.
        record_throttle_rate: share of records answered with a per-record
            ``ProvisionedThroughputExceededException``, whatever the rate: throttles that are
            noise, not a sign of a full shard. They cost no shard tokens and are counted as
            throttled records (and as ``injected_throttled_records``).
        latency: seconds added before each write request is answered.
        latency_jitter: up to this many seconds more, uniformly at random.
        reset_rate: share of write requests whose connection is reset with no answer.
        fault_after_write: share of injected request errors and resets that happen *after* the
            request's records were stored. The client cannot tell, so its retry makes
            duplicates, as it does against the service.
        seed: seed of the fault dice (``None``: a fresh random seed).
    """

    error_rate: float = 0.0
    record_failure_rate: float = 0.0
    record_throttle_rate: float = 0.0
    latency: float = 0.0
    latency_jitter: float = 0.0
    reset_rate: float = 0.0
    fault_after_write: float = 0.5
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "error_rate",
            "record_failure_rate",
            "record_throttle_rate",
            "reset_rate",
            "fault_after_write",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"Faults.{name} must be between 0 and 1, got {value!r}")
        for name in ("latency", "latency_jitter"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 60.0):
                raise ValueError(f"Faults.{name} must be between 0 and 60 seconds, got {value!r}")
        if self.error_rate + self.reset_rate > 1.0:
            raise ValueError("Faults.error_rate + Faults.reset_rate must not exceed 1")
        if self.record_failure_rate + self.record_throttle_rate > 1.0:
            raise ValueError(
                "Faults.record_failure_rate + Faults.record_throttle_rate must not exceed 1"
            )


#: The largest valid PutRecords body: 5 MiB of data in base64 (4/3 of it), and per record its
#: JSON around it (``{"Data":"","PartitionKey":"","ExplicitHashKey":""},``: 50 bytes), a
#: 256-character partition key written as ``\uXXXX`` escapes (1,536 bytes) and a 39-digit
#: explicit hash key. About 7.4 MiB.
LARGEST_PUT_RECORDS_BODY = -(-PUT_RECORDS_MAX_BYTES * 4 // 3) + PUT_RECORDS_MAX_RECORDS * (
    50 + 256 * 6 + 39
)
#: The default request body cap: four times the largest valid PutRecords body, rounded to 32 MiB.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """What the emulator's HTTP server tolerates from a client.

    Attributes:
        max_body_bytes: the largest request body accepted (Content-Length, or the chunks of a
            chunked body, summed); a larger one is answered 413 and its connection closed. The
            default, 32 MiB, is four times the largest valid PutRecords request (5 MiB of data
            is about 7.4 MiB of JSON), holds the 10 MiB requests of a stream whose maximum
            record size was raised (about 13.4 MiB) and any S3 object the project writes. The
            least it may be is the 5 MiB request's body; below 13.4 MiB, a stream with large
            records gets 413s.
        read_timeout: seconds a connection may wait before a request's first byte (idle
            keep-alive connections are then closed), and seconds a request's head and body may
            take to arrive after it (it is then answered 408 and its connection closed). Idle or
            half-open connections cannot pile up.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.max_body_bytes, int)
            and not isinstance(self.max_body_bytes, bool)
            and self.max_body_bytes >= LARGEST_PUT_RECORDS_BODY
        ):
            raise ValueError(
                f"HttpLimits.max_body_bytes must be an integer of at least "
                f"{LARGEST_PUT_RECORDS_BODY} (the largest valid PutRecords body), got "
                f"{self.max_body_bytes!r}"
            )
        value = self.read_timeout
        if not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        ):
            raise ValueError(f"HttpLimits.read_timeout must be positive seconds, got {value!r}")


@dataclass(frozen=True)
class Storm:
    """A throttle storm: a shard's limits (or every shard's of a stream, ``shard_id=None``)
    multiplied by ``factor`` for ``duration`` seconds, starting ``start`` seconds after it is
    scheduled."""

    stream: str
    duration: float
    factor: float = 0.1
    shard_id: str | None = None
    start: float = 0.0

    def __post_init__(self) -> None:
        if not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"Storm.duration must be positive, got {self.duration!r}")
        if not (0.0 <= self.factor < 1.0):
            raise ValueError(f"Storm.factor must be in [0, 1), got {self.factor!r}")
        if not (self.start >= 0 and math.isfinite(self.start)):
            raise ValueError(f"Storm.start must be >= 0, got {self.start!r}")

    @classmethod
    def parse(cls, spec: str) -> Storm:
        """``stream:shard:start:duration[:factor]``; shard ``*`` means every shard."""
        parts = spec.split(":")
        if len(parts) not in (4, 5):
            raise ValueError(f"storm spec {spec!r} is not stream:shard:start:duration[:factor]")
        stream, shard, start, duration = parts[:4]
        factor = float(parts[4]) if len(parts) == 5 else 0.1
        return cls(
            stream=stream,
            shard_id=None if shard in ("", "*") else shard,
            start=float(start),
            duration=float(duration),
            factor=factor,
        )


@dataclass(frozen=True)
class Reshard:
    """A reshard ``at`` seconds after it is scheduled: ``split`` a shard at the middle of its
    hash range, ``merge`` it with its adjacent open shard, or ``scale`` the stream to
    ``target`` open shards (UpdateShardCount). ``shard_id=None`` picks the open shard with the
    lowest hash range."""

    stream: str
    action: Literal["split", "merge", "scale"]
    at: float = 0.0
    shard_id: str | None = None
    target: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ("split", "merge", "scale"):
            raise ValueError(f"Reshard.action must be split, merge or scale, not {self.action!r}")
        if self.action == "scale" and not (isinstance(self.target, int) and self.target > 0):
            raise ValueError("Reshard(action='scale') needs a positive target shard count")
        if not (self.at >= 0 and math.isfinite(self.at)):
            raise ValueError(f"Reshard.at must be >= 0, got {self.at!r}")

    @classmethod
    def parse(cls, spec: str) -> Reshard:
        """``stream:split|merge:shard|*:at`` or ``stream:scale:target:at``."""
        parts = spec.split(":")
        if len(parts) != 4:
            raise ValueError(
                f"reshard spec {spec!r} is not stream:split|merge:shard:at or stream:scale:N:at"
            )
        stream, action, what, at = parts
        if action == "scale":
            return cls(stream=stream, action="scale", target=int(what), at=float(at))
        if action not in ("split", "merge"):
            raise ValueError(f"reshard action must be split, merge or scale, not {action!r}")
        return cls(
            stream=stream,
            action="split" if action == "split" else "merge",
            shard_id=None if what in ("", "*") else what,
            at=float(at),
        )


def to_json(options: Any) -> dict[str, Any]:
    """A dataclass as a JSON-able dict."""
    return dataclasses.asdict(options)


def from_json(cls: type[_T], data: dict[str, Any]) -> _T:
    """Build ``cls`` from a JSON dict, rejecting unknown fields with a clear error."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object, got {data!r}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
    return cls(**data)
