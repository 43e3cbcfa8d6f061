"""Delivery first, against the emulator's shard limits and faults (issue 10), on both backends.

Each case that broke delivery with the first adaptive controller: throttles that come whatever
the rate, a throttle storm, and sustained overload. Each runs with the defaults through the
public API; every admitted record must succeed (nothing expired), and every one is read back
from the stream and deaggregated (``check_read_back``), not counted by callbacks.
"""

from __future__ import annotations

import random

import anyio
import boto3
import pytest

from anykpl import PendingRecord, Producer
from anykpl.emulator import Emulator, EmulatorClient, Faults, spawn

from ..fakes import hash_of
from .conftest import CREDENTIALS, REGION
from .test_end_to_end import Sent, assert_success, check_read_back, make_sent, read_stream_async
from .test_interop import user_records

pytestmark = pytest.mark.anyio


def _stream(prefix: str) -> str:
    return f"{prefix}-{random.randrange(1 << 32):08x}"  # in-process emulators share moto


async def _submit(
    producer: Producer,
    stream: str,
    uids: range,
    size: int,
    sent: dict[int, Sent],
    handles: list[PendingRecord],
) -> None:
    """Submit a record of ``size`` bytes for each uid (key ``k<uid>``), as fast as admission
    allows, noting what was sent and its handle."""
    for uid in uids:
        record = sent[uid] = make_sent(uid, f"k{uid}", size=size)
        handles.append(await producer.submit(stream, record.data, record.partition_key))


async def _read_back_everything(url: str, stream: str, sent: dict[int, Sent]) -> None:
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
    contents = await read_stream_async(client, stream)
    arrived = check_read_back(contents, sent)
    missing = set(sent) - set(arrived)
    assert not missing, f"{len(missing)} acknowledged records missing from {stream}"
    # AWS's deaggregator (the KCL's checks) reads every Kinesis record as ours does, the
    # pieces a throttled shard's aggregates were split into among them
    ours = [(u.decoded.partition_key, u.decoded.data) for u in contents.user_records()]
    theirs = [
        (key, data)
        for records in contents.kinesis_records.values()
        for record in records
        for key, _, data in user_records(record)[1]
    ]
    assert theirs == ours


@pytest.mark.timeout(120)
async def test_throttles_that_come_whatever_the_rate_expire_nothing() -> None:
    """A quarter of the records throttled at random, on a 2-shard stream: the first adaptive
    controller read this as congestion, cut every shard to its floor and let 44 % of 20,000
    records expire. Now everything is delivered, at (nearly) the static limiter's pace."""
    stream = _stream("noise")
    faults = Faults(record_throttle_rate=0.25, seed=7)
    with Emulator(streams={stream: 2}, faults=faults) as url:
        sent: dict[int, Sent] = {}
        async with Producer(region=REGION, endpoint_url=url, **CREDENTIALS) as producer:
            handles: list[PendingRecord] = []
            await _submit(producer, stream, range(6000), 800, sent, handles)
            await producer.flush()
            for handle in handles:
                assert_success(await handle)
            throttled = sum(
                s["injected_throttled_records"] for s in EmulatorClient(url).stats()["shards"]
            )
            assert throttled > 0  # the fault was on
        await _read_back_everything(url, stream, sent)


@pytest.mark.timeout(120)
async def test_after_a_storm_the_rate_is_back_within_three_seconds() -> None:
    """The shard's limit drops to 30 % for 3 s while a backlog waits: the producer cuts, then
    is back at >= 90 % of the rate it held before the storm within 3 s of the storm's end, and
    delivers all. That rate is the ceiling, unless a stray throttle cut it in the first phase
    (seen in CI: one throttled record 1.5 s in, and the rate held clean after it, 0.72 of the
    ceiling, became the one to return to)."""
    stream = _stream("storm")
    # its own process, as in the benchmarks: timing is what this test is about
    with spawn(streams={stream: 1}) as url:
        control = EmulatorClient(url)
        sent: dict[int, Sent] = {}
        rates: list[tuple[float, float]] = []
        async with Producer(region=REGION, endpoint_url=url, **CREDENTIALS) as producer:
            handles: list[PendingRecord] = []
            # 5 s at the shard's limit first: a rate held clean (3 s) is what it climbs back to
            await _submit(producer, stream, range(5000), 1000, sent, handles)
            await producer.flush()
            before = producer.statistics().streams[stream].shards
            held = min(shard.rate[1] / shard.ceiling[1] for shard in before.values())
            assert held >= 0.5, f"the first phase was not at the shard's limit: {before}"
            await anyio.to_thread.run_sync(
                lambda: control.storm(stream, duration=3.0, factor=0.3, start=0.0)
            )
            storm_end = anyio.current_time() + 3.0

            async def watch() -> None:
                while True:
                    shards = producer.statistics().streams[stream].shards
                    for shard in shards.values():
                        rates.append((anyio.current_time(), shard.rate[1] / shard.ceiling[1]))
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                # 10 MB: 3 s at 30 % of 1 MiB/s, then about 9 s at the full rate (records
                # stay queued well past the 3 s the rate has to come back in, so that the
                # samples see it: with 7 MB, trio runs in CI sometimes drained first)
                await _submit(producer, stream, range(5000, 15000), 1000, sent, handles)
                await producer.flush()
                tg.cancel_scope.cancel()
            after = producer.statistics().streams[stream].shards
            for handle in handles:
                assert_success(await handle)
        trace = " ".join(f"{t - storm_end:+.2f}:{rate:.2f}" for t, rate in rates[::4])
        assert min(rate for _, rate in rates) < 0.6, f"it never cut during the storm: {trace}"
        back = [t for t, rate in rates if t >= storm_end and rate >= 0.9 * held]
        assert back, f"the rate never came back to 90 % of {held:.2f}: {before} {after} {trace}"
        assert back[0] - storm_end <= 3.0, back[0] - storm_end
        await _read_back_everything(url, stream, sent)


@pytest.mark.timeout(120)
async def test_overload_waits_at_the_call_and_expires_nothing() -> None:
    """Offered five times a 1-shard stream's capacity for 6 s with a 6 s TTL: ``submit``
    waits (backpressure at the call), the stream never holds more than it can send in
    ``max_outstanding_time`` (3 s here), and every admitted record is delivered."""
    stream = _stream("overload")
    with spawn(streams={stream: 1}) as url:  # its own process and moto state
        sent: dict[int, Sent] = {}
        waits: list[float] = []
        peak_bytes = 0
        async with Producer(
            region=REGION, endpoint_url=url, record_ttl=6.0, **CREDENTIALS
        ) as producer:
            handles: list[PendingRecord] = []
            size, offered = 1000, 5 * 1024 * 1024  # bytes per second
            start = anyio.current_time()
            uid = 0
            while anyio.current_time() - start < 6.0:
                due = int((anyio.current_time() - start) * offered / size)
                while uid < due and anyio.current_time() - start < 6.0:
                    record = sent[uid] = make_sent(uid, f"k{uid}", size=size)
                    before = anyio.current_time()
                    handles.append(await producer.submit(stream, record.data, record.partition_key))
                    waits.append(anyio.current_time() - before)
                    uid += 1
                stats = producer.statistics().streams.get(stream)
                if stats is not None:
                    peak_bytes = max(peak_bytes, stats.outstanding_bytes)
                await anyio.sleep(0.01)
            limit = producer.statistics().streams[stream].backlog_limit[1]
            await producer.flush()
            for handle in handles:
                assert_success(await handle)  # nothing expired
        assert sum(waits) > 2.0  # the overload showed at the call: seconds of the 6 s waiting
        assert uid < 6.0 * offered / size / 2  # far less was admitted than offered
        # at most 3 s of a shard's 1 MiB/s held (and a record over, as it is admitted)
        assert peak_bytes <= 3.0 * 1024 * 1024 + 2 * size
        assert limit == pytest.approx(3.0 * 1024 * 1024, rel=0.05)
        await _read_back_everything(url, stream, sent)


def _keys_by_shard(url: str, stream: str) -> list[str]:
    """One partition key per shard of ``stream``, in the order of its shards' hash ranges."""
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
    shards = client.list_shards(StreamName=stream)["Shards"]
    ranges = sorted(
        (int(s["HashKeyRange"]["StartingHashKey"]), int(s["HashKeyRange"]["EndingHashKey"]))
        for s in shards
    )
    keys: list[str] = []
    n = 0
    for low, high in ranges:
        while not low <= hash_of(f"key-{n}") <= high:
            n += 1
        keys.append(f"key-{n}")
    return keys


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "limit",
    [
        # the hot shard's own backlog limit binds (2 s of it, so that it fills within the run)
        {"max_outstanding_time": 2.0},
        # the producer's cap binds: the hot shard stops at its fair share of it
        {"max_outstanding_records": 3000},
    ],
    ids=["shard-backlog", "producer-cap"],
)
async def test_a_hot_key_makes_only_its_own_callers_wait(limit: dict[str, float]) -> None:
    """One key offered three times its shard's byte limit, three others a quarter of theirs,
    on a 4-shard stream for 4 s: the hot key's callers wait at the call; the cold keys' never
    wait for room (they waited up to 10 s when admission was per stream), their offer is
    admitted on time, and every admitted record is delivered, none expired."""
    stream = _stream("hotkey")
    with spawn(streams={stream: 4}) as url:
        hot_key, *cold_keys = await anyio.to_thread.run_sync(_keys_by_shard, url, stream)
        sent: dict[int, Sent] = {}
        handles: list[PendingRecord] = []
        waits: dict[str, list[float]] = {key: [] for key in (hot_key, *cold_keys)}
        offered: dict[str, int] = {}
        duration, size = 4.0, 1000
        uids = iter(range(1 << 30))
        async with Producer(region=REGION, endpoint_url=url, **limit, **CREDENTIALS) as producer:

            async def put(key: str) -> None:
                uid = next(uids)
                record = sent[uid] = make_sent(uid, key, size=size)
                before = anyio.current_time()
                handles.append(await producer.submit(stream, record.data, record.partition_key))
                waits[key].append(anyio.current_time() - before)

            async def offer(key: str, per_second: float, catch_up: bool = False) -> None:
                start = anyio.current_time()
                while (elapsed := anyio.current_time() - start) < duration:
                    due = int(elapsed * per_second)
                    while len(waits[key]) < due and anyio.current_time() - start < duration:
                        await put(key)
                    await anyio.sleep(0.01)
                offered[key] = int(duration * per_second)
                if catch_up:
                    # A cold key puts the rest of its offer too: on a busy 2-core machine its
                    # loop can fall a few per cent behind its schedule (the event loop is busy,
                    # not the shard). How late its last record was admitted is what counts.
                    while len(waits[key]) < offered[key]:
                        await put(key)
                    late[key] = anyio.current_time() - start - duration

            late: dict[str, float] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(offer, hot_key, 3 * 1024 * 1024 / size)
                for key in cold_keys:
                    tg.start_soon(offer, key, 1024 * 1024 / 4 / size, True)
            shards = producer.statistics().streams[stream].shards
            await producer.flush()
            for handle in handles:
                assert_success(await handle)  # nothing expired
        admission_waits = {shard: stats.admission_waits for shard, stats in shards.items()}
        hot_shard = max(admission_waits, key=admission_waits.__getitem__)
        for shard, count in admission_waits.items():
            if shard != hot_shard:
                # A quiet shard never waits for the hot one's backlog. Behind the producer's
                # cap it may wait now and then, when its own records in flight pass its part
                # of the reserve (a slow response from the emulator, or a busy machine): rarely
                # (11 of 1,048 records once in CI, for each cold shard), and briefly (the
                # bars on the cold keys' waits below).
                allowed = 0 if "max_outstanding_time" in limit else 0.03 * offered[cold_keys[0]]
                assert count <= allowed, admission_waits
        # the overload showed at the hot calls
        assert len(waits[hot_key]) < 0.8 * offered[hot_key]
        assert sum(waits[hot_key]) > 1.0
        for key in cold_keys:
            # the whole offer admitted, the last of it at most half a second after its time
            assert len(waits[key]) == offered[key], (key, len(waits[key]), offered[key])
            assert late[key] < 0.5, (key, late[key])
            assert max(waits[key]) < 0.5, (key, max(waits[key]))
        await _read_back_everything(url, stream, sent)
