"""``anykpl emulator-stats`` against a running emulator: the table, ``--json``, ``--reset``."""

from __future__ import annotations

import json

import pytest

from anykpl import SyncProducer
from anykpl._commands.cli import main
from anykpl.testing import KinesisEmulator


@pytest.mark.anykpl_emulator(streams={"stats": 2})
def test_the_table_and_the_json_show_what_the_emulator_stored(
    kinesis_emulator: KinesisEmulator, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncProducer(kinesis_emulator.producer_config(aggregation_enabled=False)) as producer:
        for i in range(50):
            producer.submit("stats", b"x" * 100, partition_key=f"k{i}")
        producer.flush()
    url = kinesis_emulator.endpoint_url

    assert main(["emulator-stats", "--endpoint", url]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert "limits 1,000 records/s and 1,048,576 B/s per shard" in lines[0]
    shard_lines = [line for line in lines if line.startswith("stats ")]
    assert [line.split()[1] for line in shard_lines] == [
        "shardId-000000000000",
        "shardId-000000000001",
    ]
    total = next(line for line in lines if line.startswith("total"))
    assert total.split()[1] == "50"

    assert main(["emulator-stats", "--endpoint", url, "--json", "--reset"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["totals"]["accepted_records"] == 50
    assert sum(shard["accepted_records"] for shard in document["shards"]) == 50

    # --reset zeroed the counters after printing them
    assert main(["emulator-stats", "--endpoint", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["accepted_records"] == 0


def test_an_emulator_that_is_not_there_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["emulator-stats", "--endpoint", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("anykpl emulator-stats: cannot read http://127.0.0.1:9:")
    assert len(err.strip().splitlines()) == 1
