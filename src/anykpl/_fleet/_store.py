"""The store the fleet coordinates through: :class:`Store`, the few calls members make
(conditional PUT, GET, LIST, conditional DELETE of small objects), and :class:`S3Store`, those
calls on S3. ``_dynamodb_store.py`` has them on DynamoDB; members and the allocator do not know
which one they talk to.

Each call is bounded in time and each answer fed to the store's clock. A conditional write or
delete that loses raises :class:`Conflict`; a missing object is ``None``; every other error
propagates for the member to count and log. See docs/fleet.md.
"""

from __future__ import annotations

import email.utils
import math
from collections import Counter
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Final, Protocol

import anyio

from ..config import FleetConfig
from ._clock import ServerClock
from ._documents import MAX_DOCUMENT_BYTES, DocumentError

__all__ = ("KINDS", "Conflict", "S3Store", "Store")

_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


#: the S3 API's name of each call, as the requests are counted and priced
KINDS: Final = MappingProxyType(
    {
        "put_object": "PutObject",
        "get_object": "GetObject",
        "list_objects_v2": "ListObjectsV2",
        "delete_object": "DeleteObject",
    }
)


class Conflict(Exception):
    """A conditional write or delete lost: someone else changed the object first — or, when
    ``retried``, maybe this member's own first try, whose answer was lost."""

    retried = False


class Store(Protocol):
    """The calls a fleet member makes of its store. Keys are ``<prefix>/<name>``; times are
    the store's (epoch seconds), as its clock (:class:`ServerClock`) learns them."""

    #: the shortest round trip of a dated answer: how well the store's clock can be known
    round_trip: float
    #: the requests made, by the kind the store's price list names
    requests: Counter[str]

    def key(self, name: str) -> str: ...

    async def put(
        self, key: str, body: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Write an object; return its version tag. :class:`Conflict` if a condition fails
        (``if_match`` on an object that is gone included)."""
        ...

    async def get(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, version tag, last modified)`` of an object, or ``None``."""
        ...

    async def list(self, prefix: str) -> list[tuple[str, float, str]]:
        """``(key, last modified, version tag)`` of every object under ``prefix``."""
        ...

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete an object (nothing if it is gone); :class:`Conflict` if ``if_match`` fails."""
        ...


class S3Store:
    """The few S3 calls of the coordinator, each bounded in time and fed to S3's clock."""

    def __init__(
        self,
        client: Any,
        fleet: FleetConfig,
        clock: ServerClock,
        timeout: float,
        requests: Counter[str] | None = None,
        now: Callable[[], float] = anyio.current_time,
    ) -> None:
        self._client = client
        self._now = now  # the member's local clock
        #: the requests made, by kind (shared by the stores a member opens one after another)
        self.requests: Counter[str] = Counter() if requests is None else requests
        self._bucket = fleet.bucket
        self._prefix = fleet.prefix.rstrip("/")
        self._clock = clock
        self._timeout = timeout
        #: the shortest round trip of a dated answer: how well S3's clock can be known
        self.round_trip = math.inf

    def key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _observe(self, response: Any, sent_at: float, *, written: bool) -> None:
        headers = (response or {}).get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
        # S3 dates every answer; a server that does not (moto) still dates what it stores,
        # and a write's Last-Modified is the time of the write.
        stamp = headers.get("date") or (headers.get("last-modified") if written else None)
        if not stamp:
            return
        try:
            when = email.utils.parsedate_to_datetime(stamp).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        received_at = self._now()
        self.round_trip = min(self.round_trip, received_at - sent_at)
        self._clock.observe(when, sent_at, received_at)

    async def _call(self, operation: str, *, written: bool = False, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        sent_at = self._now()
        self.requests[KINDS[operation]] += 1
        try:
            with anyio.fail_after(self._timeout):
                response = await getattr(self._client, operation)(Bucket=self._bucket, **kwargs)
        except ClientError as exc:
            self._observe(exc.response, sent_at, written=False)
            raise
        self._observe(response, sent_at, written=written)
        return response

    async def put(
        self, key: str, body: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Write an object; return its ETag. Raises :class:`Conflict` if a condition fails."""
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Key": key, "Body": body, "ContentType": "application/json"}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        try:
            response = await self._call("put_object", written=True, **kwargs)
        except ClientError as exc:
            code = _code(exc)
            if code in _CONFLICT_CODES or (if_match is not None and code in _MISSING_CODES):
                raise Conflict(code) from None
            raise
        return str(response.get("ETag", ""))

    async def get(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, ETag, LastModified)`` of an object, or ``None`` if there is none."""
        from botocore.exceptions import ClientError

        sent_at = self._now()
        self.requests["GetObject"] += 1
        try:
            with anyio.fail_after(self._timeout):
                response = await self._client.get_object(Bucket=self._bucket, Key=key)
                length = response.get("ContentLength")
                async with response["Body"] as stream:
                    if isinstance(length, int) and length > MAX_DOCUMENT_BYTES:
                        raise DocumentError(f"{key} is {length} bytes, over {MAX_DOCUMENT_BYTES}")
                    data = await stream.read()
        except ClientError as exc:
            self._observe(exc.response, sent_at, written=False)
            if _code(exc) in _MISSING_CODES:
                return None
            raise
        self._observe(response, sent_at, written=False)
        return bytes(data), str(response.get("ETag", "")), _epoch(response.get("LastModified"))

    async def list(self, prefix: str) -> list[tuple[str, float, str]]:
        """``(key, LastModified, ETag)`` of every object under ``prefix``."""
        found: list[tuple[str, float, str]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            response = await self._call("list_objects_v2", **kwargs)
            for item in response.get("Contents", ()) or ():
                found.append(
                    (str(item["Key"]), _epoch(item.get("LastModified")), str(item.get("ETag")))
                )
            if not response.get("IsTruncated"):
                return found
            token = response.get("NextContinuationToken")
            if not token:  # a listing cut short must not pass for the whole of it
                raise RuntimeError(f"ListObjectsV2 of {prefix!r} is truncated, with no token")

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Key": key}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            await self._call("delete_object", **kwargs)
        except ClientError as exc:
            code = _code(exc)
            if code in _CONFLICT_CODES or code in _MISSING_CODES:
                raise Conflict(code) from None
            raise


def _code(exc: Any) -> str:
    error = exc.response.get("Error", {}) or {}
    code = str(error.get("Code") or "")
    if not code:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(status or "")
    return code


def _epoch(value: Any) -> float:
    if value is None:
        return -math.inf  # unknown: as stale as can be
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value)
