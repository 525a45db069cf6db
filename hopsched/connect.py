"""Connecting, and reconnecting after a loss, with errors that never show the password.

``Connector`` opens hopsched's own connections (``hopsched.amqp``) for the Scheduler
and the Relay: ``await connector.connect()`` for one attempt, ``async for connection
in connector`` for a connection after each loss, with back-off between failed
attempts. ``connect`` opens an aio-pika connection for everything off the
hot path (declaring the topology, the CLI's tools).

With several node URLs (``Settings.urls``, one cluster) an attempt tries each node
once, in this order: a Connector starts at a random index, so that many relays and
schedulers started with the same list spread over the nodes without coordinating;
on a refused or lost connection it goes on round-robin from the *next* URL, as the
node just lost is the one most likely down. Back-off sleeps only after a whole round
failed, so one node down costs one refused TCP connect, not a back-off.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable

import aio_pika
import aiormq

from hopsched import amqp
from hopsched.errors import BrokerUnavailableError
from hopsched.settings import Settings
from hopsched.urls import mask_url

__all__ = [
    "CONNECT_TIMEOUT_S",
    "RECONNECT_FIRST_S",
    "RECONNECT_MAX_S",
    "Connector",
    "RetryLog",
    "connect",
    "node_of",
    "unreachable",
]

log = logging.getLogger("hopsched.connect")

#: How long the TCP connect and the AMQP handshake may take together, in seconds.
CONNECT_TIMEOUT_S = 10.0
# Capped at 5 s: messages due during a broker outage wait for the next attempt after the
# broker is back, so a 30 s cap made them up to 30 s late (F09); an attempt is one refused
# TCP connect, cheap for any number of relays.
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.5, 5.0


class RetryLog:
    """When to log a failure retried with back-off (a broker away): each of the first
    ``first`` in a row, then once per ``interval_s``; ``reset()`` once it works again.
    A relay that logged each attempt wrote two lines every 5 s (its reconnects and its
    look-ups', 720 an hour each) for as long as its broker was away.

    ``say()`` at each failure: whether to log this one, and the text to add to it.
    """

    def __init__(
        self,
        interval_s: float,
        *,
        first: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.first = first
        self.clock = clock
        self.failures = 0
        self._said_at = -float("inf")

    def say(self) -> tuple[bool, str]:
        self.failures += 1
        now = self.clock()
        if self.failures < self.first:
            return True, ""
        if self.failures == self.first:
            self._said_at = now
            return True, f" (from now on said once every {self.interval_s:g} s)"
        if now - self._said_at >= self.interval_s:
            self._said_at = now
            return True, ""
        return False, ""

    def reset(self) -> None:
        self.failures = 0
        self._said_at = -float("inf")


class Connector:
    """Opens connections to the broker at ``settings.urls`` (see the module's docstring
    for the order).

    Args:
        settings: the URLs (shown masked in every error and log line).
        name: the connection name the broker shows (``rabbitmqctl list_connections``).
        start: the index of the first URL to try; default random.
    """

    def __init__(self, settings: Settings, *, name: str, start: int | None = None) -> None:
        self.settings = settings
        self.name = name
        self.attempts = 0  #: connections opened so far
        self._params = [amqp.ConnectionParams.from_url(url) for url in settings.urls]
        count = len(self._params)
        self._next = random.randrange(count) if start is None else start % count
        #: ``host:port`` of the node of the last connection opened, None before.
        self.node: str | None = None
        self.url: str | None = None  # the URL of ``node``: others connect there first
        #: that node's URL, password masked.
        self.masked_url: str | None = None

    async def connect(self) -> amqp.Connection:
        """One attempt: each node URL once, from the next in turn, until one connects.

        Raises:
            BrokerUnavailableError: no node is reachable, answers AMQP within
                ``CONNECT_TIMEOUT_S``, and accepts the login and vhost; the message
                names each masked URL and its cause.
        """
        failures: list[BrokerUnavailableError] = []
        for _ in self._params:
            params = self._params[self._next]
            self._next = (self._next + 1) % len(self._params)  # the next attempt moves on
            try:
                connection = await amqp.connect(params, name=self.name, timeout_s=CONNECT_TIMEOUT_S)
            except BrokerUnavailableError as error:  # (a ConnectionError: before OSError)
                failures.append(error)  # login or vhost refused, no handshake: said already
            except OSError as error:  # refused, unreachable, TLS handshake
                failures.append(unreachable(self.settings, error, params.url))
            else:
                self.attempts += 1
                self.node, self.url = node_of(params.url), params.url
                self.masked_url = params.masked_url
                if failures:
                    log.info("connected to %s; before it: %s", self.node, _joined(failures))
                return connection
        raise _joined(failures)

    async def __aiter__(self) -> AsyncIterator[amqp.Connection]:
        """A connection, and after the caller is done with it (it was lost), another.

        The first attempt's failure is raised (a wrong URL at start is an error to
        report, not to retry); later ones are logged and retried with back-off from
        ``RECONNECT_FIRST_S`` doubling to ``RECONNECT_MAX_S``.
        """
        yield await self.connect()
        delay, retries = RECONNECT_FIRST_S, RetryLog(self.settings.log_interval_s)
        while True:
            try:
                connection = await self.connect()
            except BrokerUnavailableError as error:
                said, more = retries.say()
                if said:
                    log.warning(
                        "reconnect attempt %d failed: %s; next in %.1f s%s",
                        retries.failures,
                        error,
                        delay,
                        more,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            if retries.failures:
                log.info("reconnected to %s after %d failed round(s)", self.node, retries.failures)
            delay = RECONNECT_FIRST_S
            retries.reset()
            yield connection


def node_of(url: str) -> str:
    """``host:port`` of a node URL (no user, no password): how logs and ``node`` name it."""
    params = amqp.ConnectionParams.from_url(url)
    return f"{params.host}:{params.port}"


async def connect(
    settings: Settings, *, name: str = "hopsched", first: str | None = None
) -> aio_pika.abc.AbstractConnection:
    """Open a (non-robust) aio-pika connection to the first of ``settings.urls`` that
    answers, in the order given; ``first`` (one of them: the node a process is on
    already) is tried before the others, so that a node cut off costs no time-out.

    Raises:
        BrokerUnavailableError: no node answers; names each masked URL and its cause.
    """
    failures: list[BrokerUnavailableError] = []
    urls = list(settings.urls)
    if first in urls:
        urls.remove(first)
        urls.insert(0, first)
    for url in urls:
        try:
            return await _connect_one(settings, url, name)
        except BrokerUnavailableError as error:
            failures.append(error)
    raise _joined(failures)


def _joined(failures: list[BrokerUnavailableError]) -> BrokerUnavailableError:
    """One node's error as it is; several nodes' in one, each with its URL."""
    if len(failures) == 1:
        return failures[0]
    return BrokerUnavailableError("no node answers: " + "; ".join(map(str, failures)))


async def _connect_one(
    settings: Settings, node_url: str, name: str
) -> aio_pika.abc.AbstractConnection:
    url = mask_url(node_url)
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await aio_pika.connect(node_url, client_properties={"connection_name": name})
    except TimeoutError:
        raise BrokerUnavailableError(amqp.silent_peer(url, CONNECT_TIMEOUT_S)) from None
    except aiormq.exceptions.ProbableAuthenticationError:
        raise BrokerUnavailableError(
            f"{url}: login refused; check the user name and password in the URL "
            "(percent-encode '/', '#', '?', '@' and ':' in them)"
        ) from None
    except aiormq.exceptions.AMQPConnectionError as error:
        if isinstance(error.__cause__, OSError):  # aiormq wraps socket errors
            raise unreachable(settings, error.__cause__, node_url) from None
        if isinstance(error.__cause__, asyncio.IncompleteReadError):  # before connection.start
            raise BrokerUnavailableError(_not_amqp(url, error.__cause__.partial)) from None
        raise _refused(settings, error, node_url) from None
    except aiormq.exceptions.AMQPError as error:  # e.g. Connection.Close for a missing vhost
        raise _refused(settings, error, node_url) from None
    except OSError as error:
        raise unreachable(settings, error, node_url) from None


def unreachable(
    settings: Settings, error: BaseException, url: str | None = None
) -> BrokerUnavailableError:
    """The error for a broker that cannot be reached (or whose TLS handshake failed) at
    ``url``, one of ``settings.urls`` (default the first)."""
    url = settings.urls[0] if url is None else url
    masked = mask_url(url)
    reason = _reason(error, settings)
    if isinstance(error, ssl.SSLError) and error.reason in _NOT_TLS_REASONS:
        return BrokerUnavailableError(
            f"{masked}: the peer does not speak TLS ({reason}): most often this is the "
            "broker's plain AMQP port (5672). Use amqp:// for it, or the port of its TLS "
            "listener (5671 by default) with amqps://"
        )
    if isinstance(error, ssl.SSLError):
        return BrokerUnavailableError(f"{masked}: TLS handshake failed ({reason}); {_TLS_HINT}")
    hint = "is RabbitMQ running and listening there?"
    if url.startswith("amqps:"):  # a broker refusing the handshake just resets
        hint = f"is RabbitMQ's TLS listener there? If so, {_TLS_HINT}"
    return BrokerUnavailableError(f"{masked}: cannot reach the broker ({reason}); {hint}")


#: OpenSSL's reasons for a first answer that is no TLS record (RabbitMQ's plain port
#: answers a TLS hello with its AMQP protocol header: "AMQP", then 0, 0, 9, 1).
_NOT_TLS_REASONS = frozenset(
    {"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"}
)

_TLS_HINT = (
    "check the TLS options in the URL's query (aio-pika's): cafile=PATH for a CA this "
    "machine does not trust, certfile=PATH&keyfile=PATH if the broker requires a client "
    "certificate, no_verify_ssl=1 to skip verification (tests only)"
)


def _refused(settings: Settings, error: BaseException | None, url: str) -> BrokerUnavailableError:
    reason = _reason(error, settings) if error is not None else ""
    # aiormq keeps no reply code: a Connection.Close instead of Connection.OpenOk is the
    # broker refusing the vhost (missing, or the user has no permission there)
    if "OpenOk" in reason and "Connection.Close" in reason:
        return BrokerUnavailableError(
            f"{mask_url(url)}: the broker refused the vhost {settings.vhost!r} (it closed the "
            "connection in answer to connection.open); check that it exists and the user "
            "may use it (rabbitmqctl list_permissions -p VHOST)"
        )
    return BrokerUnavailableError(
        f"{mask_url(url)}: the broker closed the connection during the handshake"
        f"{f' ({reason})' if reason else ''}; check that the vhost in the URL exists and "
        "the user may use it (rabbitmqctl list_permissions -p VHOST), and that the port "
        "is RabbitMQ's AMQP port"
    )


def _not_amqp(masked_url: str, received: bytes) -> str:
    """The error text for a peer that closed the connection before a whole AMQP frame
    came (``received``: what it sent): nothing at all, or something that is not AMQP."""
    if not received:
        return (
            f"{masked_url}: the peer closed the connection before the AMQP handshake; is "
            "this RabbitMQ's AMQP port (5672, or 5671 for amqps)?"
        )
    return (
        f"{masked_url}: the peer answered with something that is not AMQP and closed the "
        "connection; check that this is RabbitMQ's AMQP port (5672, or 5671 for amqps; "
        "15672 is the management API's)"
    )


def _reason(error: BaseException, settings: Settings) -> str:
    text = str(error) or type(error).__name__
    for url in settings.urls:  # a library's words may quote the URL, password and all
        text = text.replace(url, mask_url(url))
    return text
