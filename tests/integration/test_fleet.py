"""Fleet-wide caps against the emulator's S3 and Kinesis, in one process and in four.

Every test runs with a short sync interval (0.5 s, lease 1.5 s). The grants bucket has
versioning on, so every generation of ``grants.json`` can be read back: the check that the
grants in force never summed over the cap is made from the grant objects themselves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from anykpl import FleetConfig, ProducerConfig
from anykpl._fleet import FleetDemand, FleetWorker, GrantsDocument, parse_grants
from anykpl.emulator import EmulatorClient

from .conftest import CREDENTIALS, REGION

INTERVAL = 0.5
LEASE = 3 * INTERVAL
#: how long a grant outlives its lease (the allocator's grace: one interval)
GRACE = INTERVAL
CAP = 1000.0
#: what the allocator grants at most: the cap less the bootstrap budget (4 % by default)
GRANTABLE = CAP * 0.96
PREFIX = "anykpl-fleet"
HELPER = Path(__file__).with_name("fleet_producer.py")


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"fleet-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


def generations(s3: Any, bucket: str) -> list[GrantsDocument]:
    """Every generation of grants.json ever written, oldest first."""
    key = f"{PREFIX}/grants.json"
    documents = []
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=key):
        for version in page.get("Versions", []):
            if version["Key"] == key:
                body = s3.get_object(Bucket=bucket, Key=key, VersionId=version["VersionId"])
                documents.append(parse_grants(body["Body"].read()))
    return sorted(documents, key=lambda d: d.generation)


def check_generations(documents: list[GrantsDocument], cap: float = CAP) -> float:
    """The grants that may be in force sum to at most the cap in every generation, and each
    lists every earlier grant still unexpired since the last one its worker acknowledged.
    Returns the largest sum seen."""
    assert documents
    largest = 0.0
    for index, doc in enumerate(documents):
        reserved = doc.total_reserved().records_per_second
        assert reserved is not None
        assert reserved <= cap * (1 + 1e-6), f"generation {doc.generation}: {reserved} > {cap}"
        largest = max(largest, reserved)
        for worker_id, entry in doc.workers.items():
            floor = -1 if entry.acked is None else entry.acked
            for earlier in documents[:index]:
                old = earlier.grant_for(worker_id)
                if old is None or earlier.generation < floor:
                    continue
                if earlier.expires_at > doc.issued_at + 1.0:
                    held = entry.reserved().records_per_second or 0.0
                    assert held >= (old.records_per_second or 0.0) - 1e-6
    assert [d.generation for d in documents] == sorted({d.generation for d in documents})
    return largest


def fleet_config(bucket: str, endpoint: str, worker_id: str, **overrides: Any) -> FleetConfig:
    options: dict[str, Any] = {
        "bucket": bucket,
        "records_per_second": CAP,
        "sync_interval": INTERVAL,
        "worker_id": worker_id,
        "endpoint_url": endpoint,
    }
    options.update(overrides)
    return FleetConfig(**options)


class Member:
    """A FleetWorker with a large constant demand, runnable and killable on its own."""

    def __init__(self, bucket: str, endpoint: str, worker_id: str, **overrides: Any) -> None:
        config = ProducerConfig(region=REGION, endpoint_url=endpoint, **CREDENTIALS)
        self.applied: list[tuple[float | None, float | None]] = []
        self.worker = FleetWorker(
            fleet_config(bucket, endpoint, worker_id, **overrides),
            config,
            lambda: FleetDemand(0, 0, 100_000, 10_000_000),
            lambda r, b: self.applied.append((r, b)),
        )
        self.scope = anyio.CancelScope()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with self.scope:
            await self.worker.run(task_status=task_status)

    def kill(self) -> None:
        """Stop at once, as a crashed process would: no goodbye, no release of the lease."""

        async def nothing(store: Any) -> None:
            return None

        self.worker._cleanup = nothing  # type: ignore[method-assign]
        self.scope.cancel()

    @property
    def rate(self) -> float | None:
        return self.applied[-1][0] if self.applied else None


@asynccontextmanager
async def running(*members: Member) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        for member in members:
            await tg.start(member.run)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                for member in members:
                    await member.worker.aclose()
            tg.cancel_scope.cancel()


async def wait_for(condition: Callable[[], bool], within: float) -> float:
    """Poll ``condition`` (state of other tasks) until it holds; return the time it took."""
    start = anyio.current_time()
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (polling the workers' state)
            await anyio.sleep(0.02)
    return anyio.current_time() - start


def shares(members: list[Member], share: float) -> Callable[[], bool]:
    def holds() -> bool:
        return all(
            m.worker.statistics().mode == "granted" and m.rate == pytest.approx(share, rel=1e-3)
            for m in members
        )

    return holds


@pytest.mark.anyio
async def test_workers_converge_and_a_killed_allocator_is_replaced_within_a_lease(
    moto_endpoint: str, bucket: str, s3: Any, anyio_backend: str
) -> None:
    members = [Member(bucket, moto_endpoint, f"{anyio_backend}-{i}") for i in range(4)]
    async with running(*members):
        # a cycle to gather reports, one to grant, half a one to read
        converged = await wait_for(shares(members, GRANTABLE / 4), within=10 * INTERVAL)
        allocators = [m for m in members if m.worker.statistics().role == "allocator"]
        assert len(allocators) == 1
        dead = allocators[0]
        survivors = [m for m in members if m is not dead]
        dead.kill()
        replaced = await wait_for(
            lambda: any(m.worker.statistics().role == "allocator" for m in survivors),
            within=3 * LEASE,
        )
        # learning mode for a lease, then the dead worker's share is handed out
        await wait_for(shares(survivors, GRANTABLE / 3), within=LEASE + 8 * INTERVAL)
    assert converged <= 6 * INTERVAL
    # a lease, the cycle that notices, and moto's S3 calls on a loaded machine (2.06 s and
    # 2.39 s were seen in full runs beside other work): short of two leases, which a
    # replacement that waited out a second lease would take
    assert replaced <= LEASE + 2.5 * INTERVAL < 2 * LEASE
    documents = generations(s3, bucket)
    check_generations(documents)
    # the first allocator told the fleet its size before its first grants
    assert documents[0].granted == 0
    assert documents[0].fleet_size is not None
    assert documents[0].fleet_size >= 1


@asynccontextmanager
async def tcp_proxy(endpoint: str) -> AsyncIterator[tuple[str, Callable[[], None]]]:
    """A TCP forwarder to ``endpoint``; the callable cuts it (closes the listener and every
    connection), so what goes through it finds S3 unreachable from then on."""
    target_host, target_port = endpoint.removeprefix("http://").split(":")
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def pump(source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream) -> None:
        with suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                await sink.send(chunk)
        with suppress(Exception):
            await sink.send_eof()

    async def handle(client: anyio.abc.SocketStream) -> None:
        async with (
            client,
            await anyio.connect_tcp(target_host, int(target_port)) as upstream,
            anyio.create_task_group() as pipes,
        ):
            pipes.start_soon(pump, client, upstream)
            pipes.start_soon(pump, upstream, client)

    async with anyio.create_task_group() as tg:
        serving = anyio.CancelScope()

        async def serve() -> None:
            with serving:
                await listener.serve(handle)
            await listener.aclose()

        tg.start_soon(serve)
        yield f"http://127.0.0.1:{port}", serving.cancel
        serving.cancel()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def ignoring_aiohttp_write_resets(anyio_backend: str) -> Iterator[None]:
    """When the proxy drops a connection while aiohttp is still writing a request, aiohttp's
    own writer task fails with ClientConnectionResetError after the request has already
    failed (and been counted by the worker); nobody retrieves that task's exception, and
    anyio's test runner raises it (seen once in CI). Ignore just that one."""
    if anyio_backend != "asyncio":
        yield
        return
    import asyncio

    from aiohttp.client_exceptions import ClientConnectionResetError

    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ClientConnectionResetError):
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    loop.set_exception_handler(handler)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)


@pytest.mark.anyio
@pytest.mark.parametrize("safe_fraction", [0.0, 0.5], ids=["default", "safe-fraction"])
async def test_a_worker_cut_off_from_s3_drops_to_the_safe_rate(
    moto_endpoint: str, bucket: str, s3: Any, anyio_backend: str, safe_fraction: float
) -> None:
    with ignoring_aiohttp_write_resets(anyio_backend):
        await _cut_off_from_s3(moto_endpoint, bucket, s3, anyio_backend, safe_fraction)


async def _cut_off_from_s3(
    moto_endpoint: str, bucket: str, s3: Any, anyio_backend: str, safe_fraction: float
) -> None:
    async with tcp_proxy(moto_endpoint) as (proxied, cut):
        direct = Member(
            bucket, moto_endpoint, f"{anyio_backend}-direct", safe_fraction=safe_fraction
        )
        far = Member(bucket, proxied, f"{anyio_backend}-far", safe_fraction=safe_fraction)
        # and one that never reaches S3 at all (nothing listens there)
        lost = Member(
            bucket, f"http://127.0.0.1:{closed_port()}", f"{anyio_backend}-lost", safe_fraction=0.5
        )
        async with running(direct, far, lost):
            await wait_for(shares([direct, far], GRANTABLE / 2), within=10 * INTERVAL)
            cut_at = anyio.current_time()
            cut()
            expiries: list[float] = []

            def dropped() -> bool:
                stats = far.worker.statistics()
                if stats.grant_expires_at is not None:
                    expiries.append(stats.grant_expires_at)
                return stats.mode == "safe"

            await wait_for(dropped, 3 * LEASE)
            dropped_at = anyio.current_time()
            far_stats = far.worker.statistics()
            # the allocator drops it once its report is surely older than a lease
            await wait_for(lambda: direct.rate == pytest.approx(GRANTABLE), 4 * LEASE)
            lost_stats = lost.worker.statistics()
            far_errors = far.worker.statistics().s3_errors
    # its last grant lived a lease and the allocator's grace from its issue, before the cut,
    # give or take the clocks: each member knows S3's time from its Date header, stamped to
    # the second, so the grant's issue time (the middle of the allocator's bounds) may be
    # half a second and half a round trip late (half an interval here, on a loaded machine) ...
    assert expiries
    assert expiries[-1] - cut_at <= LEASE + GRACE + (1.0 + INTERVAL) / 2
    # ... and it expired on the worker's own timer, whatever its S3 calls were doing (they
    # hang or time out here): the slack is the poll and a loaded machine's scheduling
    assert dropped_at - expiries[-1] <= 0.25
    if safe_fraction:
        # opted in: the cap × safe_fraction ÷ the fleet it last knew (2; "lost" never
        # reported, so the allocator never counted it), no more than its last grant; the
        # fleet exceeds its cap by that much while it is cut off
        assert far_stats.records_per_second == pytest.approx(CAP * 0.5 / 2)
    else:
        # its budget rate (first or second in the listing): with the others' grants, within
        # the cap
        assert far_stats.records_per_second in (
            pytest.approx(CAP * 0.04 / 2),
            pytest.approx(CAP * 0.04 / 6),
        )
        assert GRANTABLE + (far_stats.records_per_second or 0.0) <= CAP
    assert far_errors > 0  # (the grant may expire before the first call fails)
    # a worker that never reached S3 never learned its share of the bootstrap budget, and
    # never had a grant: it sends nothing (it cannot know how many share the cap)
    assert (lost_stats.mode, lost_stats.records_per_second) == ("safe", 0.0)
    assert lost_stats.last_error is not None
    assert "ConnectionError" in lost_stats.last_error
    check_generations(generations(s3, bucket))


# -- four producer processes --------------------------------------------------------------


def read_payload_ids(kinesis: Any, stream: str) -> list[str]:
    ids = []
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            response = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
            ids.extend(bytes(r["Data"]).split(b"|", 1)[0].decode() for r in response["Records"])
            if not response["Records"] and response.get("MillisBehindLatest", 0) == 0:
                break
            iterator = response.get("NextShardIterator")
    return ids


def accepted_per_second(control: EmulatorClient, stream: str) -> dict[int, int]:
    per_second: dict[int, int] = {}
    for shard in control.stats()["shards"]:
        if shard["stream"] == stream:
            for second, accepted, *_ in shard["per_second"]:
                per_second[second] = per_second.get(second, 0) + accepted
    return per_second


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_four_producer_processes_share_half_the_stream(
    moto_endpoint: str,
    bucket: str,
    s3: Any,
    kinesis_client: Any,
    make_stream: Any,
    processes: list[subprocess.Popen[str]],
) -> None:
    """Four processes (two on asyncio, two on trio), each wanting more than the stream takes,
    with a fleet cap of half the 2-shard stream's capacity in records (1000 of 2000 a
    second): the emulator accepts the cap, every acknowledged record is in the stream, and no
    generation of grants ever summed over the cap."""
    stream = make_stream(2)
    control = EmulatorClient(moto_endpoint)
    uptime, wall = control.stats()["uptime"], time.time()
    for i in range(4):
        command = [
            *(sys.executable, str(HELPER), "--endpoint", moto_endpoint, "--stream", stream),
            *("--bucket", bucket, "--worker-id", f"process-{i}"),
            *("--records-per-second", str(CAP), "--bytes-per-second", str(1 << 20)),
            *("--sync-interval", str(INTERVAL), "--duration", "8", "--report-ids"),
            *("--backend", "asyncio" if i % 2 == 0 else "trio"),
        ]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert all(r["failed"] == 0 for r in results)
    acknowledged = [uid for r in results for uid in r["ids"]]
    assert len(acknowledged) == sum(r["submitted"] for r in results)
    stored = read_payload_ids(kinesis_client, stream)
    assert set(acknowledged) <= set(stored)  # every acknowledged record is in the stream

    # the steady window: from two seconds after the last one started to when the first stopped
    begin = max(r["started"] for r in results) + 2.0 - wall + uptime
    end = min(r["stopped"] for r in results) - 0.5 - wall + uptime
    per_second = accepted_per_second(control, stream)
    window = [per_second.get(s, 0) for s in range(int(begin) + 1, int(end))]
    assert len(window) >= 3
    mean = sum(window) / len(window)
    assert abs(mean - CAP) <= 0.15 * CAP, f"{mean:.0f}/s in the steady window: {window}"

    largest = check_generations(generations(s3, bucket))
    assert largest <= CAP * (1 + 1e-6)
    assert all(r["samples"][-1]["errors"] == 0 for r in results)


# -- the standalone allocator -------------------------------------------------------------


@pytest.mark.anyio
async def test_the_fleet_allocator_command_serves_workers_that_do_not_elect(
    moto_endpoint: str, bucket: str, s3: Any, anyio_backend: str
) -> None:
    command = [
        *(sys.executable, "-m", "anykpl._commands.cli", "fleet-allocator", "--bucket", bucket),
        *("--records-per-second", str(CAP), "--sync-interval", str(INTERVAL)),
        *("--endpoint-url", moto_endpoint, "--region", REGION, "--allocator-id", "boss"),
    ]
    environment = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "t"}
    members = [Member(bucket, moto_endpoint, f"{anyio_backend}-{i}", elect=False) for i in range(2)]
    async with await anyio.open_process(command, env=environment) as process:
        try:
            async with running(*members):
                await wait_for(shares(members, GRANTABLE / 2), within=20 * INTERVAL)
                assert all(m.worker.statistics().role == "worker" for m in members)
        finally:
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                await process.wait()
        assert process.stdout is not None
        output = b""
        with suppress(anyio.EndOfStream):
            while True:
                output += await process.stdout.receive()
    assert process.returncode == 0
    lines = output.decode().splitlines()
    assert lines[0].startswith("anykpl fleet-allocator boss: s3://")
    # one line per generation; once both workers are in: their grants, and the sum
    # (the cap less the bootstrap budget, 4 %)
    assert any("2 worker(s)" in line and "sum 960 of 1000" in line for line in lines[1:])
    check_generations(generations(s3, bucket))
    assert "Versions" in s3.list_object_versions(Bucket=bucket, Prefix=f"{PREFIX}/allocator.json")
    with pytest.raises(s3.exceptions.NoSuchKey):
        s3.get_object(Bucket=bucket, Key=f"{PREFIX}/allocator.json")  # released on Ctrl-C
