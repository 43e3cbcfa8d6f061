"""The emulator's server: routing in front of moto, on one event loop.

Why not moto's own server: werkzeug's threaded development server handles one request per
thread, so concurrent PutRecords to one shard race on moto's sequence counter and lose records
(measured in the core producer issue), and it cannot reset a connection on purpose. This server
runs every request on one event loop thread, so moto's backend is never entered concurrently.
Each connection's HTTP/1.1 is ``_http.py``'s (h11, with the limits of ``HttpLimits``); this
module routes each whole request:

- ``PutRecord`` / ``PutRecords`` (the ``X-Amz-Target`` header says which) go to the write path
  (``_write_path.py``), through the fault dice (a reset fault aborts the connection with no
  answer: ``ResetConnection``);
- ``ListShards`` is paged as the service pages it (``_list_shards.py``);
- ``CreateStream``, ``UpdateMaxRecordSize`` and ``DescribeStreamSummary`` carry a stream's
  maximum record size around moto (``_record_size.py``);
- ``/_anykpl/...`` is the control endpoint (statistics, faults, limits, storms, reshards);
- everything else — every other Kinesis API, S3, any other service moto serves — is handed to
  moto's WSGI application in-line, as moto's server would (``_moto.py``, which also patches
  moto's resharding).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ._http import HttpConnection, Request, ResetConnection, Response
from ._list_shards import ShardLister, find_stream
from ._moto import MotoApp
from ._options import Faults, HttpLimits, Limits, Reshard, Storm, from_json, to_json
from ._record_size import check_size_in_kib, max_record_size, set_max_record_size
from ._write_path import RECORD_COUNTERS, KinesisError, WritePath

__all__ = ("EmulatorServer",)

logger = logging.getLogger("anykpl.emulator")

_TARGET_PREFIX = "Kinesis_20131202."
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/[^/]+/([^/]+)/")
_CONTROL_PREFIX = "/_anykpl/"

#: the calls that carry a stream's maximum record size (``_record_size``)
_RECORD_SIZE_TARGETS = frozenset(
    f"Kinesis_20131202.{operation}"
    for operation in ("CreateStream", "UpdateMaxRecordSize", "DescribeStreamSummary")
)


def _json_response(status: int, body: Any, content_type: str = "application/json") -> Response:
    payload = json.dumps(body, separators=(",", ":")).encode()
    return (
        status,
        [("Content-Type", content_type), ("x-amzn-RequestId", str(uuid.uuid4()))],
        payload,
    )


_JSON_TYPE = "application/x-amz-json-1.1"
#: Kinesis's CBOR protocol (what the AWS SDK for Java sends): the same operations, a CBOR body
#: with each record's data as a byte string, answers in CBOR
_CBOR_TYPE = "application/x-amz-cbor-1.1"
#: on every answer of the write path and ListShards: the emulator stores CBOR data as sent
_STORES_CBOR = ("x-anykpl-cbor", "stored-as-sent")


def _is_cbor(request: Request) -> bool:
    return request.headers.get("content-type", "").startswith(_CBOR_TYPE)


def _answer(status: int, body: Any, cbor: bool) -> Response:
    """A Kinesis answer, in CBOR to a CBOR request, in JSON otherwise, saying that this
    endpoint stores CBOR data as sent (``wire_protocol="auto"`` may use CBOR here)."""
    if not cbor:
        status, headers, payload = _json_response(status, body, _JSON_TYPE)
        return status, [*headers, _STORES_CBOR], payload
    import cbor2

    return (
        status,
        [("Content-Type", _CBOR_TYPE), ("x-amzn-RequestId", str(uuid.uuid4())), _STORES_CBOR],
        cbor2.dumps(body),
    )


def _request_object(request: Request) -> dict[str, Any]:
    """A Kinesis request's object, JSON or CBOR; a CBOR request's ``Data`` (a byte string, in
    each record of PutRecords, or PutRecord's own) becomes base64 text, as JSON carries it.
    Raises the service's SerializationException."""
    if not _is_cbor(request):
        return _json_object(request.body)
    import cbor2

    try:
        payload = cbor2.loads(request.body)
    except Exception as exc:  # cbor2's decode errors, and what a malformed item raises
        raise KinesisError(400, "SerializationException", str(exc)[:200]) from None
    if not isinstance(payload, dict):
        raise KinesisError(400, "SerializationException", "the request is not a map")
    records = payload.get("Records")
    for entry in records if isinstance(records, list) else (payload,):
        if isinstance(entry, dict):
            data = entry.get("Data")
            if isinstance(data, (bytes, bytearray)):
                entry["Data"] = base64.b64encode(data).decode("ascii")
            elif data is not None:  # text where the protocol has a byte string
                raise KinesisError(400, "SerializationException", "Data is not a byte string")
    return payload


def _json_object(body: bytes) -> dict[str, Any]:
    """A request's JSON object, or the service's SerializationException."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise KinesisError(400, "SerializationException", str(exc)[:200]) from None
    if not isinstance(payload, dict):
        raise KinesisError(400, "SerializationException", "the request is not an object")
    return payload


class EmulatorServer:
    """moto's backends, the write path and the control endpoint behind one HTTP port."""

    def __init__(
        self,
        *,
        limits: Limits,
        faults: Faults,
        region: str = "us-east-1",
        account_id: str | None = None,
        http: HttpLimits | None = None,
    ) -> None:
        from moto.core.models import DEFAULT_ACCOUNT_ID

        self._moto = MotoApp()
        self.region = region
        self.account_id = account_id or DEFAULT_ACCOUNT_ID
        self._loop = asyncio.get_running_loop()
        self.write_path = WritePath(limits, faults, self._loop.time())
        self.http = http or HttpLimits()
        self._shard_lister = ShardLister()
        # (account, region, name) of every stream the emulator has seen: for statistics
        self._known: dict[tuple[str, str, str], None] = {}
        self.reshard_log: list[dict[str, Any]] = []
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (a free one when ``port`` is 0)."""
        self._server = await asyncio.start_server(
            self._serve_connection, host, port, limit=1 << 20, backlog=256
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            await self._server.wait_closed()

    # -- streams, storms, reshards -----------------------------------------------------------

    def set_up(
        self, streams: Mapping[str, int], storms: Iterable[Storm], reshards: Iterable[Reshard]
    ) -> None:
        """Create the streams and schedule the storms and reshards given at start."""
        for name, shards in streams.items():
            self.create_stream(name, shards)
        for storm in storms:
            self.add_storm(storm)
        for reshard in reshards:
            self.schedule_reshard(reshard)

    def create_stream(self, name: str, shards: int, region: str | None = None) -> None:
        from moto.kinesis.models import kinesis_backends

        region = region or self.region
        backend = kinesis_backends[self.account_id][region]
        if name in backend.streams:
            # moto's backends are per process: another emulator in this process made it
            raise ValueError(
                f"stream {name!r} already exists in {region} (streams live in moto's "
                f"backend, which every emulator in one process shares)"
            )
        backend.create_stream(name, shards)
        self._known[(self.account_id, region, name)] = None

    def add_storm(self, storm: Storm) -> None:
        stream = self._find_stream(storm.stream)
        if storm.shard_id is not None and storm.shard_id not in stream.shards:
            raise ValueError(f"stream {storm.stream!r} has no shard {storm.shard_id!r}")
        self.write_path.add_storm(storm, self._loop.time())

    def schedule_reshard(self, reshard: Reshard) -> None:
        self._plan_reshard(reshard)  # a mistake is a clear error now, not a log entry later
        self._loop.call_later(reshard.at, self._reshard, reshard)

    @staticmethod
    def _live(account: str, region: str, name: str) -> Any:
        from moto.kinesis.models import kinesis_backends

        return kinesis_backends[account][region].streams.get(name)

    def _find_stream(self, name: str) -> Any:
        """The live moto stream called ``name``: one the emulator has seen, else one in its
        default region."""
        for account, region, known in self._known:
            if known == name and (stream := self._live(account, region, name)) is not None:
                return stream
        stream = self._live(self.account_id, self.region, name)
        if stream is None:
            raise ValueError(f"no stream {name!r} (in {self.region})")
        self._known[(self.account_id, self.region, name)] = None
        return stream

    def _plan_reshard(self, reshard: Reshard) -> tuple[Any, Any]:
        """Check ``reshard`` against the stream as it is now; returns (stream, the shard to
        split or merge, or None for a scale)."""
        stream = self._find_stream(reshard.stream)
        open_shards = [s for s in stream.shards.values() if s.is_open]
        if reshard.action == "scale":
            assert reshard.target is not None
            # the service's rule for one UpdateShardCount call
            if not (len(open_shards) + 1) // 2 <= reshard.target <= 2 * len(open_shards):
                raise ValueError(
                    f"cannot scale {reshard.stream!r} from {len(open_shards)} to "
                    f"{reshard.target} shards in one step (the service allows half to double)"
                )
            return stream, None
        if reshard.shard_id is None:
            shard = min(open_shards, key=lambda s: s.starting_hash)
        else:
            shard = stream.shards.get(reshard.shard_id)
            if shard is None or not shard.is_open:
                raise ValueError(
                    f"stream {reshard.stream!r} has no open shard {reshard.shard_id!r}"
                )
        if reshard.action == "merge" and len(open_shards) < 2:
            raise ValueError(f"stream {reshard.stream!r} has one open shard: nothing to merge")
        return stream, shard

    def _reshard(self, reshard: Reshard) -> None:
        entry: dict[str, Any] = {**to_json(reshard), "done_at": self.uptime()}
        try:
            stream, shard = self._plan_reshard(reshard)
            open_shards = sorted(
                (s for s in stream.shards.values() if s.is_open), key=lambda s: s.starting_hash
            )
            if reshard.action == "scale":
                assert reshard.target is not None
                stream.update_shard_count(reshard.target)
                now_open = sum(1 for s in stream.shards.values() if s.is_open)
                if now_open != reshard.target:
                    raise RuntimeError(f"moto left {now_open} open shards")
            else:
                if reshard.action == "split":
                    middle = (shard.starting_hash + shard.ending_hash) // 2 + 1
                    stream.split_shard(shard.shard_id, str(middle))
                else:
                    index = open_shards.index(shard)
                    neighbour = open_shards[index + 1 if index + 1 < len(open_shards) else -2]
                    first, second = sorted((shard, neighbour), key=lambda s: s.starting_hash)
                    stream.merge_shards(first.shard_id, second.shard_id)
            entry["result"] = "ok"
            logger.info("reshard done: %s", entry)
        except Exception as exc:
            entry["result"] = f"{type(exc).__name__}: {exc}"
            logger.warning("reshard failed: %s", entry)
        self.reshard_log.append(entry)

    def uptime(self) -> float:
        return self._loop.time() - self.write_path.started

    def statistics(self) -> dict[str, Any]:
        """The statistics document (see docs/emulator.md)."""
        now = self._loop.time()
        write_path = self.write_path
        shards = []
        seen: set[tuple[str, str]] = set()
        for key in list(self._known):
            stream_name = key[2]
            stream = self._live(*key)
            if stream is None:  # deleted since
                del self._known[key]
                continue
            for shard in stream.shards.values():
                seen.add((stream_name, shard.shard_id))
                shards.append(self._shard_document(stream_name, shard.shard_id, shard.is_open, now))
        for stream_name, shard_id in list(write_path.stats):
            if (stream_name, shard_id) not in seen:
                shards.append(self._shard_document(stream_name, shard_id, None, now))
        return {
            "uptime": now - write_path.started,
            "totals": write_path.totals,
            "limits": to_json(write_path.limits),
            "faults": to_json(write_path.faults),
            "http": to_json(self.http),
            "storms": [
                {**to_json(storm), "starts_in": start - now, "ends_in": end - now}
                for start, end, storm in write_path.storms
                if end > now
            ],
            "reshards": list(self.reshard_log),
            "shards": shards,
        }

    def _shard_document(
        self, stream: str, shard_id: str, is_open: bool | None, now: float
    ) -> dict[str, Any]:
        stats = self.write_path.shard_stats(stream, shard_id)
        limits = self.write_path.shard_limits(stream, shard_id, now)
        return {
            "stream": stream,
            "shard_id": shard_id,
            "open": is_open,
            "limit_records": None if limits is None else limits[0],
            "limit_bytes": None if limits is None else limits[1],
            **dict(zip(RECORD_COUNTERS, stats.totals, strict=True)),
            "per_second": [[second, *row[:4]] for second, row in sorted(stats.per_second.items())],
        }

    # -- requests --------------------------------------------------------------------------

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._connections.add(writer)
        try:
            await HttpConnection(reader, writer, self._handle, self.http).serve()
        finally:
            self._connections.discard(writer)

    async def _handle(self, request: Request) -> Response:
        try:
            return await self._dispatch(request)
        except ResetConnection:
            raise
        except Exception as exc:  # a bug or a moto error: answer it, keep serving
            logger.exception("error handling %s %s", request.method, request.target)
            return _json_response(
                500,
                {"__type": "InternalFailure", "message": f"emulator error: {exc!r}"},
                _JSON_TYPE,
            )

    async def _dispatch(self, request: Request) -> Response:
        if request.target.startswith(_CONTROL_PREFIX):
            try:
                return self._control(request)
            except (ValueError, TypeError, KeyError) as exc:
                return _json_response(400, {"error": f"{type(exc).__name__}: {exc}"})
            except Exception as exc:  # moto's errors (a stream that exists, ...)
                message = getattr(exc, "message", None) or str(exc)
                return _json_response(400, {"error": f"{type(exc).__name__}: {message}"})
        target = request.headers.get("x-amz-target", "")
        if target in ("Kinesis_20131202.PutRecords", "Kinesis_20131202.PutRecord"):
            return await self._write(request, target[len(_TARGET_PREFIX) :])
        if target == "Kinesis_20131202.ListShards":
            return self._list_shards(request)
        if target in _RECORD_SIZE_TARGETS:
            return self._record_size(request, target[len(_TARGET_PREFIX) :])
        return self._moto(request)

    def _record_size(self, request: Request, operation: str) -> Response:
        """CreateStream, UpdateMaxRecordSize and DescribeStreamSummary with the stream's
        maximum record size, which moto does not keep (see ``_record_size``)."""

        def named_stream() -> Any:
            return find_stream(
                payload.get("StreamName"),
                payload.get("StreamARN"),
                *self._caller(request.headers),
                self._streams,
            )[2]

        try:
            payload = _json_object(request.body)
            given = payload.get("MaxRecordSizeInKiB")
            size = None
            if operation == "UpdateMaxRecordSize" or given is not None:
                size = check_size_in_kib(given)
            if size is not None and operation == "UpdateMaxRecordSize":
                set_max_record_size(named_stream(), size)
                return _json_response(200, {}, _JSON_TYPE)
        except KinesisError as exc:
            return _json_response(exc.status, exc.body(), _JSON_TYPE)
        status, headers, body = self._moto(request)
        if status != 200:
            return status, headers, body
        stream = named_stream()
        if operation == "CreateStream":
            if size is not None:
                set_max_record_size(stream, size)
            return status, headers, body
        answer = json.loads(body)  # DescribeStreamSummary
        answer["StreamDescriptionSummary"]["MaxRecordSizeInKiB"] = max_record_size(stream) // 1024
        return _json_response(200, answer, _JSON_TYPE)

    @staticmethod
    def _streams(account: str, region: str) -> Mapping[str, Any]:
        """moto's streams of ``account`` in ``region``, by name."""
        from moto.kinesis.models import kinesis_backends

        result: Mapping[str, Any] = kinesis_backends[account][region].streams
        return result

    def _list_shards(self, request: Request) -> Response:
        cbor = _is_cbor(request)
        if cbor:
            self.write_path.requests["cbor_requests"] += 1
        try:
            payload = _request_object(request)
            response = self._shard_lister.list_shards(
                payload, self._caller(request.headers), self._streams, self._loop.time()
            )
        except KinesisError as exc:
            return _answer(exc.status, exc.body(), cbor)
        return _answer(200, response, cbor)

    # -- the write path, through the fault dice ----------------------------------------------

    async def _write(self, request: Request, operation: str) -> Response:
        write_path = self.write_path
        faults = write_path.faults
        dice = write_path.random.random
        write_path.requests["requests"] += 1
        cbor = _is_cbor(request)
        if cbor:
            write_path.requests["cbor_requests"] += 1
        fault = None
        if faults.error_rate or faults.reset_rate:
            roll = dice()
            if roll < faults.error_rate:
                fault = "error"
            elif roll < faults.error_rate + faults.reset_rate:
                fault = "reset"
        after_write = fault is not None and dice() < faults.fault_after_write
        if faults.latency or faults.latency_jitter:
            await asyncio.sleep(faults.latency + dice() * faults.latency_jitter)
        if fault is not None and not after_write:
            return self._fault(fault, cbor)
        try:
            response = self._put(request, operation)
        except KinesisError as exc:
            write_path.requests["request_errors"] += 1
            return _answer(exc.status, exc.body(), cbor)
        if fault is not None:
            return self._fault(fault, cbor)
        return _answer(200, response, cbor)

    def _fault(self, fault: str, cbor: bool = False) -> Response:
        totals = self.write_path.requests
        if fault == "reset":
            totals["resets"] += 1
            raise ResetConnection
        totals["request_errors"] += 1
        if self.write_path.random.random() < 0.5:
            body = {"__type": "InternalFailure", "message": "Internal service failure."}
            return _answer(500, body, cbor)
        body = {"__type": "ServiceUnavailable", "message": "Service Unavailable"}
        return _answer(503, body, cbor)

    def _put(self, request: Request, operation: str) -> dict[str, Any]:
        payload = _request_object(request)
        name = payload.get("StreamName")
        arn = payload.get("StreamARN")
        if not isinstance(name, str) and not isinstance(arn, str):
            raise KinesisError(
                400, "ValidationException", "Either StreamName or StreamARN must be provided."
            )
        account_id, region, stream = find_stream(
            name, arn, *self._caller(request.headers), self._streams
        )
        self._known[(account_id, region, stream.stream_name)] = None
        now = self._loop.time()
        if operation == "PutRecords":
            return self.write_path.put_records(stream, account_id, payload.get("Records"), now)
        return self.write_path.put_record(stream, account_id, payload, now)

    def _caller(self, headers: Mapping[str, str]) -> tuple[str, str]:
        """(account id, region) as moto decides them: MOTO_ACCOUNT_ID, the x-moto-account-id
        header, or the access key; the region from the signature's credential scope."""
        import os

        match = _CREDENTIAL.search(headers.get("authorization", ""))
        region = match.group(2) if match else self.region
        account = os.environ.get("MOTO_ACCOUNT_ID") or headers.get("x-moto-account-id")
        if not account:
            if match:
                from moto.iam.models import get_account_id_from

                account = get_account_id_from(match.group(1))
            else:
                account = self.account_id
        return account, region

    # -- control -----------------------------------------------------------------------------

    def _control(self, request: Request) -> Response:
        path = request.target[len(_CONTROL_PREFIX) :].partition("?")[0].strip("/")
        method = request.method
        body: Any = json.loads(request.body) if request.body else {}
        write_path = self.write_path

        def done(action: Callable[..., None], *args: Any) -> dict[str, Any]:
            action(*args)
            return {"ok": True}

        def create_stream() -> None:
            self.create_stream(str(body["name"]), int(body.get("shards", 1)), body.get("region"))

        handlers: dict[tuple[str, str], Callable[[], Any]] = {
            ("GET", "health"): lambda: {"ok": True, "uptime": self.uptime()},
            ("GET", "stats"): self.statistics,
            ("POST", "stats/reset"): lambda: done(write_path.reset_stats),
            ("GET", "faults"): lambda: to_json(write_path.faults),
            ("POST", "faults"): lambda: self._update_faults(body),
            ("GET", "limits"): lambda: to_json(write_path.limits),
            ("POST", "limits"): lambda: self._update_limits(body),
            ("POST", "storms"): lambda: done(self.add_storm, from_json(Storm, body)),
            ("POST", "reshards"): lambda: done(self.schedule_reshard, from_json(Reshard, body)),
            ("POST", "streams"): lambda: done(create_stream),
        }
        handler = handlers.get((method, path))
        if handler is None:
            return _json_response(404, {"error": f"no control endpoint {method} /_anykpl/{path}"})
        return _json_response(200, handler())

    def _update_faults(self, changes: dict[str, Any]) -> dict[str, Any]:
        merged = {**to_json(self.write_path.faults), **changes}
        self.write_path.set_faults(from_json(Faults, merged))
        return to_json(self.write_path.faults)

    def _update_limits(self, changes: dict[str, Any]) -> dict[str, Any]:
        merged = {**to_json(self.write_path.limits), **changes}
        self.write_path.set_limits(from_json(Limits, merged))
        return to_json(self.write_path.limits)


async def run_server(
    server: EmulatorServer,
    host: str,
    port: int,
    on_ready: Callable[[int], None],
    stopped: Callable[[], Awaitable[None]],
) -> None:
    """Serve until ``stopped()`` returns; ``on_ready(port)`` once listening."""
    bound = await server.start(host, port)
    on_ready(bound)
    try:
        await stopped()
    finally:
        await server.close()
