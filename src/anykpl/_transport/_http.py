"""anykpl's own HTTP/1.1 client, for the requests the transport builds and signs itself.

Every stream's PutRecords after its first (and, in CBOR, ListShards) is a POST of a body
already in memory to the root of one endpoint, answered with a small body. The SDK's HTTP
sessions carry much more than that needs: httpx (trio's) spent 1.6 ms of CPU on a 68 KB
request to the emulator where this client spends 0.2-0.3 ms, and aiohttp 0.48 ms (2026-12-03,
``docs/architecture.md``). This client keeps a pool of keep-alive connections per endpoint on
anyio's streams, so it runs under asyncio and trio alike.

What it does, and what it leaves to the SDK's session (``_botocore.py`` chooses):

- HTTP/1.1 with ``Content-Length`` bodies out; answers with ``Content-Length``, chunked, or
  up to the connection's end. No proxy (an endpoint a proxy applies to, from the settings or
  the environment, goes through the SDK), no client certificate (likewise).
- TLS with the certificate settings the SDK's session resolved (``verify``: off, on with
  botocore's bundle, or a bundle's path, loaded once in a worker thread; or the context the
  session made of them).
- A connection idle in the pool for ``KEEP_ALIVE`` seconds, or found readable (its peer
  closed it, or wrote out of turn), is closed rather than used. Errors come out as the SDK's
  (:class:`~botocore.exceptions.ConnectionClosedError`, ``EndpointConnectionError``,
  ``ConnectTimeoutError``, ``ReadTimeoutError``, ``SSLError``), which the transport turns into
  error codes. ``read_timeout`` bounds a request from its first byte sent to its answer's
  last (the SDK's ``read_timeout``, ``request_timeout``: ListShards has no other bound).
- A request that does not finish (cancelled: the sender's ``request_timeout``, or the
  producer closing; or past ``read_timeout``) closes its connection abortively
  (``SO_LINGER`` 0, see ``_aws.py``): its unsent bytes are dropped, never delivered late.
"""

from __future__ import annotations

import contextlib
import select
import ssl
import time
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream, SocketAttribute
from botocore.awsrequest import HeadersDict
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.exceptions import SSLError as SdkSSLError

from ._aws import abortive_socket_option

__all__ = ("HttpClient",)

#: Seconds a connection may stay idle in the pool before it is closed instead of used (the
#: SDK's sessions keep theirs 12 s). A server that closes an idle connection sooner (Node's
#: 5 s: kinesalite) is seen doing it: the connection is readable (:func:`_quiet`).
KEEP_ALIVE: Final = 12.0
#: The most bytes of an answer's status line and headers.
MAX_HEAD: Final = 65_536
#: The most bytes one receive takes.
RECEIVE: Final = 65_536
#: Bodies up to this size go out with their request head in one send (a copy); larger ones in
#: a send of their own.
JOIN_BELOW: Final = 16_384


class _Connection:
    __slots__ = ("buffer", "idle_since", "stream")

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self.buffer = bytearray()  # received, not yet read
        self.idle_since = 0.0


class _Endpoint:
    """One origin's connections and how to reach it."""

    __slots__ = ("host", "idle", "port", "tls", "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.idle: list[_Connection] = []


class HttpClient:
    """Keep-alive connections to the endpoints of one transport; :meth:`request` sends one
    request on one of them. ``max_idle`` bounds the connections kept per endpoint (the
    sender bounds the requests in flight); ``verify``: the SDK session's resolved certificate
    setting."""

    def __init__(
        self,
        *,
        max_idle: int,
        connect_timeout: float,
        read_timeout: float,
        verify: bool | str | ssl.SSLContext,
        clock: Any = None,
    ) -> None:
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._verify = verify
        self._clock = time.monotonic if clock is None else clock
        self._endpoints: dict[str, _Endpoint] = {}
        # (a session that made its context already: that one)
        self._ssl_context = verify if isinstance(verify, ssl.SSLContext) else None
        self._closed = False

    async def request(
        self, url: str, host: str, headers: Mapping[str, str], body: memoryview | bytes
    ) -> tuple[int, HeadersDict, bytes]:
        """POST ``body`` with ``headers`` (and ``Host: host``, and its ``Content-Length``) to
        the root of ``url``; the answer's status, headers (lower-case names, read
        case-insensitively) and content.

        :raises: the SDK's connection errors (see the module's docstring).
        """
        lines = [f"POST / HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: identity\r\n"]
        lines += [
            f"{name}: {value}\r\n"
            for name, value in headers.items()
            if name.lower() not in ("content-length", "accept-encoding")
        ]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("latin-1")
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint(url)
        connection = await self._idle_connection(endpoint) if endpoint.idle else None
        if connection is None:
            connection = await self._connect(endpoint)
        done = False
        try:
            stream = connection.stream
            with anyio.fail_after(self._read_timeout):
                if len(body) < JOIN_BELOW:
                    await stream.send(head + body)
                else:
                    await stream.send(head)
                    await stream.send(body)  # type: ignore[arg-type]  # any bytes-like object
                status, answer_headers, content, keep = await _read_answer(connection, url)
            done = True
        except TimeoutError as exc:
            raise ReadTimeoutError(endpoint_url=url) from exc
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ConnectionClosedError(endpoint_url=url) from exc
        except ssl.SSLError as exc:
            raise SdkSSLError(endpoint_url=url, error=exc) from exc
        except OSError as exc:
            raise ConnectionClosedError(endpoint_url=url) from exc
        finally:
            if not done or not keep or self._closed or len(endpoint.idle) >= self._max_idle:
                await _close(connection)
            else:
                connection.idle_since = self._clock()
                endpoint.idle.append(connection)
        return status, answer_headers, content

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        for endpoint in list(self._endpoints.values()):
            idle, endpoint.idle = endpoint.idle, []
            for connection in idle:
                await _close(connection)

    async def _idle_connection(self, endpoint: _Endpoint) -> _Connection | None:
        """The most recently used idle connection that is still fit for a request; those
        past :data:`KEEP_ALIVE` or closed by their peer are closed here."""
        idle = endpoint.idle
        now = self._clock()
        while idle and now - idle[0].idle_since >= KEEP_ALIVE:  # the oldest, unused too long
            await _close(idle.pop(0))
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < KEEP_ALIVE and _quiet(connection):
                return connection
            await _close(connection)
        return None

    async def _connect(self, endpoint: _Endpoint) -> _Connection:
        url = endpoint.url
        context = None
        if endpoint.tls:
            context = self._ssl_context
            if context is None:
                verify = self._verify
                assert not isinstance(verify, ssl.SSLContext)
                context = self._ssl_context = await anyio.to_thread.run_sync(
                    _make_ssl_context, verify
                )
        try:
            with anyio.fail_after(self._connect_timeout):
                stream: ByteStream
                if context is None:
                    stream = await anyio.connect_tcp(endpoint.host, endpoint.port)
                else:
                    stream = await anyio.connect_tcp(
                        endpoint.host,
                        endpoint.port,
                        ssl_context=context,
                        tls_hostname=endpoint.host,
                        tls_standard_compatible=False,
                    )
        except TimeoutError as exc:
            raise ConnectTimeoutError(endpoint_url=url) from exc
        except ssl.SSLError as exc:
            raise SdkSSLError(endpoint_url=url, error=exc) from exc
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            # (a peer that ends or resets the connection during the TLS handshake: anyio's)
            if isinstance(exc.__cause__, ssl.SSLError):
                raise SdkSSLError(endpoint_url=url, error=exc.__cause__) from exc
            raise EndpointConnectionError(endpoint_url=url, error=exc) from exc
        with contextlib.suppress(OSError, AttributeError):
            stream.extra(SocketAttribute.raw_socket).setsockopt(*abortive_socket_option())
        return _Connection(stream)


def _make_ssl_context(verify: bool | str) -> ssl.SSLContext:
    """The TLS settings aiobotocore's sessions make for ``verify`` (botocore's context, not
    ``ssl.create_default_context``'s, whose strict checks on Python 3.13 refuse certificates
    the SDK takes)."""
    from botocore.httpsession import create_urllib3_context, get_cert_path

    context: ssl.SSLContext = create_urllib3_context()
    if verify:
        context.check_hostname = True
        ca_certs = get_cert_path(verify)
        if ca_certs:
            context.load_verify_locations(ca_certs, None, None)
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _quiet(connection: _Connection) -> bool:
    """Whether an idle connection has nothing to read: its peer has not closed it (an end
    of stream or a reset is readable) nor written out of turn."""
    if connection.buffer:
        return False
    try:
        descriptor = connection.stream.extra(SocketAttribute.raw_socket).fileno()
        if _poll is None:  # (no poll(): Windows)
            readable, _, _ = select.select([descriptor], [], [], 0)
            return not readable
        poll = _poll()
        poll.register(descriptor, select.POLLIN)
        return not poll.poll(0)
    except (OSError, ValueError, anyio.TypedAttributeLookupError):
        return False


#: ``select.poll`` where it exists: unlike ``select.select``, it takes descriptors past 1023
_poll: Final = getattr(select, "poll", None)


async def _close(connection: _Connection) -> None:
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(Exception):
            await connection.stream.aclose()


async def _receive(connection: _Connection) -> bool:
    """Receive more of the answer into the connection's buffer; ``False`` at its end."""
    try:
        chunk = await connection.stream.receive(RECEIVE)
    except anyio.EndOfStream:
        return False
    connection.buffer += chunk
    return True


async def _find(connection: _Connection, delimiter: bytes, url: str) -> int:
    """Where ``delimiter`` starts in the connection's buffer, receiving until it is there.

    :raises ConnectionClosedError: the connection ended first, or :data:`MAX_HEAD` bytes came
        without it.
    """
    buffer = connection.buffer
    end = buffer.find(delimiter)
    while end < 0:
        if len(buffer) > MAX_HEAD or not await _receive(connection):
            raise ConnectionClosedError(endpoint_url=url)
        end = buffer.find(delimiter)
    return end


async def _read_answer(connection: _Connection, url: str) -> tuple[int, HeadersDict, bytes, bool]:
    """The answer's status, headers, content, and whether the connection may be used again.

    :raises ConnectionClosedError: the connection ended before the answer did, or the answer
        is not HTTP/1.x.
    """
    buffer = connection.buffer
    while True:
        end = await _find(connection, b"\r\n\r\n", url)
        head = buffer[:end].decode("latin-1")
        del buffer[: end + 4]
        status_line, *header_lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            status = 0
        if not version.startswith("HTTP/1.") or status < 100:
            raise ConnectionClosedError(endpoint_url=url)
        if status >= 200:
            break  # (an interim answer, 1xx, is read past)
    fields: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        value = value.strip()
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    connection_header = fields.get("connection", "").lower()
    keep = (
        "close" not in connection_header
        if version == "HTTP/1.1"
        else "keep-alive" in connection_header
    )
    if status in (204, 304):
        content = b""
    elif "chunked" in fields.get("transfer-encoding", "").lower():
        content = await _read_chunked(connection, url)
    elif "content-length" in fields:
        value = fields["content-length"]
        if not value.isdigit():  # (two lengths, a sign, anything but one number)
            raise ConnectionClosedError(endpoint_url=url)
        length = int(value)
        while len(buffer) < length:
            if not await _receive(connection):
                raise ConnectionClosedError(endpoint_url=url)
        content = bytes(buffer[:length])
        del buffer[:length]
    else:  # the body runs to the connection's end
        while await _receive(connection):
            pass
        content = bytes(buffer)
        buffer.clear()
        keep = False
    return status, HeadersDict(fields), content, keep


async def _read_chunked(connection: _Connection, url: str) -> bytes:
    buffer = connection.buffer
    parts: list[bytes] = []
    while True:
        end = await _find(connection, b"\r\n", url)
        digits = bytes(buffer[:end]).split(b";", 1)[0].strip()
        if not digits or digits.strip(b"0123456789abcdefABCDEF"):
            raise ConnectionClosedError(endpoint_url=url)
        size = int(digits, 16)
        del buffer[: end + 2]
        if size == 0:
            break
        while len(buffer) < size + 2:
            if not await _receive(connection):
                raise ConnectionClosedError(endpoint_url=url)
        if buffer[size : size + 2] != b"\r\n":
            raise ConnectionClosedError(endpoint_url=url)
        parts.append(bytes(buffer[:size]))
        del buffer[: size + 2]
    # trailers, up to the empty line
    while True:
        end = await _find(connection, b"\r\n", url)
        del buffer[: end + 2]
        if end == 0:
            return b"".join(parts)
