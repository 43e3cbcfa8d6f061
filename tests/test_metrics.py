"""KPL metric counters: each data point counts at its own level and at every level above."""

from __future__ import annotations

from anykpl._metrics import MetricKey, Metrics


def test_points_feed_their_ancestors() -> None:
    m = Metrics()
    m.add("UserRecordsPut", 3, "s1", "shardId-000000000000", None)
    m.add("UserRecordsPut", 2, "s1", "shardId-000000000001", None)
    m.add("UserRecordsPut", 5, "s2", "shardId-000000000000", None)
    snapshot = m.snapshot()
    assert snapshot[MetricKey("UserRecordsPut")] == 10
    assert snapshot[MetricKey("UserRecordsPut", "s1")] == 5
    assert snapshot[MetricKey("UserRecordsPut", "s1", "shardId-000000000001")] == 2
    # 2 streams x 2 shards... here 3 shard-level, 2 stream-level, 1 global: the KPL's counting
    assert len([k for k in snapshot if k.name == "UserRecordsPut"]) == 6


def test_error_codes_are_a_dimension() -> None:
    m = Metrics()
    m.add("ErrorsByCode", 2, "s", "shardId-000000000000", "ProvisionedThroughputExceededException")
    m.add("ErrorsByCode", 1, "s", None, "InternalFailure")
    assert m.by_error_code() == {
        "ProvisionedThroughputExceededException": 2,
        "InternalFailure": 1,
    }
    snapshot = m.snapshot()
    assert snapshot[MetricKey("ErrorsByCode", error_code="InternalFailure")] == 1
