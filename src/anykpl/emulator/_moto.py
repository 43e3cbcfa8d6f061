"""Where the emulator meets moto: its WSGI application called in-line, and the one patch.

moto serves every API the emulator does not answer itself (the Kinesis control plane,
GetRecords, S3, any other service) through ``DomainDispatcherApplication``, the WSGI application
behind moto's own server. ``MotoApp`` calls it on the emulator's event loop thread, one request
at a time, so moto's backends are never entered concurrently (werkzeug's threaded server, moto's
own, races on a shard's sequence counter).

Where moto differs from the service in a way the write path cannot route around, it is patched
here, once per process (moto's backends are per process): ``patch_moto_resharding``. Other
differences are handled around moto, not in it: the write path (``_write_path.py``), ListShards
paging (``_list_shards.py``) and a stream's maximum record size (``_record_size.py``).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from ._http import Request, Response

__all__ = ("MotoApp", "patch_moto_resharding")


def patch_moto_resharding() -> None:
    """Keep records where the service keeps them when a shard is split or merged.

    moto's ``split_shard`` re-puts the parent's records (they go back into the parent, with new
    sequence numbers) and ``merge_shards`` copies both parents' records into the child, so a
    reader of every shard sees them twice. On the service the parents keep their records and the
    children start empty. Run moto's resharding with the parents' records set aside, then put
    them back.
    """
    from moto.kinesis.models import Stream

    if getattr(Stream, "_anykpl_patched", False):
        return
    split, merge = Stream.split_shard, Stream.merge_shards

    def keep_records(original: Callable[..., None]) -> Callable[..., None]:
        def wrapper(self: Any, *args: Any) -> None:
            parents = [self.shards[s] for s in args if isinstance(s, str) and s in self.shards]
            saved = [(p, p.records) for p in parents]
            for parent in parents:
                parent.records = type(parent.records)()
            try:
                original(self, *args)
            finally:
                for parent, records in saved:
                    parent.records = records

        return wrapper

    Stream.split_shard = keep_records(split)  # type: ignore[method-assign]
    Stream.merge_shards = keep_records(merge)  # type: ignore[method-assign]
    Stream._anykpl_patched = True  # type: ignore[attr-defined]


class MotoApp:
    """moto's WSGI application (patched), called with whole requests."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        patch_moto_resharding()
        self._app = DomainDispatcherApplication(create_backend_app)

    def __call__(self, request: Request) -> Response:
        path, _, query = request.target.partition("?")
        host = request.headers.get("host", "127.0.0.1")
        server_name, _, server_port = host.partition(":")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, encoding="latin-1"),
            "RAW_URI": request.target,
            "REQUEST_URI": request.target,
            "QUERY_STRING": query,
            "SERVER_NAME": server_name,
            "SERVER_PORT": server_port or "80",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "CONTENT_LENGTH": str(len(request.body)),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(request.body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers.items():
            if name == "content-type":
                environ["CONTENT_TYPE"] = value
            elif name != "content-length":
                environ["HTTP_" + name.upper().replace("-", "_")] = value
        captured: dict[str, Any] = {}

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            captured["status"] = int(status.split(" ", 1)[0])
            captured["headers"] = headers
            return lambda data: None

        chunks: Iterable[bytes] = self._app(environ, start_response)
        try:
            body = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        # the framing is the emulator's (_http.py), for the whole body
        dropped = {"connection", "transfer-encoding"}
        if request.method != "HEAD":  # a HEAD answer keeps the length of what GET would send
            dropped.add("content-length")
        headers = [
            (name, value) for name, value in captured["headers"] if name.lower() not in dropped
        ]
        return captured["status"], headers, body
