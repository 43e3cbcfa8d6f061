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

import binascii
import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, Final, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import errors
from ._aws import create_client, http_backend
from .config import ProducerConfig

__all__ = (
    "Outcome",
    "Transport",
    "error_code",
    "open_transport",
    "put_records_body",
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


def put_records_body(parameters: Mapping[str, Any]) -> bytes:
    """See :func:`put_records_body_parts`: the body as one ``bytes``."""
    return b"".join(put_records_body_parts(parameters))


def put_records_body_parts(parameters: Mapping[str, Any]) -> list[bytes]:
    """The JSON body of a PutRecords request: the document botocore's JSON serializer writes
    (each record's ``Data`` in base64), built from bytes. Parsed, the two are equal (the bytes
    differ: botocore's has a space after each separator).

    botocore base64-encodes each record into a ``str``, ``json.dumps`` the whole request
    (scanning every character of about 1.3 MB of base64 for escapes) and encodes it back to
    bytes: about 5 ms for a 1 MiB request, a tenth of the producer's CPU end to end. Base64
    needs no JSON escaping, so its bytes are joined in as they are (0.7 ms). Partition keys
    and the other parameters go through ``json.dumps``.

    The pieces are returned in order, to be joined (:func:`put_records_body`) or written into
    a reused buffer (:class:`_BodyBuffers`).

    :raises TypeError: a record whose ``Data`` is not bytes-like, or whose keys are not str.
    :raises KeyError: a record without ``Data`` or ``PartitionKey``.
    """
    head = json.dumps({k: v for k, v in parameters.items() if k != "Records"}).encode()
    parts = [head[:-1], b',"Records":[' if len(head) > 2 else b'"Records":[']
    append = parts.append
    opening = b'{"Data":"'
    for entry in parameters["Records"]:
        append(opening)
        opening = b',{"Data":"'
        append(binascii.b2a_base64(entry["Data"], newline=False))
        append(b'","PartitionKey":')
        append(_json_string("PartitionKey", entry["PartitionKey"]))
        hash_key = entry.get("ExplicitHashKey")
        if hash_key is not None:
            append(b',"ExplicitHashKey":')
            append(_json_string("ExplicitHashKey", hash_key))
        append(b"}")
    append(b"]}")
    return parts


def _json_string(field: str, value: object) -> bytes:
    if type(value) is not str:
        raise TypeError(f"{field} must be a str, not {type(value).__name__}")
    return json.dumps(value).encode()


#: Bodies' buffers a transport keeps for its next requests (:class:`_BodyBuffers`)
KEPT_BODY_BUFFERS: Final = 2
#: A buffer bigger than this (bytes) is not kept: a full 5 MiB request's body, and some more
KEPT_BODY_BUFFER_MAX: Final = 8 << 20
#: The pieces (bytes) an httpx transport sends a kept body in (:class:`_BodyPieces`)
BODY_PIECE: Final = 256 << 10


class _BodyBuffers:
    """Buffers that PutRecords bodies are written into, reused from one request to the next.

    A firehose's bodies are 1–2 MB each. Allocated afresh for each request, such memory goes
    back to the operating system when it is freed (glibc trims the top of its heap, or maps
    and unmaps a large block), and comes back page by page on the next request, one page
    fault each (about 2 µs on a 2-core VM), about a millisecond per request. Under aiohttp (on
    Python before 3.12.9) the body is copied once more, behind the request's headers, so
    every request paid for its body's pages twice. Written into a kept buffer, a body costs no
    new pages: in the firehose benchmark the asyncio worker's page faults halved and its CPU
    fell by about 5 % (docs/benchmarks.md).

    The body handed to botocore is a ``memoryview`` of the buffer (which it signs as it
    would ``bytes``). aiohttp sends a view as it is; httpx takes only ``bytes`` or an
    iterable, so an httpx transport sends it in pieces (:class:`_BodyPieces`). A buffer is
    written again only once no view of it is left anywhere (a request that failed part-way
    may leave one behind a while): otherwise the request takes a new buffer. At most
    :data:`KEPT_BODY_BUFFERS` are kept, of at most :data:`KEPT_BODY_BUFFER_MAX` bytes each.
    """

    def __init__(self) -> None:
        self._kept: list[bytearray] = []

    def take(self) -> _BodySlot:
        """A buffer for one request's body."""
        return _BodySlot(self._kept.pop() if self._kept else bytearray())

    def give(self, slot: _BodySlot) -> None:
        """The request is over: keep its buffer for another."""
        if len(self._kept) < KEPT_BODY_BUFFERS and len(slot.buffer) <= KEPT_BODY_BUFFER_MAX:
            self._kept.append(slot.buffer)


class _BodySlot:
    """The buffer of one request in flight (:class:`_BodyBuffers`)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: bytearray) -> None:
        self.buffer = buffer

    def write(self, parts: list[bytes]) -> memoryview:
        """Write ``parts`` one after the other from the start of the buffer, and return a view
        of what was written."""
        buffer = self.buffer
        try:
            # a resize fails while a view of the buffer is alive (BufferError)
            buffer.append(0)
            del buffer[-1]
        except BufferError:
            buffer = self.buffer = bytearray()
        size = sum(map(len, parts))
        if len(buffer) < size:
            buffer += bytes(size - len(buffer))
        position = 0
        for part in parts:
            end = position + len(part)
            buffer[position:end] = part
            position = end
        return memoryview(buffer)[:size]


class _BodyPieces:
    """A kept body as httpx sends it: in pieces of :data:`BODY_PIECE` bytes.

    aiobotocore hands httpx a body that is both iterable and async iterable as a stream
    (anything else goes to httpx as it is, and httpx takes only ``bytes``); botocore has
    already signed the body and set its ``Content-Length``, so httpx sends exactly these
    bytes, not chunked. Each piece is a view of the buffer, so the buffer is not written again
    while one is alive (:class:`_BodySlot`). h11 copies each piece once on its way to the
    socket: pieces this small come from memory the allocator keeps, where one ``bytes`` of
    the whole body came from fresh pages each time.
    """

    __slots__ = ("_body",)

    def __init__(self, body: memoryview) -> None:
        self._body = body

    def __len__(self) -> int:
        return len(self._body)

    def __iter__(self) -> Iterator[memoryview]:
        body = self._body
        for start in range(0, len(body), BODY_PIECE):
            yield body[start : start + BODY_PIECE]

    def __aiter__(self) -> _AsyncPieces:
        return _AsyncPieces(iter(self))


class _AsyncPieces:
    """:class:`_BodyPieces` to ``async for``. Not an async generator: a request cancelled
    part-way leaves it unfinished, and trio warns about an async generator collected so."""

    __slots__ = ("_pieces",)

    def __init__(self, pieces: Iterator[memoryview]) -> None:
        self._pieces = pieces

    def __aiter__(self) -> _AsyncPieces:
        return self

    async def __anext__(self) -> memoryview:
        for piece in self._pieces:
            return piece
        raise StopAsyncIteration


def _send_body_in_pieces(request: Any, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook on an httpx transport's PutRecords requests: a kept
    body (a view), already signed, goes out in pieces (:class:`_BodyPieces`)."""
    if isinstance(request.body, memoryview):
        request.body = _BodyPieces(request.body)


def _send_body_as_view(request: Any, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook on an aiohttp transport's PutRecords requests: a kept
    body (a view) over 1 MiB goes to aiohttp as a payload of its own (:func:`_view_payload`),
    as it is, without aiohttp's warning for such bodies."""
    body = request.body
    if isinstance(body, memoryview) and body.nbytes > _AIOHTTP_LARGE_BODY:
        payload = _view_payload(body)
        if payload is not None:
            request.body = payload


#: aiohttp's ``TOO_LARGE_BYTES_BODY``: a bytes body bigger than this gets a ResourceWarning
_AIOHTTP_LARGE_BODY: Final = 1 << 20
_view_payload_class: Any = None


def _view_payload(body: memoryview) -> Any:
    """``body`` as aiohttp's ``BytesPayload`` does it, without the ``ResourceWarning`` that
    aiohttp gives a bytes body over 1 MiB ("might lock the event loop, pass an io.BytesIO").
    The advice is for far larger uploads: aiohttp reads a BytesIO in 64 KiB chunks through a
    thread, where a PutRecords body of a few MiB is one write to the socket. Under
    ``-W error`` (a test suite's ``filterwarnings = error``) the warning was an exception, so
    every request over 1 MiB failed, and its records were retried until they expired. ``None``
    if this aiohttp's payload class is not the one this was written for (the body then goes
    as it is)."""
    global _view_payload_class
    if _view_payload_class is None:
        from aiohttp.payload import BytesPayload, Payload

        class _ViewPayload(BytesPayload):
            def __init__(self, value: memoryview) -> None:
                Payload.__init__(self, value, content_type="application/octet-stream")
                self._size = value.nbytes

        _view_payload_class = _ViewPayload
    try:
        payload = _view_payload_class(body)
    except (AttributeError, TypeError):  # pragma: no cover - another aiohttp's internals
        return None
    # what BytesPayload.write sends, and what aiohttp sets Content-Length from
    if payload.size != body.nbytes or getattr(payload, "_value", None) is not body:
        return None  # pragma: no cover - another aiohttp's internals
    return payload


# The body buffer of the request being serialized in this task (set around each PutRecords
# call by the transport; the serializer runs inside the call, and joins the body itself
# when called otherwise)
_body_slot: ContextVar[_BodySlot | None] = ContextVar("anykpl_body_slot", default=None)


class _PutRecordsSerializer:
    """The client's request serializer, with :func:`put_records_body` for PutRecords bodies.

    Everything else is botocore's: each PutRecords request is first serialized by botocore
    with the request's own parameters and one empty record in place of the records (so the
    stream name is validated, and the method, headers and path are botocore's), and only the
    body is replaced. Should botocore ever serialize Kinesis in anything but JSON (it can
    speak CBOR), the request is left entirely to it, as is a request without records (for
    botocore's validation error).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def serialize_to_request(self, parameters: Any, operation_model: Any) -> Any:
        inner = self._inner
        if operation_model.name != "PutRecords" or not parameters.get("Records"):
            return inner.serialize_to_request(parameters, operation_model)
        request = inner.serialize_to_request(
            {**parameters, "Records": [{"Data": b"", "PartitionKey": "-"}]}, operation_model
        )
        content_type = str(request.get("headers", {}).get("Content-Type", ""))
        if not content_type.startswith("application/x-amz-json"):
            return inner.serialize_to_request(parameters, operation_model)
        slot = _body_slot.get()
        request["body"] = (
            put_records_body(parameters)
            if slot is None
            else slot.write(put_records_body_parts(parameters))
        )
        return request


class _BotocoreTransport:
    def __init__(self, client: Any, *, body_pieces: bool = False, aiohttp: bool = False) -> None:
        """Bodies are written into kept buffers (:class:`_BodyBuffers`); ``body_pieces``:
        and sent in pieces, as httpx needs (:class:`_BodyPieces`); ``aiohttp``: large ones as
        a payload that aiohttp does not warn about (:func:`_view_payload`)."""
        self._client = client
        self._bodies = _BodyBuffers()
        if body_pieces:
            client.meta.events.register(
                "before-send.kinesis.PutRecords",
                _send_body_in_pieces,
                unique_id="anykpl-body-pieces",
            )
        elif aiohttp:
            client.meta.events.register(
                "before-send.kinesis.PutRecords",
                _send_body_as_view,
                unique_id="anykpl-body-view",
            )
        serializer = getattr(client, "_serializer", None)
        if serializer is not None and not isinstance(serializer, _PutRecordsSerializer):
            # botocore keeps its serializer in a private attribute; without it (another
            # botocore), requests are botocore's own
            client._serializer = _PutRecordsSerializer(serializer)

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        slot = self._bodies.take()
        token = _body_slot.set(slot)
        try:
            response: Mapping[str, Any] = await self._client.put_records(
                **stream_parameters(stream), Records=records
            )
        finally:
            _body_slot.reset(token)
            self._bodies.give(slot)
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
        backend = http_backend(config)
        yield _BotocoreTransport(
            client, body_pieces=backend == "httpx", aiohttp=backend == "aiohttp"
        )


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
