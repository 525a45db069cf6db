"""A TCP proxy between a client and the test broker: what a network does to a connection
(cut it, withhold what the broker sends), done to real connections, nothing mocked."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

from support import BROKER_URL


class BrokerProxy:
    """Listens on a free port and passes each client's connection on to the broker.

    ``async with BrokerProxy() as url``: ``url`` is the broker's URL, through the proxy.
    ``cut()`` drops every connection made so far, as a broker that stops drops them
    (the client reads end-of-file); new ones are passed on as before.
    """

    def __init__(self, broker_url: str = BROKER_URL) -> None:
        parts = urlsplit(broker_url)
        self.broker_url = broker_url
        self.broker = (parts.hostname or "127.0.0.1", parts.port or 5672)
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        parts = urlsplit(self.broker_url)
        netloc = parts.netloc.rpartition("@")[0] + f"@127.0.0.1:{port}"
        return urlunsplit(parts._replace(netloc=netloc))

    async def __aexit__(self, *_: object) -> None:
        self.server.close()
        await self.cut()
        await self.server.wait_closed()

    async def cut(self) -> None:
        """Drop every connection made so far, both its sides."""
        for writer in self.writers:
            writer.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self.tasks.clear()
        self.writers.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        broker_reader, broker_writer = await asyncio.open_connection(*self.broker)
        self.writers += [writer, broker_writer]
        for pump in (self.up(reader, broker_writer), self.down(broker_reader, writer)):
            task = asyncio.create_task(pump)
            self.tasks.add(task)

    async def up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Client to broker."""
        with contextlib.closing(writer):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Broker to client."""
        with contextlib.closing(writer):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
