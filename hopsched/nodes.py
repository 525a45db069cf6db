"""Which node each relay is on: ``hopsched status``'s per-node view of ``{prefix}.relay``.

AMQP tells only how many consumers a queue has, cluster-wide (``queue.declare-ok``); the
node each consumer's connection is on, and the quorum queue's leader and members, come
from RabbitMQ's management HTTP API (``GET /api/queues/VHOST/NAME``), available where
the management plugin is enabled (``rabbitmq-plugins enable rabbitmq_management``).
The API is asked at ``http://HOST:15672/`` for each node URL's host unless management
URLs are given; the first that answers serves, as every node reports the whole cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from hopsched.settings import Settings, mask_url

__all__ = [
    "MANAGEMENT_PORT",
    "NodeView",
    "RelayNodes",
    "api_get",
    "management_urls",
    "relay_nodes",
    "unacknowledged",
    "why",
]

#: The management plugin's default HTTP port.
MANAGEMENT_PORT = 15672
_TIMEOUT_S = 5.0


@dataclass
class NodeView:
    """One node as ``{prefix}.relay`` sees it.

    Attributes:
        role: ``leader``, ``member`` (a follower) or ``""`` (holds no replica).
        online: whether the queue's replica on it runs.
        consumers: the connection name (and client address) of each relay consuming
            through a connection to this node.
    """

    role: str = ""
    online: bool = False
    consumers: list[str] = field(default_factory=list)


@dataclass
class RelayNodes:
    """The per-node view, or why there is none.

    Attributes:
        nodes: by RabbitMQ node name (``rabbit@host``); empty when ``unavailable``.
        unavailable: why the management API could not tell (every URL tried), or None.
        source: the management URL that answered.
    """

    nodes: dict[str, NodeView] = field(default_factory=dict)
    unavailable: str | None = None
    source: str | None = None


def management_urls(settings: Settings, given: str | None = None) -> list[str]:
    """The management API base URLs to try: ``given`` (comma-separated) if set, else
    ``http://HOST:15672/`` for each host of ``settings.urls``, in that order."""
    if given:
        return [part.strip() for part in given.split(",") if part.strip()]
    hosts = dict.fromkeys(urlsplit(url).hostname or "localhost" for url in settings.urls)
    return [f"http://{_host(host)}:{MANAGEMENT_PORT}/" for host in hosts]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def relay_nodes(settings: Settings, queue: str, urls: list[str]) -> RelayNodes:
    """Ask the management API at each of ``urls`` in turn about quorum queue ``queue``.

    Logs in with the user and password of ``settings``' first URL. Never raises for an
    API that cannot be reached or refuses: ``RelayNodes.unavailable`` says why.
    """
    problems = []
    for url in urls:
        try:
            found = await asyncio.to_thread(_get_queue, settings, url, queue)
        except (OSError, ValueError) as error:  # URLError and HTTPError are OSErrors
            problems.append(f"{mask_url(url)}: {why(error)}")
            continue
        return RelayNodes(nodes=_views(found), source=mask_url(url))
    return RelayNodes(
        unavailable=(
            "per-node consumers need RabbitMQ's management plugin "
            "(rabbitmq-plugins enable rabbitmq_management; or --management-url): "
            + "; ".join(problems)
        )
    )


async def unacknowledged(
    settings: Settings, consumers: Mapping[str, int], urls: list[str]
) -> dict[str, int] | str:
    """The deliveries consumers hold unacknowledged on each queue of ``consumers``
    (``messages_unacknowledged``), from the first management API of ``urls`` that
    answers, or why none could tell. RabbitMQ refreshes these figures every
    ``collect_statistics_interval`` (5 s by default,
    https://www.rabbitmq.com/docs/management#statistics-interval): figures that do not
    show ``consumers`` (each queue's consumer count, as AMQP reports it now) predate
    them and count as unknown. Never raises for an API that cannot be reached or
    refuses."""
    problems = []
    for url in urls:
        try:
            found = {
                name: await asyncio.to_thread(_get_queue, settings, url, name) for name in consumers
            }
        except (OSError, ValueError) as error:
            problems.append(f"{mask_url(url)}: {why(error)}")
            continue
        counts = {}
        for name, queue in found.items():
            count = queue.get("messages_unacknowledged")
            if not isinstance(count, int) or queue.get("consumers") != consumers[name]:
                return (
                    f"the management API at {mask_url(url)} has no figures for {name} since "
                    "its consumers came (RabbitMQ refreshes them every 5 s by default)"
                )
            counts[name] = count
        return counts
    return "the management API answers nowhere: " + "; ".join(problems)


def _get_queue(settings: Settings, base: str, queue: str) -> dict[str, Any]:
    found: dict[str, Any] = api_get(
        settings, base, f"queues/{quote(settings.vhost, safe='')}/{quote(queue)}"
    )
    return found


def api_get(settings: Settings, base: str, path: str) -> Any:
    """The JSON at ``{base}api/{path}``, logged in with the user and password of
    ``settings``' first URL (blocking: run it in a thread).

    Raises:
        OSError: the API cannot be reached or answers an error (``urllib.error.HTTPError``).
        ValueError: the answer is not JSON.
    """
    parts = urlsplit(settings.urls[0])
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    request = urllib.request.Request(f"{base.rstrip('/')}/api/{path}")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        return json.load(response)


def why(error: BaseException) -> str:
    """What went wrong asking the management API, in a few words."""
    if isinstance(error, urllib.error.HTTPError):
        hint = ""
        if error.code in (401, 403):
            hint = (
                " (the URL's user needs a management tag: rabbitmqctl set_user_tags USER "
                "management)"
            )
        return f"HTTP {error.code} {error.reason}{hint}"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) or type(error).__name__


def _views(found: dict[str, Any]) -> dict[str, NodeView]:
    nodes: dict[str, NodeView] = {}
    members = found.get("members") or []
    online = set(found.get("online") or [])
    for name in members:
        nodes[name] = NodeView(role="member", online=name in online)
    leader = found.get("leader")
    if isinstance(leader, str):
        nodes.setdefault(leader, NodeView(online=leader in online)).role = "leader"
    for consumer in found.get("consumer_details") or []:
        channel = consumer.get("channel_details") or {}
        node = channel.get("node", "?")
        who = channel.get("connection_name") or channel.get("name") or "?"
        peer = channel.get("peer_host")
        label = f"{who} ({peer}:{channel.get('peer_port')})" if peer else who
        nodes.setdefault(node, NodeView()).consumers.append(label)
    return nodes
