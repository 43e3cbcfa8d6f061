"""``wire_protocol="cbor"``: PutRecords in Kinesis's CBOR protocol, through the public API,
against the emulator over HTTP, on asyncio and trio; every record read back with AWS's
deaggregator (``aws_kinesis_agg``), and the emulator's own count of the CBOR requests it
answered."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import boto3
import pytest

from anykpl import Producer, ProducerConfig
from anykpl._core._limits import MAX_HASH_KEY
from anykpl.emulator import EmulatorClient, spawn

from . import interop_servers
from .conftest import CREDENTIALS, REGION

pytestmark = pytest.mark.anyio
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    with spawn() as url:
        yield url


def _endpoints() -> ModuleType:
    """benchmarks/endpoints.py: moto's own server, and reading a stream back with AWS's
    deaggregator."""
    spec = importlib.util.spec_from_file_location("endpoints", BENCHMARKS / "endpoints.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_back(url: str, stream: str) -> Counter[tuple[str, bytes]]:
    """Every user record in ``stream``, (partition key, data), as AWS's deaggregator reads it."""
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
    found: Counter[tuple[str, bytes]] = _endpoints().read_back(client, stream)
    return found


@pytest.fixture
def cbor_bodies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many CBOR PutRecords bodies the producer writes (the probe's not counted)."""
    from anykpl._transport import _cbor

    bodies = [0]
    written = _cbor.put_records_body_parts

    def counted(parameters: Any) -> list[bytes]:
        names = (parameters.get("StreamName"), parameters.get("StreamARN"))
        if not any(str(n).rpartition("/")[2].startswith("anykpl-cbor-probe-") for n in names):
            bodies[0] += 1
        return written(parameters)

    monkeypatch.setattr(_cbor, "put_records_body_parts", counted)
    return bodies


def workload(count: int) -> list[tuple[str, bytes, int | None]]:
    """(partition key, data, explicit hash key): small records under many keys (aggregated),
    some with explicit hash keys, and a few over the aggregate's size (each sent as a Kinesis
    record of its own, its data a byte string of more than 65,535 bytes)."""
    rng = random.Random(35)
    items: list[tuple[str, bytes, int | None]] = []
    for i in range(count):
        key = f"device-{rng.randrange(500)}-é"
        size = 70_000 if i % 500 == 7 else rng.choice((1, 23, 24, 100, 255, 256, 1000))
        data = (b"%08d|" % i) + bytes(rng.randrange(256) for _ in range(size))
        hash_key = rng.randrange(MAX_HASH_KEY + 1) if i % 11 == 0 else None
        items.append((key, data, hash_key))
    return items


async def put_workload(
    producer: Producer,
    stream: str,
    items: list[tuple[str, bytes, int | None]],
    *,
    before_the_rest: Any = None,
    pause_every: int = 0,
) -> list[Any]:
    """``put_record`` of the first item (the stream's first request, through the SDK, in JSON),
    ``before_the_rest()`` if given, then a ``submit`` of each other item (a short pause every
    ``pause_every``, so that they go in several requests); the results of the rest."""
    key, data, hash_key = items[0]
    await producer.put_record(stream, data, key, hash_key)
    if before_the_rest is not None:
        before_the_rest()
    handles = []
    for index, (key, data, hash_key) in enumerate(items[1:]):
        handles.append(await producer.submit(stream, data, key, hash_key))
        if pause_every and index % pause_every == 0:
            await anyio.sleep(0.01)
    return [await handle for handle in handles]


async def test_records_sent_in_cbor_are_all_delivered() -> None:
    """Each stream's first PutRecords goes through the SDK in JSON; the rest in CBOR, and every
    record is read back once, with its key and data."""
    stream = f"cbor-{uuid.uuid4().hex[:8]}"
    with spawn(streams={stream: 4}) as url:
        control = EmulatorClient(url)
        items = workload(2_000)
        config = ProducerConfig(
            region=REGION, endpoint_url=url, wire_protocol="cbor", **CREDENTIALS
        )
        async with Producer(config) as producer:
            results = await put_workload(producer, stream, items)
        assert all(result.success for result in results)
        totals = control.stats()["totals"]
        assert totals["cbor_requests"] >= 1
        assert totals["requests"] > totals["cbor_requests"]  # the first, in JSON
        found = read_back(url, stream)
        assert found == Counter((key, data) for key, data, _ in items)


async def test_list_shards_goes_in_cbor_after_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard map's first ListShards goes through the SDK; after a split, the producer lists
    the shards again, in CBOR, and every record is still read back where it was put."""
    from anykpl._transport import _botocore

    listed = [0]
    direct_list = _botocore._DirectPutRecords.list_shards

    async def counted(self: Any, route: Any, parameters: Any) -> Any:
        listed[0] += 1
        return await direct_list(self, route, parameters)

    monkeypatch.setattr(_botocore._DirectPutRecords, "list_shards", counted)
    stream = f"cbor-{uuid.uuid4().hex[:8]}"
    with spawn(streams={stream: 2}) as url:
        control = EmulatorClient(url)
        items = workload(1_200)
        config = ProducerConfig(
            region=REGION, endpoint_url=url, wire_protocol="cbor", **CREDENTIALS
        )
        async with Producer(config) as producer:
            handles = []
            for index, (key, data, hash_key) in enumerate(items):
                if index == 400:
                    control.reshard(stream, "split", shard_id="shardId-000000000000")
                handles.append(await producer.submit(stream, data, key, hash_key))
                if index % 50 == 0:
                    await anyio.sleep(0.02)
            results = [await handle for handle in handles]
            with anyio.fail_after(10):
                while len(producer.statistics().streams[stream].open_shards) < 3:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        assert all(result.success for result in results)
        assert listed[0] >= 1  # ListShards again, in CBOR
        found = read_back(url, stream)
        assert set(found) == {(k, d) for k, d, _ in items}
        # a record that landed on a child of the shard it was sent for is sent again (as the
        # KPL does): a copy per attempt at most
        for (key, data, _), result in zip(items, results, strict=True):
            assert found[(key, data)] <= len(result.attempts)


async def test_cbor_errors_are_read_and_retried() -> None:
    """The emulator answers a third of the requests with a CBOR 500 or 503: each is read as its
    error code and retried, and nothing is lost or failed."""
    stream = f"cbor-{uuid.uuid4().hex[:8]}"
    with spawn(streams={stream: 2}) as url:
        control = EmulatorClient(url)
        items = workload(600)
        config = ProducerConfig(
            region=REGION,
            endpoint_url=url,
            wire_protocol="cbor",
            record_max_buffered_time=0.01,  # many small requests
            **CREDENTIALS,
        )
        async with Producer(config) as producer:
            results = await put_workload(
                producer,
                stream,
                items,
                before_the_rest=partial(
                    control.set_faults, error_rate=0.35, fault_after_write=0.0, seed=35
                ),
                pause_every=20,  # requests of a few records each: many of them
            )
            control.clear_faults()
        assert all(result.success for result in results)
        codes: Counter[Any] = Counter(
            a.error_code for result in results for a in result.attempts if not a.success
        )
        assert codes, "no CBOR error answer was met"
        assert set(codes) <= {"InternalFailure", "ServiceUnavailable"}, codes
        assert control.stats()["totals"]["cbor_requests"] > 1
        assert read_back(url, stream) == Counter((k, d) for k, d, _ in items)


async def test_kinesis_mock_stores_what_anykpl_sends_in_cbor(
    tmp_path: Path, cbor_bodies: list[int]
) -> None:
    """kinesis-mock (npm ``kinesis-local``), an independent implementation that speaks Kinesis's
    CBOR protocol, stores every record anykpl sends it in CBOR as it was put."""
    with endpoint_of("kinesis-mock", tmp_path) as url:
        stream = f"cbor-{uuid.uuid4().hex[:8]}"
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
        client.create_stream(StreamName=stream, ShardCount=2)
        client.get_waiter("stream_exists").wait(
            StreamName=stream, WaiterConfig={"Delay": 0.1, "MaxAttempts": 200}
        )
        items = workload(800)
        config = ProducerConfig(
            region=REGION, endpoint_url=url, wire_protocol="cbor", **CREDENTIALS
        )
        async with Producer(config) as producer:
            results = await put_workload(producer, stream, items)
        assert all(result.success for result in results)
        assert cbor_bodies[0] >= 1  # requests went in CBOR
        assert read_back(url, stream) == Counter((k, d) for k, d, _ in items)


def test_cbor_needs_cbor2(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from anykpl.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cbor2" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install cbor2"):
        ProducerConfig(wire_protocol="cbor")
    assert ProducerConfig(wire_protocol="json").wire_protocol == "json"


def test_the_emulator_answers_cbor_in_cbor(emulator: str) -> None:
    """ListShards and PutRecords in CBOR straight over HTTP: CBOR answers, errors included."""
    import urllib.error
    import urllib.request

    import cbor2

    stream = f"cbor-{uuid.uuid4().hex[:8]}"
    EmulatorClient(emulator).create_stream(stream, shards=2)

    def call(operation: str, body: dict[str, Any]) -> tuple[int, str, Any]:
        request = urllib.request.Request(
            emulator,
            data=cbor2.dumps(body),
            method="POST",
            headers={
                "Content-Type": "application/x-amz-cbor-1.1",
                "X-Amz-Target": f"Kinesis_20131202.{operation}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, headers, content = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, content = error.code, error.headers, error.read()
        return status, headers["Content-Type"], cbor2.loads(content)

    status, content_type, answer = call("ListShards", {"StreamName": stream})
    assert (status, content_type) == (200, "application/x-amz-cbor-1.1")
    assert len(answer["Shards"]) == 2
    records = [{"Data": b"\x00\xff" * 10, "PartitionKey": "k"}]
    status, _, answer = call("PutRecords", {"StreamName": stream, "Records": records})
    assert status == 200
    assert answer["FailedRecordCount"] == 0
    assert answer["Records"][0]["ShardId"].startswith("shardId-")
    text = [{"Data": "not bytes", "PartitionKey": "k"}]
    status, content_type, answer = call("PutRecords", {"StreamName": stream, "Records": text})
    assert (status, content_type) == (400, "application/x-amz-cbor-1.1")
    assert answer["__type"] == "SerializationException"


@contextlib.contextmanager
def endpoint_of(name: str, tmp_path: Path) -> Iterator[str]:
    """A running endpoint: the emulator, moto's own server, kinesalite or kinesis-mock."""
    if name == "emulator":
        with spawn() as url:
            yield url
    elif name == "moto":
        with _endpoints().start_moto_server() as url:
            yield url
    else:
        missing = interop_servers.missing_tools()
        if missing:
            pytest.skip(f"{name} is installed from npm: {' and '.join(missing)} not found on PATH")
        with interop_servers.run(name, interop_servers.install(), tmp_path) as server:
            yield server.url


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("endpoint", "cbor"),
    [("emulator", True), ("moto", False), ("kinesalite", False), ("kinesis-mock", False)],
)
async def test_auto_uses_cbor_only_where_it_is_stored_as_sent(
    endpoint: str, cbor: bool, tmp_path: Path, cbor_bodies: list[int], caplog: Any
) -> None:
    """``wire_protocol="auto"``: CBOR on the emulator, JSON on moto's server (it refuses CBOR),
    kinesalite (it parses CBOR but stores its data wrongly) and kinesis-mock (it parses CBOR,
    and anykpl cannot tell how it stores it); the probe writes nothing; every record is read
    back as it was put."""
    caplog.set_level(logging.INFO, logger="anykpl.sender")
    with endpoint_of(endpoint, tmp_path) as url:
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
        stream = f"auto-{uuid.uuid4().hex[:8]}"
        client.create_stream(StreamName=stream, ShardCount=2)
        client.get_waiter("stream_exists").wait(
            StreamName=stream, WaiterConfig={"Delay": 0.1, "MaxAttempts": 200}
        )
        items = workload(600)
        config = ProducerConfig(
            region=REGION, endpoint_url=url, wire_protocol="auto", **CREDENTIALS
        )
        async with Producer(config) as producer:
            results = await put_workload(producer, stream, items, pause_every=100)
        assert all(result.success for result in results)
        assert (cbor_bodies[0] > 0) is cbor
        decided = [
            r.getMessage() for r in caplog.records if "wire_protocol='auto'" in r.getMessage()
        ]
        assert len(decided) == 1, decided  # once per endpoint
        assert ("go in CBOR" in decided[0]) is cbor, decided
        assert client.list_streams()["StreamNames"] == [stream]  # the probe created nothing
        assert read_back(url, stream) == Counter((k, d) for k, d, _ in items)
