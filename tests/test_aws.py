"""The SDK clients' factory: one loader of botocore's data files per process and data path."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import botocore
import pytest
from aiobotocore.session import AioSession
from botocore.exceptions import NoRegionError, ProfileNotFound, UnknownServiceError
from botocore.loaders import Loader
from botocore.regions import EndpointResolver

import anykpl._transport._aws
from anykpl import ProducerConfig
from anykpl._transport._aws import _session, create_client


def config() -> ProducerConfig:
    return ProducerConfig(region="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


@pytest.fixture(autouse=True)
def _no_data_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No data path of the environment's, and the process's loaders as they were after."""
    monkeypatch.delenv("AWS_DATA_PATH", raising=False)
    monkeypatch.setattr(anykpl._transport._aws, "_loaders", {})


@pytest.mark.anyio
async def test_a_client_is_made_without_listing_every_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore lists the directories of all 400 services before it loads a model; the
    shared loader looks for the one service."""
    listings: list[str] = []
    listing = Loader.list_available_services

    def counted(self: Loader, type_name: str) -> list[str]:
        listings.append(type_name)
        return listing(self, type_name)  # type: ignore[no-any-return]

    monkeypatch.setattr(Loader, "list_available_services", counted)
    async with create_client(config(), "kinesis", max_pool_connections=1) as client:
        assert client.meta.service_model.service_name == "kinesis"
    assert listings == []


@pytest.mark.anyio
async def test_clients_share_the_models_they_read() -> None:
    """A second client (another producer's, a fleet store's) reads no model file again: the
    loader, and what it read, is the process's."""
    async with create_client(config(), "kinesis", max_pool_connections=1) as first:
        loader = anykpl._transport._aws._loaders[None]
        reads: list[str] = []
        load_file = loader.file_loader.load_file

        def counted(path: str) -> object:
            reads.append(path)
            return load_file(path)

        loader.file_loader.load_file = counted
        try:
            async with create_client(config(), "kinesis", max_pool_connections=1) as second:
                assert second is not first
                assert second.meta.service_model.service_name == "kinesis"
        finally:
            del loader.file_loader.load_file
    assert reads == []
    assert anykpl._transport._aws._loaders[None] is loader


def test_a_service_is_found_without_listing_them_all() -> None:
    """Membership is what botocore checks before it loads a model; the whole list, for an
    error message, is botocore's own."""
    services = _session(None).get_component("data_loader").list_available_services("service-2")
    assert {"kinesis", "dynamodb", "s3"} <= set(services)
    for name in ("kinesis", "dynamodb", "s3"):
        assert name in services
    strangers: tuple[object, ...] = ("no-such-service", "", "../kinesis", 3)
    for stranger in strangers:
        assert stranger not in services
    everything = Loader().list_available_services("service-2")
    assert list(services) == everything
    assert len(services) == len(everything)
    assert services[0] == everything[0]


@pytest.mark.anyio
async def test_an_unknown_service_is_named_as_botocore_names_it() -> None:
    with pytest.raises(UnknownServiceError, match=r"Unknown service: 'no-such-service'.*kinesis"):
        async with create_client(config(), "no-such-service", max_pool_connections=1):
            pass  # pragma: no cover


@pytest.mark.anyio
async def test_a_data_path_of_ones_own_has_its_own_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_DATA_PATH`` (or the profile's ``data_path``) is searched first, as botocore's own
    loader does: a model there is found, and the loader is that path's."""
    model_dir = tmp_path / "kinesis" / "2013-12-02"
    model_dir.mkdir(parents=True)
    builtin = Loader().load_service_model("kinesis", "service-2")
    builtin["documentation"] = "anykpl's test model"
    (model_dir / "service-2.json").write_text(json.dumps(builtin))
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    async with create_client(config(), "kinesis", max_pool_connections=1) as client:
        assert client.meta.service_model.documentation == "anykpl's test model"
    assert anykpl._transport._aws._loaders[
        str(tmp_path)
    ] is not anykpl._transport._aws._loaders.get(None)


@pytest.mark.anyio
async def test_a_missing_profile_is_reported_as_before() -> None:
    with pytest.raises(ProfileNotFound):
        async with create_client(
            ProducerConfig(region="us-east-1", profile="anykpl-no-such-profile"),
            "kinesis",
            max_pool_connections=1,
        ):
            pass  # pragma: no cover


def _handlers(session: AioSession) -> list[tuple[str, list[str]]]:
    """Every event name of ``session``'s emitter, with its handlers in the order they run."""
    found: list[tuple[str, list[str]]] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for part, child in node.get("children", {}).items():
            walk(child, f"{prefix}.{part}" if prefix else part)
        if node.get("values") is not None:
            found.append((prefix, [repr(handler) for handler in node["values"]]))

    walk(session._original_handler._handlers._root, "")
    return sorted(found)


def test_a_session_gets_botocores_builtin_handlers_registered_once_per_process() -> None:
    """A session made here has the handlers botocore's own session registers, the same ones
    in the same order, copied from the process's rather than registered afresh; what is
    registered on one session stays that session's."""
    own = AioSession()
    ours = _session(None)
    assert len(_handlers(own)) > 50
    assert _handlers(ours) == _handlers(own)
    shared = anykpl._transport._aws._builtin_handlers()
    assert shared is not None
    assert ours._original_handler is not shared

    def handler(**kwargs: object) -> None:
        """(registered on one session only)"""

    ours.register("before-call.kinesis.PutRecords", handler)
    assert _handlers(_session(None)) == _handlers(own)
    assert _handlers(ours) != _handlers(own)


def test_session_initializers_run_for_each_session() -> None:
    """``botocore.register_initializer``: called with each new session, as botocore's own
    sessions are; what it registers is that session's."""
    made: list[object] = []

    def initializer(session: object) -> None:
        made.append(session)

    botocore.register_initializer(initializer)
    try:
        first, second = _session(None), _session(None)
    finally:
        botocore.unregister_initializer(initializer)
    assert made == [first, second]


@pytest.mark.parametrize(
    ("endpoint", "proxy", "environment", "uses_tls"),
    [
        (None, None, {}, True),  # AWS itself
        ("https://kinesis.example", None, {}, True),
        ("http://127.0.0.1:4567", None, {}, False),
        ("HTTP://127.0.0.1:4567", None, {}, False),
        ("http://127.0.0.1:4567", "https://proxy.example:3128", {}, True),
        ("http://127.0.0.1:4567", None, {"HTTP_PROXY": "https://proxy.example:3128"}, True),
        (
            "http://127.0.0.1:4567",
            None,
            {"HTTP_PROXY": "https://proxy.example:3128", "NO_PROXY": "127.0.0.1"},
            False,
        ),
        ("http://127.0.0.1:4567", None, {"NO_PROXY": "example.com"}, False),
        ("http://127.0.0.1:4567", None, {"ALL_PROXY": "https://proxy.example:3128"}, True),
    ],
)
def test_certificate_settings_apply_where_a_connection_may_be_tls(
    endpoint: str | None,
    proxy: str | None,
    environment: dict[str, str],
    uses_tls: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a plain-HTTP endpoint reached without a proxy (from the settings or the
    environment, as botocore finds it) makes no TLS connection at all."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert anykpl._transport._aws._uses_tls(endpoint, proxy) is uses_tls


@pytest.mark.parametrize("name", ["endpoints", "partitions", "kinesis/2013-12-02/service-2"])
def test_data_files_read_as_botocore_reads_them(name: str) -> None:
    """The shared loader reads botocore's data files into plain dicts (faster than botocore's
    OrderedDicts): the same content, in the same order."""
    _session(None)
    shared = anykpl._transport._aws._loaders[None]
    own = Loader()
    path = next(
        os.path.join(base, name)
        for base in own.search_paths
        if own.file_loader.exists(os.path.join(base, name))
    )
    ours, theirs = shared.file_loader.load_file(path), own.file_loader.load_file(path)
    assert type(ours) is dict
    # keys in the same order, all the way down (endpoints.json's services listed whole)
    assert json.dumps(ours, default=dict) == json.dumps(theirs)


def _endpoints() -> tuple[Any, Any]:
    """endpoints.json as a fresh shared loader reads it, and as botocore's own loader does."""
    _session(None)
    return anykpl._transport._aws._loaders[None].load_data("endpoints"), Loader().load_data(
        "endpoints"
    )


def _tracked(data: Any) -> int:
    """The containers of ``data`` (JSON data, some of its mappings ``_Services``) that the
    cyclic garbage collector tracks."""
    count = 0
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, anykpl._transport._aws._Services):
            node = node.known
        if isinstance(node, dict):
            count += gc.is_tracked(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            count += gc.is_tracked(node)
            stack.extend(node)
    return count


def test_endpoints_keep_the_services_anykpls_clients_use() -> None:
    """endpoints.json has every service of every partition, 16,000 containers that each full
    collection of the process would walk: the loader keeps the services anykpl's clients use
    (the rest is read when asked for, below), and the collector is as the caller had it."""
    kept = anykpl._transport._aws._SERVICES_KEPT
    for enabled in (True, False):
        if not enabled:
            gc.disable()
        try:
            ours, theirs = _endpoints()
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
        assert [p["partition"] for p in ours["partitions"]] == [
            p["partition"] for p in theirs["partitions"]
        ]
        for our, their in zip(ours["partitions"], theirs["partitions"], strict=True):
            assert list(our["services"].known) == [s for s in their["services"] if s in kept]
            assert {k: v for k, v in our.items() if k != "services"} == {
                k: v for k, v in their.items() if k != "services"
            }
        assert "kinesis" in ours["partitions"][0]["services"].known
        assert _tracked(ours) < 1_000 < 10_000 < _tracked(theirs)


def test_endpoints_of_other_services_are_read_when_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """botocore's endpoint resolver, given the loader's endpoints.json, answers as it does
    given the whole file, for the services kept and any other (read from the file once per
    service, every partition at once), a service the file does not have included."""
    ours, theirs = _endpoints()
    reads: list[str] = []
    read_json = anykpl._transport._aws._read_json

    def counted(path: str, open_file: Any) -> Any:
        reads.append(path)
        return read_json(path, open_file)

    monkeypatch.setattr(anykpl._transport._aws, "_read_json", counted)
    mine, botocores = EndpointResolver(ours), EndpointResolver(theirs)
    services = ["kinesis", "sts", "iam", "ec2", "sso", "route53", "no-such-service"]
    for _ in range(2):
        for partition in theirs["partitions"]:
            name = partition["partition"]
            regions = [*list(partition["regions"])[:3], "aws-global", None]
            for service in services:
                for region in regions:
                    for fips in (False, True):
                        try:
                            expected = botocores.construct_endpoint(
                                service, region, use_fips_endpoint=fips
                            )
                        except NoRegionError:
                            with pytest.raises(NoRegionError):
                                mine.construct_endpoint(service, region, use_fips_endpoint=fips)
                            continue
                        actual = mine.construct_endpoint(service, region, use_fips_endpoint=fips)
                        assert actual == expected, (service, region, fips)
                assert mine.get_available_endpoints(
                    service, name
                ) == botocores.get_available_endpoints(service, name)
        # the services not kept read once each, on the first round only
        assert len(reads) == 5
    assert "ec2" in ours["partitions"][0]["services"]
    assert "no-such-service" not in ours["partitions"][0]["services"]
    assert len(reads) == 5


@pytest.mark.anyio
async def test_a_client_finds_its_endpoint_from_the_kept_services() -> None:
    """A client made without an endpoint URL resolves it as botocore does, in each partition
    (the endpoint rules, with the partition data of endpoints.json)."""
    for region, url in (
        ("us-east-1", "https://kinesis.us-east-1.amazonaws.com"),
        ("cn-north-1", "https://kinesis.cn-north-1.amazonaws.com.cn"),
        ("us-gov-west-1", "https://kinesis.us-gov-west-1.amazonaws.com"),
    ):
        async with create_client(
            ProducerConfig(region=region, aws_access_key_id="x", aws_secret_access_key="x"),
            "kinesis",
            max_pool_connections=1,
        ) as client:
            assert client.meta.endpoint_url == url


def _run_program(program: str) -> str:
    """``program`` in a fresh interpreter (none of anykpl, trio, httpx imported yet), with the
    client's own settings only (no profile or data path of the environment's): its output."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environment,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_with_the_trio_extra_anykpl_imports_httpx_transport_with_itself() -> None:
    """httpx imports its transport (httpcore2, h11) on a client's first request, 20-40 ms
    that a trio program's first producer would spend opening, its event loop stalled. Where
    the trio extra is installed, importing anykpl imports it, even before trio (a sorted import
    block puts anykpl first)."""
    pytest.importorskip("httpcore2")
    pytest.importorskip("trio")
    program = """
import sys
import anykpl
print("httpcore2" in sys.modules, "h11" in sys.modules)
"""
    assert _run_program(program).split() == ["True", "True"]


def test_a_trio_client_imports_its_transport_when_it_is_made() -> None:
    """Where anykpl found neither trio imported nor the trio extra installed when it was
    imported (here: trio hidden from it then), making an httpx client imports httpx's transport,
    rather than the client's first request, which the first record put would wait for."""
    pytest.importorskip("httpcore2")
    program = """
import importlib.util
import sys

find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == "trio" else find_spec(name, *args)
import anykpl
from anykpl._transport._aws import create_client
importlib.util.find_spec = find_spec
assert "httpcore2" not in sys.modules
import trio

async def main():
    config = anykpl.ProducerConfig(
        region="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    async with create_client(config, "kinesis", max_pool_connections=1):
        print("httpcore2" in sys.modules, "h11" in sys.modules)

trio.run(main)
"""
    assert _run_program(program).split() == ["True", "True"]
