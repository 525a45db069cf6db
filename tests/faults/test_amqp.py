"""hopsched's own AMQP client (``hopsched.amqp``) against private RabbitMQ nodes
(``broker.py``): what needs a broker reconfigured, broken, frozen or alarmed.

* a vhost with special characters, and one the user may not use;
* TLS with PLAIN (``cafile``, no CA, ``no_verify_ssl``) and EXTERNAL (a client
  certificate whose CN is the user; the ``rabbitmq_auth_mechanism_ssl`` plugin);
* ``kill -9`` of the node, SIGSTOP with short heartbeats, a memory alarm
  (``connection.blocked``), and ``rabbitmqctl close_connection``.

The shared broker is never touched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from support.amqp import (
    Deliveries,
    Outcomes,
    confirming,
    connection_row,
    declare,
    encoded,
    open_connection,
)
from support.private_nodes import PrivateBroker, freeze, require_rabbitmq, seen_by_nodes
from support.tls import make_certificates, sockets_to

import hopsched
import hopsched.connect
from hopsched.amqp import Outcome
from hopsched.errors import BrokerConnectionLost, BrokerUnavailableError
from hopsched.testing.localbroker import free_port

StartBroker = Callable[..., Awaitable[PrivateBroker]]
EXTERNAL_USER = "amqp-external-user"
SSL_PLUGIN = "rabbitmq_auth_mechanism_ssl"

# Private nodes: each test starts one (about 10 s), so the file is in the slow tier.
pytestmark = pytest.mark.slow


# --- vhosts -------------------------------------------------------------------------------


async def test_a_special_vhost_and_a_broker_with_small_limits(
    start_private_broker: StartBroker,
) -> None:
    """A vhost named ``team/a b#1%é``, percent-encoded in the URL, on a node configured
    with ``frame_max = 8192`` and ``channel_max = 16``: the login reaches that vhost,
    the client takes the broker's limits and list_connections reports the same
    values; a 20 KB body goes out in 8 KB frames and is consumed whole; a user
    without permissions on the vhost is refused with an error naming it."""
    node = await start_private_broker("frame_max = 8192\nchannel_max = 16")
    vhost = "team/a b#1%é"
    await node.rabbitmqctl("add_vhost", vhost)
    await node.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    await node.rabbitmqctl("add_user", "outsider", "outsider-pw")
    base = f"127.0.0.1:{node.port}/{quote(vhost, safe='')}"
    name = f"test-amqp-vhost-{uuid.uuid4().hex[:8]}"
    connection = await open_connection(f"amqp://guest:guest@{base}?heartbeat=9", name=name)
    try:
        fields = ("vhost", "frame_max", "channel_max", "timeout")
        row = await connection_row(node.rabbitmqctl, name, *fields)
        assert row["vhost"] == vhost
        assert (connection.frame_max, connection.channel_max, connection.heartbeat_s) == (
            8192,
            16,
            9,
        )
        assert (row["frame_max"], row["channel_max"], row["timeout"]) == (8192, 16, 9)
        channel = await confirming(connection)
        queue = await declare(channel, None, "special")
        outcomes = Outcomes()
        payload = bytes(range(256)) * 80
        channel.publish("", queue, payload, encoded(), callback=outcomes.callback(0))
        await outcomes.wait()
        assert outcomes.outcome(0) is Outcome.ACK
        listed = await node.rabbitmqctl("list_queues", "-q", "-p", vhost, "name", "messages")
        assert "special\t1" in listed
        deliveries = Deliveries()
        await channel.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
        (got,) = await deliveries.wait_for(1)
        assert got.body == payload
        channel.ack(got.delivery_tag)
    finally:
        await connection.close()

    with pytest.raises(BrokerUnavailableError) as caught:
        await open_connection(f"amqp://outsider:outsider-pw@{base}")
    text = str(caught.value)
    assert repr(vhost) in text
    assert "530" in text
    assert "outsider-pw" not in text


# --- TLS ----------------------------------------------------------------------------------


def tls_config(port: int, files: dict[str, str], *, require_client_cert: bool) -> str:
    """The node's TLS listener, with ``files`` (in ``node_tmp_path``) as the node sees them."""
    return f"""
listeners.ssl.default = 127.0.0.1:{port}
ssl_options.cacertfile = {seen_by_nodes(files["ca.pem"])}
ssl_options.certfile = {seen_by_nodes(files["server.pem"])}
ssl_options.keyfile = {seen_by_nodes(files["server.key"])}
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = {"true" if require_client_cert else "false"}
"""


async def test_tls_with_plain_login(start_private_broker: StartBroker, node_tmp_path: Path) -> None:
    """A TLS listener that does not require client certificates: ``amqps://`` with
    ``cafile`` logs in with PLAIN over TLS (list_connections says ssl); without the CA
    the certificate check fails with an SSL error (through ``Connector``: "TLS
    handshake failed", the password masked); ``no_verify_ssl=1`` connects without it;
    ``auth=external`` where the broker does not offer it names what it offers."""
    files = make_certificates(node_tmp_path, "nobody")
    port = free_port()
    node = await start_private_broker(tls_config(port, files, require_client_cert=False))
    await node.rabbitmqctl("add_user", "tls-user", "tls-secret")
    await node.rabbitmqctl("set_permissions", "tls-user", ".*", ".*", ".*")
    base = f"amqps://tls-user:tls-secret@127.0.0.1:{port}/"
    name = f"test-amqp-tls-{uuid.uuid4().hex[:8]}"

    connection = await open_connection(
        f"{base}?{urlencode({'cafile': files['ca.pem']})}", name=name
    )
    try:
        row = await connection_row(node.rabbitmqctl, name, "ssl", "auth_mechanism", "user")
        assert (row["ssl"], row["auth_mechanism"], row["user"]) == (True, "PLAIN", "tls-user")
        channel = await confirming(connection)
        queue = await declare(channel, None, "tls")
        outcomes = Outcomes()
        channel.publish("", queue, b"over tls", encoded(), callback=outcomes.callback(0))
        await outcomes.wait()
        assert outcomes.outcome(0) is Outcome.ACK
    finally:
        await connection.close()
    assert sockets_to(port) == []  # closed with TLS's close_notify, not left to the loop

    with pytest.raises(ssl.SSLCertVerificationError, match="CERTIFICATE_VERIFY_FAILED"):
        await open_connection(base)
    assert sockets_to(port) == []
    connector = hopsched.connect.Connector(hopsched.Settings(url=base), name="test")
    with pytest.raises(BrokerUnavailableError, match="TLS handshake failed") as caught:
        await connector.connect()
    assert "tls-secret" not in str(caught.value)
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)

    unverified = await open_connection(f"{base}?no_verify_ssl=1")
    assert unverified.is_open
    await unverified.close()

    external = f"{base}?{urlencode({'auth': 'external', 'cafile': files['ca.pem']})}"
    with pytest.raises(BrokerUnavailableError, match="not EXTERNAL"):
        await open_connection(external)
    assert sockets_to(port) == []


def require_ssl_plugin() -> None:
    """The EXTERNAL mechanism's plugin ships with RabbitMQ; fail (CI) or skip without it."""
    plugins = require_rabbitmq().lib_dir / "plugins"
    if any(plugins.glob(f"{SSL_PLUGIN}-*")):
        return
    reason = f"the {SSL_PLUGIN} plugin is not installed under {plugins}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run this test", pytrace=False)
    pytest.skip(reason)


async def test_tls_with_external_login(
    start_private_broker: StartBroker, node_tmp_path: Path
) -> None:
    """``auth=external``: a node with ``rabbitmq_auth_mechanism_ssl``, EXTERNAL and
    PLAIN offered, ``ssl_cert_login_from = common_name`` and client certificates
    required. A client certificate whose CN is a user without a password logs in as
    that user with EXTERNAL; without a client certificate the TLS handshake fails with
    the broker's reason (an SSLError; through ``Connector``: "TLS handshake failed")."""
    require_ssl_plugin()
    files = make_certificates(node_tmp_path, EXTERNAL_USER)
    port = free_port()
    config = tls_config(port, files, require_client_cert=True) + (
        "auth_mechanisms.1 = EXTERNAL\nauth_mechanisms.2 = PLAIN\n"
        "ssl_cert_login_from = common_name\n"
    )
    node = await start_private_broker(config, plugins=[SSL_PLUGIN])
    await node.rabbitmqctl("add_user", EXTERNAL_USER, uuid.uuid4().hex)
    await node.rabbitmqctl("clear_password", EXTERNAL_USER)
    await node.rabbitmqctl("set_permissions", EXTERNAL_USER, ".*", ".*", ".*")
    tls = {
        "cafile": files["ca.pem"],
        "certfile": files["client.pem"],
        "keyfile": files["client.key"],
    }
    url = f"amqps://127.0.0.1:{port}/?{urlencode({'auth': 'external', **tls})}"
    name = f"test-amqp-external-{uuid.uuid4().hex[:8]}"

    connection = await open_connection(url, name=name)
    try:
        row = await connection_row(node.rabbitmqctl, name, "auth_mechanism", "user", "ssl")
        assert (row["auth_mechanism"], row["user"], row["ssl"]) == (
            "EXTERNAL",
            EXTERNAL_USER,
            True,
        )
        channel = await confirming(connection)
        queue = await declare(channel, None, "external")
        outcomes = Outcomes()
        channel.publish("", queue, b"by certificate", encoded(), callback=outcomes.callback(0))
        await outcomes.wait()
        assert outcomes.outcome(0) is Outcome.ACK
    finally:
        await connection.close()
    assert sockets_to(port) == []  # closed with TLS's close_notify, not left to the loop

    without_cert = (
        f"amqps://127.0.0.1:{port}/?{urlencode({'auth': 'external', 'cafile': files['ca.pem']})}"
    )
    # TLS 1.3 completes the client's handshake first; the broker's alert comes after it
    with pytest.raises(ssl.SSLError, match=r"CERTIFICATE_REQUIRED|HANDSHAKE_FAILURE"):
        await open_connection(without_cert)
    assert sockets_to(port) == []
    # Settings refuse it before any connection: EXTERNAL needs a client certificate
    with pytest.raises(hopsched.InvalidSettingsError, match="give certfile"):
        hopsched.Settings(url=without_cert)


# --- faults -------------------------------------------------------------------------------


async def test_kill_9_loses_the_connection_channels_and_publishes(
    private_broker: PrivateBroker,
) -> None:
    """``kill -9`` of the node with publishes in flight: ``connection.closed`` resolves
    with BrokerConnectionLost, so does every open channel's ``closed``, every in-flight
    publish gets CLOSED with that error, and later calls raise it."""
    connection = await open_connection(private_broker.url)
    publishing = await confirming(connection)
    consuming = await connection.channel()
    queue = await declare(publishing, None, "doomed")
    deliveries = Deliveries()
    await consuming.consume(queue, deliveries.on_delivery, deliveries.on_cancel)
    outcomes = Outcomes()
    for index in range(5):
        publishing.publish("", queue, b"x", encoded(), callback=outcomes.callback(index))
    await private_broker.kill()  # sent before the loop writes the publishes

    error = await asyncio.wait_for(connection.closed, 10)
    assert isinstance(error, BrokerConnectionLost)
    assert "lost" in str(error)
    assert await asyncio.wait_for(publishing.closed, 1) is error
    assert await asyncio.wait_for(consuming.closed, 1) is error
    await outcomes.wait(within=1)
    for index in range(5):
        assert outcomes.outcome(index) is Outcome.CLOSED
        assert outcomes.detail(index) is error
    assert not connection.is_open
    with pytest.raises(BrokerConnectionLost):
        publishing.publish("", queue, b"late", encoded())
    with pytest.raises(BrokerConnectionLost):
        await connection.channel()
    assert deliveries.cancelled == []
    await connection.close()  # closing a lost connection is a no-op


async def test_a_frozen_broker_is_dropped_after_two_missed_heartbeats(
    private_broker: PrivateBroker,
) -> None:
    """``?heartbeat=2``: an idle connection outlives 3 heartbeat timeouts (both sides
    send heartbeats); after SIGSTOP of the node (no RST, no FIN) the client drops the
    connection within 2 x heartbeat plus slack, with a BrokerConnectionLost saying the
    broker is frozen, and its channels and publishes are settled with it."""
    connection = await open_connection(f"{private_broker.url}?heartbeat=2")
    assert connection.heartbeat_s == 2
    channel = await confirming(connection)
    queue = await declare(channel, None, "frozen")
    await asyncio.sleep(6)
    assert connection.is_open, "the idle connection was dropped: heartbeats are not working"
    assert private_broker.pid is not None
    await freeze(private_broker.pid)
    try:
        stopped = time.monotonic()
        outcomes = Outcomes()
        channel.publish("", queue, b"x", encoded(), callback=outcomes.callback(0))
        error = await asyncio.wait_for(connection.closed, 15)
        elapsed = time.monotonic() - stopped
        await outcomes.wait(within=1)
    finally:
        os.kill(private_broker.pid, signal.SIGCONT)
    print(f"\nfrozen broker dropped after {elapsed:.1f} s: {error}")
    assert isinstance(error, BrokerConnectionLost)
    assert "heartbeat 2 s" in str(error)
    assert "frozen" in str(error)
    # silence of more than 2 heartbeats, counted from the broker's last heartbeat (up
    # to 1 s before the stop), checked every heartbeat/2 s: 3 to 5 s, plus scheduling
    assert 2.5 <= elapsed <= 2 * 2 + 3.0
    assert await asyncio.wait_for(channel.closed, 1) is error
    assert outcomes.outcome(0) is Outcome.CLOSED
    await private_broker.kill()


ALARM_ON = "rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []})."
ALARM_OFF = "rabbit_alarm:clear_alarm({resource_limit, memory, node()})."


async def test_a_memory_alarm_blocks_publishes_until_it_clears(
    private_broker: PrivateBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A memory alarm on the node: ``connection.blocked`` gets the broker's reason and
    ``on_blocked`` runs with it; a publish then gets no confirm until the alarm
    clears, when ``on_blocked`` runs with None and the publish is ACKed; blocked for
    longer than two heartbeat timeouts (``?heartbeat=2``), the connection stays. An
    ``on_blocked`` callback that raises is logged and the next one still runs."""
    connection = await open_connection(f"{private_broker.url}?heartbeat=2")
    try:
        channel = await confirming(connection)
        queue = await declare(channel, None, "alarmed")
        seen: list[str | None] = []
        changed = asyncio.Event()

        def on_blocked(reason: str | None) -> None:
            seen.append(reason)
            changed.set()

        def raising(reason: str | None) -> None:
            raise RuntimeError("a bug in on_blocked")

        connection.on_blocked.extend([raising, on_blocked])
        await private_broker.rabbitmqctl("eval", ALARM_ON)
        outcomes = Outcomes()
        channel.publish("", queue, b"waits", encoded(), callback=outcomes.callback(0))
        await asyncio.wait_for(changed.wait(), 10)
        assert connection.blocked is not None
        assert "memory" in connection.blocked
        assert seen == [connection.blocked]
        await asyncio.sleep(5)  # 2.5 heartbeat timeouts: blocked is not dead
        assert outcomes.calls[0] == [], "confirmed while the broker blocks publishers"
        assert connection.is_open

        changed.clear()
        await private_broker.rabbitmqctl("eval", ALARM_OFF)
        await asyncio.wait_for(changed.wait(), 10)
        assert seen[-1] is None
        assert connection.blocked is None
        await outcomes.wait()
        assert outcomes.outcome(0) is Outcome.ACK
        failed = [r for r in caplog.records if "on_blocked callback failed" in r.getMessage()]
        assert len(failed) == 2  # blocked, then unblocked
        assert "a bug in on_blocked" in caplog.text
    finally:
        await connection.close()


async def test_close_returns_within_its_timeout_while_blocked(
    private_broker: PrivateBroker,
) -> None:
    """A blocked connection with 20 MB of publishes the broker does not read:
    ``close(timeout_s=2)`` returns within its timeout, and the connection is really
    gone after it: its socket is closed, its channel's ``closed`` resolves and the
    publishes get CLOSED. (The broker itself notices only once it reads again.)"""
    name = f"test-amqp-blocked-{uuid.uuid4().hex[:8]}"
    connection = await open_connection(private_broker.url, name=name)
    channel = await confirming(connection)
    queue = await declare(channel, None, "blocked")
    blocked = asyncio.Event()
    connection.on_blocked.append(lambda reason: blocked.set())
    await private_broker.rabbitmqctl("eval", ALARM_ON)
    outcomes = Outcomes()
    channel.publish("", queue, b"first", encoded(), callback=outcomes.callback("first"))
    await asyncio.wait_for(blocked.wait(), 10)
    body = b"b" * 100_000
    for index in range(200):
        channel.publish("", queue, body, encoded(), callback=outcomes.callback(index))
    await asyncio.sleep(1)
    transport = connection._transport
    assert transport is not None
    print(f"\nunsent while blocked: {transport.get_write_buffer_size()} bytes")

    started = time.monotonic()
    await connection.close(timeout_s=2)
    assert time.monotonic() - started < 3.0
    error = await asyncio.wait_for(channel.closed, 5)
    assert isinstance(error, BrokerConnectionLost)
    await outcomes.wait(within=1)
    assert {outcomes.outcome(index) for index in range(200)} == {Outcome.CLOSED}

    assert transport.get_extra_info("socket").fileno() == -1, "the socket is still open"


async def test_a_broker_close_is_connection_lost_with_320(private_broker: PrivateBroker) -> None:
    """``rabbitmqctl close_connection``: ``connection.closed`` resolves with
    BrokerConnectionLost carrying 320 CONNECTION_FORCED and the operator's text; the
    channels and in-flight publishes are settled with it."""
    name = f"test-amqp-forced-{uuid.uuid4().hex[:8]}"
    connection = await open_connection(private_broker.url, name=name)
    channel = await confirming(connection)
    queue = await declare(channel, None, "forced")
    await private_broker.rabbitmqctl("eval", ALARM_ON)  # so the publish stays in flight
    outcomes = Outcomes()
    channel.publish("", queue, b"x", encoded(), callback=outcomes.callback(0))
    for index in range(1, 201):  # 20 MB the blocked broker does not read
        channel.publish("", queue, b"b" * 100_000, encoded(), callback=outcomes.callback(index))
    await connection_row(private_broker.rabbitmqctl, name)  # the node's only connection
    # The JSON formatter shows pids as #PID<...>, which close_connection does not take
    pids = await private_broker.rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid")
    (pid,) = pids.split()
    await private_broker.rabbitmqctl("close_connection", pid, "maintenance now")

    error = await asyncio.wait_for(connection.closed, 10)
    assert isinstance(error, BrokerConnectionLost)
    assert error.reply_code == 320
    assert "CONNECTION_FORCED" in error.reply_text
    assert "maintenance now" in error.reply_text
    assert "320" in str(error)
    started = time.monotonic()
    assert await asyncio.wait_for(channel.closed, 10) is error
    print(f"\nchannel closed {time.monotonic() - started:.1f} s after the connection")
    await outcomes.wait(within=1)
    assert {outcomes.outcome(index) for index in range(201)} == {Outcome.CLOSED}
    assert outcomes.detail(0) is error
