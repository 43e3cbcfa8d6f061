"""The benchmarks' endpoints (benchmarks/endpoints.py): moto's own server really starts, answers
Kinesis, and stops; a bad choice is refused."""

from __future__ import annotations

import argparse
import importlib.util
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _endpoints() -> ModuleType:
    spec = importlib.util.spec_from_file_location("endpoints", ROOT / "benchmarks" / "endpoints.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moto_server_answers_kinesis_and_stops() -> None:
    import boto3

    endpoints = _endpoints()
    with endpoints.start_endpoint("moto") as url:
        client = boto3.client(
            "kinesis",
            region_name="us-east-1",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_stream(StreamName="bench", ShardCount=2)
        put = client.put_record(StreamName="bench", Data=b"x", PartitionKey="k")
        assert put["ShardId"].startswith("shardId-")
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/moto-api/", timeout=2.0)


def test_a_url_is_used_as_it_is() -> None:
    endpoints = _endpoints()
    with endpoints.start_endpoint("http://127.0.0.1:4567") as url:
        assert url == "http://127.0.0.1:4567"


@pytest.mark.parametrize("value", ["kinesalite", "127.0.0.1:4567", ""])
def test_a_bad_endpoint_choice_is_refused(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="'emulator', 'moto' or an http"):
        _endpoints().check_endpoint(value)
