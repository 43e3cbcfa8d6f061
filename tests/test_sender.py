"""The Sender: botocore errors become codes at this boundary, concurrency is bounded, every
request yields exactly one outcome, and cancellation is never turned into an outcome."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
from botocore import exceptions as be

from anykpl import errors
from anykpl._core._records import KinesisRecord, Record
from anykpl._core._retrier import Outcome
from anykpl._runtime._sender import run_sender
from anykpl._transport._botocore import (
    BODY_PIECE,
    KEPT_BODY_BUFFER_MAX,
    KEPT_BODY_BUFFERS,
    _BodyBuffers,
    _BodyPieces,
    _BodySlot,
    _BotocoreTransport,
    _DirectPutRecords,
    _PutRecordsSerializer,
    _Route,
    error_code,
    put_records_body,
    put_records_body_parts,
)
from anykpl._transport._botocore import _host as signed_host


def _client_error(code: str, status: int, message: str = "m") -> be.ClientError:
    return be.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "PutRecords",
    )


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (_client_error("ResourceNotFoundException", 400), "ResourceNotFoundException"),
        (_client_error("InternalFailure", 500), "InternalFailure"),
        (_client_error("", 503), "HTTP503"),
        (be.ReadTimeoutError(endpoint_url="http://x"), errors.TIMEOUT),
        (be.ConnectTimeoutError(endpoint_url="http://x"), errors.TIMEOUT),
        (TimeoutError(), errors.TIMEOUT),
        (be.EndpointConnectionError(endpoint_url="http://x"), errors.CONNECTION_ERROR),
        (be.ConnectionClosedError(endpoint_url="http://x"), errors.CONNECTION_ERROR),
        (ConnectionResetError(104, "reset"), errors.CONNECTION_ERROR),
        (be.NoCredentialsError(), "NoCredentialsError"),
        (be.ParamValidationError(report="bad"), "ParamValidationError"),
        (ValueError("odd"), "ValueError"),
    ],
)
def test_error_code_translation(exc: BaseException, code: str) -> None:
    assert error_code(exc)[0] == code


def test_error_code_keeps_the_message() -> None:
    assert error_code(_client_error("AccessDeniedException", 400, "no")) == (
        "AccessDeniedException",
        "no",
    )


def test_terminal_and_retried_transport_codes() -> None:
    assert not errors.is_retriable("NoCredentialsError")
    assert not errors.is_retriable("ParamValidationError")
    assert errors.is_retriable(errors.TIMEOUT)
    assert errors.is_retriable(errors.CONNECTION_ERROR)
    assert errors.is_retriable("HTTP503")


def _request(n: int) -> list[KinesisRecord]:
    user = Record("s", "k", b"d", 1, None, 0.0, 1.0, 30.0)
    return [KinesisRecord.single(user) for _ in range(n)]


class _Transport:
    def __init__(self, fail: BaseException | None = None, hold: float = 0.05) -> None:
        self.fail = fail
        self.hold = hold
        self.active = 0
        self.peak = 0
        self.calls = 0

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Any:
        self.calls += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await anyio.sleep(self.hold)
            if self.fail is not None:
                raise self.fail
            return {
                "Records": [{"ShardId": "shardId-000000000000", "SequenceNumber": "1"}]
                * len(records)
            }
        finally:
            self.active -= 1

    async def list_shards(self, **kwargs: Any) -> Any:  # pragma: no cover - unused here
        return {"Shards": []}


async def _run(transport: _Transport, requests: int, max_connections: int) -> list[Outcome]:
    send_requests, receive_requests = anyio.create_memory_object_stream[Any](math.inf)
    send_outcomes, receive_outcomes = anyio.create_memory_object_stream[Outcome](math.inf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_sender(
                "s",
                transport,
                receive_requests,
                send_outcomes,
                max_connections=max_connections,
                request_timeout=5.0,
            )
        )
        async with send_requests:
            for _ in range(requests):
                send_requests.send_nowait(_request(2))
    async with receive_outcomes:
        return [o async for o in receive_outcomes]


@pytest.mark.anyio
async def test_at_most_max_connections_in_flight_and_one_outcome_per_request() -> None:
    transport = _Transport()
    outcomes = await _run(transport, requests=10, max_connections=3)
    assert transport.peak == 3
    assert len(outcomes) == 10
    assert all(o.response is not None and o.error_code is None for o in outcomes)
    assert all(o.end >= o.start for o in outcomes)


@pytest.mark.anyio
async def test_a_failed_call_becomes_an_outcome_with_a_code() -> None:
    outcomes = await _run(_Transport(fail=_client_error("InternalFailure", 500)), 2, 2)
    assert [(o.response, o.error_code) for o in outcomes] == [(None, "InternalFailure")] * 2


@pytest.mark.anyio
async def test_cancellation_is_not_an_outcome() -> None:
    transport = _Transport(hold=10.0)
    send_requests, receive_requests = anyio.create_memory_object_stream[Any](math.inf)
    send_outcomes, receive_outcomes = anyio.create_memory_object_stream[Outcome](math.inf)
    with anyio.move_on_after(0.1) as scope:
        async with send_requests:
            send_requests.send_nowait(_request(1))
            await run_sender(
                "s",
                transport,
                receive_requests,
                send_outcomes,
                max_connections=1,
                request_timeout=60.0,
            )
    assert scope.cancelled_caught
    assert transport.calls == 1
    async with receive_outcomes:
        assert [o async for o in receive_outcomes] == []


@pytest.mark.anyio
async def test_after_a_timeout_requests_are_split_to_the_window_and_wait_for_room() -> None:
    from anykpl._core._network import MIN_WINDOW, NetworkWindow

    class Slow(_Transport):
        async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Any:
            self.sizes.append(sum(len(r["Data"]) + len(r["PartitionKey"]) for r in records))
            if len(self.sizes) == 1:
                await anyio.sleep(10)  # the first times out
            return await super().put_records(stream, records)

    transport = Slow(hold=0.01)
    transport.sizes = []  # type: ignore[attr-defined]
    window = NetworkWindow(request_timeout=0.2)
    splits: list[int] = []
    user = Record("s", "k", b"x" * 20_000, 1, None, 0.0, 1.0, 30.0)
    send_requests, receive_requests = anyio.create_memory_object_stream[Any](math.inf)
    send_outcomes, receive_outcomes = anyio.create_memory_object_stream[Outcome](math.inf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_sender(
                "s",
                transport,
                receive_requests,
                send_outcomes,
                max_connections=8,
                request_timeout=0.2,
                window=window,
                on_split=splits.append,
            )
        )
        async with send_requests:
            send_requests.send_nowait([KinesisRecord.single(user) for _ in range(10)])
            await anyio.sleep(0.5)  # it timed out
            assert window.limited
            send_requests.send_nowait([KinesisRecord.single(user) for _ in range(10)])
    async with receive_outcomes:
        outcomes = [o async for o in receive_outcomes]
    assert [o.error_code for o in outcomes[:1]] == [errors.TIMEOUT]
    assert len(outcomes) == 1 + 1 + sum(splits)  # one outcome per request sent
    sizes = transport.sizes  # type: ignore[attr-defined]
    assert sizes[0] == 10 * 20_001
    assert all(size <= MIN_WINDOW for size in sizes[1:])
    assert sum(sizes[1:]) == 10 * 20_001
    assert transport.peak <= 2  # the timed-out one, then a window's worth at a time


class _Stuck(_Transport):
    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Any:
        self.calls += 1
        await anyio.sleep(100)  # never answered


async def _through_a_stuck_path(
    window: Any, users: list[Record], settle: float
) -> tuple[_Stuck, tuple[int, float], list[Outcome]]:
    """Send a request of 3 records of each of ``users``, one every 0.1 s, through a path that
    answers nothing; ``settle`` s after the last: the window's (stalls, size) then, and every
    outcome once the requests have ended."""
    transport = _Stuck()
    send_requests, receive_requests = anyio.create_memory_object_stream[Any](math.inf)
    send_outcomes, receive_outcomes = anyio.create_memory_object_stream[Outcome](math.inf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_sender(
                "s",
                transport,
                receive_requests,
                send_outcomes,
                max_connections=8,
                request_timeout=2.0,
                window=window,
            )
        )
        async with send_requests:
            for index, user in enumerate(users):
                send_requests.send_nowait([KinesisRecord.single(user) for _ in range(3)])
                await anyio.sleep(0.1 if index < len(users) - 1 else 0.0)
            await anyio.sleep(settle)
            seen = (window.stalls, window.window)
    async with receive_outcomes:
        return transport, seen, [o async for o in receive_outcomes]


@pytest.mark.anyio
@pytest.mark.autojump
async def test_a_stall_cuts_the_window_and_abandons_what_it_does_not_hold() -> None:
    """On a path that carries nothing, no request is answered for half the read timeout: the
    window is cut then, long before the requests time out, and the requests in flight beyond
    the new window (the newest) are abandoned at once, each with a timeout outcome; the oldest
    goes on until its own timeout."""
    from anykpl._core._network import NetworkWindow

    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    user = Record("s", "k", b"x" * 20_000, 1, None, 0.0, 1.0, 30.0)
    start = anyio.current_time()
    # the oldest has waited 0.55 s after the settle: a stall
    transport, seen, outcomes = await _through_a_stuck_path(window, [user] * 4, 0.45)
    assert seen == (1, 64 * 1024)
    assert transport.calls == 4
    assert [o.error_code for o in outcomes] == [errors.TIMEOUT] * 4
    abandoned, (oldest,) = outcomes[:3], outcomes[3:]
    for outcome in abandoned:
        assert outcome.error_message == "abandoned: the network path stalled"
        assert outcome.end - start == pytest.approx(0.5, abs=0.01)
    assert oldest.start - start == pytest.approx(0.0, abs=0.01)
    assert oldest.end - oldest.start == pytest.approx(2.0, abs=0.01)  # its own timeout
    assert (window.in_flight, window.stalls, window.timeouts) == (0, 1, 1)


@pytest.mark.anyio
@pytest.mark.autojump
async def test_a_stall_keeps_the_requests_whose_records_expire_first() -> None:
    """A request of records retried after an abandoned attempt goes last, but its records
    expire first: a stall keeps it, and abandons the newer records sent before it."""
    from anykpl._core._network import NetworkWindow

    window = NetworkWindow(request_timeout=2.0, read_timeout=1.0)
    fresh = Record("s", "k", b"x" * 20_000, 1, None, 0.0, 1.0, 30.0)
    retried = Record("s", "k", b"y" * 20_000, 1, None, 0.0, 1.0, 10.0)  # expires sooner
    _, seen, outcomes = await _through_a_stuck_path(window, [fresh, fresh, fresh, retried], 0.45)
    assert seen[0] == 1  # a stall
    abandoned = [o for o in outcomes if o.error_message == "abandoned: the network path stalled"]
    assert len(abandoned) == 3
    assert all(o.records[0].records[0] is fresh for o in abandoned)
    (kept,) = [o for o in outcomes if o not in abandoned]
    assert kept.records[0].records[0] is retried


def test_the_transport_closes_its_connections_abortively() -> None:
    """SO_LINGER on with no linger time: a close discards unsent bytes (and resets)."""
    import socket
    import struct

    from anykpl._transport._aws import _abortive_socket, abortive_socket_option

    level, option, value = abortive_socket_option()
    assert (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER)
    info = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0))
    with _abortive_socket(info) as sock:
        linger = sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, len(value))
        assert struct.unpack("ii", linger) == (1, 0)


def test_an_httpx_client_gets_the_abortive_option_on_every_pool() -> None:
    from aiobotocore._httpx import httpx

    from anykpl._transport._aws import _close_abortively, abortive_socket_option

    client = httpx.AsyncClient(mounts={"http://proxied": httpx.AsyncHTTPTransport()})
    assert _close_abortively(client)
    pools = [client._transport._pool, *(t._pool for t in client._mounts.values())]
    assert len(pools) == 2
    for pool in pools:
        assert pool._socket_options == [abortive_socket_option()]

    class Other:  # a transport this was not written for: nothing changes
        _pool = object()

    client = httpx.AsyncClient(mounts={"http://other": Other()})
    assert not _close_abortively(client)
    assert client._transport._pool._socket_options is None


@pytest.mark.anyio
async def test_a_request_that_times_out_resets_its_connection() -> None:
    """Through the producer's own transport (aiohttp under asyncio, httpx under trio): the
    connection of a request that timed out ends with a reset (SO_LINGER on, no linger time),
    not a graceful close that would send every byte of the abandoned body the kernel holds
    first. (aiohttp still writes out what its own buffer holds before it closes the socket.)"""
    import socket

    from anykpl._transport._botocore import open_transport
    from anykpl.config import ProducerConfig

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        config = ProducerConfig(
            region="us-east-1",
            endpoint_url=f"http://127.0.0.1:{port}",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            request_timeout=5.0,
            connect_timeout=5.0,
        )
        # a body bigger than the socket buffers take: the server reads none of it in time
        records = [{"Data": b"x" * 1_000_000, "PartitionKey": f"k{i}"} for i in range(4)]
        async with open_transport(config) as transport:
            with anyio.move_on_after(0.5):
                await transport.put_records("s", records)
            accepted, _ = server.accept()

            def read_to_the_end() -> None:
                with accepted:
                    accepted.settimeout(10.0)
                    while accepted.recv(1 << 20):
                        pass

            with pytest.raises(ConnectionResetError):
                await anyio.to_thread.run_sync(read_to_the_end)


# -- the PutRecords body --------------------------------------------------------------------


@pytest.fixture(scope="module")
def botocore_kinesis() -> Any:
    import botocore.session

    session = botocore.session.get_session()
    return session.create_client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )


ODD_KEYS = ['k"\\', "d\u00e9vice-\U0001f600", "tab\tand\nnewline", "\u2028", "\x00\x7f", "x" * 256]


@pytest.mark.parametrize(
    "parameters",
    [
        {"StreamName": "s", "Records": [{"Data": b"", "PartitionKey": "k"}]},
        {
            "StreamName": "s",
            "Records": [
                {"Data": bytes(range(256)) * 3, "PartitionKey": key, "ExplicitHashKey": "42"}
                for key in ODD_KEYS
            ],
        },
        {
            "StreamARN": "arn:aws:kinesis:us-east-1:123456789012:stream/s",
            "Records": [{"Data": b"a" * n, "PartitionKey": "a"} for n in range(1, 9)],
        },
        {"StreamName": "s", "DryRun": True, "Records": [{"Data": b"x", "PartitionKey": "k"}]},
    ],
    ids=["empty-data", "odd-keys", "stream-arn", "dry-run"],
)
def test_put_records_request_is_botocores_with_the_same_body(
    botocore_kinesis: Any, parameters: dict[str, Any]
) -> None:
    import json

    operation = botocore_kinesis.meta.service_model.operation_model("PutRecords")
    inner = botocore_kinesis._serializer
    theirs = inner.serialize_to_request(parameters, operation)
    ours = _PutRecordsSerializer(inner).serialize_to_request(parameters, operation)
    assert ours["body"] == put_records_body(parameters)
    assert json.loads(ours["body"]) == json.loads(theirs["body"])
    # everything but the body is botocore's own
    assert {k: v for k, v in ours.items() if k != "body"} == {
        k: v for k, v in theirs.items() if k != "body"
    }


def test_put_records_body_refuses_what_botocore_would_not_send() -> None:
    with pytest.raises(TypeError, match="bytes-like"):
        put_records_body({"StreamName": "s", "Records": [{"Data": "text", "PartitionKey": "k"}]})
    with pytest.raises(TypeError, match="PartitionKey must be a str, not int"):
        put_records_body({"StreamName": "s", "Records": [{"Data": b"", "PartitionKey": 1}]})
    with pytest.raises(TypeError, match="ExplicitHashKey must be a str, not int"):
        put_records_body(
            {
                "StreamName": "s",
                "Records": [{"Data": b"", "PartitionKey": "k", "ExplicitHashKey": 1}],
            }
        )


def test_serializer_validates_the_stream_as_botocore_does(botocore_kinesis: Any) -> None:
    operation = botocore_kinesis.meta.service_model.operation_model("PutRecords")
    serializer = _PutRecordsSerializer(botocore_kinesis._serializer)
    with pytest.raises(be.ParamValidationError, match="StreamName"):
        serializer.serialize_to_request(
            {"StreamName": "", "Records": [{"Data": b"", "PartitionKey": "k"}]}, operation
        )


def test_serializer_leaves_other_operations_and_protocols_to_botocore(
    botocore_kinesis: Any,
) -> None:
    service = botocore_kinesis.meta.service_model
    inner = botocore_kinesis._serializer
    list_shards = service.operation_model("ListShards")
    assert _PutRecordsSerializer(inner).serialize_to_request(
        {"StreamName": "s"}, list_shards
    ) == inner.serialize_to_request({"StreamName": "s"}, list_shards)

    class Cbor:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def serialize_to_request(self, parameters: Any, operation_model: Any) -> Any:
            self.calls.append(parameters)
            return {"headers": {"Content-Type": "application/cbor"}, "body": b"cbor", "n": 1}

    put_records = service.operation_model("PutRecords")
    cbor = Cbor()
    parameters = {"StreamName": "s", "Records": [{"Data": b"x", "PartitionKey": "k"}] * 3}
    request = _PutRecordsSerializer(cbor).serialize_to_request(parameters, put_records)
    assert request["body"] == b"cbor"
    assert cbor.calls[-1] is parameters  # the whole request is botocore's, not the placeholder
    # no records: botocore's own validation error, as before
    with pytest.raises(be.ParamValidationError, match="Records"):
        _PutRecordsSerializer(inner).serialize_to_request(
            {"StreamName": "s", "Records": []}, put_records
        )


class _Sent(Exception):
    pass


@pytest.mark.anyio
async def test_an_aiobotocore_client_sends_the_body_built_here() -> None:
    """Wired into a real aiobotocore client: the request that would go out (caught by a
    ``before-send`` hook) carries :func:`put_records_body`, and botocore's URL and headers."""
    from aiobotocore.session import AioSession

    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/s"
    records: list[dict[str, Any]] = [
        {"Data": bytes([i]) * 40, "PartitionKey": key, "ExplicitHashKey": str(i)}
        for i, key in enumerate(ODD_KEYS)
    ]
    requests: list[Any] = []

    def before_send(request: Any, **kwargs: Any) -> None:
        requests.append(request)
        raise _Sent

    async with AioSession().create_client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    ) as client:
        transport = _BotocoreTransport(client)
        _BotocoreTransport(client)  # a second transport on the client does not wrap it twice
        assert not isinstance(client._serializer._inner, _PutRecordsSerializer)
        client.meta.events.register("before-send.kinesis.PutRecords", before_send)
        with pytest.raises(_Sent):
            await transport.put_records(arn, records)
    (request,) = requests
    assert request.body == put_records_body({"StreamARN": arn, "Records": records})
    assert request.url == "https://123456789012.data-kinesis.us-east-1.amazonaws.com/"
    assert request.headers["X-Amz-Target"] == b"Kinesis_20131202.PutRecords"
    assert int(request.headers["Content-Length"]) == len(request.body)


@pytest.mark.anyio
async def test_an_aiohttp_transport_writes_bodies_into_kept_buffers() -> None:
    """The body that goes out is a view of a kept buffer, the same document;
    a buffer whose last body is still referenced is never written again."""
    from aiobotocore.session import AioSession

    requests: list[Any] = []

    def before_send(request: Any, **kwargs: Any) -> None:
        requests.append(request)
        raise _Sent

    batches = [
        [{"Data": bytes([i]) * 3000, "PartitionKey": f"k{i}"} for i in range(5)],
        [{"Data": b"x", "PartitionKey": "k"}],
    ]
    async with AioSession().create_client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    ) as client:
        transport = _BotocoreTransport(client)
        client.meta.events.register("before-send.kinesis.PutRecords", before_send)
        for records in batches:
            with pytest.raises(_Sent):
                await transport.put_records("s", records)
    first, second = requests
    for request, records in zip(requests, batches, strict=True):
        assert isinstance(request.body, memoryview)
        assert bytes(request.body) == put_records_body({"StreamName": "s", "Records": records})
        assert int(request.headers["Content-Length"]) == len(request.body)
    # the first body is still held here: the second request wrote into a buffer of its own
    assert first.body.obj is not second.body.obj


@pytest.mark.anyio
async def test_an_httpx_transport_sends_kept_bodies_in_pieces() -> None:
    """``body_pieces``: after botocore signed the view, the body that goes to httpx is the
    same bytes in pieces (httpx takes only ``bytes`` or an iterable), with botocore's
    ``Content-Length``; each piece is a view, so the buffer is not rewritten under it."""
    from aiobotocore.config import AioConfig
    from aiobotocore.httpxsession import HttpxSession
    from aiobotocore.session import AioSession

    requests: list[Any] = []

    def before_send(request: Any, **kwargs: Any) -> None:
        requests.append(request)
        raise _Sent

    records = [{"Data": bytes([i]) * 100_000, "PartitionKey": f"k{i}"} for i in range(6)]
    async with AioSession().create_client(
        "kinesis",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=AioConfig(http_session_cls=HttpxSession),
    ) as client:
        transport = _BotocoreTransport(client, body_pieces=True)
        # a second transport on the client does not hook it twice
        _BotocoreTransport(client, body_pieces=True)
        client.meta.events.register("before-send.kinesis.PutRecords", before_send)
        with pytest.raises(_Sent):
            await transport.put_records("s", records)
    (request,) = requests
    expected = put_records_body({"StreamName": "s", "Records": records})
    assert len(expected) > 3 * BODY_PIECE  # several pieces, the last one short
    body = request.body
    assert isinstance(body, _BodyPieces)
    assert len(body) == len(expected) == int(request.headers["Content-Length"])
    pieces = list(body)
    assert all(isinstance(piece, memoryview) for piece in pieces)
    assert [len(piece) for piece in pieces[:-1]] == [BODY_PIECE] * (len(pieces) - 1)
    assert b"".join(pieces) == expected
    assert b"".join([piece async for piece in body]) == expected  # what httpx reads


@pytest.mark.anyio
async def test_an_aiohttp_transport_sends_a_large_body_without_aiohttps_warning() -> None:
    """aiohttp warns (ResourceWarning) about a bytes body over 1 MiB; under -W error (a test
    suite's filterwarnings = error, as here) that was an exception, so every such PutRecords
    failed. The kept body goes as a payload aiohttp takes as it is, with the same bytes."""
    import aiohttp
    from aiobotocore.session import AioSession

    requests: list[Any] = []

    class _Sent(Exception):
        pass

    def before_send(request: Any, **kwargs: Any) -> None:
        requests.append(request)
        raise _Sent

    records = [{"Data": bytes([i]) * 300_000, "PartitionKey": f"k{i}"} for i in range(6)]
    async with AioSession().create_client(
        "kinesis", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    ) as client:
        transport = _BotocoreTransport(client, aiohttp=True)
        client.meta.events.register("before-send.kinesis.PutRecords", before_send)
        with pytest.raises(_Sent):
            await transport.put_records("s", records)
    (request,) = requests
    expected = put_records_body({"StreamName": "s", "Records": records})
    assert len(expected) > 1 << 20
    body = request.body
    assert isinstance(body, aiohttp.payload.BytesPayload)  # no warning made it (-W error)
    assert body.size == len(expected) == int(request.headers["Content-Length"])
    assert bytes(body._value) == expected
    # aiohttp takes it as the payload it is
    assert aiohttp.payload.PAYLOAD_REGISTRY.get(body) is body


def test_body_pieces_of_an_empty_and_a_short_body() -> None:
    assert list(_BodyPieces(memoryview(b""))) == []
    assert [bytes(p) for p in _BodyPieces(memoryview(b"abc"))] == [b"abc"]


def test_body_slot_writes_parts_and_reuses_its_buffer() -> None:
    parameters = {"StreamName": "s", "Records": [{"Data": b"a" * 100, "PartitionKey": "k"}] * 3}
    parts = put_records_body_parts(parameters)
    slot = _BodySlot(bytearray())
    body = slot.write(parts)
    assert bytes(body) == put_records_body(parameters)
    buffer = slot.buffer
    del body
    small = put_records_body_parts(
        {"StreamName": "s", "Records": [{"Data": b"", "PartitionKey": "k"}]}
    )
    body = slot.write(small)  # the same buffer, no view left of it: written again from the start
    assert slot.buffer is buffer
    assert bytes(body) == b"".join(small)
    again = slot.write(parts)  # a view is alive (``body``): a new buffer
    assert slot.buffer is not buffer
    assert bytes(body) == b"".join(small)  # the live view was not overwritten
    assert bytes(again) == put_records_body(parameters)


def test_body_buffers_keep_a_few_buffers_of_bounded_size() -> None:
    buffers = _BodyBuffers()
    slots = [buffers.take() for _ in range(KEPT_BODY_BUFFERS + 1)]
    slots[0].buffer += bytes(KEPT_BODY_BUFFER_MAX + 1)  # a body bigger than any kept one
    kept = [slot.buffer for slot in slots[1:]]
    for slot in slots:
        buffers.give(slot)
    taken = [buffers.take().buffer for _ in range(KEPT_BODY_BUFFERS + 1)]
    assert {id(b) for b in taken[:KEPT_BODY_BUFFERS]} == {id(b) for b in kept}
    assert all(b is not slots[0].buffer for b in taken)


def test_transport_installs_the_serializer_when_botocore_has_one(botocore_kinesis: Any) -> None:
    class Client:
        _serializer = botocore_kinesis._serializer

    client = Client()
    _BotocoreTransport(client)
    assert isinstance(client._serializer, _PutRecordsSerializer)
    bare = object()
    _BotocoreTransport(bare)  # another botocore, without the attribute: left alone


# -- direct PutRecords: what the SDK sent first, signed here afterwards -----------------------


@pytest.mark.parametrize(
    ("url", "token"),
    [
        ("https://kinesis.us-east-1.amazonaws.com/", None),
        ("https://kinesis.us-east-1.amazonaws.com:443/", "the session token"),
        ("http://127.0.0.1:4567/", None),
        ("http://[::1]:4567/", "t"),
        ("https://123456789012.data-kinesis.eu-west-1.amazonaws.com/", None),
    ],
)
def test_a_direct_request_is_signed_as_botocore_signs_it(
    url: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same headers, same body, same moment: the same Authorization header as botocore's
    SigV4 signer writes, and the same token header."""
    import datetime

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    moment = datetime.datetime(2026, 11, 27, 16, 5, 9)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: moment)
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    body = put_records_body(
        {"StreamName": "s", "Records": [{"Data": b"\x00\xff" * 300, "PartitionKey": "k"}]}
    )
    region = "eu-west-1" if "eu-west-1" in url else "us-east-1"
    headers = {
        "X-Amz-Target": "Kinesis_20131202.PutRecords",
        "Content-Type": "application/x-amz-json-1.1",
        "User-Agent": "Botocore/1.0  anykpl   (spaces  folded)",
    }
    request = AWSRequest(method="POST", url=url, headers=dict(headers), data=body)
    botocore.auth.SigV4Auth(credentials, "kinesis", region).add_auth(request)

    route = _Route(url, signed_host(url), headers, region, "kinesis")
    signed = route.sign(memoryview(body), credentials, "20261127T160509Z")
    assert signed["Authorization"] == request.headers["Authorization"]
    assert signed["X-Amz-Date"] == request.headers["X-Amz-Date"]
    assert signed.get("X-Amz-Security-Token") == request.headers.get("X-Amz-Security-Token")
    assert signed["Content-Length"] == str(len(body))


class _SdkRequest:
    def __init__(self, url: str, headers: dict[str, Any], method: str = "POST") -> None:
        self.url = url
        self.headers = headers
        self.method = method


_SIGNED = (
    b"AWS4-HMAC-SHA256 Credential=AKID/20261127/eu-west-1/kinesis/aws4_request, "
    b"SignedHeaders=content-type;host;x-amz-date;x-amz-target, Signature=00"
)


def test_a_route_is_learned_from_a_plain_sigv4_post_only() -> None:
    """The route keeps the SDK's URL and its lasting headers, and the scope's region and
    service; a request unlike a plain SigV4 POST to an endpoint's root leaves the stream
    with the SDK."""
    direct = _DirectPutRecords(client=None, credentials=object(), send=None, output_shape=None)
    headers = {
        "X-Amz-Target": b"Kinesis_20131202.PutRecords",
        "Content-Type": b"application/x-amz-json-1.1",
        "User-Agent": b"Botocore/1.0",
        "X-Amz-Date": b"20261127T000000Z",
        "X-Amz-Security-Token": b"t",
        "Content-Length": b"12",
        "amz-sdk-invocation-id": b"1",
        "amz-sdk-request": b"attempt=1; max=1",
        "Authorization": _SIGNED,
    }
    direct.learn("s", _SdkRequest("https://kinesis.eu-west-1.amazonaws.com/", headers))
    route = direct.routes["s"]
    assert (route.url, route.host, route.region, route.service) == (
        "https://kinesis.eu-west-1.amazonaws.com/",
        "kinesis.eu-west-1.amazonaws.com",
        "eu-west-1",
        "kinesis",
    )
    assert route.headers == {
        "X-Amz-Target": "Kinesis_20131202.PutRecords",
        "Content-Type": "application/x-amz-json-1.1",
        "User-Agent": "Botocore/1.0",
    }
    refused = [
        _SdkRequest("https://kinesis.eu-west-1.amazonaws.com/prefix/", headers),
        _SdkRequest("https://kinesis.eu-west-1.amazonaws.com/?x=1", headers),
        _SdkRequest("https://kinesis.eu-west-1.amazonaws.com/", headers, method="GET"),
        _SdkRequest(
            "https://kinesis.eu-west-1.amazonaws.com/",
            {**headers, "Authorization": b"AWS4-ECDSA-P256-SHA256 Credential=AKID/x"},
        ),
        _SdkRequest("https://kinesis.eu-west-1.amazonaws.com/", {**headers, "Authorization": b"x"}),
    ]
    for index, request in enumerate(refused):
        direct.learn(f"refused-{index}", request)
    assert list(direct.routes) == ["s"]


@pytest.mark.anyio
async def test_a_client_without_credentials_sends_everything_through_the_sdk() -> None:
    """Unsigned requests (no credentials): no direct route is ever learned."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession
    from botocore import UNSIGNED

    async with AioSession().create_client(
        "kinesis", region_name="us-east-1", config=AioConfig(signature_version=UNSIGNED)
    ) as client:
        assert _BotocoreTransport(client)._direct is None


def test_lambdas_trace_id_is_read_for_each_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """As botocore's recursion-detection handler: only in Lambda, quoted as botocore quotes it."""
    from anykpl._transport._botocore import _trace_header

    monkeypatch.delenv("AWS_LAMBDA_FUNCTION_NAME", raising=False)
    monkeypatch.setenv("_X_AMZN_TRACE_ID", "Root=1-a")
    assert _trace_header() is None
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "f")
    assert _trace_header() == "Root=1-a"
    monkeypatch.setenv("_X_AMZN_TRACE_ID", "Root=1-b;Parent=x y")
    assert _trace_header() == "Root=1-b;Parent=x%20y"
    monkeypatch.setenv("_X_AMZN_TRACE_ID", "")
    assert _trace_header() is None
