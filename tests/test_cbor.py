"""The CBOR PutRecords body (``_transport/_cbor.py``) as ``cbor2`` reads it, and CBOR answers
read as the transport reads JSON ones."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anykpl._transport import _cbor

records = st.lists(
    st.fixed_dictionaries(
        {"Data": st.binary(max_size=300), "PartitionKey": st.text(min_size=1, max_size=256)},
        optional={"ExplicitHashKey": st.integers(0, 2**128 - 1).map(str)},
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(records=records, stream=st.text(min_size=1, max_size=128), arn=st.booleans())
def test_a_body_is_what_cbor2_reads(records: list[dict[str, Any]], stream: str, arn: bool) -> None:
    parameters = {"StreamARN" if arn else "StreamName": stream, "Records": records}
    assert cbor2.loads(b"".join(_cbor.put_records_body_parts(parameters))) == parameters


@pytest.mark.parametrize("size", [0, 23, 24, 255, 256, 65535, 65536, 1 << 20])
def test_every_length_of_data_is_written_with_its_own_head(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    parameters = {"StreamName": "s", "Records": [{"Data": bytearray(data), "PartitionKey": "k"}]}
    decoded = cbor2.loads(b"".join(_cbor.put_records_body_parts(parameters)))
    assert decoded["Records"][0]["Data"] == data


def test_bad_records_are_refused() -> None:
    with pytest.raises(TypeError, match="Data must be bytes-like"):
        _cbor.put_records_body_parts({"Records": [{"Data": "text", "PartitionKey": "k"}]})
    with pytest.raises(TypeError, match="PartitionKey must be a str"):
        _cbor.put_records_body_parts({"Records": [{"Data": b"", "PartitionKey": 1}]})
    with pytest.raises(KeyError):
        _cbor.put_records_body_parts({"Records": [{"Data": b""}]})


def test_error_answers_read_as_botocore_reads_json_ones() -> None:
    answer = cbor2.dumps(
        {"__type": "com.amazonaws.kinesis#ResourceNotFoundException", "message": "no stream"}
    )
    assert _cbor.error_answer(_cbor.load(answer), 400) == {
        "Error": {"Code": "ResourceNotFoundException", "Message": "no stream"}
    }
    assert _cbor.error_answer(_cbor.load(b"\xff not cbor"), 502) == {
        "Error": {"Code": "HTTP502", "Message": ""}
    }
    assert _cbor.load(b"") is None
