"""The producer's transport on aiobotocore: PutRecords and ListShards, their request bodies,
and botocore's errors as error codes.

The transport is aiobotocore. Under asyncio it uses its default aiohttp session; under trio
(detected at start, or chosen with ``http_backend="httpx"``) it uses ``HttpxSession``, which
aiobotocore ≥ 3.9 runs on trio through anyio. The client comes from ``_aws.py``, with the SDK's
own retries turned off (one attempt per call): the Retrier owns retrying.

This module is the **only** place botocore and HTTP errors are seen: :func:`error_code` turns
them into an error code and message at this boundary, so everything downstream works on codes.
Cancellation is never turned into an outcome — it propagates.

It implements the small :class:`~anykpl.Transport` protocol (``_protocol.py``), which is also
what lets tests drive the pipeline with a fake that throttles, fails or hangs on demand. The
task that sends requests through it is the runtime's (``_runtime/_sender.py``).
"""

from __future__ import annotations

import binascii
import datetime
import hashlib
import hmac
import inspect
import json
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, Final
from urllib.parse import quote, urlsplit

import anyio
from botocore.auth import SIGNED_HEADERS_BLACKLIST
from botocore.awsrequest import AWSPreparedRequest
from botocore.exceptions import ClientError, NoCredentialsError, SSLError

from .. import errors
from ..config import ProducerConfig
from . import _cbor
from ._aws import create_client, http_backend
from ._http import HttpClient
from ._protocol import Transport, stream_parameters

__all__ = ("error_code", "open_transport", "put_records_body", "put_records_body_parts")

logger = logging.getLogger("anykpl.sender")


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
    fell by about 5 % (the CHANGELOG's measurements).

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


def _sendable(body: memoryview, *, pieces: bool) -> Any:
    """A kept body (a view), signed, in the form its HTTP client sends it: for httpx in pieces
    (:class:`_BodyPieces`); for aiohttp as it is, or over 1 MiB as a payload of its own
    (:func:`_view_payload`), without aiohttp's warning for such bodies."""
    if pieces:
        return _BodyPieces(body)
    if body.nbytes > _AIOHTTP_LARGE_BODY:
        return _view_payload(body) or body
    return body


def _send_body_in_pieces(request: Any, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook on an httpx transport's PutRecords requests."""
    if isinstance(request.body, memoryview):
        request.body = _sendable(request.body, pieces=True)


def _send_body_as_view(request: Any, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook on an aiohttp transport's PutRecords requests."""
    if isinstance(request.body, memoryview):
        request.body = _sendable(request.body, pieces=False)


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


# -- PutRecords without the SDK's per-request machinery ------------------------------------
#
# botocore spends about 1.5 ms of CPU on each call besides the body and the network: its
# events, the endpoint rules, the User-Agent built twice, parameter validation and a general
# SigV4 signer (docs/architecture.md, "The Sender"). A firehose sends a PutRecords request
# every few milliseconds, so that was a sixth of the producer's CPU. The first PutRecords of
# each stream still goes through the SDK whole; what it sent (the URL, the headers, the
# signing scope) is learned from it, and the stream's later requests are built from that,
# signed with the client's own credentials (refreshed as the SDK refreshes them) and sent
# through anykpl's own HTTP client (``_http.py``: with ``http_backend="auto"`` where no proxy
# applies; a fifth to a tenth of the session's CPU per request) or else the client's own HTTP
# session (its connection pool, proxies, timeouts, TLS settings and error mapping). Errors are
# parsed by botocore's parser into the same ClientError.

# The requests the client's HTTP session sent in this task (set around an SDK PutRecords call
# by the transport, appended to by the session's ``send`` as :meth:`_DirectPutRecords.for_client`
# wraps it): only a request that really went to the network teaches a route, not one that a
# ``before-send`` hook answered (a stub, moto's in-process mock)
_learned_route: ContextVar[list[Any] | None] = ContextVar("anykpl_learned_route", default=None)

#: Headers a direct request sets afresh (or leaves out): the rest of what the SDK sent is sent
#: as it was, and signed.
_PER_REQUEST_HEADERS: Final = frozenset(
    {
        "authorization",
        "x-amz-date",
        "x-amz-security-token",
        "x-amz-content-sha256",
        "content-length",
        "transfer-encoding",
        "amz-sdk-invocation-id",
        "amz-sdk-request",
        "host",
        "x-amzn-trace-id",  # Lambda's, per invocation (:func:`_trace_header`)
    }
)
#: The error codes of a request whose signature the service refused (Kinesis answers
#: ``InvalidSignatureException``; other endpoints, moto's server among them, answer
#: ``SignatureDoesNotMatch``)
_SIGNATURE_CODES: Final = frozenset(
    {"InvalidSignatureException", "SignatureDoesNotMatch", "IncompleteSignatureException"}
)
#: Headers SigV4 leaves unsigned: botocore's own list
_UNSIGNED_HEADERS: Final = frozenset(SIGNED_HEADERS_BLACKLIST)


class _Route:
    """How one stream's PutRecords requests are sent: what the SDK sent for its first."""

    __slots__ = ("_cbor", "headers", "host", "region", "service", "url")

    def __init__(self, url: str, host: str, headers: dict[str, str], region: str, service: str):
        self.url = url
        self.host = host
        self.headers = headers
        self.region = region
        self.service = service
        self._cbor: _Route | None = None

    def cbor(self) -> _Route:
        """This route with CBOR's content type (made once)."""
        if self._cbor is None:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = _cbor.CBOR_CONTENT_TYPE
            self._cbor = _Route(self.url, self.host, headers, self.region, self.service)
        return self._cbor

    def sign(
        self,
        body: memoryview | bytes,
        credentials: Any,
        amz_date: str,
        keys: dict[tuple[str, str], bytes] | None = None,
    ) -> dict[str, str]:
        """The request's headers, signed with SigV4; ``keys``: signing keys by (secret, day),
        kept by the caller for the next requests."""
        headers = dict(self.headers)
        headers["X-Amz-Date"] = amz_date
        token = credentials.token
        if token:
            headers["X-Amz-Security-Token"] = token
        # what botocore signs: the headers so far (its Content-Length comes after signing)
        signed = {name.lower(): " ".join(value.split()) for name, value in headers.items()}
        for name in _UNSIGNED_HEADERS.intersection(signed):
            del signed[name]
        signed["host"] = self.host
        names = sorted(signed)
        signed_names = ";".join(names)
        canonical_headers = "".join(f"{name}:{signed[name]}\n" for name in names)
        payload_hash = hashlib.sha256(body).hexdigest()
        canonical = f"POST\n/\n\n{canonical_headers}\n{signed_names}\n{payload_hash}"
        day = amz_date[:8]
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        canonical_hash = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{canonical_hash}"
        secret = credentials.secret_key
        key = None if keys is None else keys.get((secret, day))
        if key is None:
            key = _signing_key(secret, day, self.region, self.service)
            if keys is not None:
                if len(keys) >= 4:  # a new day, or new credentials: the old keys go
                    keys.clear()
                keys[(secret, day)] = key
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed_names}, Signature={signature}"
        )
        headers["Content-Length"] = str(len(body))
        return headers


def _signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    key = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def _trace_header() -> str | None:
    """Lambda's trace id for ``X-Amzn-Trace-Id``, as botocore's
    ``add_recursion_detection_header`` sends it: read for every request, since it changes with
    every invocation."""
    if "AWS_LAMBDA_FUNCTION_NAME" not in os.environ:
        return None
    trace_id = os.environ.get("_X_AMZN_TRACE_ID")
    return quote(trace_id, safe="-=;:+&[]{}\"',") if trace_id else None


def _amz_date() -> str:
    """Now, as SigV4's ``X-Amz-Date`` (what botocore signs with)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _host(url: str) -> str:
    """The ``Host`` SigV4 signs for ``url``, as botocore derives it: lower case, the default
    port left out, IPv6 in brackets."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


class _DirectPutRecords:
    """PutRecords requests built and signed here and sent through anykpl's own HTTP client
    (``http``, ``_http.py``) or the client's HTTP session (see the section's comment).
    ``routes`` holds what each stream's first request showed."""

    def __init__(
        self,
        client: Any,
        credentials: Any,
        send: Any,
        output_shape: Any,
        http: HttpClient | None = None,
        proxies: Any = None,
    ) -> None:
        self._client = client
        self._credentials = credentials
        self._send = send  # the session's own send, not the wrapper that teaches routes
        # anykpl's own HTTP client (``_http.py``), for the endpoints no proxy applies to
        # (``proxies``: the session's proxy configuration); the session's send otherwise
        self.http = http
        self._proxies = proxies
        self._own_http: dict[str, bool] = {}
        self._output_shape = output_shape
        self._parser: Any = None
        self._keys: dict[tuple[str, str], bytes] = {}
        self.routes: dict[str, _Route] = {}
        # ListShards' routes, by :func:`_list_key`
        self.list_routes: dict[str, _Route] = {}
        # endpoints whose answers said they store CBOR data as sent (:meth:`note_answer`)
        self.stores_cbor_as_sent: set[str] = set()

    @classmethod
    def for_client(
        cls, client: Any, own_http: bool = False, config: ProducerConfig | None = None
    ) -> _DirectPutRecords | None:
        """``None`` where the client is not one this was written for (every request then goes
        through the SDK). ``own_http``: its requests go through anykpl's own HTTP client
        where the session's settings allow (:func:`_own_http_client`), made with ``config``'s
        connection settings."""
        try:
            credentials = client._request_signer._credentials
            session = client._endpoint.http_session
            output_shape = client.meta.service_model.operation_model("PutRecords").output_shape
        except Exception:  # pragma: no cover - another botocore's internals
            return None
        send = getattr(session, "send", None)
        if credentials is None or not callable(send):
            return None  # unsigned requests, or an HTTP session unlike aiobotocore's
        send = getattr(send, "_anykpl_send", send)  # another transport on the client wrapped it
        http = _own_http_client(session, config) if own_http and config is not None else None
        proxies = getattr(session, "_proxy_config", None)
        direct = cls(client, credentials, send, output_shape, http, proxies)

        async def send_and_learn(request: Any) -> Any:
            sent = _learned_route.get()
            if sent is not None:
                sent.append(request)
            response = await send(request)
            if sent is not None:
                direct.note_answer(request, response)
            return response

        send_and_learn._anykpl_send = send  # type: ignore[attr-defined]
        try:
            session.send = send_and_learn
        except (AttributeError, TypeError):  # pragma: no cover - a session with slots
            return None
        return direct

    def note_answer(self, request: Any, response: Any) -> None:
        """Note an endpoint that says it stores CBOR data as sent (anykpl's emulator, in a
        header of its answers)."""
        try:
            names = {str(name).lower() for name in response.headers}
            if EMULATOR_CBOR_HEADER in names:
                self.stores_cbor_as_sent.add(_endpoint(str(request.url)))
        except Exception:  # pragma: no cover - another session's response
            return

    def learn(self, stream: str, request: Any) -> None:
        """Keep the route of the SDK's ``request`` for ``stream`` if it is a plain SigV4 POST
        to the root of an HTTP(S) endpoint; otherwise the stream stays with the SDK."""
        route = _route_of(request)
        if route is not None:
            self.routes[stream] = route

    def learn_list_shards(self, key: str, request: Any) -> None:
        """:meth:`learn` for the SDK's ListShards ``request`` (``key``: :func:`_list_key`)."""
        route = _route_of(request)
        if route is not None:
            self.list_routes[key] = route

    async def list_shards(self, route: _Route, parameters: Mapping[str, Any]) -> Mapping[str, Any]:
        """ListShards in CBOR along ``route`` (its CBOR form): the answer as botocore's JSON
        parser reads it (no null members), or the SDK's exceptions. A 2xx answer that is not
        CBOR raises :class:`_NotCbor`."""
        import cbor2

        body = memoryview(cbor2.dumps(dict(parameters)))
        status, headers, content = await self.exchange(route, body, bytes(body))
        if "cbor" not in str(headers.get("content-type", "")).lower():
            if status < 300:
                raise _NotCbor(status)
            shape = self._client.meta.service_model.operation_model("ListShards").output_shape
            raise self._sdk_error(self._parse(status, headers, content, shape), "ListShards")
        decoded = _cbor.load(content)
        if status < 300 and type(decoded) is dict:
            answer: dict[str, Any] = _without_nulls(decoded)
            answer["ResponseMetadata"] = _metadata(status, headers)
            return answer
        raise self._cbor_error(decoded, status, headers, "ListShards")

    def _cbor_error(
        self, decoded: Any, status: int, headers: Mapping[str, str], operation: str
    ) -> Exception:
        """A CBOR error answer (``decoded``) as the SDK raises a JSON one."""
        read = _cbor.error_answer(decoded, status, headers)
        read["ResponseMetadata"] = _metadata(status, headers)
        return self._sdk_error(read, operation)

    def _sdk_error(self, read: dict[str, Any], operation: str) -> Exception:
        """An error answer (``read`` as botocore's parser reads it) as the SDK raises it: the
        modelled exception for its code, or ``ClientError``."""
        try:
            error_class = self._client.exceptions.from_code(read.get("Error", {}).get("Code"))
        except Exception:  # pragma: no cover - another botocore's client
            error_class = ClientError
        error: Exception = error_class(read, operation)
        return error

    async def exchange(
        self, route: _Route, body: memoryview, payload: Any
    ) -> tuple[int, Mapping[str, str], bytes]:
        """Sign ``body`` and send it (as ``payload``); the answer's status, headers and content.

        :raises: the HTTP session's exceptions (no answer), ``NoCredentialsError``.
        """
        credentials = self._credentials.get_frozen_credentials()
        if inspect.isawaitable(credentials):
            credentials = await credentials
        if credentials is None or credentials.access_key is None:
            raise NoCredentialsError()
        headers = route.sign(body, credentials, _amz_date(), self._keys)
        trace = _trace_header()
        if trace is not None:
            headers["X-Amzn-Trace-Id"] = trace  # unsigned, as botocore leaves it
        http = self.http
        if http is not None and self._takes_own_http(route.url):
            try:
                return await http.request(route.url, route.host, headers, body)
            except SSLError as exc:
                # TLS that the SDK's session may take and this client did not (nothing was
                # sent): every request goes through the session from now on, this one first
                logger.warning(
                    "anykpl's HTTP client could not make a TLS connection to %s (%s); "
                    "requests go through the SDK's HTTP session from now on",
                    route.url,
                    exc,
                )
                self.http = None
        request = AWSPreparedRequest("POST", route.url, headers, payload, False)
        response = await self._send(request)
        content = await response.content
        return response.status_code, response.headers, content

    def _takes_own_http(self, url: str) -> bool:
        """Whether requests to ``url`` go through anykpl's own HTTP client: where the
        session's proxy configuration (its settings, and the environment's for the client's
        endpoint) names no proxy for it."""
        taken = self._own_http.get(url)
        if taken is None:
            try:
                taken = self._proxies is not None and not self._proxies.proxy_url_for(url)
            except Exception:  # pragma: no cover - another botocore's proxy configuration
                taken = False
            self._own_http[url] = taken
        return taken

    async def send(
        self, route: _Route, body: memoryview, payload: Any, *, cbor: bool = False
    ) -> Mapping[str, Any]:
        """Sign ``body`` and send it (as ``payload``, the same bytes in the form the session
        sends); the parsed response, or the SDK's exceptions. ``cbor``: the body is CBOR
        (``route`` says so in its ``Content-Type``), and so is the answer where its own
        ``Content-Type`` says it is."""
        status, headers, content = await self.exchange(route, body, payload)
        if cbor and "cbor" in str(headers.get("content-type", "")).lower():
            return self._cbor_answer(status, headers, content)
        if status == 200:
            try:
                parsed: Any = json.loads(content)
            except ValueError:
                parsed = None
            if _well_formed(parsed):
                answer: dict[str, Any] = parsed
                answer["ResponseMetadata"] = _metadata(status, headers)
                return answer
        read = self._parse(status, headers, content)
        if status >= 300:
            raise self._sdk_error(read, "PutRecords")
        return read

    def _cbor_answer(
        self, status: int, headers: Mapping[str, str], content: bytes
    ) -> Mapping[str, Any]:
        """A CBOR answer to a CBOR request: as :meth:`send` returns or raises a JSON one."""
        decoded = _cbor.load(content)
        if status < 300:
            # as botocore reads an answer: no null members; one that is not a list of entries
            # is read as none (the Retrier then fails its records as a count mismatch)
            decoded = _without_nulls(decoded)
            answer: dict[str, Any] = decoded if _well_formed(decoded) else {}
            answer["ResponseMetadata"] = _metadata(status, headers)
            return answer
        raise self._cbor_error(decoded, status, headers, "PutRecords")

    def _parse(
        self, status: int, headers: Mapping[str, str], content: bytes, shape: Any = None
    ) -> dict[str, Any]:
        """The response as botocore's JSON parser reads it (errors above all), for PutRecords'
        output unless ``shape`` says otherwise."""
        if self._parser is None:
            from botocore.parsers import create_parser

            self._parser = create_parser("json")
        parsed: dict[str, Any] = self._parser.parse(
            {"status_code": status, "headers": headers, "body": content},
            self._output_shape if shape is None else shape,
        )
        parsed.setdefault("ResponseMetadata", {}).update(_metadata(status, headers))
        return parsed


def _own_http_client(session: Any, config: ProducerConfig) -> HttpClient | None:
    """anykpl's own HTTP client for the requests signed here, with ``session``'s resolved
    certificate setting; ``None`` where the session is not one this was written for, or
    offers a client certificate (those requests stay the session's)."""
    verify = getattr(session, "_verify", None)
    if not isinstance(verify, (bool, str, ssl.SSLContext)) or getattr(session, "_cert_file", None):
        return None
    return HttpClient(
        max_idle=config.max_connections,
        connect_timeout=config.connect_timeout,
        read_timeout=config.request_timeout,
        verify=verify,
    )


class _NotCbor(Exception):
    """An endpoint answered a CBOR request with a success that is not CBOR."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}, not CBOR")


def _without_nulls(value: Any) -> Any:
    """``value`` with every null member of a map left out, as botocore's parser leaves them out
    (kinesis-mock writes them)."""
    if type(value) is dict:
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if type(value) is list:
        return [_without_nulls(v) for v in value]
    return value


def _list_key(parameters: Mapping[str, Any]) -> str:
    """Which learned route a ListShards call takes: botocore sends a call by stream ARN to the
    account's own endpoint, and one by name or by ``NextToken`` alone to the region's."""
    return str(parameters.get("StreamARN") or "")


def _route_of(request: Any) -> _Route | None:
    """The route of the SDK's ``request`` if it is a plain SigV4 POST to the root of an
    HTTP(S) endpoint."""
    try:
        url = str(request.url)
        parts = urlsplit(url)
        headers = {
            str(k): v.decode() if isinstance(v, bytes) else str(v)
            for k, v in request.headers.items()
        }
    except Exception:  # pragma: no cover - another botocore's request
        return None
    authorization = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
    prefix = "AWS4-HMAC-SHA256 Credential="
    if (
        str(getattr(request, "method", "")).upper() != "POST"
        or parts.scheme not in ("http", "https")
        or parts.path not in ("", "/")
        or parts.query
        or not authorization.startswith(prefix)
    ):
        return None
    scope = authorization[len(prefix) :].split(",", 1)[0].split("/")
    if len(scope) != 5 or scope[4] != "aws4_request":
        return None
    kept = {k: v for k, v in headers.items() if k.lower() not in _PER_REQUEST_HEADERS}
    return _Route(url, _host(url), kept, scope[2], scope[3])


#: Hosts whose Kinesis stores CBOR requests' data as sent (AWS's own endpoints, VPC endpoints
#: included): ``wire_protocol="auto"`` uses CBOR there once the probe shows it is parsed
_AWS_HOST_SUFFIXES: Final = (
    ".amazonaws.com",
    ".amazonaws.com.cn",
    ".api.aws",
    ".api.amazonwebservices.com.cn",
    ".amazonaws.eu",
    ".c2s.ic.gov",
    ".sc2s.sgov.gov",
    ".cloud.adc-e.uk",
    ".csp.hci.ic.gov",
)
#: The header anykpl's emulator puts on its CBOR answers: it stores CBOR data as sent
EMULATOR_CBOR_HEADER: Final = "x-anykpl-cbor"
#: The answers that show an endpoint parsed a CBOR PutRecords (to a stream that does not exist)
_PROBE_ANSWERS: Final = frozenset({"ResourceNotFoundException", "AccessDeniedException"})
#: Seconds before a probe that met no answer (a timeout, a lost connection) is tried again
PROBE_RETRY: Final = 60.0


class _CborProbe:
    """``wire_protocol="auto"``: whether an endpoint takes CBOR, found out once per endpoint.

    Parsing is not enough: kinesalite parses CBOR and answers in it, but stores a record's byte
    string wrongly (mhart/kinesalite#101), and nothing short of writing a record and reading it
    back would show that. So CBOR is used only where the data is known to be stored as sent,
    on AWS's own endpoints and on anykpl's emulator (which says so in a header of its
    answers), and only once the endpoint has shown it parses a CBOR PutRecords: the probe
    sends one, with one record, to a stream that does not exist, so nothing can be written,
    and expects a CBOR error that names the stream's absence (or the caller's lack of access
    to it). Every other endpoint stays JSON without being asked (a stub or a proxy of the
    user's never sees a probe), and the reason is logged once."""

    def __init__(self, clock: Any, spawn: Any, timeout: float) -> None:
        """``spawn(fn, *args)`` runs a probe in a task of the transport's own, so that no
        request waits for it (the requests go in JSON meanwhile); each probe is given
        ``timeout`` seconds."""
        self._clock = clock
        self._spawn = spawn
        self._timeout = timeout
        # per endpoint (scheme, host): True or False once known, else when to try again
        self._known: dict[str, bool | float] = {}

    def decided(self, url: str) -> bool:
        """Whether the endpoint of ``url`` was found to take CBOR (``False`` until probed)."""
        return self._known.get(_endpoint(url)) is True

    def takes_cbor(self, direct: _DirectPutRecords, route: _Route, stream: str) -> bool:
        """Whether this request of ``stream`` may go in CBOR; the first time an endpoint is met,
        starts its probe (and says JSON: this request does not wait for the probe)."""
        endpoint = _endpoint(route.url)
        known = self._known.get(endpoint)
        if type(known) is bool:
            return known
        if known is not None and self._clock() < known:
            return False  # a probe is under way, or the last met no answer
        host = urlsplit(route.url).hostname or ""
        if not host.endswith(_AWS_HOST_SUFFIXES) and endpoint not in direct.stores_cbor_as_sent:
            # kinesalite parses CBOR and answers as Kinesis does, yet stores its data wrongly:
            # an endpoint that is neither AWS's nor anykpl's emulator is not asked at all
            self._known[endpoint] = False
            logger.info(
                "wire_protocol='auto': PutRecords to %s stay in JSON: anykpl can tell only of "
                "AWS's endpoints and its emulator that they store CBOR data as sent "
                "(kinesalite does not); wire_protocol='cbor' uses CBOR anyway",
                endpoint,
            )
            return False
        self._known[endpoint] = self._clock() + PROBE_RETRY  # one probe at a time
        self._spawn(self.probe, direct, route, stream)
        return False

    async def probe(self, direct: _DirectPutRecords, route: _Route, stream: str) -> None:
        """Probe the endpoint of ``route`` and keep the verdict; an answer that says nothing
        (none within the timeout, a server error, a throttle, expired credentials) leaves it on
        JSON until it is asked again, :data:`PROBE_RETRY` seconds later."""
        endpoint = _endpoint(route.url)
        try:
            with anyio.fail_after(self._timeout):
                verdict, reason = await self._probe(direct, route, stream)
        except Exception as exc:
            code, message = error_code(exc)
            self._known[endpoint] = self._clock() + PROBE_RETRY
            logger.info(
                "wire_protocol='auto': the CBOR probe of %s met no answer (%s: %s); JSON until "
                "it is tried again in %.0f s",
                endpoint,
                code,
                message,
                PROBE_RETRY,
            )
            return
        self._known[endpoint] = verdict
        if verdict:
            logger.info("wire_protocol='auto': PutRecords to %s go in CBOR", endpoint)
        else:
            logger.info("wire_protocol='auto': PutRecords to %s stay in JSON: %s", endpoint, reason)

    async def _probe(
        self, direct: _DirectPutRecords, route: _Route, stream: str
    ) -> tuple[bool, str]:
        missing = f"anykpl-cbor-probe-{os.urandom(8).hex()}"
        if stream.startswith("arn:"):
            parameters = {"StreamARN": stream.rpartition("/")[0] + "/" + missing}
        else:
            parameters = {"StreamName": missing}
        record = {"Data": b"\x00\xff anykpl", "PartitionKey": "anykpl-cbor-probe"}
        body = memoryview(
            b"".join(_cbor.put_records_body_parts({**parameters, "Records": [record]}))
        )
        status, answered_headers, content = await direct.exchange(route, body, bytes(body))
        headers = {str(name).lower(): str(value) for name, value in answered_headers.items()}
        content_type = headers.get("content-type", "")
        if status >= 500:
            raise _ProbeUnanswered(f"HTTP {status}")
        if "cbor" not in content_type.lower():
            answered = content_type or "no content type"
            return False, f"it answered a CBOR request with HTTP {status} ({answered})"
        code = _cbor.error_answer(_cbor.load(content), status, headers)["Error"]["Code"]
        if code in _PROBE_UNANSWERED:
            raise _ProbeUnanswered(code)
        if code not in _PROBE_ANSWERS:
            return False, f"it answered a CBOR request to a missing stream with {code}"
        return True, ""


class _ProbeUnanswered(Exception):
    """The probe's answer says nothing of CBOR (a server error, a throttle, ...)."""


#: Answers to the probe that say nothing of CBOR: it is asked again later
_PROBE_UNANSWERED: Final = frozenset(
    {
        "ThrottlingException",
        "ProvisionedThroughputExceededException",
        "LimitExceededException",
        "ExpiredTokenException",
        "RequestExpired",
        "InternalFailure",
        "ServiceUnavailable",
    }
)


def _endpoint(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _well_formed(parsed: Any) -> bool:
    """A PutRecords answer the Retrier can read as it is: a list of entries, each an object
    (anything else is left to botocore's parser, which drops nulls as the SDK's answers do)."""
    if type(parsed) is not dict:
        return False
    records = parsed.get("Records")
    return type(records) is list and all(type(entry) is dict for entry in records)


def _signature_refused(exc: BaseException) -> bool:
    """The service refused a request's signature (:data:`_SIGNATURE_CODES`)."""
    if not _is_client_error(exc):
        return False
    code, message = error_code(exc)
    return code in _SIGNATURE_CODES or (code == "403" and "SignatureDoesNotMatch" in message)


def _is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, ClientError)


def _metadata(status: int, headers: Mapping[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"HTTPStatusCode": status, "HTTPHeaders": dict(headers)}
    request_id = headers.get("x-amzn-requestid")
    if request_id:
        metadata["RequestId"] = request_id
    return metadata


class _BotocoreTransport:
    def __init__(
        self,
        client: Any,
        *,
        body_pieces: bool = False,
        aiohttp: bool = False,
        wire_protocol: str = "json",
        clock: Any = time.monotonic,
        spawn: Any = None,
        probe_timeout: float = 6.0,
        config: ProducerConfig | None = None,
    ) -> None:
        """Bodies are written into kept buffers (:class:`_BodyBuffers`); ``body_pieces``:
        and sent in pieces, as httpx needs (:class:`_BodyPieces`); ``aiohttp``: large ones as
        a payload that aiohttp does not warn about (:func:`_view_payload`). ``wire_protocol``:
        the PutRecords requests built here (every one after a stream's first) are JSON, CBOR,
        or (``"auto"``) CBOR where :class:`_CborProbe` finds the endpoint takes it, probing in
        tasks that ``spawn(fn, *args)`` starts (without it, ``"auto"`` is JSON). With a
        ``config`` whose ``http_backend`` is ``"auto"``, the requests built here go through
        anykpl's own HTTP client (``_http.py``) where no proxy applies."""
        self._client = client
        self._cbor = wire_protocol == "cbor"
        self._probe = (
            _CborProbe(clock, spawn, probe_timeout)
            if wire_protocol == "auto" and spawn is not None
            else None
        )
        # an endpoint answered a CBOR ListShards with a success in something else
        self._cbor_list_shards_refused = False
        self._bodies = _BodyBuffers()
        self._body_pieces = body_pieces
        self._aiohttp = aiohttp
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
        self._direct = _DirectPutRecords.for_client(
            client, own_http=config is not None and config.http_backend == "auto", config=config
        )
        self.http = None if self._direct is None else self._direct.http

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        direct = self._direct
        if direct is not None:
            route = direct.routes.get(stream)
            if route is not None:
                return await self._put_records_direct(direct, route, stream, records)
        slot = self._bodies.take()
        token = _body_slot.set(slot)
        learning = None if direct is None else _learned_route.set([])
        answered = False
        try:
            response: Mapping[str, Any] = await self._client.put_records(
                **stream_parameters(stream), Records=records
            )
            answered = True
        except Exception as exc:
            # the service answered (with an error): the route reached it
            answered = _is_client_error(exc)
            raise
        finally:
            _body_slot.reset(token)
            self._bodies.give(slot)
            if learning is not None:
                sent = _learned_route.get()
                _learned_route.reset(learning)
                if direct is not None and answered and sent:
                    direct.learn(stream, sent[-1])
        return response

    async def _put_records_direct(
        self, direct: _DirectPutRecords, route: _Route, stream: str, records: list[dict[str, Any]]
    ) -> Mapping[str, Any]:
        probe = self._probe
        cbor = self._cbor or (probe is not None and probe.takes_cbor(direct, route.cbor(), stream))
        if cbor:
            route = route.cbor()
        slot = self._bodies.take()
        try:
            parameters = {**stream_parameters(stream), "Records": records}
            body = slot.write(
                _cbor.put_records_body_parts(parameters)
                if cbor
                else put_records_body_parts(parameters)
            )
            payload = (
                _sendable(body, pieces=self._body_pieces)
                if self._body_pieces or self._aiohttp
                else body
            )
            try:
                return await direct.send(route, body, payload, cbor=cbor)
            except Exception as exc:
                if not _signature_refused(exc):
                    raise
                refused = exc
        finally:
            self._bodies.give(slot)
        # the service refused a signature made here: from now on every request goes through
        # the SDK, this one first (if the SDK's is refused too, its error is the outcome)
        code, _ = error_code(refused)
        logger.warning(
            "a PutRecords request signed by anykpl was refused (%s); every request goes "
            "through the SDK from now on",
            code,
        )
        self._direct = None
        return await self.put_records(stream, records)

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]:
        direct = self._direct
        if direct is None or not (self._cbor or self._probe is not None):
            response: Mapping[str, Any] = await self._client.list_shards(**kwargs)
            return response
        # In CBOR once a call along the same route went through the SDK (and, with "auto",
        # once the endpoint was found to take CBOR, by PutRecords' probe)
        key = _list_key(kwargs)
        route = direct.list_routes.get(key)
        probe = self._probe
        if route is not None and (self._cbor or (probe is not None and probe.decided(route.url))):
            try:
                return await direct.list_shards(route.cbor(), kwargs)
            except Exception as exc:
                if not isinstance(exc, _NotCbor) and not _signature_refused(exc):
                    raise
                # answered with a success that is not CBOR, or a signature made here refused
                logger.warning(
                    "a ListShards request in CBOR was answered with %s; ListShards goes "
                    "through the SDK, in JSON, from now on",
                    exc if isinstance(exc, _NotCbor) else error_code(exc)[0],
                )
                self._cbor_list_shards_refused = True
                direct.list_routes.clear()
        learning = _learned_route.set([])
        answered = False
        try:
            response = await self._client.list_shards(**kwargs)
            answered = True
        except Exception as exc:
            answered = _is_client_error(exc)
            raise
        finally:
            sent = _learned_route.get()
            _learned_route.reset(learning)
            if answered and sent and not self._cbor_list_shards_refused:
                direct.learn_list_shards(key, sent[-1])
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
        abortive_close=True,  # a request that timed out takes its unsent bytes with it
    )
    async with client_context as client, anyio.create_task_group() as probes:
        backend = http_backend(config)
        transport = None
        try:
            transport = _BotocoreTransport(
                client,
                body_pieces=backend == "httpx",
                aiohttp=backend == "aiohttp",
                wire_protocol=config.wire_protocol,
                spawn=probes.start_soon,  # wire_protocol="auto": its probes
                probe_timeout=config.request_timeout,
                config=config,
            )
            yield transport
        finally:
            probes.cancel_scope.cancel()
            if transport is not None and transport.http is not None:
                await transport.http.aclose()
