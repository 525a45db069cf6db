"""Which node each relay is on: ``hopsched status``'s per-node view of ``{prefix}.relay``.

AMQP tells only how many consumers a queue has, cluster-wide (``queue.declare-ok``); the
node each consumer's connection is on, and the quorum queue's leader and members, come
from RabbitMQ's management HTTP API (``GET /api/queues/VHOST/NAME``), available where
the management plugin is enabled (``rabbitmq-plugins enable rabbitmq_management``).
The API is asked at ``http://HOST:15672/`` for each node URL's host unless management
URLs are given; the first that answers serves, as every node reports the whole cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hopsched.broker.management import MANAGEMENT_PORT, ManagementClient, management_urls
from hopsched.errors import ManagementAPIError
from hopsched.settings import Settings

__all__ = [
    "MANAGEMENT_PORT",
    "NodeView",
    "RelayNodes",
    "management_urls",
    "relay_nodes",
    "unacknowledged",
]


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


async def relay_nodes(settings: Settings, queue: str, urls: list[str]) -> RelayNodes:
    """Ask the management API at each of ``urls`` in turn about quorum queue ``queue``.

    Logs in with the user and password of ``settings``' first URL. Never raises for an
    API that cannot be reached or refuses: ``RelayNodes.unavailable`` says why.
    """
    client = ManagementClient(settings, urls)
    try:
        found = await client.get(f"queues/{client.vhost}/{quote(queue, safe='')}")
    except ManagementAPIError as error:
        return RelayNodes(
            unavailable=(
                "per-node consumers need RabbitMQ's management plugin "
                f"(rabbitmq-plugins enable rabbitmq_management; or --management-url): {error}"
            )
        )
    return RelayNodes(nodes=_views(found), source=client.source)


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
    client = ManagementClient(settings, urls)
    try:
        found = {
            name: await client.get(f"queues/{client.vhost}/{quote(name, safe='')}")
            for name in consumers
        }
    except ManagementAPIError as error:
        return f"the management API answers nowhere: {error}"
    counts = {}
    for name, queue in found.items():
        count = queue.get("messages_unacknowledged")
        if not isinstance(count, int) or queue.get("consumers") != consumers[name]:
            return (
                f"the management API at {client.source} has no figures for {name} since "
                "its consumers came (RabbitMQ refreshes them every 5 s by default)"
            )
        counts[name] = count
    return counts


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
