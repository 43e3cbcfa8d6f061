"""The Sender: PutRecords requests → the network → outcomes for the Retrier.

The transport is aiobotocore. Under asyncio it uses its default aiohttp session; under trio
(detected at start, or chosen with ``http_backend="httpx"``) it uses ``HttpxSession``, which
aiobotocore ≥ 3.9 runs on trio through anyio. The client comes from ``_aws.py``, with the SDK's
own retries turned off (one attempt per call): the Retrier owns retrying.

This module is the **only** place botocore and HTTP errors are seen: :func:`error_code` turns
them into an error code and message at this boundary, so everything downstream works on codes.
Cancellation is never turned into an outcome — it propagates.

The transport sits behind the small :class:`Transport` protocol so unit tests can drive the
pipeline with a fake that throttles, fails or hangs on demand.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import errors
from ._aws import create_client
from .config import ProducerConfig

__all__ = (
    "Outcome",
    "Transport",
    "error_code",
    "open_transport",
    "run_sender",
    "stream_parameters",
)

logger = logging.getLogger("anykpl.sender")


class Transport(Protocol):
    """What the producer needs from a Kinesis client. Errors may be any exception; the Sender
    translates them with :func:`error_code`."""

    async def put_records(
        self, stream: str, records: list[dict[str, Any]]
    ) -> Mapping[str, Any]: ...

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]: ...


class Outcome:
    """One PutRecords call: the request's records, its timing, and the response or error."""

    __slots__ = ("end", "error_code", "error_message", "records", "response", "start", "stream")

    def __init__(
        self,
        stream: str,
        records: Sequence[Any],
        start: float,
        end: float,
        response: Mapping[str, Any] | None,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        self.stream = stream
        self.records = records
        self.start = start
        self.end = end
        self.response = response
        self.error_code = error_code
        self.error_message = error_message


def error_code(exc: BaseException) -> tuple[str, str]:
    """Translate an exception from the transport into ``(error code, message)``."""
    from botocore import exceptions as be

    if isinstance(exc, be.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "UnknownError")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        message = str(error.get("Message") or exc)
        if code in ("UnknownError", "") and isinstance(status, int):
            code = f"HTTP{status}"
        return code, message
    if isinstance(exc, (be.ReadTimeoutError, be.ConnectTimeoutError, TimeoutError)):
        return errors.TIMEOUT, str(exc) or "the request timed out"
    if isinstance(exc, (be.EndpointConnectionError, be.ConnectionClosedError, be.HTTPClientError)):
        return errors.CONNECTION_ERROR, str(exc)
    if isinstance(exc, be.NoCredentialsError):
        return "NoCredentialsError", str(exc)
    if isinstance(exc, be.ParamValidationError):
        return "ParamValidationError", str(exc)
    if isinstance(exc, OSError):
        return errors.CONNECTION_ERROR, f"{type(exc).__name__}: {exc}"
    return type(exc).__name__, str(exc)


def stream_parameters(stream: str) -> dict[str, str]:
    """How a request names ``stream``: ``StreamARN`` for a stream ARN (cross-account access,
    as the KPL 0.15.9 sends it), ``StreamName`` otherwise."""
    if stream.startswith("arn:"):
        return {"StreamARN": stream}
    return {"StreamName": stream}


class _BotocoreTransport:
    def __init__(self, client: Any) -> None:
        self._client = client

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        response: Mapping[str, Any] = await self._client.put_records(
            **stream_parameters(stream), Records=records
        )
        return response

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]:
        response: Mapping[str, Any] = await self._client.list_shards(**kwargs)
        return response


@asynccontextmanager
async def open_transport(config: ProducerConfig) -> AsyncIterator[Transport]:
    """Open an aiobotocore Kinesis client for ``config`` (credentials, region and profile from
    the config or botocore's usual chain). SDK retries are off: the Retrier owns retrying."""
    client_context = create_client(
        config,
        "kinesis",
        max_pool_connections=config.max_connections,
        endpoint_url=config.endpoint_url,
    )
    async with client_context as client:
        yield _BotocoreTransport(client)


async def run_sender(
    stream: str,
    transport: Transport,
    requests: MemoryObjectReceiveStream[list[Any]],
    outcomes: MemoryObjectSendStream[Outcome],
    *,
    max_connections: int,
    request_timeout: float,
) -> None:
    """Send each request with at most ``max_connections`` in flight; pass every outcome on."""
    slots = anyio.Semaphore(max_connections)

    async def send(batch: list[Any]) -> None:
        try:
            entries = [
                {
                    "Data": kr.data,
                    "PartitionKey": kr.partition_key,
                    "ExplicitHashKey": kr.explicit_hash_key,
                }
                for kr in batch
            ]
            start = anyio.current_time()
            response: Mapping[str, Any] | None = None
            code = message = None
            try:
                with anyio.fail_after(request_timeout):
                    response = await transport.put_records(stream, entries)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                code, message = error_code(exc)
            del entries
            for kr in batch:
                kr.release()  # an aggregate's bytes: the user records keep their own
            outcome = Outcome(stream, batch, start, anyio.current_time(), response, code, message)
            try:
                outcomes.send_nowait(outcome)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # the Retrier is gone: the producer is shutting down and fails what is left
                return
        finally:
            slots.release()

    async with requests, outcomes, anyio.create_task_group() as tg:
        async for batch in requests:
            await slots.acquire()
            tg.start_soon(send, batch)
