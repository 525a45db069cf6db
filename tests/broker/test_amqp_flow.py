"""``hopsched.amqp`` against a scripted AMQP peer: what RabbitMQ itself no longer does.

RabbitMQ stopped sending ``channel.flow`` in 3.x: it throttles publishers with TCP
back-pressure and ``connection.blocked`` instead
(https://www.rabbitmq.com/docs/flow-control), so no real broker can make the client
handle it. The peer here is a small asyncio server that speaks just enough AMQP
0-9-1 (its frames marshalled by pamqp, the codec aio-pika uses) and records every
frame the client sends; it also tunes values the shared broker does not (a small
frame_max, two channels). Everything that a real broker can exercise is tested
against one in ``broker/test_amqp.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pamqp import body, commands, frame, header, heartbeat
from support.amqp import Outcomes, encoded, open_connection

from hopsched.amqp import Outcome
from hopsched.errors import BrokerUnavailableError

Received = Any  # a pamqp frame: method, content header, body or heartbeat


class ScriptedPeer:
    """One AMQP "broker" connection at a time: the handshake, channel.open-ok and
    confirm.select-ok by itself; everything else the test sends with ``send``.

    Args:
        frame_max, channel_max: what its ``connection.tune`` proposes.
    """

    def __init__(self, *, frame_max: int = 131_072, channel_max: int = 2047) -> None:
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.received: list[tuple[int, Received]] = []
        self._arrived = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None
        self._serving: asyncio.Task[Any] | None = None
        self.answer_open = True  #: reply channel.open-ok by itself
        self.port = 0

    async def __aenter__(self) -> ScriptedPeer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._writer is not None:
            self._writer.close()  # the handler then reads EOF and returns
        if self._serving is not None:
            await asyncio.wait_for(asyncio.shield(self._serving), 5)
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def send(self, channel: int, *frames: Any) -> None:
        assert self._writer is not None
        for value in frames:
            self._writer.write(frame.marshal(value, channel))

    def methods(self, kind: type[Any] | None = None) -> list[tuple[int, Received]]:
        return [
            (channel, value)
            for channel, value in self.received
            if not isinstance(value, heartbeat.Heartbeat)
            and (kind is None or isinstance(value, kind))
        ]

    async def wait_for(self, kind: type[Any], count: int = 1, within: float = 5.0) -> None:
        try:
            async with asyncio.timeout(within):
                while len(self.methods(kind)) < count:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            pytest.fail(f"peer: {len(self.methods(kind))} of {count} {kind.__name__} frames")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._serving = asyncio.current_task()
        assert await reader.readexactly(8) == b"AMQP\x00\x00\x09\x01"
        self.send(
            0,
            commands.Connection.Start(
                server_properties={"product": "scripted-peer", "capabilities": {}},
                mechanisms="PLAIN",
                locales="en_US",
            ),
        )
        buffer = b""
        while True:
            data = await reader.read(65536)
            if not data:
                return
            buffer += data
            while len(buffer) >= 8:
                size = int.from_bytes(buffer[3:7], "big") + 8
                if len(buffer) < size:
                    break
                _, channel, value = frame.unmarshal(buffer[:size])
                buffer = buffer[size:]
                self.received.append((channel, value))
                self._answer(channel, value)
                self._arrived.set()

    def _answer(self, channel: int, value: Any) -> None:
        if isinstance(value, commands.Connection.StartOk):
            self.send(
                0,
                commands.Connection.Tune(
                    channel_max=self.channel_max, frame_max=self.frame_max, heartbeat=0
                ),
            )
        elif isinstance(value, commands.Connection.Open):
            self.send(0, commands.Connection.OpenOk())
        elif isinstance(value, commands.Channel.Open) and self.answer_open:
            self.send(channel, commands.Channel.OpenOk())
        elif isinstance(value, commands.Confirm.Select):
            self.send(channel, commands.Confirm.SelectOk())
        elif isinstance(value, commands.Connection.Close):
            self.send(0, commands.Connection.CloseOk())


@pytest.fixture
async def peer() -> AsyncIterator[ScriptedPeer]:
    async with ScriptedPeer() as scripted:
        yield scripted


def bodies(peer: ScriptedPeer) -> list[bytes]:
    return [value.value for _, value in peer.received if isinstance(value, body.ContentBody)]


async def test_channel_flow_holds_publishes_until_active_again(peer: ScriptedPeer) -> None:
    """``channel.flow(active=False)``: the client answers flow-ok(active=False) and sends
    no publish until ``channel.flow(active=True)``, which it answers too; then the held
    publishes leave in the order they were made, and confirms for them settle each
    once. A scripted peer: RabbitMQ no longer sends channel.flow (module doc)."""
    connection = await open_connection(peer.url)
    try:
        channel = await connection.channel()
        await channel.confirm_select()
        outcomes = Outcomes()
        channel.publish("", "q", b"before", encoded(), callback=outcomes.callback(0))
        await peer.wait_for(body.ContentBody, 1)

        peer.send(channel.number, commands.Channel.Flow(active=False))
        await peer.wait_for(commands.Channel.FlowOk, 1)
        assert peer.methods(commands.Channel.FlowOk)[0][1].active is False
        for index in range(1, 4):
            channel.publish(
                "", "q", b"held %d" % index, encoded(), callback=outcomes.callback(index)
            )
        await asyncio.sleep(0.3)
        assert bodies(peer) == [b"before"]
        assert len(peer.methods(commands.Basic.Publish)) == 1
        assert channel.unconfirmed == 4

        peer.send(channel.number, commands.Channel.Flow(active=True))
        await peer.wait_for(body.ContentBody, 4)
        flow_oks = peer.methods(commands.Channel.FlowOk)
        assert [value.active for _, value in flow_oks] == [False, True]
        assert bodies(peer) == [b"before", b"held 1", b"held 2", b"held 3"]
        sent = [value for _, value in peer.received]
        resumed = sent.index(flow_oks[1][1])
        first_held = sent.index(peer.methods(commands.Basic.Publish)[1][1])
        assert resumed < first_held, "a held publish left before flow-ok(active=True)"

        peer.send(channel.number, commands.Basic.Ack(delivery_tag=1))
        peer.send(channel.number, commands.Basic.Ack(delivery_tag=4, multiple=True))
        await outcomes.wait()
        assert [outcomes.outcome(index) for index in range(4)] == [Outcome.ACK] * 4
    finally:
        await connection.close(timeout_s=1)


async def test_publishes_held_by_flow_are_closed_with_the_channel(peer: ScriptedPeer) -> None:
    """Publishes held by ``channel.flow(active=False)`` when the peer closes the channel:
    each gets CLOSED with the ChannelClosedError once, and none is ever sent."""
    connection = await open_connection(peer.url)
    try:
        channel = await connection.channel()
        await channel.confirm_select()
        peer.send(channel.number, commands.Channel.Flow(active=False))
        await peer.wait_for(commands.Channel.FlowOk, 1)
        outcomes = Outcomes()
        for index in range(3):
            channel.publish("", "q", b"held", encoded(), callback=outcomes.callback(index))
        peer.send(
            channel.number,
            commands.Channel.Close(
                reply_code=406, reply_text="PRECONDITION_FAILED - test", class_id=0, method_id=0
            ),
        )
        error = await asyncio.wait_for(channel.closed, 5)
        await outcomes.wait()
        assert [outcomes.outcome(index) for index in range(3)] == [Outcome.CLOSED] * 3
        assert all(outcomes.detail(index) is error for index in range(3))
        await peer.wait_for(commands.Channel.CloseOk, 1)
        assert peer.methods(commands.Basic.Publish) == []
        assert connection.is_open
    finally:
        await connection.close(timeout_s=1)


async def test_a_small_tuned_frame_max_splits_bodies_and_bounds_headers() -> None:
    """A peer tuning frame_max 4096: the client agrees to it in tune-ok, sends a 10,000
    byte body in frames of at most 4096 bytes (4088 of payload), and refuses with
    ValueError, before sending, properties that do not fit one 4096-byte frame."""
    async with ScriptedPeer(frame_max=4096) as peer:
        connection = await open_connection(peer.url)
        try:
            ((_, tune_ok),) = peer.methods(commands.Connection.TuneOk)
            assert tune_ok.frame_max == connection.frame_max == 4096
            channel = await connection.channel()
            payload = bytes(range(256)) * 40  # 10,240 bytes
            channel.publish("", "q", payload, encoded())
            await peer.wait_for(body.ContentBody, 3)
            assert [len(chunk) for chunk in bodies(peer)] == [4088, 4088, 2064]
            assert b"".join(bodies(peer)) == payload
            ((_, content),) = [
                (channel_, value)
                for channel_, value in peer.received
                if isinstance(value, header.ContentHeader)
            ]
            assert content.body_size == len(payload)
            with pytest.raises(ValueError, match="frame_max"):
                channel.publish("", "q", b"x", encoded(headers={"pad": "p" * 4096}))
            await asyncio.sleep(0.2)
            assert len(peer.methods(commands.Basic.Publish)) == 1
        finally:
            await connection.close(timeout_s=1)


async def test_channel_max_from_tune_bounds_the_channels() -> None:
    """A peer tuning channel_max 2: the client opens channels 1 and 2 and refuses a
    third with BrokerUnavailableError, sending nothing for it."""
    async with ScriptedPeer(channel_max=2) as peer:
        connection = await open_connection(peer.url)
        try:
            assert connection.channel_max == 2
            first, second = await connection.channel(), await connection.channel()
            assert (first.number, second.number) == (1, 2)
            with pytest.raises(BrokerUnavailableError, match="all 2 channels"):
                await connection.channel()
            assert len(peer.methods(commands.Channel.Open)) == 2
        finally:
            await connection.close(timeout_s=1)


async def test_acks_and_nacks_in_any_order_settle_each_publish_once(peer: ScriptedPeer) -> None:
    """Confirms as a broker may send them: a single ack out of order, a multiple ack
    over it, a multiple nack, a repeated ack: each publish is settled exactly once
    with the outcome of the first confirm that covers it. (A real broker's order
    cannot be chosen, hence the scripted peer.)"""
    connection = await open_connection(peer.url)
    try:
        channel = await connection.channel()
        await channel.confirm_select()
        outcomes = Outcomes()
        for index in range(1, 9):
            channel.publish("", "q", b"%d" % index, encoded(), callback=outcomes.callback(index))
        await peer.wait_for(commands.Basic.Publish, 8)
        for tag, multiple, kind in (
            (3, False, commands.Basic.Ack),
            (2, False, commands.Basic.Nack),
            (4, True, commands.Basic.Ack),  # covers 1 and 4 (2 and 3 are settled)
            (4, True, commands.Basic.Ack),  # again: nothing left to settle
            (7, True, commands.Basic.Nack),  # 5, 6, 7
            (8, False, commands.Basic.Ack),
        ):
            peer.send(channel.number, kind(delivery_tag=tag, multiple=multiple))
        await outcomes.wait()
        await asyncio.sleep(0.2)
        ack, nack = Outcome.ACK, Outcome.NACK
        expected = [ack, nack, ack, ack, nack, nack, nack, ack]
        assert [outcomes.outcome(index) for index in range(1, 9)] == expected
        assert channel.unconfirmed == 0
    finally:
        await connection.close(timeout_s=1)


async def test_a_close_crossing_the_brokers_keeps_the_number_until_its_close_ok(
    peer: ScriptedPeer, caplog: pytest.LogCaptureFixture
) -> None:
    """The client closes a channel just as the broker closes it (e.g. for a refused
    publish): RabbitMQ answers the client's close with a close-ok after its own close
    (seen on RabbitMQ 3.10: Channel.Close then Channel.CloseOk). Until that close-ok
    comes the number stays taken, so a channel opened meanwhile gets another number
    and no stale reply: its open-ok, not the close-ok, answers its channel.open.
    Scripted, since the real broker's timing cannot be chosen."""
    connection = await open_connection(peer.url)
    try:
        first = await connection.channel()
        closing = asyncio.create_task(first.close())
        await peer.wait_for(commands.Channel.Close, 1)
        peer.send(
            first.number,
            commands.Channel.Close(
                reply_code=404, reply_text="NOT_FOUND - crossing", class_id=60, method_id=40
            ),
        )
        error = await asyncio.wait_for(first.closed, 5)
        assert error.reply_code == 404
        await asyncio.wait_for(closing, 5)
        await peer.wait_for(commands.Channel.CloseOk, 1)  # the client's, for the broker's

        peer.answer_open = False
        opening = asyncio.create_task(connection.channel())
        await peer.wait_for(commands.Channel.Open, 2)
        number = peer.methods(commands.Channel.Open)[-1][0]
        peer.send(first.number, commands.Channel.CloseOk())  # the broker's, for the client's
        await asyncio.sleep(0.1)
        assert not opening.done(), "channel.open was answered by a stale close-ok"
        peer.send(number, commands.Channel.OpenOk())
        second = await asyncio.wait_for(opening, 5)
        assert second.number == number != first.number
        await asyncio.wait_for(second.confirm_select(), 5)

        peer.answer_open = True
        third = await asyncio.wait_for(connection.channel(), 5)
        assert third.number == first.number  # freed by the late close-ok
        assert "unexpected" not in caplog.text
    finally:
        await connection.close(timeout_s=1)
