"""PutRecords after a stream's first: built and signed by the producer, sent through the SDK
client's HTTP session (``_transport/_botocore.py``, "PutRecords without the SDK's per-request
machinery").

moto's own server checks every request's SigV4 signature against the secret of an IAM user it
knows once ``INITIAL_NO_AUTH_ACTION_COUNT`` unauthenticated calls have been made, as AWS does:
a request signed wrongly is refused with ``SignatureDoesNotMatch``. Errors from a direct
request are the SDK's exceptions for the same answer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from anykpl import Producer, ProducerConfig
from anykpl._transport._botocore import _BotocoreTransport, open_transport

from .conftest import CREDENTIALS, REGION, serving
from .test_end_to_end import check_read_back, make_sent, read_stream_async

pytestmark = pytest.mark.anyio

#: the calls moto's server takes without checking (the IAM user, its policy and key)
UNCHECKED_CALLS = 3


@pytest.fixture(scope="module")
def signing_moto() -> Iterator[dict[str, str]]:
    """moto's server checking signatures, and the credentials of an IAM user allowed all."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    environment = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(UNCHECKED_CALLS))
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, "moto's server exited"
                assert time.monotonic() < deadline, "moto's server did not answer"
                time.sleep(0.1)
        iam = boto3.client("iam", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
        iam.create_user(UserName="producer")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="producer", PolicyName="all", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="producer")["AccessKey"]
        yield {
            "region": REGION,
            "endpoint_url": endpoint,
            "aws_access_key_id": key["AccessKeyId"],
            "aws_secret_access_key": key["SecretAccessKey"],
        }
    finally:
        server.terminate()
        server.wait(timeout=10)


def _kinesis(options: dict[str, str]) -> Any:
    import boto3

    sdk_options = {k: v for k, v in options.items() if k != "region"}
    return boto3.client("kinesis", region_name=options["region"], **sdk_options)


def _new_stream(options: dict[str, str], shards: int = 2) -> str:
    name = f"signed-{time.monotonic_ns()}"
    client = _kinesis(options)
    client.create_stream(StreamName=name, ShardCount=shards)
    client.get_waiter("stream_exists").wait(StreamName=name)
    return name


async def test_every_request_is_signed_as_moto_checks_it(signing_moto: dict[str, str]) -> None:
    """Many requests on one stream, all but the first direct: moto accepts every signature,
    and every record is read back."""
    stream = _new_stream(signing_moto)
    sent = {uid: make_sent(uid, f"key-{uid % 53}", size=300) for uid in range(3000)}
    async with Producer(**signing_moto) as producer:
        handles = []
        for index, record in enumerate(sent.values()):
            handles.append(await producer.submit(stream, record.data, record.partition_key))
            if index % 250 == 249:
                await producer.flush()  # a request at least every 250 records
        results = [await handle for handle in handles]
        transport = producer._transport
        assert isinstance(transport, _BotocoreTransport)
        assert transport._direct is not None
        assert stream in transport._direct.routes
    assert all(result.success for result in results)
    contents = await read_stream_async(_kinesis(signing_moto), stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


@pytest.mark.parametrize("http_backend", ["auto", "the backend's session"])
async def test_direct_requests_go_through_anykpls_own_http_client_by_default(
    signing_moto: dict[str, str],
    http_backend: str,
    anyio_backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the default ``http_backend="auto"`` every direct request goes through anykpl's
    own HTTP client (``_http.py``), on one kept-alive connection after another: moto's server
    takes every signature and every record is read back. Naming an SDK backend sends them all
    through that session instead, as before."""
    if http_backend != "auto":  # the session "auto" uses for the rest: aiohttp, or httpx on trio
        http_backend = "httpx" if anyio_backend == "trio" else "aiohttp"
    from anykpl._transport import _http

    own: list[str] = []
    request = _http.HttpClient.request

    async def counted(self: _http.HttpClient, url: str, *args: Any) -> Any:
        own.append(url)
        return await request(self, url, *args)

    monkeypatch.setattr(_http.HttpClient, "request", counted)
    stream = _new_stream(signing_moto)
    sent = {uid: make_sent(uid, f"key-{uid % 17}", size=200) for uid in range(600)}
    async with Producer(**signing_moto, http_backend=http_backend) as producer:
        handles = []
        for index, record in enumerate(sent.values()):
            handles.append(await producer.submit(stream, record.data, record.partition_key))
            if index % 100 == 99:
                await producer.flush()  # a request at least every 100 records
        results = [await handle for handle in handles]
        transport = producer._transport
        assert isinstance(transport, _BotocoreTransport)
        assert (transport.http is not None) == (http_backend == "auto")
    assert all(result.success for result in results)
    if http_backend == "auto":
        assert len(own) >= 5  # 6 flushes, the first request of the stream the SDK's
        assert set(own) == {signing_moto["endpoint_url"] + "/"}
    else:
        assert own == []
    contents = await read_stream_async(_kinesis(signing_moto), stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


async def test_a_refused_signature_sends_everything_through_the_sdk(
    signing_moto: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The check is real: a direct request signed with the wrong key is refused with moto's
    SignatureDoesNotMatch, the same error the SDK gets with a wrong secret. The transport then
    sends that request, and every later one, through the SDK: nothing is lost to a signer of
    ours the service does not take."""
    from botocore.exceptions import ClientError

    import anykpl._transport._botocore
    from anykpl._transport._botocore import error_code, put_records_body

    stream = _new_stream(signing_moto)
    records = [{"Data": b"x" * 10, "PartitionKey": "k"}]
    wrong = ProducerConfig(**{**signing_moto, "aws_secret_access_key": "not the secret"})
    async with open_transport(wrong) as transport:
        with pytest.raises(ClientError) as by_the_sdk:
            await transport.put_records(stream, records)
    async with open_transport(ProducerConfig(**signing_moto)) as transport:
        assert isinstance(transport, _BotocoreTransport)
        await transport.put_records(stream, records)  # the SDK's, which teaches the route
        direct = transport._direct
        assert direct is not None
        response = await transport.put_records(stream, records)  # direct
        assert response["FailedRecordCount"] == 0
        monkeypatch.setattr(
            anykpl._transport._botocore, "_signing_key", lambda *args: b"not the key"
        )
        direct._keys.clear()
        body = put_records_body({"StreamName": stream, "Records": records})
        with pytest.raises(ClientError) as directly:
            await direct.send(direct.routes[stream], memoryview(body), body)
        with caplog.at_level("WARNING", logger="anykpl.sender"):
            response = await transport.put_records(stream, records)  # refused, then the SDK's
        assert response["FailedRecordCount"] == 0
        assert transport._direct is None
        assert "every request goes through the SDK" in caplog.text
    assert type(directly.value) is type(by_the_sdk.value)
    code, message = error_code(directly.value)
    assert (code, message) == error_code(by_the_sdk.value)
    assert "SignatureDoesNotMatch" in message
    assert directly.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


async def test_a_direct_error_is_the_sdks_error(moto_endpoint: str) -> None:
    """The same answer (a stream that does not exist) raises the same exception, with the same
    code and message, from the SDK's request and from a direct one."""
    from anykpl._transport._botocore import error_code

    config = ProducerConfig(region=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    records = [{"Data": b"x", "PartitionKey": "k"}]
    raised = []
    async with open_transport(config) as transport:
        assert isinstance(transport, _BotocoreTransport)
        for _ in range(2):
            with pytest.raises(Exception) as caught:
                await transport.put_records("no-such-stream", records)
            raised.append(caught.value)
        assert transport._direct is not None
        assert "no-such-stream" in transport._direct.routes
    sdk, direct = raised
    assert type(sdk) is type(direct)
    assert type(sdk).__name__ == "ResourceNotFoundException"
    assert error_code(sdk) == error_code(direct)
    assert sdk.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert direct.response["ResponseMetadata"]["HTTPStatusCode"] == 400


async def test_tls_the_own_client_cannot_make_sends_every_request_through_the_session(
    moto_endpoint: str, make_stream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A TLS connection anykpl's own HTTP client fails to make (here: its context refuses
    every handshake; nothing was sent) is not the records' failure: that request and every
    later one go through the SDK's session, with a warning, and every record arrives."""
    from botocore.exceptions import SSLError

    config = ProducerConfig(region=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    stream = make_stream(1)
    records = [{"Data": b"x", "PartitionKey": "k"}]
    async with open_transport(config) as transport:
        assert isinstance(transport, _BotocoreTransport)
        await transport.put_records(stream, records)  # the SDK's, which teaches the route
        direct = transport._direct
        assert direct is not None
        assert direct.http is not None
        tried = []

        async def refused(url: str, *args: Any) -> Any:
            tried.append(url)
            raise SSLError(endpoint_url=url, error="certificate verify failed")

        direct.http.request = refused  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="anykpl.sender"):
            for _ in range(2):
                response = await transport.put_records(stream, records)
                assert response["FailedRecordCount"] == 0
        assert len(tried) == 1  # once, then never again
        assert direct.http is None
        assert "requests go through the SDK's HTTP session from now on" in caplog.text
    options = {"region": REGION, "endpoint_url": moto_endpoint, **CREDENTIALS}
    contents = await read_stream_async(_kinesis(options), stream)
    assert len(list(contents.user_records())) == 3


class _Answers(BaseHTTPRequestHandler):
    """Answers every POST with ``body`` (a PutRecords answer), keeping each request's headers."""

    body = b""
    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append(dict(self.headers))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answers() -> Iterator[tuple[str, type[_Answers]]]:
    handler = type("Handler", (_Answers,), {"seen": []})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler


async def test_an_answer_without_entries_reads_as_the_sdks(
    answers: tuple[str, type[_Answers]],
) -> None:
    """A 200 whose ``Records`` is null: botocore's parser drops it, and so does a direct
    request (the Retrier then fails the request as a count mismatch, not with a TypeError)."""
    url, handler = answers
    handler.body = b'{"FailedRecordCount": 0, "Records": null}'
    config = ProducerConfig(region=REGION, endpoint_url=url, **CREDENTIALS)
    records = [{"Data": b"x", "PartitionKey": "k"}]
    async with open_transport(config) as transport:
        assert isinstance(transport, _BotocoreTransport)
        sdk = await transport.put_records("s", records)
        direct = await transport.put_records("s", records)
        assert transport._direct is not None
        assert "s" in transport._direct.routes
    assert len(handler.seen) == 2
    assert {k: v for k, v in sdk.items() if k != "ResponseMetadata"} == {"FailedRecordCount": 0}
    assert {k: v for k, v in direct.items() if k != "ResponseMetadata"} == {"FailedRecordCount": 0}


async def test_lambdas_trace_id_goes_with_each_request(
    answers: tuple[str, type[_Answers]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In Lambda, each request carries the trace id of the invocation it is sent in."""
    url, handler = answers
    handler.body = b'{"FailedRecordCount": 0, "Records": [{"SequenceNumber": "1", "ShardId": "s"}]}'
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "f")
    config = ProducerConfig(region=REGION, endpoint_url=url, **CREDENTIALS)
    records = [{"Data": b"x", "PartitionKey": "k"}]
    async with open_transport(config) as transport:
        for invocation in "ABC":
            monkeypatch.setenv("_X_AMZN_TRACE_ID", f"Root=1-{invocation}")
            await transport.put_records("s", records)
    assert [seen.get("X-Amzn-Trace-Id") for seen in handler.seen] == [
        "Root=1-A",
        "Root=1-B",
        "Root=1-C",
    ]


async def test_a_request_a_hook_answered_teaches_no_route() -> None:
    """A ``before-send`` hook that answers (a stub, moto's in-process mock) keeps answering:
    only a request the HTTP session sent teaches a route."""
    from aiobotocore.awsrequest import AioAWSResponse

    answer = b'{"FailedRecordCount": 0, "Records": [{"SequenceNumber": "1", "ShardId": "s"}]}'

    class _Raw:
        async def read(self) -> bytes:
            return answer

    def stub(request: Any, **kwargs: Any) -> Any:
        return AioAWSResponse(request.url, 200, {}, _Raw())

    # nothing listens on port 9: a request that went past the stub would fail
    config = ProducerConfig(region=REGION, endpoint_url="http://127.0.0.1:9", **CREDENTIALS)
    records = [{"Data": b"x", "PartitionKey": "k"}]
    async with open_transport(config) as transport:
        assert isinstance(transport, _BotocoreTransport)
        transport._client.meta.events.register("before-send.kinesis.PutRecords", stub)
        for _ in range(3):
            response = await transport.put_records("s", records)
            assert response["FailedRecordCount"] == 0
        assert transport._direct is not None
        assert transport._direct.routes == {}
