"""What the producer needs of Kinesis: :class:`Transport`, two calls, and how a request names
a stream. The producer's own transport is aiobotocore's (``_botocore.py``); a test or a user
may pass any object with these two calls (``Producer(transport=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ("Transport", "stream_parameters")


class Transport(Protocol):
    """What the producer needs from a Kinesis client. Errors may be any exception; the Sender
    translates them with :func:`error_code`."""

    async def put_records(
        self, stream: str, records: list[dict[str, Any]]
    ) -> Mapping[str, Any]: ...

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]: ...


def stream_parameters(stream: str) -> dict[str, str]:
    """How a request names ``stream``: ``StreamARN`` for a stream ARN (cross-account access,
    as the KPL 0.15.9 sends it), ``StreamName`` otherwise."""
    if stream.startswith("arn:"):
        return {"StreamARN": stream}
    return {"StreamName": stream}
