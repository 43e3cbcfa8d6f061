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

import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ("make_app", "serve")


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
