"""Helpers for the tests of hopsched's own AMQP client (``hopsched.amqp``).

Used by ``broker/test_amqp.py``, ``faults/test_amqp.py`` and ``broker/test_amqp_flow.py``: opening a
connection from a URL, collecting publish outcomes and deliveries as they come (the
client runs on callbacks), declaring queues through ``Channel.call``, and reading
what the broker reports of its connections.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pamqp import commands

from hopsched import amqp
from hopsched.amqp import Delivery, Outcome, Properties
from support import Cleanup
from support import unique as marked


def unique(what: str = "q") -> str:
    return marked(f"amqp.{what}")


async def open_connection(url: str, *, name: str | None = None, timeout_s: float = 10.0) -> Any:
    """``hopsched.amqp.connect`` to ``url`` (the connection name defaults to a unique one)."""
    return await amqp.connect(
        amqp.ConnectionParams.from_url(url),
        name=name or f"test-amqp-{uuid.uuid4().hex[:8]}",
        timeout_s=timeout_s,
    )


def encoded(**properties: Any) -> bytes:
    """``Properties(**properties).encode()``, headers given as a dict."""
    headers = properties.pop("headers", None)
    if headers is not None:
        properties["headers"] = amqp.Table.from_dict(headers)
    return Properties(**properties).encode()


class Outcomes:
    """Records each publish's confirm callbacks by key; ``wait`` for a number of them."""

    def __init__(self) -> None:
        self.calls: dict[Any, list[tuple[Outcome, Any]]] = {}
        self._changed = asyncio.Event()

    def callback(self, key: Any) -> amqp.ConfirmCallback:
        self.calls.setdefault(key, [])

        def settled(outcome: Outcome, detail: Any) -> None:
            self.calls[key].append((outcome, detail))
            self._changed.set()

        return settled

    def settled(self) -> int:
        return sum(1 for calls in self.calls.values() if calls)

    def outcome(self, key: Any) -> Outcome:
        calls = self.calls[key]
        assert len(calls) == 1, f"publish {key!r}: {len(calls)} callbacks ({calls})"
        return calls[0][0]

    def detail(self, key: Any) -> Any:
        return self.calls[key][0][1]

    async def wait(self, count: int | None = None, within: float = 10.0) -> None:
        """Until ``count`` publishes (default: all) have had a callback."""
        wanted = len(self.calls) if count is None else count
        try:
            async with asyncio.timeout(within):
                while self.settled() < wanted:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pytest.fail(f"{self.settled()} of {wanted} publishes settled after {within} s")


class Deliveries:
    """A consumer's callbacks: deliveries and broker-side cancels, in order."""

    def __init__(self) -> None:
        self.received: list[Delivery] = []
        self.cancelled: list[str] = []
        self._changed = asyncio.Event()

    def on_delivery(self, delivery: Delivery) -> None:
        self.received.append(delivery)
        self._changed.set()

    def on_cancel(self, tag: str) -> None:
        self.cancelled.append(tag)
        self._changed.set()

    async def wait_for(self, count: int, within: float = 10.0) -> list[Delivery]:
        try:
            async with asyncio.timeout(within):
                while len(self.received) < count:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pytest.fail(f"{len(self.received)} of {count} deliveries after {within} s")
        return self.received

    async def wait_cancelled(self, within: float = 10.0) -> list[str]:
        try:
            async with asyncio.timeout(within):
                while not self.cancelled:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pytest.fail(f"no consumer cancel notification after {within} s")
        return self.cancelled


async def declare(
    channel: amqp.Channel,
    cleanup: Cleanup | None,
    name: str | None = None,
    *,
    arguments: dict[str, Any] | None = None,
) -> str:
    """Declare a durable queue with ``Channel.call`` (deleted after the test via ``cleanup``)."""
    name = name or unique()
    if cleanup is not None:
        cleanup.queues.add(name)
    reply = await channel.call(
        commands.Queue.Declare(queue=name, durable=True, arguments=arguments or {})
    )
    assert isinstance(reply, commands.Queue.DeclareOk), reply
    assert reply.queue == name
    return name


async def confirming(connection: amqp.Connection) -> amqp.Channel:
    channel = await connection.channel()
    await channel.confirm_select()
    return channel


async def connection_rows(
    rabbitmqctl: Callable[..., Awaitable[str]], *fields: str
) -> list[dict[str, Any]]:
    """``rabbitmqctl list_connections FIELDS`` as dicts (JSON formatter)."""
    out = await rabbitmqctl("list_connections", "-q", *fields, "--formatter", "json")
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def connection_name(row: dict[str, Any]) -> str | None:
    """The ``connection_name`` a client gave in its ``client_properties``, if any (a
    connection still in its handshake, another test's, lists them as ``'none'``)."""
    properties = row.get("client_properties")
    if not isinstance(properties, list):
        return None
    for key, _, value in properties:
        if key == "connection_name":
            return str(value)
    return None


async def connection_row(
    rabbitmqctl: Callable[..., Awaitable[str]], name: str, *fields: str, within: float = 30.0
) -> dict[str, Any]:
    """The broker's row for the connection named ``name`` (it may take a moment to show)."""
    async with asyncio.timeout(within):
        while True:
            rows = await connection_rows(rabbitmqctl, "client_properties", *fields)
            found = [row for row in rows if connection_name(row) == name]
            if found:
                assert len(found) == 1, found
                return found[0]
            await asyncio.sleep(0.2)
