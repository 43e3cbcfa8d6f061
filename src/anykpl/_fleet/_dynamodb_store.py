"""The fleet's store on DynamoDB: one table, an item per coordination object.

Every item of a fleet has the partition key ``pk`` = the fleet's prefix and the sort key
``sk`` = the object's key (``<prefix>/workers/<id>.json``, ``<prefix>/grants.json``, …), so
one ``Query`` lists the reports. An item holds the document (``body``, zlib-compressed: a
thousand workers' grants fit DynamoDB's 400 KB item), a version tag (``etag``, random per
write: the conditions ``If-Match`` and ``If-None-Match`` of S3 become condition expressions
on it), the store time of the write (``modified``), and ``expires``, the table's TTL
attribute: long past any document's life (:data:`TTL_LEASES` leases), only so that the items
of a fleet gone for good go away. Readers never skip an item for it: every document carries
its own expiry and age, judged as on S3 (an item hidden but still there would block a
conditional create).

DynamoDB has no object timestamps of its own: a writer stamps ``modified`` with the latest
the store's time can be when it sends the write, so an object is never judged older than it
is (a member that has not heard from the store yet reads the item first, for a dated
answer). The store's time is learned from the ``Date`` header of its answers where it sends one;
where it sends none (moto's server, dynalite), from this machine's wall clock, in whole
seconds like a ``Date`` header: the members' clocks then need to agree (NTP keeps them
within milliseconds). ``anykpl fleet-table create`` makes the table (:func:`create_table`).
"""

from __future__ import annotations

import email.utils
import math
import os
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import anyio

from ..config import FleetConfig
from ._clock import ServerClock
from ._documents import MAX_DOCUMENT_BYTES, DocumentError
from ._store import Conflict
from ._worker_state import LEFTOVER_LEASES

__all__ = ("OPERATIONS", "TABLE_SCHEMA", "TTL_ATTRIBUTE", "DynamoDBStore", "create_table")

#: The DynamoDB operations a member calls (and the IAM actions docs/fleet.md grants).
OPERATIONS: Final = ("GetItem", "PutItem", "DeleteItem", "Query")

#: The table's key schema and attributes, as ``anykpl fleet-table create`` makes it.
TABLE_SCHEMA: Final = {
    "KeySchema": [
        {"AttributeName": "pk", "KeyType": "HASH"},
        {"AttributeName": "sk", "KeyType": "RANGE"},
    ],
    "AttributeDefinitions": [
        {"AttributeName": "pk", "AttributeType": "S"},
        {"AttributeName": "sk", "AttributeType": "S"},
    ],
    "BillingMode": "PAY_PER_REQUEST",
}
#: The item attribute the table's time to live reads.
TTL_ATTRIBUTE: Final = "expires"
#: An item's time to live, in leases: past any document's life even at the longest stretch
#: of the sync interval (a leftover is deleted by the allocator after LEFTOVER_LEASES).
TTL_LEASES: Final = 12 * 2 * LEFTOVER_LEASES
_CONFLICT_CODES: Final = frozenset({"ConditionalCheckFailedException"})


class DynamoDBStore:
    """The fleet's calls on one DynamoDB table (see the module's docstring)."""

    def __init__(
        self,
        client: Any,
        fleet: FleetConfig,
        clock: ServerClock,
        timeout: float,
        requests: Counter[str] | None = None,
        now: Callable[[], float] = anyio.current_time,
    ) -> None:
        assert fleet.table is not None
        self._client = client
        self._now = now  # the member's local clock
        self._table = fleet.table
        self._prefix = fleet.prefix.rstrip("/")
        self._clock = clock
        self._timeout = timeout
        self._time_to_live = TTL_LEASES * float(fleet.lease or 3 * fleet.sync_interval)
        self.round_trip = math.inf
        self.requests: Counter[str] = Counter() if requests is None else requests

    def key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    # -- the store's clock ----------------------------------------------------------------

    def _observe(self, response: Any, sent_at: float) -> None:
        headers = (response or {}).get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
        received_at = self._now()
        stamp = headers.get("date")
        when: float | None = None
        if stamp:
            try:
                when = email.utils.parsedate_to_datetime(stamp).timestamp()
            except (TypeError, ValueError, IndexError, OverflowError):
                when = None
        if when is None:  # no Date header: this machine's wall clock, in whole seconds
            when = float(math.floor(time.time()))
        self.round_trip = min(self.round_trip, received_at - sent_at)
        self._clock.observe(when, sent_at, received_at)

    def _latest_now(self) -> float:
        """The latest the store's time can be now (a write's stamp: never too early). Before
        the clock is known: this machine's wall clock and a second (not fed to the clock,
        which learns from the store's answers)."""
        bounds = self._clock.bounds(self._now())
        return time.time() + 1.0 if bounds is None else bounds[1]

    async def _call(self, operation: str, kind: str, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        assert kind in OPERATIONS
        sent_at = self._now()
        self.requests[kind] += 1
        try:
            with anyio.fail_after(self._timeout):
                response = await getattr(self._client, operation)(TableName=self._table, **kwargs)
        except ClientError as exc:
            self._observe(exc.response, sent_at)
            code = _code(exc)
            if code in _CONFLICT_CODES:
                raise Conflict(code) from None
            if code == "ResourceNotFoundException":
                exc.response.setdefault("Error", {})["Message"] = (
                    f"the table {self._table} does not exist (anykpl fleet-table create "
                    f"--table {self._table} makes it)"
                )
            elif code == "ValidationException" and "size" in str(exc).lower():
                exc.response.setdefault("Error", {})["Message"] = (
                    f"{kwargs.get('Item', {}).get('sk', {}).get('S', 'an item')} is over "
                    "DynamoDB's 400 KB item: the grants of this many workers need S3 (bucket=)"
                )
            raise
        self._observe(response, sent_at)
        return response

    # -- the calls ------------------------------------------------------------------------

    async def put(
        self, key: str, body: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Write an item; return its new version tag. :class:`Conflict` if a condition fails."""
        if self._clock.bounds(self._now()) is None:
            # a member's first call: a dated answer first, so that the write is stamped with
            # the store's time and not this machine's wall clock (which may be off by hours);
            # only the key is read, whatever the item holds
            await self._call(
                "get_item",
                "GetItem",
                Key={"pk": {"S": self._prefix}, "sk": {"S": key}},
                ProjectionExpression="sk",
            )
        etag = os.urandom(12).hex()
        modified = self._latest_now()
        item = {
            "pk": {"S": self._prefix},
            "sk": {"S": key},
            "body": {"B": zlib.compress(body)},
            "etag": {"S": etag},
            "modified": {"N": repr(modified)},
            TTL_ATTRIBUTE: {"N": str(math.ceil(modified + self._time_to_live))},
        }
        kwargs: dict[str, Any] = {"Item": item}
        if if_match is not None:
            kwargs["ConditionExpression"] = "etag = :etag"
            kwargs["ExpressionAttributeValues"] = {":etag": {"S": if_match}}
        elif if_none_match:
            kwargs["ConditionExpression"] = "attribute_not_exists(sk)"
        await self._call("put_item", "PutItem", **kwargs)
        return etag

    async def get(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, version tag, modified)`` of an item, or ``None``."""
        response = await self._call(
            "get_item",
            "GetItem",
            Key={"pk": {"S": self._prefix}, "sk": {"S": key}},
            ConsistentRead=True,
        )
        item = response.get("Item")
        if not item:
            return None
        try:
            body = zlib.decompressobj().decompress(item["body"]["B"], MAX_DOCUMENT_BYTES + 1)
        except (KeyError, TypeError, zlib.error) as exc:
            raise DocumentError(f"{key}: not a fleet item ({exc})") from None
        if len(body) > MAX_DOCUMENT_BYTES:
            raise DocumentError(f"{key} is over {MAX_DOCUMENT_BYTES} bytes")
        return body, _string(item, "etag"), _number(item, "modified")

    async def list(self, prefix: str) -> list[tuple[str, float, str]]:
        """``(key, modified, version tag)`` of every item under ``prefix``."""
        found: list[tuple[str, float, str]] = []
        start: dict[str, Any] | None = None
        while True:
            kwargs: dict[str, Any] = {
                "KeyConditionExpression": "pk = :pk AND begins_with(sk, :prefix)",
                "ExpressionAttributeValues": {":pk": {"S": self._prefix}, ":prefix": {"S": prefix}},
                "ProjectionExpression": "sk, etag, modified",
                "ConsistentRead": True,
            }
            if start:
                kwargs["ExclusiveStartKey"] = start
            response = await self._call("query", "Query", **kwargs)
            for item in response.get("Items", ()) or ():
                found.append(
                    (_string(item, "sk"), _number(item, "modified"), _string(item, "etag"))
                )
            start = response.get("LastEvaluatedKey")
            if not start:
                return found

    async def delete(self, key: str, *, if_match: str | None = None) -> None:
        kwargs: dict[str, Any] = {"Key": {"pk": {"S": self._prefix}, "sk": {"S": key}}}
        if if_match is not None:
            kwargs["ConditionExpression"] = "etag = :etag"
            kwargs["ExpressionAttributeValues"] = {":etag": {"S": if_match}}
        await self._call("delete_item", "DeleteItem", **kwargs)


async def create_table(client: Any, table: str) -> bool:
    """Make the fleet's table (on-demand capacity) and turn its time to live on; return
    whether the endpoint has time to live (dynalite has not: the allocator's deletion of
    leftovers is all there is, and readers skip expired items anyway)."""
    from botocore.exceptions import ClientError

    await client.create_table(TableName=table, **TABLE_SCHEMA)
    waiter = client.get_waiter("table_exists")
    await waiter.wait(TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 120})
    try:
        await client.update_time_to_live(
            TableName=table,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": TTL_ATTRIBUTE},
        )
    except ClientError as exc:
        if _code(exc) != "UnknownOperationException":
            raise
        return False
    return True


def _code(exc: Any) -> str:
    return str((exc.response.get("Error", {}) or {}).get("Code") or "")


def _string(item: dict[str, Any], name: str) -> str:
    value = (item.get(name) or {}).get("S")
    if not isinstance(value, str):
        raise DocumentError(f"item attribute {name} is not a string")
    return value


def _number(item: dict[str, Any], name: str) -> float:
    value = (item.get(name) or {}).get("N")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DocumentError(f"item attribute {name} is not a number") from None
    if not math.isfinite(number):
        raise DocumentError(f"item attribute {name} is not finite")
    return number
