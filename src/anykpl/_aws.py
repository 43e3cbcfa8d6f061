"""The AWS SDK clients the producer makes, and which event loop runs them.

One factory, :func:`create_client`, builds every aiobotocore client anykpl uses — the Kinesis
transport (``_sender.py``), the fleet coordinator's S3 client (``_fleet/``) and the CloudWatch
metrics sink — from the producer's settings. The SDK's own retries are off everywhere
(``total_max_attempts=1``, one attempt per call), as the KPL builds its client with
``DefaultRetryStrategy(0)``: the caller owns retrying. botocore's ``max_attempts`` counts
*retries* after the first attempt, so ``max_attempts=1`` (what anykpl once passed) let the SDK
repeat every call once on a 5xx, a throttling code, a timeout or a reset, unseen by the attempt
history, the backoff, the retry budget and adaptive control.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

# Imported with anykpl, not when a producer opens: these imports take 0.2-0.4 s (aiohttp,
# botocore), and inside ``async with Producer(...)`` they would stall a running service's event
# loop for that long, every task with it. aiobotocore's endpoint module also brings in its httpx
# session (trio's HTTP client) when httpx is installed.
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from .config import ProducerConfig

__all__ = ("create_client", "http_backend", "running_trio")


def running_trio() -> bool:
    try:
        import sniffio
    except ImportError:  # pragma: no cover - trio depends on sniffio
        return False
    try:
        return bool(sniffio.current_async_library() == "trio")
    except sniffio.AsyncLibraryNotFoundError:
        return False


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
) -> AbstractAsyncContextManager[Any]:
    """An aiobotocore client for ``service`` with the producer's settings: credentials,
    profile, region, certificate check, proxy, timeouts and HTTP backend (aiohttp under asyncio,
    httpx under trio, unless ``http_backend`` says otherwise). The SDK makes exactly one
    attempt per call (see the module's docstring): whoever calls it owns retrying. The Kinesis
    transport, the fleet coordinator's S3 client and the CloudWatch metrics sink all use it."""
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

        options["http_session_cls"] = HttpxSession
    client: AbstractAsyncContextManager[Any] = AioSession(profile=config.profile).create_client(
        service,
        region_name=region or config.region,
        endpoint_url=endpoint_url,
        aws_access_key_id=config.aws_access_key_id,
        aws_secret_access_key=config.aws_secret_access_key,
        aws_session_token=config.aws_session_token,
        # None hands the choice to botocore's chain (AWS_CA_BUNDLE, the profile's ca_bundle)
        verify=config.ca_bundle if config.verify_certificate else False,
        config=AioConfig(**options),
    )
    return client
