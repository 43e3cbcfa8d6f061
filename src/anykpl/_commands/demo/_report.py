"""What the demo prints after the run: the producer's figures and each shard's share of its
limits (:func:`report_run`), then the read-back's verdict (:func:`report_verdict`).

Everything goes through a :class:`Printer`, which styles the lines through ``rich`` when it is
installed and prints them plainly otherwise; the verdict itself is
:func:`anykpl.readback.judge`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

from ... import errors
from ..._core._limits import SHARD_BYTES_PER_SECOND, SHARD_RECORDS_PER_SECOND
from ._views import MIB, format_ms

if TYPE_CHECKING:
    from ... import readback
    from ._putting import RunReport

__all__ = ("Printer", "report_run", "report_verdict")


class Printer:
    """Lines to stdout (or ``file``), styled through rich when it is there."""

    def __init__(self, console: Any, file: TextIO | None = None) -> None:
        self._console = console
        self._file = file

    def __call__(self, text: str = "", style: str | None = None) -> None:
        if self._console is None:
            print(text, file=self._file, flush=True)
        else:
            self._console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def report_run(
    say: Printer,
    report: RunReport,
    final_stats: Mapping[str, Any] | None,
    stream: str,
) -> None:
    """The producer's figures, then each shard's records and share of its byte limit (the
    emulator's counts when it ran, the producer's otherwise)."""
    tally = report.tally
    seconds = max(report.elapsed, 1e-9)
    latencies = tally.latencies
    say()
    say("Producer", "bold")
    say(
        f"  offered {tally.offered_count:,} readings in {report.elapsed:.1f} s; "
        f"acknowledged {tally.acknowledged_count:,} ({tally.acknowledged_count / seconds:,.0f}/s, "
        f"{tally.acknowledged_bytes / MIB:.1f} MiB), failed {tally.failed_count:,}"
    )
    for code, count in sorted(tally.failures_by_code.items()):
        say(f"    failed with {code}: {count:,}", "yellow")
    say(
        f"  put latency p50 {format_ms(latencies.percentile(50))}, "
        f"p99 {format_ms(latencies.percentile(99))}"
        f", max {format_ms(latencies.max if latencies.count else None)}"
    )
    say(
        f"  throttled Kinesis records {report.throttled:,}, retried user records {report.retried:,}"
    )
    other = {
        code: count for code, count in report.errors_by_code.items() if code != errors.THROTTLED
    }
    if other:
        say("  other errors: " + ", ".join(f"{c} {n:,}" for c, n in sorted(other.items())))
    say()
    say("Per shard", "bold")
    # With the emulator, bytes are what each shard stored (aggregated records: data plus
    # partition key, the bytes the limit counts); without it, the user records' bytes.
    emulator_rows: dict[str, Mapping[str, Any]] = {}
    if final_stats is not None:
        emulator_rows = {
            row["shard_id"]: row for row in final_stats["shards"] if row["stream"] == stream
        }
    header = f"  {'shard':<22}{'user records':>14}"
    if emulator_rows:
        header += f"{'Kinesis records':>17}{'MiB stored':>12}"
    else:
        header += f"{'MiB':>12}"
    say(header + f"{'avg MiB/s':>11}{'of limit':>10}{'throttled':>11}", "dim")
    for shard in sorted(set(tally.shard_totals) | set(emulator_rows)):
        records, stored = tally.shard_totals.get(shard, [0, 0])
        line = f"  {shard:<22}{records:>14,}"
        row = emulator_rows.get(shard)
        if row is not None:
            stored = row["accepted_bytes"]
            line += f"{row['accepted_records']:>17,}"
            throttled = row["throttled_records"]
        else:
            throttled = report.throttled_by_shard.get(shard, 0)
        per_second = stored / seconds
        say(
            f"{line}{stored / MIB:>12.2f}{per_second / MIB:>11.3f}"
            f"{per_second / SHARD_BYTES_PER_SECOND:>10.1%}{throttled:>11,}"
        )
    if final_stats is not None:
        totals = final_stats["totals"]
        say(
            f"  the emulator stored {totals['accepted_records']:,} Kinesis records "
            f"({totals['accepted_bytes'] / MIB:.1f} MiB) from {totals['requests']:,} requests "
            f"and throttled {totals['throttled_records']:,}; each shard's limits are "
            f"{SHARD_RECORDS_PER_SECOND:,} records/s and {SHARD_BYTES_PER_SECOND / MIB:g} MiB/s",
            "dim",
        )


def report_verdict(say: Printer, verdict: readback.Verdict, found: int, left_out: int) -> None:
    """What the read-back found, and PASS or FAIL."""
    say()
    say("Read back", "bold")
    say(
        f"  read {found:,} user records of this run from the stream"
        + (f" (and {left_out:,} of earlier runs, ignored)" if left_out else "")
    )
    say(
        f"  acknowledged {verdict.acknowledged:,}: present {verdict.present:,}, "
        f"missing {verdict.missing:,}; duplicates {verdict.duplicates:,}; "
        f"unexpected {verdict.unexpected:,}"
    )
    if verdict.failed:
        say(
            f"  failed {verdict.failed:,}, of which {verdict.failed_present:,} reached the "
            "stream anyway (a failed record may have been written)"
        )
    for key, data in verdict.examples_missing:
        say(f"    missing: {key} {data.decode(errors='replace')}", "red")
    for key, data in verdict.examples_unexpected:
        say(f"    unexpected: {key} {data.decode(errors='replace')}", "red")
    say()
    if verdict.ok:
        extra = f", {verdict.duplicates:,} duplicates" if verdict.duplicates else ", no duplicates"
        say(
            f"PASS: all {verdict.acknowledged:,} acknowledged records are in the stream, "
            f"none lost{extra}.",
            "bold green",
        )
    elif verdict.acknowledged == 0:
        say("FAIL: the producer acknowledged no records.", "bold red")
    else:
        say(
            f"FAIL: {verdict.missing:,} acknowledged records missing, "
            f"{verdict.unexpected:,} unexpected records in the stream.",
            "bold red",
        )
