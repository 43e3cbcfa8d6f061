"""Where a benchmark's streams live: anykpl's emulator, moto's own server, or a URL.

``start_endpoint(which)`` yields the endpoint's URL for ``which``:

- ``emulator``: anykpl's emulator (``anykpl.emulator.spawn``) with shard limits off, in its own
  process;
- ``moto``: moto's own server (``python -m moto.server``, Werkzeug, threaded), in its own
  process on a free port of 127.0.0.1;
- an ``http(s)://`` URL: an endpoint someone else runs (kinesalite, kinesis-mock, ...); the
  benchmark creates its streams there and leaves them.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import inspect
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

REGION = "us-east-1"
CREDENTIALS: dict[str, Any] = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
#: GetRecords' answers when a shard's reads are used up: the read waits and tries again
READ_THROTTLED = frozenset(
    {"ProvisionedThroughputExceededException", "ThrottlingException", "LimitExceededException"}
)

ENDPOINT_HELP = (
    "where the streams live: 'emulator' (anykpl's, limits off; the default), 'moto' (moto's "
    "own server in its own process) or the URL of a running Kinesis-compatible endpoint "
    "(kinesalite, kinesis-mock, ...; streams are created there and left)"
)


def check_endpoint(value: str) -> str:
    """argparse ``type=`` for an endpoint choice."""
    if value in ("emulator", "moto") or value.startswith(("http://", "https://")):
        return value
    raise argparse.ArgumentTypeError(f"'emulator', 'moto' or an http(s) URL, not {value!r}")


def start_emulator() -> Any:
    """``spawn`` with limits off, whichever version of the emulator is installed (the
    benchmarks also run against older trees)."""
    from anykpl import emulator

    kwargs: dict[str, Any] = {}
    limits = getattr(emulator, "Limits", None)
    if limits is not None and "limits" in inspect.signature(emulator.spawn).parameters:
        kwargs["limits"] = limits.off()
    return emulator.spawn(**kwargs)


@contextlib.contextmanager
def start_moto_server(timeout: float = 30.0) -> Iterator[str]:
    """moto's own server on a free port of 127.0.0.1, in its own process, stopped on exit. It
    logs a line per request: to a file, since a pipe nobody reads would fill and block it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-500:]
                    raise RuntimeError(f"moto's server exited with {server.returncode}: {tail}")
                try:
                    urllib.request.urlopen(endpoint + "/moto-api/", timeout=1.0).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"moto's server did not answer on {endpoint}") from None
                    time.sleep(0.1)
            yield endpoint
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@contextlib.contextmanager
def start_endpoint(which: str) -> Iterator[str]:
    """The URL of ``which`` (see the module's docstring), for as long as the block runs."""
    if which == "emulator":
        with start_emulator() as endpoint:
            yield endpoint
    elif which == "moto":
        with start_moto_server() as endpoint:
            yield endpoint
    else:
        yield which


def client_for(endpoint: str) -> Any:
    """A botocore Kinesis client of ``endpoint``."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS
    )


def read_back(client: Any, stream: str) -> Counter[tuple[str, bytes]]:
    """How many times each (partition key, data) user record is in ``stream``: every shard
    read from TRIM_HORIZON to its tip, every Kinesis record deaggregated by AWS's
    ``aws_kinesis_agg``."""
    from aws_kinesis_agg.deaggregator import iter_deaggregate_records

    from anykpl.readback import list_shard_ids

    found: Counter[tuple[str, bytes]] = Counter()
    for shard_id in list_shard_ids(client, stream):
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            try:
                page = client.get_records(ShardIterator=iterator, Limit=10_000)
            except Exception as exc:  # botocore's ClientError
                if getattr(exc, "response", {}).get("Error", {}).get("Code") in READ_THROTTLED:
                    time.sleep(0.2)
                    continue
                raise
            for user in iter_deaggregate_records(page["Records"], data_format="Boto3"):
                kinesis = user["kinesis"]
                # an aggregate's user records come base64-encoded, a plain record as it was read
                data = kinesis["data"]
                data = base64.b64decode(data) if kinesis.get("aggregated") else bytes(data)
                found[(kinesis["partitionKey"], data)] += 1
            if not page["Records"] and page.get("MillisBehindLatest", 0) == 0:
                break  # caught up with the tip of an open shard
            iterator = page.get("NextShardIterator")
    return found


def overrides(pairs: list[str]) -> dict[str, Any]:
    """``field=value`` pairs as ProducerConfig keyword arguments (values as Python literals)."""
    result: dict[str, Any] = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        try:
            result[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            result[name] = text
    return result
