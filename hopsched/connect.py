"""Connecting with errors that say what went wrong and never show the password."""

from __future__ import annotations

from urllib.parse import urlsplit

import aio_pika
import aiormq

from hopsched.errors import BrokerUnavailableError
from hopsched.settings import Settings

__all__ = ["connect"]


async def connect(settings: Settings, *, name: str = "hopsched") -> aio_pika.abc.AbstractConnection:
    """Open a (non-robust) aio-pika connection to ``settings.url``.

    Raises:
        BrokerUnavailableError: refused, unreachable, bad credentials or vhost; the
            message names the masked URL and the cause.
    """
    try:
        return await aio_pika.connect(settings.url, client_properties={"connection_name": name})
    except aiormq.exceptions.ProbableAuthenticationError:  # before its parent below
        raise BrokerUnavailableError(
            f"{settings.masked_url}: login refused; check the user name and password in the URL"
        ) from None
    except aiormq.exceptions.AMQPConnectionError as error:
        if isinstance(error.__cause__, OSError):  # aiormq wraps socket errors
            raise _unreachable(settings, error.__cause__) from None
        raise BrokerUnavailableError(
            f"{settings.masked_url}: the broker refused the connection "
            f"({_reason(error, settings)}); "
            "check the vhost and the user's permissions"
        ) from None
    except (OSError, TimeoutError) as error:
        raise _unreachable(settings, error) from None


def _unreachable(settings: Settings, error: BaseException) -> BrokerUnavailableError:
    return BrokerUnavailableError(
        f"{settings.masked_url}: cannot reach the broker ({_reason(error, settings)}); "
        "is RabbitMQ running and listening there?"
    )


def _reason(error: BaseException, settings: Settings) -> str:
    text = str(error) or type(error).__name__
    password = urlsplit(settings.url).password
    return (
        text.replace(settings.url, settings.masked_url).replace(password, "***")
        if password
        else text
    )
