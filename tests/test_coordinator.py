"""The fleet coordinator's shell against a fake in-memory S3 with S3's conditional writes.

Time-heavy tests run on trio's ``MockClock`` (autojump), so minutes of fleet time pass in
milliseconds; the fake S3's clock is ``SERVER_EPOCH`` + that clock, stamped in whole seconds
like S3's ``Date`` and ``LastModified``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from email.utils import formatdate
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from trio.testing import MockClock

from anykpl import FleetConfig, Producer, ProducerConfig
from anykpl import _coordinator as coordinator
from anykpl._coordinator import FleetAllocator, FleetWorker
from anykpl._fleet import FleetDemand, GrantsDocument, parse_grants, parse_lease

from .fakes import FakeKinesis

pytestmark = pytest.mark.anyio

SERVER_EPOCH = 1_800_000_000.0
BUCKET = "fleet-bucket"
CAP = 1000.0
INTERVAL = 1.0
LEASE = 3.0
CONFIG = ProducerConfig(region="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")


class FakeBody:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aenter__(self) -> FakeBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        await anyio.lowlevel.checkpoint()
        return self._data


class FakeS3:
    """Objects in a dict, conditional PUT and DELETE like S3, every version of every object
    kept (to check each generation of grants), and an outage switch."""

    def __init__(self, *, send_date: bool = True) -> None:
        self.objects: dict[str, tuple[bytes, str, float]] = {}  # key -> body, ETag, stamp
        self.versions: dict[str, list[bytes]] = {}
        self.send_date = send_date
        self.down = False
        self.calls = 0

    def stamp(self) -> float:
        return float(math.floor(SERVER_EPOCH + anyio.current_time()))

    def _metadata(self, status: int = 200, **headers: str) -> dict[str, Any]:
        if self.send_date:
            headers["date"] = formatdate(self.stamp(), usegmt=True)
        return {"HTTPStatusCode": status, "HTTPHeaders": headers}

    def _error(self, code: str, status: int, operation: str) -> ClientError:
        return ClientError(
            {
                "Error": {"Code": code, "Message": f"{code} (fake)"},
                "ResponseMetadata": self._metadata(status),
            },
            operation,
        )

    async def _enter(self, bucket: str) -> None:
        await anyio.lowlevel.checkpoint()
        self.calls += 1
        if self.down:
            raise EndpointConnectionError(endpoint_url="http://fake-s3")
        assert bucket == BUCKET

    async def put_object(
        self,
        *,
        Bucket: str,
        Key: str,
        Body: bytes,
        ContentType: str = "",
        IfMatch: str | None = None,
        IfNoneMatch: str | None = None,
    ) -> dict[str, Any]:
        await self._enter(Bucket)
        existing = self.objects.get(Key)
        if IfNoneMatch == "*" and existing is not None:
            raise self._error("PreconditionFailed", 412, "PutObject")
        if IfMatch is not None:
            if existing is None:
                raise self._error("NoSuchKey", 404, "PutObject")
            if existing[1] != IfMatch:
                raise self._error("PreconditionFailed", 412, "PutObject")
        etag = '"' + hashlib.md5(Body + str(self.calls).encode()).hexdigest() + '"'
        stamp = self.stamp()
        self.objects[Key] = (bytes(Body), etag, stamp)
        self.versions.setdefault(Key, []).append(bytes(Body))
        last_modified = formatdate(stamp, usegmt=True)
        return {
            "ETag": etag,
            "ResponseMetadata": self._metadata(**{"last-modified": last_modified}),
        }

    async def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        await self._enter(Bucket)
        if Key not in self.objects:
            raise self._error("NoSuchKey", 404, "GetObject")
        body, etag, stamp = self.objects[Key]
        return {
            "Body": FakeBody(body),
            "ETag": etag,
            "ContentLength": len(body),
            "LastModified": datetime.fromtimestamp(stamp, timezone.utc),
            "ResponseMetadata": self._metadata(),
        }

    async def list_objects_v2(
        self, *, Bucket: str, Prefix: str, ContinuationToken: str | None = None
    ) -> dict[str, Any]:
        await self._enter(Bucket)
        keys = sorted(k for k in self.objects if k.startswith(Prefix))
        start = int(ContinuationToken or 0)
        page = keys[start : start + 2]  # small pages, to exercise the paging
        truncated = start + 2 < len(keys)
        return {
            "Contents": [
                {
                    "Key": k,
                    "ETag": self.objects[k][1],
                    "LastModified": datetime.fromtimestamp(self.objects[k][2], timezone.utc),
                }
                for k in page
            ],
            "IsTruncated": truncated,
            "NextContinuationToken": str(start + 2) if truncated else None,
            "ResponseMetadata": self._metadata(),
        }

    async def delete_object(
        self, *, Bucket: str, Key: str, IfMatch: str | None = None
    ) -> dict[str, Any]:
        await self._enter(Bucket)
        existing = self.objects.get(Key)
        if IfMatch is not None and (existing is None or existing[1] != IfMatch):
            raise self._error("PreconditionFailed", 412, "DeleteObject")
        self.objects.pop(Key, None)
        return {"ResponseMetadata": self._metadata(204)}

    # -- for the tests ---------------------------------------------------------------------

    def factory(self) -> Callable[[], Any]:
        @asynccontextmanager
        async def client() -> AsyncIterator[FakeS3]:
            yield self

        return client

    def generations(self) -> list[GrantsDocument]:
        return [parse_grants(v) for v in self.versions.get("anykpl-fleet/grants.json", [])]

    def holder(self) -> str | None:
        found = self.objects.get("anykpl-fleet/allocator.json")
        return None if found is None else parse_lease(found[0]).holder


def fleet(worker_id: str | None = None, **overrides: Any) -> FleetConfig:
    options: dict[str, Any] = {
        "bucket": BUCKET,
        "records_per_second": CAP,
        "sync_interval": INTERVAL,
        "lease": LEASE,
        "worker_id": worker_id,
    }
    options.update(overrides)
    return FleetConfig(**options)


class Member:
    """A FleetWorker with a constant, large demand, and what it applied."""

    def __init__(self, s3: FakeS3, worker_id: str, **overrides: Any) -> None:
        self.applied: list[tuple[float | None, float | None]] = []
        self.backlog = 100_000
        self.worker = FleetWorker(
            fleet(worker_id, **overrides),
            CONFIG,
            self.demand,
            lambda r, b: self.applied.append((r, b)),
            client_factory=s3.factory(),
        )

    def demand(self) -> FleetDemand:
        return FleetDemand(0, 0, self.backlog, self.backlog * 100)

    @property
    def rate(self) -> float | None:
        return self.applied[-1][0]


@asynccontextmanager
async def running(*members: Member | FleetAllocator) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        for member in members:
            await tg.start((member.worker if isinstance(member, Member) else member).run)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                for member in members:
                    await (member.worker if isinstance(member, Member) else member).aclose()
            tg.cancel_scope.cancel()


async def killed(store: Any) -> None:
    """A crashed member's clean-up: none."""


def check_every_generation(s3: FakeS3, cap: float = CAP) -> None:
    """From the grant objects alone: in every generation, the grants that may be in force
    (each worker's new grant and its earlier unexpired ones since the last it acknowledged)
    sum to at most the cap; and each generation's bookkeeping matches the history."""
    history = s3.generations()
    assert history
    for index, doc in enumerate(history):
        reserved = doc.total_reserved().records_per_second
        assert reserved is not None
        assert reserved <= cap * (1 + 1e-6)
        for worker_id, entry in doc.workers.items():
            floor = -1 if entry.acked is None else entry.acked
            for earlier in history[:index]:
                old = earlier.grant_for(worker_id)
                if old is None or earlier.generation < floor:
                    continue
                # an earlier grant still unexpired when this one was issued is listed
                if earlier.expires_at > doc.issued_at + 1.0:
                    assert (entry.reserved().records_per_second or 0) >= (
                        old.records_per_second or 0
                    ) - 1e-6


# -- on both backends, in real time -------------------------------------------------------


async def test_the_bootstrap_rate_applies_before_any_s3_call(anyio_backend: str) -> None:
    s3 = FakeS3()
    member = Member(s3, "w1", sync_interval=0.05, lease=0.15)
    applied_at_first_call: list[Any] = []
    enter = s3._enter

    async def first_call(bucket: str) -> None:
        if not applied_at_first_call:
            applied_at_first_call.append(list(member.applied))
        await enter(bucket)

    s3._enter = first_call  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(member.worker.run)
        assert member.applied == [(CAP * 0.1, None)]
        assert member.worker.statistics().mode == "bootstrap"
        # alone in the fleet, it becomes the allocator and grants itself the whole cap
        with anyio.fail_after(5):
            while member.rate != pytest.approx(CAP):  # noqa: ASYNC110 (the worker's task)
                await anyio.sleep(0.01)
        assert member.worker.statistics().role == "allocator"
        await member.worker.aclose()
    assert applied_at_first_call == [[(CAP * 0.1, None)]]
    assert "anykpl-fleet/workers/w1.json" not in s3.objects  # deleted on close
    assert s3.holder() is None  # released


# -- on trio's mock clock -----------------------------------------------------------------


class TestOnMockClock:
    @pytest.fixture
    def anyio_backend(self) -> Any:
        return ("trio", {"clock": MockClock(autojump_threshold=0)})

    async def test_four_workers_converge_to_equal_shares_within_three_intervals(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(4)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            rates = [m.rate for m in members]
            stats = [m.worker.statistics() for m in members]
        assert rates == pytest.approx([CAP / 4] * 4)
        assert [s.mode for s in stats] == ["granted"] * 4
        assert sum(1 for s in stats if s.role == "allocator") == 1
        assert {s.fleet_size for s in stats} == {4}
        check_every_generation(s3)

    async def test_demand_moves_capacity_without_the_sum_ever_exceeding_the_cap(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(3)]
        async with running(*members):
            await anyio.sleep(5 * INTERVAL)
            members[0].backlog = 0  # w0 goes idle
            await anyio.sleep(6 * INTERVAL)
            idle = members[0].rate
            busy = [m.rate for m in members[1:]]
            members[0].backlog = 100_000  # and busy again
            await anyio.sleep(6 * INTERVAL)
            back = [m.rate for m in members]
        assert idle == pytest.approx(CAP * 0.1 / 3)  # its floor
        assert busy == pytest.approx([(CAP - CAP * 0.1 / 3) / 2] * 2)
        assert back == pytest.approx([CAP / 3] * 3)
        check_every_generation(s3)

    async def test_a_dead_allocator_is_replaced_within_a_lease(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(3)]
        async with anyio.create_task_group() as tg:
            scopes = {}
            for member in members:
                scope = anyio.CancelScope()
                scopes[member.worker.worker_id] = scope

                async def run(member: Member = member, scope: anyio.CancelScope = scope) -> None:
                    with scope:
                        await member.worker.run()

                tg.start_soon(run)
            await anyio.sleep(3 * INTERVAL)
            dead = s3.holder()
            assert dead is not None
            victim = next(m for m in members if m.worker.worker_id == dead)
            victim.worker._cleanup = killed  # type: ignore[method-assign]
            scopes[dead].cancel()  # killed: no release, no goodbye
            await anyio.lowlevel.checkpoint()
            assert s3.holder() == dead
            killed_at = anyio.current_time()
            while s3.holder() in (dead, None):  # noqa: ASYNC110 (polling the fake S3)
                await anyio.sleep(0.01)
            replaced_after = anyio.current_time() - killed_at
            # learning mode for a lease, then the dead worker's share is handed out
            await anyio.sleep(LEASE + 3 * INTERVAL)
            survivors = [m for m in members if m.worker.worker_id != dead]
            rates = [m.rate for m in survivors]
            tg.cancel_scope.cancel()
        assert replaced_after <= LEASE + 0.1
        assert rates == pytest.approx([CAP / 2] * 2)
        check_every_generation(s3)

    async def test_s3_errors_fall_back_to_the_safe_rate_and_are_logged_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}", safe_fraction=0.5) for i in range(2)]
        caplog.set_level(logging.INFO, logger="anykpl.fleet")
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            assert [m.rate for m in members] == pytest.approx([CAP / 2] * 2)
            s3.down = True
            cut_at = anyio.current_time()
            await anyio.sleep(LEASE + 1.5 * INTERVAL)
            during = [m.worker.statistics() for m in members]
            s3.down = False
            # a cycle to notice, one to gather reports (every grant had expired), one to read
            await anyio.sleep(5 * INTERVAL)
            after = [m.worker.statistics() for m in members]
            assert anyio.current_time() - cut_at > LEASE
        # a lease after its last grant, each is at the safe rate: 50 % of the cap ÷ 2
        assert [s.mode for s in during] == ["safe", "safe"]
        assert [s.records_per_second for s in during] == pytest.approx([CAP * 0.5 / 2] * 2)
        assert all(s.s3_errors >= 4 for s in during)
        assert all(s.last_error and "ConnectionError" in s.last_error for s in during)
        # logged once per kind of failure, not once per interval
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        failures = [r for r in warnings if "failed" in r.getMessage()]
        # one ConnectionError warning per worker for the whole outage, though every call of
        # every cycle failed
        assert sorted(r.getMessage().split(":")[0] for r in failures) == ["fleet w0", "fleet w1"]
        assert {r.__dict__["error_code"] for r in failures} == {"ConnectionError"}
        assert any("→ safe" in r.getMessage() for r in warnings)
        assert any("S3 answers again" in r.getMessage() for r in caplog.records)
        assert [s.mode for s in after] == ["granted", "granted"]
        check_every_generation(s3)

    async def test_a_worker_that_never_reaches_s3_ends_at_the_safe_rate(self) -> None:
        s3 = FakeS3()
        s3.down = True
        member = Member(s3, "alone")
        async with running(member):
            await anyio.sleep(LEASE - 0.1)
            early = member.worker.statistics()
            await anyio.sleep(0.2)
            late = member.worker.statistics()
        assert (early.mode, early.records_per_second) == ("bootstrap", CAP * 0.1)
        # no fleet size known: the whole cap × safe_fraction
        assert (late.mode, late.records_per_second) == ("safe", CAP)
        assert late.s3_errors > 0

    async def test_without_a_date_header_the_clock_comes_from_what_it_writes(self) -> None:
        s3 = FakeS3(send_date=False)
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            rates = [m.rate for m in members]
        assert rates == pytest.approx([CAP / 2] * 2)

    async def test_the_standalone_allocator_serves_workers_that_do_not_elect(self) -> None:
        s3 = FakeS3(send_date=False)
        members = [Member(s3, f"w{i}", elect=False) for i in range(2)]
        seen: list[GrantsDocument] = []
        allocator = FleetAllocator(
            fleet(),
            CONFIG,
            allocator_id="boss",
            client_factory=s3.factory(),
            on_allocation=seen.append,
        )
        async with running(*members, allocator):
            await anyio.sleep(3 * INTERVAL)
            rates = [m.rate for m in members]
            assert s3.holder() == "boss"
            assert "anykpl-fleet/allocators/boss.json" in s3.objects
        assert rates == pytest.approx([CAP / 2] * 2)
        assert seen
        assert seen[-1] == s3.generations()[-1]
        assert s3.holder() is None
        assert "anykpl-fleet/allocators/boss.json" not in s3.objects

    async def test_without_any_allocator_workers_wait_at_the_bootstrap_rate(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}", elect=False) for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * LEASE)
            stats = [m.worker.statistics() for m in members]
        # S3 answers, but nobody allocates: no grant, and no reason for the safe rate
        assert [s.mode for s in stats] == ["bootstrap", "bootstrap"]
        assert [s.records_per_second for s in stats] == [CAP * 0.1] * 2
        assert s3.holder() is None
        assert "anykpl-fleet/grants.json" not in s3.objects

    async def test_a_worker_that_never_gets_a_grant_from_a_dead_allocator_goes_safe(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
        # the allocator is gone and its grants have expired; a newcomer that cannot elect
        newcomer = Member(s3, "late", elect=False)
        async with running(newcomer):
            await anyio.sleep(LEASE - 0.1)
            early = newcomer.worker.statistics()
            await anyio.sleep(0.2)
            late = newcomer.worker.statistics()
        assert early.mode == "bootstrap"
        assert (late.mode, late.records_per_second) == ("safe", CAP / 3)  # three it knows of

    async def test_a_lost_lease_makes_the_allocator_step_down(self) -> None:
        s3 = FakeS3()
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(2 * INTERVAL)
            assert member.worker.statistics().role == "allocator"
            # someone else took the lease (say, after a long pause of this process)
            body = json.loads(s3.objects["anykpl-fleet/allocator.json"][0])
            body.update(holder="thief", incarnation="0123")
            await s3.put_object(
                Bucket=BUCKET, Key="anykpl-fleet/allocator.json", Body=json.dumps(body).encode()
            )
            await anyio.sleep(1.5 * INTERVAL)
            assert member.worker.statistics().role == "worker"
            await anyio.sleep(LEASE + INTERVAL)  # the thief never renews: it takes it back
            assert member.worker.statistics().role == "allocator"

    async def test_junk_grants_are_counted_and_replaced_by_the_allocator(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/grants.json", Body=b"{junk")
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            stats = member.worker.statistics()
        assert stats.mode == "granted"
        assert stats.s3_errors >= 1  # once per read, until the allocator replaced it
        assert stats.last_error is not None
        assert "InvalidDocument" in stats.last_error
        assert parse_grants(s3.versions["anykpl-fleet/grants.json"][1]).generation == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1  # logged once

    async def test_junk_and_misplaced_reports_are_ignored(self) -> None:
        s3 = FakeS3()
        await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/workers/junk.json", Body=b"[]")
        member = Member(s3, "w0")
        body = None
        async with running(member):
            await anyio.sleep(INTERVAL / 2)
            body = s3.objects["anykpl-fleet/workers/w0.json"][0]
            await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/workers/other.json", Body=body)
            await anyio.sleep(2 * INTERVAL)
            granted = s3.generations()[-1]
        assert body is not None
        assert set(granted.workers) == {"w0"}
        assert member.worker.s3_errors >= 2

    async def test_leftover_reports_of_crashed_workers_are_deleted(self) -> None:
        s3 = FakeS3()
        await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/workers/crashed.json", Body=b"{}")
        await anyio.sleep(coordinator.LEFTOVER_LEASES * LEASE + 2)
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(2 * INTERVAL)
        assert "anykpl-fleet/workers/crashed.json" not in s3.objects

    async def test_a_hung_s3_call_is_bounded_and_the_grant_still_expires(self) -> None:
        s3 = FakeS3()
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(2 * INTERVAL)
            assert member.worker.statistics().mode == "granted"
            hang = anyio.Event()

            async def hung(**kwargs: Any) -> dict[str, Any]:
                await hang.wait()
                raise AssertionError("unreachable")

            s3.get_object = hung  # type: ignore[method-assign]
            await anyio.sleep(LEASE + INTERVAL)
            stats = member.worker.statistics()
            hang.set()
        assert stats.mode == "safe"
        assert stats.last_error is not None
        assert "Timeout" in stats.last_error

    async def test_the_producer_applies_its_grant_to_the_shared_bucket(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s3 = FakeS3()
        monkeypatch.setattr(coordinator, "create_client", lambda *a, **k: s3.factory()())
        config = CONFIG.replace(
            fleet=fleet("producer", bytes_per_second=50_000.0), record_max_buffered_time=0.05
        )
        async with Producer(config, transport=FakeKinesis()) as producer:
            bucket = producer._fleet_bucket
            assert bucket is not None
            assert bucket.records_per_second == CAP * 0.1  # bootstrap, before any S3 call
            for i in range(50):
                await producer.submit("stream", b"x" * 100, partition_key=str(i))
            await anyio.sleep(2 * INTERVAL)
            stats = producer.statistics().fleet
            assert stats is not None
            assert (stats.mode, stats.role, stats.worker_id) == ("granted", "allocator", "producer")
            grant = s3.generations()[-1].grant_for("producer")
            assert grant is not None
            assert stats.generation == s3.generations()[-1].generation
            rates = (stats.records_per_second, stats.bytes_per_second)
            assert rates == tuple(grant)
            assert (bucket.records_per_second, bucket.bytes_per_second) == rates
            # little demand: its floor (10 % of the cap) in records; what it sends, in bytes
            assert stats.records_per_second == pytest.approx(CAP * 0.1)
            assert stats.grant_expires_at is not None
            assert stats.grant_expires_at > anyio.current_time()
            report = s3.objects["anykpl-fleet/workers/producer.json"][0]
        assert b'"backlog"' in report
        assert "anykpl-fleet/workers/producer.json" not in s3.objects  # deleted on close
        assert s3.holder() is None

    async def test_a_producer_without_a_fleet_has_no_fleet_statistics(self) -> None:
        async with Producer(CONFIG, transport=FakeKinesis()) as producer:
            assert producer.statistics().fleet is None
            assert producer._fleet_bucket is None
