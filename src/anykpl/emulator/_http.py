"""One connection's HTTP/1.1 for the emulator: h11 parses and frames, this module adds the limits.

Why h11 rather than a parser of our own: every rule a hand-written parser misses (of the request
line, headers, Content-Length, chunked bodies) is a request smuggled past it or a client it
misreads, and the emulator sits on a shared port. h11 is a small, pure-Python, sans-I/O HTTP/1.1
state machine, well kept, that httpcore and uvicorn build on: it validates the request line and
headers, refuses a Content-Length that is not plain digits or two that disagree, checks each
chunk's size line and the CRLF after its data, handles ``Expect: 100-continue``, keep-alive,
pipelining and ``Connection: close``, and writes the answers' framing. What it leaves to its
user, this module does, over asyncio streams:

- **limits** (``HttpLimits``): a body over ``max_body_bytes`` is answered 413 as soon as its
  Content-Length says so, or as soon as a chunked body's data passes the cap; a request head
  still incomplete past 1 MiB is answered 431 (h11's ``max_incomplete_event_size``: a head that
  completes within the read that crossed it may run over by up to that read); a request whose
  head and body have not all arrived ``read_timeout`` after its first byte is answered 408, and
  a connection idle that long between requests is closed;
- **refusals**: whatever h11 refuses is answered with its status (400 malformed, 431, 501 for a
  transfer coding other than chunked) and every refusal ends the connection cleanly: the answer,
  ``Connection: close``, a half-close, then a second of reading and dropping what the client still
  sends, so that it reads the answer rather than a reset;
- **deliberate resets**: a handler raises ``ResetConnection`` and the connection is aborted with
  no answer (the emulator's ``reset_rate`` fault).

Where h11 is strict, h11 decides: a Content-Length of more than 20 digits is malformed (400,
not 413), a chunk size of more than 20 hex digits too, and HTTP/1.1 requests must carry
``Host``. h11 does not tell its user a chunk's declared size, so a chunked body is measured by
the data that arrives, not by what its size lines promise.

The handler sees a whole request (``Request``: its body read, its framing headers replaced by the
body's length) and answers a whole response; routing is ``_server.py``'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import h11

from ._options import HttpLimits

__all__ = ("Handler", "HttpConnection", "Request", "ResetConnection", "Response")

#: a request head (request line and headers) still incomplete past this many bytes is answered 431
MAX_HEAD_BYTES = 1 << 20
#: the most read from the socket at once: large reads keep h11's per-event work per byte small
_READ_SIZE = 1 << 20
#: how long a closing connection keeps reading what the client still sends, so that the client
#: reads the 4xx answer instead of a reset (a close with unread data sends RST)
_LINGER = 1.0
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_REASONS[413] = b"Content Too Large"  # RFC 9110's name (Python 3.13's too)
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")


class Request:
    """A whole request: ``headers`` by lower-case name (repeated ones joined with ", "), the
    body read (a chunked one joined, its headers then saying ``Content-Length``)."""

    __slots__ = ("body", "headers", "method", "target")

    def __init__(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body


#: (status, headers, body); the framing adds ``Content-Length`` (kept as given for a HEAD answer)
Response = tuple[int, list[tuple[str, str]], bytes]
Handler = Callable[[Request], Awaitable[Response]]


class ResetConnection(Exception):
    """Raised by a handler to reset the connection with no answer."""


class _Refusal(Exception):
    """A request the server cannot take: answered ``status``, then the connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpConnection:
    """Serve the requests of one connection, one at a time, until it closes or is closed."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        limits: HttpLimits,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._limits = limits
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._peer_closed = False

    async def serve(self) -> None:
        h11_connection, writer = self._h11, self._writer
        try:
            while True:
                try:
                    request = await self._next_request()
                except h11.RemoteProtocolError as exc:
                    if not self._peer_closed:  # a peer gone mid-request hears nothing
                        await self._refuse(exc.error_status_hint, str(exc))
                    return
                except _Refusal as exc:
                    await self._refuse(exc.status, str(exc))
                    return
                if request is None:
                    return
                try:
                    response = await self._handler(request)
                except ResetConnection:
                    writer.transport.abort()
                    return
                self._send(request.method, response)
                await writer.drain()
                if h11_connection.our_state is not h11.DONE:  # Connection: close, HTTP/1.0
                    return
                h11_connection.start_next_cycle()
        except ConnectionError:
            return
        except asyncio.CancelledError:
            # the server is closing; nothing awaits this task, and Python 3.11's start_server
            # callback would log a cancelled connection task as an error
            return
        finally:
            writer.close()

    # -- reading -----------------------------------------------------------------------------

    async def _next_request(self) -> Request | None:
        """The next request, or None when the client closes the connection or leaves it idle
        for the read timeout. Its head and body must then arrive within the read timeout."""
        timeout = self._limits.read_timeout
        buffered = self._h11.next_event()  # a pipelined request may be buffered already
        first = buffered if isinstance(buffered, h11.Event) else None
        if first is None:
            try:
                data = await asyncio.wait_for(self._reader.read(_READ_SIZE), timeout)
            except asyncio.TimeoutError:
                return None  # idle: close it, as a server closes idle keep-alive connections
            if not data:
                return None
            self._h11.receive_data(data)
        try:
            return await asyncio.wait_for(self._read_request(first), timeout)
        except asyncio.TimeoutError:
            raise _Refusal(408, f"the request did not arrive within {timeout:g} s") from None

    async def _read_request(self, first: h11.Event | None) -> Request | None:
        event = first if first is not None else await self._next_event()
        if isinstance(event, h11.ConnectionClosed):
            return None
        assert isinstance(event, h11.Request), event  # h11's only other event in this state
        method, target = event.method.decode("ascii"), event.target.decode("latin-1")
        if not target.startswith("/"):
            # absolute form (``POST http://host:port/ HTTP/1.1``), as some clients send it
            target = "/" + target.split("://", 1)[-1].partition("/")[2]
        headers: dict[str, str] = {}
        for raw_name, raw_value in event.headers:
            name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        cap = self._limits.max_body_bytes
        length = headers.get("content-length")
        if length is not None and int(length) > cap:  # h11 checked it: at most 20 digits
            raise _Refusal(
                413,
                f"a body of {length} bytes is over the emulator's cap of {cap} bytes "
                f"(HttpLimits.max_body_bytes)",
            )
        if self._h11.they_are_waiting_for_100_continue:
            self._writer.write(self._h11.send(_CONTINUE))
        parts = []
        size = 0
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            size += len(event.data)
            if size > cap:  # only a chunked body gets here: a Content-Length was checked
                raise _Refusal(
                    413,
                    f"a chunked body of over {cap} bytes is over the emulator's cap "
                    f"(HttpLimits.max_body_bytes)",
                )
            parts.append(event.data)
        if headers.pop("transfer-encoding", None) is not None:
            headers["content-length"] = str(size)
        return Request(method, target, headers, b"".join(parts))

    async def _next_event(self) -> h11.Event:
        """h11's next event, reading from the socket as it needs."""
        h11_connection = self._h11
        while not isinstance(event := h11_connection.next_event(), h11.Event):
            # a cycle is only started once the last one is done, so h11 never pauses here
            assert event is h11.NEED_DATA, event
            data = await self._reader.read(_READ_SIZE)
            self._peer_closed = not data
            h11_connection.receive_data(data)  # b"": the peer closed, h11 decides what it means
        return event

    # -- writing -----------------------------------------------------------------------------

    def _send(self, method: str, response: Response) -> None:
        status, headers, body = response
        raw_headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers]
        if method != "HEAD" or not any(n.lower() == "content-length" for n, _ in headers):
            raw_headers.append((b"Content-Length", b"%d" % len(body)))
        h11_connection, writer = self._h11, self._writer
        head = h11.Response(
            status_code=status, headers=raw_headers, reason=_REASONS.get(status, b"")
        )
        writer.write(h11_connection.send(head))
        if method != "HEAD" and body:
            # the body as it is, not copied into one buffer with its (empty) framing
            writer.writelines(h11_connection.send_with_data_passthrough(h11.Data(data=body)) or ())
        writer.write(h11_connection.send(h11.EndOfMessage()))

    async def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` and close cleanly: half-close, then read and drop what the client
        is still sending for a moment, so that it reads the answer rather than a reset."""
        reader, writer = self._reader, self._writer
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps({"error": message}).encode()
            headers = [("Content-Type", "application/json"), ("Connection", "close")]
            self._send("", (status, headers, body))
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _LINGER
        try:
            while (left := deadline - loop.time()) > 0:
                if not await asyncio.wait_for(reader.read(65536), left):
                    break
        except (asyncio.TimeoutError, ConnectionError):
            pass
