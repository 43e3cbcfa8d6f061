"""moto's server, started once per test session on 127.0.0.1 in its own process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "anykpl.emulator", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
