"""``anykpl emulator``: a local Kinesis (and S3) endpoint that enforces shard limits.

moto's backends own streams, shards, sequence numbers, GetRecords, resharding, S3 and every other
API; this package owns the server (``_server.py``: routing on one event loop, so moto is never
entered concurrently), each connection's HTTP/1.1 (``_http.py``: h11, with the limits of
``HttpLimits``), the write path (``_write_path.py``: per-shard limits like the service, routing
to open shards, fault injection), ListShards paging (``_list_shards.py``) and where it meets
moto (``_moto.py``: moto's WSGI app in-line, and a patch to its resharding).
``docs/emulator.md`` is the user's guide.

Three ways to run it, all on 127.0.0.1 by default:

- ``anykpl emulator --port 4567 --streams demo:4`` (or ``python -m anykpl.emulator``);
- ``with Emulator(streams={"demo": 4}) as url:`` / ``async with Emulator(...) as url:`` in this
  process, on a server thread with its own event loop (tests);
- ``with spawn(streams={"demo": 4}) as url:`` in its own process (benchmarks: it must not share
  a core with the producer).

``EmulatorClient(url)`` controls either kind at run time. It needs the ``emulator`` extra
(``moto[server]``, ``h11``). The producer core never imports this package.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType

from ._client import EmulatorClient, EmulatorControlError
from ._options import Faults, HttpLimits, Limits, Reshard, Storm

__all__ = (
    "Emulator",
    "EmulatorClient",
    "EmulatorControlError",
    "Faults",
    "HttpLimits",
    "Limits",
    "Reshard",
    "Storm",
    "spawn",
)


class Emulator:
    """The emulator in this process, on a server thread with its own asyncio event loop (so it
    serves asyncio and trio tests alike).

    ``with Emulator(...) as url`` and ``async with Emulator(...) as url`` start it on a free
    port of ``host`` and give its endpoint URL; ``emulator.client`` controls it.
    """

    def __init__(
        self,
        *,
        streams: Mapping[str, int] | None = None,
        limits: Limits | None = None,
        faults: Faults | None = None,
        storms: Sequence[Storm] = (),
        reshards: Sequence[Reshard] = (),
        region: str = "us-east-1",
        host: str = "127.0.0.1",
        port: int = 0,
        http: HttpLimits | None = None,
    ) -> None:
        self.streams = dict(streams or {})
        self.limits = limits or Limits()
        self.faults = faults or Faults()
        self.storms = tuple(storms)
        self.reshards = tuple(reshards)
        self.region = region
        self.host = host
        self.port = port
        self.http = http or HttpLimits()
        self.url = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def client(self) -> EmulatorClient:
        if not self.url:
            raise RuntimeError("the emulator is not running")
        return EmulatorClient(self.url)

    def start(self) -> str:
        """Start serving; returns the endpoint URL."""
        if self._thread is not None:
            raise RuntimeError("the emulator is already running")
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="anykpl-emulator", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError("the emulator did not start") from self._error
        return self.url

    def stop(self) -> None:
        """Stop serving and wait for the server thread."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        self._thread = None
        self.url = ""

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the thread just ends
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from ._server import EmulatorServer

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = EmulatorServer(
            limits=self.limits, faults=self.faults, region=self.region, http=self.http
        )
        server.set_up(self.streams, self.storms, self.reshards)
        port = await server.start(self.host, self.port)
        self.url = f"http://{self.host}:{port}"
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> str:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import anyio.to_thread

        await anyio.to_thread.run_sync(self.stop)


def command_line(
    *,
    port: int,
    host: str = "127.0.0.1",
    streams: Mapping[str, int] | None = None,
    limits: Limits | None = None,
    faults: Faults | None = None,
    storms: Sequence[Storm] = (),
    reshards: Sequence[Reshard] = (),
    region: str = "us-east-1",
    http: HttpLimits | None = None,
) -> list[str]:
    """The ``python -m anykpl.emulator`` command line for these options."""
    argv = [sys.executable, "-m", "anykpl.emulator", "--host", host, "--port", str(port)]
    argv += ["--region", region]
    if streams:
        argv += ["--streams", ",".join(f"{name}:{count}" for name, count in streams.items())]
    limits = limits or Limits()
    if not limits.enabled:
        argv.append("--no-limits")
    argv += ["--records-per-second", repr(limits.records_per_second)]
    argv += ["--bytes-per-second", repr(limits.bytes_per_second)]
    faults = faults or Faults()
    for name in (
        "error_rate",
        "record_failure_rate",
        "record_throttle_rate",
        "latency",
        "latency_jitter",
        "reset_rate",
        "fault_after_write",
    ):
        argv += ["--" + name.replace("_", "-"), repr(getattr(faults, name))]
    if faults.seed is not None:
        argv += ["--seed", str(faults.seed)]
    for storm in storms:
        shard = storm.shard_id or "*"
        argv += ["--storm", f"{storm.stream}:{shard}:{storm.start}:{storm.duration}:{storm.factor}"]
    for reshard in reshards:
        what = str(reshard.target) if reshard.action == "scale" else (reshard.shard_id or "*")
        argv += ["--reshard", f"{reshard.stream}:{reshard.action}:{what}:{reshard.at}"]
    http = http or HttpLimits()
    argv += ["--max-body-bytes", str(http.max_body_bytes)]
    argv += ["--read-timeout", repr(http.read_timeout)]
    return argv


@contextmanager
def spawn(
    *,
    streams: Mapping[str, int] | None = None,
    limits: Limits | None = None,
    faults: Faults | None = None,
    storms: Sequence[Storm] = (),
    reshards: Sequence[Reshard] = (),
    region: str = "us-east-1",
    startup_timeout: float = 60.0,
    http: HttpLimits | None = None,
) -> Iterator[str]:
    """Run the emulator in its own process on a free 127.0.0.1 port; yields its URL and stops
    the process on exit. Its log goes to a temporary file, shown if it fails to start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    argv = command_line(
        port=port,
        streams=streams,
        limits=limits,
        faults=faults,
        storms=storms,
        reshards=reshards,
        region=region,
        http=http,
    )
    # stderr to a file, not a pipe: nobody reads a pipe while the emulator runs, and a full one
    # would block its logging and so the emulator itself
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        url = f"http://127.0.0.1:{port}"
        client = EmulatorClient(url, timeout=2.0)
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                try:
                    client.health()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        process.kill()
                        process.wait()
                        log.seek(0)
                        output = log.read().decode(errors="replace")[-2000:]
                        raise RuntimeError(f"the emulator did not start: {output}") from None
                    time.sleep(0.05)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
