"""The progress the demo shows while the devices send: a :class:`Progress` snapshot, twice a
second, to one of three views.

:class:`LiveView` redraws a ``rich`` table on a terminal, :class:`PlainView` prints a line every
two seconds for logs and CI, :class:`NoView` shows nothing (``--quiet``). The views only format
what they are given; :mod:`anykpl._commands.demo._putting` builds each snapshot, and the command
(:mod:`anykpl._commands.demo`) picks the view that ``--progress`` and the terminal allow.
``rich`` is imported only when a live view draws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._bookkeeping import RATE_WINDOW, ShardRate, shard_number

__all__ = (
    "MIB",
    "PLAIN_EVERY",
    "REFRESH_EVERY",
    "LiveView",
    "NoView",
    "PlainView",
    "Progress",
    "ProgressView",
    "format_ms",
)

#: How often the views refresh.
REFRESH_EVERY = 0.5
#: How often the plain (non-terminal) progress prints a line.
PLAIN_EVERY = 2.0
#: The live view lists this many of the latest events.
EVENTS_SHOWN = 8
MIB = 1024 * 1024


@dataclass(frozen=True)
class Progress:
    """One refresh of the progress view.

    Attributes:
        elapsed: seconds since the devices started.
        duration: seconds the devices send.
        offered_rate: readings per second the devices handed to the producer, lately.
        acknowledged_rate: readings per second acknowledged, lately.
        acknowledged: readings acknowledged so far.
        failed: readings that failed so far.
        outstanding: readings admitted and not yet terminal.
        throttled: Kinesis records throttled so far (the producer's count).
        retried: user records retried so far.
        p50: median put latency of the readings acknowledged lately, in seconds.
        p99: 99th percentile of the same.
        shards: each shard's rate lately.
        measured_by: ``emulator`` or ``producer``, who measured :attr:`shards`.
        finished: whether this is the last refresh.
        events: what ``--chaos`` did so far: (seconds since the start, announcement).
    """

    elapsed: float
    duration: float
    offered_rate: float
    acknowledged_rate: float
    acknowledged: int
    failed: int
    outstanding: int
    throttled: int
    retried: int
    p50: float | None
    p99: float | None
    shards: list[ShardRate] = field(default_factory=list)
    measured_by: str = "producer"
    finished: bool = False
    events: list[tuple[float, str]] = field(default_factory=list)


class ProgressView(Protocol):
    """Shows :class:`Progress` as it comes, twice a second."""

    def update(self, progress: Progress) -> None: ...


class NoView:
    def update(self, progress: Progress) -> None:
        pass


def format_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _share(value: float, limit: float | None) -> str:
    return "" if not limit else f"{value / limit:4.0%}"


class PlainView:
    """A line every :data:`PLAIN_EVERY` seconds, for logs and CI, and a line for each event
    as soon as it is seen."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._next = PLAIN_EVERY
        self._told = 0  # events printed

    def update(self, progress: Progress) -> None:
        for at, text in progress.events[self._told :]:
            self._write(f"[{at:5.1f} s] >> {text}")
        self._told = max(self._told, len(progress.events))
        if progress.elapsed < self._next and not progress.finished:
            return
        self._next = progress.elapsed + PLAIN_EVERY - REFRESH_EVERY / 2
        # each value after its shard's number: a split closes one shard and adds two
        shards = " ".join(
            f"{shard_number(rate.shard_id)}:{rate.bytes_per_second / MIB:.2f}"
            for rate in progress.shards
        )
        records = " ".join(
            f"{shard_number(rate.shard_id)}:{rate.records_per_second:,.0f}"
            for rate in progress.shards
        )
        self._write(
            f"[{progress.elapsed:5.1f} s] offered {progress.offered_rate:,.0f}/s  "
            f"acknowledged {progress.acknowledged_rate:,.0f}/s ({progress.acknowledged:,})  "
            f"failed {progress.failed:,}  throttled {progress.throttled:,}  "
            f"retried {progress.retried:,}  "
            f"p50 {format_ms(progress.p50)}  p99 {format_ms(progress.p99)}  "
            f"| per shard MiB/s: {shards or '-'}, records/s: {records or '-'}"
        )


def _bar(share: float, width: int = 20) -> tuple[str, str]:
    """A text bar for ``share`` of a limit and its colour."""
    filled = min(width, round(share * width))
    colour = "green" if share < 0.8 else "yellow" if share < 1.0 else "red"
    return "█" * filled + "░" * (width - filled), colour


class LiveView:
    """A ``rich`` live table, redrawn on every update (about twice a second)."""

    def __init__(self, live: Any, title: str) -> None:
        self._live = live
        self._title = title

    def update(self, progress: Progress) -> None:
        self._live.update(self.render(progress), refresh=True)

    def render(self, progress: Progress) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        done = min(1.0, progress.elapsed / progress.duration)
        bar, _ = _bar(done, 40)
        if progress.finished:
            state = " done"
        elif progress.elapsed >= progress.duration:
            state = " waiting for the last results"
        else:
            state = ""
        header = Text.assemble(
            (self._title, "bold"),
            "\n",
            (bar, "cyan"),
            f" {progress.elapsed:5.1f} s / {progress.duration:g} s{state}",
        )
        figures = Table.grid(padding=(0, 2))
        figures.add_column(style="dim")
        figures.add_column(justify="right")
        figures.add_column(style="dim")
        figures.add_column(justify="right")
        figures.add_row(
            "readings offered",
            f"{progress.offered_rate:,.0f}/s",
            "acknowledged",
            f"{progress.acknowledged:,}",
        )
        figures.add_row(
            "readings acknowledged",
            f"{progress.acknowledged_rate:,.0f}/s",
            "outstanding",
            f"{progress.outstanding:,}",
        )
        figures.add_row(
            "put latency p50", format_ms(progress.p50), "failed", f"{progress.failed:,}"
        )
        figures.add_row(
            "put latency p99", format_ms(progress.p99), "throttled", f"{progress.throttled:,}"
        )
        figures.add_row("", "", "retried", f"{progress.retried:,}")
        kind = "Kinesis records/s" if progress.measured_by == "emulator" else "user records/s"
        shards = Table(
            title=f"per shard, last {RATE_WINDOW:g} s (measured by the {progress.measured_by})",
            title_justify="left",
            expand=False,
        )
        shards.add_column("shard")
        shards.add_column("MiB/s", justify="right")
        shards.add_column("of the byte limit")
        shards.add_column(kind, justify="right")
        shards.add_column("throttled", justify="right")
        for rate in progress.shards:
            if rate.limit_bytes:
                share = rate.bytes_per_second / rate.limit_bytes
                shard_bar, colour = _bar(share)
                against = Text.assemble((shard_bar, colour), f" {share:4.0%}")
            else:
                against = Text("no limit", "dim")
            records = f"{rate.records_per_second:,.0f}"
            if rate.limit_records:
                records += f" ({_share(rate.records_per_second, rate.limit_records).strip()})"
            shards.add_row(
                rate.shard_id,
                f"{rate.bytes_per_second / MIB:.3f}",
                against,
                records,
                f"{rate.throttled:,}",
            )
        parts: list[Any] = [header, Text(""), figures, Text(""), shards]
        if progress.events:
            parts.append(Text(""))
            parts.append(Text("chaos, as it happened", "bold"))
            for at, text in progress.events[-EVENTS_SHOWN:]:
                parts.append(Text.assemble((f"{at:5.1f} s  ", "dim"), (text, "magenta")))
        return Group(*parts)
