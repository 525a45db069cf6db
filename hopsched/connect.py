"""Connecting, and reconnecting after a loss, with errors that never show the password.

``Connector`` opens hopsched's own connections (``hopsched.amqp``) for the Scheduler
and the Relay: ``await connector.connect()`` for one attempt, ``async for connection
in connector`` for a connection after each loss, with back-off between failed
attempts. ``connect`` opens an aio-pika connection for everything off the
hot path (declaring the topology, the CLI's tools).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator

import aio_pika
import aiormq

from hopsched import amqp
from hopsched.errors import BrokerUnavailableError
from hopsched.settings import Settings

__all__ = [
    "CONNECT_TIMEOUT_S",
    "RECONNECT_FIRST_S",
    "RECONNECT_MAX_S",
    "Connector",
    "connect",
    "unreachable",
]

log = logging.getLogger("hopsched.connect")

#: How long the TCP connect and the AMQP handshake may take together, in seconds.
CONNECT_TIMEOUT_S = 10.0
# Capped at 5 s: messages due during a broker outage wait for the next attempt after the
# broker is back, so a 30 s cap made them up to 30 s late (F09); an attempt is one refused
# TCP connect, cheap for any number of relays.
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.5, 5.0


class Connector:
    """Opens connections to the broker at ``settings.url``.

    Args:
        settings: the URL (shown masked in every error and log line).
        name: the connection name the broker shows (``rabbitmqctl list_connections``).
    """

    def __init__(self, settings: Settings, *, name: str) -> None:
        self.settings = settings
        self.name = name
        self.attempts = 0  #: connections opened so far
        self._params = amqp.ConnectionParams.from_url(settings.url)

    async def connect(self) -> amqp.Connection:
        """One attempt.

        Raises:
            BrokerUnavailableError: unreachable, no AMQP answer within
                ``CONNECT_TIMEOUT_S``, login refused, no such vhost or no access to it;
                the message names the masked URL and the cause.
        """
        try:
            connection = await amqp.connect(
                self._params, name=self.name, timeout_s=CONNECT_TIMEOUT_S
            )
        except OSError as error:  # refused, unreachable, TLS handshake
            raise unreachable(self.settings, error) from None
        self.attempts += 1
        return connection

    async def __aiter__(self) -> AsyncIterator[amqp.Connection]:
        """A connection, and after the caller is done with it (it was lost), another.

        The first attempt's failure is raised (a wrong URL at start is an error to
        report, not to retry); later ones are logged and retried with back-off from
        ``RECONNECT_FIRST_S`` doubling to ``RECONNECT_MAX_S``.
        """
        yield await self.connect()
        delay, failures = RECONNECT_FIRST_S, 0
        while True:
            try:
                connection = await self.connect()
            except BrokerUnavailableError as error:
                failures += 1
                log.warning(
                    "reconnect attempt %d failed: %s; next in %.1f s", failures, error, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            if failures:
                log.info(
                    "reconnected to %s after %d failed attempt(s)",
                    self.settings.masked_url,
                    failures,
                )
            delay, failures = RECONNECT_FIRST_S, 0
            yield connection


async def connect(settings: Settings, *, name: str = "hopsched") -> aio_pika.abc.AbstractConnection:
    """Open a (non-robust) aio-pika connection to ``settings.url``.

    Raises:
        BrokerUnavailableError: as ``Connector.connect``.
    """
    url = settings.masked_url
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await aio_pika.connect(settings.url, client_properties={"connection_name": name})
    except TimeoutError:
        raise BrokerUnavailableError(
            f"{url}: no AMQP handshake within {CONNECT_TIMEOUT_S:g} s; is this RabbitMQ's "
            "AMQP port (5672, or 5671 for amqps)?"
        ) from None
    except aiormq.exceptions.ProbableAuthenticationError:
        raise BrokerUnavailableError(
            f"{url}: login refused; check the user name and password in the URL "
            "(percent-encode '/', '#', '?', '@' and ':' in them)"
        ) from None
    except aiormq.exceptions.AMQPConnectionError as error:
        if isinstance(error.__cause__, OSError):  # aiormq wraps socket errors
            raise unreachable(settings, error.__cause__) from None
        raise _refused(settings, error) from None
    except aiormq.exceptions.AMQPError:  # e.g. Connection.Close for a missing vhost
        raise _refused(settings, None) from None
    except OSError as error:
        raise unreachable(settings, error) from None


def unreachable(settings: Settings, error: BaseException) -> BrokerUnavailableError:
    """The error for a broker that cannot be reached (or whose TLS handshake failed)."""
    reason = _reason(error, settings)
    if isinstance(error, ssl.SSLError):
        return BrokerUnavailableError(
            f"{settings.masked_url}: TLS handshake failed ({reason}); {_TLS_HINT}"
        )
    hint = "is RabbitMQ running and listening there?"
    if settings.url.startswith("amqps:"):  # a broker refusing the handshake just resets
        hint = f"is RabbitMQ's TLS listener there? If so, {_TLS_HINT}"
    return BrokerUnavailableError(
        f"{settings.masked_url}: cannot reach the broker ({reason}); {hint}"
    )


_TLS_HINT = (
    "check the TLS options in the URL's query (aio-pika's): cafile=PATH for a CA this "
    "machine does not trust, certfile=PATH&keyfile=PATH if the broker requires a client "
    "certificate, no_verify_ssl=1 to skip verification (tests only)"
)


def _refused(settings: Settings, error: BaseException | None) -> BrokerUnavailableError:
    reason = f" ({_reason(error, settings)})" if error is not None else ""
    return BrokerUnavailableError(
        f"{settings.masked_url}: the broker closed the connection during the handshake"
        f"{reason}; check that the vhost in the URL exists and the "
        "user may use it (rabbitmqctl list_permissions -p VHOST), and that the port is "
        "RabbitMQ's AMQP port"
    )


def _reason(error: BaseException, settings: Settings) -> str:
    text = str(error) or type(error).__name__
    return text.replace(settings.url, settings.masked_url)
