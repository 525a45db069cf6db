"""Settings: one frozen dataclass passed in explicitly; only the CLI reads the environment."""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal, cast
from urllib.parse import parse_qsl, unquote, urlsplit

from hopsched.core.ladder import Ladder
from hopsched.core.signing import Signatures, SigningKey, parse_signing_keys
from hopsched.core.targets import TargetPolicy
from hopsched.errors import InvalidSettingsError
from hopsched.urls import mask_url, split_urls

__all__ = ["QueueType", "Settings"]

QueueType = Literal["quorum", "classic"]

#: RabbitMQ 4.x's default ``max_message_size``, bytes (https://www.rabbitmq.com/docs/configure).
MAX_MESSAGE_SIZE = 16 * 1024 * 1024
#: The largest ``max_message_size`` RabbitMQ accepts, bytes.
BROKER_MAX_MESSAGE_SIZE = 512 * 1024 * 1024
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$")
_ENV = "HOPSCHED_"
#: The URL query options hopsched's connections read (aio-pika's and aiormq's names):
#: each option and the rule its value must follow. Any other option is refused: an option
#: no connection reads (``frame_max``, a typo) would be silently ignored.
_OPTIONS = {
    "heartbeat": "whole seconds from 0 (no heartbeats) to 65534, e.g. heartbeat=30",
    "auth": "plain (the default: the URL's user and password) or external (the TLS "
    "client certificate; needs amqps:// and certfile)",
    "name": "a non-empty connection name",
    "cafile": "the path of a file of CA certificates (PEM)",
    "capath": "the path of a directory of CA certificates",
    "cadata": "CA certificates (DER), base64-encoded",
    "certfile": "the path of the client certificate (PEM)",
    "keyfile": "the path of the client certificate's key (PEM); needs certfile",
    "no_verify_ssl": "0 (verify the broker's certificate, the default) or 1 (do not: tests only)",
}
_TLS_OPTIONS = frozenset({"cafile", "capath", "cadata", "certfile", "keyfile", "no_verify_ssl"})
#: aiormq (which hopsched's declaring and CLI connections use) turns a heartbeat it does
#: not accept into 0, no heartbeats, silently (``aiormq.connection.parse_heartbeat``).
_MAX_HEARTBEAT_S = 65534


def _option_problem(key: str, value: str, options: Mapping[str, str], tls: bool) -> str | None:
    """What is wrong with URL query option ``key=value``, or None."""
    if key in _TLS_OPTIONS and not tls:
        return "is a TLS option, and the URL is amqp:// (no TLS): use amqps://"
    if key == "heartbeat":
        if not (value.isascii() and value.isdigit()) or int(value) > _MAX_HEARTBEAT_S:
            return "is not whole seconds from 0 to 65534"
    elif key == "auth":
        if value.lower() not in ("plain", "external"):
            return "is not plain or external"
        if value.lower() == "external" and not (tls and "certfile" in options):
            return "logs in with the TLS client certificate: use amqps:// and give certfile"
    elif key == "name":
        if not value.strip():
            return "is empty"
    elif key in ("cafile", "certfile", "keyfile"):
        if not os.path.isfile(value):
            return "names no file"
        if key == "keyfile" and "certfile" not in options:
            return "needs certfile (the certificate it is the key of)"
    elif key == "capath":
        if not os.path.isdir(value):
            return "names no directory"
    elif key == "cadata":
        try:
            base64.b64decode(value, validate=True)
        except ValueError:
            return "is not base64"
    elif key == "no_verify_ssl" and value not in ("0", "1"):
        return "is not 0 or 1 (aio-pika reads anything but 0 as 1)"
    return None


def _check_options(url: str) -> None:
    """Raise InvalidSettingsError for a query option of ``url`` that hopsched's
    connections do not read, given twice, or with a value they cannot use."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    options = dict(pairs)
    seen: set[str] = set()
    for key, value in pairs:
        where = f"url {mask_url(url)!r}: option {key}={value!r}"
        if key not in _OPTIONS:
            known = ", ".join(_OPTIONS)
            raise InvalidSettingsError(
                f"{where} is not one hopsched reads (it would be ignored); the options are {known}"
            )
        if key in seen:
            raise InvalidSettingsError(f"{where}: given twice; give it once")
        seen.add(key)
        problem = _option_problem(key, value, options, parts.scheme == "amqps")
        if problem is not None:
            raise InvalidSettingsError(f"{where} {problem}; {key} takes {_OPTIONS[key]}")


def _check_url(url: str) -> None:
    """Raise InvalidSettingsError unless ``url`` is an amqp(s) URL with a host and valid port."""
    masked = mask_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        try:  # the parser's words may quote the password: take them from the masked URL
            urlsplit(masked).port  # noqa: B018
        except ValueError as error:
            raise InvalidSettingsError(f"url {masked!r}: {error}") from None
        raise InvalidSettingsError(
            f"url {masked!r}: the password holds '/', '#', '?' or '@'; percent-encode it "
            "(e.g. '/' as %2F)"
        ) from None
    if parts.scheme not in ("amqp", "amqps"):
        raise InvalidSettingsError(f"url {mask_url(url)!r}: must start with amqp:// or amqps://")
    if not parts.hostname:
        raise InvalidSettingsError(
            f"url {mask_url(url)!r}: no host; write amqp://user:password@host:5672/vhost "
            "(percent-encode '/', '#', '?' and '@' in the password)"
        )
    if urlsplit(mask_url(url)).hostname != parts.hostname:
        raise InvalidSettingsError(
            f"url {mask_url(url)!r}: the password holds '/', '#', '?' or '@'; "
            "percent-encode it (e.g. '/' as %2F)"
        )
    _check_options(url)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a Scheduler or Relay needs.

    Attributes:
        url: AMQP URL (``amqp://`` or ``amqps://``; query options, aio-pika's names:
            ``heartbeat`` (s, 0-65534), ``auth`` (plain, external), ``name``, and for
            amqps ``cafile``, ``capath``, ``cadata``, ``certfile``, ``keyfile``,
            ``no_verify_ssl`` (0 or 1); any other, or a value out of range, is refused),
            or the URLs of several nodes of one
            cluster: a sequence, or one string with the URLs separated by commas (as in
            ``HOPSCHED_URL`` and ``--url``). Stored as that comma-separated string;
            ``urls`` gives the list. They must share the user and vhost (the relay checks
            ``user_id`` against the login). Each connection attempt of a process starts
            at a random URL (so processes spread over the nodes) and goes round the list
            on failure (``hopsched.connect.Connector``). Shown masked everywhere.
        prefix: namespace of every broker object, so several ladders share a vhost.
        min_step_ms, max_step_ms: the ladder's smallest and largest step TTL, powers of
            two in ms (of four with ``step_ratio`` 4).
        hold_window_ms: at or below this remaining time (ms) the relay waits in-process
            (a timer) instead of hopping (a publish, a dead-lettering and a delivery on the
            broker), and hops land at least half of it before the due time. 4000: a burst
            of 10,000 due at one instant arrives from 9 ms to 0.93 s late, against 0.73 to
            2.9 s with 1000 (``benchmarks/accuracy.py --scenario burst``). A relay holds
            at most nine tenths of its prefetch (``prefetch``) and ``hold_memory_mb``.
        hop_margin_ms: the least time (ms) kept in hand for one hop's overshoot; the
            relay widens it to 1.5 x the recent peak overshoot (``OvershootTracker``).
        queue_type: ``"quorum"`` (replicated, at-least-once dead-lettering; the default)
            or ``"classic"`` (the broker dead-letters at-most-once: a broker crash can lose
            messages, measured in tests/faults/test_crashes.py).
        prefetch: unacknowledged deliveries a relay takes at once (AMQP ``basic.qos``).
            Each message it holds until due takes one, so this bounds a burst it can
            hold: 20,000 holds a burst of 10,000 messages due at one instant and keeps a
            tenth free for deliveries due now.
        hold_memory_mb: the most message data (bodies and properties) a relay holds
            in memory, MiB; past it, or past nine tenths of ``prefetch``, it hops what a
            step fits instead of holding it.
        publish_timeout_s: how long ``schedule()`` waits for the broker's confirm, s;
            past it ``PublishTimeoutError`` (a broker blocking publishers under a memory
            or disk alarm, or frozen). The message may still be delivered.
        target_retry_s: how long the relay tries again a final publish its target
            refuses (``basic.nack``: a full queue with ``x-overflow=reject-publish``)
            before it parks the message, s; the waits double from 1 s to 32 s.
        log_interval_s: seconds between the relay's totals lines.
        allowed_targets: ``EXCHANGE/ROUTING-KEY`` glob patterns (see ``TargetPattern``);
            a message for any other target is refused by ``schedule()`` and parked by
            the relay, never published. Empty (the default): every target is allowed.
        metrics_port: TCP port of the relay's Prometheus endpoint (``/metrics`` over
            HTTP; see docs/operations.md, "Metrics"); 0 (the default): no endpoint.
        metrics_address: the address it listens on: ``127.0.0.1`` (the default, this
            machine only) or e.g. ``0.0.0.0`` / ``::`` for every interface.
        lookups: a relay answers look-ups (``Scheduler.get``, ``get_many``) from the
            journal it reads once and keeps, reading when asked what was written since:
            milliseconds however long the journal, instead of each look-up reading it all
            (``hopsched.journal.lookups``; False by default: it costs the relay the
            journal's memory, about 127 bytes per pending schedule, and CPU per look-up).
        lookup_timeout_s: how long ``get()`` waits for a relay's answer before it reads
            the journal itself, s (no relay answering look-ups answers at once).
        signing_keys: keys (``SigningKey``, or ``KEY-ID:SECRET`` text with the secret in
            base64) that sign envelopes and records: the first signs, every one verifies
            (several during a rotation). Empty (the default): nothing is signed or
            verified. Never shown: ``repr()`` and errors give key ids only. See
            docs/security.md.
        require_signatures: a relay parks unsigned envelopes and ignores unsigned records
            (False by default, so that a deployment can add keys to every process first);
            needs ``signing_keys``.
        trusted_users: RabbitMQ users whose unsigned cancels and reschedules reach every
            unsigned schedule (operators; relays of the prefix that log in as other
            users). Anyone else's reach the schedules of its own user only, and those
            whose user is unknown (docs/security.md, "Owner-only without keys"). Set the
            same on every relay and every process that looks schedules up.
        management_url: base URL(s) of RabbitMQ's management HTTP API, comma-separated
            (``http://rabbit:15672/``), which tells the relay, ``status`` and the
            Scheduler the policies in force (``hopsched.broker.policy_watch``); empty (the
            default): ``http://HOST:15672/`` for each node URL's host. The login is the
            AMQP URL's.
        max_message_size: the largest body ``schedule()`` sends, bytes; a larger one is
            refused with ``InvalidScheduleError`` before anything is sent. 16,777,216
            (16 MiB): RabbitMQ 4.x's default ``max_message_size``, which the broker
            enforces by closing the channel (https://www.rabbitmq.com/docs/configure);
            set it to your broker's (RabbitMQ 3.x: 128 MiB, at most 512 MiB).
        step_ratio: each step's TTL over the one below: 2 (the default, every power of
            two: 29 step queues from 16 ms to 2**32 ms, the most precise) or 4 (every
            power of four: 15 step queues over the same range, about half the broker's
            cost per prefix, for more hops per message; docs/operations.md, "Fewer
            steps"). Every Scheduler and relay of a prefix must use the same ladder
            (``TopologyMismatchError`` otherwise).

    Raises:
        InvalidSettingsError: a value is out of range; the message says which and why.
    """

    url: str | Sequence[str] = "amqp://guest:guest@localhost:5672/"
    prefix: str = "hopsched"
    min_step_ms: int = 16
    max_step_ms: int = 2**32
    hold_window_ms: int = 4000
    hop_margin_ms: int = 20
    queue_type: QueueType = "quorum"
    prefetch: int = 20_000
    hold_memory_mb: int = 256
    publish_timeout_s: float = 30.0
    target_retry_s: float = 300.0
    log_interval_s: float = 60.0
    allowed_targets: tuple[str, ...] = ()
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    lookups: bool = False
    lookup_timeout_s: float = 1.0
    signing_keys: tuple[SigningKey | str, ...] = ()
    require_signatures: bool = False
    trusted_users: tuple[str, ...] = ()
    management_url: str = ""
    max_message_size: int = MAX_MESSAGE_SIZE
    step_ratio: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _join_urls(self.url))
        urls = self.urls
        for url in urls:
            _check_url(url)
        first = urlsplit(urls[0])
        for url in urls[1:]:  # one cluster: one login (user_id checks) and one vhost
            parts = urlsplit(url)
            if (parts.username, parts.path or "/") != (first.username, first.path or "/"):
                raise InvalidSettingsError(
                    f"url {mask_url(url)!r}: every node URL must name the same user and "
                    f"vhost as the first, {mask_url(urls[0])!r}"
                )
        if not _PREFIX.match(self.prefix) or self.prefix.startswith("amq."):
            raise InvalidSettingsError(
                f"prefix {self.prefix!r}: use 1-100 letters, digits, '.', '_', ':' or '-', "
                "starting with a letter or digit and not with 'amq.' (reserved by RabbitMQ)"
            )
        if self.prefix.endswith(".") or ".." in self.prefix:
            raise InvalidSettingsError(
                f"prefix {self.prefix!r}: must not end with '.' or hold '..': hopsched adds "
                f"'.relay', '.step.N' ... to it ({self.prefix}.relay); did you mean "
                f"{re.sub(r'[.]+', '.', self.prefix).rstrip('.')!r}?"
            )
        if self.queue_type not in ("quorum", "classic"):
            raise InvalidSettingsError(
                f"queue_type {self.queue_type!r}: must be 'quorum' or 'classic'"
            )
        if not 1 <= self.prefetch <= 65535:
            raise InvalidSettingsError(
                f"prefetch {self.prefetch}: must be 1..65535 (AMQP basic.qos is 16 bits)"
            )
        for name in ("log_interval_s", "publish_timeout_s", "target_retry_s", "lookup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidSettingsError(f"{name} {value!r}: must be a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise InvalidSettingsError(f"{name} {value}: must be > 0 seconds")
        if not 1 <= self.hold_memory_mb <= 1_048_576:
            raise InvalidSettingsError(
                f"hold_memory_mb {self.hold_memory_mb}: must be 1..1048576 MiB"
            )
        if isinstance(self.metrics_port, bool) or not 0 <= self.metrics_port <= 65535:
            raise InvalidSettingsError(
                f"metrics_port {self.metrics_port!r}: must be 1..65535, or 0 for no endpoint"
            )
        if (
            isinstance(self.max_message_size, bool)
            or not isinstance(self.max_message_size, int)
            or not 1 <= self.max_message_size <= BROKER_MAX_MESSAGE_SIZE
        ):
            raise InvalidSettingsError(
                f"max_message_size {self.max_message_size!r}: must be 1..{BROKER_MAX_MESSAGE_SIZE}"
                " bytes (the broker's max_message_size; RabbitMQ caps it at 512 MiB)"
            )
        if not self.metrics_address.strip():
            raise InvalidSettingsError("metrics_address '': give an address, e.g. 127.0.0.1")
        for base in filter(None, (part.strip() for part in self.management_url.split(","))):
            if not base.startswith(("http://", "https://")):
                raise InvalidSettingsError(
                    f"management_url {mask_url(base)!r}: must start with http:// or https://"
                )
        self.ladder  # noqa: B018 - validates the ladder fields now, not at first use
        if isinstance(self.allowed_targets, str):  # one pattern is not its characters
            raise InvalidSettingsError(
                f"allowed_targets {self.allowed_targets!r}: give a tuple of patterns"
            )
        object.__setattr__(self, "allowed_targets", tuple(self.allowed_targets))
        self.target_policy  # noqa: B018 - validates the patterns
        object.__setattr__(self, "signing_keys", parse_signing_keys(self.signing_keys))
        object.__setattr__(
            self, "require_signatures", _flag("require_signatures", self.require_signatures)
        )
        object.__setattr__(self, "lookups", _flag("lookups", self.lookups))
        self.signatures  # noqa: B018 - a requirement without keys
        if isinstance(self.trusted_users, str):
            raise InvalidSettingsError(
                f"trusted_users {self.trusted_users!r}: give a tuple of RabbitMQ user names"
            )
        object.__setattr__(self, "trusted_users", tuple(self.trusted_users))

    def __repr__(self) -> str:
        values = ", ".join(
            f"{f.name}={self.masked_url if f.name == 'url' else _masked(getattr(self, f.name))!r}"
            for f in fields(self)
        )
        return f"Settings({values})"

    @property
    def ladder(self) -> Ladder:
        """The ladder these settings describe."""
        return Ladder(
            min_step_ms=self.min_step_ms,
            max_step_ms=self.max_step_ms,
            hold_window_ms=self.hold_window_ms,
            hop_margin_ms=self.hop_margin_ms,
            step_ratio=self.step_ratio,
        )

    @property
    def target_policy(self) -> TargetPolicy:
        """The allow list ``allowed_targets`` describes."""
        return TargetPolicy(self.allowed_targets, self.prefix)

    @property
    def signatures(self) -> Signatures:
        """The signing keys and requirement, for this prefix (``hopsched.core.signing``)."""
        keys = cast(tuple[SigningKey, ...], self.signing_keys)  # parsed in __post_init__
        return Signatures(keys, self.prefix, required=self.require_signatures)

    @property
    def urls(self) -> tuple[str, ...]:
        """The node URLs, in the order given (at least one)."""
        return tuple(split_urls(str(self.url)))

    @property
    def login(self) -> str:
        """The user name the URL logs in with (aio-pika's default: ``guest``)."""
        return unquote(urlsplit(self.urls[0]).username or "guest")

    @property
    def owner(self) -> str | None:
        """The RabbitMQ user whose schedules and records this process's are: the login,
        which the broker checks a ``user_id`` against
        (https://www.rabbitmq.com/docs/validated-user-id); None with ``auth=external``
        (the user is the client certificate's, which the URL does not name)."""
        options = dict(parse_qsl(urlsplit(self.urls[0]).query))
        return self.login if options.get("auth", "plain").upper() == "PLAIN" else None

    @property
    def vhost(self) -> str:
        """The virtual host the URL names, percent-decoded: ``/`` for a
        URL whose path is empty or ``/``, else the path after its first ``/``
        (``amqp://h/team%2Fa`` is vhost ``team/a``)."""
        path = urlsplit(self.urls[0]).path
        return unquote(path[1:]) if path not in ("", "/") else "/"

    @property
    def masked_url(self) -> str:
        """The URL (or URLs, comma-separated) with each password replaced by ``***``."""
        return mask_url(str(self.url))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Settings from ``HOPSCHED_<FIELD>`` variables (e.g. ``HOPSCHED_URL``,
        ``HOPSCHED_PREFIX``, ``HOPSCHED_QUEUE_TYPE``, ``HOPSCHED_PREFETCH``;
        ``HOPSCHED_ALLOWED_TARGETS``, ``HOPSCHED_SIGNING_KEYS`` and
        ``HOPSCHED_TRUSTED_USERS`` are comma-separated;
        ``HOPSCHED_REQUIRE_SIGNATURES`` is true or false), then ``overrides`` whose value
        is not None.

        Raises:
            InvalidSettingsError: a variable does not parse as its field's type, or a
                value is refused (the message starts with the variables it came from).
        """
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(_ENV + f.name.upper())
            if raw is None:
                continue
            kind = cast(type, type(f.default))
            if kind is tuple:
                values[f.name] = tuple(part.strip() for part in raw.split(",") if part.strip())
                continue
            try:
                values[f.name] = kind(raw) if kind in (int, float) else raw
            except ValueError:
                raise InvalidSettingsError(
                    f"{_ENV}{f.name.upper()}={raw!r}: expected {kind.__name__}"
                ) from None
        given = {k: v for k, v in overrides.items() if v is not None}
        from_environ = {name: _ENV + name.upper() for name in values if name not in given}
        values.update(given)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidSettingsError as error:
            culprits = _culprits(cls, values, from_environ, str(error))
            if not culprits:
                raise
            raise InvalidSettingsError(f"{', '.join(culprits)}: {error}") from None


def _culprits(
    cls: type[Settings], values: dict[str, object], from_environ: dict[str, str], refusal: str
) -> list[str]:
    """The variables among ``from_environ`` (field → variable) without which ``values``
    no longer give the error ``refusal``: those an error from ``from_env`` names."""
    culprits = []
    for name, variable in from_environ.items():
        others = {k: v for k, v in values.items() if k != name}
        try:
            cls(**others)  # type: ignore[arg-type]
        except InvalidSettingsError as error:
            if str(error) == refusal:
                continue
        culprits.append(variable)
    return culprits


def _masked(value: object) -> object:
    return mask_url(value) if isinstance(value, str) and "://" in value else value


def _flag(name: str, value: object) -> bool:
    """A bool field from a bool or its environment variable's text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise InvalidSettingsError(f"{name} {value!r}: use true or false (1 or 0)")


def _join_urls(url: object) -> str:
    """``Settings.url`` as one comma-separated string, from a string or a sequence."""
    if isinstance(url, str):
        parts = split_urls(url)
    elif isinstance(url, Sequence) and all(isinstance(part, str) for part in url):
        parts = [part.strip() for part in url]
        for part in parts:
            if len(split_urls(part)) > 1:
                raise InvalidSettingsError(
                    f"url {mask_url(part)!r}: give one URL per item of the sequence"
                )
    else:
        raise InvalidSettingsError(
            f"url: expected a string or a sequence of strings, not {type(url).__name__}"
        )
    if not parts:
        raise InvalidSettingsError("url: no URL given")
    return ",".join(parts)
