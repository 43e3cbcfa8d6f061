"""ListShards as the service pages it, over moto's shard objects.

moto's own ListShards pages with a token that checksums the request's other parameters, so a
second page asked for the way the service wants it (``NextToken`` alone: the token names the
stream) fails with moto's ``InvalidToken``, and a stream of more than 1,000 shards never gets
listed. moto also ignores ``ShardFilter`` and defaults ``MaxResults`` to 10,000. This module
answers ListShards itself, following the service's API reference (``ListShards`` and its
``NextToken``, ``MaxResults`` and ``ShardFilter`` members):

- at most 1,000 shards a page: ``MaxResults`` is 1..10,000, defaults to 1,000, and a larger
  value still returns at most 1,000; ``NextToken`` is answered while shards remain;
- a call with ``NextToken`` must not also carry ``StreamName``, ``StreamARN``,
  ``ExclusiveStartShardId``, ``ShardFilter`` or ``StreamCreationTimestamp``
  (``InvalidArgumentException: NextToken and StreamName cannot be provided together.``);
- tokens expire after 300 seconds (``ExpiredNextTokenException``); a token this emulator did
  not issue — garbage, or one from an emulator since restarted — is refused too (the first
  with ``InvalidArgumentException``, the second as expired: the message is the emulator's own);
- ``ShardFilter`` ``AT_LATEST`` lists the open shards only and ``AFTER_SHARD_ID`` starts after
  its ``ShardId``; the others list every shard (the emulator never trims a shard, and moto keeps
  no shard open/close times to filter by).

Shards are listed in shard id order, as the service lists them. The lister is synchronous and
clock-injected, like the write path.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ._write_path import KinesisError

__all__ = (
    "LIST_SHARDS_DEFAULT_RESULTS",
    "LIST_SHARDS_MAX_RESULTS",
    "NEXT_TOKEN_TTL",
    "ShardLister",
)

#: Shards in one ListShards page: the default ``MaxResults``, and the most one page holds.
LIST_SHARDS_DEFAULT_RESULTS = 1000
#: The largest ``MaxResults`` the service accepts (it still answers at most 1,000 a page).
LIST_SHARDS_MAX_RESULTS = 10000
#: Seconds a ListShards ``NextToken`` stays valid.
NEXT_TOKEN_TTL = 300.0

_FILTER_TYPES = (
    "AFTER_SHARD_ID",
    "AT_TRIM_HORIZON",
    "FROM_TRIM_HORIZON",
    "AT_LATEST",
    "AT_TIMESTAMP",
    "FROM_TIMESTAMP",
)
#: request members a ``NextToken`` call must not carry, in the order the service names them
_EXCLUSIVE_WITH_TOKEN = (
    "StreamName",
    "StreamARN",
    "ExclusiveStartShardId",
    "ShardFilter",
    "StreamCreationTimestamp",
)

#: (account id, region) → that backend's streams by name
Streams = Callable[[str, str], Mapping[str, Any]]


def find_stream(
    name: object, arn: object, account: str, region: str, streams: Streams
) -> tuple[str, str, Any]:
    """(account, region, stream) that a request's ``StreamName`` or ``StreamARN`` names (the
    ARN names its own account and region, as for cross-account access); the service's
    ResourceNotFoundException when there is none. At least one of the two is a str."""
    if isinstance(arn, str):
        parts = arn.split(":", 5)
        if len(parts) == 6 and parts[5].startswith("stream/"):
            account, region = parts[4], parts[3]
    backend = streams(account, region)
    stream = backend.get(name) if isinstance(name, str) else None
    if stream is None and isinstance(arn, str):
        stream = next((s for s in backend.values() if s.arn == arn), None)
    if stream is None or (isinstance(arn, str) and stream.arn != arn):
        missing = name if isinstance(name, str) else arn
        raise KinesisError(
            400,
            "ResourceNotFoundException",
            f"Stream {missing} under account {account} not found.",
        )
    return account, region, stream


def _invalid(message: str) -> KinesisError:
    return KinesisError(400, "InvalidArgumentException", message)


def _shard_number(shard_id: str) -> int:
    try:
        return int(shard_id.rsplit("-", 1)[-1])
    except ValueError:
        return -1


class ShardLister:
    """Answers ListShards for one emulator; its tokens are good for this emulator only."""

    def __init__(self) -> None:
        self._issuer = uuid.uuid4().hex

    def list_shards(
        self, payload: Mapping[str, Any], caller: tuple[str, str], streams: Streams, now: float
    ) -> dict[str, Any]:
        """The ListShards response for ``payload``; ``caller`` is (account id, region) of the
        request, ``streams`` finds a backend's streams, ``now`` is the server's clock."""
        max_results = payload.get("MaxResults")
        if max_results is not None:
            if not isinstance(max_results, int) or isinstance(max_results, bool):
                raise KinesisError(400, "SerializationException", "MaxResults is an integer")
            if not 1 <= max_results <= LIST_SHARDS_MAX_RESULTS:
                bound = (
                    "greater than or equal to 1"
                    if max_results < 1
                    else f"less than or equal to {LIST_SHARDS_MAX_RESULTS}"
                )
                raise KinesisError(
                    400,
                    "ValidationException",
                    f"1 validation error detected: Value '{max_results}' at 'maxResults' failed "
                    f"to satisfy constraint: Member must have value {bound}",
                )
        page_size = min(max_results or LIST_SHARDS_DEFAULT_RESULTS, LIST_SHARDS_DEFAULT_RESULTS)
        token = payload.get("NextToken")
        after: str | None
        if token is not None:
            for member in _EXCLUSIVE_WITH_TOKEN:
                if payload.get(member) is not None:
                    raise _invalid(f"NextToken and {member} cannot be provided together.")
            account, region, name, created, after, filter_type = self._open(token, now)
            stream = streams(account, region).get(name)
            if stream is None or str(stream.creation_datetime) != created:
                raise KinesisError(
                    400,
                    "ResourceNotFoundException",
                    f"Stream {name} under account {account} not found.",
                )
        else:
            account, region, stream = self._find(payload, *caller, streams)
            after, filter_type = self._filter(payload)
        shards = sorted(stream.shards.values(), key=lambda s: _shard_number(s.shard_id))
        if filter_type == "AT_LATEST":
            shards = [s for s in shards if s.is_open]
        if after is not None:
            start = _shard_number(after)
            shards = [s for s in shards if _shard_number(s.shard_id) > start]
        page = shards[:page_size]
        response: dict[str, Any] = {"Shards": [s.to_json() for s in page]}
        if len(shards) > page_size:
            response["NextToken"] = self._seal(
                account,
                region,
                stream.stream_name,
                str(stream.creation_datetime),
                page[-1].shard_id,
                filter_type,
                now,
            )
        return response

    @staticmethod
    def _find(
        payload: Mapping[str, Any], account: str, region: str, streams: Streams
    ) -> tuple[str, str, Any]:
        """(account, region, stream) a first-page request names."""
        name = payload.get("StreamName")
        arn = payload.get("StreamARN")
        if not isinstance(name, str) and not isinstance(arn, str):
            raise _invalid("Either NextToken or StreamName or StreamARN should be provided.")
        return find_stream(name, arn, account, region, streams)

    @staticmethod
    def _filter(payload: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """(the shard id to start after, the filter type) of a first-page request."""
        after = payload.get("ExclusiveStartShardId")
        if after is not None and not isinstance(after, str):
            raise KinesisError(400, "SerializationException", "ExclusiveStartShardId is a string")
        shard_filter = payload.get("ShardFilter")
        if shard_filter is None:
            return after, None
        if not isinstance(shard_filter, dict):
            raise KinesisError(400, "SerializationException", "ShardFilter is an object")
        filter_type = shard_filter.get("Type")
        if filter_type not in _FILTER_TYPES:
            raise KinesisError(
                400,
                "ValidationException",
                f"1 validation error detected: Value '{str(filter_type)[:40]}' at "
                f"'shardFilter.type' failed to satisfy constraint: Member must satisfy enum "
                f"value set: [{', '.join(_FILTER_TYPES)}]",
            )
        if filter_type == "AFTER_SHARD_ID":
            shard_id = shard_filter.get("ShardId")
            if not isinstance(shard_id, str):
                raise _invalid("ShardId must be provided with the AFTER_SHARD_ID filter type.")
            after = shard_id if after is None else max(after, shard_id, key=_shard_number)
        return after, filter_type

    # -- tokens ------------------------------------------------------------------------------

    def _seal(
        self,
        account: str,
        region: str,
        name: str,
        created: str,
        after: str,
        filter_type: str | None,
        now: float,
    ) -> str:
        fields = [self._issuer, now, account, region, name, created, after, filter_type]
        return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()

    def _open(self, token: Any, now: float) -> tuple[str, str, str, str, str, str | None]:
        """(account, region, stream, its creation time, last shard listed, filter type)."""
        try:
            fields = json.loads(base64.urlsafe_b64decode(str(token).encode("ascii")))
            issuer, issued, account, region, name, created, after, filter_type = fields
            if not all(isinstance(f, str) for f in (issuer, account, region, name, created, after)):
                raise ValueError("not a token")
            if not isinstance(issued, (int, float)) or filter_type not in (None, *_FILTER_TYPES):
                raise ValueError("not a token")
        except (ValueError, TypeError, UnicodeError, RecursionError, binascii.Error):
            raise _invalid("Invalid NextToken.") from None
        if issuer != self._issuer or not 0 <= now - issued <= NEXT_TOKEN_TTL:
            raise KinesisError(
                400,
                "ExpiredNextTokenException",
                f"The NextToken has expired: tokens are valid for {NEXT_TOKEN_TTL:g} seconds.",
            )
        return account, region, name, created, after, filter_type
