"""anykpl's own HTTP/1.1 client (``_transport/_http.py``) against scripted servers on
127.0.0.1: answers in every framing, keep-alive and its limits, a peer that closes, errors as
the SDK's, and a request cancelled mid-way (its connection closed, never used again)."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.streams.tls
import pytest
from anyio.abc import SocketStream
from botocore.exceptions import ConnectionClosedError, EndpointConnectionError
from botocore.exceptions import SSLError as SdkSSLError

from anykpl._transport import _http
from anykpl._transport._http import HttpClient

from .certificates import self_signed

pytestmark = pytest.mark.anyio

Handler = Callable[[SocketStream, int], Awaitable[None]]


async def read_request(stream: SocketStream, buffer: bytearray) -> tuple[str, bytes]:
    """One request from ``stream``: its head and its body (by ``Content-Length``)."""
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive()
    end = buffer.index(b"\r\n\r\n")
    head = buffer[:end].decode("latin-1")
    del buffer[: end + 4]
    length = 0
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(buffer) < length:
        buffer += await stream.receive()
    body = bytes(buffer[:length])
    del buffer[:length]
    return head, body


class Tally:
    """Numbers noted as they come, and a wait until there are so many."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self._changed = anyio.Event()

    def append(self, item: int) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    def __eq__(self, other: object) -> bool:
        return self.items == other

    def __len__(self) -> int:
        return len(self.items)

    async def reach(self, count: int) -> None:
        with anyio.fail_after(5):
            while len(self.items) < count:
                await self._changed.wait()


#: the numbers of the connections the server has closed, in order (new for each ``server``)
closed = Tally()


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, Tally]]:
    """A server on 127.0.0.1 that runs ``handler(stream, n)`` for its ``n``-th connection,
    then closes it (noted in ``closed``); yields its URL and the list of connections'
    numbers as they came."""
    global closed
    connections = Tally()
    closed = Tally()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: SocketStream) -> None:
        number = len(connections)
        connections.append(number)
        async with stream:
            with contextlib.suppress(
                anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
            ):
                await handler(stream, number)
        closed.append(number)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", connections
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def client(**options: object) -> AsyncIterator[HttpClient]:
    settings: dict[str, object] = {"max_idle": 4, "connect_timeout": 2.0, "read_timeout": 5.0}
    settings["verify"] = False
    settings.update(options)
    http = HttpClient(**settings)  # type: ignore[arg-type]
    try:
        yield http
    finally:
        await http.aclose()


def answer(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    lines = [f"HTTP/1.1 {status}", *headers, f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode() + body


async def echo(stream: SocketStream, number: int) -> None:
    """Answers each request on the connection with its body, and the connection's number."""
    buffer = bytearray()
    while True:
        _, body = await read_request(stream, buffer)
        await stream.send(answer(body, f"X-Connection: {number}", "X-Amzn-RequestId: r"))


async def test_a_request_is_sent_whole_and_its_answer_read_and_the_connection_kept() -> None:
    async with client() as http, server(echo) as (url, connections):
        small = b'{"a": 1}'
        large = bytes(range(256)) * 1000  # over JOIN_BELOW: sent apart from its head
        for body in (small, memoryview(large), small):
            status, headers, content = await http.request(url, "h", {"X-A": "1"}, body)
            assert (status, content) == (200, bytes(body))
            assert headers["x-connection"] == "0"  # one connection, kept between requests
            assert headers["X-Amzn-RequestId"] == "r"  # read without regard to case
        assert connections == [0]


async def test_the_request_carries_the_host_and_headers_given() -> None:
    heads: list[str] = []

    async def keep_head(stream: SocketStream, number: int) -> None:
        head, _ = await read_request(stream, bytearray())
        heads.append(head)
        await stream.send(answer(b"{}"))

    async with client() as http, server(keep_head) as (url, _):
        headers = {"Content-Type": "application/x-amz-json-1.1", "Content-Length": "2"}
        await http.request(url, "kinesis.test:4567", headers, b"{}")
    assert heads[0].split("\r\n") == [
        "POST / HTTP/1.1",
        "Host: kinesis.test:4567",
        "Accept-Encoding: identity",
        "Content-Type: application/x-amz-json-1.1",
        "Content-Length: 2",
    ]


@pytest.mark.parametrize(
    ("framing", "keeps"),
    [
        pytest.param(
            b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n6;x=y\r\ndef\r\ng\r\n0\r\n\r\n",
            True,
            id="chunked",
        ),
        pytest.param(
            b"Transfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n1\r\ng\r\n0\r\nX-Trailer: 1\r\n\r\n",
            True,
            id="chunked-with-trailer",
        ),
        pytest.param(b"Content-Length: 7\r\nConnection: close\r\n\r\nabcdefg", False, id="close"),
        pytest.param(b"\r\nabcdefg", False, id="to-the-end"),
    ],
)
async def test_every_framing_of_an_answer_is_read(framing: bytes, keeps: bool) -> None:
    async def framed(stream: SocketStream, number: int) -> None:
        buffer = bytearray()
        while True:
            await read_request(stream, buffer)
            # an interim answer first, read past
            await stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            await stream.send(b"HTTP/1.1 200 OK\r\n" + framing)
            if not keeps:
                return

    async with client() as http, server(framed) as (url, connections):
        for _ in range(2):
            status, _, content = await http.request(url, "h", {}, b"x")
            assert (status, content.replace(b"g", b"")[:6]) == (200, b"abcdef")
            assert content.endswith(b"g")
        assert connections == ([0] if keeps else [0, 1])


async def test_an_answer_of_http_1_0_closes_its_connection_unless_kept_alive() -> None:
    async def old(stream: SocketStream, number: int) -> None:
        buffer = bytearray()
        while True:
            await read_request(stream, buffer)
            keep = "Connection: keep-alive\r\n" if number == 1 else ""
            await stream.send(f"HTTP/1.0 200 OK\r\n{keep}Content-Length: 2\r\n\r\nok".encode())
            if number == 0:
                return

    async with client() as http, server(old) as (url, connections):
        for _ in range(3):
            assert (await http.request(url, "h", {}, b"x"))[2] == b"ok"
        assert connections == [0, 1]  # the second, kept alive, served the third request


async def test_a_connection_its_peer_closed_is_not_used_again() -> None:
    async def one_each(stream: SocketStream, number: int) -> None:
        await read_request(stream, bytearray())
        await stream.send(answer(str(number).encode()))  # kept alive by its headers, but
        # closed by the server right after (as an idle close would)

    async with client() as http, server(one_each) as (url, connections):
        for expected in (0, 1, 2):
            await closed.reach(expected)  # the previous connection's close went out
            assert (await http.request(url, "h", {}, b"x"))[2] == str(expected).encode()
        assert connections == [0, 1, 2]


async def test_a_connection_idle_past_keep_alive_is_not_used_again() -> None:
    now = [0.0]
    async with client(clock=lambda: now[0]) as http, server(echo) as (url, connections):
        await http.request(url, "h", {}, b"x")
        now[0] += _http.KEEP_ALIVE - 0.1
        await http.request(url, "h", {}, b"x")
        assert connections == [0]
        now[0] += _http.KEEP_ALIVE + 0.1
        await http.request(url, "h", {}, b"x")
        assert connections == [0, 1]


async def test_connections_kept_are_at_most_max_idle() -> None:
    release = anyio.Event()

    async def slow(stream: SocketStream, number: int) -> None:
        buffer = bytearray()
        while True:
            await read_request(stream, buffer)
            await release.wait()
            await stream.send(answer(b"ok"))

    async with client(max_idle=2) as http, server(slow) as (url, connections):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(http.request, url, "h", {}, b"x")
            await connections.reach(4)  # four requests at once: four connections
            release.set()
        endpoint = http._endpoints[url]
        assert len(endpoint.idle) == 2
    assert endpoint.idle == []


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", id="short-body"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Le", id="short-head"),
        pytest.param(b"SSH-2.0-OpenSSH\r\n\r\n", id="not-http"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nab", id="negative-length"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
            id="two-lengths",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY0\r\n\r\n",
            id="chunk-overrun",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", id="bad-chunk"
        ),
    ],
)
async def test_an_answer_cut_short_or_not_http_is_a_closed_connection(reply: bytes) -> None:
    async def cut(stream: SocketStream, number: int) -> None:
        await read_request(stream, bytearray())
        await stream.send(reply)

    async with client() as http, server(cut) as (url, _):
        with pytest.raises(ConnectionClosedError) as caught:
            await http.request(url, "h", {}, b"x")
        assert url in str(caught.value)
        assert http._endpoints[url].idle == []  # not kept


async def test_an_endpoint_that_refuses_connections_is_the_sdks_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    async with client() as http:
        with pytest.raises(EndpointConnectionError):
            await http.request(f"http://127.0.0.1:{port}", "h", {}, b"x")


async def test_a_cancelled_request_closes_its_connection_abortively() -> None:
    seen: list[bytes] = []
    got_request = anyio.Event()
    ended = anyio.Event()

    async def never_answers(stream: SocketStream, number: int) -> None:
        await read_request(stream, bytearray())
        got_request.set()
        try:
            seen.append(await stream.receive())
        except anyio.BrokenResourceError:
            seen.append(b"reset")
        except anyio.EndOfStream:
            seen.append(b"end")
        ended.set()

    async with client() as http, server(never_answers) as (url, _):
        with anyio.move_on_after(5) as outer:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(http.request, url, "h", {}, b"x")
                    await got_request.wait()
                    scope.cancel()
        assert not outer.cancelled_caught
        with anyio.fail_after(5):
            await ended.wait()
        assert seen == [b"reset"]  # SO_LINGER 0: a reset, not an orderly end
        assert http._endpoints[url].idle == []


def test_the_abortive_option_is_linger_on_with_no_time() -> None:
    from anykpl._transport._aws import abortive_socket_option

    level, option, value = abortive_socket_option()
    assert (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER)
    assert struct.unpack("ii", value) == (1, 0)


@pytest.mark.parametrize("verify", ["bundle", "off", "default"])
async def test_tls_endpoints_are_checked_as_the_sdks_settings_say(
    tmp_path: Path, verify: str
) -> None:
    """Over TLS: the endpoint's certificate is checked against the bundle given (the SDK
    session's resolved ``verify``), not at all when checks are off, and against botocore's
    default bundle otherwise, which does not hold a certificate made here: the SDK's
    ``SSLError``."""
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tcp = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = tcp.extra(anyio.abc.SocketAttribute.local_port)
    listener = anyio.streams.tls.TLSListener(tcp, context, standard_compatible=False)

    async def serve(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                buffer = bytearray()
                while True:
                    _, body = await read_request(stream, buffer)  # type: ignore[arg-type]
                    await stream.send(answer(body))

    setting: bool | str = {"bundle": str(cert), "off": False, "default": True}[verify]
    url = f"https://127.0.0.1:{port}"
    async with (
        listener,
        anyio.create_task_group() as tg,
        client(verify=setting) as http,
    ):
        tg.start_soon(listener.serve, serve)
        if verify == "default":
            with pytest.raises(SdkSSLError):
                await http.request(url, "h", {}, b"x")
        else:
            for body in (b"secret", b"kept alive"):
                assert (await http.request(url, "h", {}, body))[2] == body
            assert len(http._endpoints[url].idle) == 1
        tg.cancel_scope.cancel()


async def test_keep_alive_holds_where_the_process_has_many_descriptors_open() -> None:
    """Descriptors past 1023 (which ``select.select`` refuses) are checked too: a process
    with many files open still reuses its connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        async with client() as http, server(echo) as (url, connections):
            for _ in range(3):
                await http.request(url, "h", {}, b"x")
            assert connections == [0]
    finally:
        for descriptor in files:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_an_answer_that_does_not_come_within_the_read_timeout_is_the_sdks_timeout() -> None:
    """ListShards has no bound but this one (the sender bounds PutRecords itself)."""
    from botocore.exceptions import ReadTimeoutError

    async def silent(stream: SocketStream, number: int) -> None:
        await read_request(stream, bytearray())
        await anyio.sleep_forever()

    async with client(read_timeout=0.2) as http, server(silent) as (url, _):
        with anyio.fail_after(5), pytest.raises(ReadTimeoutError):
            await http.request(url, "h", {}, b"x")
        assert http._endpoints[url].idle == []


async def test_a_tls_handshake_the_peer_ends_is_the_sdks_connection_error(tmp_path: Path) -> None:
    async def hang_up(stream: SocketStream, number: int) -> None:
        return  # closed before a TLS byte

    async with client(verify=False) as http, server(hang_up) as (url, _):
        with pytest.raises(EndpointConnectionError):
            await http.request(url.replace("http://", "https://"), "h", {}, b"x")
