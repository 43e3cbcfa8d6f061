"""The delivery benchmark (benchmarks/delivery.py) end to end, shortened: the hot-key scenario on
both backends and the storm on one of two shards early in the producer's life run against a
spawned emulator, settle every record and report what the tables and ``--json`` promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "delivery.py"


def _run(tmp_path: Path, *argv: str) -> tuple[str, dict[str, Any]]:
    report = tmp_path / "delivery.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--adaptive-only", "--json", str(report), *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(report.read_text())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_hotkey_reports_the_hot_and_the_cold_keys(tmp_path: Path, backend: str) -> None:
    out, report = _run(
        tmp_path, "--scenario", "hotkey", "--hotkey-duration", "2", "--backend", backend
    )
    run = report["runs"]["hotkey"]["adaptive"]
    assert "error" not in run
    assert run["settled"] == run["admitted"] > 0
    classes = run["classes"]
    hot, cold = classes["hot"], classes["cold"]
    assert (hot["rate"], hot["scheduled"]) == (3000, 6000)
    assert (cold["rate"], cold["scheduled"]) == (750, 1500)
    # one cold key on each of the three shards the hot key does not use
    cold_shards = [name for name in classes if name.startswith("cold ")]
    assert len(cold_shards) == 3
    assert sorted({*hot["shard_ids"], *cold["shard_ids"]}) == sorted(run["by_shard"])
    assert not set(hot["shard_ids"]) & set(cold["shard_ids"])
    for figures in classes.values():
        assert 0 < figures["admitted_in_time"] <= figures["scheduled"]
        outcomes = figures["delivered"] + figures["expired"] + figures["failed_other"]
        assert outcomes == figures["admitted"]
        assert figures["latency_p99"] >= figures["latency_p50"] > 0
    assert "#### by class, adaptive" in out
    assert "| share of the offer admitted |" in out


def test_an_early_storm_on_one_of_two_shards(tmp_path: Path) -> None:
    out, report = _run(
        tmp_path,
        "--scenario",
        "storm",
        "--storm-shards",
        "2",
        "--storm-start",
        "0.5",
        "--storm-duration",
        "1",
        "--records",
        "3000",
        "--plot",
    )
    run = report["runs"]["storm"]["adaptive"]
    assert "error" not in run
    assert (run["shards"], run["storm_start"], run["storm_shard"]) == (
        2,
        0.5,
        "shardId-000000000000",
    )
    assert run["delivered"] == run["settled"] == 3000
    assert len(run["by_shard"]) == 2
    assert "recovery_seconds" in run
    assert "s after storm to ≥ 90 % of ceiling" in out
    # the timeline in the JSON, drawn beside it
    timeline = run["timeline"]
    assert sorted(timeline["shards"]) == ["shardId-000000000000", "shardId-000000000001"]
    stormy = [point[2] for point in timeline["limits"]["shardId-000000000000"]]
    assert stormy[:3] == [1048576.0, 0.3 * 1048576.0, 1048576.0]
    assert [point[2] for point in timeline["limits"]["shardId-000000000001"]][:2] == [1048576.0] * 2
    assert [at for at, _ in timeline["events"]] == [0.5, 1.5]
    stored = sum(sum(series["bytes"]) for series in timeline["shards"].values())
    assert stored >= 3000 * 1024
    assert len(timeline["producer"]["t"]) == len(timeline["producer"]["outstanding"]) > 5
    picture = tmp_path / "delivery-storm-adaptive.png"
    assert picture.read_bytes().startswith(b"\x89PNG")
    assert f"drawn in {picture}" in out
