"""The SDK makes exactly one attempt per call: every retry is the Retrier's, and on record.

A stub endpoint (a plain ``http.server`` in a thread, nothing of ours) answers the first call
of an operation with a failure botocore's standard retry mode would repeat — a 500, a
throttling error, a read timeout — and counts the requests it sees. botocore's ``max_attempts``
counts retries after the first attempt, so ``max_attempts=1`` (what anykpl passed before)
made two requests per call: duplicates no ``Attempt`` records, and the retry skipped the
Retrier's backoff, budget and adaptive control.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from botocore.exceptions import ClientError

from anykpl import Producer, ProducerConfig
from anykpl._transport._aws import create_client

from .conftest import CREDENTIALS, REGION, serving

pytestmark = pytest.mark.anyio

MAX_HASH_KEY = str(2**128 - 1)
SHARD = "shardId-000000000000"
REQUEST_TIMEOUT = 0.5


class _Stub(ThreadingHTTPServer):
    daemon_threads = True
    #: how the first request of each operation fails: "500", "throttle" or "timeout"
    failure = "500"
    #: operations whose every request fails (not only the first)
    always_fail: frozenset[str] = frozenset()
    #: whether the first request of each operation fails
    fail_first = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: Counter[str] = Counter()
        #: (operation, JSON body) of every Kinesis request
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Stub

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _operation(self, body: bytes) -> str:
        target = self.headers.get("X-Amz-Target")
        if target:
            return target.rsplit(".", 1)[-1]
        action = parse_qs(body.decode(errors="replace")).get("Action")
        if action:
            return action[0]
        return f"{self.command} {self.path}"

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        operation = self._operation(body)
        with self.server.lock:
            self.server.requests[operation] += 1
            number = self.server.requests[operation]
            if self.headers.get("X-Amz-Target"):
                self.server.bodies.append((operation, json.loads(body)))
        if (number == 1 and self.server.fail_first) or operation in self.server.always_fail:
            failure = self.server.failure
            if failure == "timeout":
                time.sleep(REQUEST_TIMEOUT * 3)
                self.close_connection = True
                return
            if self.headers.get("X-Amz-Target"):
                code, status = (
                    ("ProvisionedThroughputExceededException", 400)
                    if failure == "throttle"
                    else ("InternalFailure", 500)
                )
                error = json.dumps({"__type": code, "message": "stub"}).encode()
                self._reply(status, error, "application/x-amz-json-1.1")
            else:
                code, status = (
                    ("Throttling", 400) if failure == "throttle" else ("InternalError", 500)
                )
                error = (
                    f"<ErrorResponse><Error><Type>Receiver</Type><Code>{code}</Code>"
                    f"<Message>stub</Message></Error><RequestId>1</RequestId></ErrorResponse>"
                ).encode()
                self._reply(status, error, "text/xml")
            return
        if operation == "ListShards":
            shard = {
                "ShardId": SHARD,
                "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": MAX_HASH_KEY},
                "SequenceNumberRange": {"StartingSequenceNumber": "1"},
            }
            reply: dict[str, Any] = {"Shards": [shard]}
        elif operation == "PutRecords":
            entries = json.loads(body)["Records"]
            reply = {
                "FailedRecordCount": 0,
                "Records": [
                    {"SequenceNumber": str(1000 + i), "ShardId": SHARD} for i in range(len(entries))
                ],
            }
        else:
            reply = {}
        self._reply(200, json.dumps(reply).encode(), "application/x-amz-json-1.1")

    do_POST = _handle
    do_GET = _handle
    do_PUT = _handle
    do_HEAD = _handle


@pytest.fixture
def stub() -> Iterator[_Stub]:
    with serving(_Stub()) as server:
        yield server


def _endpoint(server: _Stub) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("failure", ["500", "throttle", "timeout"])
async def test_each_put_records_request_is_an_attempt(stub: _Stub, failure: str) -> None:
    stub.failure = failure
    options = {
        "region": REGION,
        "endpoint_url": _endpoint(stub),
        "request_timeout": REQUEST_TIMEOUT,
        "connect_timeout": REQUEST_TIMEOUT,
        "record_max_buffered_time": 0.01,
        **CREDENTIALS,
    }
    async with Producer(**options) as producer:
        result = await producer.put_record("stub-stream", b"payload", partition_key="key")
    assert result.success
    # the first ListShards failed too: the shard map retried it itself, one request per try
    assert stub.requests["PutRecords"] == len(result.attempts) == 2
    first = result.attempts[0]
    assert not first.success
    if failure == "timeout":
        # one read timeout, not two back to back
        assert first.duration < 2 * REQUEST_TIMEOUT
    else:
        expected = (
            "InternalFailure" if failure == "500" else "ProvisionedThroughputExceededException"
        )
        assert first.error_code == expected


@pytest.mark.parametrize(
    ("service", "call"),
    [
        ("kinesis", lambda client: client.list_shards(StreamName="stub-stream")),
        ("s3", lambda client: client.get_object(Bucket="fleet", Key="capacity.json")),
        (
            "cloudwatch",
            lambda client: client.put_metric_data(
                Namespace="stub", MetricData=[{"MetricName": "m", "Value": 1.0}]
            ),
        ),
    ],
)
@pytest.mark.parametrize("failure", ["500", "throttle"])
async def test_every_sdk_client_makes_one_attempt(
    stub: _Stub, service: str, call: Any, failure: str
) -> None:
    """The one client factory the Kinesis transport, the fleet coordinator (S3) and the
    CloudWatch sink share: a failing call is one request, whatever the error."""
    stub.failure = failure
    stub.always_fail = frozenset({"ListShards", "PutMetricData", "GET /fleet/capacity.json"})
    config = ProducerConfig(region=REGION, request_timeout=REQUEST_TIMEOUT, **CREDENTIALS)
    async with create_client(
        config, service, max_pool_connections=1, endpoint_url=_endpoint(stub)
    ) as client:
        with pytest.raises(ClientError):
            await call(client)
    assert sum(stub.requests.values()) == 1, stub.requests
