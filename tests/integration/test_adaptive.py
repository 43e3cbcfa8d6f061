"""Adaptive rate control against the emulator's shard limits: three producers sharing one
shard, each able to fill it alone. With adaptive control they throttle each other far less than
with the KPL's static limiter, each gets a real share, and every record is read back."""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import boto3
import pytest

from anykpl import Producer
from anykpl.emulator import Emulator, EmulatorClient

from .conftest import CREDENTIALS, REGION
from .test_end_to_end import Sent, assert_success, check_read_back, make_sent, read_stream_async

pytestmark = pytest.mark.anyio

PRODUCERS = 3
SECONDS = 9.0
SETTLE = 1.5
STATIC_WARM_UP = 4.0
SIZE = 1000


async def _share_one_shard(
    url: str, control: EmulatorClient, stream: str, *, adaptive: bool
) -> dict[str, Any]:
    """Run the producers for SECONDS; return what each delivered and what they saw. Three
    producers starting at a whole shard each throttle a lot until their rates are cut, and the
    emulator's burst puts that off by a second or two: with adaptive control, the emulator's
    counters are reset SETTLE seconds after every producer's first cut (static producers never
    cut: theirs are reset after STATIC_WARM_UP seconds, about when the adaptive run's are)."""
    sent: dict[int, Sent] = {}
    delivered = [0] * PRODUCERS
    cuts = [0] * PRODUCERS
    next_uid = iter(range(10**9))
    all_cut = anyio.Event()
    rng = random.Random(3)

    async def producer_task(index: int) -> None:
        async with Producer(
            region=REGION,
            endpoint_url=url,
            adaptive=adaptive,
            max_outstanding_records=500,
            record_ttl=120.0,
            **CREDENTIALS,
        ) as producer:
            handles = []
            end = anyio.current_time() + SECONDS
            while anyio.current_time() < end:
                uid = next(next_uid)
                record = sent[uid] = make_sent(uid, f"p{index}-{rng.random()}", size=SIZE)
                handles.append(await producer.submit(stream, record.data, record.partition_key))
                if not cuts[index] and len(handles) % 100 == 0:
                    cuts[index] = _cuts(producer, stream)
                    if all(cuts):
                        all_cut.set()
            cuts[index] = _cuts(producer, stream)
            await producer.flush()
            for handle in handles:
                assert_success(await handle)
            delivered[index] = len(handles)

    async def reset_after_warm_up() -> None:
        if adaptive:
            with anyio.move_on_after(SECONDS / 2):
                await all_cut.wait()
            await anyio.sleep(SETTLE)
        else:
            await anyio.sleep(STATIC_WARM_UP)
        await anyio.to_thread.run_sync(control.reset_stats)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reset_after_warm_up)
        for index in range(PRODUCERS):
            tg.start_soon(producer_task, index)
    return {"sent": sent, "delivered": delivered, "cuts": cuts}


def _cuts(producer: Producer, stream: str) -> int:
    stats = producer.statistics().streams.get(stream)
    return 0 if stats is None else sum(shard.cuts for shard in stats.shards.values())


def _throttled_share(control: EmulatorClient, stream: str) -> float:
    shards = [s for s in control.stats()["shards"] if s["stream"] == stream]
    accepted = sum(s["accepted_records"] for s in shards)
    throttled = sum(s["throttled_records"] for s in shards)
    return throttled / max(1, accepted + throttled)


@pytest.mark.timeout(180)
async def test_producers_sharing_a_shard_throttle_less_with_adaptive_control() -> None:
    tag = f"{random.randrange(1 << 32):08x}"  # in-process emulators share moto's state
    static_stream, adaptive_stream = f"static-{tag}", f"adaptive-{tag}"
    with Emulator(streams={static_stream: 1, adaptive_stream: 1}) as url:
        control = EmulatorClient(url)
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)

        started = time.monotonic()
        static = await _share_one_shard(url, control, static_stream, adaptive=False)
        static_share = _throttled_share(control, static_stream)
        assert static["cuts"] == [0] * PRODUCERS
        assert time.monotonic() - started < 120

        adaptive = await _share_one_shard(url, control, adaptive_stream, adaptive=True)
        adaptive_share = _throttled_share(control, adaptive_stream)

        # each static producer sends a whole shard's worth: most of it is throttled
        assert static_share > 0.3, static_share
        # adaptive control cut the rates and the throttling with them
        assert all(cuts > 0 for cuts in adaptive["cuts"]), adaptive["cuts"]
        assert adaptive_share < static_share / 2, (adaptive_share, static_share)
        # nobody starved: each producer put at least an eighth of all records (a fair share is
        # a third)
        total = sum(adaptive["delivered"])
        assert min(adaptive["delivered"]) > total / 8, adaptive["delivered"]

        for stream, run in ((static_stream, static), (adaptive_stream, adaptive)):
            contents = await read_stream_async(client, stream)
            arrived = check_read_back(contents, run["sent"])
            missing = set(run["sent"]) - set(arrived)
            assert not missing, f"{len(missing)} acknowledged records missing from {stream}"
