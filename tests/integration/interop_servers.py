"""kinesalite and kinesis-mock (Kinesis) and dynalite (DynamoDB, for the fleet's table),
installed from npm and started on 127.0.0.1, for the interop tests.

The emulators are installed once per machine into a cache directory (not the repository):
``$ANYKPL_INTEROP_CACHE``, else ``$XDG_CACHE_HOME/anykpl-interop``, else
``~/.cache/anykpl-interop``, one subdirectory per pinned set of versions. A file lock keeps
parallel test runs from installing into the same directory at once; a marker file written last
says the install finished. Only a machine without ``node`` or ``npm`` skips the tests; a failed
install is an error (CI must run them).

None can be told which address to listen on (kinesalite's CLI has no host option, kinesis-mock
and dynalite listen on every interface), so all run under a small ``--require`` preload that
makes every server listen on 127.0.0.1, on a port the system picks (so parallel runs never race
for one), and writes the port it got to a file. The preload also keeps a server alive when a
client aborts a request mid-way (dynalite died of it, as the real services do not).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINESALITE_VERSION = "3.3.3"
KINESIS_LOCAL_VERSION = "0.6.2"  # kinesis-mock, compiled for node
DYNALITE_VERSION = "3.2.2"  # in memory: no native module needed
PACKAGES = (
    f"kinesalite@{KINESALITE_VERSION}",
    f"kinesis-local@{KINESIS_LOCAL_VERSION}",
    f"dynalite@{DYNALITE_VERSION}",
)

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"

# Every net.Server (http, https, raw) listens on a port of the system's choosing on loopback,
# whatever it asked for, and reports the port. listen() is called as listen(options[, cb]) or
# listen(port[, host][, backlog][, cb]).
PRELOAD = r"""
'use strict';
const fs = require('fs');
const net = require('net');
const tls = require('tls');
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (args[0] !== null && typeof args[0] === 'object') {
    args[0] = Object.assign({}, args[0], { host: '127.0.0.1', port: 0 });
  } else {
    args[0] = 0;
    if (typeof args[1] === 'string') {
      args[1] = '127.0.0.1';
    } else {
      args.splice(1, 0, '127.0.0.1');
    }
  }
  this.once('listening', () => {
    const kind = this instanceof tls.Server ? 'tls' : 'plain';
    const address = this.address();
    fs.appendFileSync(
      process.env.ANYKPL_INTEROP_PORTS, `${kind} ${address.address} ${address.port}\n`);
  });
  return listen.apply(this, args);
};
// A client that closes its connection in the middle of a request (a cancelled call, a killed
// process) does not stop the service. dynalite rethrows the request's 'aborted' error from its
// handler (dynalite/index.js: req.on('error', function(err) { throw err })) and dies with it,
// failing every later test: such an error is logged and the server carries on. Any other
// uncaught error still stops the emulator.
process.on('uncaughtException', (err) => {
  if (err && (err.code === 'ECONNRESET' || err.message === 'aborted')) {
    console.error(`a client aborted a request (${err.message}); carrying on`);
    return;
  }
  console.error(err);
  process.exit(70);
});
"""


class InteropSetupError(RuntimeError):
    """npm could not install an emulator, or an emulator did not start."""


def missing_tools() -> list[str]:
    """The tools the interop tests need that this machine does not have."""
    return [tool for tool in ("node", "npm") if shutil.which(tool) is None]


def cache_root() -> Path:
    explicit = os.environ.get("ANYKPL_INTEROP_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "anykpl-interop"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    if sys.platform == "win32":  # pragma: no cover - CI and development run on POSIX
        yield
        return
    import fcntl

    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def install(root: Path | None = None, timeout: float = 600.0) -> Path:
    """Install the pinned emulators (once per machine) and return the npm prefix they are in."""
    root = cache_root() if root is None else root
    prefix = root / (
        f"kinesalite-{KINESALITE_VERSION}+kinesis-local-{KINESIS_LOCAL_VERSION}"
        f"+dynalite-{DYNALITE_VERSION}"
    )
    done = prefix / ".installed"
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        if not done.exists():
            prefix.mkdir(parents=True, exist_ok=True)
            command = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix)]
            try:
                completed = subprocess.run(
                    [*command, *PACKAGES],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise InteropSetupError(f"{' '.join(command)} took over {timeout:.0f} s") from exc
            if completed.returncode != 0:
                raise InteropSetupError(
                    f"{' '.join([*command, *PACKAGES])} failed ({completed.returncode}):\n"
                    f"{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}"
                )
            done.write_text(" ".join(PACKAGES) + "\n")
        preload = prefix / "preload.js"
        if not preload.exists() or preload.read_text() != PRELOAD:
            preload.write_text(PRELOAD)
    return prefix


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    log: Path


def _kinesalite_command(prefix: Path) -> tuple[list[str], Path, dict[str, str]]:
    cli = prefix / "node_modules" / "kinesalite" / "cli.js"
    command = [
        "node",
        "--require",
        str(prefix / "preload.js"),
        str(cli),
        # stream states short but not instant: UPDATING is a state the producer meets
        "--createStreamMs",
        "50",
        "--updateStreamMs",
        "50",
        "--deleteStreamMs",
        "50",
        "--shardLimit",
        "100",
    ]
    return command, prefix, {}


def _kinesis_mock_command(prefix: Path) -> tuple[list[str], Path, dict[str, str]]:
    package = prefix / "node_modules" / "kinesis-local"  # main.js finds server.json beside it
    durations = (
        "CREATE_STREAM_DURATION",
        "DELETE_STREAM_DURATION",
        "MERGE_SHARDS_DURATION",
        "SPLIT_SHARD_DURATION",
        "UPDATE_SHARD_COUNT_DURATION",
    )
    env = dict.fromkeys(durations, "50ms")
    env.update(
        SHARD_LIMIT="100",
        LOG_LEVEL="WARN",
        AWS_REGION=REGION,
        SHOULD_PERSIST_DATA="false",
        LOAD_DATA_IF_EXISTS="false",
    )
    command = ["node", "--require", str(prefix / "preload.js"), str(package / "main.js")]
    return command, package, env


def _dynalite_command(prefix: Path) -> tuple[list[str], Path, dict[str, str]]:
    cli = prefix / "node_modules" / "dynalite" / "cli.js"
    # tables become ACTIVE after 50 ms, as the service's after a moment
    command = ["node", "--require", str(prefix / "preload.js"), str(cli), "--createTableMs", "50"]
    return command, prefix, {}


COMMANDS = {
    "kinesalite": _kinesalite_command,
    "kinesis-mock": _kinesis_mock_command,
    "dynalite": _dynalite_command,
}


def _answers(name: str, url: str) -> bool:
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client(
        "dynamodb" if name == "dynalite" else "kinesis",
        region_name=REGION,
        endpoint_url=url,
        config=botocore.config.Config(retries={"max_attempts": 1}, read_timeout=2),
        **CREDENTIALS,
    )
    try:
        client.list_tables() if name == "dynalite" else client.list_streams()
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False
    return True


@contextlib.contextmanager
def run(name: str, prefix: Path, workdir: Path, timeout: float = 60.0) -> Iterator[Server]:
    """Start emulator ``name`` (``kinesalite``, ``kinesis-mock`` or ``dynalite``) on 127.0.0.1
    and yield it once it answers (ListStreams, ListTables); stop it on exit. Its output goes
    to ``workdir/<name>.log``."""
    command, cwd, extra_env = COMMANDS[name](prefix)
    ports = workdir / f"{name}.ports"
    log = workdir / f"{name}.log"
    ports.unlink(missing_ok=True)
    env = {**os.environ, **extra_env, "ANYKPL_INTEROP_PORTS": str(ports)}
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output
        )
    try:
        url = _wait_until_ready(name, process, ports, log, timeout)
        yield Server(name, url, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_ready(
    name: str, process: subprocess.Popen[Any], ports: Path, log: Path, timeout: float
) -> str:
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise InteropSetupError(f"{name} exited with {process.returncode}:\n{_tail(log)}")
        if url is None and ports.exists():
            for line in ports.read_text().splitlines():
                kind, host, port = line.split()
                if kind == "plain":
                    url = f"http://{host}:{port}"
        if url is not None and _answers(name, url):
            return url
        time.sleep(0.05)
    raise InteropSetupError(f"{name} did not answer within {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:]
    except OSError:
        return "(no output)"
