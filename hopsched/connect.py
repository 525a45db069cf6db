"""Connecting with errors that say what went wrong and never show the password."""

from __future__ import annotations

import asyncio
import ssl

import aio_pika
import aiormq

from hopsched.errors import BrokerUnavailableError
from hopsched.settings import Settings

__all__ = ["CONNECT_TIMEOUT_S", "connect"]

#: How long the TCP connect and the AMQP handshake may take together, in seconds.
CONNECT_TIMEOUT_S = 10.0


async def connect(settings: Settings, *, name: str = "hopsched") -> aio_pika.abc.AbstractConnection:
    """Open a (non-robust) aio-pika connection to ``settings.url``.

    Raises:
        BrokerUnavailableError: unreachable, no AMQP answer within ``CONNECT_TIMEOUT_S``,
            login refused, no such vhost or no access to it; the message names the
            masked URL and the cause.
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
            raise _unreachable(settings, error.__cause__) from None
        raise _refused(settings, error) from None
    except aiormq.exceptions.AMQPError:  # e.g. Connection.Close for a missing vhost
        raise _refused(settings, None) from None
    except OSError as error:
        raise _unreachable(settings, error) from None


def _unreachable(settings: Settings, error: BaseException) -> BrokerUnavailableError:
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
