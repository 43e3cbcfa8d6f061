"""``proxy_url`` through a real forward proxy on 127.0.0.1, on both backends: every AWS call
the producer makes — Kinesis, the fleet's S3, a ``CloudWatchSink``'s CloudWatch — goes through
it with its credentials, to moto's server, and every record is read back from the stream
directly (not through the proxy)."""

from __future__ import annotations

import base64
import http.client
import http.server
import threading
import uuid
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from anykpl import FleetConfig, Producer
from anykpl._core._aggregator import SHARD_MAP_WAIT
from anykpl.errors import EXPIRED, RecordFailedError
from anykpl.metrics import CloudWatchSink

from .conftest import CREDENTIALS, REGION, serving
from .test_end_to_end import assert_success, check_read_back, make_sent, read_stream

pytestmark = pytest.mark.anyio

#: headers for one hop only (RFC 9110 §7.6.1), not forwarded
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


class _ForwardProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, credentials: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.expected_authorization = "Basic " + base64.b64encode(credentials.encode()).decode()
        self.seen: list[str] = []  # per request: the target's service, as the call names it
        self.refused = 0  # requests without the proxy's credentials
        self.lock = threading.Lock()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    """An HTTP/1.1 forward proxy for ``http://`` targets (absolute-form request lines), with
    Basic proxy authentication: what a corporate proxy does for plain HTTP."""

    protocol_version = "HTTP/1.1"
    server: _ForwardProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        target = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.headers.get("Proxy-Authorization") != self.server.expected_authorization:
            with self.server.lock:
                self.server.refused += 1
            self._reply(407, [("Proxy-Authenticate", 'Basic realm="test"')], b"")
            return
        if target.scheme != "http" or not target.hostname:
            self._reply(400, [], b"absolute http:// URLs only")
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            path = target.path or "/"
            connection.request(
                self.command, path + (f"?{target.query}" if target.query else ""), body, headers
            )
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        with self.server.lock:
            self.server.seen.append(_service(self.headers, path, body))
        self._reply(response.status, response.getheaders(), data)

    def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward


def _service(headers: Any, path: str, body: bytes | None) -> str:
    """Which AWS service a request is for, from what it says: Kinesis's JSON target, the
    signing scope of the Authorization header (``.../<region>/<service>/aws4_request``)."""
    target = headers.get("X-Amz-Target", "")
    if target.startswith("Kinesis_"):
        return "kinesis"
    authorization = headers.get("Authorization", "")
    scope = authorization.partition("Credential=")[2].split(",")[0].split("/")
    return scope[3] if len(scope) >= 5 else f"unknown {path}"


def _proxy(credentials: str) -> AbstractContextManager[_ForwardProxy]:
    return serving(_ForwardProxy(credentials))


async def test_every_aws_call_goes_through_the_proxy(
    moto_endpoint: str, make_stream: Any, kinesis_client: Any
) -> None:
    import boto3

    stream = make_stream(2)
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS).create_bucket(
        Bucket=bucket
    )
    sent = {uid: make_sent(uid, f"k{uid}", size=200) for uid in range(40)}
    with _proxy("ops:p@ss") as proxy:
        port = proxy.server_address[1]
        sink = CloudWatchSink(
            namespace=f"anykpl-proxy-{uuid.uuid4().hex[:8]}", endpoint_url=moto_endpoint
        )
        fleet = FleetConfig(
            bucket=bucket, records_per_second=10_000, sync_interval=0.5, endpoint_url=moto_endpoint
        )
        async with Producer(
            region=REGION,
            endpoint_url=moto_endpoint,
            proxy_url=f"http://ops:p%40ss@127.0.0.1:{port}",
            metrics_sinks=[sink],
            # a publish may take its whole upload delay: a second leaves a loaded machine room
            # for a PutMetricData or two through the proxy (0.1-0.2 s each on a 2-core VM)
            metrics_upload_delay=1.0,
            fleet=fleet,
            **CREDENTIALS,
        ) as producer:
            for record in sent.values():
                assert_success(await producer.put_record(stream, record.data, record.partition_key))
            await anyio.sleep(1.5)  # a periodic upload as well as the final one
            fleet_statistics = producer.statistics().fleet
        assert proxy.refused == 0
        seen = set(proxy.seen)
    assert {"kinesis", "s3", "monitoring"} <= seen, seen  # CloudWatch signs as "monitoring"
    assert fleet_statistics is not None
    assert sink.failures == 0
    assert sink.calls >= 1
    arrived = check_read_back(read_stream(kinesis_client, stream), sent)
    assert set(arrived) == set(sent)
    assert all(count == 1 for count in arrived.values())


async def test_a_proxy_that_refuses_the_credentials_fails_the_records_clearly(
    moto_endpoint: str, make_stream: Any
) -> None:
    """A wrong proxy password: the record waits for a shard map whose ListShards the proxy
    refuses, and fails at its TTL, not a hang, its history naming the proxy's 407."""
    stream = make_stream(1)
    with _proxy("ops:right") as proxy:
        port = proxy.server_address[1]
        async with Producer(
            region=REGION,
            endpoint_url=moto_endpoint,
            proxy_url=f"http://ops:wrong@127.0.0.1:{port}",
            record_ttl=2.0,
            **CREDENTIALS,
        ) as producer:
            started = anyio.current_time()
            with pytest.raises(RecordFailedError) as caught:
                await producer.put_record(stream, b"x", "k")
            took = anyio.current_time() - started
        assert proxy.refused >= 1
    # no hang: the wait for the shard map ends at the record's TTL (before the longest wait
    # for a map), unsent, with the proxy's answer to ListShards in its history
    assert took < SHARD_MAP_WAIT
    (attempt,) = caught.value.result.attempts
    assert attempt.error_code == EXPIRED
    assert attempt.error_message is not None
    assert "ListShards failed: 407" in attempt.error_message, attempt
