"""The tests reach one broker: ``HOPSCHED_TEST_URL`` over AMQP, and the same node through
``HOPSCHED_TEST_RABBITMQCTL`` (users, policies, listings) and its management API."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from urllib.parse import urlsplit

import aio_pika
from support import broker_version, management_url, rabbitmqctl, require_rabbitmqctl


async def test_rabbitmqctl_reaches_the_node_of_the_test_url(
    broker_url: str, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """Were ``HOPSCHED_TEST_RABBITMQCTL`` another node's (the machine's 3.10 while the
    tests run on 4.x, say), users and policies would be made where no test looks."""
    require_rabbitmqctl()
    status = json.loads(await rabbitmqctl("status", "--formatter", "json"))

    amqp_ports = {row["port"] for row in status["listeners"] if row["protocol"] == "amqp"}
    assert (urlsplit(broker_url).port or 5672) in amqp_ports, (broker_url, status["listeners"])
    version = tuple(int(part) for part in status["rabbitmq_version"].split("."))
    assert version == broker_version(amqp)


async def test_the_management_api_found_is_the_test_brokers(
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """The management API the tests find is the test broker's; none found means that
    broker runs no management plugin (the machine's 3.10 runs none; CI's 4.0 node does)."""
    require_rabbitmqctl()
    url = await management_url()
    running = "lists:keymember(rabbitmq_management, 1, application:which_applications())."
    if url is None:
        assert (await rabbitmqctl("eval", running)).strip() == "false"
        return
    parts = urlsplit(url)
    request = urllib.request.Request(f"http://{parts.hostname}:{parts.port}/api/overview")
    manager = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    manager.add_password(None, request.full_url, parts.username or "", parts.password or "")
    opener = urllib.request.build_opener(urllib.request.HTTPBasicAuthHandler(manager))

    overview = json.loads(await asyncio.to_thread(lambda: opener.open(request, timeout=10).read()))

    version = tuple(int(part) for part in overview["rabbitmq_version"].split("."))
    assert version == broker_version(amqp)
    assert overview["node"] in await rabbitmqctl("eval", "node().")
