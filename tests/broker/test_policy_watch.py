"""The policy watch without a management API, and the management client's answers: the
relay and the commands say the policies are unchecked, never that they are fine.

The F28 cases, with the management plugin on private nodes, are in
faults/test_policies.py (slow).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import aio_pika
import pytest
from pamqp import commands
from support import Cleanup, Relays, hopsched_cli, until
from support.proxy import BrokerProxy

import hopsched
from hopsched.amqp import channel as amqp_channel
from hopsched.amqp.wire import method_frame
from hopsched.broker import idle_consumers
from hopsched.broker.idle_consumers import IdleConsumers, takes_credit
from hopsched.broker.management import ManagementClient, management_urls
from hopsched.broker.objects import declare_topology
from hopsched.broker.policy_watch import UNCHECKED_TOUCH_INTERVAL_S, PolicyWatch, warn_on_risk
from hopsched.connect import Connector
from hopsched.errors import ManagementAPIError
from hopsched.testing.localbroker import free_port

CLOSED = f"http://127.0.0.1:{free_port()}/"  # nothing listens there


async def unchecked_relay(
    relays: Relays, make_settings: Callable[..., hopsched.Settings]
) -> hopsched.Relay:
    """A relay with no management API to read, once its watch has found so."""
    relay = await relays.start(make_settings(management_url=CLOSED))
    for _ in range(100):
        if relay.stats.policy_unchecked:
            break
        await asyncio.sleep(0.1)
    assert relay.stats.policy_unchecked == 1
    return relay


async def test_a_relay_without_the_management_api_says_the_policies_are_unchecked(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="hopsched.policies")
    relay = await unchecked_relay(relays, make_settings)
    assert relay.stats.snapshot().policy_unchecked == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "hopsched.policies"]
    assert line.startswith(f"cannot read the policies in force on prefix {relay.settings.prefix}'s")
    assert "give user 'guest' the tag management, or set HOPSCHED_MANAGEMENT_URL" in line
    assert "Connection refused" in line


async def test_a_stopped_relay_leaves_no_watch_running(
    make_settings: Callable[..., hopsched.Settings], relays: Relays
) -> None:
    """Without the API the watch keeps a connection open for its touches. Once the relay's
    run() has returned, no task of the watch is left (each closed that connection as it
    ended): one left cancelled but running closed it only when the event loop closed,
    and uvloop's close waited on it forever (a CI run)."""
    relay = await unchecked_relay(relays, make_settings)
    watch_tasks = [
        task
        for task in asyncio.all_tasks()
        if "_watch_policies" in repr(task.get_coro())
        or "_keep_queues_in_use" in repr(task.get_coro())
    ]
    assert watch_tasks, "the relay runs a policy watch"
    await relays.stop(relay)
    assert all(task.done() for task in watch_tasks), watch_tasks


async def test_without_the_management_api_the_watch_keeps_every_queue_an_expires_could_delete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not knowing the leases, it uses every queue but the streams (they ignore expires)
    and the relay and ingress queues (the relay consumes them), every
    UNCHECKED_TOUCH_INTERVAL_S."""
    settings = hopsched.Settings(prefix="w", management_url=CLOSED)
    topology = hopsched.Topology.from_settings(settings)
    now = [0.0]
    stats = hopsched.RelayStats()
    watch = PolicyWatch(settings, stats, clock=lambda: now[0])
    touched: list[str] = []

    async def touch(name: str) -> bool:
        touched.append(name)
        return True

    watch._touch = touch  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="hopsched.policies")

    assert await watch.keep_in_use() == watch._interval_s  # not checked yet: nothing
    assert touched == []
    await watch.check()
    assert stats.policy_unchecked == 1
    assert "meanwhile the relay keeps every queue in use, against an expires" in caplog.text
    assert await watch.keep_in_use() == UNCHECKED_TOUCH_INTERVAL_S
    assert touched == [*topology.step_queues, topology.parked_queue]
    touched.clear()
    now[0] = UNCHECKED_TOUCH_INTERVAL_S - 0.5
    assert await watch.keep_in_use() == pytest.approx(0.5)
    assert touched == []
    now[0] = UNCHECKED_TOUCH_INTERVAL_S
    await watch.keep_in_use()
    assert touched == [*topology.step_queues, topology.parked_queue]


async def test_without_a_broker_the_watch_tries_a_queue_a_round_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = hopsched.Settings(
        url=f"amqp://guest:guest@127.0.0.1:{free_port()}/",  # nothing listens there
        prefix="w",
        management_url=CLOSED,
        log_interval_s=60,
    )
    now = [0.0]
    watch = PolicyWatch(settings, hopsched.RelayStats(), clock=lambda: now[0])
    await watch.check()
    caplog.set_level(logging.WARNING, logger="hopsched.policies")
    caplog.clear()

    for now[0] in (0.0, UNCHECKED_TOUCH_INTERVAL_S):
        assert await watch.keep_in_use() == watch._interval_s

    (line,) = [r.getMessage() for r in caplog.records if r.name == "hopsched.policies"]
    assert line.startswith("could not keep queue w.step.16 in use (")
    assert watch._touched == {}  # all due again once the broker is back


async def test_a_touch_connection_the_broker_dropped_is_opened_again_without_an_error(
    settings: hopsched.Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """aio-pika calls a connection the broker dropped neither closed nor usable: a
    channel() on it raised RuntimeError, which a relay whose node stopped logged with its
    traceback every 2 s (seen by hand). The next round opens a new one and uses them all."""
    await declare_topology(settings)
    proxy = BrokerProxy(settings.url)
    async with proxy as url:
        now = [0.0]
        through = dataclasses.replace(settings, url=url, management_url=CLOSED)
        watch = PolicyWatch(through, hopsched.RelayStats(), clock=lambda: now[0])
        try:
            await watch.check()
            await watch.keep_in_use()
            assert set(watch._touched.values()) == {0.0}
            connection = watch._connection
            assert connection is not None
            await proxy.cut()
            await until(lambda: not connection.connected.is_set(), 10)
            caplog.clear()
            now[0] = UNCHECKED_TOUCH_INTERVAL_S
            assert await watch.keep_in_use() == UNCHECKED_TOUCH_INTERVAL_S
            assert set(watch._touched.values()) == {now[0]}  # every queue, used again
            said = [r for r in caplog.records if r.name.startswith("hopsched")]
            assert not [r for r in said if r.levelno >= logging.WARNING], caplog.text
        finally:
            await watch._close()


async def test_the_commands_without_the_management_api(settings: hopsched.Settings) -> None:
    await declare_topology(settings)
    env = {"HOPSCHED_MANAGEMENT_URL": CLOSED}

    status, out, err = await hopsched_cli("status", settings=settings, env=env)
    assert status == 0, (out, err)  # unchecked is not a risk found
    assert "policies: not checked: GET /api/queues/%2F?page=1" in out
    assert f"{CLOSED}: [Errno 111] Connection refused" in out

    status, out, err = await hopsched_cli("policies", "check", settings=settings, env=env)
    assert status == 1, (out, err)
    assert "Error: cannot read the policies in force: GET /api/" in err

    status, out, err = await hopsched_cli("policies", "protect", settings=settings, env=env)
    assert status == 1, (out, err)
    topology = hopsched.Topology.from_settings(settings)
    prefix = topology.prefix
    assert out.splitlines() == [
        "run these where you may set policies:",
        "  rabbitmqctl set_policy -p / --priority 1000 --apply-to queues "
        f"hopsched-protect.{prefix} '^{prefix}\\.(step\\.[0-9]+|relay|ingress|parked)$' "
        '\'{"overflow":"reject-publish"}\'',
        f"  rabbitmqctl set_policy -p / --priority 1000 --apply-to queues "
        f"hopsched-protect-stream.{prefix} '^{prefix}\\.cancelled$' '{{\"max-age\":\"4381367s\"}}'",
    ]
    assert "Error: the protective policies were not set: PUT /api/policies/%2F/" in err


class _Fake(http.server.BaseHTTPRequestHandler):
    """A management API that answers ``answers[path]`` (status, JSON)."""

    answers: ClassVar[dict[str, tuple[int, Any]]] = {}
    logins: ClassVar[list[str]] = []  # each request's Authorization header

    def do_GET(self) -> None:
        self.logins.append(self.headers.get("Authorization", ""))
        status, body = self.answers.get(self.path.split("?")[0], (404, {"error": "not found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_api() -> Iterator[tuple[str, type[_Fake]]]:
    handler = type("Handler", (_Fake,), {"answers": {}, "logins": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


async def test_a_derived_management_url_that_serves_another_broker_is_not_used(
    fake_api: tuple[str, type[_Fake]],
) -> None:
    """On one host, http://HOST:15672/ may be another broker's API (another AMQP port):
    its answers would be about other queues. The client checks the AMQP listeners."""
    address, handler = fake_api
    handler.answers["/api/overview"] = (200, {"listeners": [{"protocol": "amqp", "port": 5672}]})
    handler.answers["/api/queues/%2F"] = (200, [])
    settings = hopsched.Settings(url="amqp://guest:guest@127.0.0.1:5702/")
    client = ManagementClient(settings, [f"http://{address}/"])
    client._derived = True  # as if derived from the AMQP URL's host

    with pytest.raises(ManagementAPIError) as raised:
        await client.get("queues/%2F")

    assert "serves another broker (AMQP on port 5672, not 5702)" in str(raised.value)
    assert "HOPSCHED_MANAGEMENT_URL" in str(raised.value)
    handler.answers["/api/overview"] = (200, {"listeners": [{"protocol": "amqp", "port": 5702}]})
    assert await ManagementClient(settings, [f"http://{address}/"]).get("queues/%2F") == []


async def test_a_refused_login_names_the_tag_to_grant(fake_api: tuple[str, type[_Fake]]) -> None:
    address, handler = fake_api
    handler.answers["/api/queues/%2F"] = (401, {"error": "not_authorised"})
    settings = hopsched.Settings(
        url="amqp://sched:secret@127.0.0.1:5702/", management_url=f"http://{address}/"
    )

    with pytest.raises(ManagementAPIError) as raised:
        await ManagementClient(settings).get("queues/%2F")

    assert raised.value.status == 401
    text = str(raised.value)
    assert "user 'sched' needs the tag management to read, policymaker to set policies" in text
    assert "rabbitmqctl set_user_tags sched management policymaker" in text
    assert "secret" not in text


async def test_a_management_url_with_a_login_and_the_api_path_is_used_as_given(
    fake_api: tuple[str, type[_Fake]],
) -> None:
    """A new-user trial: http://USER:PASSWORD@HOST:PORT/ failed with "Name or service not
    known" (urllib took the login for the host), and .../api/ with HTTP 400."""
    address, handler = fake_api
    handler.answers["/api/queues/%2F"] = (200, [])
    settings = hopsched.Settings(
        url="amqp://sched:secret@127.0.0.1:5702/",
        management_url=f"http://monitor:m%40pw@{address}/api/",
    )

    assert await ManagementClient(settings).get("queues/%2F") == []

    assert handler.logins == ["Basic " + base64.b64encode(b"monitor:m@pw").decode()]
    handler.answers["/api/queues/%2F"] = (401, {"error": "not_authorised"})
    with pytest.raises(ManagementAPIError) as raised:
        await ManagementClient(settings).get("queues/%2F")
    assert "user 'monitor' needs the tag management" in str(raised.value)
    assert "m@pw" not in str(raised.value)
    assert "m%40pw" not in str(raised.value)


def test_a_producers_policy_check_ends_quietly_once_no_thread_takes_its_reads(
    fake_api: tuple[str, type[_Fake]],
) -> None:
    """A new-user trial: a short-lived Celery producer printed "Task exception was never
    retrieved ... RuntimeError: cannot schedule new futures after shutdown" one run in
    five: at exit, concurrent.futures refuses new work while the SyncScheduler's loop
    thread still runs the check. Here the loop's executor is shut down as at exit."""
    address, handler = fake_api
    handler.answers["/api/queues/%2F"] = (200, [])
    settings = hopsched.Settings(management_url=f"http://{address}/")

    async def exiting() -> None:
        executor = concurrent.futures.ThreadPoolExecutor(1)
        executor.shutdown()
        asyncio.get_running_loop().set_default_executor(executor)
        await asyncio.wait_for(warn_on_risk(settings), 5)  # returns: no RuntimeError

    asyncio.run(exiting())  # a loop of its own: the shut executor goes with it
    assert handler.logins == []  # no read was made


def test_the_management_urls_come_from_the_setting_or_the_node_hosts() -> None:
    cluster = hopsched.Settings(
        url=["amqp://u:p@rmq1/", "amqp://u:p@rmq2:5673/", "amqp://u:p@[::1]/"]
    )
    assert management_urls(cluster) == [
        "http://rmq1:15672/",
        "http://rmq2:15672/",
        "http://[::1]:15672/",
    ]
    given = hopsched.Settings(management_url="https://m1:443/, https://m2/")
    assert management_urls(given) == ["https://m1:443/", "https://m2/"]
    assert management_urls(given, "http://other/") == ["http://other/"]


def test_a_management_url_must_be_http() -> None:
    with pytest.raises(hopsched.InvalidSettingsError, match="management_url 'ftp://x/'"):
        hopsched.Settings(management_url="ftp://x/")
    shown = repr(hopsched.Settings(management_url="http://admin:hunter2@m:15672/"))
    assert "hunter2" not in shown


def _api_for(
    topology: hopsched.Topology, policies: list[dict[str, Any]]
) -> dict[str, tuple[int, Any]]:
    """A management API's answers for ``topology``'s queues and ``policies``."""
    items = [
        {"name": name, "type": arguments["x-queue-type"], "arguments": arguments}
        for name, arguments in topology.all_queues().items()
    ]
    return {
        "/api/queues/%2F": (200, {"items": items, "page_count": 1}),
        "/api/policies/%2F": (200, policies),
        "/api/operator-policies/%2F": (200, []),
        "/api/overview": (200, {"rabbitmq_version": "3.10.8"}),
    }


async def test_the_watch_says_a_risk_at_once_again_each_interval_and_when_it_is_gone(
    fake_api: tuple[str, type[_Fake]], caplog: pytest.LogCaptureFixture
) -> None:
    address, handler = fake_api
    settings = hopsched.Settings(prefix="w", management_url=f"http://{address}/", log_interval_s=60)
    topology = hopsched.Topology.from_settings(settings)
    blanket = {"name": "hygiene", "pattern": ".*", "apply-to": "queues", "priority": 0}
    handler.answers.update(
        _api_for(topology, [{**blanket, "definition": {"max-length": 1, "overflow": "drop-head"}}])
    )
    now = [0.0]
    stats = hopsched.RelayStats()
    watch = PolicyWatch(settings, stats, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="hopsched.policies")

    def said() -> list[tuple[int, str]]:
        lines = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        return lines

    await watch.check()
    first = said()
    assert [level for level, _ in first] == [logging.ERROR] * 3  # steps, relay, parked
    assert all(
        line.startswith("loss possible: policy 'hygiene' sets max-length=1") for _, line in first
    )
    assert stats.policy_risks == {"loss": 3, "stall": 0, "hops": 0}

    now[0] = 59.0
    await watch.check()
    assert said() == []  # said once per log interval
    now[0] = 60.0
    await watch.check()
    assert said() == first  # ... and again while it stands

    handler.answers["/api/policies/%2F"] = (
        200,
        [{**blanket, "definition": {"queue-mode": "lazy"}}],
    )
    await watch.check()
    gone = said()
    assert [level for level, _ in gone] == [logging.INFO] * 4
    assert all(
        line.startswith("no longer in force: loss possible: policy 'hygiene'")
        for _, line in gone[:3]
    )
    assert gone[3][1].startswith("prefix w's queues are not protected from user policies")
    assert stats.policy_risks == {"loss": 0, "stall": 0, "hops": 0}
    assert watch.report is not None
    assert watch.report.expires_ms == {}


async def test_a_consumer_without_credit_keeps_a_quorum_queue_in_use_and_takes_nothing(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    cleanup: Cleanup,
) -> None:
    """RabbitMQ 3.x: a queue with an ``expires`` of 3 s outlives it three times over under
    the consumer, and its messages are dead-lettered by their TTL, never to it (a
    ``basic.get`` returned head came back up to 8 s late on 3.10.8). RabbitMQ 4.x
    ignores ``x-credit``: ``keep`` says so and attaches nothing (the watch then uses
    ``basic.get``, whose returned heads 4.0.5 expires on time)."""
    queue, dead = f"{settings.prefix}.kept", f"{settings.prefix}.dead"
    cleanup.queues.update({queue, dead})
    channel = await amqp.channel()
    await channel.declare_queue(dead, durable=True, arguments={"x-queue-type": "quorum"})
    arguments = {"x-queue-type": "quorum", "x-expires": 3000, "x-message-ttl": 1000}
    arguments |= {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    await channel.declare_queue(queue, durable=True, arguments=arguments)
    connection = await Connector(settings, name="hopsched-test").connect()
    credit = takes_credit(connection.server_properties)
    await connection.close()

    consumers = IdleConsumers(settings)
    try:
        assert await consumers.keep(queue) is credit
        if not credit:
            assert consumers.kept == frozenset()
            return
        sent = {}
        for index in range(5):
            sent[b"%d" % index] = time.monotonic()
            await channel.default_exchange.publish(aio_pika.Message(b"%d" % index), queue)
        dead_lettered: dict[bytes, float] = {}
        async with (await channel.get_queue(dead)).iterator() as messages:
            async for message in messages:
                dead_lettered[message.body] = time.monotonic()
                await message.ack()
                if len(dead_lettered) == len(sent):
                    break
        assert all(dead_lettered[body] - sent[body] >= 0.99 for body in sent)  # by TTL
        await asyncio.sleep(9.0 - (time.monotonic() - min(sent.values())))
        await channel.declare_queue(queue, passive=True)  # still there: 404 if deleted
        assert consumers.kept == frozenset({queue})
    finally:
        await consumers.close()
    # Closed: no consumer left on it (a teardown right after a relay stopped counts them),
    # also when the close comes while a consume is under way (a relay stopping mid-round).
    assert (await channel.declare_queue(queue, passive=True)).declaration_result.consumer_count == 0
    assert await consumers.keep(dead)  # the connection and channel open again
    keeping = asyncio.ensure_future(consumers.keep(queue))
    await asyncio.sleep(0)  # the consume sent, its consume-ok not read yet
    keeping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await keeping
    assert consumers.kept == frozenset({queue, dead})
    await consumers.close()
    for name in (queue, dead):
        declared = await channel.declare_queue(name, passive=True)
        assert declared.declaration_result.consumer_count == 0


async def test_a_broker_that_delivers_to_a_consumer_without_credit_gets_it_back_and_no_more(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    cleanup: Cleanup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker that ignores the credit (a plain ``basic.consume`` here, as RabbitMQ 4.x
    reads the one with ``x-credit``; 3.10.8 closes the connection for a credit above 0,
    INTERNAL_ERROR): the message is returned to its queue, not held or lost, the
    consumers go, and the watch keeps the queues in use by ``basic.get`` from then on."""
    queue = f"{settings.prefix}.kept"
    cleanup.queues.add(queue)
    channel = await amqp.channel()
    await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
    await channel.default_exchange.publish(aio_pika.Message(b"head"), queue)

    def ignored_credit(number: int, queue: str, tag: str, credit: int) -> bytes:
        return method_frame(number, commands.Basic.Consume(queue=queue, consumer_tag=tag))

    monkeypatch.setattr(amqp_channel, "credit_consume_frame", ignored_credit)
    monkeypatch.setattr(idle_consumers, "takes_credit", lambda properties: True)
    caplog.set_level(logging.WARNING, logger="hopsched.policies")
    consumers = IdleConsumers(settings)
    try:
        await consumers.keep(queue)  # True, or False if the message came before consume-ok
        await until(lambda: not consumers.kept, within=30)
        assert not await consumers.keep(queue)
    finally:
        await consumers.close()
    # Back in its queue: the consumers' return reaches a quorum queue's leader in its
    # own time, maybe after a basic.get sent once they closed (a CI run of 4.0 got
    # GetEmpty there), so the get is tried again until the message is there.
    kept = await channel.get_queue(queue)
    got = None
    async with asyncio.timeout(10):
        while got is None:
            got = await kept.get(timeout=10, fail=False)
            if got is None:
                await asyncio.sleep(0.05)
    assert got.body == b"head"
    await got.ack()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "hopsched.policies"]
    assert line.startswith("the broker delivered to a consumer given no credit")
