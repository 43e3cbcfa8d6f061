"""Where the demo's readings go: the emulator it starts, or an endpoint given with
``--endpoint``, with the TLS checks and credentials that go with each.

:func:`started_target` makes the choice and makes the stream ready: with ``--endpoint`` it uses
botocore's credential chain (or the demo's own when there are none: a local endpoint that
accepts any), creates the stream unless it exists, and turns a failed TLS handshake into one
clear line; without it, it spawns the emulator (``anykpl.emulator.spawn``) with the stream and
stops it afterwards. ``--ca-bundle`` and ``--no-verify`` apply to ``--endpoint`` only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._report import Printer

__all__ = ("DEMO_CREDENTIALS", "Target", "botocore_client", "started_target", "unverified_quietly")

#: Credentials for the emulator, which accepts any.
DEMO_CREDENTIALS = {"aws_access_key_id": "demo", "aws_secret_access_key": "demo"}


@dataclass(frozen=True)
class Target:
    """Where the readings go.

    Attributes:
        endpoint_url: the Kinesis endpoint (None: the service's, from the region).
        region: the AWS region.
        credentials: explicit credentials, or empty for botocore's usual chain.
        stream: the stream name.
        emulator: whether the endpoint is the emulator this demo started (its statistics can
            be asked for).
        verify_certificate: whether to check the endpoint's TLS certificate (``--no-verify``
            turns it off).
        ca_bundle: the PEM file of CA certificates to check it with (``--ca-bundle``), or
            None for botocore's chain.
    """

    endpoint_url: str | None
    region: str
    credentials: Mapping[str, str]
    stream: str
    emulator: bool
    verify_certificate: bool = True
    ca_bundle: str | None = None

    @property
    def verify(self) -> bool | str | None:
        """botocore's ``verify``: False, the CA bundle, or None (botocore's chain)."""
        return self.ca_bundle if self.verify_certificate else False


def botocore_client(target: Target) -> Any:
    import botocore.session

    session = botocore.session.get_session()
    return session.create_client(
        "kinesis",
        region_name=target.region,
        endpoint_url=target.endpoint_url,
        verify=target.verify,
        **target.credentials,
    )


def _ensure_stream(client: Any, stream: str, shards: int, say: Printer) -> None:
    """Create ``stream`` with ``shards`` shards unless it exists; wait until it is ACTIVE."""
    try:
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
    except client.exceptions.ResourceNotFoundException:
        say(f"creating stream {stream} with {shards} shards")
        client.create_stream(StreamName=stream, ShardCount=shards)
    else:
        say(
            f"using the existing stream {stream} ({summary['OpenShardCount']} open shards, "
            f"{summary['StreamStatus']})"
        )
    client.get_waiter("stream_exists").wait(
        StreamName=stream, WaiterConfig={"Delay": 1, "MaxAttempts": 120}
    )


def _external_target(args: argparse.Namespace) -> Target:
    """The target for ``--endpoint``: credentials from botocore's chain, or the demo's."""
    import botocore.session

    session = botocore.session.get_session()
    region = args.region or session.get_config_variable("region") or "us-east-1"
    # no credentials anywhere: likely a local endpoint that accepts any
    credentials = {} if session.get_credentials() is not None else DEMO_CREDENTIALS
    endpoint = None if args.endpoint == "aws" else args.endpoint
    if args.ca_bundle is not None and not os.path.isfile(args.ca_bundle):
        raise SystemExit(f"anykpl demo: --ca-bundle {args.ca_bundle}: no such file")
    return Target(
        endpoint,
        region,
        credentials,
        args.stream,
        emulator=False,
        verify_certificate=args.verify,
        ca_bundle=args.ca_bundle,
    )


@contextmanager
def started_target(args: argparse.Namespace, say: Printer) -> Iterator[Target]:
    """The endpoint to use: ``--endpoint``, or the emulator started here (and stopped after)."""
    if args.endpoint is not None:
        import botocore.exceptions

        target = _external_target(args)
        where = target.endpoint_url or f"the Kinesis endpoint of {target.region}"
        if not target.verify_certificate:
            say(
                f"warning: TLS certificate verification is off (--no-verify): anyone between "
                f"here and {where} can read and change the traffic",
                "yellow",
            )
        client = botocore_client(target)
        try:
            _ensure_stream(client, target.stream, args.shards, say)
        except botocore.exceptions.SSLError as exc:
            raise SystemExit(
                f"anykpl demo: TLS with {where} failed ({_tls_reason(exc)}); for a test "
                "endpoint with a self-signed certificate, give its CA with --ca-bundle, or "
                "--no-verify skips the check"
            ) from None
        except botocore.exceptions.EndpointConnectionError:
            raise SystemExit(f"anykpl demo: could not connect to {where}") from None
        finally:
            client.close()
        yield target
        return
    if not args.verify:
        raise SystemExit("anykpl demo: --no-verify applies to --endpoint only")
    if args.ca_bundle is not None:
        raise SystemExit("anykpl demo: --ca-bundle applies to --endpoint only")
    missing = [m for m in ("moto", "h11") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"anykpl demo starts the emulator, which needs {' and '.join(missing)}: "
            "pip install 'anykpl[demo]' (or give --endpoint)"
        )
    from anykpl.emulator import spawn

    say(f"starting the emulator with stream {args.stream} ({args.shards} shards, limits on)")
    with spawn(streams={args.stream: args.shards}) as url:
        yield Target(url, args.region or "us-east-1", DEMO_CREDENTIALS, args.stream, True)


@contextmanager
def unverified_quietly(verify: bool) -> Iterator[None]:
    """Without verification, silence urllib3's warning: the demo warned once, and urllib3
    would warn again on every request of its botocore clients."""
    with warnings.catch_warnings():
        if not verify:
            from urllib3.exceptions import InsecureRequestWarning

            warnings.simplefilter("ignore", InsecureRequestWarning)
        yield


def _tls_reason(exc: BaseException) -> str:
    """What went wrong in the handshake ("certificate verify failed: self-signed certificate"),
    from the ``ssl`` error botocore's ``SSLError`` wraps (in urllib3's), else its message."""
    import ssl

    seen: list[BaseException] = []
    pending: list[object] = [exc]
    while pending:
        current = pending.pop()
        if not isinstance(current, BaseException) or current in seen:
            continue
        seen.append(current)
        if isinstance(current, ssl.SSLCertVerificationError) and current.verify_message:
            return f"certificate verify failed: {current.verify_message}"
        if isinstance(current, ssl.SSLError) and current.reason:
            return str(current.reason)
        pending.extend([*current.args, *getattr(current, "kwargs", {}).values()])
        pending.extend([current.__cause__, current.__context__])
    return str(exc)
