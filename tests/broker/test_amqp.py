"""hopsched's own AMQP client (``hopsched.amqp``) against the shared broker: the
handshake, channels, publisher confirms, returns and write coalescing.

Each test opens its own connections with unique names and deletes every queue it
declares. Faults that need a broker to break, freeze or be reconfigured are in
``faults/test_amqp.py`` (private nodes); consumers in ``broker/test_amqp_consume.py``;
``channel.flow`` in ``broker/test_amqp_flow.py``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
from pamqp import commands
from support import Cleanup, rabbitmqctl, rabbitmqctl_path
from support.amqp import (
    Deliveries,
    Outcomes,
    confirming,
    connection_row,
    declare,
    encoded,
    open_connection,
    unique,
)
from support.tls import make_certificates, sockets_to

import hopsched
import hopsched.connect
import hopsched.urls
from hopsched import amqp
from hopsched.amqp import Outcome, Returned
from hopsched.amqp.wire import FRAME_BODY, FRAME_HEADER, FrameReader
from hopsched.errors import BrokerUnavailableError, ChannelClosedError

PASSWORD = "pw-amqp-wrong-9f3"


def url_with(url: str, *, user: str = "guest", password: str = "guest", path: str = "/") -> str:
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, path=path))


@pytest.fixture
async def connection(broker_url: str) -> AsyncIterator[amqp.Connection]:
    opened: amqp.Connection = await open_connection(broker_url)
    yield opened
    await opened.close()


@pytest.fixture
def need_rabbitmqctl() -> None:
    if rabbitmqctl_path() is None:
        pytest.fail("rabbitmqctl is needed to read what the broker reports of a connection")


# --- handshake ----------------------------------------------------------------------------


@pytest.mark.usefixtures("need_rabbitmqctl")
async def test_negotiated_values_and_name_are_what_the_broker_reports(broker_url: str) -> None:
    """A PLAIN login with ``?name=`` and ``?heartbeat=``: the broker's list_connections
    shows that name, user and vhost, and the frame_max, channel_max and heartbeat the
    client says it negotiated; without ``?name=`` the ``name=`` argument is shown."""
    from_url = f"test-amqp-url-{uuid.uuid4().hex[:8]}"
    by_argument = f"test-amqp-arg-{uuid.uuid4().hex[:8]}"
    first = await open_connection(f"{broker_url}?name={from_url}&heartbeat=7", name="unused")
    second = await open_connection(broker_url, name=by_argument)
    try:
        fields = ("frame_max", "channel_max", "timeout", "user", "vhost", "auth_mechanism")
        row = await connection_row(rabbitmqctl, from_url, *fields)
        assert (row["frame_max"], row["channel_max"], row["timeout"]) == (
            first.frame_max,
            first.channel_max,
            first.heartbeat_s,
        )
        assert (first.frame_max, first.channel_max, first.heartbeat_s) == (131_072, 2047, 7)
        assert (row["user"], row["vhost"], row["auth_mechanism"]) == ("guest", "/", "PLAIN")
        row = await connection_row(rabbitmqctl, by_argument, *fields)
        assert row["timeout"] == second.heartbeat_s == 20  # hopsched's default
        assert first.server_properties["product"] in ("RabbitMQ", b"RabbitMQ")
    finally:
        await first.close()
        await second.close()


def everything_said(error: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    records = [f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records]
    return "\n".join(
        [str(error), repr(error), *traceback.format_exception(error), caplog.text, *records]
    )


async def test_a_wrong_password_is_refused_with_the_url_masked(
    broker_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password: BrokerUnavailableError naming the masked URL and saying the
    login was refused; the password is in no str, repr, traceback or log line."""
    caplog.set_level(logging.DEBUG)
    url = url_with(broker_url, password=PASSWORD)
    with pytest.raises(BrokerUnavailableError) as caught:
        await open_connection(url)
    said = everything_said(caught.value, caplog)
    assert hopsched.urls.mask_url(url) in str(caught.value)
    assert "login refused" in str(caught.value)
    assert "403" in str(caught.value)
    assert PASSWORD not in said


async def test_a_missing_vhost_is_named_in_the_error(broker_url: str) -> None:
    """``connection.open`` of a vhost that does not exist: BrokerUnavailableError naming it."""
    vhost = f"no-such-vhost-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BrokerUnavailableError) as caught:
        await open_connection(url_with(broker_url, path=f"/{vhost}"))
    assert repr(vhost) in str(caught.value)
    assert "530" in str(caught.value)


async def test_nothing_listening_raises_oserror_that_the_connector_maps(
    broker_url: str,
) -> None:
    """A closed port: ``amqp.connect`` raises the OSError (refused), and
    ``hopsched.connect.Connector`` maps it to BrokerUnavailableError."""
    url = url_with(broker_url, password=PASSWORD)
    closed = urlunsplit(urlsplit(url)._replace(netloc=f"guest:{PASSWORD}@127.0.0.1:1"))
    with pytest.raises(ConnectionRefusedError) as caught:
        await open_connection(closed)
    assert not isinstance(caught.value, hopsched.HopschedError)

    connector = hopsched.connect.Connector(hopsched.Settings(url=closed), name="test")
    with pytest.raises(BrokerUnavailableError, match="cannot reach the broker") as mapped:
        await connector.connect()
    assert PASSWORD not in str(mapped.value)


async def test_a_silent_endpoint_fails_within_the_timeout() -> None:
    """A TCP endpoint that accepts and never answers: BrokerUnavailableError saying no
    AMQP handshake came, within the timeout."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match="no AMQP handshake within 1 s"):
            await open_connection(f"amqp://guest:guest@127.0.0.1:{port}/", timeout_s=1.0)
        assert time.monotonic() - started < 2.0
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@dataclass
class TlsEndpoints:
    """``start(kind)`` starts a local TLS endpoint and returns its port: ``untrusted``
    (its certificate is of a CA the client does not know), ``client-cert`` (requires a
    client certificate, which the client lacks) or ``silent`` (takes TCP, never answers
    the TLS hello). ``cafile`` is the CA that signed its certificate."""

    start: Callable[[str], Awaitable[int]]
    cafile: str


@pytest.fixture
async def tls_endpoints(tmp_path: Path) -> AsyncIterator[TlsEndpoints]:
    """Local TLS endpoints; see ``TlsEndpoints``."""
    files = make_certificates(tmp_path, "nobody")
    held: list[asyncio.StreamWriter] = []
    servers: list[asyncio.Server] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    async def start(kind: str) -> int:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files["server.pem"], files["server.key"])
        if kind == "client-cert":
            context.load_verify_locations(files["ca.pem"])
            context.verify_mode = ssl.CERT_REQUIRED
        tls = None if kind == "silent" else context
        server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=tls)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield TlsEndpoints(start, files["ca.pem"])
    for writer in held:
        writer.close()
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("untrusted", r"CERTIFICATE_VERIFY_FAILED"),
        ("client-cert", r"CERTIFICATE_REQUIRED|HANDSHAKE_FAILURE|closed the connection"),
        ("silent", r"took the TCP connection but completed no TLS handshake within 0.5 s"),
    ],
)
async def test_a_failed_tls_connect_leaves_no_socket_open(
    tls_endpoints: TlsEndpoints, kind: str, error: str
) -> None:
    """A TLS connect that fails, in the handshake or by its timeout, has closed its
    socket when it raises. Before, asyncio closed it in a later loop callback: a test
    loop that ended first left it to the garbage collector (a ResourceWarning that
    failed a CI run), and a relay retrying such a broker would pile them up. A TLS
    timeout also said "no TCP connection" for a peer that had taken it."""
    port = await tls_endpoints.start(kind)
    cafile = "" if kind == "untrusted" else f"?cafile={quote(tls_endpoints.cafile)}"
    url = f"amqps://guest:guest@127.0.0.1:{port}/{cafile}"
    with pytest.raises((ssl.SSLError, BrokerUnavailableError), match=error):
        await amqp.connect(amqp.ConnectionParams.from_url(url), timeout_s=0.5)
    assert sockets_to(port) == []


async def test_a_close_cancelled_while_it_waits_for_close_ok_drops_the_socket(
    broker_url: str,
) -> None:
    """A task cancelled in the ``finally`` that closes its connection (a relay's stop
    cancelling its watches, a loop ending) left the socket open: the garbage collector
    found it later (a ResourceWarning failing another test's setup)."""
    connection = await open_connection(broker_url)
    closing = asyncio.ensure_future(connection.close())
    await asyncio.sleep(0)  # connection.close sent; its close-ok not read yet
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.sleep(0)  # abort() closes the socket in a callback queued by then
    assert connection._transport is not None
    assert connection._transport.is_closing()
    async with asyncio.timeout(5):
        await connection._lost  # the socket is closed: connection_lost ran


# --- channels and confirms ----------------------------------------------------------------


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_confirmed_publishes_are_acked(
    connection: amqp.Connection, cleanup: Cleanup, queue_type: str
) -> None:
    """Publishes with confirms to a quorum and a classic queue: each gets one ACK and
    the queue holds them all."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup, arguments={"x-queue-type": queue_type})
    outcomes = Outcomes()
    for index in range(20):
        channel.publish("", queue, b"m%d" % index, encoded(), callback=outcomes.callback(index))
    await outcomes.wait()
    assert {outcomes.outcome(index) for index in range(20)} == {Outcome.ACK}
    assert channel.unconfirmed == 0
    declared = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
    assert isinstance(declared, commands.Queue.DeclareOk)
    assert declared.message_count == 20


async def test_mandatory_to_an_unbound_key_is_returned_312(
    connection: amqp.Connection,
) -> None:
    """A mandatory publish nothing is bound for: RETURNED with 312 NO_ROUTE, once."""
    channel = await confirming(connection)
    outcomes = Outcomes()
    channel.publish("", unique("nowhere"), b"lost", encoded(), callback=outcomes.callback(0))
    await outcomes.wait()
    assert outcomes.outcome(0) is Outcome.RETURNED
    returned = outcomes.detail(0)
    assert isinstance(returned, Returned)
    assert (returned.reply_code, returned.reply_text) == (312, "NO_ROUTE")


async def test_returns_reach_their_own_publish_among_identical_messages(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """50 publishes in flight at once, all with the same message_id, properties and
    body, to a mix of routable and unroutable keys: each gets its true outcome (ACK
    for a bound key, RETURNED for an unbound one), and the queues hold exactly the
    routable ones."""
    channel = await confirming(connection)
    queues = [
        await declare(channel, cleanup, arguments={"x-queue-type": kind})
        for kind in ("quorum", "classic")  # a quorum queue confirms later than a return
    ]
    nowhere = [unique("nowhere") for _ in range(3)]
    keys = [(queues + nowhere)[(index * 7) % 5] for index in range(50)]
    properties = encoded(message_id="same-id", headers={"k": "v"})
    outcomes = Outcomes()
    for index, key in enumerate(keys):
        channel.publish("", key, b"same body", properties, callback=outcomes.callback(index))
    await outcomes.wait()
    for index, key in enumerate(keys):
        expected = Outcome.ACK if key in queues else Outcome.RETURNED
        assert outcomes.outcome(index) is expected, (index, key)
    for queue in queues:
        declared = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
        assert isinstance(declared, commands.Queue.DeclareOk)
        assert declared.message_count == keys.count(queue)


async def test_a_return_never_lands_on_a_publish_without_mandatory(
    connection: amqp.Connection,
) -> None:
    """Identical publishes to one unbound key, alternately without and with
    ``mandatory``: the broker drops the former (ACK) and returns the latter
    (RETURNED); a return is never pinned on a publish that could not be returned."""
    channel = await confirming(connection)
    nowhere = unique("nowhere")
    outcomes = Outcomes()
    for index in range(10):
        mandatory = index % 2 == 1
        channel.publish(
            "", nowhere, b"same", encoded(), mandatory=mandatory, callback=outcomes.callback(index)
        )
    await outcomes.wait()
    for index in range(10):
        expected = Outcome.RETURNED if index % 2 else Outcome.ACK
        assert outcomes.outcome(index) is expected, index


async def test_returns_are_matched_by_content_on_the_same_key(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """On a headers exchange one routing key routes or not by the message's headers:
    publishes that differ only in a header, interleaved, each get their own outcome."""
    channel = await confirming(connection)
    exchange = unique("headers")
    cleanup.exchanges.add(exchange)
    await channel.call(commands.Exchange.Declare(exchange=exchange, exchange_type="headers"))
    queue = await declare(channel, cleanup)
    await channel.call(
        commands.Queue.Bind(
            queue=queue, exchange=exchange, arguments={"x-match": "all", "route": "yes"}
        )
    )
    routed = [index % 3 == 0 for index in range(30)]
    outcomes = Outcomes()
    for index, route in enumerate(routed):
        properties = encoded(message_id="same", headers={"route": "yes" if route else "no"})
        channel.publish(exchange, "key", b"body", properties, callback=outcomes.callback(index))
    await outcomes.wait()
    for index, route in enumerate(routed):
        assert outcomes.outcome(index) is (Outcome.ACK if route else Outcome.RETURNED), index


async def test_a_full_reject_publish_queue_nacks(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """``x-max-length: 1`` with ``x-overflow: reject-publish``: the first publish is
    ACKed, the next NACKed."""
    channel = await confirming(connection)
    queue = await declare(
        channel, cleanup, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    outcomes = Outcomes()
    channel.publish("", queue, b"fits", encoded(), callback=outcomes.callback(0))
    await outcomes.wait()
    channel.publish("", queue, b"refused", encoded(), callback=outcomes.callback(1))
    await outcomes.wait()
    assert [outcomes.outcome(0), outcomes.outcome(1)] == [Outcome.ACK, Outcome.NACK]
    assert outcomes.detail(1) is None


async def test_a_missing_exchange_closes_the_channel_404(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """A publish to a missing exchange: the broker closes the channel with 404 for
    basic.publish (class 60, method 40); every publish in flight on it gets CLOSED
    with that error, a later publish and call raise it, and another channel of the
    connection goes on publishing."""
    channel = await confirming(connection)
    other = await confirming(connection)
    queue = await declare(other, cleanup)
    outcomes = Outcomes()
    channel.publish("", queue, b"before", encoded(), callback=outcomes.callback("before"))
    await outcomes.wait()
    channel.publish(unique("no-exchange"), "k", b"x", encoded(), callback=outcomes.callback(0))
    for index in range(1, 5):
        channel.publish("", queue, b"after", encoded(), callback=outcomes.callback(index))
    error = await asyncio.wait_for(channel.closed, 10)
    await outcomes.wait()

    assert isinstance(error, ChannelClosedError)
    assert error.reply_code == 404
    assert "NOT_FOUND" in error.reply_text
    assert (error.class_id, error.method_id) == (60, 40)
    assert not channel.is_open
    assert outcomes.outcome("before") is Outcome.ACK
    for index in range(5):
        assert outcomes.outcome(index) is Outcome.CLOSED
        assert outcomes.detail(index) is error
    with pytest.raises(ChannelClosedError):
        channel.publish("", queue, b"late", encoded())
    with pytest.raises(ChannelClosedError):
        await channel.call(commands.Queue.Declare(queue=queue, passive=True))

    still = Outcomes()
    other.publish("", queue, b"other", encoded(), callback=still.callback(0))
    await still.wait()
    assert still.outcome(0) is Outcome.ACK
    assert connection.is_open
    again = await confirming(connection)  # the closed channel's number is reusable
    again.publish("", queue, b"again", encoded(), callback=still.callback(1))
    await still.wait()
    assert still.outcome(1) is Outcome.ACK


async def test_ten_thousand_publishes_settle_exactly_once(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """10,000 publishes made as fast as possible: the broker confirms most of them with
    ``multiple=True`` acks, and every publish's callback runs exactly once, with ACK."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup, arguments={"x-queue-type": "classic"})
    calls = [0] * 10_000
    outcomes: set[Outcome] = set()
    done = asyncio.Event()
    settled = 0
    multiple_acks = 0
    original = channel._confirmed

    def counted(tag: int, multiple: bool, outcome: Outcome) -> None:
        nonlocal multiple_acks
        multiple_acks += multiple
        original(tag, multiple, outcome)

    channel._confirmed = counted  # type: ignore[method-assign]

    def callback(index: int) -> amqp.ConfirmCallback:
        def settle(outcome: Outcome, detail: Any) -> None:
            nonlocal settled
            calls[index] += 1
            outcomes.add(outcome)
            settled += 1
            if settled == len(calls):
                done.set()

        return settle

    properties = encoded()
    for batch in range(0, len(calls), 1000):
        for index in range(batch, batch + 1000):
            channel.publish("", queue, b"n", properties, callback=callback(index))
        await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 60)
    await asyncio.sleep(0.3)  # a second callback would come in this time
    assert calls == [1] * len(calls)
    assert outcomes == {Outcome.ACK}
    assert multiple_acks > 0, "the broker sent no multiple=True ack: nothing was tested"
    assert channel.unconfirmed == 0
    print(f"\n10,000 publishes, {multiple_acks} multiple=True acks")


def frames_written(connection: amqp.Connection) -> list[tuple[int, int, bytes]]:
    """Start recording every frame the connection writes; returns the (live) list."""
    transport = connection._transport
    assert transport is not None
    reader = FrameReader(frame_max=connection.frame_max)
    frames: list[tuple[int, int, bytes]] = []
    write = transport.write

    def recording(data: bytes | bytearray | memoryview) -> None:
        frames.extend(reader.feed(bytes(data)))
        write(data)

    transport.write = recording  # type: ignore[method-assign]
    return frames


async def test_a_body_larger_than_frame_max_is_split_and_arrives_whole(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """A 3.5 x frame_max body leaves in four body frames none larger than frame_max,
    and a consumer gets it whole, byte for byte."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    body = bytes(range(256)) * (connection.frame_max * 7 // 2 // 256)
    frames = frames_written(connection)
    outcomes = Outcomes()
    channel.publish("", queue, body, encoded(message_id="big"), callback=outcomes.callback(0))
    await outcomes.wait()
    assert outcomes.outcome(0) is Outcome.ACK
    bodies = [payload for kind, _, payload in frames if kind == FRAME_BODY]
    assert len(bodies) == 4
    assert all(len(payload) + 8 <= connection.frame_max for payload in bodies)
    assert b"".join(bodies) == body

    deliveries = Deliveries()
    await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    (got,) = await deliveries.wait_for(1)
    assert got.body == body
    assert got.properties is not None
    assert got.properties.message_id == "big"
    channel.ack(got.delivery_tag)


async def test_a_header_too_large_for_a_frame_raises_before_sending(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """Properties whose content header exceeds one frame: ``publish`` raises ValueError,
    writes nothing and uses no confirm sequence number; the channel and the
    connection go on (the next publish is ACKed as the first)."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    too_big = encoded(headers={"pad": "x" * connection.frame_max})
    frames = frames_written(connection)
    outcomes = Outcomes()
    with pytest.raises(ValueError, match="frame_max"):
        channel.publish("", queue, b"never", too_big, callback=outcomes.callback("big"))
    await asyncio.sleep(0.1)
    assert frames == []
    assert channel.unconfirmed == 0
    channel.publish("", queue, b"next", encoded(), callback=outcomes.callback(0))
    await outcomes.wait(1)
    assert outcomes.outcome(0) is Outcome.ACK
    assert outcomes.calls["big"] == []
    assert channel.is_open
    assert connection.is_open
    assert [kind for kind, _, _ in frames].count(FRAME_HEADER) == 1


async def test_call_declares_binds_purges_and_deletes(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """``Channel.call`` returns each method's own reply: queue.declare-ok with the
    counts, bind-ok (a publish then routes), purge-ok with the purged count and
    delete-ok with the count left; the queue is then gone (passive declare: 404)."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    exchange = unique("direct")
    cleanup.exchanges.add(exchange)
    reply = await channel.call(commands.Exchange.Declare(exchange=exchange, durable=False))
    assert isinstance(reply, commands.Exchange.DeclareOk)
    reply = await channel.call(commands.Queue.Bind(queue=queue, exchange=exchange, routing_key="k"))
    assert isinstance(reply, commands.Queue.BindOk)
    outcomes = Outcomes()
    for index in range(3):
        channel.publish(exchange, "k", b"x", encoded(), callback=outcomes.callback(index))
    await outcomes.wait()
    assert {outcomes.outcome(index) for index in range(3)} == {Outcome.ACK}
    reply = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
    assert isinstance(reply, commands.Queue.DeclareOk)
    assert (reply.message_count, reply.consumer_count) == (3, 0)
    reply = await channel.call(commands.Queue.Purge(queue=queue))
    assert isinstance(reply, commands.Queue.PurgeOk)
    assert reply.message_count == 3
    channel.publish(exchange, "k", b"x", encoded(), callback=outcomes.callback(3))
    await outcomes.wait()
    reply = await channel.call(
        commands.Queue.Unbind(queue=queue, exchange=exchange, routing_key="k")
    )
    assert isinstance(reply, commands.Queue.UnbindOk)
    reply = await channel.call(commands.Queue.Delete(queue=queue))
    assert isinstance(reply, commands.Queue.DeleteOk)
    assert reply.message_count == 1
    reply = await channel.call(commands.Exchange.Delete(exchange=exchange))
    assert isinstance(reply, commands.Exchange.DeleteOk)
    with pytest.raises(ChannelClosedError) as caught:
        await channel.call(commands.Queue.Declare(queue=queue, passive=True))
    assert caught.value.reply_code == 404
    assert (caught.value.class_id, caught.value.method_id) == (50, 10)


async def test_a_redeclare_with_other_arguments_is_406(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """Redeclaring a queue with other arguments: ChannelClosedError 406
    PRECONDITION_FAILED for queue.declare; the connection stays open."""
    channel = await connection.channel()
    queue = await declare(channel, cleanup, arguments={"x-max-length": 5})
    with pytest.raises(ChannelClosedError) as caught:
        await declare(channel, None, queue, arguments={"x-max-length": 6})
    assert caught.value.reply_code == 406
    assert "PRECONDITION_FAILED" in caught.value.reply_text
    assert (caught.value.class_id, caught.value.method_id) == (50, 10)
    assert await channel.closed is caught.value
    assert connection.is_open
    await (await connection.channel()).close()


# --- writes -------------------------------------------------------------------------------


async def test_publishes_of_one_loop_iteration_leave_in_one_write(
    connection: amqp.Connection, cleanup: Cleanup
) -> None:
    """200 publishes and acks made without yielding to the loop go out in a single
    ``transport.write`` (counted through a wrapper of the transport's write)."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    transport = connection._transport
    assert transport is not None
    writes: list[int] = []
    write = transport.write

    def counting(data: bytes | bytearray | memoryview) -> None:
        writes.append(len(data))
        write(data)

    transport.write = counting  # type: ignore[method-assign]
    outcomes = Outcomes()
    for index in range(200):
        channel.publish("", queue, b"c", encoded(), callback=outcomes.callback(index))
    assert writes == []  # nothing before the loop runs
    await asyncio.sleep(0)
    assert len(writes) == 1
    await outcomes.wait()
    assert {outcomes.outcome(index) for index in range(200)} == {Outcome.ACK}


async def test_a_confirm_callback_that_raises_is_logged_and_the_rest_settle(
    connection: amqp.Connection, cleanup: Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    """A confirm callback that raises (a bug in the caller) is logged, as a delivery
    callback's error is; the other publishes still get their ACK, each once, and the
    connection and channel stay open."""
    channel = await confirming(connection)
    queue = await declare(channel, cleanup)
    outcomes = Outcomes()
    failing = outcomes.callback("failing")

    def raising(outcome: Outcome, detail: Any) -> None:
        failing(outcome, detail)
        raise RuntimeError("a bug in a confirm callback")

    for index in range(50):
        callback = raising if index % 10 == 0 else outcomes.callback(index)
        channel.publish("", queue, b"x", encoded(), callback=callback)
    await outcomes.wait(50 - 5 + 1)
    await asyncio.sleep(0.3)
    assert connection.is_open
    assert channel.is_open
    assert len(outcomes.calls["failing"]) == 5
    for index in range(50):
        if index % 10:
            assert outcomes.outcome(index) is Outcome.ACK
    assert "a bug in a confirm callback" in caplog.text


async def test_repeated_errors_of_a_closed_channel_do_not_grow(
    connection: amqp.Connection,
) -> None:
    """The one error a closed channel (and a lost connection) raises again and again
    keeps a traceback of the last raise only: 1,000 refused publishes and calls leave
    it a few frames deep, not thousands (a caller retrying in a loop would otherwise
    grow it, and every log line showing it, without bound)."""
    channel = await connection.channel()
    channel.publish(unique("no-exchange"), "k", b"x", encoded())
    await asyncio.wait_for(channel.closed, 10)
    for _ in range(1000):
        with pytest.raises(ChannelClosedError) as refused:
            channel.publish("", "k", b"x", encoded())
    assert len(traceback.extract_tb(refused.value.__traceback__)) < 10
    for _ in range(1000):
        with pytest.raises(ChannelClosedError) as failed:
            await channel.call(commands.Basic.Qos(prefetch_count=1))
    assert len(traceback.extract_tb(failed.value.__traceback__)) < 10

    await connection.close()
    for _ in range(1000):
        with pytest.raises(hopsched.BrokerConnectionLost) as lost:
            await connection.channel()
    assert len(traceback.extract_tb(lost.value.__traceback__)) < 10


async def test_a_close_crossing_the_brokers_close_leaves_the_connection_sound(
    connection: amqp.Connection, cleanup: Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    """``close()`` sent in the same write as a publish the broker refuses: both sides
    close the channel at once. ``close()`` returns, ``closed`` holds the broker's 404,
    and the next channel (reusing the number once the broker answered both closes)
    opens, confirms and declares with the right replies, nothing logged as unexpected."""
    channel = await connection.channel()
    channel.publish(unique("no-exchange"), "k", b"x", encoded())
    await asyncio.wait_for(channel.close(), 10)
    error = await asyncio.wait_for(channel.closed, 1)
    assert isinstance(error, ChannelClosedError)
    assert error.reply_code == 404
    again = await confirming(connection)
    queue = await declare(again, cleanup)
    outcomes = Outcomes()
    again.publish("", queue, b"x", encoded(), callback=outcomes.callback(0))
    await outcomes.wait()
    assert outcomes.outcome(0) is Outcome.ACK
    assert "unexpected" not in caplog.text
