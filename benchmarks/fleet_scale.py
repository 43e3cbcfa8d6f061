"""A fleet at scale on a virtual clock (issue 31): the real worker and allocator code, a
simulated store that is slow, fails and throttles.

Every member is a real :class:`~anykpl._fleet.FleetWorker` (the code a producer runs), each
with its own demand (``--offer`` records/s, spread ±33 %: its callers offer that much, and its
producer admits it while its backlog is under ``max_outstanding_time`` of what it sends, and
holds the callers back beyond, as a producer's admission does), all in one trio run on
``trio.testing.MockClock(autojump_threshold=0)``: minutes of fleet time pass in seconds, and
nothing here is timed by the wall clock. The store is :class:`SimulatedStore`, an S3 bucket in
memory with S3's conditional writes and whole-second ``Date`` and ``LastModified``, that
serves ``--store-rate`` requests per second from one queue (a request waits its turn, plus
``--latency`` ± a quarter), answers ``503 SlowDown`` at once when its queue is more than
``--throttle-after`` seconds deep, and fails ``--error-rate`` of the requests with a 500.

With ``--new-cap``, the cap changes ``--cap-change-at`` s after the last join by a rolling
redeploy over ``--rollout`` s: each member's process closes (its report and any lease
released) and a new one with the new cap starts under the same ``worker_id``;
``converged_after_cap_change`` counts from the end of the rollout, and
``max_applied_over_cap`` is taken over the cap in force (either cap during the rollout).

Each member's monotonic clock may be its own (``--skew`` s of offset and ``--drift`` parts per
million of rate, either way, drawn per member): staleness is judged by the store's clock,
which the members learn from its ``Date`` and ``LastModified`` stamps.

The run: ``--members`` join evenly over ``--join`` s; ``--leave-at`` s after the last join,
``--leave`` of them (never the allocator) leave gracefully (their producers close);
``--late-at`` s after the last join, ``--late`` more join at once; ``--crash`` s after the
last join the allocator crashes (its process gone: no clean-up); the run ends ``--duration``
s after the last join. Printed, and as JSON with ``--json``:

* ``max_applied_over_cap``: the largest sum of the rates the members apply, at any instant,
  over the cap (the bar: at most 1);
* ``converged_after_join``, ``converged_after_leave``, ``converged_after_late`` and
  ``converged_after_crash``: seconds from the last join, the leave, the late joins and the
  crash until the sum applied is within ±5 % of the cap until the next of these events
  (``None``: never);
* ``fair_share`` and ``late_fair_share_after``: what the members there before apply (the
  median, at the end of the late joins' window), and the seconds until the last of the late
  members applies at least 95 % of it for good;
* ``final_applied_over_cap`` and ``mean_applied_over_cap_last_minute``: the sum applied at the
  end, and its mean over the last minute, over the cap in force at the end;
* ``requests_per_second``: the store's requests by kind over the run, and those it refused;
  ``requests_per_second_last_minute``: all kinds, over the run's last minute;
* ``longest_interval``, ``final_interval``: the sync interval the allocator asked of the
  fleet (it stretches while the store is slow).

    python benchmarks/fleet_scale.py --members 1000 --store-rate 230      # the issue's case
    python benchmarks/fleet_scale.py --members 300 --store-rate 5000 --join 30 \
        --leave 30 --leave-at 40 --late 30 --late-at 80 --crash 120 --duration 180
    python benchmarks/fleet_scale.py --members 300 --store-rate 5000 --plot fleet.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import formatdate
from typing import Any

import anyio
import anyio.lowlevel
from botocore.exceptions import ClientError

from anykpl import FleetConfig, ProducerConfig
from anykpl._fleet import DocumentError, FleetDemand, FleetWorker, parse_grants

#: The store's time when the virtual clock reads 0.
EPOCH = 1_800_000_000.0
BUCKET = "fleet"
TABLE = "fleet"
PREFIX = "anykpl-fleet"
GRANTS = "anykpl-fleet/grants.json"
CONFIG = ProducerConfig(region="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")
#: A member's producer admits records while its backlog is under this many seconds of what it
#: sends (``max_outstanding_time``: half the default ``record_ttl``).
HELD_SECONDS = CONFIG.record_ttl / 2


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aenter__(self) -> _Body:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return self._data


class SimulatedStore:
    """An S3 bucket in memory that serves ``rate`` requests/s from one queue."""

    #: what it answers when its queue is too deep, and when a request fails
    THROTTLED = ("SlowDown", 503)
    FAILED = ("InternalError", 500)

    def __init__(
        self,
        *,
        rate: float,
        latency: float,
        throttle_after: float,
        error_rate: float,
        seed: int = 1,
    ) -> None:
        self.rate = rate
        self.latency = latency
        self.throttle_after = throttle_after
        self.error_rate = error_rate
        self.random = random.Random(seed)
        self.objects: dict[str, tuple[bytes, str, float]] = {}
        self.requests: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.per_second: Counter[int] = Counter()  # requests by virtual second
        self.by_second: Counter[tuple[int, str]] = Counter()  # and by kind
        self._busy_until = 0.0
        self._writes = 0

    def _now(self) -> float:
        return EPOCH + anyio.current_time()

    def _metadata(self, status: int = 200, **headers: str) -> dict[str, Any]:
        headers["date"] = formatdate(math.floor(self._now()), usegmt=True)
        return {"HTTPStatusCode": status, "HTTPHeaders": headers}

    def _error(self, code: str, status: int, operation: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": code}, "ResponseMetadata": self._metadata(status)},
            operation,
        )

    async def _serve(self, operation: str) -> None:
        """Wait for this request's turn and its latency; refuse it when the queue is deep."""
        self.requests[operation] += 1
        now = anyio.current_time()
        self.per_second[int(now)] += 1
        self.by_second[int(now), operation] += 1
        start = max(now, self._busy_until)
        if start - now > self.throttle_after:
            self.refused[operation] += 1
            await anyio.sleep(self.latency)
            raise self._error(*self.THROTTLED, operation)
        self._busy_until = start + 1.0 / self.rate
        jitter = self.latency * self.random.uniform(-0.25, 0.25)
        await anyio.sleep(self._busy_until - now + self.latency + jitter)
        if self.random.random() < self.error_rate:
            self.refused[operation] += 1
            raise self._error(*self.FAILED, operation)

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
        await self._serve("PutObject")
        existing = self.objects.get(Key)
        if IfNoneMatch == "*" and existing is not None:
            raise self._error("PreconditionFailed", 412, "PutObject")
        if IfMatch is not None and (existing is None or existing[1] != IfMatch):
            raise self._error("PreconditionFailed" if existing else "NoSuchKey", 412, "PutObject")
        self._writes += 1
        etag = '"' + hashlib.md5(Body + str(self._writes).encode()).hexdigest() + '"'
        stamp = float(math.floor(self._now()))
        self.objects[Key] = (bytes(Body), etag, stamp)
        return {"ETag": etag, "ResponseMetadata": self._metadata()}

    async def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        await self._serve("GetObject")
        if Key not in self.objects:
            raise self._error("NoSuchKey", 404, "GetObject")
        body, etag, stamp = self.objects[Key]
        return {
            "Body": _Body(body),
            "ETag": etag,
            "ContentLength": len(body),
            "LastModified": datetime.fromtimestamp(stamp, timezone.utc),
            "ResponseMetadata": self._metadata(),
        }

    async def list_objects_v2(
        self, *, Bucket: str, Prefix: str, ContinuationToken: str | None = None
    ) -> dict[str, Any]:
        await self._serve("ListObjectsV2")
        keys = sorted(k for k in self.objects if k.startswith(Prefix))
        start = int(ContinuationToken or 0)
        page = keys[start : start + 1000]
        truncated = start + 1000 < len(keys)
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
            "NextContinuationToken": str(start + 1000) if truncated else None,
            "ResponseMetadata": self._metadata(),
        }

    async def delete_object(
        self, *, Bucket: str, Key: str, IfMatch: str | None = None
    ) -> dict[str, Any]:
        await self._serve("DeleteObject")
        existing = self.objects.get(Key)
        if IfMatch is not None and (existing is None or existing[1] != IfMatch):
            raise self._error("PreconditionFailed", 412, "DeleteObject")
        self.objects.pop(Key, None)
        return {"ResponseMetadata": self._metadata(204)}

    def document(self, key: str) -> bytes | None:
        """The body of object ``key``, if any (what the run measures, not a request)."""
        found = self.objects.get(key)
        return None if found is None else found[0]

    def factory(self) -> Callable[[], Any]:
        @asynccontextmanager
        async def client() -> AsyncIterator[SimulatedStore]:
            yield self

        return client


class SimulatedTable(SimulatedStore):
    """A DynamoDB table in memory, the calls a fleet makes (GetItem, PutItem, DeleteItem,
    Query) with their condition expressions, dated answers, a page of a Query per MB read,
    and items of at most 400 KB; served as :class:`SimulatedStore` serves requests, throttled
    with ``ThrottlingException``."""

    THROTTLED = ("ThrottlingException", 400)
    FAILED = ("InternalServerError", 500)
    PAGE_BYTES = 1 << 20
    ITEM_BYTES = 400 * 1024

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.items: dict[tuple[str, str], dict[str, Any]] = {}

    @staticmethod
    def _size(item: dict[str, Any]) -> int:
        return sum(len(name) + len(next(iter(value.values()))) for name, value in item.items())

    def _check(self, key: tuple[str, str], condition: str | None, values: Any, op: str) -> None:
        existing = self.items.get(key)
        if condition is None:
            return
        if condition == "attribute_not_exists(sk)":
            ok = existing is None
        elif condition == "etag = :etag":
            ok = existing is not None and existing["etag"]["S"] == values[":etag"]["S"]
        else:
            raise self._error("ValidationException", 400, op)
        if not ok:
            raise self._error("ConditionalCheckFailedException", 400, op)

    async def put_item(
        self,
        *,
        TableName: str,
        Item: dict[str, Any],
        ConditionExpression: str | None = None,
        ExpressionAttributeValues: Any = None,
    ) -> dict[str, Any]:
        await self._serve("PutItem")
        if self._size(Item) > self.ITEM_BYTES:
            raise ClientError(
                {
                    "Error": {
                        "Code": "ValidationException",
                        "Message": "Item size has exceeded the maximum allowed size",
                    },
                    "ResponseMetadata": self._metadata(400),
                },
                "PutItem",
            )
        key = (Item["pk"]["S"], Item["sk"]["S"])
        self._check(key, ConditionExpression, ExpressionAttributeValues, "PutItem")
        self.items[key] = dict(Item)
        return {"ResponseMetadata": self._metadata()}

    async def get_item(
        self, *, TableName: str, Key: dict[str, Any], ConsistentRead: bool = False
    ) -> dict[str, Any]:
        await self._serve("GetItem")
        item = self.items.get((Key["pk"]["S"], Key["sk"]["S"]))
        answer: dict[str, Any] = {"ResponseMetadata": self._metadata()}
        if item is not None:
            answer["Item"] = dict(item)
        return answer

    async def delete_item(
        self,
        *,
        TableName: str,
        Key: dict[str, Any],
        ConditionExpression: str | None = None,
        ExpressionAttributeValues: Any = None,
    ) -> dict[str, Any]:
        await self._serve("DeleteItem")
        key = (Key["pk"]["S"], Key["sk"]["S"])
        self._check(key, ConditionExpression, ExpressionAttributeValues, "DeleteItem")
        self.items.pop(key, None)
        return {"ResponseMetadata": self._metadata()}

    async def query(
        self,
        *,
        TableName: str,
        KeyConditionExpression: str,
        ExpressionAttributeValues: Any,
        ProjectionExpression: str,
        ConsistentRead: bool = False,
        ExclusiveStartKey: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        await self._serve("Query")
        assert KeyConditionExpression == "pk = :pk AND begins_with(sk, :prefix)"
        pk = ExpressionAttributeValues[":pk"]["S"]
        prefix = ExpressionAttributeValues[":prefix"]["S"]
        after = ExclusiveStartKey["sk"]["S"] if ExclusiveStartKey else None
        names = [name.strip() for name in ProjectionExpression.split(",")]
        keys = sorted(
            sk
            for (p, sk) in self.items
            if p == pk and sk.startswith(prefix) and (after is None or sk > after)
        )
        page: list[dict[str, Any]] = []
        read = 0
        last: str | None = None
        for sk in keys:
            item = self.items[(pk, sk)]
            read += self._size(item)  # a page counts what is read, before the projection
            page.append({name: item[name] for name in names if name in item})
            if read >= self.PAGE_BYTES:  # (the service says so even at the last item)
                last = sk
                break
        answer: dict[str, Any] = {"Items": page, "ResponseMetadata": self._metadata()}
        if last is not None:
            answer["LastEvaluatedKey"] = {"pk": {"S": pk}, "sk": {"S": last}}
        return answer

    def document(self, key: str) -> bytes | None:
        item = self.items.get((PREFIX, key))
        return None if item is None else zlib.decompress(item["body"]["B"])


def settled_since(
    series: list[tuple[float, float]], start: float, end: float, ok: Callable[[float], bool]
) -> float | None:
    """Seconds from ``start`` until the value of a step ``series`` (time, value) satisfies
    ``ok`` for good, up to ``end`` (``None``: not by then)."""
    since: float | None = None
    value = 0.0
    for when, level in series:
        if when >= end:
            break
        if when >= start and since is None and ok(value):
            since = start
        value = level
        if when < start:
            continue
        if ok(level) and since is None:
            since = when
        elif not ok(level):
            since = None
    if since is None and ok(value):
        since = start
    return None if since is None else since - start


@dataclass
class Ledger:
    """The rates every member applies, and their sum over time."""

    cap: float
    applied: dict[int, float] = field(default_factory=dict)
    total: float = 0.0
    peak: float = 0.0
    peak_at: float = 0.0
    series: list[tuple[float, float]] = field(default_factory=list)
    #: each member's applied rate over time
    members: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    def set(self, member: int, rate: float | None) -> None:
        value = math.inf if rate is None else rate
        self.total += value - self.applied.get(member, 0.0)
        self.applied[member] = value
        now = anyio.current_time()
        self.members.setdefault(member, []).append((now, value))
        if self.total > self.peak:
            self.peak, self.peak_at = self.total, now
        if self.series and self.series[-1][0] == now:
            self.series[-1] = (now, self.total)
        else:
            self.series.append((now, self.total))

    def converged_since(
        self, start: float, end: float, band: float = 0.05, cap: float | None = None
    ) -> float | None:
        """Seconds from ``start`` until the sum stays within ±band of the cap (``cap``, or the
        ledger's) until ``end``."""
        cap = self.cap if cap is None else cap
        low, high = cap * (1 - band), cap * (1 + band)
        return settled_since(self.series, start, end, lambda total: low <= total <= high)

    def mean(self, start: float, end: float) -> float:
        """The time-weighted mean of the sum applied over [start, end)."""
        total = value = 0.0
        at = start
        for when, level in self.series:
            if when > start:
                total += value * (min(when, end) - at)
                at = min(when, end)
            if when >= end:
                break
            value = level
        total += value * (end - at)
        return total / max(1e-9, end - start)

    def rate_at(self, member: int, when: float) -> float:
        """The rate ``member`` applied at ``when``."""
        value = 0.0
        for at, rate in self.members.get(member, ()):
            if at > when:
                break
            value = rate
        return value

    def reached_since(self, member: int, start: float, end: float, share: float) -> float | None:
        """Seconds from ``start`` until ``member`` applies at least ``share`` until ``end``."""
        return settled_since(self.members.get(member, []), start, end, lambda rate: rate >= share)


def member_clock(index: int, args: Any) -> Callable[[], float] | None:
    """Member ``index``'s own monotonic clock: the virtual clock with an offset of up to
    ``--skew`` s either way and a rate off by up to ``--drift`` parts per million (``None``:
    the virtual clock itself). Its timers still run at the virtual clock's rate: a sleep of
    an interval is off by drift × interval (5 µs at 1 ppm and 5 s), as a real machine's timers
    follow its own clock."""
    if not args.skew and not args.drift:
        return None
    draw = random.Random(args.seed * 7_919 + index)
    offset = draw.uniform(-args.skew, args.skew)
    rate = 1.0 + draw.uniform(-args.drift, args.drift) * 1e-6

    def clock() -> float:
        return offset + rate * anyio.current_time()

    return clock


class Member:
    """A real FleetWorker with a steady offer, and a backlog when its rate is below it."""

    def __init__(
        self, index: int, store: SimulatedStore, ledger: Ledger, offer: float, args: Any
    ) -> None:
        self.index = index
        self.offer = offer
        self.ledger = ledger
        self.rate = 0.0
        self.offered = 0.0  # records admitted so far
        self.backlog = 0.0
        self.held = False  # callers wait for room
        self.waits = 0  # the times they began to
        self.since = 0.0
        self.store = store
        self.args = args
        self.worker = self.make_worker(args.cap)

    def make_worker(self, cap: float, incarnation: int = 0) -> FleetWorker:
        """The member's worker (a new process of it, for a redeploy: ``incarnation`` > 0)."""
        args = self.args
        worker = FleetWorker(
            FleetConfig(
                bucket=BUCKET if args.store == "s3" else None,
                table=TABLE if args.store == "dynamodb" else None,
                records_per_second=cap,
                sync_interval=args.interval,
                worker_id=f"m{self.index:05d}",
            ),
            CONFIG,
            self.demand,
            self.apply,
            client_factory=self.store.factory(),
            local_clock=member_clock(self.index, args),
        )
        # the jitter and the incarnation of each member from the seed: a run can be repeated
        worker._random = random.Random((args.seed * 100_003 + self.index) * 7 + incarnation)
        # (a grant names the first 6 characters: unique for every process of every member)
        worker._incarnation = worker._state.incarnation = (
            f"{incarnation}{self.index:05d}-{args.seed}"
        )
        return worker

    def _advance(self) -> None:
        """Its callers offer ``offer`` records/s; the producer admits them while its backlog
        (admitted, not yet sent) is under ``max_outstanding_time`` of what it sends, and holds
        the callers back beyond that (as a producer's admission does); it sends at ``rate``."""
        now = anyio.current_time()
        elapsed = now - self.since
        self.since = now
        arriving = self.backlog + self.offer * elapsed
        backlog = max(0.0, arriving - self.rate * elapsed)
        limit = HELD_SECONDS * self.rate
        held = backlog > limit
        self.waits += held or self.held  # (callers waited in this stretch of time)
        self.held = held
        admitted = self.offer * elapsed - max(0.0, backlog - limit)
        self.offered += max(0.0, admitted)
        self.backlog = min(backlog, limit)

    def demand(self) -> FleetDemand:
        self._advance()
        return FleetDemand(
            int(self.offered),
            int(self.offered) * 100,
            int(self.backlog),
            0,
            admission_waits=self.waits,
            admission_waiting=self.held,
            fleet_refusals=self.waits,  # (what holds it back is its fleet rate)
            fleet_holding=self.held,
        )

    def apply(self, records: float | None, nbytes: float | None) -> None:
        self._advance()
        self.rate = math.inf if records is None else records
        self.ledger.set(self.index, records)


async def simulate(args: Any) -> dict[str, Any]:
    store = (SimulatedStore if args.store == "s3" else SimulatedTable)(
        rate=args.store_rate,
        latency=args.latency,
        throttle_after=args.throttle_after,
        error_rate=args.error_rate,
        seed=args.seed,
    )
    ledger = Ledger(cap=args.cap)
    rng = random.Random(args.seed)
    members = [
        Member(i, store, ledger, args.offer * rng.uniform(0.67, 1.33), args)
        for i in range(args.members + args.late)
    ]
    late = members[args.members :]
    members = members[: args.members]
    last_join = args.join
    change_at = last_join + args.cap_change_at if args.new_cap else None
    changed_at = None if change_at is None else change_at + args.rollout
    leave_at = last_join + args.leave_at if args.leave else None
    late_at = last_join + args.late_at if args.late else None
    crash_at = last_join + args.crash if args.crash is not None and args.crash >= 0 else None
    end = last_join + args.duration
    events = sorted(
        t for t in (leave_at, late_at, crash_at, change_at, changed_at) if t is not None
    )
    crashed: list[str] = []
    left: list[int] = []

    def next_event(after: float) -> float:
        return min([t for t in events if t > after] + [end])

    async def killed(_store: Any) -> None:
        """A crashed member cleans nothing up."""

    intervals: list[tuple[float, float]] = []

    async def sample_interval() -> None:
        """The sync interval the allocator asks of the fleet, every virtual second."""
        while True:
            found = store.document(GRANTS)
            if found is not None:
                try:
                    asked = getattr(parse_grants(found), "sync_interval", None) or args.interval
                except DocumentError:
                    asked = args.interval
                if not intervals or intervals[-1][1] != asked:
                    intervals.append((anyio.current_time(), asked))
            await anyio.sleep(1.0)

    async def redeploy(member: Member, task_group: Any) -> None:
        """A new process of the member, with the new cap: the old one closes first (its
        report and any lease released, as a rolling deployment's stop does)."""
        await member.worker.aclose()
        member.worker = member.make_worker(args.new_cap, incarnation=1)
        task_group.start_soon(member.worker.run)

    async def roll_out(task_group: Any) -> None:
        """The cap changes by a rolling redeploy of every member over ``--rollout`` s."""
        assert change_at is not None
        await anyio.sleep_until(change_at)
        peaks.append((ledger.peak / args.cap, ledger.peak_at))
        # the next window starts at the sum in force now
        ledger.peak, ledger.peak_at = ledger.total, anyio.current_time()
        staying = [m for m in members if m.index not in left and m.worker.worker_id not in crashed]
        staying += [m for m in late if m.worker._run_scope is not None]
        for i, member in enumerate(staying):
            await anyio.sleep_until(change_at + args.rollout * i / max(1, len(staying)))
            task_group.start_soon(redeploy, member, task_group)
        await anyio.sleep_until(change_at + args.rollout)
        # while it rolls out, either cap may be in force
        peaks.append((ledger.peak / max(args.cap, args.new_cap), ledger.peak_at))
        ledger.peak, ledger.peak_at = ledger.total, anyio.current_time()

    peaks: list[tuple[float, float]] = []  # (the largest sum ÷ the cap in force, when)

    async def leave(member: Member) -> None:
        """A graceful leave: the producer closes, and its worker with it (which applies
        nothing from then on: the ledger hears it from the worker)."""
        await member.worker.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_interval)
        if change_at is not None:
            tg.start_soon(roll_out, tg)
        for i, member in enumerate(members):
            await anyio.sleep_until(args.join * i / max(1, args.members - 1))
            tg.start_soon(member.worker.run)
        for when in events:
            await anyio.sleep_until(when)
            if when == leave_at:
                stay = [m for m in members if not m.worker.holds_lease and m.index not in left]
                for member in random.Random(args.seed + 1).sample(stay, args.leave):
                    left.append(member.index)
                    tg.start_soon(leave, member)
            if when == late_at:
                for member in late:
                    tg.start_soon(member.worker.run)
            if when == crash_at:
                for member in members:
                    if member.worker.holds_lease:
                        crashed.append(member.worker.worker_id)
                        member.worker._cleanup = killed  # type: ignore[method-assign,assignment]
                        assert member.worker._run_scope is not None
                        member.worker._run_scope.cancel()
                        ledger.set(member.index, 0.0)
        await anyio.sleep_until(end)
        # (as the run ends, every member leaves and applies nothing: measured before that)
        final, series = ledger.total, list(ledger.series)
        last_minute = ledger.mean(max(0.0, end - 60), end)
        tg.cancel_scope.cancel()
    seconds = max(1e-9, end)
    cap_at_end = args.new_cap if changed_at is not None else args.cap

    def cap_at(when: float) -> float:
        """The cap in force at ``when`` (the old one until the rollout ends)."""
        return args.new_cap if changed_at is not None and when >= changed_at else args.cap

    peak, peak_at = max([*peaks, (ledger.peak / cap_at_end, ledger.peak_at)])
    after_crash = None
    if crash_at is not None:
        after_crash = ledger.converged_since(crash_at, next_event(crash_at), cap=cap_at(crash_at))
    after_leave = None
    if leave_at is not None:
        after_leave = ledger.converged_since(leave_at, next_event(leave_at), cap=cap_at(leave_at))
    after_late = fair_share_after = None
    fair_share = None
    if late_at is not None:
        window_end = next_event(late_at)
        after_late = ledger.converged_since(late_at, window_end, cap=cap_at(late_at))
        # a member's fair share: what the members already there apply at the window's end
        # (every member offers more than the cap allows it, so the allocator shares evenly)
        steady = sorted(
            ledger.rate_at(m.index, window_end - 1e-6)
            for m in members
            if m.index not in left and m.worker.worker_id not in crashed
        )
        fair_share = steady[len(steady) // 2]
        reached = [
            ledger.reached_since(m.index, late_at, window_end, 0.95 * fair_share) for m in late
        ]
        fair_share_after = None if None in reached else max(r for r in reached if r is not None)
    return {
        "members": args.members,
        "cap": args.cap,
        "store": args.store,
        "store_rate": args.store_rate,
        "skew": args.skew,
        "drift_ppm": args.drift,
        "latency": args.latency,
        "error_rate": args.error_rate,
        "interval": args.interval,
        # over the cap in force: the old one, either during a rollout, the new one after it
        "max_applied_over_cap": peak,
        "cap_changed_at": changed_at,
        "new_cap": args.new_cap,
        "converged_after_cap_change": (
            None
            if changed_at is None
            else ledger.converged_since(changed_at, next_event(changed_at), cap=args.new_cap)
        ),
        "max_applied_at": peak_at,
        "converged_after_join": ledger.converged_since(last_join, next_event(last_join)),
        "left": len(left),
        "converged_after_leave": after_leave,
        "late": args.late,
        "converged_after_late": after_late,
        "fair_share": fair_share,
        "late_fair_share_after": fair_share_after,
        "crashed": crashed,
        "converged_after_crash": after_crash,
        # over the cap in force at the end
        "final_applied_over_cap": final / cap_at_end,
        "mean_applied_over_cap_last_minute": last_minute / cap_at_end,
        "longest_interval": max((i for _, i in intervals), default=args.interval),
        "final_interval": intervals[-1][1] if intervals else args.interval,
        "requests_per_second": {k: v / seconds for k, v in sorted(store.requests.items())},
        "requests_per_second_last_minute": sum(
            store.per_second[second] for second in range(int(end) - 60, int(end))
        )
        / 60,
        "last_minute_by_kind": {
            kind: sum(store.by_second[second, kind] for second in range(int(end) - 60, int(end)))
            for kind in sorted(store.requests)
        },
        "grants_document_bytes": len(grants_body := store.document(GRANTS) or b""),
        "grants_document_compressed_bytes": len(zlib.compress(grants_body)),
        "refused": dict(store.refused),
        "series": [*series, (end, final)],
        "last_join": last_join,
        "crash_at": crash_at,
        "leave_at": leave_at,
        "late_at": late_at,
        "end": end,
        "bootstrap_fraction": FleetConfig(bucket=BUCKET, records_per_second=1).bootstrap_fraction,
    }


def parse(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--cap", type=float, default=5000.0, help="records/s for the fleet")
    parser.add_argument("--offer", type=float, default=30.0, help="records/s per member")
    parser.add_argument("--interval", type=float, default=5.0, help="sync_interval, s")
    parser.add_argument(
        "--store", choices=("s3", "dynamodb"), default="s3", help="the store simulated"
    )
    parser.add_argument("--store-rate", type=float, default=230.0, help="requests/s")
    parser.add_argument("--latency", type=float, default=0.05, help="s per request")
    parser.add_argument("--throttle-after", type=float, default=1.0, help="queue depth, s")
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--join", type=float, default=60.0, help="s over which members join")
    parser.add_argument(
        "--crash", type=float, default=60.0, help="s after the last join (negative: no crash)"
    )
    parser.add_argument(
        "--leave", type=int, default=0, help="members that leave gracefully (at --leave-at)"
    )
    parser.add_argument("--leave-at", type=float, default=30.0, help="s after the last join")
    parser.add_argument("--late", type=int, default=0, help="members that join at --late-at")
    parser.add_argument("--late-at", type=float, default=45.0, help="s after the last join")
    parser.add_argument("--duration", type=float, default=150.0, help="s after the last join")
    parser.add_argument(
        "--skew", type=float, default=0.0, help="s: each member's clock offset, up to ± this"
    )
    parser.add_argument(
        "--drift", type=float, default=0.0, help="ppm: each member's clock rate, off by up to ±"
    )
    parser.add_argument(
        "--new-cap", type=float, default=0.0, help="records/s: the cap after a rolling redeploy"
    )
    parser.add_argument(
        "--cap-change-at", type=float, default=60.0, help="s after the last join: it starts"
    )
    parser.add_argument("--rollout", type=float, default=10.0, help="s the redeploy takes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", help="write a plot of the applied sum against the cap")
    args = parser.parse_args(argv)
    last = args.join + args.duration
    at = {
        "--leave-at": args.join + args.leave_at if args.leave else None,
        "--late-at": args.join + args.late_at if args.late else None,
        "--crash": args.join + args.crash if args.crash >= 0 else None,
        "--cap-change-at": args.join + args.cap_change_at if args.new_cap else None,
        "the rollout's end": (
            args.join + args.cap_change_at + args.rollout if args.new_cap else None
        ),
    }
    times = [t for t in at.values() if t is not None]
    if len(set(times)) != len(times):
        parser.error(f"two events at the same time: {at}")
    if any(t >= last for t in times):
        parser.error(f"an event at or after the end of the run ({last} s): {at}")
    return args


def share_parsed_grants() -> None:
    """Parse each stored grants document once for every member of this one process.

    A real member parses the document it reads (a 10,000-member fleet's is 2.5 MB of JSON:
    tens of milliseconds each interval, see the CHANGELOG's measurements). Here every member
    runs in one process and reads the same stored bytes, so parsing them once per member made the
    simulation's cost grow with the square of the fleet. The parsed document is immutable; a
    member gets the same result from the real ``parse_grants`` as before, only computed once
    per stored version (looked up by the bytes: a DynamoDB read decompresses a copy; what
    fails to parse is not kept, each member gets the error).
    """
    from anykpl._fleet import _member

    real = _member.parse_grants
    parsed: dict[bytes, Any] = {}

    def parse(data: bytes) -> Any:
        if type(data) is not bytes:
            return real(data)
        document = parsed.get(data)
        if document is None:
            document = real(data)
            if len(parsed) >= 8:
                parsed.clear()
            parsed[data] = document
        return document

    _member.parse_grants = parse  # type: ignore[attr-defined]


def run(args: Any) -> dict[str, Any]:
    import trio.testing

    share_parsed_grants()

    clock = trio.testing.MockClock(autojump_threshold=0)
    # trio reverses each batch of runnable tasks at random (to shake out order assumptions):
    # seeded here (where this trio has that generator), with each member's incarnation and
    # jitter, so that runs repeat (five runs of one command gave the same figures; what trio
    # orders by object address and Python by string hash may still differ in principle)
    scheduler_random = getattr(getattr(trio._core, "_run", None), "_r", None)
    if scheduler_random is not None:
        scheduler_random.seed(args.seed)
    result: dict[str, Any] = anyio.run(
        simulate, args, backend="trio", backend_options={"clock": clock}
    )
    return result


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for t, _ in result["series"]]
    totals = [min(v, 3 * result["cap"]) for _, v in result["series"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(times, totals, where="post", label="sum of the rates applied")
    ax.axhline(result["cap"], color="red", linestyle="--", label="cap")
    shared = result["cap"] * (1 - result["bootstrap_fraction"])
    ax.axhline(shared, color="grey", linestyle=":", label="what the grants share")
    ax.axvline(result["last_join"], color="green", linestyle="-.", label="last member joined")
    if result.get("leave_at") is not None:
        ax.axvline(result["leave_at"], color="orange", linestyle=":", label="a tenth left")
    if result.get("late_at") is not None:
        ax.axvline(result["late_at"], color="purple", linestyle=":", label="late members joined")
    if result["crash_at"] is not None:
        ax.axvline(result["crash_at"], color="black", linestyle="-.", label="allocator crashed")
    ax.set_xlabel("virtual seconds")
    ax.set_ylabel("records/s")
    ax.set_title(
        f"{result['members']} members, a store serving {result['store_rate']:g} requests/s"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    if args.plot:
        plot(result, args.plot)
    shown = {k: v for k, v in result.items() if k != "series"}
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        for key, value in shown.items():
            print(f"{key}: {value}")
    return 0 if result["max_applied_over_cap"] <= 1 + 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
