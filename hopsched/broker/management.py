"""A small client of RabbitMQ's management HTTP API (``rabbitmq_management``).

hopsched uses the API for what AMQP cannot tell: which node each relay consumes through
(``hopsched.broker.nodes``) and which policies the broker applies to the prefix's queues
(``hopsched.broker.policy_watch``). It logs in with the user and password of the settings'
first AMQP URL; reading needs the user tag ``management`` (or ``monitoring``),
setting a policy the tag ``policymaker``
(https://www.rabbitmq.com/docs/management#permissions).

The base URLs are ``Settings.management_url`` (comma-separated) if given, else
``http://HOST:15672/`` for each node URL's host. Every node of a cluster answers for
the whole cluster, so the first base URL that answers serves. A base URL derived from
an AMQP host may reach another broker on that host (another port, another node): the
client checks once that the broker answering lists the AMQP URL's port among its AMQP
listeners, and otherwise treats it as unavailable.

Calls run ``urllib`` in a thread (``asyncio.to_thread``); each waits at most
``TIMEOUT_S`` per base URL.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shlex
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from hopsched.errors import ManagementAPIError
from hopsched.settings import Settings
from hopsched.urls import mask_url

__all__ = [
    "MANAGEMENT_PORT",
    "TIMEOUT_S",
    "ManagementClient",
    "api_get",
    "api_request",
    "management_urls",
    "why",
]

#: The management plugin's default HTTP port.
MANAGEMENT_PORT = 15672
#: Seconds one request to one base URL may take.
TIMEOUT_S = 5.0


def management_urls(settings: Settings, given: str | None = None) -> list[str]:
    """The management API base URLs to try: ``given`` (comma-separated) if set, else
    ``settings.management_url``, else ``http://HOST:15672/`` for each host of
    ``settings.urls``, in that order."""
    chosen = given or settings.management_url
    if chosen:
        return [part.strip() for part in chosen.split(",") if part.strip()]
    return _derived_urls(settings)


def _derived_urls(settings: Settings) -> list[str]:
    hosts = dict.fromkeys(urlsplit(url).hostname or "localhost" for url in settings.urls)
    return [f"http://{_host(host)}:{MANAGEMENT_PORT}/" for host in hosts]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def api_request(
    settings: Settings, base: str, path: str, method: str = "GET", body: Any = None
) -> Any:
    """``method`` ``{base}api/{path}`` (``body`` as JSON), logged in with the user and
    password ``base`` carries (``http://USER:PASSWORD@HOST:15672/``), else those of
    ``settings``' first URL; the decoded JSON answer, None for none (blocking: run it in
    a thread). A ``base`` that ends in ``/api/`` is taken as the API's own URL.

    Raises:
        OSError: the API cannot be reached or answers an error (``urllib.error.HTTPError``).
        ValueError: the answer is not JSON.
    """
    parts = urlsplit(settings.urls[0])
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    given = urlsplit(base)
    if given.username is not None:  # a login of its own: urllib would take it for the host
        user, password = unquote(given.username), unquote(given.password or "")
        given = given._replace(netloc=given.netloc.rpartition("@")[2])
    root = given.geturl().rstrip("/").removesuffix("/api")  # the API's own URL given
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{root}/api/{path}", data=data, method=method)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def api_get(settings: Settings, base: str, path: str) -> Any:
    """``api_request`` of a GET."""
    return api_request(settings, base, path)


def why(error: BaseException, user: str | None = None) -> str:
    """What went wrong asking the management API, in a few words; a refusal names the
    tags the (AMQP URL's) ``user`` needs."""
    if isinstance(error, urllib.error.HTTPError):
        problem = f"HTTP {error.code} {error.reason}"
        if error.code in (401, 403):
            who = "the URL's user" if user is None else f"user {user!r}"
            name = "USER" if user is None else shlex.quote(user)
            problem += (
                f" ({who} needs the tag management to read, policymaker to set policies: "
                f"rabbitmqctl set_user_tags {name} management policymaker; it replaces "
                "the user's tags)"
            )
        return problem
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) or type(error).__name__


class ManagementClient:
    """GET, PUT and DELETE on the management API of the broker ``settings`` names.

    Args:
        settings: the AMQP URLs (login, vhost, hosts) and ``management_url``.
        urls: base URLs to use instead of ``management_urls(settings)``.

    Attributes:
        source: the base URL (password masked) that answered last, None before.
    """

    def __init__(self, settings: Settings, urls: Sequence[str] | None = None) -> None:
        self.settings = settings
        self._urls = list(urls) if urls is not None else management_urls(settings)
        self._derived = self._urls == _derived_urls(settings)
        self._amqp_ports = {urlsplit(url).port or _default_port(url) for url in settings.urls}
        self._checked: set[str] = set()  # base URLs confirmed to serve this broker
        self._version: str | None = None
        self.source: str | None = None

    @property
    def vhost(self) -> str:
        """The settings' vhost, quoted for a path (``/`` is ``%2F``)."""
        return quote(self.settings.vhost, safe="")

    async def get(self, path: str) -> Any:
        """``GET /api/{path}``: the decoded JSON.

        Raises:
            ManagementAPIError: no base URL answered with 2xx; ``status`` is the last
                HTTP status (None if none answered), the message names each URL tried.
        """
        return await self._call("GET", path)

    async def broker_version(self) -> str:
        """The broker's RabbitMQ version, e.g. ``"3.10.8"`` (asked once).

        Raises:
            ManagementAPIError: as ``get``.
        """
        if self._version is None:
            overview = await self.get("overview?columns=rabbitmq_version")
            self._version = str(overview.get("rabbitmq_version", ""))
        return self._version

    async def put(self, path: str, body: Any) -> None:
        """``PUT /api/{path}`` with ``body`` as JSON.

        Raises:
            ManagementAPIError: as ``get`` (401 or 403: the user lacks the tag).
        """
        await self._call("PUT", path, body)

    async def delete(self, path: str) -> bool:
        """``DELETE /api/{path}``; False if there was nothing to delete (404).

        Raises:
            ManagementAPIError: as ``get``, for any answer but 2xx and 404.
        """
        try:
            await self._call("DELETE", path)
        except ManagementAPIError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        problems: list[str] = []
        status: int | None = None
        for base in self._urls:
            try:
                if self._derived and base not in self._checked:
                    await asyncio.to_thread(self._check_listener, base)
                    self._checked.add(base)
                found = await asyncio.to_thread(
                    api_request, self.settings, base, path, method, body
                )
            except _OtherBroker as other:
                problems.append(f"{mask_url(base)}: {other}")
                continue
            except urllib.error.HTTPError as error:
                status = error.code
                login = unquote(urlsplit(base).username or "") or self.settings.login
                problems.append(f"{mask_url(base)}: {why(error, login)}")
                if error.code in (401, 403, 404):
                    break  # every node of the cluster would say the same
                continue
            except (OSError, ValueError) as error:  # URLError is an OSError
                problems.append(f"{mask_url(base)}: {why(error)}")
                continue
            self.source = mask_url(base)
            return found
        raise ManagementAPIError(f"{method} /api/{path}: " + "; ".join(problems), status)

    def _check_listener(self, base: str) -> None:
        """Raise ``_OtherBroker`` unless the broker at ``base`` has an AMQP listener on
        one of the settings' ports (a derived URL may reach another broker)."""
        overview = api_get(self.settings, base, "overview?columns=listeners")
        listeners = overview.get("listeners") if isinstance(overview, dict) else None
        ports = {
            int(entry["port"])
            for entry in listeners or []
            if isinstance(entry, dict)
            and str(entry.get("protocol", "")).startswith("amqp")
            and str(entry.get("port", "")).isdigit()
        }
        if ports and not ports & self._amqp_ports:
            raise _OtherBroker(
                f"serves another broker (AMQP on port {', '.join(map(str, sorted(ports)))}, "
                f"not {', '.join(map(str, sorted(self._amqp_ports)))}); set "
                "HOPSCHED_MANAGEMENT_URL (Settings.management_url) to this broker's"
            )


class _OtherBroker(Exception):
    """The management API at a derived URL belongs to another broker."""


def _default_port(url: str) -> int:
    return 5671 if url.startswith("amqps:") else 5672
