"""Connection failures are clear errors, and no password ever reaches an error or a log."""

from __future__ import annotations

import asyncio
import logging
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit, urlunsplit

import pytest
from support import Relays, Targets, rabbitmqctl, rabbitmqctl_path, unique

import hopsched
import hopsched.connect

PASSWORD = "s3cretPW"


def with_login(url: str, user: str, password: str, port: int | None = None) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{password}@{host}:{port if port is not None else parts.port or 5672}"
    return urlunsplit(parts._replace(netloc=netloc))


def everything_said(error: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    """The error as str, repr and traceback, plus every captured log line and traceback."""
    records = [f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records]
    return "\n".join(
        [str(error), repr(error), *traceback.format_exception(error), caplog.text, *records]
    )


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(lambda url: with_login(url, "guest", PASSWORD), id="wrong-password"),
        pytest.param(lambda url: with_login(url, "guest", PASSWORD, port=1), id="closed-port"),
    ],
)
@pytest.mark.parametrize("client", ["scheduler", "relay"])
async def test_connection_errors_mask_the_password(
    broker_url: str,
    prefix: str,
    case: Callable[[str], str],
    client: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = hopsched.Settings(url=case(broker_url), prefix=prefix)

    async def connect() -> None:
        if client == "relay":
            await hopsched.Relay(settings).run()
            return
        async with hopsched.Scheduler(settings):
            pytest.fail("connected with a wrong password or to a closed port")

    with pytest.raises(hopsched.BrokerUnavailableError) as caught:
        await connect()
    error = caught.value
    print(f"\n{client}: {error}")
    assert isinstance(error, ConnectionError)
    assert PASSWORD not in everything_said(error, caplog)
    assert settings.masked_url in str(error)


@pytest.fixture
async def login_url(broker_url: str) -> AsyncIterator[tuple[str, str]]:
    """(url, password): a throw-away broker user whose password appears nowhere else.

    Without rabbitmqctl (a remote broker), the test URL itself; its password must then
    differ from the user name for the check to mean anything.
    """
    if rabbitmqctl_path() is None:
        password = urlsplit(broker_url).password or ""
        yield broker_url, password
        return
    user, password = unique(), f"pw{uuid.uuid4().hex}"
    await rabbitmqctl("add_user", user, password)
    try:
        await rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        yield with_login(broker_url, user, password), password
    finally:
        await rabbitmqctl("delete_user", user)


async def test_relay_and_scheduler_logs_never_show_the_password(
    login_url: tuple[str, str],
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url, password = login_url
    settings = make_settings(url=url, log_interval_s=0.2)
    relay = await relays.start(settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduler.schedule(b"logged", delay=0.1, routing_key=target.name)
        await scheduler.schedule(b"parked", delay=0.0, exchange="", routing_key="no.such.q")
    await target.wait_for(1, within=30)
    await relays.stop(relay)
    assert relay.totals.parked == 1
    text = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert settings.masked_url in text, "the relay's start line was not captured"
    assert "since start: delivered=1" in text
    if password and password != urlsplit(url).username:
        assert password not in text
    assert f":{password}@" not in text


async def test_closed_port_error_says_the_broker_is_unreachable(
    broker_url: str, prefix: str
) -> None:
    """Nothing listening is not a vhost or permission problem: the hint must say so."""
    settings = hopsched.Settings(
        url=with_login(broker_url, "guest", PASSWORD, port=1), prefix=prefix
    )
    with pytest.raises(hopsched.BrokerUnavailableError) as caught:
        async with hopsched.Scheduler(settings):
            pytest.fail("connected to port 1")
    text = str(caught.value)
    assert "cannot reach the broker" in text, text
    assert "vhost" not in text, text
    assert "permissions" not in text, text


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A TCP port that accepts connections and never says a word (not AMQP)."""
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_a_silent_endpoint_times_out_with_a_clear_error(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hopsched.connect, "CONNECT_TIMEOUT_S", 1.0)
    settings = hopsched.Settings(url=f"amqp://guest:{PASSWORD}@127.0.0.1:{silent_port}/")

    with pytest.raises(hopsched.BrokerUnavailableError, match="no AMQP handshake") as caught:
        await asyncio.wait_for(hopsched.connect.connect(settings), 10)

    assert PASSWORD not in str(caught.value)


async def test_a_peer_that_takes_tcp_but_never_speaks_is_not_blamed_on_the_port_alone(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a new-user trial (and F38): "is this RabbitMQ's AMQP port?" for a broker
    that accepted the connection but could not serve it (out of file descriptors)."""
    url = f"amqp://guest:{PASSWORD}@127.0.0.1:{silent_port}/"
    with pytest.raises(hopsched.BrokerUnavailableError) as lean:
        await hopsched.amqp.connect(hopsched.amqp.ConnectionParams.from_url(url), timeout_s=0.5)
    monkeypatch.setattr(hopsched.connect, "CONNECT_TIMEOUT_S", 0.5)
    with pytest.raises(hopsched.BrokerUnavailableError) as pika:
        await hopsched.connect.connect(hopsched.Settings(url=url))

    for error in (lean.value, pika.value):
        text = str(error)
        assert "took the TCP connection but sent no AMQP handshake within 0.5 s" in text
        assert "frozen, overloaded or out of file descriptors" in text
        assert PASSWORD not in text


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    """A TCP port that answers like an HTTP server (the management API's port, say) and
    closes the connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(8)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_a_peer_that_speaks_something_else_is_named_as_not_amqp(http_port: int) -> None:
    """Found by a new-user trial: ``hopsched status`` on an HTTP port said the broker
    closed the connection and to check the vhost and the user's permissions."""
    url = f"amqp://guest:{PASSWORD}@127.0.0.1:{http_port}/"

    with pytest.raises(hopsched.BrokerUnavailableError) as caught:
        await hopsched.connect.connect(hopsched.Settings(url=url))

    text = str(caught.value)
    assert "answered with something that is not AMQP" in text, text
    assert "AMQP port" in text
    assert "vhost" not in text
    assert "permissions" not in text
    assert PASSWORD not in text


async def test_relay_stops_at_once_while_still_connecting(silent_port: int) -> None:
    relay = hopsched.Relay(hopsched.Settings(url=f"amqp://guest:guest@127.0.0.1:{silent_port}/"))
    running = asyncio.create_task(relay.run())
    await asyncio.sleep(0.3)  # inside the AMQP handshake that never completes

    await relay.stop()

    async with asyncio.timeout(2):
        await running


async def test_a_user_without_configure_permission_gets_one_clear_error(
    broker_url: str, make_settings: Callable[..., hopsched.Settings]
) -> None:
    if rabbitmqctl_path() is None:
        pytest.fail("rabbitmqctl is needed to create a user with limited permissions")
    user, password = unique(), f"pw{uuid.uuid4().hex}"
    await rabbitmqctl("add_user", user, password)
    try:
        await rabbitmqctl("set_permissions", "-p", "/", user, "^$", ".*", ".*")
        settings = make_settings(url=with_login(broker_url, user, password))
        with pytest.raises(hopsched.AccessRefusedError) as caught:
            await hopsched.Relay(settings).run()
    finally:
        await rabbitmqctl("delete_user", user)

    text = str(caught.value)
    assert "ACCESS_REFUSED" in text
    assert "configure" in text
    assert settings.prefix in text
    assert password not in text


async def test_a_connector_walks_the_url_list_past_a_node_that_refuses(
    broker_url: str, prefix: str
) -> None:
    """Node 0 refuses (nothing listens on port 1): one attempt goes on to the next URL;
    the following attempt starts after the one that answered."""
    dead = with_login(broker_url, "guest", "guest", port=1)
    settings = hopsched.Settings(url=[dead, broker_url], prefix=prefix)
    connector = hopsched.connect.Connector(settings, name="test-walk", start=0)
    connection = await connector.connect()
    try:
        assert connector.node == hopsched.connect.node_of(broker_url)
    finally:
        await connection.close()
    only_dead = hopsched.connect.Connector(
        hopsched.Settings(url=[dead, dead.replace(":1/", ":2/")], prefix=prefix), name="t"
    )
    with pytest.raises(hopsched.BrokerUnavailableError, match="no node answers") as caught:
        await only_dead.connect()
    assert "guest:guest" not in str(caught.value)


async def test_a_scheduler_on_a_node_declares_there_not_on_a_silent_first_url(
    silent_port: int, make_settings: Callable[..., hopsched.Settings]
) -> None:
    """Found by a new-user trial: the topology's own connection walked the URL list
    from its start, so a first node cut off (silent) cost a 10 s time-out on every
    start, although the scheduler itself was on another node."""
    good = make_settings().url
    settings = make_settings(url=f"amqp://guest:guest@127.0.0.1:{silent_port}/,{good}")

    started = asyncio.get_running_loop().time()
    async with hopsched.Scheduler(settings, first_url=1, declare=True) as scheduler:
        await scheduler.schedule(b"x", delay=3600, routing_key="nowhere")
        assert scheduler.node is not None
    assert asyncio.get_running_loop().time() - started < hopsched.connect.CONNECT_TIMEOUT_S / 2


async def test_wait_consuming_raises_the_error_that_ended_the_relay(broker_url: str) -> None:
    """Found by a new-user trial: with a wrong password run() failed and
    wait_consuming() waited for ever (the example hung)."""
    relay = hopsched.Relay(hopsched.Settings(url=with_login(broker_url, "guest", PASSWORD)))
    running = asyncio.create_task(relay.run())

    with pytest.raises(hopsched.BrokerUnavailableError, match="login refused"):
        await asyncio.wait_for(relay.wait_consuming(), 30)
    with pytest.raises(hopsched.BrokerUnavailableError):
        await running


async def test_amqps_to_the_plain_amqp_port_says_the_port_speaks_no_tls(broker_url: str) -> None:
    """Found by a new-user trial: ``amqps://`` to the broker's plain AMQP port said "TLS
    handshake failed" and to check cafile, certificates and no_verify_ssl (given
    already). RabbitMQ answers a TLS hello there with its AMQP header, which OpenSSL
    reads as a wrong version: the error now names the port and the scheme."""
    plain = with_login(broker_url, "guest", PASSWORD)
    url = urlunsplit(urlsplit(plain)._replace(scheme="amqps", query="no_verify_ssl=1"))
    settings = hopsched.Settings(url=url)
    with pytest.raises(hopsched.BrokerUnavailableError) as lean:
        await hopsched.connect.Connector(settings, name="test").connect()
    with pytest.raises(hopsched.BrokerUnavailableError) as pika:
        await hopsched.connect.connect(settings)

    for error in (lean.value, pika.value):
        text = str(error)
        assert "does not speak TLS" in text
        assert "plain AMQP port" in text
        assert "amqp://" in text
        assert "cafile" not in text
        assert PASSWORD not in text
