"""Tests for the aggregated-record codec, ``anykpl._core._wire``.

The encoder is checked against hand-built bytes, against protobuf's own serializer (through the
generated messages of ``aws_kinesis_agg``) and by round trips; the decoder against
``aws_kinesis_agg``'s aggregator, against protobuf's parser, and by fuzzing.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence

import pytest
from aws_kinesis_agg import aggregator, deaggregator, messages_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anykpl._core._records import Record
from anykpl._core._wire import (
    AGGREGATION_OVERHEAD,
    MAGIC,
    AggregateBuilder,
    DecodedRecord,
    KeyFacts,
    deaggregate,
    decode_aggregate,
    encode_aggregate,
    is_aggregated,
    key_table_entry,
)
from anykpl.errors import AggregationFormatError

Entry = tuple[str, str | None, bytes]

# --- strategies -----------------------------------------------------------------------------

keys = st.one_of(
    st.sampled_from(["a", "b", "ключ", "🔑"]),  # small pool: exercises de-duplication
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=256),
)
hash_keys = st.one_of(
    st.none(),
    st.sampled_from(["0", "340282366920938463463374607431768211455"]),
    st.integers(0, 2**128 - 1).map(str),
)
entries = st.tuples(keys, hash_keys, st.binary(max_size=300))
entry_lists = st.lists(entries, max_size=25)

fuzz_settings = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- helpers --------------------------------------------------------------------------------


def frame(protobuf: bytes) -> bytes:
    """Magic + protobuf + a matching MD5: lets corrupt protobuf through to the parser."""
    return MAGIC + protobuf + hashlib.md5(protobuf).digest()


def protobuf_of(aggregate: bytes) -> bytes:
    return aggregate[len(MAGIC) : -16]


def as_decoded(records: Sequence[Entry]) -> list[DecodedRecord]:
    return [DecodedRecord(pk, ehk, data) for pk, ehk, data in records]


def reference_message(records: Sequence[Entry]) -> messages_pb2.AggregatedRecord:
    """What the KPL's kinesis_record.cc builds (KeySet de-duplication), in protobuf proper."""
    message = messages_pb2.AggregatedRecord()
    pk_indices: dict[str, int] = {}
    ehk_indices: dict[str, int] = {}
    for pk, ehk, data in records:
        record = message.records.add()
        if pk not in pk_indices:
            pk_indices[pk] = len(pk_indices)
            message.partition_key_table.append(pk)
        record.partition_key_index = pk_indices[pk]
        if ehk is not None:
            if ehk not in ehk_indices:
                ehk_indices[ehk] = len(ehk_indices)
                message.explicit_hash_key_table.append(ehk)
            record.explicit_hash_key_index = ehk_indices[ehk]
        record.data = data
    return message


def decode_or_error(data: bytes) -> list[DecodedRecord] | None:
    """Decode; None for AggregationFormatError. Any other exception fails the test."""
    try:
        return decode_aggregate(data)
    except AggregationFormatError as exc:
        message = str(exc)
    assert message.startswith(("corrupt aggregated record: ", "not an aggregated record: "))
    return None


# --- the encoder ----------------------------------------------------------------------------


def test_constants() -> None:
    assert MAGIC == b"\xf3\x89\x9a\xc2"
    assert AGGREGATION_OVERHEAD == 20


def test_empty_builder() -> None:
    builder = AggregateBuilder()
    assert len(builder) == 0
    assert builder.size == 20
    assert builder.serialize() == MAGIC + hashlib.md5(b"").digest()
    assert decode_aggregate(builder.serialize()) == []
    assert repr(builder) == "<AggregateBuilder records=0 size=20>"


def test_golden_two_records() -> None:
    builder = AggregateBuilder()
    assert builder.add("a", None, b"hello") == 0
    assert builder.add("b", "123", b"") == 1
    protobuf = bytes(
        [
            *(0x0A, 0x01, ord("a")),  # partition_key_table: "a"
            *(0x0A, 0x01, ord("b")),  # partition_key_table: "b"
            *(0x12, 0x03, *b"123"),  # explicit_hash_key_table: "123"
            *(0x1A, 0x09),  # records, 9 bytes:
            *(0x08, 0x00),  # .partition_key_index = 0 (no EHK index: none was given)
            *(0x1A, 0x05, *b"hello"),  # .data = "hello"
            *(0x1A, 0x06),  # records, 6 bytes:
            *(0x08, 0x01),  # .partition_key_index = 1
            *(0x10, 0x00),  # .explicit_hash_key_index = 0
            *(0x1A, 0x00),  # .data = ""
        ]
    )
    expected = b"\xf3\x89\x9a\xc2" + protobuf + hashlib.md5(protobuf).digest()
    serialized = builder.serialize()
    assert list(serialized) == list(expected)
    assert serialized[-16:].hex() == "f22267b6b4d6dde74e4767f456fe6d9c"
    # The KPL's accurate-size rule (kinesis_record_test.cc::AccurateSize).
    assert builder.size == len(serialized) == 20 + len(protobuf) == 50
    assert len(builder) == 2
    assert (
        protobuf
        == reference_message([("a", None, b"hello"), ("b", "123", b"")]).SerializeToString()
    )


def test_key_tables_are_deduplicated_in_first_seen_order() -> None:
    records: list[Entry] = [
        ("b", None, b"1"),
        ("a", "7", b"2"),
        ("b", "7", b"3"),
        ("a", None, b"4"),
        ("c", "5", b"5"),
    ]
    message = messages_pb2.AggregatedRecord()
    message.ParseFromString(protobuf_of(encode_aggregate(records)))
    assert list(message.partition_key_table) == ["b", "a", "c"]
    assert list(message.explicit_hash_key_table) == ["7", "5"]
    assert [r.partition_key_index for r in message.records] == [0, 1, 0, 1, 2]
    # An EHK index only where the user gave an EHK.
    with_index = [r for r in message.records if r.HasField("explicit_hash_key_index")]
    assert [r.data for r in with_index] == [b"2", b"3", b"5"]
    assert [r.explicit_hash_key_index for r in with_index] == [0, 0, 1]


# 16_376 and 16_380: the record's length crosses a varint boundary, its data length does not.
@pytest.mark.parametrize(
    "data_len", [0, 1, 127, 128, 16_376, 16_380, 16_383, 16_384, 2**21 - 1, 2**21]
)
def test_size_across_varint_boundaries(data_len: int) -> None:
    builder = AggregateBuilder()
    builder.add("first", None, b"x")
    predicted = builder.size_with("k" * 300, "9" * 39, data_len)
    builder.add("k" * 300, "9" * 39, bytes(data_len))
    serialized = builder.serialize()
    assert predicted == builder.size == len(serialized)
    assert (
        protobuf_of(serialized)
        == reference_message(
            [("first", None, b"x"), ("k" * 300, "9" * 39, bytes(data_len))]
        ).SerializeToString()
    )


def test_slow_paths_match_protobuf() -> None:
    # Beyond the precomputed tables: key table indices past 4095 and 16383, keys past 2047
    # bytes, data past 16383 bytes.
    records: list[Entry] = [(f"k{i}", str(i) if i % 3 else None, b"") for i in range(16_500)]
    records += [("x" * 3000, "y" * 2100, bytes(20_000)), ("é" * 1500, None, b"z")]
    builder = AggregateBuilder()
    for index, (pk, ehk, data) in enumerate(records):
        predicted = builder.size_with(pk, ehk, len(data))
        assert builder.add(pk, ehk, data) == index
        assert builder.size == predicted
    serialized = builder.serialize()
    assert len(serialized) == builder.size
    assert protobuf_of(serialized) == reference_message(records).SerializeToString()
    assert decode_aggregate(serialized) == as_decoded(records)


def test_shared_headers_stay_within_their_bound() -> None:
    """Plain records' headers are built once and shared, by key index and data length: more
    of them than the cache keeps (and indices past its rows) still come out right, and the
    cache keeps at most its limit."""
    from anykpl._core import _wire

    records: list[Entry] = [(f"k{i % 5_000}", None, bytes(i % 7)) for i in range(5_000)]
    records += [("k0", None, bytes(length)) for length in range(20_000)]
    builder = AggregateBuilder()
    for pk, ehk, data in records:
        builder.add(pk, ehk, data)
    serialized = builder.serialize()
    assert protobuf_of(serialized) == reference_message(records).SerializeToString()
    rows = _wire._header_rows
    assert len(rows) <= _wire._HEADER_INDEX_LIMIT
    assert sum(map(len, rows)) == _wire._header_count[0] <= _wire._HEADER_CACHE_LIMIT
    for index, row in enumerate(rows):
        for length, header in row.items():
            assert header == _wire._record_header(index, None, length)


def test_serialize_leaves_the_builder_usable() -> None:
    builder = AggregateBuilder()
    builder.add("a", None, b"1")
    first = builder.serialize()
    assert builder.serialize() == first
    builder.add("a", None, b"2")
    assert decode_aggregate(builder.serialize()) == as_decoded(
        [("a", None, b"1"), ("a", None, b"2")]
    )


def test_unencodable_key_leaves_a_valid_aggregate() -> None:
    builder = AggregateBuilder()
    builder.add("a", None, b"1")
    with pytest.raises(UnicodeEncodeError):
        builder.add("\ud800", None, b"2")
    with pytest.raises(UnicodeEncodeError):
        builder.add("b", "\ud800", b"3")
    builder.add("c", "5", b"4")
    serialized = builder.serialize()
    assert builder.size == len(serialized)
    assert decode_aggregate(serialized) == as_decoded([("a", None, b"1"), ("c", "5", b"4")])


@settings(max_examples=100, deadline=None)
@given(entry_lists)
def test_round_trip_and_exact_sizes(records: list[Entry]) -> None:
    builder = AggregateBuilder()
    for index, (pk, ehk, data) in enumerate(records):
        predicted = builder.size_with(pk, ehk, len(data))
        assert builder.add(pk, ehk, data) == index
        assert builder.size == predicted == len(builder.serialize())
        assert len(builder) == index + 1
    serialized = builder.serialize()
    assert serialized == encode_aggregate(records)
    assert is_aggregated(serialized)
    assert decode_aggregate(serialized) == as_decoded(records)
    # The KPL's own bytes: protobuf's serializer on the message kinesis_record.cc builds.
    assert protobuf_of(serialized) == reference_message(records).SerializeToString()


# --- interoperability with aws-kinesis-agg --------------------------------------------------


def lambda_event_record(data: bytes, partition_key: str = "a") -> dict[str, object]:
    return {
        "eventSource": "aws:kinesis",
        "kinesis": {
            "kinesisSchemaVersion": "1.0",
            "partitionKey": partition_key,
            "sequenceNumber": "49590338271490256608559692538361571095921575989136588898",
            "approximateArrivalTimestamp": 1545084650.987,
            "data": base64.b64encode(data).decode("ascii"),
        },
    }


def check_seen_by_aws_kinesis_agg(records: list[Entry], seen: list[dict[str, object]]) -> None:
    assert len(seen) == len(records)
    has_ehk_table = any(ehk is not None for _, ehk, _ in records)
    for (pk, ehk, data), user_record in zip(records, seen, strict=True):
        kinesis = user_record["kinesis"]
        assert isinstance(kinesis, dict)
        assert kinesis["aggregated"] is True
        assert kinesis["partitionKey"] == pk
        assert base64.b64decode(kinesis["data"]) == data
        if ehk is not None:
            assert kinesis["explicitHashKey"] == ehk
        elif not has_ehk_table:
            # With an EHK table it reports entry 0 for records without an index (it reads the
            # index's default value without checking HasField); the KCL reports null.
            assert kinesis["explicitHashKey"] is None


@settings(max_examples=60, deadline=None)
@given(entry_lists.filter(bool))
def test_aws_kinesis_agg_reads_our_records(records: list[Entry]) -> None:
    serialized = encode_aggregate(records)
    seen = deaggregator.deaggregate_records([lambda_event_record(serialized)])
    check_seen_by_aws_kinesis_agg(records, seen)
    boto3_record = {
        "SequenceNumber": "1",
        "ApproximateArrivalTimestamp": 0,
        "Data": serialized,
        "PartitionKey": "a",
    }
    seen = list(deaggregator.iter_deaggregate_records([boto3_record], data_format="Boto3"))
    check_seen_by_aws_kinesis_agg(records, seen)


@settings(max_examples=60, deadline=None)
@given(entry_lists.filter(bool), st.booleans())
def test_we_read_aws_kinesis_agg_records(records: list[Entry], bytes_keys: bool) -> None:
    # Its aggregator stores an EHK only when truthy, and our EHKs never are empty strings.
    complete: list[aggregator.AggRecord] = []
    agg = aggregator.RecordAggregator(max_size=4096)
    agg.on_record_complete(complete.append, execute_on_new_thread=False)
    for pk, ehk, data in records:
        agg.add_user_record(pk.encode() if bytes_keys else pk, data, ehk)
    last = agg.clear_and_get()
    if last is not None:
        complete.append(last)
    decoded: list[DecodedRecord] = []
    for agg_record in complete:
        *_, serialized = agg_record.get_contents()
        decoded += decode_aggregate(serialized)
        # Its records always carry the framing, even a record of one.
        assert deaggregate(serialized, "outer") == decode_aggregate(serialized)
    assert decoded == as_decoded(records)


# --- the decoder ----------------------------------------------------------------------------


def test_is_aggregated() -> None:
    assert is_aggregated(MAGIC + bytes(16))
    assert is_aggregated(bytearray(encode_aggregate([("a", None, b"x")])))
    assert not is_aggregated(MAGIC + bytes(15))
    assert not is_aggregated(b"\xf3\x89\x9a\xc3" + bytes(16))
    assert not is_aggregated(b"")


def test_decoder_accepts_bytes_like() -> None:
    serialized = encode_aggregate([("a", None, b"x"), ("b", "1", b"y")])
    expected = as_decoded([("a", None, b"x"), ("b", "1", b"y")])
    assert decode_aggregate(bytearray(serialized)) == expected
    assert decode_aggregate(memoryview(serialized)) == expected
    assert deaggregate(memoryview(serialized), "outer") == expected


def test_decoder_follows_protobuf_for_valid_non_canonical_input() -> None:
    # Records before the tables, an over-long varint, a repeated field (last wins), unknown
    # fields of every supported wire type, and a tag: all valid protobuf.
    protobuf = bytes(
        [
            *(0x1A, 0x0E),  # records, 14 bytes:
            *(0x08, 0x80, 0x00),  # .partition_key_index = 0, over-long
            *(0x1A, 0x01, *b"x"),  # .data = "x"
            *(0x1A, 0x01, *b"y"),  # .data = "y" (the last one wins)
            *(0x22, 0x03, 0x0A, 0x01, *b"t"),  # .tags: {key: "t"}
            *(0x0A, 0x01, *b"p"),  # partition_key_table: "p"
            *(0x28, 0x96, 0x01),  # unknown field 5, varint
            *(0x31, *bytes(8)),  # unknown field 6, fixed64
            *(0x3A, 0x02, *b"zz"),  # unknown field 7, length-delimited
            *(0x45, *bytes(4)),  # unknown field 8, fixed32
        ]
    )
    message = messages_pb2.AggregatedRecord()
    message.ParseFromString(protobuf)
    assert list(message.partition_key_table) == ["p"]
    assert [r.data for r in message.records] == [b"y"]
    assert decode_aggregate(frame(protobuf)) == [DecodedRecord("p", None, b"y")]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"", "0 bytes, fewer than the 20", id="empty"),
        pytest.param(MAGIC + bytes(15), "19 bytes, fewer than the 20", id="too-short"),
        pytest.param(b"\x00\x89\x9a\xc2" + bytes(16), "starts with 00899ac2", id="no-magic"),
        pytest.param(
            encode_aggregate([("a", None, b"x")])[:-1] + b"\x00", "MD5", id="md5-mismatch"
        ),
        pytest.param(encode_aggregate([("a", None, b"x")]) + b"\x00", "MD5", id="trailing-bytes"),
        pytest.param(frame(b"\x0a"), "truncated varint at byte 5", id="truncated-varint"),
        pytest.param(frame(b"\x0a\x05ab"), "length 5 runs past the end", id="truncated-length"),
        pytest.param(frame(b"\x0a\x01a\x80"), "truncated varint at byte 7", id="trailing-garbage"),
        pytest.param(
            frame(b"\x28" + b"\xff" * 10 + b"\x01"), "longer than 10 bytes", id="long-varint"
        ),
        pytest.param(
            frame(b"\x28" + b"\xff" * 9 + b"\x7f"), "exceeds 64 bits", id="varint-overflow"
        ),
        pytest.param(frame(b"\x00"), "field number 0 at byte 4", id="field-zero"),
        pytest.param(frame(b"\x2b"), "unsupported wire type 3", id="group"),
        pytest.param(frame(b"\x2e"), "unsupported wire type 6", id="bad-wire-type"),
        pytest.param(frame(b"\x2d\x00"), "truncated fixed-width field", id="truncated-fixed32"),
        pytest.param(
            frame(b"\x08\x01"), "partition_key_table has wire type 0", id="table-wire-type"
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x02\x09\x00"),
            "Record.partition_key_index has wire type 1",
            id="index-wire-type",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x04\x08\x00\x18\x00"),
            "Record.data has wire type 0",
            id="data-wire-type",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x04\x08\x00\x20\x00"),
            "Record.tags has wire type 0",
            id="tags-wire-type",
        ),
        pytest.param(
            frame(b"\x1a\x02\x1a\x00"),
            "missing its required partition_key_index",
            id="missing-index",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x02\x08\x00"), "missing its required data", id="missing-data"
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x06\x08\x00\x1a\x00\x22\x00"),
            "Tag is missing its required key",
            id="tag-missing-key",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x04\x08\x01\x1a\x00"),
            "partition_key_index 1 is out of range for a table of 1",
            id="pk-index-range",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x06\x08\x00\x10\x00\x1a\x00"),
            "explicit_hash_key_index 0 is out of range for a table of 0",
            id="ehk-index-range",
        ),
        pytest.param(
            frame(b"\x0a\x01\xff"),
            "partition_key_table entry is not valid UTF-8 at byte 6",
            id="pk-utf8",
        ),
        pytest.param(
            frame(b"\x12\x02\xc3\x28"),
            "explicit_hash_key_table entry is not valid UTF-8",
            id="ehk-utf8",
        ),
        pytest.param(
            frame(b"\x0a\x01a\x1a\x09\x08\x00\x1a\x00\x22\x03\x0a\x01\xff"),
            "Tag.key is not valid UTF-8",
            id="tag-utf8",
        ),
    ],
)
def test_corruption_is_reported_readably(data: bytes, message: str) -> None:
    with pytest.raises(AggregationFormatError, match=message):
        decode_aggregate(data)


@fuzz_settings
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decode_or_error(data)
    decode_or_error(MAGIC + data)
    # With a matching MD5 the bytes reach the protobuf parser.
    decoded = decode_or_error(frame(data))
    if decoded is not None:
        # Whatever we accept, protobuf accepts and reads the same way.
        check_agrees_with_protobuf(data, decoded)


def check_agrees_with_protobuf(protobuf: bytes, decoded: list[DecodedRecord]) -> None:
    message = messages_pb2.AggregatedRecord()
    message.ParseFromString(protobuf)
    pks = list(message.partition_key_table)
    ehks = list(message.explicit_hash_key_table)
    assert decoded == [
        DecodedRecord(
            pks[r.partition_key_index],
            ehks[r.explicit_hash_key_index] if r.HasField("explicit_hash_key_index") else None,
            r.data,
        )
        for r in message.records
    ]


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire_type) + payload


def length_delimited(number: int, payload: bytes) -> bytes:
    return field(number, 2, varint(len(payload)) + payload)


small_ints = st.integers(0, 3) | st.integers(0, 2**64 - 1)
unknown_fields = st.one_of(
    st.builds(lambda n, v: field(n, 0, varint(v)), st.integers(5, 40), small_ints),
    st.builds(lambda n, b: length_delimited(n, b), st.integers(5, 40), st.binary(max_size=4)),
    st.builds(lambda n, b: field(n, 1, b), st.integers(5, 40), st.binary(min_size=8, max_size=8)),
    st.builds(lambda n, b: field(n, 5, b), st.integers(5, 40), st.binary(min_size=4, max_size=4)),
    st.binary(min_size=1, max_size=3),  # garbage
)
strings = st.text(max_size=3).map(str.encode) | st.binary(max_size=3)
tag_fields = st.one_of(
    st.builds(lambda s: length_delimited(1, s), strings),
    st.builds(lambda s: length_delimited(2, s), strings),
    unknown_fields,
)
record_fields = st.one_of(
    st.builds(lambda v: field(1, 0, varint(v)), small_ints),
    st.builds(lambda v: field(2, 0, varint(v)), small_ints),
    st.builds(lambda b: length_delimited(3, b), st.binary(max_size=5)),
    st.builds(lambda fs: length_delimited(4, b"".join(fs)), st.lists(tag_fields, max_size=3)),
    unknown_fields,
)
aggregate_fields = st.one_of(
    st.builds(lambda s: length_delimited(1, s), strings),
    st.builds(lambda s: length_delimited(2, s), strings),
    st.builds(lambda fs: length_delimited(3, b"".join(fs)), st.lists(record_fields, max_size=6)),
    unknown_fields,
)


@fuzz_settings
@given(st.lists(aggregate_fields, max_size=8).map(b"".join))
def test_fuzz_protobuf_shaped_input(protobuf: bytes) -> None:
    decoded = decode_or_error(frame(protobuf))
    if decoded is not None:
        check_agrees_with_protobuf(protobuf, decoded)


@fuzz_settings
@given(entry_lists, st.data())
def test_fuzz_damaged_aggregates(records: list[Entry], data: st.DataObject) -> None:
    serialized = bytearray(encode_aggregate(records))
    position = data.draw(st.integers(0, len(serialized) - 1), label="position")
    damaged = bytearray(serialized)
    damaged[position] ^= data.draw(st.integers(1, 255), label="xor")
    decode_or_error(bytes(damaged))
    # Damage inside the protobuf, with the MD5 recomputed so that the parser sees it.
    protobuf = bytearray(protobuf_of(bytes(serialized)))
    if protobuf:
        position = data.draw(st.integers(0, len(protobuf) - 1), label="protobuf position")
        protobuf[position] ^= data.draw(st.integers(1, 255), label="protobuf xor")
        decoded = decode_or_error(frame(bytes(protobuf)))
        if decoded is not None:
            check_agrees_with_protobuf(bytes(protobuf), decoded)
    # Truncation: the MD5 no longer matches; with it recomputed, the parser sees the cut.
    cut = data.draw(st.integers(0, len(serialized) - 1), label="cut")
    assert decode_or_error(bytes(serialized[:cut])) is None
    truncated = protobuf_of(bytes(serialized))[:cut]
    decoded = decode_or_error(frame(truncated))
    if decoded is not None:
        check_agrees_with_protobuf(truncated, decoded)


# --- deaggregate ----------------------------------------------------------------------------


def test_deaggregate_decodes_aggregates() -> None:
    records: list[Entry] = [("a", None, b"1"), ("b", "42", b"2")]
    assert deaggregate(encode_aggregate(records), "outer", "7") == as_decoded(records)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"plain user data", id="plain"),
        pytest.param(MAGIC + b"0123456789abcdef0", id="magic-bad-md5"),
        pytest.param(encode_aggregate([("a", None, b"x")])[:-1], id="truncated-aggregate"),
        # Exactly magic + MD5 of nothing: the KCL wants more than 16 bytes after the magic.
        pytest.param(MAGIC + hashlib.md5(b"").digest(), id="empty-aggregate"),
    ],
)
def test_deaggregate_falls_back_to_a_plain_record_like_the_kcl(data: bytes) -> None:
    assert deaggregate(data, "pk", "12") == [DecodedRecord("pk", "12", data)]
    assert deaggregate(data, "pk") == [DecodedRecord("pk", None, data)]


def test_deaggregate_raises_on_corrupt_protobuf_behind_a_good_md5() -> None:
    with pytest.raises(AggregationFormatError, match="out of range"):
        deaggregate(frame(b"\x1a\x04\x08\x00\x1a\x00"), "pk")


@fuzz_settings
@given(st.binary(max_size=100), keys, hash_keys)
def test_fuzz_deaggregate(data: bytes, partition_key: str, explicit_hash_key: str | None) -> None:
    for candidate in (data, MAGIC + data, frame(data)):
        try:
            result = deaggregate(candidate, partition_key, explicit_hash_key)
        except AggregationFormatError:
            continue
        if result != [DecodedRecord(partition_key, explicit_hash_key, candidate)]:
            assert result == decode_aggregate(candidate)


@settings(max_examples=50, deadline=None)
@given(
    records=st.lists(
        st.tuples(
            st.sampled_from(["a", "bb", "ключ", "k" * 200]),
            st.none() | st.integers(0, 2**128 - 1).map(str),
            st.binary(max_size=300),
        ),
        max_size=30,
    ),
    limit=st.integers(20, 3000),
)
def test_add_within_agrees_with_size_with(
    records: list[tuple[str, str | None, bytes]], limit: int
) -> None:
    builder = AggregateBuilder()
    for pk, ehk, data in records:
        predicted = builder.size_with(pk, ehk, len(data))
        before = builder.size
        added = builder.add_within(pk, ehk, data, limit)
        assert added == (predicted <= limit)
        assert builder.size == (predicted if added else before)
        assert builder.size == len(builder.serialize())


# --- keys the producer's key cache knows (add_key_within) -----------------------------------


def facts_of(key: str) -> KeyFacts:
    encoded = key.encode()
    return KeyFacts(key, 0, len(encoded), key_table_entry(encoded))


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["a", "bb", "ключ", "k" * 200])).flatmap(
            lambda t: st.tuples(st.just(t[0]), st.just(t[1]), st.binary(max_size=300))
        ),
        max_size=40,
    ),
    limit=st.integers(20, 3000),
)
def test_keys_known_by_their_facts_aggregate_as_the_kpl_does(
    records: list[tuple[int, str, bytes]], limit: int
) -> None:
    """Records spread over up to four builders in turn, each key's facts shared by all: every
    aggregate decodes to its own records and is as big as it says; while no key goes to more
    than two aggregates, each is byte for byte what the KPL builds (keys de-duplicated) and
    takes exactly the records that fit."""
    facts: dict[str, KeyFacts] = {}
    builders = [AggregateBuilder() for _ in range(4)]
    references = [AggregateBuilder() for _ in range(4)]  # by the keys' text: exact de-dup
    kept: list[list[Entry]] = [[] for _ in range(4)]
    exact = all(len({w for w, p, _ in records if p == pk}) <= 2 for _, pk, _ in records)
    for which, pk, data in records:
        builder = builders[which]
        before = builder.size
        added = builder.add_key_within(facts.setdefault(pk, facts_of(pk)), data, limit)
        assert builder.size == len(builder.serialize())
        assert builder.size <= limit if added else builder.size == before
        if exact:
            assert added == references[which].add_within(pk, None, data, limit)
            assert builder.size == references[which].size
        if added:
            kept[which].append((pk, None, data))
    for builder, entries_kept in zip(builders, kept, strict=True):
        serialized = builder.serialize()
        assert decode_aggregate(serialized) == as_decoded(entries_kept)
        if exact:
            assert serialized == encode_aggregate(entries_kept)
        # whatever the rotation, a key is in a table at most twice
        message = messages_pb2.AggregatedRecord()
        message.ParseFromString(protobuf_of(serialized))
        table = list(message.partition_key_table)
        assert all(table.count(pk) <= 2 for pk in table)


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.lists(
                st.tuples(st.sampled_from(["a", "bb", "ключ", "k" * 200]), st.binary(max_size=300)),
                max_size=12,
            ),
        ),
        max_size=12,
    ),
    limit=st.integers(20, 3000),
)
def test_a_run_of_known_keys_aggregates_as_its_records_one_by_one(
    runs: list[tuple[int, list[tuple[str, bytes]]]], limit: int
) -> None:
    """AggregateBuilder.add_keys_within (a batch's records of one shard in one call) and
    add_items_within (a column batch's items, by position) take the records add_key_within
    takes one by one, stop at the same one, and leave the same aggregates and the same facts,
    keys rotating among four builders (some to more than two)."""
    singly = [AggregateBuilder() for _ in range(4)]
    in_runs = [AggregateBuilder() for _ in range(4)]
    in_columns = [AggregateBuilder() for _ in range(4)]
    facts_singly: dict[str, KeyFacts] = {}
    facts_in_runs: dict[str, KeyFacts] = {}
    facts_in_columns: dict[str, KeyFacts] = {}
    for which, run in runs:
        # add_items_within: the run's items in columns, in reverse, with others between them
        # (positions say where each is), from the second position on
        keys = [facts_in_columns.setdefault(pk, facts_of(pk)) for pk, _ in reversed(run)]
        datas = [data for _, data in reversed(run)]
        keys += [facts_of("other")] * 3
        datas += [b"other"] * 3
        positions = [len(run)] + [len(run) - 1 - p for p in range(len(run))]
        added = in_columns[which].add_items_within(keys, datas, positions, 1, len(positions), limit)
        taken = len(run)
        for pk, _ in run:
            facts_singly.setdefault(pk, facts_of(pk))
        for position, (pk, data) in enumerate(run):
            if not singly[which].add_key_within(facts_singly[pk], data, limit):
                taken = position
                break
        records = [
            Record(
                "s",
                pk,
                data,
                0,
                None,
                0.0,
                0.0,
                0.0,
                None,
                facts_in_runs.setdefault(pk, facts_of(pk)),
            )
            for pk, data in run
        ]
        # a start other than 0: the run from the list's second record on
        records.insert(0, records[0] if records else Record("s", "a", b"", 0, None, 0.0, 0.0, 0.0))
        assert in_runs[which].add_keys_within(records, 1, len(records), limit) == taken + 1
        assert added == taken + 1
    for one, other, third in zip(singly, in_runs, in_columns, strict=True):
        assert len(one) == len(other) == len(third)
        assert one.size == other.size == third.size
        assert one.serialize() == other.serialize() == third.serialize()

    def tables(facts: dict[str, KeyFacts], builders: list[AggregateBuilder]) -> list[object]:
        number = {b._token: n for n, b in enumerate(builders)}
        return [
            (pk, number.get(f.table), f.index, number.get(f.other_table), f.other_index)
            for pk, f in sorted(facts.items())
        ]

    assert tables(facts_singly, singly) == tables(facts_in_runs, in_runs)
    assert tables(facts_singly, singly) == tables(facts_in_columns, in_columns)


def test_a_key_put_to_two_aggregates_in_turn_keeps_one_entry_in_each() -> None:
    key = facts_of("device-1")
    first, second = AggregateBuilder(), AggregateBuilder()
    for n in range(3):
        assert first.add_key_within(key, b"%d" % n, math.inf)
        assert second.add_key_within(key, b"%d" % n, math.inf)
    for builder in (first, second):
        message = messages_pb2.AggregatedRecord()
        message.ParseFromString(protobuf_of(builder.serialize()))
        assert list(message.partition_key_table) == ["device-1"]
        assert [r.partition_key_index for r in message.records] == [0, 0, 0]
    # a third aggregate in the rotation, and a fourth: each decodes right, and the older
    # aggregates take the key once more at most (looked up by its text from then on), not
    # once per record
    third, fourth = AggregateBuilder(), AggregateBuilder()
    for _ in range(50):
        for builder in (first, second, third, fourth):
            assert builder.add_key_within(key, b"x", math.inf)
    for builder, count in ((first, 53), (second, 53), (third, 50), (fourth, 50)):
        decoded = decode_aggregate(builder.serialize())
        assert [r.partition_key for r in decoded] == ["device-1"] * count
        message = messages_pb2.AggregatedRecord()
        message.ParseFromString(protobuf_of(builder.serialize()))
        assert len(message.partition_key_table) <= 2


def test_a_key_that_does_not_fit_is_not_taken_into_the_table() -> None:
    key = facts_of("k" * 100)
    builder = AggregateBuilder()
    assert not builder.add_key_within(key, b"x" * 50, AGGREGATION_OVERHEAD + 100)
    assert builder.size == AGGREGATION_OVERHEAD
    assert key.table == 0
    assert builder.add_key_within(key, b"x" * 50, math.inf)
    assert decode_aggregate(builder.serialize()) == as_decoded([("k" * 100, None, b"x" * 50)])


def test_a_key_added_by_its_text_and_by_its_facts_decodes_the_same() -> None:
    builder = AggregateBuilder()
    assert builder.add_within("a", None, b"1", math.inf)
    assert builder.add_key_within(facts_of("a"), b"2", math.inf)
    assert builder.add_within("a", "5", b"3", math.inf)
    assert decode_aggregate(builder.serialize()) == as_decoded(
        [("a", None, b"1"), ("a", None, b"2"), ("a", "5", b"3")]
    )
