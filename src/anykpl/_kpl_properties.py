"""Reading the KPL's ``.properties`` files for :meth:`ProducerConfig.from_kpl_properties`.

The mapping from every KPL property name to our field, the properties accepted but ignored (they
configure the KPL's Java wrapper or native daemon, or name a Java object), and a
``java.util.Properties`` reader.

The KPL's property names are not a list in its source: ``KinesisProducerConfiguration.
fromProperties`` takes each key ``Key`` whose class has a method ``setKey``, and converts the
value to the setter's parameter type (``long`` through ``Long.valueOf``, ``int``, ``boolean``,
``String``). A setter that takes anything else (``setCredentialsProvider``, the Glue Schema
Registry's) still counts as found: the KPL accepts the key and does nothing with it, without the
warning it gives unknown keys. Our names are those setters. We differ in one place: numbers
outside Java's ``long`` range make ``Long.valueOf`` throw, and we raise a ``ConfigError`` naming
the property and the field; we check the length of the digits before converting, so a
5,000-digit value costs nothing and never meets Python's limit on converting long integers.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import quote, urlsplit, urlunsplit

from .errors import ConfigError

__all__ = ("KPL_PROPERTY_NAMES", "read_kpl_properties")

#: The KPL's KinesisEndpoint pattern: a host name or an IP address, nothing else.
_ENDPOINT_HOST_PATTERN: Final = re.compile(r"[A-Za-z0-9.-]+")

#: Java's Long.valueOf syntax.
_JAVA_LONG_PATTERN: Final = re.compile(r"[+-]?[0-9]+")
#: Java's Long range, which Long.valueOf enforces.
_JAVA_LONG_MIN: Final = -(2**63)
_JAVA_LONG_MAX: Final = 2**63 - 1
#: Digits of _JAVA_LONG_MAX: a longer number (leading zeros aside) is out of range.
_JAVA_LONG_DIGITS: Final = 19
#: Property values longer than this are shortened in error messages and warnings.
_MAX_SHOWN_LENGTH: Final = 60

# --- KPL .properties files ------------------------------------------------------------------

#: KPL properties that set a field: property -> (field, how the value is read).
#: "ms" values are Java longs in milliseconds, converted to seconds; a "path" left empty (the
#: KPL default) keeps the field's default.
_MAPPED_PROPERTIES: Final[Mapping[str, tuple[str, str]]] = {
    "AggregationEnabled": ("aggregation_enabled", "bool"),
    "AggregationMaxCount": ("aggregation_max_count", "int"),
    "AggregationMaxSize": ("aggregation_max_size", "int"),
    "CollectionMaxCount": ("collection_max_count", "int"),
    "CollectionMaxSize": ("collection_max_size", "int"),
    "ConnectTimeout": ("connect_timeout", "ms"),
    "RequestTimeout": ("request_timeout", "ms"),
    "FailIfThrottled": ("fail_if_throttled", "bool"),
    "MaxConnections": ("max_connections", "int"),
    "MinConnections": ("min_connections", "int"),
    "MetricsGranularity": ("metrics_granularity", "str"),
    "MetricsLevel": ("metrics_level", "str"),
    "MetricsNamespace": ("metrics_namespace", "str"),
    "MetricsUploadDelay": ("metrics_upload_delay", "ms"),
    "RateLimit": ("rate_limit", "percent"),
    "RecordMaxBufferedTime": ("record_max_buffered_time", "ms"),
    "RecordTtl": ("record_ttl", "ms"),
    "Region": ("region", "str"),
    "VerifyCertificate": ("verify_certificate", "bool"),
    "CaCertFile": ("ca_bundle", "path"),
    "MaxUserRecordSize": ("max_user_record_size", "int"),
}

#: The two properties that together make endpoint_url.
_ENDPOINT_PROPERTIES: Final = ("KinesisEndpoint", "KinesisPort")
#: ProxyHost, ProxyPort, ProxyUserName and ProxyPassword become ``proxy_url``: the KPL's proxy
#: is an HTTP proxy (the AWS SDK's default proxy scheme), reached at ProxyPort (default 443)
_PROXY_PROPERTIES: Final = ("ProxyHost", "ProxyPort", "ProxyUserName", "ProxyPassword")

_NO_DAEMON: Final = "anykpl runs in your process; there is no native daemon"

#: KPL properties accepted without effect: property -> (kind, KPL default, why it is ignored).
#: Defaults from KinesisProducerConfiguration.java.
_IGNORED_PROPERTIES: Final[Mapping[str, tuple[str, str, str]]] = {
    "CloudwatchEndpoint": (
        "str",
        "",
        "metrics go to CloudWatch only through Producer(metrics_sinks=[CloudWatchSink("
        "endpoint_url=...)]), whose endpoint defaults to botocore's configuration",
    ),
    "CloudwatchPort": (
        "int",
        "443",
        "metrics go to CloudWatch only through Producer(metrics_sinks=[CloudWatchSink("
        "endpoint_url=...)]), whose endpoint defaults to botocore's configuration",
    ),
    "ThreadingModel": (
        "str",
        "PER_REQUEST",
        "anykpl uses no threads; requests run as tasks on the event loop, "
        "bounded by max_connections",
    ),
    "ThreadPoolSize": (
        "int",
        "0",
        "anykpl uses no threads; requests run as tasks on the event loop, "
        "bounded by max_connections",
    ),
    "LogLevel": (
        "str",
        "info",
        "anykpl logs through the standard logging module; set the level of the 'anykpl' logger",
    ),
    "CredentialsRefreshDelay": (
        "int",
        "5000",
        "botocore refreshes expiring credentials itself, and there is no daemon to push them to",
    ),
    "EnableCoreDumps": ("bool", "false", _NO_DAEMON),
    "NativeExecutable": ("str", "", _NO_DAEMON),
    "TempDirectory": ("str", "", _NO_DAEMON + " to extract"),
    # The KPL hands CaCertPath to libcurl as a directory of hashed certificates (CURLOPT_CAPATH);
    # aiobotocore loads one file only.
    "CaCertPath": (
        "str",
        "",
        "a directory of CA certificates is not supported; concatenate them into one PEM file "
        "and set CaCertFile (ca_bundle)",
    ),
    "StsEndpoint": (
        "str",
        "",
        "credentials come from botocore (the KPL itself stopped using STS in 1.0.5)",
    ),
    "StsPort": (
        "int",
        "443",
        "credentials come from botocore (the KPL itself stopped using STS in 1.0.5)",
    ),
    "UserRecordTimeoutInMillis": (
        "int",
        "0",
        "it is a Java-wrapper timeout; use record_ttl, or a cancel scope around put_record",
    ),
    "EnableOldestFutureTracker": (
        "bool",
        "true",
        "it is Java-wrapper bookkeeping for getOldestRecordTimeInMillis; "
        "Producer.oldest_record_age is always kept",
    ),
    "ReturnUserRecordOnFailure": (
        "bool",
        "false",
        "it is a Java-wrapper option; the caller awaiting a record still holds its data",
    ),
    "EnableDaemonHealthCheck": ("bool", "false", _NO_DAEMON + " to check"),
    "DaemonHealthCheckTimeoutMs": ("int", "30000", _NO_DAEMON + " to check"),
    "GlueSchemaRegistryPropertiesFilePath": (
        "str",
        "",
        "configure anykpl.schema_registry.GlueSchemaRegistry in code (registry name, "
        "auto-registration, compression) and encode each record with it before put_record",
    ),
    # The KPL's setters for these take Java objects, so its fromProperties accepts the names
    # and ignores their values too.
    "GlueSchemaRegistryConfiguration": (
        "str",
        "",
        "its KPL setter takes a Java object, so the KPL ignores it in a properties file too; "
        "anykpl.schema_registry.GlueSchemaRegistry takes its settings in code",
    ),
    "GlueSchemaRegistryCredentialsProvider": (
        "str",
        "",
        "its KPL setter takes a Java object, so the KPL ignores it in a properties file too; "
        "anykpl.schema_registry.GlueSchemaRegistry uses the producer's credentials",
    ),
    "CredentialsProvider": (
        "str",
        "",
        "its KPL setter takes a Java object, so the KPL ignores it in a properties file too; "
        "credentials come from botocore's chain, or from the aws_access_key_id, "
        "aws_secret_access_key and profile fields",
    ),
    "MetricsCredentialsProvider": (
        "str",
        "",
        "its KPL setter takes a Java object, so the KPL ignores it in a properties file too; "
        "a CloudWatchSink uses the producer's credentials, or its own profile or keys",
    ),
}

KPL_PROPERTY_NAMES: Final[Mapping[str, str | None]] = MappingProxyType(
    {
        **{key: name for key, (name, _) in _MAPPED_PROPERTIES.items()},
        **dict.fromkeys(_ENDPOINT_PROPERTIES, "endpoint_url"),
        **dict.fromkeys(_PROXY_PROPERTIES, "proxy_url"),
        **dict.fromkeys(_IGNORED_PROPERTIES),
    }
)
"""Every KPL property name ``from_kpl_properties`` accepts, mapped to the field it sets, or to
``None`` for properties accepted and ignored."""


def _read_properties(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("iso-8859-1")
    return _parse_properties(text)


def _parse_properties(text: str) -> dict[str, str]:
    """Parse ``java.util.Properties`` text into a dict; a repeated key keeps its last value."""
    properties: dict[str, str] = {}
    for line in _logical_lines(text):
        key, value = _split_key_value(line)
        properties[key] = value
    return properties


def _logical_lines(text: str) -> list[str]:
    """Join continued lines; drop blank and comment lines (which are never continued)."""
    logical: list[str] = []
    pending: str | None = None
    for natural in re.split(r"\r\n|\r|\n", text):
        line = natural.lstrip(" \t\f")
        if pending is None and (not line or line[0] in "#!"):
            continue
        trailing_backslashes = len(line) - len(line.rstrip("\\"))
        if trailing_backslashes % 2 == 1:
            pending = (pending or "") + line[:-1]
            continue
        logical.append((pending or "") + line)
        pending = None
    if pending is not None:
        logical.append(pending)
    return logical


def _split_key_value(line: str) -> tuple[str, str]:
    index = 0
    while index < len(line) and line[index] not in "=: \t\f":
        index += 2 if line[index] == "\\" else 1
    index = min(index, len(line))
    key = line[:index]
    while index < len(line) and line[index] in " \t\f":
        index += 1
    if index < len(line) and line[index] in "=:":
        index += 1
    while index < len(line) and line[index] in " \t\f":
        index += 1
    return _unescape(key), _unescape(line[index:])


_ESCAPES: Final = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char != "\\" or index + 1 == len(text):
            out.append(char)
            index += 1
            continue
        escaped = text[index + 1]
        hex_digits = text[index + 2 : index + 6]
        if escaped == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", hex_digits):
            out.append(chr(int(hex_digits, 16)))
            index += 6
        else:
            out.append(_ESCAPES.get(escaped, escaped))
            index += 2
    return "".join(out)


def _clean_value(raw: str) -> str:
    # Java keeps trailing whitespace, and the KPL sample ends one value with a stray ';'
    # ("MaxUserRecordSize = 1048576;"), which Long.valueOf would reject. We forgive both.
    return raw.strip().removesuffix(";").rstrip()


def _parse_java_long(text: str) -> int | None:
    """Java's Long.valueOf: the number, or None where Long.valueOf throws (not an integer, or
    outside Java's long range)."""
    if not _JAVA_LONG_PATTERN.fullmatch(text):
        return None
    # Count the digits before converting: int() refuses more than 4,300 (leading zeros
    # included), and a long never has more than 19.
    digits = text.lstrip("+-").lstrip("0") or "0"
    if len(digits) > _JAVA_LONG_DIGITS:
        return None
    number = -int(digits) if text.startswith("-") else int(digits)
    return number if _JAVA_LONG_MIN <= number <= _JAVA_LONG_MAX else None


class _Shortened:
    """Stands for a long property value in a message: its start and its length."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        if len(self._text) <= _MAX_SHOWN_LENGTH:
            return repr(self._text)
        return f"{self._text[:30]!r}... ({len(self._text)} characters)"


def _property_error(name: str, text: str, allowed: str) -> ConfigError:
    """A ConfigError whose message shortens a long value; ``value`` keeps it whole."""
    error = ConfigError(name, _Shortened(text), allowed)
    error.value = text
    return error


def _source(key: str, raw: str) -> str:
    """``"KPL property Key='value'"`` for messages, with a long value shortened."""
    return f"KPL property {key}={_Shortened(raw)!r}"


def _convert_property(key: str, name: str, kind: str, text: str) -> object:
    if kind == "str":
        return text
    if kind == "path":
        return text or None
    source = _source(key, text)
    if kind == "bool":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise _property_error(name, text, f"true or false (from {source})")
    number = _parse_java_long(text)
    if number is None:
        unit = " number of milliseconds" if kind == "ms" else ""
        if _JAVA_LONG_PATTERN.fullmatch(text):
            allowed = (
                f"an integer{unit} in {_JAVA_LONG_MIN}..{_JAVA_LONG_MAX}, Java's long range "
                f"(from {source})"
            )
        else:
            allowed = f"an integer{unit} (from {source})"
        raise _property_error(name, text, allowed)
    if kind == "ms":
        return number / 1000
    if kind == "percent":
        return float(number)
    return number


def _is_kpl_default(kind: str, default: str, text: str) -> bool:
    if kind == "bool":
        return text.lower() == default
    if kind == "int":
        return _parse_java_long(text) == int(default)
    return text == default


def _port_property(properties: Mapping[str, str], key: str, field: str) -> int | None:
    """The port property ``key`` (for the field ``field``), ``None`` when it is not set."""
    if key not in properties:
        return None
    raw = properties[key]
    port = _parse_java_long(_clean_value(raw))
    if port is None or not 1 <= port <= 65535:
        raise _property_error(
            field, _clean_value(raw), f"a port in 1..65535 (from {_source(key, raw)})"
        )
    return port


def _endpoint_from_properties(properties: Mapping[str, str]) -> str | None:
    """KinesisEndpoint + KinesisPort -> endpoint_url; None when KinesisEndpoint is unset."""
    port = _port_property(properties, "KinesisPort", "endpoint_url")
    host = _clean_value(properties.get("KinesisEndpoint", ""))
    if not host:
        if port is not None and port != 443:
            warnings.warn(
                "KPL property KinesisPort is accepted and ignored: it has no effect without "
                "KinesisEndpoint",
                UserWarning,
                stacklevel=4,
            )
        return None
    source = f"(from {_source('KinesisEndpoint', properties['KinesisEndpoint'])})"
    if "://" not in host:
        # The KPL's form: a bare host name or IP address, always reached over TLS.
        if not _ENDPOINT_HOST_PATTERN.fullmatch(host):
            raise _property_error(
                "endpoint_url", host, f"a host name, or an http:// or https:// URL {source}"
            )
        return f"https://{host}:{443 if port is None else port}"
    # Our extension: a URL with a scheme is used as given, plus KinesisPort if it has no port.
    try:
        parts = urlsplit(host)
        url_port = parts.port
    except ValueError:
        raise _property_error(
            "endpoint_url", host, f"a host name, or an http:// or https:// URL {source}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _property_error(
            "endpoint_url", host, f"a host name, or an http:// or https:// URL {source}"
        )
    if url_port is None:
        if port is None:
            return host
        return urlunsplit(parts._replace(netloc=f"{parts.netloc}:{port}"))
    # KinesisPort = 443 is the sample file's default line; only a different, explicit port
    # contradicts the URL.
    if port is not None and port not in (443, url_port):
        raise _property_error(
            "endpoint_url",
            host,
            f"a URL whose port agrees with {_source('KinesisPort', properties['KinesisPort'])} "
            f"{source}",
        )
    return host


def _proxy_from_properties(properties: Mapping[str, str]) -> str | None:
    """ProxyHost + ProxyPort + ProxyUserName + ProxyPassword -> proxy_url
    (``http://[user[:password]@]host:port``); None when ProxyHost is unset."""
    given_port = _port_property(properties, "ProxyPort", "proxy_url")
    port = 443 if given_port is None else given_port
    host = _clean_value(properties.get("ProxyHost", ""))
    # as Java's Properties gives them: a trailing space or ';' may be part of a password
    user = properties.get("ProxyUserName", "")
    password = properties.get("ProxyPassword", "")
    if not host:
        given = [key for key in ("ProxyUserName", "ProxyPassword") if properties.get(key, "")]
        if port != 443:
            given.insert(0, "ProxyPort")
        for key in given:
            warnings.warn(
                f"KPL property {key} is accepted and ignored: it has no effect without ProxyHost",
                UserWarning,
                stacklevel=4,
            )
        return None
    if not _ENDPOINT_HOST_PATTERN.fullmatch(host):
        raise _property_error(
            "proxy_url", host, f"a host name (from {_source('ProxyHost', properties['ProxyHost'])})"
        )
    credentials = ""
    if user:
        credentials = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
        credentials += "@"
    elif password:
        warnings.warn(
            "KPL property ProxyPassword is accepted and ignored: it has no effect without "
            "ProxyUserName",
            UserWarning,
            stacklevel=4,
        )
    return f"http://{credentials}{host}:{port}"


def read_kpl_properties(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a KPL ``.properties`` file into ``ProducerConfig`` field values.

    Returns ``(values, sources)``: the field values, and for each field the words that name
    where it came from, such as ``"KPL property RecordTtl='50', in milliseconds"`` (so that a
    ``ConfigError`` can name the property). Warns about ignored and unknown properties.
    """
    properties = _read_properties(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, raw in properties.items():
        text = _clean_value(raw)
        if key in _MAPPED_PROPERTIES:
            name, kind = _MAPPED_PROPERTIES[key]
            values[name] = _convert_property(key, name, kind, text)
            unit = ", in milliseconds" if kind == "ms" else ""
            sources[name] = _source(key, raw) + unit
        elif key in _IGNORED_PROPERTIES:
            kind, default, reason = _IGNORED_PROPERTIES[key]
            if not _is_kpl_default(kind, default, text):
                warnings.warn(
                    f"KPL property {key} (set to {_Shortened(text)!r}) is accepted and ignored: "
                    f"{reason}",
                    UserWarning,
                    stacklevel=3,
                )
        elif key not in _ENDPOINT_PROPERTIES and key not in _PROXY_PROPERTIES:
            warnings.warn(f"unknown KPL property {key!r} ignored", UserWarning, stacklevel=3)

    endpoint_url = _endpoint_from_properties(properties)
    if endpoint_url is not None:
        values["endpoint_url"] = endpoint_url
        sources["endpoint_url"] = _source("KinesisEndpoint", properties["KinesisEndpoint"])
    proxy_url = _proxy_from_properties(properties)
    if proxy_url is not None:
        values["proxy_url"] = proxy_url
        sources["proxy_url"] = _source("ProxyHost", properties["ProxyHost"])

    return values, sources
