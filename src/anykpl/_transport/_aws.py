"""The AWS SDK clients the producer makes, and which event loop runs them.

One factory, :func:`create_client`, builds every aiobotocore client anykpl uses — the Kinesis
transport (``_botocore.py``), the fleet coordinator's S3 client (``_fleet/``) and the CloudWatch
metrics sink — from the producer's settings. The SDK's own retries are off everywhere
(``total_max_attempts=1``, one attempt per call), as the KPL builds its client with
``DefaultRetryStrategy(0)``: the caller owns retrying. botocore's ``max_attempts`` counts
*retries* after the first attempt, so ``max_attempts=1`` (what anykpl once passed) let the SDK
repeat every call once on a 5xx, a throttling code, a timeout or a reset, unseen by the attempt
history, the backoff, the retry budget and adaptive control.

The Kinesis transport's connections close abortively (:func:`abortive_socket_option`): a request
that timed out is abandoned mid-way, and its unsent bytes must not keep going out on the path.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import gzip
import importlib.util
import json
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import SimpleNamespace
from typing import Any, Final, overload

# Imported with anykpl, not when a producer opens: these imports take 0.2-0.4 s (aiohttp,
# botocore), and inside ``async with Producer(...)`` they would stall a running service's event
# loop for that long, every task with it. aiobotocore's endpoint module also brings in its httpx
# session (trio's HTTP client) when httpx is installed.
from aiobotocore.config import AioConfig
from aiobotocore.hooks import AioHierarchicalEmitter
from aiobotocore.session import AioSession
from botocore.hooks import EventAliaser
from botocore.loaders import JSONFileLoader, Loader, create_loader
from botocore.utils import get_environ_proxies

from .._compat import running_trio
from ..config import ProducerConfig


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken installation
        return False


if "trio" in sys.modules or _installed("trio"):
    # A trio program: it imported trio, or has trio installed (the trio extra, with httpx2), as
    # a program does that imports anykpl before trio (a sorted import block puts anykpl
    # first). httpx, trio's HTTP client here, builds its transport with httpcore, which it
    # imports on the first client (h11 with it, 20-40 ms with trio loaded): imported now, for
    # the reason above, not while the first producer opens. httpcore imports trio with it: an
    # asyncio program with the trio extra installed takes 0.07-0.1 s longer to import anykpl.
    # Without trio, or without httpx2, nothing is imported here; an httpx client made later
    # (asyncio with ``http_backend="httpx"``) imports it then (create_client).
    with contextlib.suppress(ImportError):  # trio without httpx2: httpx is not used
        import httpcore2  # noqa: F401  # the httpcore of httpx2, aiobotocore's choice

__all__ = ("abortive_socket_option", "create_client", "http_backend")


def http_backend(config: ProducerConfig) -> str:
    """The HTTP client the producer's AWS clients use: ``"aiohttp"`` or ``"httpx"``
    (``http_backend="auto"``: httpx under trio, aiohttp otherwise)."""
    if config.http_backend == "auto":
        return "httpx" if running_trio() else "aiohttp"
    return config.http_backend


def create_client(
    config: ProducerConfig,
    service: str,
    *,
    max_pool_connections: int,
    region: str | None = None,
    endpoint_url: str | None = None,
    abortive_close: bool = False,
) -> AbstractAsyncContextManager[Any]:
    """An aiobotocore client for ``service`` with the producer's settings: credentials,
    profile, region, certificate check, proxy, timeouts and HTTP backend (aiohttp under asyncio,
    httpx under trio, unless ``http_backend`` says otherwise). The SDK makes exactly one
    attempt per call (see the module's docstring): whoever calls it owns retrying. The Kinesis
    transport, the fleet coordinator's S3 client and the CloudWatch metrics sink all use it.
    ``abortive_close``: every connection closes abortively (:func:`abortive_socket_option`)."""
    backend = http_backend(config)
    options: dict[str, Any] = {
        "max_pool_connections": max_pool_connections,
        "connect_timeout": config.connect_timeout,
        "read_timeout": config.request_timeout,
        # total_max_attempts counts the first attempt; max_attempts would count retries
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    if config.proxy_url is not None:
        # every scheme: an endpoint over http (the emulator) or https goes through the proxy
        options["proxies"] = {"http": config.proxy_url, "https": config.proxy_url}
    if backend == "httpx":
        from aiobotocore.httpxsession import HttpxSession

        if "httpcore2" not in sys.modules:
            # not imported with anykpl (neither trio imported nor the trio extra installed
            # then, as asyncio with ``http_backend="httpx"``): httpx would import its transport
            # on the client's first request (20 ms, and trio's 0.1 s on asyncio), which the
            # first record put would wait for; imported now, while the producer opens
            with contextlib.suppress(ImportError):
                import httpcore2  # noqa: F401

        options["http_session_cls"] = _abortive_httpx_session() if abortive_close else HttpxSession
    elif abortive_close and _aiohttp_takes_socket_factory():
        options["connector_args"] = {"socket_factory": _abortive_socket}
    client: AbstractAsyncContextManager[Any] = _session(config.profile).create_client(
        service,
        region_name=region or config.region,
        endpoint_url=endpoint_url,
        aws_access_key_id=config.aws_access_key_id,
        aws_secret_access_key=config.aws_secret_access_key,
        aws_session_token=config.aws_session_token,
        # None hands the choice to botocore's chain (AWS_CA_BUNDLE, the profile's ca_bundle)
        verify=(
            config.ca_bundle
            if config.verify_certificate and _uses_tls(endpoint_url, config.proxy_url)
            else False
        ),
        config=AioConfig(**options),
    )
    return client


def _uses_tls(endpoint_url: str | None, proxy_url: str | None) -> bool:
    """Whether a client of ``endpoint_url`` may make a TLS connection. Not to a plain
    ``http://`` endpoint (an emulator, a local gateway) reached without a proxy: there the
    certificate settings have nothing to check, and leaving them off spares opening the
    client the loading of the CA bundle (20 ms, in a worker thread that the opening waits
    for). With a proxy, from the settings or the environment, the proxy's own connection
    may be TLS, checked with the same settings."""
    if endpoint_url is None or not endpoint_url.lower().startswith("http://"):
        return True
    if proxy_url is not None:
        return True
    # (NO_PROXY alone comes back as the key "no": no proxy)
    proxies = get_environ_proxies(endpoint_url)
    return any(proxies.get(scheme) for scheme in ("http", "https", "all"))


# ---------------------------------------------------------------------------------------------
# Abortive closes
#
# A request that times out is abandoned, and its connection closed: aiohttp and httpcore both
# close (never pool) a connection whose request was cancelled mid-way. But a plain close() is
# graceful: the kernel keeps sending what the socket's send buffer holds (on a slow path, up to
# megabytes of the abandoned body), then a FIN. Those bytes compete for the path with the
# retries; the service, once it has them all, may even store the abandoned request, whose
# records were retried: copies. With SO_LINGER {on, 0} a close discards the unsent bytes and
# sends a reset. (aiohttp writes out what its own write buffer still holds before it closes the
# socket; httpcore writes a body in pieces, each taken by the kernel before the next.) A
# connection closed idle (keep-alive expiry, shutdown) has nothing unsent and nothing to
# lose: only its FIN becomes a reset. Both HTTP clients take the option through
# public settings: aiohttp through its connector's ``socket_factory`` (aiobotocore's
# ``connector_args``), httpcore through its pool's ``socket_options``, which aiobotocore's
# HttpxSession does not pass on: it is set on the pool that session builds, where the pool is
# the one this was written for (otherwise connections close as before).


def abortive_socket_option() -> tuple[int, int, bytes]:
    """The socket option that makes a close abortive: ``SO_LINGER`` on, with no linger
    time (``setsockopt(*option)``)."""
    linger = struct.pack("HH" if sys.platform == "win32" else "ii", 1, 0)
    return socket.SOL_SOCKET, socket.SO_LINGER, linger


def _abortive_socket(addr_info: Any) -> socket.socket:
    """aiohttp's ``socket_factory``: the socket it would make, closing abortively."""
    family, type_, proto = addr_info[:3]
    sock = socket.socket(family=family, type=type_, proto=proto)
    with contextlib.suppress(OSError):  # a platform without SO_LINGER: a graceful close
        sock.setsockopt(*abortive_socket_option())
    return sock


@functools.cache
def _aiohttp_takes_socket_factory() -> bool:
    """Whether aiohttp's connector and aiobotocore's ``connector_args`` take a
    ``socket_factory`` (aiohttp ≥ 3.12)."""
    import inspect

    import aiohttp

    try:
        parameters = inspect.signature(aiohttp.TCPConnector).parameters
        AioConfig(connector_args={"socket_factory": _abortive_socket})
    except Exception:  # pragma: no cover - an older aiohttp or aiobotocore
        return False
    return "socket_factory" in parameters


_abortive_httpx_session_class: Any = None


def _abortive_httpx_session() -> Any:
    """aiobotocore's HttpxSession, whose connections close abortively where its httpx client
    is the one this was written for (a pool with ``socket_options``)."""
    global _abortive_httpx_session_class
    if _abortive_httpx_session_class is None:
        from aiobotocore.httpxsession import HttpxSession

        class _AbortiveHttpxSession(HttpxSession):  # type: ignore[misc]  # no types
            def _make_async_client(self) -> Any:
                client = super()._make_async_client()
                _close_abortively(client)
                return client

        _abortive_httpx_session_class = _AbortiveHttpxSession
    return _abortive_httpx_session_class


def _close_abortively(client: Any) -> bool:
    """Add the abortive option to the socket options of every pool of the httpx ``client``
    (its own transport and its mounts); ``False`` (nothing changed) where a pool is not
    httpcore's connection pool (``httpcore``, or the ``httpcore2`` of aiobotocore's
    preferred ``httpx2``) keeping its options where this was written for."""
    transports = [getattr(client, "_transport", None)]
    transports += list(getattr(client, "_mounts", {}).values())
    pools: list[Any] = []
    for transport in transports:
        if transport is None:
            continue  # a mount that sends nothing (no proxy for the scheme)
        pool = getattr(transport, "_pool", None)
        kind = type(pool)
        options = getattr(pool, "_socket_options", ())
        if (
            kind.__name__ != "AsyncConnectionPool"
            or kind.__module__.partition(".")[0] not in ("httpcore", "httpcore2")
            or not (options is None or isinstance(options, (list, tuple)))
        ):
            return False
        pools.append(pool)
    for pool in pools:
        pool._socket_options = [*(pool._socket_options or ()), abortive_socket_option()]
    return bool(pools)


# ---------------------------------------------------------------------------------------------
# The SDK's data files, read once per process
#
# Every client needs botocore's models: the service's, its endpoint rules, endpoints.json.
# A new AioSession reads them afresh, and before that lists every service's directory to check
# that the service exists (about 400 directories): 70-100 ms of CPU for a Kinesis client on a
# 2-core VM (2026-11-28), a third of it the listing, paid again by every producer, fleet store
# and metrics sink the process opens. Every session made here shares one loader per data path
# (what AWS_DATA_PATH or the profile's ``data_path`` says, its ``~`` and variables expanded
# when the first session of the process names it), which keeps what it read, as botocore
# keeps it for the clients of one session (models added under a data path later are not seen
# by that process). Credentials and configuration stay each session's own.

_loaders: dict[str | None, Loader] = {}
_loaders_lock = threading.Lock()  # SyncProducer opens its producer on a thread of its own


def _session(profile: str | None) -> AioSession:
    """A new AioSession for ``profile`` that reads the SDK's data through the process's
    shared loader (see above), its builtin event handlers copied from the process's
    (:func:`_builtin_handlers`)."""
    handlers = _builtin_handlers()
    if handlers is None:
        session = AioSession(profile=profile)
    else:
        session = AioSession(
            profile=profile, event_hooks=copy.copy(handlers), include_builtin_handlers=False
        )
    try:
        data_path = session.get_config_variable("data_path")
    except Exception:  # a profile that is not there: the session says so, as it always did
        return session
    with _loaders_lock:
        loader = _loaders.get(data_path)
        if loader is None:
            # botocore's own loader for the path, as its session would make it, answering
            # "is there a service X" for X alone
            loader = create_loader(data_path)
            loader.__class__ = _SharedLoader
            loader.file_loader = _JSONFiles()
            _loaders[data_path] = loader
    session.register_component("data_loader", loader)
    return session


# A new session also registers botocore's builtin event handlers, about 120 of them, each
# event name rewritten through botocore's aliases and each handler's signature inspected:
# 16 ms of CPU a session (2026-12-03), as long as the rest of opening a producer. The handlers
# are module-level functions and objects that every session registers alike, so they are
# registered once per process, into an emitter each session then gets a copy of (what botocore
# does for each client it makes). Session initializers (``botocore.register_initializer``)
# still run for each session, on its own copy.

_handlers: list[AioHierarchicalEmitter | None] = []  # the emitter, once made (None: see below)


def _builtin_handlers() -> AioHierarchicalEmitter | None:
    """The process's emitter holding botocore's builtin handlers, as ``Session`` registers
    them (not to be changed: sessions get copies); ``None`` where this botocore registers
    them in a way not known here (each session then registers its own)."""
    if _handlers:
        return _handlers[0]
    with _loaders_lock:
        if not _handlers:
            emitter = AioHierarchicalEmitter()
            events = EventAliaser(emitter)
            # Session._register_builtin_handlers, run on a stand-in that has what it uses;
            # botocore's own handlers, whose signatures it need not inspect (each takes
            # **kwargs), under event names that are aliased only where they hold an alias
            emitter._verify_accept_kwargs = _accepts_kwargs
            registrar = SimpleNamespace(
                register=_builtin_registrar(events, emitter), _events=events
            )
            try:
                AioSession._register_builtin_handlers(registrar, events)
            except (AttributeError, TypeError):  # pragma: no cover - another botocore
                _handlers.append(None)
            else:
                _handlers.append(emitter)
            finally:
                del emitter._verify_accept_kwargs
    return _handlers[0]


def _accepts_kwargs(handler: object) -> None:
    """(botocore's builtin handlers all take ``**kwargs``: not inspected, see above)"""


def _builtin_registrar(events: EventAliaser, emitter: AioHierarchicalEmitter) -> Any:
    """``events.register`` (an EventAliaser's), that registers an event name holding none of
    the aliases straight into ``emitter``: the aliaser splits each name once per alias (about
    40), 2-4 ms for the builtin handlers, where a name needs its aliases looked for once."""
    try:
        aliases = list(events._event_aliases)
    except AttributeError:  # pragma: no cover - another botocore: every name aliased
        return events.register
    # as EventAliaser._alias_event_name matches them: a dotless alias is one part of the name,
    # a dotted one any part of its text
    parts = frozenset(alias for alias in aliases if "." not in alias)
    texts = tuple(alias for alias in aliases if "." in alias)

    def register(
        event_name: str,
        handler: Any,
        unique_id: Any = None,
        unique_id_uses_count: bool = False,
    ) -> Any:
        if parts.isdisjoint(event_name.split(".")) and not any(t in event_name for t in texts):
            return emitter.register(event_name, handler, unique_id, unique_id_uses_count)
        return events.register(event_name, handler, unique_id, unique_id_uses_count)

    return register


class _SharedLoader(Loader):  # type: ignore[misc]  # botocore has no types
    """botocore's loader (made by ``create_loader``, then given this class), that answers
    "is there a service X" by looking for X alone."""

    def list_available_services(self, type_name: str) -> Sequence[str]:
        return _AvailableServices(self, type_name)


class _JSONFiles(JSONFileLoader):  # type: ignore[misc]  # botocore has no types
    """botocore's reader of its JSON data files, reading objects into plain dicts. botocore
    reads them into OrderedDicts (a hook called for every object), which made endpoints.json
    (1.2 MB, read by every first client of a process) take 20 ms instead of 6; a dict keeps the
    order as well, and nothing reads these data as anything but mappings. endpoints.json is
    read by :func:`_read_endpoints` (see there)."""

    def load_file(self, file_path: str) -> Any:
        for extension, open_file in _JSON_FILES:
            path = file_path + extension
            if os.path.isfile(path):
                if os.path.basename(file_path) == "endpoints":
                    return _read_endpoints(path, open_file)
                return _read_json(path, open_file)
        return None


#: how botocore's data files may be stored, in the order its loader tries them
_JSON_FILES: Final = ((".json", open), (".json.gz", gzip.open))


def _read_json(path: str, open_file: Callable[[str, str], Any]) -> Any:
    with open_file(path, "rb") as file:
        return json.loads(file.read().decode("utf-8"))


# endpoints.json holds the endpoints of every service in every partition: 23,000 dicts and lists
# (botocore 1.43), 16,000 of them containers that the cyclic garbage collector tracks, held by
# the process's loader for as long as it runs. Each full collection of the process walked them
# (6 ms of the 25 a full collection took next to a producer, 2-core VM, 2026-12-04), and
# reading them set one off in the first producer's opening (a 30 ms stall of its event loop,
# there a producer's opening took 67 ms in all). A client reads the entries of its own service
# only. So each partition's ``services`` is a mapping (:class:`_Services`) that holds, from the
# first reading, the services anykpl's clients use, and reads any other service from the file
# the first time it is asked for, or the whole file if it is listed: botocore's endpoint
# resolver finds the same entries as in the whole file, and the rest is not kept. The file is
# read with the collector paused (:func:`_collection_paused`), and what is not kept is freed
# before it resumes: no collection walks it, and it counts towards none.

#: The services (their endpoints.json names) kept from the first reading: anykpl's clients'
#: (Kinesis, CloudWatch, DynamoDB, S3, Glue's schema registry) and STS, which botocore's
#: assume-role credentials call.
_SERVICES_KEPT: Final = frozenset({"kinesis", "monitoring", "dynamodb", "s3", "glue", "sts"})


def _read_endpoints(path: str, open_file: Callable[[str, str], Any]) -> Any:
    """endpoints.json at ``path``, each partition's ``services`` a :class:`_Services` (see
    above); as read, where the file is not shaped as botocore's is."""
    with _collection_paused():
        data = _read_json(path, open_file)
        try:
            partitions = data["partitions"]
            names = [partition["partition"] for partition in partitions]
            shaped = all(type(partition["services"]) is dict for partition in partitions)
        except (KeyError, TypeError):
            return data
        if not shaped or len(set(names)) != len(names):
            return data
        source = _EndpointsFile(path, open_file)
        for partition, name in zip(partitions, names, strict=True):
            # (the services not kept freed here, while the collector is paused)
            services = _Services(source, _kept(partition["services"]))
            partition["services"] = source.partitions[name] = services
    return data


def _kept(services: dict[str, Any]) -> dict[str, Any]:
    """Of a partition's ``services``, those in :data:`_SERVICES_KEPT`, in the file's order."""
    return {service: entry for service, entry in services.items() if service in _SERVICES_KEPT}


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """The cyclic garbage collector paused (as the caller found it after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _EndpointsFile:
    """An endpoints.json read by :func:`_read_endpoints`: its partitions' services, by
    partition name, and where to read the rest."""

    def __init__(self, path: str, open_file: Callable[[str, str], Any]) -> None:
        self.path = path
        self.open_file = open_file
        self.partitions: dict[str, _Services] = {}

    def read(self, service: str | None) -> None:
        """Read ``service``'s entries into each partition, which from then on knows whether
        it has the service; every service's, with ``None``."""
        with _collection_paused():
            # (what is not kept freed as _take returns, while the collector is paused)
            self._take(_read_json(self.path, self.open_file), service)

    def _take(self, data: Any, service: str | None) -> None:
        found: dict[str, dict[str, Any]] = {
            partition["partition"]: partition["services"] for partition in data["partitions"]
        }
        for name, services in self.partitions.items():
            entries = found.get(name, {})
            if service is None:
                # in the file's order, the entries given out already kept
                known = services.known
                services.known = {each: known.get(each, entry) for each, entry in entries.items()}
                services.complete = True
            elif service in entries:
                services.known.setdefault(service, entries[service])
            else:
                services.absent.add(service)


class _Services(Mapping[str, Any]):
    """A partition's ``services`` in endpoints.json (see above): the services read so far; any
    other is read from the file the first time it is asked for, and every one of them where
    the mapping is listed."""

    def __init__(self, source: _EndpointsFile, known: dict[str, Any]) -> None:
        self.source = source
        self.known = known
        self.absent: set[str] = set()  # services asked for, not in this partition
        self.complete = False  # every service of the partition known

    def __getitem__(self, service: str) -> Any:
        known = self.known
        if (
            service not in known
            and not self.complete
            and type(service) is str
            and service not in self.absent
        ):
            self.source.read(service)
        return known[service]

    def __iter__(self) -> Iterator[str]:
        if not self.complete:
            self.source.read(None)
        return iter(self.known)

    def __len__(self) -> int:
        if not self.complete:
            self.source.read(None)
        return len(self.known)


class _AvailableServices(Sequence[str]):
    """The services with a ``type_name`` model: membership is checked for the one service
    asked about (what botocore does before it loads a model); the whole list, wanted only for
    an error message, is botocore's own listing."""

    def __init__(self, loader: _SharedLoader, type_name: str) -> None:
        self._loader = loader
        self._type_name = type_name

    def __contains__(self, service: object) -> bool:
        if not isinstance(service, str):
            return False
        for path in self._loader.search_paths:
            # (named exactly, as botocore's listing names it, also where file names ignore case)
            if not os.path.isdir(path) or service not in os.listdir(path):
                continue
            directory = os.path.join(path, service)
            if not os.path.isdir(directory):
                continue
            for version in os.listdir(directory):
                if self._loader.file_loader.exists(
                    os.path.join(directory, version, self._type_name)
                ):
                    return True
        return False

    def _all(self) -> list[str]:
        services: list[str] = Loader.list_available_services(self._loader, self._type_name)
        return services

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())
