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
        "Error": {"Code": "502", "Message": ""}
    }
    assert _cbor.load(b"") is None


class _Direct:
    """Answers the probe's exchange with what the test queued."""

    def __init__(self, answers: list[Any], emulators: tuple[str, ...] = ()) -> None:
        self.answers = answers
        self.bodies: list[Any] = []
        self.stores_cbor_as_sent = set(emulators)

    async def exchange(self, route: Any, body: Any, payload: Any) -> Any:
        self.bodies.append(cbor2.loads(bytes(body)))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _route(url: str) -> Any:
    from anykpl._transport._botocore import _Route

    return _Route(url, "host", {}, "us-east-1", "kinesis")


def _cbor_error(code: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    body = cbor2.dumps({"__type": code, "message": "..."})
    return 400, {"Content-Type": _cbor.CBOR_CONTENT_TYPE, **headers}, body


class _Spawned:
    """Stands for the transport's task group: keeps the probes it is asked to start."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __call__(self, fn: Any, *args: Any) -> None:
        self.calls.append((fn, args))

    async def run_last(self) -> None:
        fn, args = self.calls[-1]
        await fn(*args)


@pytest.mark.anyio
async def test_the_probe_runs_apart_decides_once_and_asks_again_after_no_answer() -> None:
    from anykpl._transport._botocore import PROBE_RETRY, _CborProbe

    now = [0.0]
    spawned = _Spawned()
    probe = _CborProbe(lambda: now[0], spawned, 5.0)
    emulator = _route("http://127.0.0.1:4567")
    direct = _Direct(
        [TimeoutError("read timeout"), _cbor_error("ResourceNotFoundException")],
        emulators=("http://127.0.0.1:4567",),  # its answers said it stores CBOR as sent
    )
    assert not probe.takes_cbor(direct, emulator, "s")  # JSON while the probe runs apart
    assert len(spawned.calls) == 1
    assert not probe.takes_cbor(direct, emulator, "s")  # one probe at a time
    assert len(spawned.calls) == 1
    await spawned.run_last()  # no answer
    assert not probe.takes_cbor(direct, emulator, "s")  # not asked again yet
    assert len(spawned.calls) == 1
    now[0] += PROBE_RETRY
    assert not probe.takes_cbor(direct, emulator, "s")
    assert len(spawned.calls) == 2
    await spawned.run_last()
    assert probe.takes_cbor(direct, emulator, "s")
    assert probe.decided(emulator.url)
    assert len(spawned.calls) == 2  # known: not asked again
    sent = direct.bodies[0]
    assert sent["StreamName"].startswith("anykpl-cbor-probe-")  # a stream that does not exist
    assert sent["Records"][0]["Data"] == b"\x00\xff anykpl"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "answer",
    [
        (503, {"Content-Type": "text/html"}, b"busy"),
        _cbor_error("ThrottlingException"),
        _cbor_error("ExpiredTokenException"),
    ],
)
async def test_an_answer_that_says_nothing_of_cbor_is_asked_again(answer: Any) -> None:
    from anykpl._transport._botocore import PROBE_RETRY, _CborProbe

    now = [0.0]
    spawned = _Spawned()
    probe = _CborProbe(lambda: now[0], spawned, 5.0)
    aws = _route("https://kinesis.us-east-1.amazonaws.com")
    direct = _Direct([answer, _cbor_error("AccessDeniedException")])
    assert not probe.takes_cbor(direct, aws, "s")
    await spawned.run_last()
    now[0] += PROBE_RETRY
    assert not probe.takes_cbor(direct, aws, "s")
    assert len(spawned.calls) == 2
    await spawned.run_last()
    assert probe.takes_cbor(direct, aws, "s")


@pytest.mark.anyio
async def test_a_probe_that_hangs_ends_at_its_timeout() -> None:
    import anyio

    from anykpl._transport._botocore import _CborProbe

    class Hanging(_Direct):
        async def exchange(self, route: Any, body: Any, payload: Any) -> Any:
            await anyio.sleep_forever()

    spawned = _Spawned()
    probe = _CborProbe(lambda: 0.0, spawned, 0.05)
    aws = _route("https://kinesis.us-east-1.amazonaws.com")
    assert not probe.takes_cbor(Hanging([]), aws, "s")
    with anyio.fail_after(5):
        await spawned.run_last()
    assert not probe.decided(aws.url)


def test_an_error_code_is_read_as_botocore_reads_it() -> None:
    headers = {"X-Amzn-ErrorType": "ResourceNotFoundException:http://internal.amazon.com/x"}
    assert _cbor.error_answer({}, 400, headers)["Error"]["Code"] == "ResourceNotFoundException"
    answer = {"__type": "aws#InvalidSignatureException:extra", "message": "no"}
    assert _cbor.error_answer(answer, 403)["Error"] == {
        "Code": "InvalidSignatureException",
        "Message": "no",
    }
    assert _cbor.error_answer({}, 403)["Error"]["Code"] == "403"


def test_a_memoryview_of_wide_items_is_written_as_its_bytes() -> None:
    import array

    data = memoryview(array.array("i", [1, 2, 3]))
    parameters = {"StreamName": "s", "Records": [{"Data": data, "PartitionKey": "k"}]}
    decoded = cbor2.loads(b"".join(_cbor.put_records_body_parts(parameters)))
    assert decoded["Records"][0]["Data"] == data.tobytes()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("url", "answer", "cbor"),
    [
        # AWS's own endpoints store CBOR as sent: an AccessDenied answer shows it parsed it
        ("https://kinesis.us-east-1.amazonaws.com", _cbor_error("AccessDeniedException"), True),
        (
            "https://vpce-1.kinesis.us-east-1.vpce.amazonaws.com",
            _cbor_error("ResourceNotFoundException"),
            True,
        ),
        # a JSON answer, a 500, a parse error
        (
            "https://kinesis.us-east-1.amazonaws.com",
            (500, {"Content-Type": "text/html"}, b"<html>"),
            False,
        ),
        ("https://kinesis.us-east-1.amazonaws.com", _cbor_error("SerializationException"), False),
    ],
)
async def test_the_probes_verdict(url: str, answer: Any, cbor: bool) -> None:
    from anykpl._transport._botocore import _CborProbe

    spawned = _Spawned()
    probe = _CborProbe(lambda: 0.0, spawned, 5.0)
    arn = "arn:aws:kinesis:us-east-1:123456789012:stream/events"
    direct = _Direct([answer])
    assert not probe.takes_cbor(direct, _route(url), arn)
    await spawned.run_last()
    assert probe.takes_cbor(direct, _route(url), arn) is cbor
    probed = direct.bodies[0]["StreamARN"]
    assert probed.startswith("arn:aws:kinesis:us-east-1:123456789012:stream/anykpl-cbor-probe-")


@pytest.mark.anyio
async def test_an_endpoint_that_is_not_aws_nor_the_emulator_is_not_asked() -> None:
    """kinesalite answers the probe just as Kinesis does, and stores CBOR data wrongly: an
    endpoint anykpl cannot vouch for stays JSON, and no probe reaches it (a user's stub or
    proxy never sees one)."""
    from anykpl._transport._botocore import _CborProbe

    spawned = _Spawned()
    probe = _CborProbe(lambda: 0.0, spawned, 5.0)
    direct = _Direct([_cbor_error("ResourceNotFoundException")])
    assert not probe.takes_cbor(direct, _route("http://localhost:4567"), "s")
    assert not probe.takes_cbor(direct, _route("http://localhost:4567"), "s")
    assert spawned.calls == []
