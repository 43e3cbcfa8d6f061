"""The demo's only async part: the devices' readings through a :class:`~anykpl.Producer`, and
the results into a :class:`~anykpl._commands.demo._bookkeeping.Tally`.

:func:`produce` runs one putting task and one acknowledging task per :data:`GROUP_SIZE` devices,
a task that refreshes the progress view, and (with the emulator) one that polls the emulator's
statistics. The readings come from :mod:`anykpl._commands.demo._workload` and the counting is
:mod:`anykpl._commands.demo._bookkeeping`'s; this module only moves readings into the producer
and results into the tally, and hands back a :class:`RunReport` for the final report.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ... import errors
from ._bookkeeping import RATE_WINDOW, Tally, shard_rates_from_emulator
from ._views import REFRESH_EVERY, Progress, ProgressView
from ._workload import DeviceGroup, Workload

if TYPE_CHECKING:
    from anykpl import PendingRecord, Producer

    from ._chaos import Chaos
    from ._target import Target
    from ._timeline import Timeline

__all__ = ("ACKNOWLEDGE_BATCH", "GROUP_SIZE", "TICK", "EmulatorStats", "RunReport", "produce")

#: Devices per putting task: one task per group keeps the task count small (50 for 5,000
#: devices) while every group still puts concurrently with the others.
GROUP_SIZE = 100
#: A group wakes at most this often; readings that fall due in between go out together.
TICK = 0.02
#: An acknowledging task lets the others run after this many readings in a row.
ACKNOWLEDGE_BATCH = 256


@dataclass
class RunReport:
    """What :func:`produce` hands back: the tally and the producer's last counters."""

    tally: Tally
    elapsed: float
    throttled: int
    retried: int
    errors_by_code: Mapping[str, int]
    throttled_by_shard: Mapping[str, int]


class EmulatorStats:
    """The emulator's latest ``stats()``, polled from a worker thread while the demo runs."""

    def __init__(self, url: str) -> None:
        from anykpl.emulator import EmulatorClient

        self._client = EmulatorClient(url)
        self.latest: Mapping[str, Any] | None = None
        #: the loop's time when :attr:`latest` was taken (the middle of the call)
        self.fetched_at = 0.0

    def fetch(self) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._client.stats()
        return stats

    async def poll(self, period: float) -> None:
        """Refresh :attr:`latest` every ``period`` seconds. A failed call leaves it None, and
        the view falls back to the producer's own measurements until a call succeeds."""
        import anyio.to_thread

        while True:
            try:
                asked = anyio.current_time()
                self.latest = await anyio.to_thread.run_sync(self.fetch)
                # the statistics were taken between the two: the midpoint is the best guess
                self.fetched_at = (asked + anyio.current_time()) / 2
            except Exception:
                self.latest = None
            await anyio.sleep(period)


def _throttled_by_shard(statistics: Any, stream: str) -> dict[str, int]:
    """Throttled Kinesis records per (predicted) shard of ``stream``, from the producer's
    metrics."""
    return {
        key.shard: int(count)
        for key, count in statistics.metrics.items()
        if key.name == "ErrorsByCode"
        and key.error_code == errors.THROTTLED
        and key.stream == stream
        and key.shard is not None
    }


#: What a putting task hands its acknowledging task: when ``submit`` was called, when it
#: returned, the reading, and its handle.
_InFlight = tuple[float, float, str, bytes, "PendingRecord"]


def _throttled_and_retried(statistics: Any) -> tuple[int, int]:
    """Throttled Kinesis records and retried user records, from ``producer.statistics()``."""
    from anykpl import MetricKey

    throttled = int(statistics.errors_by_code.get(errors.THROTTLED, 0))
    retried = int(statistics.metrics.get(MetricKey("RetriesPerRecord"), 0))
    return throttled, retried


async def produce(
    target: Target,
    workload: Workload,
    view: ProgressView,
    *,
    rng: random.Random | None = None,
    emulator_stats: EmulatorStats | None = None,
    chaos: Chaos | None = None,
    timeline: Timeline | None = None,
) -> RunReport:
    """Run ``workload`` through a :class:`~anykpl.Producer` into ``target``; return the tally.

    One task per :data:`GROUP_SIZE` devices submits the readings as they fall due and hands
    each :class:`~anykpl.PendingRecord` to the group's acknowledging task, which awaits them in
    order. A record's put latency is measured from the call to ``submit`` to the end of its
    last attempt: the admission wait plus the sum of its attempts' ``delay`` and ``duration``,
    which add up to the time from admission to the end of the final PutRecords call.

    With ``chaos`` (the emulator's ``target`` only), its events are told to the emulator on
    schedule and its hot device sends from a task of its own; ``timeline`` is noted on every
    refresh.
    """
    import anyio
    import anyio.lowlevel
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from anykpl import Producer, ProducerConfig

    rng = rng or random.Random()
    tally = Tally()
    config = ProducerConfig(
        region=target.region,
        endpoint_url=target.endpoint_url,
        aggregation_enabled=workload.aggregation,
        aws_access_key_id=target.credentials.get("aws_access_key_id"),
        aws_secret_access_key=target.credentials.get("aws_secret_access_key"),
        verify_certificate=target.verify_certificate,
        ca_bundle=target.ca_bundle,
    )
    indexes = list(range(workload.devices))
    groups = [
        DeviceGroup(indexes[i : i + GROUP_SIZE], workload, random.Random(rng.random()))
        for i in range(0, workload.devices, GROUP_SIZE)
    ]
    stream = target.stream
    clock = anyio.current_time

    # Per-record times come from perf_counter: only differences and offsets from the start
    # are used, and anyio.current_time (which looks the backend up on every call) would cost
    # more than the rest of the demo's work per reading. The schedule uses the loop's clock.
    perf_counter = time.perf_counter

    async with Producer(config) as producer:
        start = clock()
        perf_start = perf_counter()

        async def emit(
            group: DeviceGroup,
            handles: MemoryObjectSendStream[_InFlight],
            begin: float = 0.0,
            length: float = workload.duration,
        ) -> None:
            # the group's readings from ``begin`` seconds after the start, for ``length`` s
            async with handles:
                while True:
                    wake = min(group.next_due(), length)
                    await anyio.sleep_until(start + begin + wake)
                    elapsed = clock() - start - begin
                    if elapsed >= length:
                        return
                    readings = group.take_due(elapsed, time.time())
                    tally.offered(len(readings))
                    called = perf_counter()
                    for key, data in readings:
                        pending = await producer.submit(stream, data, partition_key=key)
                        admitted = perf_counter()
                        handles.send_nowait((called, admitted, key, data, pending))
                        called = admitted  # the next call starts as this one returns
                    # at most one wake-up per tick, however the readings fall
                    await anyio.sleep_until(start + begin + elapsed + TICK)

        async def acknowledge(handles: MemoryObjectReceiveStream[_InFlight]) -> None:
            # Takes what is queued without waiting and reads done records without awaiting
            # them: a checkpoint per reading would cost an event loop turn each. It yields
            # every ACKNOWLEDGE_BATCH readings instead.
            async with handles:
                taken = 0
                while True:
                    try:
                        called, admitted, key, data, pending = handles.receive_nowait()
                    except anyio.WouldBlock:
                        try:
                            called, admitted, key, data, pending = await handles.receive()
                        except anyio.EndOfStream:
                            return
                    except anyio.EndOfStream:
                        return
                    try:
                        result = pending.result() if pending.done() else await pending.wait()
                    except errors.RecordFailedError as exc:
                        tally.failed((key, data), exc.error_code)
                        continue
                    latency = admitted - called
                    for attempt in result.attempts:
                        latency += attempt.delay + attempt.duration
                    tally.acknowledged(
                        (key, data), result.shard_id, latency, called + latency - perf_start
                    )
                    taken += 1
                    if taken % ACKNOWLEDGE_BATCH == 0:
                        await anyio.lowlevel.checkpoint()

        events = chaos.happened if chaos is not None else []

        def refresh(*, finished: bool = False) -> None:
            elapsed = clock() - start
            progress = _progress(
                producer, tally, elapsed, workload, emulator_stats, stream, events, finished
            )
            view.update(progress)
            if timeline is not None:
                latest = emulator_stats.latest if emulator_stats is not None else None
                timeline.note(
                    elapsed,
                    outstanding=progress.outstanding,
                    throttled=progress.throttled,
                    retried=progress.retried,
                    offered_rate=progress.offered_rate,
                    acknowledged_rate=progress.acknowledged_rate,
                    stats=latest,
                    stats_elapsed=(
                        None if emulator_stats is None else emulator_stats.fetched_at - start
                    ),
                    shard_rates=progress.shards if progress.measured_by == "producer" else (),
                )

        async def show() -> None:
            while True:
                refresh()
                await anyio.sleep(REFRESH_EVERY)

        async with anyio.create_task_group() as around:
            if emulator_stats is not None:
                around.start_soon(emulator_stats.poll, REFRESH_EVERY)
            around.start_soon(show)
            if chaos is not None:
                assert target.endpoint_url is not None
                around.start_soon(chaos.run, target.endpoint_url, start)
            async with anyio.create_task_group() as devices:
                for group in groups:
                    send, receive = anyio.create_memory_object_stream[_InFlight](math.inf)
                    devices.start_soon(emit, group, send)
                    devices.start_soon(acknowledge, receive)
                if chaos is not None:
                    hot = chaos.hot
                    group = DeviceGroup(
                        [hot.device],
                        replace(workload, rate=hot.rate, burst_every=0.0),
                        random.Random(rng.random()),
                        pad=hot.pad,
                    )
                    send, receive = anyio.create_memory_object_stream[_InFlight](math.inf)
                    devices.start_soon(emit, group, send, hot.start, hot.duration)
                    devices.start_soon(acknowledge, receive)
            around.cancel_scope.cancel()
        elapsed = clock() - start
        refresh(finished=True)
        statistics = producer.statistics()
    throttled, retried = _throttled_and_retried(statistics)
    return RunReport(
        tally,
        elapsed,
        throttled,
        retried,
        dict(statistics.errors_by_code),
        _throttled_by_shard(statistics, stream),
    )


def _progress(
    producer: Producer,
    tally: Tally,
    elapsed: float,
    workload: Workload,
    emulator_stats: EmulatorStats | None,
    stream: str,
    events: list[tuple[float, str]],
    finished: bool = False,
) -> Progress:
    statistics = producer.statistics()
    throttled, retried = _throttled_and_retried(statistics)
    offered_rate, acknowledged_rate = tally.sample_rates(elapsed)
    p50, p99 = tally.recent_percentiles(elapsed)
    window = round(RATE_WINDOW)
    if emulator_stats is not None and emulator_stats.latest is not None:
        shards = shard_rates_from_emulator(emulator_stats.latest, stream, window)
        measured_by = "emulator"
    else:
        throttled_by_shard = _throttled_by_shard(statistics, stream)
        shards = [
            replace(rate, throttled=throttled_by_shard.get(rate.shard_id, 0))
            for rate in tally.shard_rates(elapsed, window)
        ]
        measured_by = "producer"
    return Progress(
        elapsed=elapsed,
        duration=workload.duration,
        offered_rate=offered_rate,
        acknowledged_rate=acknowledged_rate,
        acknowledged=tally.acknowledged_count,
        failed=tally.failed_count,
        outstanding=statistics.outstanding_records,
        throttled=throttled,
        retried=retried,
        p50=p50,
        p99=p99,
        shards=shards,
        measured_by=measured_by,
        finished=finished,
        events=list(events),
    )
