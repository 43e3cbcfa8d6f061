"""A run as it went, second by second: each shard's rate against its ceiling, the producer's
backlog, throttles and retries, and the injected events; kept as JSON and drawn as a picture.

:class:`Timeline` collects while the demo runs (:meth:`Timeline.note` on every refresh of the
view: the producer's figures, and each shard's limits from the emulator's latest statistics)
and once after it (:meth:`Timeline.finish`: each shard's stored and throttled records per
second, from the emulator's own per-second counts, which are exact where polling is not).
:meth:`Timeline.to_json` is the ``timeline`` of ``anykpl demo --json``; :func:`plot` draws any
document of that shape (``benchmarks/delivery.py`` writes one too) with matplotlib, which is
imported only there (``pip install 'anykpl[bench]'``).

Times are seconds since the devices started. The emulator counts by seconds of its own uptime;
its uptime at the start (:attr:`Timeline.offset`) is taken from the first statistics fetched,
less the seconds since the start at which they were fetched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._bookkeeping import shard_number

if TYPE_CHECKING:
    from ._bookkeeping import ShardRate

__all__ = ("Timeline", "matplotlib_missing", "plot")

MIB = 1024 * 1024


class Timeline:
    """What :func:`plot` draws, collected while a run goes (module docstring)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        #: the emulator's uptime when the devices started, once known
        self.offset: float | None = None
        self._producer: dict[str, list[float]] = {
            "t": [],
            "outstanding": [],
            "throttled": [],
            "retried": [],
            "offered_rate": [],
            "acknowledged_rate": [],
        }
        self._limits: dict[str, list[tuple[float, float | None, float | None]]] = {}
        self._shards: dict[str, dict[str, list[float]]] = {}
        #: who measured the shards' rates: the emulator, or (without it) the producer
        self.measured_by = "producer"
        self._throttled: dict[str, tuple[float, int]] = {}  # the producer's count, per shard
        self.events: list[tuple[float, str]] = []

    def note(
        self,
        elapsed: float,
        *,
        outstanding: int,
        throttled: int,
        retried: int,
        offered_rate: float,
        acknowledged_rate: float,
        stats: Mapping[str, Any] | None = None,
        stats_elapsed: float | None = None,
        shard_rates: Sequence[ShardRate] = (),
    ) -> None:
        """The producer's figures at ``elapsed``, and the emulator's ``stats`` fetched at
        ``stats_elapsed`` (each shard's limits then). Without the emulator, ``shard_rates``
        (each shard's rate as the producer measured it lately) are the shards' series."""
        producer = self._producer
        producer["t"].append(round(elapsed, 3))
        producer["outstanding"].append(outstanding)
        producer["throttled"].append(throttled)
        producer["retried"].append(retried)
        producer["offered_rate"].append(round(offered_rate, 1))
        producer["acknowledged_rate"].append(round(acknowledged_rate, 1))
        if stats is None or stats_elapsed is None:
            if self.measured_by == "producer":
                self._note_producer_rates(elapsed, shard_rates)
            return
        self.measured_by = "emulator"
        if self.offset is None:
            self.offset = float(stats["uptime"]) - stats_elapsed
        for shard in stats["shards"]:
            if shard["stream"] != self.stream:
                continue
            limits = self._limits.setdefault(shard["shard_id"], [])
            point = (round(stats_elapsed, 3), shard.get("limit_records"), shard.get("limit_bytes"))
            if shard.get("open") is False:
                point = (point[0], None, None)  # closed: no ceiling of its own any more
            if not limits or limits[-1][1:] != point[1:]:
                limits.append(point)

    def _note_producer_rates(self, elapsed: float, shard_rates: Sequence[ShardRate]) -> None:
        for rate in shard_rates:
            series = self._shards.setdefault(
                rate.shard_id, {"t": [], "records": [], "bytes": [], "throttled": []}
            )
            then, count = self._throttled.get(rate.shard_id, (0.0, 0))
            self._throttled[rate.shard_id] = (elapsed, rate.throttled)
            series["t"].append(round(elapsed, 3))
            series["records"].append(round(rate.records_per_second, 1))
            series["bytes"].append(round(rate.bytes_per_second, 1))
            span = elapsed - then
            series["throttled"].append(round((rate.throttled - count) / span, 1) if span else 0.0)

    def finish(self, stats: Mapping[str, Any], elapsed: float) -> None:
        """Each shard's stored and throttled records per second from the emulator's final
        ``stats`` (the run lasted ``elapsed`` seconds)."""
        if self.offset is None:
            self.offset = float(stats["uptime"]) - elapsed
        self.measured_by = "emulator"
        offset = self.offset
        now = int(stats["uptime"])
        for shard in stats["shards"]:
            if shard["stream"] != self.stream:
                continue
            series: dict[str, list[float]] = {"t": [], "records": [], "bytes": [], "throttled": []}
            rows = {row[0]: row[1:4] for row in shard["per_second"]}
            if rows:
                # a second with no row is a second the shard stored nothing: a zero, not a gap
                last = max(rows) if shard.get("open") is False else max(max(rows), now)
                for second in range(min(rows), last + 1):
                    start = second - offset
                    if start < -1.0 or start > elapsed + 1.0:
                        continue
                    records, stored, throttled = rows.get(second, (0, 0, 0))
                    series["t"].append(round(start, 3))
                    series["records"].append(records)
                    series["bytes"].append(stored)
                    series["throttled"].append(throttled)
            self._shards[shard["shard_id"]] = series
            limits = self._limits.get(shard["shard_id"])
            if limits:
                limits.append((round(elapsed, 3), *limits[-1][1:]))

    def to_json(self) -> dict[str, Any]:
        """The document :func:`plot` draws."""
        return {
            "measured_by": self.measured_by,
            "shards": self._shards,
            "limits": {
                shard: [list(point) for point in points] for shard, points in self._limits.items()
            },
            "producer": self._producer,
            "events": [[round(at, 3), text] for at, text in self.events],
        }


def matplotlib_missing() -> str | None:
    """Why :func:`plot` cannot draw here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "the timeline plot needs matplotlib: pip install 'anykpl[bench]'"
    return None


def plot(timeline: Mapping[str, Any], path: str, title: str) -> None:
    """Draw ``timeline`` (:meth:`Timeline.to_json`'s shape) into the image file ``path`` (its
    suffix picks the format: .png, .svg, .pdf): each shard's stored MiB/s against its byte
    ceiling, the producer's backlog, throttled and retried records per second, and each event
    as a numbered line across all three."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    figure, (rates, backlog, trouble) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, height_ratios=(3, 1.4, 1.4)
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shards: Mapping[str, Mapping[str, Sequence[float]]] = timeline.get("shards", {})
    limits: Mapping[str, Sequence[Sequence[Any]]] = timeline.get("limits", {})
    for index, shard_id in enumerate(sorted(set(shards) | set(limits))):
        colour = colours[index % len(colours)]
        label = f"shard {shard_number(shard_id)}"
        series = shards.get(shard_id)
        if series and series["t"]:
            rates.plot(
                series["t"],
                [value / MIB for value in series["bytes"]],
                color=colour,
                label=label,
                drawstyle="steps-post",
            )
            trouble.plot(
                series["t"],
                series["throttled"],
                color=colour,
                drawstyle="steps-post",
                linewidth=1,
            )
        points = limits.get(shard_id, ())
        if any(point[2] is not None for point in points):
            # no ceiling (a closed shard): a gap in the line, which ends where the shard did
            rates.plot(
                [point[0] for point in points],
                [math.nan if point[2] is None else point[2] / MIB for point in points],
                color=colour,
                linestyle="--",
                linewidth=1,
                drawstyle="steps-post",
            )
    if timeline.get("measured_by", "emulator") == "emulator":
        rates.set_ylabel("stored MiB/s\n(dashed: ceiling)")
    else:
        rates.set_ylabel("acknowledged MiB/s\n(the producer's count)")
    if rates.get_legend_handles_labels()[0]:
        rates.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    producer = timeline.get("producer", {})
    times = producer.get("t", [])
    if times:
        backlog.plot(times, producer["outstanding"], color="black")
        retried = _per_second(times, producer["retried"])
        if retried:
            # user records, many to a throttled Kinesis record: an axis of their own
            again = trouble.twinx()
            again.plot(times[1:], retried, color="black", linestyle=":", linewidth=1)
            again.set_ylabel("user records\nretried/s (dotted)")
            again.set_ylim(bottom=0)
    backlog.set_ylabel("user records\noutstanding")
    trouble.set_ylabel("Kinesis records\nthrottled/s")
    trouble.set_xlabel("seconds since the start")
    for number, (at, _text) in enumerate(timeline.get("events", []), 1):
        for axes in (rates, backlog, trouble):
            axes.axvline(at, color="grey", linestyle="-", linewidth=0.8, alpha=0.6)
        rates.annotate(
            str(number),
            (at, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -12),
            textcoords="offset points",
            fontsize="small",
        )
    events = timeline.get("events", [])
    caption = "\n".join(f"{n}. {at:5.1f} s  {text}" for n, (at, text) in enumerate(events, 1))
    rates.set_title(title, loc="left", fontsize="medium")
    for axes in (rates, backlog, trouble):
        axes.grid(True, alpha=0.3)
        axes.set_ylim(bottom=0)
    if caption:
        figure.text(0.01, 0.005, caption, fontsize="small", family="monospace", va="bottom")
        figure.subplots_adjust(bottom=0.08 + 0.022 * len(events), top=0.95, hspace=0.12)
    figure.subplots_adjust(left=0.1, right=0.86)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _per_second(times: Sequence[float], counts: Sequence[float]) -> list[float]:
    """The rate of a running count between samples."""
    return [
        (counts[i] - counts[i - 1]) / (times[i] - times[i - 1]) if times[i] > times[i - 1] else 0.0
        for i in range(1, len(times))
    ]
