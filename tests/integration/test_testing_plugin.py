"""The ``kinesis_emulator`` fixture (``anykpl.testing``) as a user's project meets it: test
files run by a pytest of their own, in a subprocess, which finds the fixture through the
``pytest11`` entry point of the installed package (no ``-p``, no conftest)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's environment: no AWS credentials and no region."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_user=textwrap.dedent(source))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)


def test_a_sync_test_sends_with_sync_producer_and_reads_back(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import os

        from anykpl import SyncProducer


        def test_service(kinesis_emulator):
            assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"  # fake, for the test only
            stream = kinesis_emulator.create_stream("readings", shards=2)
            with SyncProducer(kinesis_emulator.producer_config()) as producer:
                handles = [
                    producer.submit(stream, f"r{i}".encode(), partition_key=f"sensor-{i % 5}")
                    for i in range(200)
                ]
                producer.flush()
            assert all(h.result().success for h in handles)
            records = kinesis_emulator.records(stream)
            assert sorted(r.data for r in records) == sorted(f"r{i}".encode() for i in range(200))
            assert {r.shard_id for r in records} == {
                "shardId-000000000000", "shardId-000000000001"
            }
            assert {r.partition_key for r in records} == {f"sensor-{i}" for i in range(5)}


        def test_every_test_starts_empty(kinesis_emulator):
            client = kinesis_emulator.kinesis_client()
            assert client.list_streams()["StreamNames"] == []
        """,
    )
    result.assert_outcomes(passed=2)


def test_async_tests_on_both_backends_under_anyio(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import anyio
        import pytest

        from anykpl import Producer


        @pytest.fixture(params=["asyncio", "trio"])
        def anyio_backend(request):
            return request.param


        @pytest.mark.anyio
        async def test_service(kinesis_emulator, anyio_backend):
            stream = kinesis_emulator.create_stream(f"events-{anyio_backend}")
            async with Producer(kinesis_emulator.producer_config()) as producer:
                result = await producer.put_record(stream, b"hello", partition_key="k")
            assert result.success
            data = await anyio.to_thread.run_sync(kinesis_emulator.data, stream)
            assert data == [b"hello"]
        """,
    )
    result.assert_outcomes(passed=2)


def test_the_marker_configures_the_emulator(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import pytest

        from anykpl import SyncProducer, errors
        from anykpl.emulator import Faults, Limits


        @pytest.mark.anykpl_emulator(streams={"ready": 3}, limits=Limits.off())
        def test_streams_and_limits(kinesis_emulator):
            client = kinesis_emulator.kinesis_client()
            shards = client.list_shards(StreamName="ready")["Shards"]
            assert len(shards) == 3
            assert kinesis_emulator.client.limits()["enabled"] is False


        @pytest.mark.anykpl_emulator(streams={"s": 1}, faults=Faults(record_failure_rate=1.0))
        def test_faults(kinesis_emulator):
            config = kinesis_emulator.producer_config(record_ttl=1.0)
            with SyncProducer(config) as producer:
                handle = producer.submit("s", b"x", partition_key="k")
                producer.flush()
            with pytest.raises(errors.RecordFailedError):
                handle.result()
            assert kinesis_emulator.data("s") == []


        @pytest.mark.anykpl_emulator("positional")
        def test_bad_marker(kinesis_emulator):
            pass


        @pytest.mark.anykpl_emulator(shards=3)
        def test_unknown_option(kinesis_emulator):
            pass
        """,
    )
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*anykpl_emulator takes keyword arguments only*",
            "*anykpl_emulator: *unexpected keyword argument 'shards'*",
        ]
    )


def test_the_environment_is_restored_after_the_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_PROFILE", "mine")
    result = _run(
        pytester,
        """
        import os


        def test_uses_it(kinesis_emulator):
            assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"
            assert "AWS_PROFILE" not in os.environ  # no real profile while it runs


        def test_after():
            assert os.environ.get("AWS_PROFILE") == "mine"
            assert "AWS_ACCESS_KEY_ID" not in os.environ
        """,
    )
    result.assert_outcomes(passed=2)


def test_the_recipe_s_examples_pass(pytester: pytest.Pytester) -> None:
    """docs/recipes/testing.md stays true: its sync and async tests run as a user's would."""
    recipe = (Path(__file__).resolve().parents[2] / "docs" / "recipes" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", recipe, flags=re.DOTALL)
    runnable = [block for block in blocks if "..." not in block]
    assert len(runnable) == 2
    for number, block in enumerate(runnable):
        pytester.makepyfile(**{f"test_recipe_{number}": block})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=3)  # the sync test, and the async one on both backends
