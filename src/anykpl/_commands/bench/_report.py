"""What a benchmark run writes: ``bench.json`` (every number, and the machine), ``bench.md`` (the
markdown table) and ``bench.png`` (the plot, when matplotlib is installed)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import warnings
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ("BAR", "machine", "markdown_table", "size_label", "write_json", "write_plot")

#: The bench's bar (docs/bench.md): a lone producer sustains at least this share of each
#: shard's binding limit.
BAR = 0.97

_PACKAGES = ("anyio", "trio", "aiobotocore", "aiohttp", "httpx2", "moto", "matplotlib")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    from ... import __version__

    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on Windows
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "anykpl": __version__,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "packages": versions,
    }


def size_label(size: int) -> str:
    """``100 B``, ``1 KiB``, ``10 KiB``, ``100 KiB``, ``1.5 KiB``."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:g} KiB"
    return f"{size / 1024 / 1024:g} MiB"


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{share * 100:.1f} %"


def _number(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def markdown_table(cases: Sequence[Mapping[str, Any]]) -> str:
    """One row per case. Shares are of the shard limits (1000 records/s, 1 MiB/s); utilisation
    is the worst shard's share of the limit that binds; latency is from the call to ``submit``
    to the record's result."""
    header = (
        "| record size | aggregation | user records/s | user records per Kinesis record "
        "| Kinesis records per request | record share | byte share "
        "| utilisation (worst shard) | binding limit | throttled (measured / whole run) "
        "| latency p50 / p90 / p99 (ms) | CPU s per 100k records |\n"
        "|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|\n"
    )
    rows = []
    for case in cases:
        latency = case["latency_ms"]
        rows.append(
            "| "
            + " | ".join(
                [
                    size_label(case["record_size"]),
                    "on" if case["aggregation"] else "off",
                    _number(case["user_records_per_second"]),
                    _number(case["user_records_per_kinesis_record"], 1),
                    _number(case["kinesis_records_per_request"], 1),
                    _percent(case["record_share"]),
                    _percent(case["byte_share"]),
                    f"**{_percent(case['utilisation'])}**",
                    case["binding_limit"],
                    f"{case['throttled_records']:,} / {case['throttled_records_total']:,}",
                    " / ".join(_number(latency[p]) for p in ("p50", "p90", "p99")),
                    _number(case["cpu_seconds_per_100k"], 2),
                ]
            )
            + " |"
        )
    return header + "\n".join(rows) + "\n"


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(path: Path, cases: Sequence[Mapping[str, Any]]) -> bool:
    """Draw utilisation per case (record sizes along x, aggregation on and off side by side,
    the 97 % bar as a line) over p99 latency. Returns ``False`` when matplotlib is missing."""
    with warnings.catch_warnings():
        # a cosmetic warning from matplotlib (fonts, layout) must not fail a finished run
        warnings.simplefilter("ignore")
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return False
        _draw(Figure, path, cases)
    return True


def _draw(figure_class: type[Figure], path: Path, cases: Sequence[Mapping[str, Any]]) -> None:
    sizes = sorted({int(case["record_size"]) for case in cases})
    modes = [mode for mode in (True, False) if any(c["aggregation"] is mode for c in cases)]
    by_key = {(int(c["record_size"]), bool(c["aggregation"])): c for c in cases}
    width = 0.8 / len(modes)
    colours = {True: "#1f77b4", False: "#ff7f0e"}

    figure = figure_class(figsize=(8.0, 7.0), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    for index, mode in enumerate(modes):
        xs = [i + (index - (len(modes) - 1) / 2) * width for i in range(len(sizes))]
        label = f"aggregation {'on' if mode else 'off'}"
        utilisation = [_value(by_key.get((s, mode)), "utilisation", 100.0) for s in sizes]
        bars = top.bar(xs, utilisation, width, label=label, color=colours[mode])
        top.bar_label(bars, labels=[_short(u, "{:.1f}") for u in utilisation], fontsize=8)
        p99 = [_latency(by_key.get((s, mode))) for s in sizes]
        bars = bottom.bar(xs, p99, width, label=label, color=colours[mode])
        bottom.bar_label(bars, labels=[_short(v, "{:.0f}") for v in p99], fontsize=8)
    top.axhline(BAR * 100, color="black", linestyle="--", linewidth=1, label="97 % bar")
    top.set_ylabel("utilisation of the binding limit, worst shard (%)")
    top.set_ylim(0, 125)
    top.legend(loc="upper center", ncols=3, fontsize=8)
    top.set_title("anykpl bench: one producer, emulator limits on")
    bottom.set_ylabel("latency p99, submit to result (ms)")
    bottom.set_xticks(range(len(sizes)), [size_label(s) for s in sizes])
    bottom.set_xlabel("user record size")
    figure.savefig(path, dpi=110)


def _value(case: Mapping[str, Any] | None, name: str, scale: float) -> float:
    if case is None or case.get(name) is None:
        return math.nan
    return float(case[name]) * scale


def _latency(case: Mapping[str, Any] | None) -> float:
    if case is None or case["latency_ms"]["p99"] is None:
        return math.nan
    return float(case["latency_ms"]["p99"])


def _short(value: float, form: str) -> str:
    return "" if math.isnan(value) else form.format(value)
