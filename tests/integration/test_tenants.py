"""Tenant quotas and the fair queue against the emulator (limits on: 1 MiB/s and 1000
records/s per shard), on asyncio and on trio.

A quiet tenant puts a 100-byte record every 10 ms on a 1-shard stream, each ``put_record`` in
its own task, and we take each put's latency. Its p99 alone is the baseline; then a noisy
tenant on the same shard (1) offers 10 times its quota, or (2) has a quota above the shard's
limit and uses it all, so the shard is saturated and its backlog grows by 1 MiB/s. In both,
the quiet tenant's p99 must stay close to its p99 alone: in (1) because the quota holds the
noisy tenant back, in (2) because the Limiter serves the shard's tenants round robin. The
issue's bar is one ``record_max_buffered_time`` (0.1 s), checked by benchmarks/tenants.py on
a quiet machine; here the margin is 1 s, loose enough not to flake on a busy one (a CI run on
trio gave 0.54 s where a quiet machine gives 0.17-0.23 s) and still far below the 2.4 s p99
the quiet records have behind the backlog of (2) without fair queuing.

Every admitted record, quiet and noisy, is then read back from the stream exactly once.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import pytest

from anykpl import Producer, TenantQuota, errors

from .test_end_to_end import read_stream_async

pytestmark = pytest.mark.anyio

KIB = 1024
MIB = 1024 * 1024
PHASE = 3.0  # seconds of load per phase
QUIET_INTERVAL = 0.01
RMBT = 0.1
MARGIN = 1.0  # seconds over the quiet tenant's p99 alone (the bar is RMBT)
NOISY_SIZE = 1000  # data bytes; with the 24-character partition key, 1 KiB
NOISY_KEY = "noisy-partition-key-0000"
NOISY_RECORD = NOISY_SIZE + len(NOISY_KEY)


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    sent: set[bytes] = field(default_factory=set)  # every admitted record's data
    noisy_offered: int = 0
    noisy_admitted: int = 0
    noisy_refused: int = 0

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[math.ceil(0.99 * len(ordered)) - 1]


async def run_phase(
    stream: str,
    options: dict[str, Any],
    *,
    noisy_rate: float = 0.0,
    noisy_quota: TenantQuota | None = None,
) -> Run:
    """``PHASE`` seconds of the quiet tenant, with a noisy one offering ``noisy_rate``
    records/s (each ``submit`` in a task of its own) if given; then flush."""
    run = Run()
    quotas = {} if noisy_quota is None else {"noisy": noisy_quota}
    async with Producer(
        tenant_quotas=quotas,
        admission_timeout=1.0,
        record_max_buffered_time=RMBT,
        **options,
    ) as producer:
        await producer.put_record(stream, b"warm-up", partition_key="warm-up")
        run.sent.add(b"warm-up")

        async def quiet(uid: int) -> None:
            data = b"q%07d|" % uid + b"q" * 90
            start = anyio.current_time()
            result = await producer.put_record(
                stream, data, partition_key=f"quiet-{uid % 16}", tenant="quiet"
            )
            run.latencies.append(anyio.current_time() - start)
            assert result.success
            run.sent.add(data)

        async def noisy(uid: int) -> None:
            data = (b"n%07d|" % uid).ljust(NOISY_SIZE, b"n")
            try:
                await producer.submit(stream, data, partition_key=NOISY_KEY, tenant="noisy")
            except errors.BackpressureTimeout:
                run.noisy_refused += 1
            else:
                run.noisy_admitted += 1
                run.sent.add(data)

        async def offer_noise(tg: anyio.abc.TaskGroup, until: float) -> None:
            start = anyio.current_time()
            while (now := anyio.current_time()) < until:
                for _ in range(int((now - start) * noisy_rate) - run.noisy_offered):
                    tg.start_soon(noisy, run.noisy_offered)
                    run.noisy_offered += 1
                await anyio.sleep(0.005)

        started = anyio.current_time()
        until = started + PHASE
        async with anyio.create_task_group() as tg:
            if noisy_rate:
                tg.start_soon(offer_noise, tg, until)
            uid = 0
            while anyio.current_time() < until:
                tg.start_soon(quiet, uid)
                uid += 1
                await anyio.sleep_until(started + uid * QUIET_INTERVAL)
        with anyio.fail_after(30):
            await producer.flush()
        assert producer.outstanding_records == 0
    return run


async def assert_read_back(client: Any, stream: str, sent: set[bytes]) -> None:
    contents = await read_stream_async(client, stream)
    arrived = Counter(bytes(r.decoded.data) for r in contents.user_records())
    missing = sent - set(arrived)
    assert not missing, f"{len(missing)} admitted records are not in the stream"
    assert set(arrived) == sent
    duplicated = [data[:8] for data, n in arrived.items() if n > 1]
    assert not duplicated, f"duplicated: {duplicated[:5]}"


@pytest.mark.timeout(180)
async def test_a_noisy_tenant_does_not_delay_a_quiet_one(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    alone_stream = make_stream(1)
    alone = await run_phase(alone_stream, producer_options)
    await assert_read_back(kinesis_client, alone_stream, alone.sent)

    # (1) 10x its quota: 100 KiB/s, offered 1000 KiB/s; what would wait more than the
    # admission_timeout (1 s) is refused at once
    quota = TenantQuota(bytes_per_second=100 * KIB)
    over_quota_stream = make_stream(1)
    over_quota = await run_phase(
        over_quota_stream,
        producer_options,
        noisy_rate=10 * 100 * KIB / NOISY_RECORD,
        noisy_quota=quota,
    )
    await assert_read_back(kinesis_client, over_quota_stream, over_quota.sent)
    assert over_quota.noisy_refused > over_quota.noisy_offered / 2
    # the quota held: at most a second's burst over the rate (and the waiters admitted
    # within the admission_timeout after the offer stopped)
    allowed = 100 * KIB * (PHASE + 1.0 + 1.0) / NOISY_RECORD
    assert over_quota.noisy_admitted <= allowed + 1

    # (2) a quota above the shard's limit, used in full: 2 MiB/s into a 1 MiB/s shard
    saturated_stream = make_stream(1)
    saturated = await run_phase(
        saturated_stream,
        producer_options,
        noisy_rate=2 * MIB / NOISY_RECORD,
        noisy_quota=TenantQuota(bytes_per_second=2 * MIB),
    )
    await assert_read_back(kinesis_client, saturated_stream, saturated.sent)
    # the shard really was over its limit: more admitted than it could take during the phase
    assert saturated.noisy_admitted * NOISY_RECORD > 1.5 * MIB * PHASE

    for name, run in (("10x quota", over_quota), ("over the shard", saturated)):
        assert run.p99 <= alone.p99 + MARGIN, (
            f"{name}: the quiet tenant's p99 was {run.p99:.3f} s, alone {alone.p99:.3f} s"
        )
