"""``anykpl.aggregation``, the consumers' deaggregator: Lambda events, GetRecords records and raw
bytes; the KCL's rule for a shard's range; corrupt input raised or counted; and the same user
records as AWS's own deaggregator (``aws_kinesis_agg``) reads."""

from __future__ import annotations

import base64
import hashlib

import pytest
from aws_kinesis_agg import aggregator as agg_aggregator
from aws_kinesis_agg import deaggregator as agg_deaggregator

from anykpl._core._records import partition_key_hash
from anykpl._core._wire import MAGIC, encode_aggregate
from anykpl.aggregation import (
    MAX_HASH_KEY,
    Deaggregator,
    UserRecord,
    deaggregate,
    deaggregate_lambda_event,
    deaggregate_records,
)
from anykpl.errors import AggregationFormatError

RECORDS = [("device-1", None, b"21.5"), ("device-2", "12345", b"19.0"), ("device-1", None, b"")]


def lambda_event(*datas: bytes, partition_key: str = "a") -> dict[str, object]:
    return {
        "Records": [
            {
                "eventSource": "aws:kinesis",
                "kinesis": {
                    "kinesisSchemaVersion": "1.0",
                    "partitionKey": partition_key,
                    "sequenceNumber": f"4959{index}",
                    "approximateArrivalTimestamp": 1545084650.987,
                    "data": base64.b64encode(data).decode("ascii"),
                },
            }
            for index, data in enumerate(datas)
        ]
    }


def corrupt_aggregate() -> bytes:
    """The magic and a matching checksum around a protobuf that is cut short."""
    body = encode_aggregate(RECORDS)[4:-16][:-3]
    return MAGIC + body + hashlib.md5(body).digest()


def test_an_aggregate_gives_its_user_records_in_order_with_their_positions() -> None:
    records = deaggregate(encode_aggregate(RECORDS), "container", sequence_number="42")
    assert records == [
        UserRecord("device-1", None, b"21.5", "42", 0, True),
        UserRecord("device-2", "12345", b"19.0", "42", 1, True),
        UserRecord("device-1", None, b"", "42", 2, True),
    ]
    assert records[1].hash_key == 12345
    assert records[0].hash_key == partition_key_hash("device-1")


def test_a_plain_record_is_one_user_record_with_its_own_keys() -> None:
    assert deaggregate(b"plain", "k", "7", sequence_number="1") == [
        UserRecord("k", "7", b"plain", "1", 0, False)
    ]
    # the KCL's rule: a checksum that does not match is not an aggregate, whatever the magic
    tampered = bytearray(encode_aggregate(RECORDS))
    tampered[-1] ^= 0xFF
    (record,) = deaggregate(bytes(tampered), "k")
    assert record.data == bytes(tampered)
    assert not record.aggregated


def test_a_corrupt_aggregate_is_raised_or_skipped_and_counted() -> None:
    with pytest.raises(AggregationFormatError):
        deaggregate(corrupt_aggregate(), "k")
    deaggregator = Deaggregator(on_corrupt="skip")
    assert deaggregator.record(corrupt_aggregate(), "k") == []
    assert deaggregator.record(b"fine", "k") == [UserRecord("k", None, b"fine")]
    assert (deaggregator.records_in, deaggregator.corrupt, deaggregator.user_records_out) == (
        2,
        1,
        1,
    )
    with pytest.raises(ValueError, match="on_corrupt"):
        Deaggregator(on_corrupt="ignore")  # type: ignore[arg-type]


def test_the_kcl_rule_drops_an_aggregate_with_a_user_record_outside_the_shards_range() -> None:
    low = partition_key_hash("device-1")
    inside = encode_aggregate([("device-1", None, b"x"), ("other", str(low), b"y")])
    straddling = encode_aggregate([("device-1", None, b"x"), ("other", str(low - 1), b"y")])
    deaggregator = Deaggregator(hash_range=(str(low), str(MAX_HASH_KEY)))
    assert len(deaggregator.record(inside, "c")) == 2
    assert deaggregator.record(straddling, "c") == []  # the whole aggregate, as the KCL does
    # a plain record is where the service put it: never dropped
    assert len(deaggregator.record(b"raw", "k", str(low - 1))) == 1
    assert deaggregator.dropped_out_of_range == 2
    assert deaggregator.user_records_out == 3
    with pytest.raises(ValueError, match="hash_range"):
        Deaggregator(hash_range=(5, 4))
    with pytest.raises(ValueError, match="hash_range"):
        Deaggregator(hash_range=(0, MAX_HASH_KEY + 1))


def test_a_lambda_event_is_deaggregated_record_by_record() -> None:
    event = lambda_event(encode_aggregate(RECORDS), b"plain", partition_key="pk")
    records = deaggregate_lambda_event(event)
    assert [
        (r.partition_key, r.data, r.sequence_number, r.sub_sequence_number) for r in records
    ] == [
        ("device-1", b"21.5", "49590", 0),
        ("device-2", b"19.0", "49590", 1),
        ("device-1", b"", "49590", 2),
        ("pk", b"plain", "49591", 0),
    ]


def test_a_bad_lambda_event_gets_a_clear_error_or_a_counted_skip() -> None:
    with pytest.raises(ValueError, match="no 'Records'"):
        deaggregate_lambda_event({"body": "hello"})
    event = lambda_event(b"good")
    event["Records"].append({"kinesis": {"partitionKey": "k", "data": "not base64!"}})  # type: ignore[attr-defined]
    with pytest.raises(AggregationFormatError, match="not base64"):
        deaggregate_lambda_event(event)
    deaggregator = Deaggregator(on_corrupt="skip")
    assert [r.data for r in deaggregator.lambda_event(event)] == [b"good"]
    assert deaggregator.corrupt == 1


def test_getrecords_records_as_boto3_returns_them() -> None:
    page = [
        {"SequenceNumber": "1", "Data": encode_aggregate(RECORDS), "PartitionKey": "c"},
        {"SequenceNumber": "2", "Data": b"raw", "PartitionKey": "k", "ExplicitHashKey": "9"},
    ]
    records = deaggregate_records(page)
    assert [(r.sequence_number, r.sub_sequence_number) for r in records] == [
        ("1", 0),
        ("1", 1),
        ("1", 2),
        ("2", 0),
    ]
    assert records[-1].explicit_hash_key == "9"
    with pytest.raises(AggregationFormatError, match="without 'Data'"):
        deaggregate_records([{"PartitionKey": "k"}])


def test_the_same_user_records_as_aws_kinesis_agg() -> None:
    """Aggregates from AWS's Python aggregator, read by both deaggregators from one Lambda
    event."""
    complete: list[agg_aggregator.AggRecord] = []
    aggregator = agg_aggregator.RecordAggregator(max_size=2048)
    aggregator.on_record_complete(complete.append, execute_on_new_thread=False)
    for i in range(300):
        aggregator.add_user_record(f"key-{i % 17}", f"reading {i}".encode(), None)
    last = aggregator.clear_and_get()
    if last is not None:
        complete.append(last)
    datas = [record.get_contents()[2] for record in complete]
    event = lambda_event(*datas)
    theirs = agg_deaggregator.deaggregate_records(event["Records"])
    ours = deaggregate_lambda_event(event)
    assert len(ours) == len(theirs) == 300
    for mine, their in zip(ours, theirs, strict=True):
        assert mine.partition_key == their["kinesis"]["partitionKey"]
        assert mine.data == base64.b64decode(their["kinesis"]["data"])


def test_malformed_input_is_a_format_error_or_a_counted_skip() -> None:
    bad_key = encode_aggregate([("a", "1_0", b"x"), ("b", None, b"y")])
    with pytest.raises(AggregationFormatError, match="explicit hash key"):
        Deaggregator(hash_range=(0, MAX_HASH_KEY)).record(bad_key, "c")
    with pytest.raises(AggregationFormatError, match="data is a str"):
        deaggregate("aGVsbG8=", "k")  # type: ignore[arg-type]
    with pytest.raises(AggregationFormatError, match="a NoneType"):
        deaggregate_records([None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a list"):
        deaggregate_lambda_event({"Records": None})
    deaggregator = Deaggregator(hash_range=(0, MAX_HASH_KEY), on_corrupt="skip")
    assert deaggregator.record(bad_key, "c") == []
    assert list(deaggregator.records([None, {"Data": b"ok", "PartitionKey": "k"}])) == [  # type: ignore[list-item]
        UserRecord("k", None, b"ok")
    ]
    assert (deaggregator.corrupt, deaggregator.records_in, deaggregator.user_records_out) == (
        2,
        3,
        1,
    )
