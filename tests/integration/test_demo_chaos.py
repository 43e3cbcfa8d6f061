"""``anykpl demo --chaos`` and ``--plot``: the run under a storm, a hot device, a split and
resets, on both backends against the emulator the demo starts, judged by its read-back verdict;
and the parts without an event loop (the plan, the views' announcements, the timeline)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import anykpl._commands.demo
from anykpl._commands.demo import Progress, add_arguments
from anykpl._commands.demo._chaos import CHAOS_DURATION, Chaos, shard_of
from anykpl._commands.demo._timeline import Timeline, plot

MIB = 1024 * 1024
PNG = b"\x89PNG\r\n\x1a\n"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="anykpl demo")
    add_arguments(parser)
    return parser.parse_args(list(argv))


# -- the whole run ------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_chaos_demo_announces_each_event_and_passes_the_read_back(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "chaos.png"
    argv = ("--chaos", "--duration", "12", "--devices", "500", "--rate", "2", "--burst-every", "4")
    status = anykpl._commands.demo.run(
        parse(*argv, "--backend", backend, "--progress", "plain", "--json", "--plot", str(picture))
    )
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert status == document["exit_code"] == 0, captured.err
    assert document["chaos"] is True
    assert document["read_back"]["missing"] == document["read_back"]["unexpected"] == 0
    assert document["acknowledged"] == document["read_back"]["present"] > 10_000
    events = document["timeline"]["events"]
    texts = [text for _, text in events]
    assert [text.split(":")[0].split(" ")[0] for text in texts] == [
        "throttle", "storm", "hot", "hot", "shard", "connection", "connection",
    ]  # fmt: skip
    # each told when it was due: at 10 %, 30 %, 33 %, 50 %, 55 %, 70 % and 80 % of the run
    due = [1.2, 3.6, 3.96, 5.96, 6.6, 8.4, 9.6]
    assert all(d <= at < d + 1.0 for (at, _), d in zip(events, due, strict=True)), events
    assert not [text for text in texts if "refused" in text]
    # announced as they happened, in the progress lines
    for text in texts:
        assert f">> {text}" in captured.err
    # the resets reached the producer (retried: nothing failed, nothing missing)
    assert document["errors_by_code"].get("ConnectionError", 0) > 0
    assert "chaos, as it happened:" in captured.err
    # the emulator saw them: the storm's ceiling on the first shard, the split's two shards
    timeline = document["timeline"]
    storm_ceilings = [point[2] for point in timeline["limits"]["shardId-000000000000"]]
    assert pytest.approx(0.1 * MIB) in storm_ceilings
    assert storm_ceilings[-1] == pytest.approx(MIB)
    assert sorted(timeline["shards"]) == [f"shardId-{i:012d}" for i in range(6)]
    # the hot device's shard took more than any other, in its window and not before
    shards = timeline["shards"]
    stored = {shard: sum(series["bytes"]) for shard, series in shards.items()}
    assert max(stored, key=stored.__getitem__) == "shardId-000000000002"
    hot = shards["shardId-000000000002"]
    busiest = max(range(len(hot["t"])), key=hot["bytes"].__getitem__)
    assert 3.0 <= hot["t"][busiest] <= 9.0, hot  # from 3.96 s for 2 s, then its backlog
    before = [b for t, b in zip(hot["t"], hot["bytes"], strict=True) if t < 3.0]
    assert max(before) < hot["bytes"][busiest] / 3
    # the storm's ceiling, as the emulator said it, from 1.2 s to 3.6 s (polled twice a second)
    cut, back = [at for at, _, ceiling in timeline["limits"]["shardId-000000000000"][1:3]]
    assert 1.2 <= cut <= 2.5
    assert 3.6 <= back <= 4.9
    assert picture.read_bytes().startswith(PNG)


def test_chaos_needs_the_emulator_the_demo_starts() -> None:
    with pytest.raises(SystemExit, match="--chaos needs the emulator"):
        anykpl._commands.demo.run(parse("--chaos", "--endpoint", "http://127.0.0.1:9"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("run.jpeg", "must end in .png, .svg or .pdf"),
        ("nowhere/run.png", "no directory"),
        ("folder.png", "cannot write a file there"),
    ],
)
def test_a_plot_that_could_not_be_written_is_refused_before_the_run(
    tmp_path: Path, name: str, message: str
) -> None:
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(SystemExit, match=message):
        anykpl._commands.demo.run(parse("--plot", str(tmp_path / name)))


def test_chaos_runs_a_minute_unless_told() -> None:
    assert anykpl._commands.demo.workload_from(parse("--chaos")).duration == CHAOS_DURATION
    assert anykpl._commands.demo.workload_from(parse("--chaos", "--duration", "7")).duration == 7
    assert anykpl._commands.demo.workload_from(parse()).duration == 30


# -- the plan -----------------------------------------------------------------------------


def test_shard_of_routes_a_key_as_the_emulator_splits_a_new_stream() -> None:
    import boto3

    from anykpl.emulator import spawn

    with spawn(streams={"s": 4}) as url:
        client = boto3.client(
            "kinesis",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        shards = client.list_shards(StreamName="s")["Shards"]
    ranges = [
        (int(s["HashKeyRange"]["StartingHashKey"]), int(s["HashKeyRange"]["EndingHashKey"]))
        for s in sorted(shards, key=lambda s: s["ShardId"])
    ]
    import hashlib

    for number in range(300):
        key = f"dev-{number:05d}"
        hashed = int.from_bytes(hashlib.md5(key.encode()).digest(), "big")
        (expected,) = [i for i, (low, high) in enumerate(ranges) if low <= hashed <= high]
        assert shard_of(key, 4) == expected, key


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_the_plan_puts_each_trouble_on_its_own_shard_where_there_are_three(shards: int) -> None:
    chaos = Chaos("demo", shards, devices=5000, duration=60.0)
    assert [event.at for event in chaos.plan] == sorted(event.at for event in chaos.plan)
    assert all(0 < event.at < 60.0 for event in chaos.plan)
    hot = chaos.hot
    assert hot.device >= 5000  # a device of its own, not one of the fleet's
    assert shard_of(hot.key, shards) == 2 % shards
    assert hot.shard_id == f"shardId-{2 % shards:012d}"
    assert hot.start + hot.duration < 60.0
    texts = " | ".join(event.text for event in chaos.plan)
    assert "shardId-000000000000 cut to 10%" in texts
    assert f"split: shardId-{1 % shards:012d}" in texts
    # the storm and the resets are told to the emulator; the hot device is the putting side's
    told = [event.text.split(":")[0] for event in chaos.plan if event.apply is not None]
    assert told == ["throttle storm", "shard split", "connection resets", "connection resets stop"]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_each_event_tells_the_emulator_what_it_says() -> None:
    chaos = Chaos("demo", 4, devices=10, duration=60.0)
    client = _Recorder()
    for event in chaos.plan:
        if event.apply is not None:
            event.apply(client)
    assert client.calls == [
        ("storm", ("demo",), {"duration": 12.0, "factor": 0.1, "shard_id": "shardId-000000000000"}),
        ("reshard", ("demo", "split"), {"shard_id": "shardId-000000000001"}),
        ("set_faults", (), {"reset_rate": 0.3}),
        ("set_faults", (), {"reset_rate": 0.0}),
    ]  # fmt: skip


# -- the views and the timeline -----------------------------------------------------------


def _progress(elapsed: float, events: list[tuple[float, str]]) -> Progress:
    return Progress(
        elapsed=elapsed, duration=60.0, offered_rate=1.0, acknowledged_rate=1.0, acknowledged=1,
        failed=0, outstanding=0, throttled=0, retried=0, p50=None, p99=None, events=events,
    )  # fmt: skip


def test_plain_view_prints_each_event_once_as_soon_as_it_is_seen() -> None:
    lines: list[str] = []
    view = anykpl._commands.demo._PlainView(lines.append)
    view.update(_progress(0.5, []))
    view.update(_progress(1.0, [(0.8, "storm")]))
    view.update(_progress(1.5, [(0.8, "storm")]))
    view.update(_progress(2.0, [(0.8, "storm"), (1.9, "split")]))
    assert [line for line in lines if ">>" in line] == ["[  0.8 s] >> storm", "[  1.9 s] >> split"]


def test_live_view_lists_the_latest_events() -> None:
    from rich.console import Console

    console = Console(width=120, record=True, color_system=None)
    events = [(float(i), f"event number {i}") for i in range(12)]
    console.print(anykpl._commands.demo._LiveView(None, "t").render(_progress(12.0, events)))
    text = console.export_text()
    assert "chaos, as it happened" in text
    assert "event number 11" in text
    assert "event number 4" in text
    assert "event number 3" not in text  # the latest eight


def _stats(uptime: float, limit_bytes: float, shards: int = 2) -> dict[str, Any]:
    return {
        "uptime": uptime,
        "shards": [
            {
                "stream": "demo", "shard_id": f"shardId-{i:012d}", "open": True,
                "limit_records": 1000.0, "limit_bytes": limit_bytes if i == 0 else MIB,
                "per_second": [[s, 100, 50_000 * (i + 1), i, 0] for s in range(3, int(uptime))],
            }
            for i in range(shards)
        ] + [{"stream": "other", "shard_id": "x", "open": True, "per_second": []}],
    }  # fmt: skip


def test_timeline_keeps_rates_ceilings_backlog_and_events_and_draws_them(tmp_path: Path) -> None:
    timeline = Timeline("demo")
    # the emulator had run 3 s when the devices started
    for step in range(20):
        elapsed = step * 0.5
        storm = 2.0 <= elapsed < 5.0
        timeline.note(
            elapsed, outstanding=step * 10, throttled=step, retried=2 * step, offered_rate=100.0,
            acknowledged_rate=90.0, stats=_stats(3.0 + elapsed, 0.1 * MIB if storm else MIB),
            stats_elapsed=elapsed,
        )  # fmt: skip
    timeline.finish(_stats(13.2, MIB), 10.2)
    timeline.events = [(2.0, "storm"), (5.0, "storm over")]
    document = timeline.to_json()
    assert timeline.offset == 3.0
    assert document["limits"]["shardId-000000000000"] == [
        [0.0, 1000.0, MIB], [2.0, 1000.0, 0.1 * MIB], [5.0, 1000.0, MIB], [10.2, 1000.0, MIB],
    ]  # fmt: skip
    first = document["shards"]["shardId-000000000000"]
    assert first["t"][:2] == [0.0, 1.0]  # the emulator's second 3 is the run's second 0
    assert first["bytes"][0] == 50_000
    assert document["shards"]["shardId-000000000001"]["throttled"][0] == 1
    assert document["producer"]["outstanding"][-1] == 190
    assert document["events"] == [[2.0, "storm"], [5.0, "storm over"]]
    assert "x" not in document["shards"]
    json.dumps(document)  # what --json prints
    picture = tmp_path / "run.png"
    plot(document, str(picture), "a title")
    assert picture.read_bytes().startswith(PNG)
    plot({}, str(tmp_path / "empty.svg"), "nothing")  # a run with nothing to draw still draws
    assert (tmp_path / "empty.svg").read_text().lstrip().startswith("<?xml")


def test_timeline_fills_the_seconds_a_shard_stored_nothing_with_zeros() -> None:
    timeline = Timeline("demo")
    stats = {
        "uptime": 10.5,
        "shards": [
            {"stream": "demo", "shard_id": "a", "open": True,
             "per_second": [[2, 5, 500, 0, 0], [6, 7, 700, 1, 0]]},
            {"stream": "demo", "shard_id": "b", "open": False, "per_second": [[3, 1, 100, 0, 0]]},
        ],
    }  # fmt: skip
    timeline.finish(stats, elapsed=9.0)  # no sample before: the run began at the uptime 1.5
    document = timeline.to_json()
    a = document["shards"]["a"]
    assert a["t"] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5]  # open: up to the end
    assert a["bytes"] == [500, 0, 0, 0, 700, 0, 0, 0, 0]
    assert document["shards"]["b"]["t"] == [1.5]  # closed: up to its last second
    assert document["measured_by"] == "emulator"


def test_without_the_emulator_the_timeline_holds_the_producers_rates(tmp_path: Path) -> None:
    from anykpl._commands.demo import ShardRate

    timeline = Timeline("demo")
    for step, throttled in enumerate([0, 0, 4, 10]):
        rates = [
            ShardRate("shardId-000000000003", 20.0 * step, 1000.0 * step, throttled, None, None)
        ]
        timeline.note(
            step * 0.5, outstanding=1, throttled=throttled, retried=0, offered_rate=1.0,
            acknowledged_rate=1.0, shard_rates=rates,
        )  # fmt: skip
    document = timeline.to_json()
    assert document["measured_by"] == "producer"
    series = document["shards"]["shardId-000000000003"]
    assert series["t"] == [0.0, 0.5, 1.0, 1.5]
    assert series["bytes"] == [0.0, 1000.0, 2000.0, 3000.0]
    assert series["throttled"] == [0.0, 0.0, 8.0, 12.0]  # per second, from the running count
    assert document["limits"] == {}
    plot(document, str(tmp_path / "producer.png"), "t")
    assert (tmp_path / "producer.png").read_bytes().startswith(PNG)


def test_a_shard_that_closes_keeps_its_ceiling_until_it_closes(tmp_path: Path) -> None:
    timeline = Timeline("demo")
    for step in range(6):
        stats = _stats(3.0 + step, MIB)
        stats["shards"][1]["open"] = step < 3
        timeline.note(
            float(step), outstanding=0, throttled=0, retried=0, offered_rate=0.0,
            acknowledged_rate=0.0, stats=stats, stats_elapsed=float(step),
        )  # fmt: skip
    timeline.finish(_stats(9.0, MIB), 6.0)
    closed = timeline.to_json()["limits"]["shardId-000000000001"]
    assert closed[0] == [0.0, 1000.0, MIB]
    assert closed[1] == [3.0, None, None]
    import matplotlib.pyplot as plt

    drawn: list[Any] = []
    real = plt.Axes.plot

    def spy(axes: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(args)
        return real(axes, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt.Axes, "plot", spy)
        plot(timeline.to_json(), str(tmp_path / "closed.png"), "t")
    ceilings = [args for args in drawn if list(args[0][:2]) == [0.0, 3.0]]
    assert ceilings, drawn  # the closed shard's ceiling is drawn from 0 s to its close at 3 s
