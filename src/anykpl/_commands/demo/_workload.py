"""What the devices send: the :class:`Workload` the options describe, and the readings of a
:class:`DeviceGroup` as they fall due.

Synchronous and clock-free, so it is tested without an event loop: a group is given the seconds
since the start and answers with what fell due by then. Putting the readings into a producer is
:mod:`anykpl._commands.demo._putting`'s job.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ("BURST_FRACTION", "DeviceGroup", "Workload", "device_name", "run_prefix")

#: The share of devices that send alert readings in a burst.
BURST_FRACTION = 0.1


@dataclass(frozen=True)
class Workload:
    """What the devices send.

    Attributes:
        devices: number of devices; device 42's partition key is ``dev-00042``.
        rate: readings per device per second (each device at a steady cadence, with a random
            phase so the fleet's readings spread evenly over time).
        duration: seconds the devices send.
        burst_every: seconds between bursts (0: no bursts). Bursts fall halfway through each
            period: at 5 s, 15 s, 25 s for 10 s.
        burst_size: alert readings each bursting device sends at once.
        aggregation: whether the producer aggregates.
        run_id: tags every reading, so that a stream holding earlier runs can be read back.
    """

    devices: int = 5000
    rate: float = 0.8
    duration: float = 30.0
    burst_every: float = 10.0
    burst_size: int = 5
    aggregation: bool = True
    run_id: str = "00000000"

    @property
    def steady_rate(self) -> float:
        """Readings per second from the steady cadence alone."""
        return self.devices * self.rate

    def describe(self) -> str:
        """One line for the top of the demo's output."""
        bursts = (
            f" + every {self.burst_every:g} s {BURST_FRACTION:.0%} of them send "
            f"{self.burst_size} alerts"
            if self.burst_every and self.burst_size
            else ""
        )
        return (
            f"{self.devices:,} devices × {self.rate:g} readings/s "
            f"(≈{self.steady_rate:,.0f} readings/s){bursts}, for {self.duration:g} s"
        )


def device_name(index: int) -> str:
    """The partition key of device ``index``: ``dev-00042``."""
    return f"dev-{index:05d}"


class DeviceGroup:
    """The readings of a group of devices: a steady cadence per device, plus bursts.

    Synchronous and clock-free: :meth:`take_due` is given the seconds since the start and
    returns what fell due by then, and :meth:`next_due` says when to ask again. A reading is
    ``(partition_key, data)`` with data like::

        {"run":"1f2e3d4c","device":"dev-00042","seq":17,"ts":1718000000.123,
         "temp":21.37,"hum":40.2,"kind":"reading"}

    ``seq`` counts each device's readings from 0, so ``(device, seq)`` names a reading. A
    device that falls behind (the producer pushing back) catches up: every reading due is
    sent, none is skipped.
    """

    def __init__(
        self,
        devices: Sequence[int],
        workload: Workload,
        rng: random.Random | None = None,
        *,
        pad: int = 0,
    ) -> None:
        """``pad``: characters of filler in each reading (a ``"blob"`` field), for devices that
        send more than a small reading."""
        self._workload = workload
        self._blob = f',"blob":"{"x" * pad}"' if pad else ""
        self._rng = rng or random.Random()
        self._devices = list(devices)
        self._names = {index: device_name(index) for index in self._devices}
        self._interval = 1.0 / workload.rate
        self._seq = dict.fromkeys(self._devices, 0)
        # a room temperature and humidity per device, so the series look like sensors
        self._base = {
            index: (self._rng.uniform(18.0, 26.0), self._rng.uniform(30.0, 60.0))
            for index in self._devices
        }
        self._prefix = run_prefix(workload.run_id).decode() + '"device":"'
        self._due = [(self._rng.uniform(0.0, self._interval), index) for index in self._devices]
        heapq.heapify(self._due)
        bursts = workload.burst_every > 0 and workload.burst_size > 0
        self._next_burst = workload.burst_every / 2 if bursts else math.inf
        self._bursting = max(1, round(len(self._devices) * BURST_FRACTION))

    def next_due(self) -> float:
        """Seconds since the start at which the next reading falls due."""
        steady = self._due[0][0] if self._due else math.inf
        return min(steady, self._next_burst)

    def take_due(self, elapsed: float, wall_time: float) -> list[tuple[str, bytes]]:
        """Every reading due by ``elapsed`` seconds since the start, stamped ``wall_time``."""
        readings: list[tuple[str, bytes]] = []
        due = self._due
        while due and due[0][0] <= elapsed:
            when, index = due[0]
            readings.append(self._reading(index, wall_time, elapsed, "reading"))
            heapq.heapreplace(due, (when + self._interval, index))
        if elapsed >= self._next_burst:
            for index in self._rng.sample(self._devices, self._bursting):
                for _ in range(self._workload.burst_size):
                    readings.append(self._reading(index, wall_time, elapsed, "alert"))
            self._next_burst += self._workload.burst_every
        return readings

    def _reading(
        self, index: int, wall_time: float, elapsed: float, kind: str
    ) -> tuple[str, bytes]:
        name = self._names[index]
        seq = self._seq[index]
        self._seq[index] = seq + 1
        base_temperature, base_humidity = self._base[index]
        swing = math.sin(elapsed / 60.0 * math.tau + index)
        temperature = base_temperature + 1.5 * swing + self._rng.uniform(-0.1, 0.1)
        if kind == "alert":
            temperature += 8.0
        humidity = base_humidity - 3.0 * swing
        data = (
            f'{self._prefix}{name}","seq":{seq},"ts":{wall_time:.3f},'
            f'"temp":{temperature:.2f},"hum":{humidity:.1f},"kind":"{kind}"{self._blob}}}'
        )
        return name, data.encode()


def run_prefix(run_id: str) -> bytes:
    """The bytes every reading of run ``run_id`` starts with."""
    return f'{{"run":"{run_id}",'.encode()
