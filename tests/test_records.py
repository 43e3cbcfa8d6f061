"""PendingRecord's completion hook, without an event loop (the rest of PendingRecord is tested
through the producer in test_producer.py)."""

from __future__ import annotations

import logging

import pytest

from anykpl import PendingRecord, errors
from anykpl._records import AttemptRecord


def make_record() -> PendingRecord:
    return PendingRecord("stream", "key", b"data", 1, None, 0.0, 0.0, 0.0)


def hook_of(record: PendingRecord) -> object:
    return record._on_done


@pytest.mark.parametrize("success", [True, False])
def test_the_hook_is_called_once_with_the_terminal_record(success: bool) -> None:
    record = make_record()
    record._add_attempt(AttemptRecord(0.0, 0.1, success, None if success else "Code", "msg"))
    seen: list[tuple[PendingRecord, bool]] = []
    record._on_done = lambda r: seen.append((r, r.done()))
    record._resolve(success)
    assert seen == [(record, True)]
    assert hook_of(record) is None  # cleared: it holds nothing once it has run
    record._resolve(success)  # resolved again (the producer never does): no second call
    assert len(seen) == 1
    if success:
        assert record.result().success
    else:
        with pytest.raises(errors.RecordFailedError):
            record.result()


def test_a_record_without_a_hook_resolves() -> None:
    record = make_record()
    record._resolve(True)
    assert record.done()


def test_a_failing_hook_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    # the hook runs inside the stage that resolves a whole batch: it must not stop the batch
    def broken(record: PendingRecord) -> None:
        raise RuntimeError("hook broke")

    records = [make_record() for _ in range(3)]
    for record in records:
        record._on_done = broken
    with caplog.at_level(logging.ERROR, logger="anykpl.records"):
        for record in records:
            record._resolve(True)
    assert all(record.done() for record in records)
    assert len(caplog.records) == 3
    assert "completion hook" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is not None
