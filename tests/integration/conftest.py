"""moto's server, started once per test session on 127.0.0.1 in its own process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import HTTPServer
from typing import Any, TypeVar

import pytest

from anykpl.emulator import spawn

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"

_Server = TypeVar("_Server", bound=HTTPServer)


@contextmanager
def serving(server: _Server) -> Iterator[_Server]:
    """``server`` (a test's own HTTP server on 127.0.0.1) serving in a thread until the block
    ends; then it is shut down and closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    with spawn() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def kinesis_client(moto_endpoint: str) -> Any:
    import boto3

    return boto3.client("kinesis", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)


@pytest.fixture
def make_stream(kinesis_client: Any) -> Any:
    """Create a fresh stream with ``shards`` shards; returns its name."""

    def create(shards: int = 4) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        kinesis_client.create_stream(StreamName=name, ShardCount=shards)
        return name

    return create


@pytest.fixture
def producer_options(moto_endpoint: str) -> dict[str, Any]:
    return {"region": REGION, "endpoint_url": moto_endpoint, **CREDENTIALS}
