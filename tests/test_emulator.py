"""The emulator's pure parts: options, the write path's limits, routing, faults and statistics,
on moto's own stream objects and an injected clock (no server, no event loop)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from moto.kinesis.models import Stream

from anykpl._core._limits import MAX_HASH_KEY, SHARD_BYTES_PER_SECOND
from anykpl.emulator import Faults, HttpLimits, Limits, Reshard, Storm
from anykpl.emulator._list_shards import ShardLister
from anykpl.emulator._moto import patch_moto_resharding
from anykpl.emulator._options import from_json, to_json
from anykpl.emulator._write_path import KinesisError, WritePath

ACCOUNT = "123456789012"


def make_stream(shards: int = 1, name: str = "s") -> Any:
    return Stream(name, shards, None, None, ACCOUNT, "us-east-1")


def entry(key: str = "k", size: int = 10, ehk: int | None = None) -> dict[str, str]:
    record = {"PartitionKey": key, "Data": base64.b64encode(b"x" * size).decode()}
    if ehk is not None:
        record["ExplicitHashKey"] = str(ehk)
    return record


def codes(response: dict[str, Any]) -> list[str]:
    return [r.get("ErrorCode", "ok") for r in response["Records"]]


# -- options --------------------------------------------------------------------------------


def test_options_round_trip_through_json_and_reject_unknown_fields() -> None:
    faults = Faults(error_rate=0.1, latency=0.5, seed=3)
    assert from_json(Faults, to_json(faults)) == faults
    with pytest.raises(ValueError, match="unknown Faults field"):
        from_json(Faults, {"eror_rate": 0.1})


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Faults, {"error_rate": 1.5}, "error_rate"),
        (Faults, {"latency": -1}, "latency"),
        (Faults, {"error_rate": 0.6, "reset_rate": 0.6}, "must not exceed 1"),
        (Faults, {"record_throttle_rate": -0.1}, "record_throttle_rate"),
        (Faults, {"record_failure_rate": 0.5, "record_throttle_rate": 0.6}, "must not exceed 1"),
        (Limits, {"records_per_second": 0}, "records_per_second"),
        (Storm, {"stream": "s", "duration": 0}, "duration"),
        (Storm, {"stream": "s", "duration": 1, "factor": 1.0}, "factor"),
        (Reshard, {"stream": "s", "action": "scale"}, "target"),
        (Reshard, {"stream": "s", "action": "explode"}, "action"),
        (HttpLimits, {"max_body_bytes": 1024}, "max_body_bytes"),
        (HttpLimits, {"max_body_bytes": -1}, "max_body_bytes"),
        (HttpLimits, {"read_timeout": 0}, "read_timeout"),
        (HttpLimits, {"read_timeout": float("inf")}, "read_timeout"),
    ],
)
def test_invalid_options_name_the_field(cls: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_spawn_command_line_carries_every_fault_to_the_emulator_options() -> None:
    import argparse

    from anykpl.emulator import command_line
    from anykpl.emulator.__main__ import add_arguments

    faults = Faults(
        error_rate=0.1,
        record_failure_rate=0.2,
        record_throttle_rate=0.3,
        latency=0.4,
        latency_jitter=0.5,
        reset_rate=0.6,
        fault_after_write=0.7,
        seed=8,
    )
    http = HttpLimits(max_body_bytes=64 * 1024 * 1024, read_timeout=2.5)
    argv = command_line(port=4567, faults=faults, http=http)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[3:])  # after python -m anykpl.emulator
    assert Faults(**{name: getattr(args, name) for name in to_json(faults)}) == faults
    assert HttpLimits(**{name: getattr(args, name) for name in to_json(http)}) == http
    defaults = parser.parse_args([])
    assert HttpLimits(**{name: getattr(defaults, name) for name in to_json(http)}) == HttpLimits()


def test_command_line_specs_parse() -> None:
    assert Storm.parse("demo:*:5:10") == Storm("demo", duration=10.0, start=5.0)
    assert Storm.parse("demo:shardId-000000000001:0:3:0.5") == Storm(
        "demo", duration=3.0, factor=0.5, shard_id="shardId-000000000001"
    )
    assert Reshard.parse("demo:split:*:20") == Reshard("demo", "split", at=20.0)
    assert Reshard.parse("demo:scale:8:1.5") == Reshard("demo", "scale", at=1.5, target=8)
    with pytest.raises(ValueError, match="reshard spec"):
        Reshard.parse("demo:split")


# -- limits ---------------------------------------------------------------------------------


def test_a_shard_accepts_one_second_of_records_then_its_rate() -> None:
    stream = make_stream()
    path = WritePath(Limits(), Faults(), now=0.0)
    first = path.put_records(stream, ACCOUNT, [entry() for _ in range(500)] * 1, now=0.0)
    second = path.put_records(stream, ACCOUNT, [entry() for _ in range(500)], now=0.0)
    third = path.put_records(stream, ACCOUNT, [entry() for _ in range(500)], now=0.0)
    assert first["FailedRecordCount"] == second["FailedRecordCount"] == 0
    assert third["FailedRecordCount"] == 500
    # half a second later, half a second of tokens
    later = path.put_records(stream, ACCOUNT, [entry() for _ in range(500)], now=0.5)
    assert later["FailedRecordCount"] == 0
    assert path.put_records(stream, ACCOUNT, [entry()], now=0.5)["FailedRecordCount"] == 1


def test_throttled_records_carry_the_service_message() -> None:
    stream = make_stream(name="demo")
    path = WritePath(Limits(records_per_second=1), Faults(), now=0.0)
    response = path.put_records(stream, ACCOUNT, [entry(), entry()], now=0.0)
    assert codes(response) == ["ok", "ProvisionedThroughputExceededException"]
    assert response["Records"][1]["ErrorMessage"] == (
        f"Rate exceeded for shard shardId-000000000000 in stream demo under account {ACCOUNT}."
    )


def test_bytes_count_data_plus_partition_key() -> None:
    stream = make_stream()
    path = WritePath(Limits(bytes_per_second=100), Faults(), now=0.0)
    # 96 + 4 bytes fit exactly; one more byte does not
    assert codes(path.put_records(stream, ACCOUNT, [entry("abcd", 96)], now=0.0)) == ["ok"]
    path = WritePath(Limits(bytes_per_second=100), Faults(), now=0.0)
    response = path.put_records(stream, ACCOUNT, [entry("abcde", 96)], now=0.0)
    assert codes(response) == ["ProvisionedThroughputExceededException"]


def test_limits_off_accept_any_rate() -> None:
    stream = make_stream()
    path = WritePath(Limits.off(), Faults(), now=0.0)
    for _ in range(10):
        assert path.put_records(stream, ACCOUNT, [entry()] * 500, now=0.0)["FailedRecordCount"] == 0


def test_a_storm_cuts_one_shard_for_its_duration() -> None:
    stream = make_stream(2)
    low, high = 0, MAX_HASH_KEY
    path = WritePath(Limits(), Faults(), now=0.0)
    path.add_storm(Storm("s", duration=2.0, factor=0.1, shard_id="shardId-000000000000"), 0.0)
    assert path.shard_limits("s", "shardId-000000000000", 1.0) == (
        100.0,
        SHARD_BYTES_PER_SECOND / 10,
    )
    assert path.shard_limits("s", "shardId-000000000001", 1.0) == (1000, SHARD_BYTES_PER_SECOND)
    response = path.put_records(stream, ACCOUNT, [entry(ehk=low)] * 200, now=1.0)
    assert response["FailedRecordCount"] == 100
    response = path.put_records(stream, ACCOUNT, [entry(ehk=high)] * 200, now=1.0)
    assert response["FailedRecordCount"] == 0
    # after the storm the shard refills to its full rate
    assert path.shard_limits("s", "shardId-000000000000", 2.5) == (1000, SHARD_BYTES_PER_SECOND)
    response = path.put_records(stream, ACCOUNT, [entry(ehk=low)] * 500, now=3.5)
    assert response["FailedRecordCount"] == 0


# -- routing --------------------------------------------------------------------------------


def test_records_go_to_the_shard_holding_their_hash_key_inclusive_of_its_end() -> None:
    stream = make_stream(2)
    shards = sorted(stream.shards.values(), key=lambda s: s.starting_hash)
    path = WritePath(Limits.off(), Faults(), now=0.0)
    keys = [0, shards[0].ending_hash, shards[1].starting_hash, MAX_HASH_KEY]
    response = path.put_records(stream, ACCOUNT, [entry(ehk=k) for k in keys], now=0.0)
    assert [r["ShardId"] for r in response["Records"]] == [
        shards[0].shard_id,
        shards[0].shard_id,
        shards[1].shard_id,
        shards[1].shard_id,
    ]
    md5 = int.from_bytes(hashlib.md5(b"device-7").digest(), "big")
    expected = shards[0] if md5 <= shards[0].ending_hash else shards[1]
    assert (
        path.put_records(stream, ACCOUNT, [entry("device-7")], now=0.0)["Records"][0]["ShardId"]
        == expected.shard_id
    )


def test_after_a_split_records_go_to_the_children_and_the_parent_keeps_its_own() -> None:
    patch_moto_resharding()
    stream = make_stream(1)
    path = WritePath(Limits.off(), Faults(), now=0.0)
    path.put_records(stream, ACCOUNT, [entry(ehk=1), entry(ehk=MAX_HASH_KEY)], now=0.0)
    parent = stream.shards["shardId-000000000000"]
    stream.split_shard(parent.shard_id, str(1 << 127))
    assert not parent.is_open
    assert [r.sequence_number for r in parent.records.values()] == [1, 2]
    response = path.put_records(stream, ACCOUNT, [entry(ehk=1), entry(ehk=MAX_HASH_KEY)], now=0.0)
    assert [r["ShardId"] for r in response["Records"]] == [
        "shardId-000000000001",
        "shardId-000000000002",
    ]
    assert len(parent.records) == 2
    assert all(
        len(stream.shards[s].records) == 1 for s in ("shardId-000000000001", "shardId-000000000002")
    )


def test_a_merge_leaves_the_parents_records_in_the_parents() -> None:
    patch_moto_resharding()
    stream = make_stream(2)
    path = WritePath(Limits.off(), Faults(), now=0.0)
    path.put_records(stream, ACCOUNT, [entry(ehk=1), entry(ehk=MAX_HASH_KEY)], now=0.0)
    stream.merge_shards("shardId-000000000000", "shardId-000000000001")
    child = stream.shards["shardId-000000000002"]
    assert len(child.records) == 0
    response = path.put_records(stream, ACCOUNT, [entry(ehk=1)], now=0.0)
    assert response["Records"][0]["ShardId"] == child.shard_id


def test_stored_records_read_back_through_moto() -> None:
    stream = make_stream(1)
    path = WritePath(Limits.off(), Faults(), now=0.0)
    path.put_records(stream, ACCOUNT, [entry("a", 3), entry("b", 4)], now=0.0)
    shard = stream.shards["shardId-000000000000"]
    records, last, _behind = shard.get_records("0", None)
    assert [(r.partition_key, r.to_json()["Data"]) for r in records] == [
        ("a", b"xxx"),
        ("b", b"xxxx"),
    ]
    assert last == 2


# -- faults and validation ------------------------------------------------------------------


def test_record_failure_rate_fails_records_with_internal_failure() -> None:
    stream = make_stream()
    path = WritePath(Limits.off(), Faults(record_failure_rate=1.0), now=0.0)
    response = path.put_records(stream, ACCOUNT, [entry()] * 3, now=0.0)
    assert codes(response) == ["InternalFailure"] * 3
    assert response["FailedRecordCount"] == 3
    assert path.totals["failed_records"] == 3
    path.set_faults(Faults(record_failure_rate=0.3, seed=1))
    response = path.put_records(stream, ACCOUNT, [entry()] * 500, now=0.0)
    assert 100 < response["FailedRecordCount"] < 200


def test_record_throttle_rate_throttles_records_whatever_the_rate() -> None:
    stream = make_stream(name="demo")
    path = WritePath(Limits(records_per_second=2), Faults(record_throttle_rate=1.0), now=0.0)
    response = path.put_records(stream, ACCOUNT, [entry(size=6)] * 3, now=0.0)
    assert codes(response) == ["ProvisionedThroughputExceededException"] * 3
    assert response["FailedRecordCount"] == 3
    assert response["Records"][0]["ErrorMessage"] == (
        f"Rate exceeded for shard shardId-000000000000 in stream demo under account {ACCOUNT}."
    )
    # counted as throttles (data + key bytes), tallied apart, and no tokens were taken
    totals = path.totals
    assert (totals["throttled_records"], totals["throttled_bytes"]) == (3, 21)
    assert totals["injected_throttled_records"] == 3
    assert totals["failed_records"] == totals["accepted_records"] == 0
    path.set_faults(Faults())
    assert codes(path.put_records(stream, ACCOUNT, [entry()] * 3, now=0.0)) == [
        "ok",
        "ok",
        "ProvisionedThroughputExceededException",
    ]
    assert path.totals["injected_throttled_records"] == 3
    assert path.totals["throttled_records"] == 4
    # a share of records, independent of the rate (limits off), and beside failures
    path = WritePath(Limits.off(), Faults(record_throttle_rate=0.25, seed=1), now=0.0)
    response = path.put_records(stream, ACCOUNT, [entry()] * 500, now=0.0)
    assert 85 < response["FailedRecordCount"] < 165
    path.set_faults(Faults(record_failure_rate=0.5, record_throttle_rate=0.5, seed=2))
    response = path.put_records(stream, ACCOUNT, [entry()] * 500, now=0.0)
    assert 200 < codes(response).count("InternalFailure") < 300
    assert codes(response).count("ok") == 0
    path.set_faults(Faults(record_throttle_rate=1.0))
    with pytest.raises(KinesisError, match="Rate exceeded") as caught:
        path.put_record(stream, ACCOUNT, entry(), now=0.0)
    assert caught.value.status == 400


def test_put_record_turns_a_throttle_into_a_request_error() -> None:
    stream = make_stream()
    path = WritePath(Limits(records_per_second=1), Faults(), now=0.0)
    assert path.put_record(stream, ACCOUNT, entry(), now=0.0)["SequenceNumber"] == "1"
    with pytest.raises(KinesisError) as caught:
        path.put_record(stream, ACCOUNT, entry(), now=0.0)
    assert caught.value.status == 400
    assert caught.value.error_type == "ProvisionedThroughputExceededException"


@pytest.mark.parametrize(
    ("records", "error_type"),
    [
        ([], "ValidationException"),
        ([entry()] * 501, "ValidationException"),
        ([entry("")], "ValidationException"),
        ([entry("k" * 257)], "ValidationException"),
        ([entry(size=1024 * 1024)], "ValidationException"),
        ([entry(size=1024 * 1000)] * 6, "InvalidArgumentException"),
        ([entry(ehk=MAX_HASH_KEY + 1)], "InvalidArgumentException"),
        ([{"PartitionKey": "k", "Data": "abc"}], "SerializationException"),
    ],
)
def test_invalid_requests_are_rejected_whole(records: list[Any], error_type: str) -> None:
    stream = make_stream()
    path = WritePath(Limits.off(), Faults(), now=0.0)
    with pytest.raises(KinesisError) as caught:
        path.put_records(stream, ACCOUNT, records, now=0.0)
    assert caught.value.error_type == error_type
    assert stream.shards["shardId-000000000000"].records == {}


def test_statistics_count_per_shard_per_second() -> None:
    stream = make_stream()
    path = WritePath(Limits(records_per_second=2), Faults(), now=100.0)
    path.put_records(stream, ACCOUNT, [entry("k", 6)] * 3, now=100.5)
    path.put_records(stream, ACCOUNT, [entry("k", 6)] * 2, now=101.5)
    stats = path.stats[("s", "shardId-000000000000")]
    assert stats.totals == [4, 28, 1, 7, 0, 0]
    assert stats.per_second == {0: [2, 14, 1, 7, 0], 1: [2, 14, 0, 0, 0]}
    path.reset_stats()
    assert path.stats == {}
    assert path.totals["accepted_records"] == 0


@pytest.mark.parametrize(
    "ehk",
    ["9" * 5000, "1" + "0" * 39, "-1", "1e3", " 1", "0x10", "²"],
    ids=["5000-digits", "40-digits", "negative", "exponent", "space", "hex", "superscript"],
)
def test_explicit_hash_keys_outside_the_range_are_invalid_arguments(ehk: str) -> None:
    stream = make_stream()
    path = WritePath(Limits.off(), Faults(), now=0.0)
    for put in (
        lambda e: path.put_records(stream, ACCOUNT, [e], now=0.0),
        lambda e: path.put_record(stream, ACCOUNT, e, now=0.0),
    ):
        with pytest.raises(KinesisError) as caught:
            put({**entry(), "ExplicitHashKey": ehk})
        assert (caught.value.status, caught.value.error_type) == (400, "InvalidArgumentException")
        assert len(caught.value.message) < 300  # a 5,000-digit key is not echoed whole
    # leading zeros are still a number in range, as the service reads them
    response = path.put_records(
        stream, ACCOUNT, [{**entry(), "ExplicitHashKey": "0" * 60 + "7"}], 0.0
    )
    assert response["FailedRecordCount"] == 0


# -- ListShards -----------------------------------------------------------------------------


class Lister:
    """A ShardLister over moto stream objects kept in a dict, with a clock the test moves."""

    def __init__(self, *streams: Any) -> None:
        self.lister = ShardLister()
        self.streams = {s.stream_name: s for s in streams}
        self.now = 1000.0

    def __call__(self, **payload: Any) -> dict[str, Any]:
        return self.lister.list_shards(
            payload, (ACCOUNT, "us-east-1"), lambda account, region: self.streams, self.now
        )


def list_error(call: Any) -> tuple[str, str]:
    with pytest.raises(KinesisError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value.error_type, caught.value.message


def test_list_shards_pages_a_thousand_shards_at_a_time_with_next_token_alone() -> None:
    stream = make_stream(2500, name="big")
    lister = Lister(stream)
    first = lister(StreamName="big")
    assert [s["ShardId"] for s in first["Shards"]] == [f"shardId-{i:012d}" for i in range(1000)]
    # a MaxResults above 1,000 is accepted and still answers 1,000
    assert len(lister(StreamARN=stream.arn, MaxResults=10000)["Shards"]) == 1000
    second = lister(NextToken=first["NextToken"], MaxResults=1000)
    third = lister(NextToken=second["NextToken"])
    assert [s["ShardId"] for s in second["Shards"] + third["Shards"]] == [
        f"shardId-{i:012d}" for i in range(1000, 2500)
    ]
    assert "NextToken" not in third
    # a smaller MaxResults makes smaller pages, a token included
    small = lister(StreamName="big", MaxResults=2)
    assert len(lister(NextToken=small["NextToken"], MaxResults=3)["Shards"]) == 3


def test_list_shards_filters_open_shards_and_keeps_the_filter_across_pages() -> None:
    patch_moto_resharding()
    stream = make_stream(3, name="f")
    stream.split_shard(
        "shardId-000000000001", str(stream.shards["shardId-000000000001"].starting_hash + 1)
    )
    lister = Lister(stream)
    every = [s["ShardId"] for s in lister(StreamName="f")["Shards"]]
    assert every == [f"shardId-{i:012d}" for i in range(5)]
    first = lister(StreamName="f", ShardFilter={"Type": "AT_LATEST"}, MaxResults=2)
    rest = lister(NextToken=first["NextToken"], MaxResults=2)
    assert [s["ShardId"] for s in first["Shards"] + rest["Shards"]] == [
        "shardId-000000000000",
        "shardId-000000000002",
        "shardId-000000000003",
        "shardId-000000000004",
    ]
    after = lister(StreamName="f", ShardFilter={"Type": "AFTER_SHARD_ID", "ShardId": every[2]})
    assert [s["ShardId"] for s in after["Shards"]] == every[3:]
    assert (
        lister(StreamName="f", ExclusiveStartShardId=every[3])["Shards"][0]["ShardId"] == every[4]
    )


@pytest.mark.parametrize(
    "member",
    [
        {"StreamName": "big"},
        {"StreamARN": "arn:aws:kinesis:us-east-1:123456789012:stream/big"},
        {"ExclusiveStartShardId": "shardId-000000000001"},
        {"ShardFilter": {"Type": "AT_LATEST"}},
    ],
    ids=lambda m: next(iter(m)),
)
def test_list_shards_refuses_a_next_token_with_a_stream(member: dict[str, Any]) -> None:
    lister = Lister(make_stream(3, name="big"))
    token = lister(StreamName="big", MaxResults=1)["NextToken"]
    name = next(iter(member))
    assert list_error(lambda: lister(NextToken=token, **member)) == (
        "InvalidArgumentException",
        f"NextToken and {name} cannot be provided together.",
    )


def test_list_shards_tokens_expire_after_300_seconds_and_are_the_emulators_own() -> None:
    stream = make_stream(3, name="t")
    lister = Lister(stream)
    token = lister(StreamName="t", MaxResults=1)["NextToken"]
    lister.now += 300
    assert len(lister(NextToken=token)["Shards"]) == 2
    lister.now += 1
    assert list_error(lambda: lister(NextToken=token))[0] == "ExpiredNextTokenException"
    # a token of another emulator (one since restarted) is expired too; garbage is invalid
    other = Lister(stream)
    assert list_error(lambda: other(NextToken=token))[0] == "ExpiredNextTokenException"
    for garbage in ("x", "e30=", "W10=", "9" * 5000):
        assert list_error(lambda g=garbage: lister(NextToken=g)) == (
            "InvalidArgumentException",
            "Invalid NextToken.",
        )


@pytest.mark.parametrize(
    ("payload", "error_type", "message"),
    [
        ({"StreamName": "v", "MaxResults": 0}, "ValidationException", "greater than or equal to 1"),
        (
            {"StreamName": "v", "MaxResults": 10001},
            "ValidationException",
            "less than or equal to 10000",
        ),
        ({"StreamName": "v", "MaxResults": "5"}, "SerializationException", "MaxResults"),
        (
            {"StreamName": "v", "ShardFilter": {"Type": "SOON"}},
            "ValidationException",
            "shardFilter.type",
        ),
        (
            {"StreamName": "v", "ShardFilter": {"Type": "AFTER_SHARD_ID"}},
            "InvalidArgumentException",
            "ShardId",
        ),
        ({}, "InvalidArgumentException", "StreamName or StreamARN"),
        ({"StreamName": "nope"}, "ResourceNotFoundException", "Stream nope under account"),
    ],
)
def test_list_shards_validates_like_the_service(
    payload: dict[str, Any], error_type: str, message: str
) -> None:
    lister = Lister(make_stream(1, name="v"))
    found_type, found_message = list_error(lambda: lister(**payload))
    assert found_type == error_type
    assert message in found_message


def test_a_listing_of_a_deleted_stream_ends_with_resource_not_found() -> None:
    lister = Lister(make_stream(2, name="d"))
    token = lister(StreamName="d", MaxResults=1)["NextToken"]
    lister.streams["d"] = make_stream(2, name="d")  # deleted and created again
    assert list_error(lambda: lister(NextToken=token))[0] == "ResourceNotFoundException"
