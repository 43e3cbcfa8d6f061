"""``anykpl demo --chaos``: trouble on a schedule, told to the emulator while the devices send.

Four things go wrong, one after another, at fixed shares of the run (at 6, 20, 33 and 42 s of
the default 60):

- **a throttle storm**: the first shard's limits cut to a tenth for a fifth of the run (the
  emulator's ``storm``);
- **a hot device**: one more device, whose key falls on the third shard, sends 1,500
  readings/s of about 1 KiB for a sixth of the run, half as much again as its shard takes;
- **a shard split**: the second shard split at the middle of its hash range (``reshard``), so
  its keys move to two new shards while records are in flight;
- **connection resets**: for a tenth of the run 30 % of write requests have their connection
  reset with no answer, half of them after their records were stored (``faults``).

With fewer than three shards the storm, the split and the hot device share shards. Each is
announced as it happens (the views show the announcements), and kept, with the time it
happened, for the report, the JSON document and the timeline plot. The storm and the resets end
by themselves; their ends are announced too. The hot device is the putting side's job
(:func:`anykpl._commands.demo._putting.produce` runs it from :attr:`Chaos.hot`); this module
only says when and what.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._workload import device_name

__all__ = ("CHAOS_DURATION", "Chaos", "ChaosEvent", "HotKey", "shard_of")

#: ``--chaos`` runs this long unless ``--duration`` says otherwise (seconds)
CHAOS_DURATION = 60.0
#: the storm's cut: the shard keeps this share of its limits
STORM_FACTOR = 0.1
#: the share of write requests reset while the resets last
RESET_RATE = 0.3
#: the hot device's readings per second, and the filler in each (about 1 KiB a reading)
HOT_RATE = 1500.0
HOT_PAD = 900


def shard_name(index: int) -> str:
    """The id the emulator (and Kinesis) gives the ``index``-th shard of a new stream."""
    return f"shardId-{index:012d}"


def shard_of(key: str, shards: int) -> int:
    """The shard of a new stream of ``shards`` evenly split shards that ``key`` falls on."""
    digest = int.from_bytes(hashlib.md5(key.encode(), usedforsecurity=False).digest(), "big")
    return digest * shards >> 128


@dataclass(frozen=True)
class HotKey:
    """One more device that sends far more than the others, for a while."""

    device: int
    key: str
    shard_id: str
    start: float
    duration: float
    rate: float = HOT_RATE
    pad: int = HOT_PAD


@dataclass(frozen=True)
class ChaosEvent:
    """One announcement at ``at`` seconds since the start; ``apply`` (if any) tells the
    emulator."""

    at: float
    text: str
    apply: Callable[[Any], object] | None = None


class Chaos:
    """The plan for a run of ``duration`` seconds of ``stream`` (``shards`` shards, the
    fleet's devices numbered below ``devices``), and what happened of it."""

    def __init__(self, stream: str, shards: int, devices: int, duration: float) -> None:
        self.stream = stream
        self.duration = duration
        storm_shard = shard_name(0)
        split_shard = shard_name(1 % shards)
        hot_shard = 2 % shards
        device = devices
        while shard_of(device_name(device), shards) != hot_shard:
            device += 1
        self.hot = HotKey(
            device,
            device_name(device),
            shard_name(hot_shard),
            start=round(0.33 * duration, 3),
            duration=round(duration / 6, 3),
        )
        hot = self.hot
        storm_at, storm_for = 0.1 * duration, 0.2 * duration
        resets_at, resets_for = 0.7 * duration, 0.1 * duration

        def storm(client: Any) -> None:
            client.storm(stream, duration=storm_for, factor=STORM_FACTOR, shard_id=storm_shard)

        def split(client: Any) -> None:
            client.reshard(stream, "split", shard_id=split_shard)

        def resets(rate: float) -> Callable[[Any], object]:
            return lambda client: client.set_faults(reset_rate=rate)

        self.plan = [
            ChaosEvent(
                storm_at,
                f"throttle storm: {storm_shard} cut to {STORM_FACTOR:.0%} of its limits "
                f"for {storm_for:g} s",
                storm,
            ),
            ChaosEvent(storm_at + storm_for, f"storm over: {storm_shard} back to its limits"),
            ChaosEvent(
                hot.start,
                f"hot device: {hot.key} ({hot.shard_id}) sends {hot.rate:,.0f} readings/s "
                f"of about 1 KiB for {hot.duration:g} s",
            ),
            ChaosEvent(hot.start + hot.duration, f"hot device {hot.key} back to normal"),
            ChaosEvent(
                0.55 * duration,
                f"shard split: {split_shard} split in two at the middle of its hash range",
                split,
            ),
            ChaosEvent(
                resets_at,
                f"connection resets: {RESET_RATE:.0%} of write requests reset for {resets_for:g} s",
                resets(RESET_RATE),
            ),
            ChaosEvent(resets_at + resets_for, "connection resets stop", resets(0.0)),
        ]
        self.plan.sort(key=lambda event: event.at)
        #: (seconds since the start, announcement) of each event that happened, in order
        self.happened: list[tuple[float, str]] = []

    async def run(self, url: str, start: float) -> None:
        """Tell the emulator at ``url`` each event at its time (``start`` is the loop's time
        at which the devices started)."""
        import anyio
        import anyio.to_thread

        from anykpl.emulator import EmulatorClient

        client = EmulatorClient(url)
        for event in self.plan:
            await anyio.sleep_until(start + event.at)
            text = event.text
            if event.apply is not None:
                try:
                    await anyio.to_thread.run_sync(event.apply, client)
                except Exception as exc:  # the demo goes on; the announcement says so
                    text = f"{text} (the emulator refused: {exc})"
            self.happened.append((anyio.current_time() - start, text))

    def describe(self) -> str:
        """One line for the top of the demo's output."""
        return (
            "chaos: a throttle storm, a hot device, a shard split and connection resets, "
            "each announced as it happens"
        )
