"""A local Kinesis (and S3) endpoint for tests, examples and benchmarks, built on moto's server.

This is the seed of ``anykpl emulator``: today it serves moto's backends with every request
**serialized** behind one lock. moto's threaded server updates a shard's sequence counter
without a lock, so concurrent PutRecords calls to one shard hand out the same sequence number
twice and one record overwrites the other (measured: 20 concurrent requests of 500 records to
one shard stored 9,913 of 10,000 acknowledged records). Serializing requests makes every
acknowledged record stick. Shard write limits, fault injection and correct post-split routing
come with the emulator issue.

Run it with ``python -m anykpl.emulator --port 4567``. It needs the ``emulator`` extra
(``moto[server]``). The producer core never imports this package.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ("make_app", "serve", "spawn")


def make_app() -> Callable[..., Iterable[bytes]]:
    """moto's WSGI application, wrapped so that one request is handled at a time."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def serialized(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with lock:
            # materialise the body inside the lock: moto builds it lazily in some services
            return list(app(environ, start_response))

    return serialized


def serve(host: str = "127.0.0.1", port: int = 4567) -> None:
    """Serve until interrupted."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import run_simple

    run_simple(host, port, make_app(), threaded=True, request_handler=MotoRequestHandler)


@contextmanager
def spawn(startup_timeout: float = 30.0) -> Iterator[str]:
    """Run the endpoint in its own process on a free 127.0.0.1 port; yields its URL and stops
    the process on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    process = subprocess.Popen(
        [sys.executable, "-m", "anykpl.emulator", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the local endpoint did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
