"""``anykpl demo``: the whole run against the emulator on both backends, and its parts.

The end-to-end tests run the demo the way ``anykpl demo --short`` does in CI, only smaller, and
check its exit status and its verdict. They call :func:`anykpl._commands.demo.run` with options
parsed by the demo's own :func:`~anykpl._commands.demo.add_arguments`, as
``anykpl._commands.cli`` does, and start one emulator each (the demo starts its own). A third
run loses a record on purpose, between the stream and the verdict, and must fail. The rest
checks the pieces without an event loop: the verdict, the read-back loop against a fake client,
the device schedule and the statistics."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import ssl
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import anykpl._commands.demo
import anykpl.readback
from anykpl._commands.demo import (
    DeviceGroup,
    LatencyHistogram,
    Progress,
    ShardRate,
    Tally,
    Workload,
    add_arguments,
    run_prefix,
    shard_rates_from_emulator,
    workload_from,
)
from anykpl._core._wire import encode_aggregate
from anykpl.readback import count_user_records, judge, read_user_records

from ..certificates import self_signed


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="anykpl demo")
    add_arguments(parser)
    return parser.parse_args(list(argv))


SHORT = ("--duration", "3", "--devices", "200", "--rate", "2", "--burst-every", "1")


# -- the whole demo -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_puts_reads_back_and_passes(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = anykpl._commands.demo.run(parse(*SHORT, "--backend", backend, "--progress", "plain"))
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS: all " in out
    assert "missing 0" in out
    assert "unexpected 0" in out
    assert f"on {backend}" in out
    # progress lines came out while it ran, with the emulator's per-shard rates
    assert "per shard MiB/s:" in out
    assert "the emulator stored" in out
    acknowledged = int(out.split("PASS: all ")[1].split(" ")[0].replace(",", ""))
    # 200 devices × 2 readings/s × 3 s, plus bursts at 0.5, 1.5 and 2.5 s of 20 devices × 5
    assert 1000 < acknowledged <= 1200 + 300


@pytest.mark.timeout(60)
def test_demo_json_is_one_document_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    status = anykpl._commands.demo.run(parse(*SHORT, "--json", "--progress", "plain"))
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # stdout holds the document and nothing else
    assert status == document["exit_code"] == 0
    assert document["ok"] is True
    assert document["read_back"]["missing"] == 0
    assert document["read_back"]["unexpected"] == 0
    assert document["acknowledged"] == document["read_back"]["present"] > 1000
    assert document["workload"]["devices"] == 200
    # the report and the progress lines went to stderr
    assert "PASS: all " in captured.err
    assert "per shard MiB/s:" in captured.err


@pytest.mark.timeout(60)
def test_demo_fails_when_an_acknowledged_record_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = anykpl.readback.count_user_records
    lost: list[tuple[str, bytes]] = []

    def lose_one(*args: Any, **kwargs: Any) -> tuple[Counter[tuple[str, bytes]], int]:
        found, left_out = real(*args, **kwargs)
        record = min(found)
        del found[record]
        lost.append(record)
        return found, left_out

    monkeypatch.setattr(anykpl.readback, "count_user_records", lose_one)
    # and without rich, as after a plain ``pip install anykpl[emulator]``
    monkeypatch.setattr(anykpl._commands.demo, "_rich_console", lambda: None)
    status = anykpl._commands.demo.run(parse(*SHORT, "--duration", "1", "--quiet"))
    out = capsys.readouterr().out
    assert status == 1, out
    assert "FAIL: 1 acknowledged records missing" in out
    assert f"missing: {lost[0][0]} {lost[0][1].decode()}" in out
    assert "[" not in out.split("Producer")[0], "--quiet printed progress lines"


# -- an HTTPS endpoint with a self-signed certificate --------------------------------------


@contextmanager
def _tls_proxy(upstream: str, cert_path: Path, key_path: Path) -> Iterator[str]:
    """``https://localhost:PORT`` terminating TLS with the given certificate and passing the
    bytes on to ``upstream`` (an ``http://host:port`` URL), on an event loop in a thread."""
    import asyncio

    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    loop = asyncio.new_event_loop()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass  # a client that gave up on the handshake, or hung up
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=context))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{server.sockets[0].getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        server.close()
        loop.run_until_complete(server.wait_closed())
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


@pytest.fixture(scope="module")
def self_signed_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cert.pem, key.pem): a certificate for localhost that no CA signed; cert.pem is also
    the CA bundle that trusts it."""
    return self_signed(tmp_path_factory.mktemp("tls"))


#: The stream the producer tests over TLS write to (the emulator behind the proxy has it).
TLS_STREAM = "tls-producer"


@pytest.fixture(scope="module")
def self_signed_endpoint(self_signed_certificate: tuple[Path, Path]) -> Iterator[str]:
    """The emulator behind a TLS proxy whose certificate no CA signed."""
    from anykpl.emulator import spawn

    cert_path, key_path = self_signed_certificate
    with (
        spawn(streams={TLS_STREAM: 1}) as upstream,
        _tls_proxy(upstream, cert_path, key_path) as url,
    ):
        yield url


@pytest.mark.timeout(60)
def test_demo_against_a_self_signed_endpoint_ends_in_one_clear_line(
    self_signed_endpoint: str,
) -> None:
    # the real command, so that the test sees what a user sees: status and stderr
    command = [sys.executable, "-m", "anykpl._commands.cli", "demo", *SHORT, "--quiet"]
    command += ["--endpoint", self_signed_endpoint, "--stream", "tls-refused"]
    environment = {**os.environ, "AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=50)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"anykpl demo: TLS with {self_signed_endpoint} failed (certificate verify failed: "
        "self-signed certificate); for a test endpoint with a self-signed certificate, "
        "give its CA with --ca-bundle, or --no-verify skips the check"
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_with_no_verify_runs_over_tls_and_warns(
    backend: str,
    self_signed_endpoint: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "demo")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "demo")
    stream = f"tls-{backend}"
    argv = [*SHORT, "--quiet", "--backend", backend, "--stream", stream, "--region", "us-east-1"]
    status = anykpl._commands.demo.run(
        parse(*argv, "--endpoint", self_signed_endpoint, "--no-verify")
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert (
        "warning: TLS certificate verification is off (--no-verify): anyone between here and "
        f"{self_signed_endpoint} can read and change the traffic"
    ) in out
    assert "PASS: all " in out
    assert "missing 0" in out


def test_no_verify_without_an_endpoint_is_refused() -> None:
    with pytest.raises(SystemExit, match="--no-verify applies to --endpoint only"):
        anykpl._commands.demo.run(parse(*SHORT, "--no-verify"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_with_ca_bundle_checks_the_certificate_and_passes(
    backend: str,
    self_signed_endpoint: str,
    self_signed_certificate: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "demo")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "demo")
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    stream = f"tls-ca-{backend}"
    argv = [*SHORT, "--quiet", "--backend", backend, "--stream", stream, "--region", "us-east-1"]
    argv += ["--endpoint", self_signed_endpoint, "--ca-bundle", str(self_signed_certificate[0])]
    # verification stays on: any warning (urllib3's InsecureRequestWarning) fails the test
    status = anykpl._commands.demo.run(parse(*argv))
    out = capsys.readouterr().out
    assert status == 0, out
    assert "verification is off" not in out
    assert "PASS: all " in out
    assert "missing 0" in out


def test_ca_bundle_and_no_verify_together_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*SHORT, "--endpoint", "https://localhost:1", "--ca-bundle", "ca.pem", "--no-verify")
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_ca_bundle_without_an_endpoint_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("", encoding="ascii")
    with pytest.raises(SystemExit, match="--ca-bundle applies to --endpoint only"):
        anykpl._commands.demo.run(parse(*SHORT, "--ca-bundle", str(bundle)))


def test_missing_ca_bundle_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    argv = [*SHORT, "--endpoint", "https://localhost:1", "--ca-bundle", str(missing)]
    with pytest.raises(SystemExit, match=f"^anykpl demo: --ca-bundle {missing}: no such file$"):
        anykpl._commands.demo.run(parse(*argv))


# -- the producer over TLS: the CA bundle from the config or from botocore's chain ----------


async def _put_one(config: Any) -> Any:
    from anykpl import Producer

    async with Producer(config) as producer:
        return await producer.put_record(TLS_STREAM, b"over tls", partition_key="k")


def _tls_config(endpoint: str, **changes: Any) -> Any:
    from anykpl import ProducerConfig

    options: dict[str, Any] = {
        "region": "us-east-1",
        "endpoint_url": endpoint,
        "aws_access_key_id": "demo",
        "aws_secret_access_key": "demo",
        "record_ttl": 3.0,
    }
    return ProducerConfig(**{**options, **changes})


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_producer_checks_the_certificate_against_ca_bundle(
    self_signed_endpoint: str,
    self_signed_certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    bundle = str(self_signed_certificate[0])
    result = await _put_one(_tls_config(self_signed_endpoint, ca_bundle=bundle))
    assert result.shard_id == "shardId-000000000000"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_producer_honours_aws_ca_bundle(
    self_signed_endpoint: str,
    self_signed_certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(self_signed_certificate[0]))
    result = await _put_one(_tls_config(self_signed_endpoint))
    assert result.shard_id == "shardId-000000000000"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_producer_without_the_ca_refuses_the_self_signed_certificate(
    self_signed_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the control: the two tests above pass only because of the bundle
    from anykpl._core._aggregator import SHARD_MAP_WAIT
    from anykpl.errors import EXPIRED, RecordFailedError

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    start = anyio.current_time()
    with pytest.raises(RecordFailedError) as failed:
        await _put_one(_tls_config(self_signed_endpoint, record_ttl=1.0))
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
    # every ListShards fails: the record, waiting for the shard map, fails at its TTL, not
    # after the longest wait for a map (its deadline and SHARD_MAP_WAIT)
    assert failed.value.error_code == EXPIRED
    assert "CERTIFICATE_VERIFY_FAILED" in str(failed.value)
    assert anyio.current_time() - start < SHARD_MAP_WAIT


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_plain_http_endpoint_reads_no_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over plain HTTP (an emulator, a local gateway) there is no certificate to check: the
    CA bundle is not read (the client opens without loading one), so a bundle that is not
    PEM at all does not stand in the way. The same bundle fails an https endpoint: see the
    next test."""
    from anykpl.emulator import spawn

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    bundle = tmp_path / "not-a-bundle.pem"
    bundle.write_text("not a certificate\n")
    with spawn(streams={TLS_STREAM: 1}) as endpoint:
        assert endpoint.startswith("http://")
        result = await _put_one(_tls_config(endpoint, ca_bundle=str(bundle)))
    assert result.shard_id == "shardId-000000000000"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_https_endpoint_reads_the_certificate_bundle(
    self_signed_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the control: the bundle that plain HTTP never reads is read, and refused, over TLS (when
    # the client opens under trio, httpx's; at the first request under asyncio, aiohttp's)
    import ssl

    from anykpl.errors import RecordFailedError

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    bundle = tmp_path / "not-a-bundle.pem"
    bundle.write_text("not a certificate\n")
    with pytest.raises((RecordFailedError, ssl.SSLError)) as failed:
        await _put_one(_tls_config(self_signed_endpoint, ca_bundle=str(bundle), record_ttl=1.0))
    assert "NO_CERTIFICATE_OR_CRL_FOUND" in str(failed.value)


# -- options ------------------------------------------------------------------------------


def test_short_fills_only_the_options_not_given() -> None:
    short = workload_from(parse("--short"))
    assert (short.duration, short.burst_every) == (5.0, 2.0)
    assert workload_from(parse("--short", "--duration", "7")).duration == 7.0
    default = workload_from(parse())
    assert (default.duration, default.burst_every, default.devices) == (30.0, 10.0, 5000)
    assert default.steady_rate == pytest.approx(4000)
    assert default.aggregation
    assert not workload_from(parse("--no-aggregation")).aggregation
    assert workload_from(parse()).run_id != default.run_id


def test_help_lists_every_option() -> None:
    parser = argparse.ArgumentParser(prog="anykpl demo")
    add_arguments(parser)
    text = parser.format_help()
    for option in (
        "--duration",
        "--devices",
        "--rate",
        "--shards",
        "--backend",
        "--endpoint",
        "--stream",
        "--short",
        "--quiet",
        "--progress",
        "--no-aggregation",
        "--chaos",
        "--plot",
    ):
        assert option in text
    assert "10% of the devices" in " ".join(text.split())


@pytest.mark.parametrize(
    "argv", [("--devices", "0"), ("--rate", "0"), ("--duration", "-1"), ("--burst-every", "nan")]
)
def test_bad_options_are_usage_errors(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2


# -- the verdict --------------------------------------------------------------------------


def test_verdict_counts_present_missing_duplicates_and_unexpected() -> None:
    a, b, c, d = (("dev-1", b"a"), ("dev-1", b"b"), ("dev-2", b"c"), ("dev-2", b"d"))
    failed_but_written, failed_not_written = ("dev-3", b"e"), ("dev-3", b"f")
    stranger = ("dev-9", b"zzz")
    found = Counter({a: 1, b: 3, d: 1, failed_but_written: 2, stranger: 1})
    verdict = judge([a, b, c, d], found, [failed_but_written, failed_not_written])
    assert verdict.acknowledged == 4
    assert verdict.present == 3
    assert verdict.missing == 1
    assert verdict.examples_missing == (c,)
    assert verdict.duplicates == 2 + 1  # b twice more, the failed record once more
    assert verdict.failed == 2
    assert verdict.failed_present == 1
    assert verdict.unexpected == 1
    assert verdict.examples_unexpected == (stranger,)
    assert not verdict.ok
    assert verdict.exit_code == 1


def test_verdict_passes_with_duplicates_only() -> None:
    records = [(f"dev-{i}", f"reading {i}".encode()) for i in range(10)]
    found = Counter(records) + Counter(records[:2])
    verdict = judge(records, found)
    assert (verdict.present, verdict.missing, verdict.duplicates) == (10, 0, 2)
    assert verdict.ok
    assert verdict.exit_code == 0


def test_verdict_fails_when_nothing_was_acknowledged() -> None:
    verdict = judge([], Counter())
    assert not verdict.ok
    assert verdict.exit_code == 1


def test_verdict_fails_on_unexpected_records_alone() -> None:
    record = ("dev-1", b"a")
    verdict = judge([record], Counter({record: 1, ("dev-1", b"corrupt"): 1}))
    assert verdict.missing == 0
    assert verdict.unexpected == 1
    assert verdict.exit_code == 1


# -- reading back -------------------------------------------------------------------------


class ThrottledError(Exception):
    """Shaped like botocore's ClientError; the read after it gets the page ``then``."""

    def __init__(self, then: Any) -> None:
        super().__init__("throttled")
        self.response = {"Error": {"Code": "ProvisionedThroughputExceededException"}}
        self.then = then


class FakeKinesis:
    """GetRecords pages scripted per shard; ListShards in two pages."""

    def __init__(self, pages: dict[str, list[Any]]) -> None:
        self.pages = pages
        self.calls: list[tuple[str, int]] = []

    def list_shards(self, **request: Any) -> dict[str, Any]:
        shards = [{"ShardId": shard_id} for shard_id in self.pages]
        if "NextToken" in request:
            assert "StreamName" not in request
            return {"Shards": shards[1:]}
        assert request == {"StreamName": "s"}
        return {"Shards": shards[:1], "NextToken": "more"}

    def get_shard_iterator(self, **request: Any) -> dict[str, str]:
        assert request["ShardIteratorType"] == "TRIM_HORIZON"
        return {"ShardIterator": f"{request['ShardId']}/0"}

    def get_records(self, ShardIterator: str, Limit: int) -> dict[str, Any]:
        shard_id, position = ShardIterator.split("/")
        self.calls.append((shard_id, int(position)))
        page = self.pages[shard_id][int(position)]
        if isinstance(page, ThrottledError):
            self.pages[shard_id][int(position)] = page.then
            raise page
        records, behind, more = page
        response: dict[str, Any] = {
            "Records": [
                {"SequenceNumber": f"{shard_id}-{position}-{n}", "PartitionKey": key, "Data": data}
                for n, (key, data) in enumerate(records)
            ],
            "MillisBehindLatest": behind,
        }
        if more:
            response["NextShardIterator"] = f"{shard_id}/{int(position) + 1}"
        return response


def test_read_back_pages_deaggregates_and_stops_at_the_tip() -> None:
    aggregate = encode_aggregate([("dev-1", None, b"one"), ("dev-2", None, b"two")])
    client = FakeKinesis(
        {
            # an open shard: an empty page that is behind goes on, an empty one at the tip stops
            "shard-0": [
                ([("agg-key", aggregate)], 5000, True),
                ([], 3000, True),
                ([("dev-3", b"three")], 0, True),
                ([], 0, True),
                ([("dev-4", b"never read")], 0, True),
            ],
            # a closed shard: no NextShardIterator ends it; a throttled read is retried
            "shard-1": [
                ([("dev-5", b"five")], 0, True),
                ThrottledError(then=([("dev-6", b"six")], 0, False)),
            ],
        }
    )
    naps: list[float] = []
    records = list(read_user_records(client, "s", pace=0.01, sleep=naps.append))
    assert [(r.shard_id, r.partition_key, r.data, r.sub_sequence_number) for r in records] == [
        ("shard-0", "dev-1", b"one", 0),
        ("shard-0", "dev-2", b"two", 1),
        ("shard-0", "dev-3", b"three", 0),
        ("shard-1", "dev-5", b"five", 0),
        ("shard-1", "dev-6", b"six", 0),
    ]
    assert records[0].sequence_number == records[1].sequence_number
    assert client.calls == [
        ("shard-0", 0), ("shard-0", 1), ("shard-0", 2), ("shard-0", 3),
        ("shard-1", 0), ("shard-1", 1), ("shard-1", 1),
    ]  # fmt: skip
    assert 0.2 in naps  # the throttled read waited before trying again
    assert naps.count(0.01) == 4  # paced between reads of one shard


def test_count_user_records_keeps_only_what_it_is_told() -> None:
    client = FakeKinesis(
        {
            "shard-0": [([("dev-1", b"run1 a"), ("dev-1", b"run2 b")], 0, True), ([], 0, True)],
            "shard-1": [([("dev-2", b"run1 c"), ("dev-2", b"run1 c")], 0, False)],
        }
    )
    found, left_out = count_user_records(
        client, "s", keep=lambda _key, data: data.startswith(b"run1")
    )
    assert found == Counter({("dev-1", b"run1 a"): 1, ("dev-2", b"run1 c"): 2})
    assert left_out == 1


# -- the devices --------------------------------------------------------------------------


def test_device_group_keeps_each_devices_cadence_and_bursts() -> None:
    workload = Workload(devices=40, rate=2.0, duration=10, burst_every=4, burst_size=3, run_id="r")
    group = DeviceGroup(range(40), workload, random.Random(1))
    readings: list[tuple[str, bytes]] = []
    elapsed = 0.0
    while elapsed < 10.0:
        readings.extend(group.take_due(elapsed, 1_700_000_000.0 + elapsed))
        assert group.next_due() > elapsed  # everything due was taken
        elapsed += 0.05
    # 40 devices × 2/s × 10 s (±1 per device for the phase), plus 4 devices × 3 at 2 s and 6 s
    steady = [r for r in readings if b'"kind":"reading"' in r[1]]
    alerts = [r for r in readings if b'"kind":"alert"' in r[1]]
    assert 40 * 19 <= len(steady) <= 40 * 20
    assert len(alerts) == 2 * 4 * 3
    assert len(set(readings)) == len(readings)
    decoded = [json.loads(data) for _, data in readings]
    assert all(d["run"] == "r" for d in decoded)
    assert all(key == d["device"] for (key, _), d in zip(readings, decoded, strict=True))
    by_device: dict[str, list[int]] = {}
    for d in decoded:
        by_device.setdefault(d["device"], []).append(d["seq"])
    assert len(by_device) == 40
    assert all(seqs == list(range(len(seqs))) for seqs in by_device.values())
    assert all(data.startswith(run_prefix("r")) for _, data in readings)
    assert max(len(data) for _, data in readings) < 160


def test_device_group_catches_up_after_a_stall() -> None:
    workload = Workload(devices=10, rate=1.0, burst_every=0, run_id="r")
    group = DeviceGroup(range(10), workload, random.Random(2))
    assert len(group.take_due(5.0, 0.0)) == 50  # five seconds due at once, none skipped
    assert 5.0 < group.next_due() <= 6.0


# -- statistics ---------------------------------------------------------------------------


def test_latency_histogram_is_within_one_percent() -> None:
    rng = random.Random(3)
    samples = [rng.lognormvariate(-2.5, 0.8) for _ in range(20_000)]
    histogram = LatencyHistogram()
    for sample in samples:
        histogram.add(sample)
    ordered = sorted(samples)
    for q in (50, 90, 99):
        exact = ordered[int(len(ordered) * q / 100) - 1]
        estimate = histogram.percentile(q)
        assert estimate is not None
        assert estimate == pytest.approx(exact, rel=0.015)
    assert histogram.max == max(samples)
    assert LatencyHistogram().percentile(50) is None


def test_tally_rates_and_recent_latencies() -> None:
    tally = Tally()
    assert tally.sample_rates(0.5) == (0.0, 0.0)
    for n in range(200):
        at = 1.0 + n / 100  # 100 readings/s for 2 s, from 1 s
        tally.offered(1)
        tally.acknowledged(("dev-1", b"x" * 95 + str(n).encode()), "shard-0", 0.05, at)
    offered, acknowledged = tally.sample_rates(3.0)
    assert offered == pytest.approx(200 / 2.5)
    assert acknowledged == pytest.approx(200 / 2.5)
    p50, p99 = tally.recent_percentiles(3.0)
    assert p50 == p99 == 0.05
    (rate,) = tally.shard_rates(3.0)
    assert rate.shard_id == "shard-0"
    assert rate.records_per_second == pytest.approx(100)
    assert tally.shard_totals["shard-0"][0] == 200


def test_shard_rates_from_emulator_uses_whole_seconds_of_the_stream() -> None:
    stats = {
        "uptime": 12.5,
        "shards": [
            {
                "stream": "demo", "shard_id": "shardId-000000000001", "open": True,
                "limit_records": 1000.0, "limit_bytes": 1048576.0, "throttled_records": 7,
                "per_second": [[9, 500, 100_000, 0, 0], [10, 300, 200_000, 7, 700],
                               [11, 100, 400_000, 0, 0], [12, 999, 999_999, 0, 0]],
            },
            {
                "stream": "other", "shard_id": "shardId-000000000000", "open": True,
                "limit_records": None, "limit_bytes": None, "throttled_records": 0,
                "per_second": [[11, 1, 1, 0, 0]],
            },
        ],
    }  # fmt: skip
    (rate,) = shard_rates_from_emulator(stats, "demo", window=2)
    assert rate.shard_id == "shardId-000000000001"
    assert rate.records_per_second == 200  # seconds 10 and 11; 12 is not whole yet
    assert rate.bytes_per_second == 300_000
    assert rate.throttled == 7
    assert (rate.limit_records, rate.limit_bytes) == (1000.0, 1048576.0)


# -- progress views -----------------------------------------------------------------------


def progress(**changes: Any) -> Progress:
    values: dict[str, Any] = {
        "elapsed": 12.5, "duration": 30.0, "offered_rate": 4012.0, "acknowledged_rate": 3998.0,
        "acknowledged": 48210, "failed": 3, "outstanding": 312, "throttled": 17, "retried": 9,
        "p50": 0.081, "p99": 0.19, "measured_by": "emulator",
        "shards": [
            ShardRate("shardId-000000000000", 10.0, 0.5 * 1048576, 17, 1000.0, 1048576.0),
            ShardRate("shardId-000000000001", 950.0, 0.05 * 1048576, 0, 1000.0, None),
        ],
    }  # fmt: skip
    values.update(changes)
    return Progress(**values)


def test_live_view_shows_the_figures_and_each_shard_against_its_limits() -> None:
    from rich.console import Console

    console = Console(width=120, record=True, color_system=None)
    console.print(anykpl._commands.demo._LiveView(live=None, title="the title").render(progress()))
    text = console.export_text()
    for expected in ("the title", "12.5 s / 30 s", "4,012/s", "3,998/s", "48,210", "81 ms",
                     "190 ms", "measured by the emulator", "Kinesis records/s", "50%",
                     "0.500", "950 (95%)", "no limit"):  # fmt: skip
        assert expected in text, expected
    first_shard = next(line for line in text.splitlines() if "shardId-000000000000" in line)
    assert "█" * 10 + "░" * 10 in first_shard
    assert first_shard.rstrip(" │").endswith("17")
    console.print(
        anykpl._commands.demo._LiveView(None, "t").render(progress(elapsed=30.2, finished=True))
    )
    assert "30.2 s / 30 s done" in console.export_text()


def test_plain_view_prints_a_line_every_two_seconds() -> None:
    lines: list[str] = []
    view = anykpl._commands.demo._PlainView(lines.append)
    for tick in range(13):
        view.update(progress(elapsed=tick * 0.5))
    view.update(progress(elapsed=6.1, finished=True))
    assert [line.split("]")[0] for line in lines] == [
        "[  2.0 s",
        "[  4.0 s",
        "[  6.0 s",
        "[  6.1 s",
    ]
    assert "per shard MiB/s: 0:0.50 1:0.05, records/s: 0:10 1:950" in lines[0]
    assert "p50 81 ms  p99 190 ms" in lines[0]


def test_progress_view_falls_back_to_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    not_a_terminal = Console(force_terminal=False)
    with anykpl._commands.demo._progress_view("auto", not_a_terminal, "t") as view:
        assert isinstance(view, anykpl._commands.demo._PlainView)
    with anykpl._commands.demo._progress_view("live", None, "t") as view:
        assert isinstance(view, anykpl._commands.demo._PlainView)
    assert "no live view: rich is not installed" in capsys.readouterr().out
    with anykpl._commands.demo._progress_view("off", not_a_terminal, "t") as view:
        assert isinstance(view, anykpl._commands.demo._NoView)
    terminal = Console(force_terminal=True, file=io.StringIO())
    with anykpl._commands.demo._progress_view("auto", terminal, "t") as view:
        assert isinstance(view, anykpl._commands.demo._LiveView)
