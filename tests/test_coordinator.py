"""The fleet coordinator's shell against a fake in-memory S3 with S3's conditional writes.

Time-heavy tests run on trio's ``MockClock`` (autojump), so minutes of fleet time pass in
milliseconds; the fake S3's clock is ``SERVER_EPOCH`` + that clock, stamped in whole seconds
like S3's ``Date`` and ``LastModified``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from anykpl import FleetConfig, Producer, ProducerConfig, errors
from anykpl._fleet import (
    FleetAllocator,
    FleetDemand,
    FleetWorker,
    GrantsDocument,
    Rates,
    WorkerEntry,
    parse_grants,
    parse_lease,
    parse_report,
)
from anykpl._fleet import _member as fleet_member
from anykpl._fleet import _worker as fleet_worker
from anykpl._runtime._producer import STOPPED

from . import fakes
from .fakes import SERVER_EPOCH, FakeKinesis

pytestmark = pytest.mark.anyio

BUCKET = "fleet-bucket"
CAP = 1000.0
#: what the allocator grants at most: the cap less the bootstrap budget (4 % by default)
GRANTABLE = CAP * (1 - FleetConfig(bucket="b" * 3, records_per_second=1).bootstrap_fraction)
INTERVAL = 1.0
LEASE = 3.0
CONFIG = ProducerConfig(region="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")


class FakeS3(fakes.FakeS3):
    """The fleet's bucket (``tests/fakes/s3.py``), with readers for the fleet's documents."""

    def __init__(self, *, send_date: bool = True) -> None:
        super().__init__(BUCKET, send_date=send_date)

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


def fleet_producer(monkeypatch: pytest.MonkeyPatch, s3: FakeS3, **overrides: Any) -> ProducerConfig:
    """The configuration of a producer named "producer" whose fleet worker talks to ``s3``."""
    monkeypatch.setattr(fleet_member, "create_client", lambda *a, **k: s3.factory()())
    return CONFIG.replace(fleet=fleet("producer", **overrides), record_max_buffered_time=0.05)


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


async def retries_after(
    caplog: pytest.LogCaptureFixture,
    failures: list[list[tuple[str, str, str, int]]],
    wait: float,
) -> list[tuple[int, int]]:
    """A lone member, settled; then each list of ``failures`` in turn, ``wait`` s each: the
    retries it made meanwhile, and how many of the failures were left unmet."""
    s3 = FakeS3()
    member = Member(s3, "w0")
    caplog.set_level(logging.INFO, logger="anykpl.fleet")
    seen = []
    async with running(member):
        await anyio.sleep(3 * INTERVAL)
        for failing in failures:
            before = member.worker.retries
            s3.failing = list(failing)
            await anyio.sleep(wait)
            seen.append((member.worker.retries - before, len(s3.failing)))
    return seen


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


async def test_nothing_is_sent_before_the_first_s3_calls(anyio_backend: str) -> None:
    s3 = FakeS3()
    member = Member(s3, "w1", sync_interval=0.05, lease=0.15)
    applied_at_first_call: list[Any] = []
    enter = s3._enter

    async def first_call(bucket: str, operation: str = "S3", key: str = "") -> None:
        if not applied_at_first_call:
            applied_at_first_call.append(list(member.applied))
        await enter(bucket, operation, key)

    s3._enter = first_call  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(member.worker.run)
        # it cannot know its share of the bootstrap budget before it lists the reports
        assert member.applied == [(0.0, None)]
        assert member.worker.statistics().mode == "bootstrap"
        # alone in the fleet, it becomes the allocator and grants itself the cap less the
        # bootstrap budget
        with anyio.fail_after(5):
            while member.rate != pytest.approx(GRANTABLE):  # noqa: ASYNC110 (its task)
                await anyio.sleep(0.01)
        assert member.worker.statistics().role == "allocator"
        await member.worker.aclose()
    assert applied_at_first_call == [[(0.0, None)]]
    # its first rate of its own: half the budget, the first of the fleet
    assert member.applied[1] == (CAP * 0.04 / 2, None)
    assert "anykpl-fleet/workers/w1.json" not in s3.objects  # deleted on close
    assert s3.holder() is None  # released


def test_the_report_after_callers_were_held_back_wants_at_least_the_rate_applied() -> None:
    """While callers wait for room because of the fleet's rate, what they admit is what the
    rate lets through, not what they offer: a worker that was held back and is not now (its
    new grant let them through) wants at least the rate it applies in its next report, and
    that held-back sample is not averaged into the one after it. Without either, a member
    that just got its grant reported a fraction of its demand, was cut, and climbed back by a
    quarter per interval (a raised cap took 19 to 29 s to settle instead of 7.6)."""
    now = [0.0]
    demand = [FleetDemand(0, 0, 0, 0, 1, 1, 1, True)]  # waiting now, for the fleet's rate
    worker = FleetWorker(
        fleet("w"),
        CONFIG,
        lambda: demand[0],
        lambda r, b: None,
        client_factory=FakeS3().factory(),
        local_clock=lambda: now[0],
    )
    worker._mode, worker._applied = "granted", Rates(50.0, 5000.0)
    assert worker._report().wants == Rates(CAP, 0.0)  # held: all it can get (no byte cap)
    # a second later nobody waits: 10 records admitted, at 1 record/s of demand on the face
    # of it, half of that second held back
    now[0], demand[0] = 1.0, FleetDemand(10, 1000, 0, 0, 1, 0, 1, False)
    report = worker._report()
    assert report.offered == Rates(10.0, 1000.0)
    assert report.wants == Rates(50.0, 5000.0)  # the rate it applies, at least
    # a whole second at that rate: 40 admitted, not averaged with the held-back 10
    now[0], demand[0] = 2.0, FleetDemand(50, 5000, 0, 0, 1, 0, 1, False)
    report = worker._report()
    assert report.offered == Rates(40.0, 4000.0)
    assert report.wants == Rates(40.0, 4000.0)


@pytest.mark.parametrize(
    ("due", "unread", "strained"),
    [(0, 0, False), (1000, 10, False), (1000, 50, False), (1000, 51, True), (4, 1, True)],
)
def test_a_store_is_strained_when_more_than_a_twentieth_of_the_reads_fail(
    due: int, unread: int, strained: bool
) -> None:
    """The allocator stretches the fleet's interval while the store is strained: a thousand
    reads with 1 % of errors (a store that answers, with some noise) stretched it to its
    longest, where the fleet then took minutes to converge."""
    read = fleet_member.ReportsRead(due=due, unread={f"w{i}" for i in range(unread)})
    assert read.strained is strained


# -- on trio's mock clock -----------------------------------------------------------------


@pytest.mark.autojump
class TestOnMockClock:
    async def test_a_member_that_leaves_frees_its_share_at_once(self) -> None:
        # A member that leaves applies nothing, and only then marks itself as left (and
        # deletes its report); the allocator's next cycle frees its grant, instead of when the
        # grant expires (a lease and an interval later), and deletes the mark.
        s3 = FakeS3()
        stay, leave = Member(s3, "stay"), Member(s3, "leave", elect=False)
        at_last_report: list[float | None] = []
        put = s3.put_object

        async def recording_put(**kwargs: Any) -> dict[str, Any]:
            if kwargs["Key"].endswith("left/leave.json"):
                assert json.loads(kwargs["Body"])["left"] is True
                at_last_report.append(leave.rate)
            return await put(**kwargs)

        s3.put_object = recording_put  # type: ignore[method-assign]
        async with running(stay):
            async with running(leave):
                await anyio.sleep(4 * INTERVAL)
                assert [stay.rate, leave.rate] == pytest.approx([GRANTABLE / 2] * 2)
            left_at = anyio.current_time()
            assert at_last_report == [0.0]
            while (stay.rate or 0.0) < GRANTABLE * 0.99:  # noqa: ASYNC110 (its rates)
                await anyio.sleep(0.05)
            took = anyio.current_time() - left_at
            assert "anykpl-fleet/workers/leave.json" not in s3.objects
            assert "anykpl-fleet/left/leave.json" not in s3.objects  # deleted once freed
        # the allocator's next cycle frees it, and the member reads the grants the next
        assert took <= 2 * INTERVAL + 0.5
        check_every_generation(s3)

    async def test_a_report_that_is_merely_gone_frees_nothing(self) -> None:
        # Deleted by hand (or as a leftover) while its worker goes on: its grant stays counted
        # until it expires, and the worker writes its report again.
        s3 = FakeS3()
        stay, other = Member(s3, "stay"), Member(s3, "other", elect=False)
        async with running(stay, other):
            await anyio.sleep(4 * INTERVAL)
            assert [stay.rate, other.rate] == pytest.approx([GRANTABLE / 2] * 2)
            mark = len(stay.applied)
            await s3.delete_object(Bucket=BUCKET, Key="anykpl-fleet/workers/other.json")
            await anyio.sleep(3 * INTERVAL)
            assert other.worker.statistics().mode == "granted"
        check_every_generation(s3)
        # every generation counted what "other" had: "stay" never got more than its half
        assert max(r or 0.0 for r, _ in stay.applied[mark:]) <= GRANTABLE / 2 * 1.001

    async def test_a_process_restarted_under_a_worker_id_takes_no_grant_of_the_one_before(
        self,
    ) -> None:
        # The first process leaves (its share is freed); a second one under the same id reads
        # the grants before the allocator has seen it: the grant it finds there was made for
        # the first and is not its own.
        s3 = FakeS3()
        stay, first = Member(s3, "stay"), Member(s3, "again", elect=False)
        async with running(stay):
            async with running(first):
                await anyio.sleep(4 * INTERVAL)
            grants = s3.generations()[-1]
            old = grants.workers["again"]
            assert old.grant is not None
            assert old.incarnation is not None
            assert first.worker._incarnation.startswith(old.incarnation)
            # as if the second read the grants before the allocator's next listing: the
            # document still grants "again", and is in force
            await s3.put_object(
                Bucket=BUCKET, Key="anykpl-fleet/grants.json", Body=grants.to_json()
            )
            second = Member(s3, "again", elect=False)
            async with running(second):
                for _ in range(40):  # it may be granted anew, never the first one's grant
                    stats = second.worker.statistics()
                    assert stats.mode != "granted" or stats.generation != grants.generation
                    await anyio.sleep(INTERVAL / 20)
                await anyio.sleep(2 * INTERVAL)
                assert second.worker.statistics().mode == "granted"

    async def test_four_workers_converge_to_equal_shares_within_three_intervals(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(4)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            rates = [m.rate for m in members]
            stats = [m.worker.statistics() for m in members]
        assert rates == pytest.approx([GRANTABLE / 4] * 4)
        assert [s.mode for s in stats] == ["granted"] * 4
        assert sum(1 for s in stats if s.role == "allocator") == 1
        assert {s.fleet_size for s in stats} == {4}
        check_every_generation(s3)

    async def test_a_worker_that_holds_its_callers_back_gets_its_share_at_once(self) -> None:
        # Starting on a small budget rate, a producer admits little and holds a small backlog
        # (admission keeps it to what the shard sends in max_outstanding_time): its callers
        # waiting for room are what says it wants more. It asks for the whole cap, and the
        # first grants share the cap equally with a worker whose backlog says as much.
        s3 = FakeS3()
        held, busy = Member(s3, "held"), Member(s3, "busy")
        waits = 0

        def demand() -> FleetDemand:
            nonlocal waits
            waits += 1
            return FleetDemand(0, 0, 0, 0, waits, 1, fleet_refusals=waits, fleet_holding=True)

        held.worker._demand = demand
        async with running(busy, held):
            await anyio.sleep(3 * INTERVAL)
            rates = [busy.rate, held.rate]
            report = parse_report(s3.objects["anykpl-fleet/workers/held.json"][0])
        assert rates == pytest.approx([GRANTABLE / 2] * 2)
        assert report.wants.records_per_second == CAP
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
        floor = GRANTABLE * 0.04 / 3
        assert idle == pytest.approx(floor)
        assert busy == pytest.approx([(GRANTABLE - floor) / 2] * 2)
        assert back == pytest.approx([GRANTABLE / 3] * 3)
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
        assert replaced_after <= LEASE + fleet_member.TAKEOVER_SPREAD * INTERVAL + 0.1
        assert rates == pytest.approx([GRANTABLE / 2] * 2)
        check_every_generation(s3)

    @pytest.mark.parametrize("reads", [0.0, 0.2])
    async def test_an_allocator_dead_just_after_renewing_its_lease_leaves_no_one_ungranted(
        self, reads: float
    ) -> None:
        # The worst moment for an allocator to die: just after renewing its lease, before
        # its next grants. The grants in force must outlive that lease by enough for the
        # successor to publish new ones and the workers to read them (``reads``: how long
        # each read of a report takes, as on a slow store).
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(3)]
        get, put = s3.get_object, s3.put_object
        scopes: dict[str, anyio.CancelScope] = {}
        crash: list[float] = []

        async def slow_get(**kwargs: Any) -> dict[str, Any]:
            if "/workers/" in kwargs["Key"]:
                await anyio.sleep(reads)
            return await get(**kwargs)

        async def put_then_crash(**kwargs: Any) -> dict[str, Any]:
            answer = await put(**kwargs)
            renewal = kwargs["Key"].endswith("allocator.json") and kwargs.get("IfMatch")
            if renewal and not crash and anyio.current_time() > 6 * INTERVAL:
                dead = parse_lease(kwargs["Body"]).holder
                crash.append(anyio.current_time())
                victim = next(m for m in members if m.worker.worker_id == dead)
                victim.worker._cleanup = killed  # type: ignore[method-assign]
                scopes[dead].cancel()  # killed: no release, no goodbye
            return answer

        s3.get_object = slow_get  # type: ignore[method-assign]
        s3.put_object = put_then_crash  # type: ignore[method-assign]
        modes: list[str] = []
        async with anyio.create_task_group() as tg:
            for member in members:
                scope = scopes[member.worker.worker_id] = anyio.CancelScope()

                async def run(member: Member = member, scope: anyio.CancelScope = scope) -> None:
                    with scope:
                        await member.worker.run()

                tg.start_soon(run)
            while not crash:  # noqa: ASYNC110 (waiting for the renewal in the fake S3)
                await anyio.sleep(0.01)
            dead = parse_lease(s3.versions["anykpl-fleet/allocator.json"][-1]).holder
            survivors = [m for m in members if m.worker.worker_id != dead]
            assert all(m.worker.statistics().mode == "granted" for m in survivors)
            while anyio.current_time() < crash[0] + 2 * LEASE:
                modes.extend(m.worker.statistics().mode for m in survivors)
                await anyio.sleep(0.01)
            assert s3.holder() not in (dead, None)
            tg.cancel_scope.cancel()
        assert set(modes) == {"granted"}
        check_every_generation(s3)

    async def test_a_live_allocator_keeps_its_lease_through_a_failed_renewal_and_slow_reads(
        self,
    ) -> None:
        # The renewal put off until the grants are written must not come after the lease
        # has run out: one renewal fails (a 500), then the next cycle's listings are slow
        # (nearly an interval each); a standby must never take the lease from the live holder.
        s3 = FakeS3()
        holder = Member(s3, "w0")
        standby = FleetAllocator(fleet("standby"), CONFIG, client_factory=s3.factory())
        get, put, listing = s3.get_object, s3.put_object, s3.list_objects_v2
        failed: list[float] = []
        slowed: list[str] = []
        holders: set[str] = set()

        async def slow_get(**kwargs: Any) -> dict[str, Any]:
            if "/workers/" in kwargs["Key"]:
                await anyio.sleep(0.3 * INTERVAL)
            return await get(**kwargs)

        async def failing_put(**kwargs: Any) -> dict[str, Any]:
            if kwargs["Key"].endswith("allocator.json"):
                holder_id = parse_lease(kwargs["Body"]).holder
                renewal = kwargs.get("IfMatch") and holder_id == "w0"
                if renewal and not failed and anyio.current_time() > 6 * INTERVAL:
                    failed.append(anyio.current_time())
                    raise s3._error("InternalError", 500, "PutObject")
                answer = await put(**kwargs)
                holders.add(holder_id)
                return answer
            return await put(**kwargs)

        async def slow_list(**kwargs: Any) -> dict[str, Any]:
            if failed and len(slowed) < 2 and kwargs["Prefix"].endswith(("/workers/", "/left/")):
                slowed.append(kwargs["Prefix"])
                await anyio.sleep(0.95 * INTERVAL)
            return await listing(**kwargs)

        s3.get_object = slow_get  # type: ignore[method-assign]
        s3.put_object = failing_put  # type: ignore[method-assign]
        s3.list_objects_v2 = slow_list  # type: ignore[method-assign]
        async with running(holder):
            await anyio.sleep(3 * INTERVAL)
            assert s3.holder() == "w0"
            async with running(standby):
                await anyio.sleep(12 * INTERVAL)
        assert failed
        assert len(slowed) == 2
        assert holders == {"w0"}
        check_every_generation(s3)

    async def test_a_failing_on_allocation_callback_is_logged_once_and_the_cycle_goes_on(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        calls: list[int] = []

        def broken(document: GrantsDocument) -> None:
            calls.append(document.generation)
            raise BrokenPipeError(32, "Broken pipe")

        allocator = FleetAllocator(
            fleet("a1"), CONFIG, client_factory=s3.factory(), on_allocation=broken
        )
        member = Member(s3, "w0", elect=False)
        caplog.set_level(logging.DEBUG, logger="anykpl.fleet")
        async with running(allocator, member):
            await anyio.sleep(8 * INTERVAL)
            assert member.worker.statistics().mode == "granted"
        assert len(calls) >= 6
        failed = [r for r in caplog.records if "on_allocation callback failed" in r.getMessage()]
        assert [r.levelno for r in failed] == [logging.ERROR] + [logging.DEBUG] * (len(calls) - 1)
        assert not [r for r in caplog.records if "sync cycle failed" in r.getMessage()]

    async def test_s3_errors_fall_back_to_the_safe_rate_and_are_logged_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}", safe_fraction=0.5) for i in range(2)]
        caplog.set_level(logging.INFO, logger="anykpl.fleet")
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            assert [m.rate for m in members] == pytest.approx([GRANTABLE / 2] * 2)
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
        assert any("the store answers again" in r.getMessage() for r in caplog.records)
        assert [s.mode for s in after] == ["granted", "granted"]
        check_every_generation(s3)

    async def test_a_worker_the_store_throttles_calls_it_less_often_until_it_answers(
        self,
    ) -> None:
        # A store that answers 503 SlowDown is overloaded: a member that goes on calling it
        # every interval keeps it so (and the allocator, refused too, cannot tell the fleet to
        # stretch). A store that is unreachable is not overloaded: no back-off for that.
        s3 = FakeS3()
        member = Member(s3, "w0", elect=False)
        stretched = fleet_member.MAX_STRETCH * INTERVAL
        async with running(member):
            await anyio.sleep(5 * INTERVAL)
            calm = member.worker.statistics()
            s3.throttled = True
            calls = s3.calls
            await anyio.sleep(60 * INTERVAL)
            throttled = member.worker.statistics()
            throttled_calls = s3.calls - calls
            s3.throttled = False
            s3.down = True  # (unreachable: each cycle shrinks the back-off)
            await anyio.sleep(40 * INTERVAL)
            down = member.worker.statistics()
            s3.down = False
            await anyio.sleep(3 * INTERVAL)
            after = member.worker.statistics()
        assert calm.sync_interval == INTERVAL
        assert throttled.sync_interval == stretched
        # at most three calls a cycle (grants, report, a listing), over 1, 1.5, 2.25 ... 12
        # intervals: 9-10 cycles in 60 intervals, where it would have made 60
        assert throttled_calls <= 30
        assert "SlowDown" in (throttled.last_error or "")
        assert down.sync_interval == INTERVAL
        assert after.sync_interval == INTERVAL
        assert "ConnectionError" in (after.last_error or "")

    async def test_an_occasional_internal_error_is_tried_again_within_the_cycle(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A store that fails a request in a hundred is not overloaded: a read or a worker's
        # report that fails with a 500 is tried again at once, so the workers acknowledge
        # their grants and the allocator reads every report in the same cycle; nothing is
        # logged, nothing stretched. A throttle is not tried again.
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(2)]
        caplog.set_level(logging.INFO, logger="anykpl.fleet")
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            s3.failing = [
                (operation, key, "InternalError", 500)
                for operation, key in [
                    ("GetObject", "grants.json"),
                    ("GetObject", "workers/"),
                    ("PutObject", "workers/"),
                    ("ListObjectsV2", "workers/"),
                ]
            ]
            await anyio.sleep(2 * INTERVAL)
            retried = [m.worker.statistics() for m in members]
            left_over = list(s3.failing)
            s3.failing = [("GetObject", "grants.json", "SlowDown", 503)]
            await anyio.sleep(INTERVAL)
            throttled = [m.worker.statistics() for m in members]
        assert not left_over  # (every failure was met)
        assert sum(s.s3_errors for s in retried) == 4
        assert [(s.mode, s.sync_interval) for s in retried] == [("granted", INTERVAL)] * 2
        assert any("InternalError" in (s.last_error or "") for s in retried)
        failed = [r.__dict__["error_code"] for r in caplog.records if "error_code" in r.__dict__]
        assert failed == ["SlowDown"]
        assert sum(s.s3_errors for s in throttled) == 5
        check_every_generation(s3)

    async def test_an_allocator_that_could_not_read_the_grants_tries_again_soon(self) -> None:
        # its cycle's read of grants.json failed (every try): it cannot allocate in that
        # cycle, and the next comes a quarter interval later, not an interval (after a
        # takeover, the grants in force run out within an interval)
        s3 = FakeS3()
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            written = len(s3.generations())
            tries = 1 + fleet_member.TRANSIENT_RETRIES
            s3.failing = [("GetObject", "grants.json", "InternalError", 500)] * tries
            while s3.failing:  # noqa: ASYNC110 (waiting for the fake S3's failures)
                await anyio.sleep(0.001)
            failed_at = anyio.current_time()
            while len(s3.generations()) == written:  # noqa: ASYNC110 (polling the fake S3)
                await anyio.sleep(0.001)
            took = anyio.current_time() - failed_at
        assert took <= (fleet_member.RETRY_SOON + 0.05) * INTERVAL

    async def test_a_call_is_tried_three_times_in_all(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # two 500s in a row (one call in four hundred, where one answer in twenty fails) are
        # met within the cycle, as the SDKs' three attempts meet them; a third is the call's
        # failure, logged
        failure = ("PutObject", "workers/", "InternalError", 500)
        twice, thrice = await retries_after(caplog, [[failure] * 2, [failure] * 3], INTERVAL)
        assert twice == (2, 0)
        assert thrice == (2, 0)
        logged = [r.__dict__["error_code"] for r in caplog.records if "error_code" in r.__dict__]
        assert logged == ["InternalError"]

    async def test_the_reads_of_many_reports_have_an_allowance_of_retries(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # the allocator's reads of the reports go out together: of nine reads among eighty
        # that fail once each, eight are tried again (the phase may retry a tenth of the
        # reports), where the member's own budget of five would have left four workers unread
        # for a generation; the ninth is a read that failed
        s3 = FakeS3()
        members = [Member(s3, f"w{i:02d}") for i in range(80)]
        caplog.set_level(logging.INFO, logger="anykpl.fleet")
        async with running(*members):
            await anyio.sleep(4 * INTERVAL)
            allocator = next(m for m in members if m.worker.holds_lease)
            before = allocator.worker.retries
            s3.failing = [("GetObject", "workers/", "InternalError", 500)] * 9
            while s3.failing:  # noqa: ASYNC110 (waiting for the fake S3's failures)
                await anyio.sleep(0.001)
            await anyio.sleep(INTERVAL)
            retried = allocator.worker.retries - before
        assert fleet_member.READ_RETRY_SHARE * 80 > fleet_member.RETRY_BUDGET
        assert retried == 8
        failed = [r for r in caplog.records if "read a report failed" in r.getMessage()]
        assert len(failed) == 1
        check_every_generation(s3)

    async def test_a_grants_write_is_tried_again_once(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # the grants' conditional write: after a 500, one retry (a retry whose first try went
        # through fails its condition), not the three tries of the other calls
        failure = ("PutObject", "grants.json", "InternalError", 500)
        (retried,) = await retries_after(caplog, [[failure] * 3], INTERVAL / 2)
        assert retried == (1, 1)
        failed = [r for r in caplog.records if "write grants failed" in r.getMessage()]
        assert len(failed) == 1

    async def test_a_new_worker_reads_early_for_its_first_cycles_granted_or_not(self) -> None:
        # a new member's first grant can be part of its share (the rest is freed a generation
        # later, when the members already there acknowledge their cut): for its first cycles
        # it reads early in the allocator's period, from 0.15 to 0.35 of it, granted or not;
        # then anywhere from 0.2 to 0.8 of it
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(3)]
        async with running(*members):
            await anyio.sleep(4 * INTERVAL)
            worker = next(m.worker for m in members if not m.worker.holds_lease)
            mode = worker.statistics().mode
            now, sequence = anyio.current_time(), worker._sequence
            spans = []
            for cycle in (2, fleet_worker.EARLY_READS, fleet_worker.EARLY_READS + 1):
                worker._sequence = cycle
                starts = [worker._locked_start(now) for _ in range(200)]
                spans.append((max(starts) - min(starts)) / INTERVAL)
            worker._sequence = sequence
        assert mode == "granted"
        early, last_early, later = spans
        assert 0.15 < early <= 0.2
        assert 0.15 < last_early <= 0.2
        assert 0.5 < later <= 0.6

    async def test_a_throttled_grants_write_is_tried_again_within_the_cycle(self) -> None:
        # the fleet's most important write: refused as overloaded, it is tried again once, a
        # fraction of an interval later, with the same document; other calls are not
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            before = s3.generations()[-1].generation
            s3.failing = [("PutObject", "grants.json", "SlowDown", 503)]
            while s3.failing:  # noqa: ASYNC110 (waiting for the fake S3's refusal)
                await anyio.sleep(0.001)
            refused_at = anyio.current_time()
            while s3.generations()[-1].generation == before:  # noqa: ASYNC110 (the fake S3)
                await anyio.sleep(0.001)
            took = anyio.current_time() - refused_at
            retries = sum(m.worker.retries for m in members)
        low, high = fleet_member.THROTTLED_PAUSE
        assert low * INTERVAL - 0.01 <= took <= high * INTERVAL + 0.01  # (polled each ms)
        assert retries == 1
        check_every_generation(s3)

    async def test_a_report_whose_answer_was_lost_is_not_taken_for_anothers(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # the first try of the report's PUT went through, its answer a 500: the retry's
        # If-Match fails on the worker's own write, which says nothing of another process
        s3 = FakeS3()
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            for _ in range(fleet_worker.OVERWRITTEN_REPORTS + 1):
                s3.lost_answers.append("workers/w0")
                await anyio.sleep(INTERVAL)
            stats = member.worker.statistics()
            left_over = list(s3.lost_answers)
        assert not left_over
        assert member.worker.retries >= fleet_worker.OVERWRITTEN_REPORTS
        assert (stats.mode, stats.rank) == ("granted", 1)
        assert not [r for r in caplog.records if "overwriting" in r.getMessage()]

    async def test_retries_stop_when_the_store_fails_much(self) -> None:
        # the retry budget: five retries, then a tenth of one for each call that succeeded at
        # its first try (as botocore's retry quota): a store that fails every call gets at most
        # five retries from a member, however long it fails
        s3 = FakeS3()
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            s3.failing = [
                (operation, "", "InternalError", 500)
                for operation in ("GetObject", "PutObject", "ListObjectsV2", "DeleteObject")
                for _ in range(1000)
            ]
            before = member.worker.statistics().s3_errors, member.worker.retries
            await anyio.sleep(20 * INTERVAL)
            failed = member.worker.statistics().s3_errors - before[0]
            retried = member.worker.retries - before[1]
            s3.failing = []
            await anyio.sleep(6 * INTERVAL)
            after = member.worker.statistics()
        # every call failed, some 40 of them that could be tried again: five were
        assert failed > 40
        assert retried == fleet_member.RETRY_BUDGET
        assert after.mode == "granted"

    async def test_a_granted_worker_keeps_to_the_interval(self) -> None:
        # A worker applying a grant reports every interval: a report an interval and a quarter
        # old gets it no new grant, and one older than a lease is not counted by an allocator
        # that takes over without a readable grants.json. Only workers without a grant back
        # off (or a fleet interval the allocator stretched).
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            worker = next(m.worker for m in members if not m.worker.holds_lease)
            worker._back_off(strained=True)
            worker._back_off(strained=True)
            stats = worker.statistics()
            assert worker._backoff == 1.0
            worker._state.grant = None  # (as if it had never been granted)
            worker._back_off(strained=True)
            unlocked = worker.cycle_period
        assert (stats.mode, stats.sync_interval) == ("granted", INTERVAL)
        assert unlocked == pytest.approx(fleet_member.STRETCH_STEP * INTERVAL)

    async def test_a_standby_allocator_does_not_back_off(self) -> None:
        # it must see the lease run out in time, and there are only a few
        s3 = FakeS3()
        s3.throttled = True
        standby = FleetAllocator(
            fleet(), CONFIG, allocator_id="standby", client_factory=s3.factory()
        )
        async with running(standby):
            await anyio.sleep(10 * INTERVAL)
            assert not standby.holds_lease
            assert standby.cycle_period == INTERVAL
        assert standby.s3_errors >= 10

    @pytest.mark.parametrize(
        ("code", "strained"),
        [
            ("SlowDown", True),
            ("ProvisionedThroughputExceededException", True),
            ("Timeout", True),
            ("503", True),  # a 5xx without a body: botocore names it by its status
            ("HTTP500", True),
            ("404", False),
            ("PreconditionFailed", False),
            ("ConnectionError", False),
        ],
    )
    async def test_which_errors_say_the_store_is_overloaded(
        self, code: str, strained: bool
    ) -> None:
        assert fleet_member.is_strain(code) == strained

    async def test_a_worker_that_never_reaches_s3_ends_at_the_safe_rate(self) -> None:
        s3 = FakeS3()
        s3.down = True
        member = Member(s3, "alone")
        async with running(member):
            await anyio.sleep(LEASE - 0.1)
            early = member.worker.statistics()
            await anyio.sleep(0.2)
            late = member.worker.statistics()
        # it never learned its rank in the bootstrap budget: it sends nothing, since it cannot
        # know how many share the cap
        assert (early.mode, early.records_per_second) == ("bootstrap", 0.0)
        assert (late.mode, late.records_per_second) == ("safe", 0.0)
        assert late.s3_errors > 0

    async def test_without_a_date_header_the_clock_comes_from_what_it_writes(self) -> None:
        s3 = FakeS3(send_date=False)
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            rates = [m.rate for m in members]
        assert rates == pytest.approx([GRANTABLE / 2] * 2)

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
        assert rates == pytest.approx([GRANTABLE / 2] * 2)
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
        # S3 answers, but nobody allocates: no grant, and no reason for the safe rate; each
        # listed both reports (again, once a lease): the budget's shares of ranks 2 and 2
        assert [s.mode for s in stats] == ["bootstrap", "bootstrap"]
        assert [s.records_per_second for s in stats] == pytest.approx([CAP * 0.04 / 6] * 2)
        assert s3.holder() is None
        assert "anykpl-fleet/grants.json" not in s3.objects

    async def test_a_worker_that_never_gets_a_grant_from_a_dead_allocator_goes_safe(self) -> None:
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
        # the allocator is gone and its grants have expired; a newcomer that cannot elect
        newcomer = Member(s3, "late", elect=False)
        # the last grants outlive their lease by an interval, from when they were issued
        last = s3.generations()[-1]
        expired = last.expires_at - SERVER_EPOCH
        async with running(newcomer):
            await anyio.sleep(LEASE - 0.1)
            early = newcomer.worker.statistics()
            await anyio.sleep_until(max(expired, anyio.current_time()) + 0.5)
            late = newcomer.worker.statistics()
        assert early.mode == "bootstrap"
        # the others closed (their reports deleted): first in the listing, half the budget
        assert (late.mode, late.records_per_second) == ("safe", pytest.approx(CAP * 0.04 / 2))

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
        await anyio.sleep(fleet_member.LEFTOVER_LEASES * LEASE + 2)
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
            # (a cycle that read the grants just before may still issue a generation, its
            # unread report's grant echoed and the interval stretched by the reads that hung:
            # it lasts a stretched lease and grace, 1.5 × (LEASE + INTERVAL))
            await anyio.sleep(1.5 * (LEASE + INTERVAL) + INTERVAL)
            stats = member.worker.statistics()
            hang.set()
        assert stats.mode == "safe"
        assert stats.last_error is not None
        assert "Timeout" in stats.last_error

    async def test_the_producer_applies_its_grant_to_the_shared_bucket(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s3 = FakeS3()
        config = fleet_producer(monkeypatch, s3, bytes_per_second=50_000.0)
        async with Producer(config, transport=FakeKinesis()) as producer:
            bucket = producer._fleet_bucket
            assert bucket is not None
            assert bucket.records_per_second == STOPPED  # before any S3 call: nothing
            for i in range(50):
                await producer.submit("stream", b"x" * 100, partition_key=str(i))
            # (the submits waited for room before the first grant: it asked for the whole cap
            # then, and for what it admits once they no longer wait)
            await anyio.sleep(4 * INTERVAL)
            stats = producer.statistics().fleet
            assert stats is not None
            assert (stats.mode, stats.role, stats.worker_id) == ("granted", "allocator", "producer")
            grant = s3.generations()[-1].grant_for("producer")
            assert grant is not None
            assert stats.generation == s3.generations()[-1].generation
            rates = (stats.records_per_second, stats.bytes_per_second)
            assert rates == tuple(grant)
            assert (bucket.records_per_second, bucket.bytes_per_second) == rates
            # little demand: its floor (4 % of what may be granted) in records; what it sends,
            # in bytes
            assert stats.records_per_second == pytest.approx(GRANTABLE * 0.04)
            assert stats.grant_expires_at is not None
            assert stats.grant_expires_at > anyio.current_time()
            report = s3.objects["anykpl-fleet/workers/producer.json"][0]
        assert b'"backlog"' in report
        assert "anykpl-fleet/workers/producer.json" not in s3.objects  # deleted on close
        assert s3.holder() is None

    async def test_a_producer_tells_its_worker_when_the_fleet_rate_holds_its_callers(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # what the worker's demand is made of (see DemandEstimator.held): the callers waiting
        # for room at admission, and the records the fleet's bucket holds back
        s3 = FakeS3()
        # a cap of 100 records/s binds before anything else here (the fake Kinesis takes more)
        config = fleet_producer(monkeypatch, s3, records_per_second=100.0)
        async with Producer(config, transport=FakeKinesis()) as producer:

            async def saturate() -> None:
                i = 0
                while True:
                    await producer.submit("stream", b"x" * 100, partition_key=str(i % 7))
                    i += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(saturate)
                await anyio.sleep(3 * INTERVAL)
                before = producer._fleet_demand()
                await anyio.sleep(INTERVAL)
                after = producer._fleet_demand()
                stats = producer.statistics().fleet
                tg.cancel_scope.cancel()
            await anyio.sleep(2 * INTERVAL)  # nothing waits now
            idle = producer._fleet_demand()
        assert after.admission_waits > before.admission_waits > 0
        assert after.fleet_refusals > before.fleet_refusals > 0
        assert stats is not None
        assert (stats.mode, stats.records_per_second) == ("granted", pytest.approx(96.0))
        assert (idle.admission_waiting, idle.fleet_holding) == (0, False)

    # -- review fixes -----------------------------------------------------------------------

    @pytest.mark.parametrize("key", ["grants.json", "allocator.json"])
    async def test_an_integer_too_long_to_read_is_junk_and_replaced(
        self, key: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        # json.loads raised a plain ValueError past 4300 digits: every cycle failed before
        # its report and allocation, and the fleet stayed at its safe rate
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(3)]
        junk = b'{"kind": "x", "version": 1, "n": ' + b"9" * 5000 + b"}"
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            await s3.put_object(Bucket=BUCKET, Key=f"anykpl-fleet/{key}", Body=junk)
            await anyio.sleep(3 * LEASE)
            stats = [m.worker.statistics() for m in members]
            body = s3.objects[f"anykpl-fleet/{key}"][0]
        assert body != junk  # replaced
        assert [s.mode for s in stats] == ["granted"] * 3
        assert [s.records_per_second for s in stats] == pytest.approx([GRANTABLE / 3] * 3)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    async def test_a_failing_cycle_is_logged_with_its_traceback_once_per_kind(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        member = Member(s3, "w0")
        worker = member.worker
        failing = True
        report = worker._report

        def broken() -> Any:
            if failing:
                raise RuntimeError("a bug")
            return report()

        worker._report = broken  # type: ignore[method-assign]
        async with running(member):
            await anyio.sleep(5 * INTERVAL)  # five failed cycles
            failing = False
            await anyio.sleep(2 * INTERVAL)  # clean ones
            failing = True
            await anyio.sleep(3 * INTERVAL)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        # once, and once more after the clean cycles: not once per cycle
        assert [r.getMessage() for r in errors] == ["fleet w0: a sync cycle failed"] * 2
        assert all(r.exc_info for r in errors)
        assert worker.s3_errors >= 8  # each still counted

    async def test_a_producer_that_never_reaches_s3_sends_nothing(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # it cannot know how many share the cap: not even the one record its bucket's token
        # would have let through (a megabyte, for all it knows)
        s3 = FakeS3()
        s3.down = True
        kinesis = FakeKinesis()
        config = fleet_producer(monkeypatch, s3, elect=False).replace(record_ttl=60.0)
        async with Producer(config, transport=kinesis) as producer:
            pendings = [
                await producer.submit("stream", b"x" * 1000, partition_key=str(i)) for i in range(5)
            ]
            await anyio.sleep(10 * INTERVAL)
            assert kinesis.requests == []
            assert not any(p.done() for p in pendings)
            stats = producer.statistics().fleet
            assert stats is not None
            assert (stats.records_per_second, stats.rank) == (0.0, None)
            # S3 answers: it lists the reports, runs its budget rate, and the records go
            s3.down = False
            with anyio.fail_after(10 * INTERVAL):
                results = [await p for p in pendings]
        assert all(r.success for r in results)

    async def test_records_held_by_a_fleet_rate_of_nothing_still_expire(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A member that cannot reach the store sends nothing (its rate is zero), and its
        # shards wait for the fleet's tokens without end: their records must still end when
        # their TTL passes, and the calls waiting for room with them (a benchmark's producer
        # cut off from the store hung in submit for good).
        s3 = FakeS3()
        s3.down = True
        kinesis = FakeKinesis()
        config = fleet_producer(monkeypatch, s3, elect=False).replace(
            record_ttl=5.0, max_outstanding_records=10
        )
        async with Producer(config, transport=kinesis) as producer:
            # twice as many records as may be outstanding: two TTLs, and a third for the rest
            with anyio.fail_after(5 * config.record_ttl):
                pendings = [
                    await producer.submit("stream", b"x" * 100, partition_key=str(i % 3))
                    for i in range(20)
                ]
                codes = []
                for pending in pendings:
                    with pytest.raises(errors.RecordFailedError) as failed:
                        await pending.wait()
                    codes.append(failed.value.error_code)
        assert kinesis.requests == []
        assert set(codes) == {errors.EXPIRED}

    async def test_a_grant_of_zero_never_reaches_the_producer(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # parsed and applied, it made the shared bucket divide by zero: the producer crashed
        s3 = FakeS3()
        monkeypatch.setattr(fleet_member, "create_client", lambda *a, **k: s3.factory()())
        now = SERVER_EPOCH + anyio.current_time()
        body = {
            "kind": "anykpl-fleet-grants",
            "version": 1,
            "generation": 99,
            "allocator": "x",
            "issued_at": now,
            "expires_at": now + LEASE,
            "learning": False,
            "cap": {"records_per_second": CAP, "bytes_per_second": None},
            "workers": {"producer": {"grant": {"records_per_second": 0}, "acked": None}},
        }
        await s3.put_object(
            Bucket=BUCKET, Key="anykpl-fleet/grants.json", Body=json.dumps(body).encode()
        )
        config = CONFIG.replace(fleet=fleet("producer", elect=False), record_max_buffered_time=0.05)
        async with Producer(config, transport=FakeKinesis()) as producer:
            pendings = [
                await producer.submit("stream", b"x" * 100, partition_key=str(i)) for i in range(50)
            ]
            await producer.flush()
            stats = producer.statistics().fleet
        assert all(p.result().success for p in pendings)
        assert stats is not None
        # alone in the bucket: the first rank, half the bootstrap budget
        assert (stats.mode, stats.records_per_second) == ("bootstrap", CAP * 0.04 / 2)
        assert stats.last_error is not None
        assert "positive" in stats.last_error

    async def test_a_rate_the_producer_refuses_does_not_stop_the_worker(self) -> None:
        s3 = FakeS3()
        member = Member(s3, "w0")
        offered: list[tuple[float | None, float | None]] = []

        def refuse_after_the_first(records: float | None, nbytes: float | None) -> None:
            offered.append((records, nbytes))
            if len(offered) > 1:
                raise ValueError("refused")
            member.applied.append((records, nbytes))

        member.worker._apply = refuse_after_the_first
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            stats = member.worker.statistics()
        assert len(offered) > 1  # its grant was offered, and refused
        assert stats.last_error is not None
        assert stats.last_error.startswith("apply the rate: ValueError")
        # it says what it applies: the rate it started with (nothing), still
        assert (stats.mode, stats.records_per_second) == ("bootstrap", 0.0)

    async def test_the_rate_applied_follows_the_state_machine_out_of_the_safe_rate(
        self,
    ) -> None:
        # The safe rate has no timer: the rate applied changed only with a new grant, so a
        # worker back from safe to bootstrap, or learning another rank, kept its old rate for
        # good while its statistics said otherwise.
        s3 = FakeS3()
        s3.down = True
        member = Member(s3, "w0", elect=False, safe_fraction=0.05)
        async with running(member):
            await anyio.sleep(LEASE + INTERVAL)
            assert member.worker.statistics().mode == "safe"
            assert member.rate == 0.0  # never granted, no rank: nothing
            s3.down = False  # S3 answers: no grants yet, the fleet is starting
            await anyio.sleep(1.5 * INTERVAL)
            assert member.worker.statistics().mode == "bootstrap"
            assert member.rate == CAP * 0.04 / 2  # first in the listing
            # an allocator is alive, has not granted w0 yet, and counts four others
            now = SERVER_EPOCH + anyio.current_time()
            others = GrantsDocument(
                generation=1,
                allocator="x",
                issued_at=now,
                expires_at=now + 3 * LEASE,
                learning=False,
                cap=Rates(CAP, None),
                workers={f"o{i}": WorkerEntry(Rates(100.0, None), None) for i in range(4)},
                fleet_size=4,
            )
            await s3.put_object(
                Bucket=BUCKET, Key="anykpl-fleet/grants.json", Body=others.to_json()
            )
            for i in range(2):  # and two of them have reported
                await s3.put_object(Bucket=BUCKET, Key=f"anykpl-fleet/workers/o{i}.json", Body=b"")
            await anyio.sleep(LEASE + 1.5 * INTERVAL)  # it lists again a lease later
            stats = member.worker.statistics()
            rate = member.rate
            # the report of the cycle after: one written in the cycle that listed may have
            # gone before the listing (the order of tasks due at one instant is not fixed)
            await anyio.sleep(INTERVAL)
            report = json.loads(s3.objects["anykpl-fleet/workers/w0.json"][0])
        assert (stats.mode, stats.fleet_size) == ("bootstrap", 5)
        assert rate == stats.records_per_second == pytest.approx(CAP * 0.04 / 12)
        # and it reports the rate it applies
        assert report["has"]["records_per_second"] == pytest.approx(CAP * 0.04 / 12)

    async def test_a_starting_fleet_shares_the_bootstrap_rate_after_one_cycle(self) -> None:
        # Before any grants the fleet size is unknown: 20 members each ran at 10 % of the cap
        # (twice the cap in all) until the first grants, two cycles in. The first allocator
        # now writes the fleet size at once, and the members read it at their next cycle.
        s3 = FakeS3()
        members = [Member(s3, f"w{i:02d}") for i in range(20)]
        worst = 0.0
        async with running(*members):
            start = anyio.current_time()
            await anyio.sleep(1.15 * INTERVAL)
            while anyio.current_time() - start < 4 * INTERVAL:
                worst = max(worst, sum(m.rate or 0.0 for m in members))
                await anyio.sleep(0.05)
            final = [m.rate for m in members]
        first = s3.generations()[0]
        assert (first.generation, first.granted) == (1, 0)
        assert first.fleet_size is not None
        assert first.fleet_size >= 1
        assert worst <= CAP * (1 + 1e-6)
        assert final == pytest.approx([GRANTABLE / 20] * 20)
        check_every_generation(s3)

    async def test_the_first_grants_see_the_demand_of_every_member(self) -> None:
        # A first report carries no demand (a rate takes two samples). Members that read the
        # grants-less document locked their phase to it and reported again only after the
        # first allocation, which then gave them their floor; their second report now comes
        # half an interval after the first.
        s3 = FakeS3()
        members = [Member(s3, f"w{i}") for i in range(4)]
        for member in members:
            member.backlog = 0  # nothing offered yet when they first report
        async with running(*members):
            await anyio.sleep(0.1 * INTERVAL)
            for member in members:
                member.backlog = 100_000
            await anyio.sleep(3 * INTERVAL)
        first = next(d for d in s3.generations() if d.granted)
        assert first.generation == 2
        grants = [e.grant.records_per_second for e in first.workers.values() if e.grant]
        assert grants == pytest.approx([GRANTABLE / 4] * 4)

    async def test_processes_sharing_a_worker_id_are_told(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # worker_id=HOSTNAME under a pre-fork server: one report, one grant, applied by each
        caplog.set_level(logging.WARNING, logger="anykpl.fleet")
        s3 = FakeS3()
        members = [Member(s3, "host-a"), Member(s3, "host-a"), Member(s3, "host-b")]
        async with running(*members):
            await anyio.sleep(10 * INTERVAL)
        warned = [r for r in caplog.records if "duplicate_worker_id" in r.__dict__]
        assert {r.__dict__["duplicate_worker_id"] for r in warned} == {"host-a"}
        # each process whose report the other overwrites says so, once (the allocator, unless
        # it is one of them and so always reads its own report, may say so too, once)
        by_workers = [r for r in warned if "keeps overwriting" in r.getMessage()]
        assert 1 <= len(by_workers) <= 2
        assert len(warned) - len(by_workers) <= 1

    async def test_the_allocator_tells_reports_that_alternate_between_processes(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="anykpl.fleet")
        s3 = FakeS3()
        members = [Member(s3, "twin", elect=False) for _ in range(2)]
        allocator = FleetAllocator(
            fleet(), CONFIG, allocator_id="boss", client_factory=s3.factory()
        )
        async with running(*members, allocator):
            await anyio.sleep(20 * INTERVAL)
        by_allocator = [r for r in caplog.records if "changing hands" in r.getMessage()]
        assert len(by_allocator) == 1
        assert by_allocator[0].getMessage().startswith("fleet boss: the report of worker twin")

    async def test_grants_for_other_caps_are_applied_within_the_workers_own(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # the standalone allocator started with a record cap only, and twice the workers'
        s3 = FakeS3()
        caplog.set_level(logging.WARNING, logger="anykpl.fleet")
        members = [Member(s3, f"w{i}", elect=False, bytes_per_second=100_000.0) for i in range(2)]
        members[0].backlog = 0  # w0 is idle, w1 wants more than the cap
        allocator = FleetAllocator(
            fleet(records_per_second=2 * CAP), CONFIG, client_factory=s3.factory()
        )
        async with running(*members, allocator):
            await anyio.sleep(4 * INTERVAL)
            stats = [m.worker.statistics() for m in members]
        assert [s.mode for s in stats] == ["granted"] * 2
        # records: no more than its own cap; bytes, uncapped by the document: its budget rate
        assert stats[1].records_per_second == pytest.approx(CAP)
        shares = sorted(s.bytes_per_second or 0.0 for s in stats)
        assert shares[0] >= 100_000.0 * 0.04 / 6
        assert sum(shares) < 100_000.0 * 0.04
        mismatches = [r for r in caplog.records if "document_cap" in r.__dict__]
        assert len(mismatches) == 2  # once per worker

    async def test_closing_keeps_to_close_timeout_when_s3_hangs(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s3 = FakeS3()
        monkeypatch.setattr(fleet_member, "create_client", lambda *a, **k: s3.factory()())
        hang = anyio.Event()

        async def hung(**kwargs: Any) -> dict[str, Any]:
            await hang.wait()
            raise AssertionError("unreachable")

        config = CONFIG.replace(fleet=fleet("p", elect=False), close_timeout=0.2)
        async with Producer(config, transport=FakeKinesis()):
            await anyio.sleep(INTERVAL / 2)
            s3.get_object = s3.put_object = s3.delete_object = hung  # type: ignore[method-assign]
            await anyio.sleep(INTERVAL)
            closing_at = anyio.current_time()
        closed_after = anyio.current_time() - closing_at
        hang.set()
        assert closed_after <= 0.2 + 1e-6  # not CLOSE_TIMEOUT (1.5 s) and more

    async def test_a_takeover_waits_for_reads_that_succeed(self) -> None:
        # w0 hands over cleanly while its grants are in force; w1's first reads as the new
        # allocator fail: its first document follows w0's last one, built on it (the grants
        # in force still bound), with no learning mode. The lease is twice the usual
        # here: w1 decides up to two jittered cycles (2.2 s) after taking the lease.
        s3 = FakeS3()
        members = [Member(s3, f"w{i}", lease=2 * LEASE) for i in range(2)]
        async with running(*members):
            await anyio.sleep(3 * INTERVAL)
            assert s3.holder() == "w0"
            w1 = members[1].worker
            read_reports = w1._read_reports
            failed: list[float] = []

            async def fail_once(store: Any) -> Any:
                if not failed:
                    failed.append(anyio.current_time())
                    return None
                return await read_reports(store)

            w1._read_reports = fail_once  # type: ignore[method-assign]
            await members[0].worker.aclose()
            # w1 looks at the lease once the grants are an interval and a half old
            await anyio.sleep(5 * INTERVAL)
        assert failed
        documents = s3.generations()
        after = [d for d in documents if d.allocator == "w1"]
        assert after
        last_of_w0 = max(d.generation for d in documents if d.allocator == "w0")
        assert after[0].generation == last_of_w0 + 1
        assert not after[0].learning  # (the last document bounds what may be in force)

    async def test_a_leftover_written_again_since_the_listing_is_not_deleted(self) -> None:
        s3 = FakeS3()
        key = "anykpl-fleet/workers/back.json"
        await s3.put_object(Bucket=BUCKET, Key=key, Body=b"old")
        listed_etag = s3.objects[key][1]
        await s3.put_object(Bucket=BUCKET, Key=key, Body=b"new")  # its owner is back
        member = Member(s3, "w0")
        async with member.worker._store() as store:
            await member.worker._delete_leftover(store, key, listed_etag)
        assert s3.objects[key][0] == b"new"

    async def test_a_worker_whose_report_vanished_lists_again(self) -> None:
        s3 = FakeS3()
        member = Member(s3, "w0")  # alone: the allocator, granted, it has no need to list
        lists: list[float] = []
        listing = s3.list_objects_v2

        async def counted(**kwargs: Any) -> Any:
            lists.append(anyio.current_time())
            return await listing(**kwargs)

        s3.list_objects_v2 = counted  # type: ignore[method-assign]
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
            assert member.worker.statistics().mode == "granted"
            assert member.worker.statistics().rank == 1
            await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/workers/other.json", Body=b"")
            del s3.objects["anykpl-fleet/workers/w0.json"]  # deleted behind its back
            deleted_at = anyio.current_time()
            await anyio.sleep(2 * INTERVAL)
            stats = member.worker.statistics()
        # its next write found its report gone: it listed again, after writing it again
        assert [t for t in lists if t > deleted_at]
        assert stats.rank == 2

    async def test_junk_reports_do_not_stretch_the_interval(self) -> None:
        s3 = FakeS3()
        junk = b'{"kind": "anykpl-fleet-report", "version": 2}'
        members = [Member(s3, f"w{i}") for i in range(2)]
        async with running(*members):
            for _ in range(10):
                await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/workers/junk.json", Body=junk)
                await anyio.sleep(INTERVAL)
            stats = [m.worker.statistics() for m in members]
        assert [s.sync_interval for s in stats] == [INTERVAL, INTERVAL]
        assert s3.generations()[-1].sync_interval == INTERVAL

    async def test_a_standby_allocator_keeps_to_the_fleets_interval(self) -> None:
        # a slow store: the allocator asks three intervals of the fleet; a standalone standby
        # that takes over must write a lease for that interval, not for its configured one
        s3 = FakeS3()
        now = SERVER_EPOCH + anyio.current_time()
        stretched = GrantsDocument(
            generation=5,
            allocator="gone",
            issued_at=now,
            expires_at=now + 4 * 3 * INTERVAL,
            learning=False,
            cap=Rates(CAP, None),
            workers={},
            sync_interval=3 * INTERVAL,
        )
        await s3.put_object(Bucket=BUCKET, Key="anykpl-fleet/grants.json", Body=stretched.to_json())
        standby = FleetAllocator(
            fleet(), CONFIG, allocator_id="standby", client_factory=s3.factory()
        )
        async with running(standby):
            await anyio.sleep(1.5 * INTERVAL)
        lease = parse_lease(s3.versions["anykpl-fleet/allocator.json"][0])
        assert lease.holder == "standby"
        assert lease.lease == pytest.approx(3 * LEASE)

    async def test_leftover_presence_objects_of_allocators_are_deleted(self) -> None:
        s3 = FakeS3()
        key = "anykpl-fleet/allocators/gone.json"
        await s3.put_object(Bucket=BUCKET, Key=key, Body=b"{}")
        await anyio.sleep(fleet_member.LEFTOVER_LEASES * LEASE + 2)
        member = Member(s3, "w0")
        async with running(member):
            await anyio.sleep(3 * INTERVAL)
        assert key not in s3.objects

    async def test_the_standalone_allocator_does_not_speak_of_a_producer(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        s3 = FakeS3()
        s3.down = True
        allocator = FleetAllocator(fleet(), CONFIG, client_factory=s3.factory())
        async with running(allocator):
            await anyio.sleep(2 * INTERVAL)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings
        assert not [w for w in warnings if "producer" in w]

    async def test_a_producer_without_a_fleet_has_no_fleet_statistics(self) -> None:
        async with Producer(CONFIG, transport=FakeKinesis()) as producer:
            assert producer.statistics().fleet is None
            assert producer._fleet_bucket is None


async def test_a_member_must_define_its_own_cycle() -> None:
    """The sync cycle is an abstract method: a kind of member without one fails when it is
    made, not at its first cycle."""

    class Forgetful(fleet_member.Member):
        pass

    with pytest.raises(TypeError, match="_cycle"):
        Forgetful(fleet(), CONFIG, member_id="m", client_factory=None, on_allocation=None)
