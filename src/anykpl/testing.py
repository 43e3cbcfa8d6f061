"""A local Kinesis for your own tests: the ``kinesis_emulator`` pytest fixture.

Installing anykpl registers this module as a pytest plugin (the ``pytest11`` entry point), so
a project that depends on anykpl gets the fixture with nothing to configure::

    from anykpl import Producer

    async def test_my_service_sends_readings(kinesis_emulator):
        kinesis_emulator.create_stream("readings", shards=2)
        async with Producer(kinesis_emulator.producer_config()) as producer:
            await producer.put_record("readings", b"21.5", partition_key="sensor-1")
        assert kinesis_emulator.data("readings") == [b"21.5"]

The fixture starts anykpl's emulator (moto's Kinesis behind a write path that enforces the
service's per-shard limits, ``docs/emulator.md``) on a free port of 127.0.0.1 for the test,
and stops it after: every test gets an empty Kinesis. (The emulator keeps its streams in moto's
backends, in the test's process; the fixture clears them as it starts and stops, so do not
use it in a test that also runs moto's ``mock_aws``.) For the test's duration it also sets
fake AWS credentials and a region in the environment, as moto's ``mock_aws`` does, so neither
the code under test nor the test needs real ones (and none can leak to AWS).

Configure it with the ``anykpl_emulator`` marker::

    @pytest.mark.anykpl_emulator(streams={"readings": 2}, faults=Faults(record_throttle_rate=0.1))
    def test_...(kinesis_emulator): ...

It accepts the keyword arguments of :class:`anykpl.emulator.Emulator` (``streams``,
``limits``, ``faults``, ``storms``, ``reshards``, ``region``). Shard limits are on by
default (``limits=Limits.off()`` turns them off); faults can also change at run time through
``kinesis_emulator.client`` (``set_faults``, ``storm``, ``reshard``...).

It works in sync tests (with :class:`anykpl.SyncProducer`) and in async ones under anyio's
pytest plugin, on asyncio and trio: the emulator runs on a thread of its own. It needs the
``emulator`` extra (``pip install 'anykpl[emulator]'``); without it, the fixture fails with
that instruction instead of an import error, and the plugin loads anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .config import ProducerConfig
    from .emulator import Emulator, EmulatorClient
    from .readback import ReadRecord

__all__ = ("KinesisEmulator", "kinesis_emulator")

#: What the fixture puts in the environment while a test runs (moto's ``mock_aws`` sets the
#: same kind of values): botocore finds credentials and a region without any real ones.
FAKE_ENVIRONMENT: Mapping[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

#: The environment variables that could point botocore at real credentials or config; unset
#: while the fixture runs.
_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")

MARKER = "anykpl_emulator"


class KinesisEmulator:
    """A running emulator, as the ``kinesis_emulator`` fixture gives it.

    Attributes:
        endpoint_url: the emulator's URL (``http://127.0.0.1:PORT``), for any Kinesis or S3
            client: ``ProducerConfig(endpoint_url=...)``, boto3, the AWS CLI.
        region: the region its streams live in (``us-east-1`` unless the marker says).
    """

    def __init__(self, emulator: Emulator, endpoint_url: str) -> None:
        self._emulator = emulator
        self.endpoint_url = endpoint_url
        self.region = emulator.region

    def __repr__(self) -> str:
        return f"<KinesisEmulator {self.endpoint_url}>"

    @property
    def client(self) -> EmulatorClient:
        """The emulator's control client: faults, limits, storms, reshards and statistics at
        run time (``docs/emulator.md``)."""
        return self._emulator.client

    def create_stream(self, name: str, shards: int = 1) -> str:
        """Create an ACTIVE stream of ``shards`` shards; returns its name."""
        self.client.create_stream(name, shards, region=self.region)
        return name

    def kinesis_client(self) -> Any:
        """A synchronous botocore Kinesis client for the emulator (fake credentials)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "kinesis",
            region_name=self.region,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=FAKE_ENVIRONMENT["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        )

    def producer_config(self, **overrides: Any) -> ProducerConfig:
        """A :class:`~anykpl.ProducerConfig` for the emulator: its endpoint and region, fake
        credentials, and ``overrides`` (any field)."""
        from .config import ProducerConfig

        fields: dict[str, Any] = {
            "region": self.region,
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": FAKE_ENVIRONMENT["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": FAKE_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        }
        fields.update(overrides)
        return ProducerConfig(**fields)

    def records(self, stream: str) -> list[ReadRecord]:
        """Every user record in ``stream`` as a consumer reads it: each shard from
        ``TRIM_HORIZON``, aggregates deaggregated as the KCL does. Each is a
        :class:`~anykpl.readback.ReadRecord` (``shard_id``, ``sequence_number``,
        ``sub_sequence_number``, ``partition_key``, ``data``), in shard order and, within a
        shard, in the order stored. Synchronous: from async code, call it through
        ``anyio.to_thread.run_sync``."""
        from .readback import read_user_records

        client = self.kinesis_client()
        try:
            return list(read_user_records(client, stream))
        finally:
            client.close()

    def data(self, stream: str) -> list[bytes]:
        """The data of every user record in ``stream`` (see :meth:`records`)."""
        return [record.data for record in self.records(stream)]


def _reset_moto() -> None:
    """Clear moto's backends in this process, where the emulator keeps its streams (what
    moto's server does for ``POST /moto-api/reset``)."""
    from moto.moto_api._internal.models import moto_api_backend

    moto_api_backend.reset()


def _emulator_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(MARKER))):
        if marker.args:
            pytest.fail(
                f"@pytest.mark.{MARKER} takes keyword arguments only "
                "(streams=, limits=, faults=, storms=, reshards=, region=)",
                pytrace=False,
            )
        options.update(marker.kwargs)
    return options


@pytest.fixture
def kinesis_emulator(request: pytest.FixtureRequest) -> Iterator[KinesisEmulator]:
    """A fresh local Kinesis for the test, on 127.0.0.1 (see :mod:`anykpl.testing`)."""
    try:
        from .emulator import Emulator
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        pytest.fail(
            "the kinesis_emulator fixture needs anykpl's emulator extra: "
            f"pip install 'anykpl[emulator]' ({exc})",
            pytrace=False,
        )
    options = _emulator_options(request)
    try:
        emulator = Emulator(**options)
    except (TypeError, ValueError) as exc:
        pytest.fail(f"@pytest.mark.{MARKER}: {exc}", pytrace=False)
    _reset_moto()  # an empty Kinesis, whatever an earlier emulator in this process left
    with pytest.MonkeyPatch.context() as environment:  # undone after the test
        for name, value in FAKE_ENVIRONMENT.items():
            environment.setenv(name, value)
        for name in _CLEARED:
            environment.delenv(name, raising=False)
        url = emulator.start()
        try:
            yield KinesisEmulator(emulator, url)
        finally:
            emulator.stop()
            _reset_moto()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): options of the kinesis_emulator fixture's emulator "
        "(streams=, limits=, faults=, storms=, reshards=, region=; anykpl.emulator.Emulator)",
    )
