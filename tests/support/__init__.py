"""Helpers for the integration tests that run against a real RabbitMQ broker.

Imported by ``conftest.py`` (which wires them into fixtures) and by the test modules.
Nothing here knows hopsched internals beyond its public names and header names.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import statistics
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

import hopsched
from hopsched.core.clock import now_us
from hopsched.testing.localbroker import run_bounded

HEADER_ID = "x-hopsched-id"
HEADER_DUE = "x-hopsched-due"
HEADER_HOPS = "x-hopsched-hops"
HEADER_EXCHANGE = "x-hopsched-exchange"
HEADER_ROUTING_KEY = "x-hopsched-routing-key"
HEADER_PARKED_REASON = "x-hopsched-parked-reason"
#: This run's marker. Every name a test gives a broker object carries it (``unique()``,
#: the ``prefix`` fixture): the end-of-run check removes only what carries it, on a broker
#: others may be using at the same time (``leftovers.py``). Made once by the first process
#: of a run; its xdist workers and the processes its tests start inherit it.
RUN_MARKER = os.environ.setdefault("HOPSCHED_TEST_RUN", f"ht{uuid.uuid4().hex[:8]}")
#: The broker the integration tests run against (``HOPSCHED_TEST_URL``).
BROKER_URL = os.environ.get("HOPSCHED_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")
RELAY_START_TIMEOUT_S = 30.0
RELAY_STOP_TIMEOUT_S = 30.0
#: What a target consumer may see added to the caller's headers.
ADDED_ON_DELIVERY = frozenset({HEADER_ID, HEADER_DUE, HEADER_HOPS})


async def until(condition: Callable[[], bool], within: float) -> None:
    """Wait (polling a relay's counters: they signal nothing) until ``condition()``."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def unique(what: str = "") -> str:
    """A fresh name carrying the run's marker: ``RUN_MARKER``, 8 hex digits, then
    ``.what`` when given (``ht1a2b3c4d5e6f7a8b.target``). Valid as a hopsched prefix."""
    name = f"{RUN_MARKER}{uuid.uuid4().hex[:8]}"
    return f"{name}.{what}" if what else name


def broker_death_headers(headers: Mapping[str, Any]) -> list[str]:
    """The broker's dead-letter bookkeeping headers present in ``headers``."""
    return sorted(
        name
        for name in headers
        if name == "x-death"
        or name.startswith("x-first-death-")
        or name.startswith("x-last-death-")
    )


@dataclass(frozen=True)
class Received:
    """One message a test consumer got, and the wall-clock instant it got it."""

    delivery: DeliveredMessage
    received_us: int

    @property
    def body(self) -> bytes:
        return self.delivery.body

    @property
    def properties(self) -> Basic.Properties:
        """The basic properties exactly as decoded from the wire (no client defaults)."""
        return self.delivery.header.properties

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    @property
    def schedule_id(self) -> str:
        value = self.headers[HEADER_ID]
        assert isinstance(value, str), value
        return value

    @property
    def due_us(self) -> int:
        value = self.headers[HEADER_DUE]
        assert type(value) is int, f"{HEADER_DUE} is {type(value).__name__} {value!r}"
        return value

    @property
    def lateness_us(self) -> int:
        return self.received_us - self.due_us


class Collector:
    """Consumes one queue, recording each message with its receive time (µs)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[Received] = []
        self._arrived = asyncio.Event()

    async def on_message(self, delivery: DeliveredMessage) -> None:
        self.received.append(Received(delivery, now_us()))
        self._arrived.set()

    def __len__(self) -> int:
        return len(self.received)

    async def wait_for(self, count: int, within: float) -> list[Received]:
        """Wait until at least ``count`` messages arrived; fail the test after ``within`` s."""
        try:
            async with asyncio.timeout(within):
                while len(self.received) < count:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            pytest.fail(
                f"queue {self.name}: {len(self.received)} of {count} messages after {within} s"
            )
        return self.received

    async def wait_for_ids(self, ids: Iterable[str], within: float) -> list[Received]:
        """Wait until every schedule id in ``ids`` arrived at least once."""
        wanted = set(ids)
        try:
            async with asyncio.timeout(within):
                while missing := wanted - {r.schedule_id for r in self.received}:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            pytest.fail(
                f"queue {self.name}: {len(missing)} of {len(wanted)} schedule ids missing "
                f"after {within} s"
            )
        return self.received

    async def settle(self, quiet_s: float = 0.5) -> list[Received]:
        """Wait until nothing new arrived for ``quiet_s`` s (to catch late duplicates)."""
        while True:
            seen = len(self.received)
            await asyncio.sleep(quiet_s)
            if len(self.received) == seen:
                return self.received

    def counts(self) -> Counter[str]:
        """Deliveries per schedule id."""
        return Counter(r.schedule_id for r in self.received)

    def assert_never_early(self) -> None:
        early = [(r.schedule_id, r.lateness_us / 1000) for r in self.received if r.lateness_us < 0]
        assert not early, f"{len(early)} message(s) delivered early (id, ms): {early[:10]}"

    def assert_no_broker_death_headers(self) -> None:
        found = {r.schedule_id: broker_death_headers(r.headers) for r in self.received}
        found = {k: v for k, v in found.items() if v}
        assert not found, f"dead-letter headers left the relay: {found}"

    def lateness_line(self) -> str:
        return lateness_line(r.lateness_us for r in self.received)


def lateness_line(values_us: Iterable[int]) -> str:
    """``n=… min/p50/p99/max …`` in ms, for printing (timing goals are not asserted)."""
    values = sorted(values_us)
    if not values:
        return "lateness: no messages"
    ms = [v / 1000 for v in values]
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return (
        f"lateness n={len(ms)} min={ms[0]:.2f} p50={statistics.median(ms):.2f} "
        f"p99={p99:.2f} max={ms[-1]:.2f} ms"
    )


async def schedule_all(
    scheduler: hopsched.Scheduler, calls: list[dict[str, Any]], concurrency: int = 200
) -> list[hopsched.Scheduled]:
    """``scheduler.schedule(**call)`` for every call, ``concurrency`` at a time, in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(call: dict[str, Any]) -> hopsched.Scheduled:
        async with gate:
            return await scheduler.schedule(**call)

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def message_count(connection: aio_pika.abc.AbstractConnection, queue: str) -> int:
    """Ready messages in ``queue`` (passive declare)."""
    async with connection.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        count = declared.declaration_result.message_count
        assert count is not None
        return count


async def wait_until_count(
    connection: aio_pika.abc.AbstractConnection,
    queue: str,
    count: int,
    within: float,
    *,
    at_least: bool = False,
) -> int:
    """Poll ``queue`` until it holds ``count`` (or ``at_least`` that many) ready messages;
    fail after ``within`` s."""
    current = -1

    def reached(current: int) -> bool:
        return current >= count if at_least else current == count

    try:
        async with asyncio.timeout(within):
            # The broker signals no event for a queue's depth: polling is the only way.
            while not reached(current := await message_count(connection, queue)):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"queue {queue}: {current} messages, expected {count} after {within} s")
    return current


async def publish_raw(
    connection: aio_pika.abc.AbstractConnection,
    settings: hopsched.Settings,
    schedule_id: str,
    due: Any,
    target: str,
    **extra: Any,
) -> None:
    """docs/envelope.md's raw producer recipe, the headers written by hand (no hopsched
    code): ``schedule_id`` due at ``due`` (meant as µs since the epoch) for the queue
    ``target``; ``extra`` adds or replaces headers."""
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    async with channel:
        message = aio_pika.Message(
            schedule_id.encode(),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers={
                "x-hopsched-version": 1,
                "x-hopsched-id": schedule_id,
                "x-hopsched-due": due,
                "x-hopsched-hops": 0,
                "x-hopsched-exchange": "",
                "x-hopsched-routing-key": target,
                "x-hopsched-created": now_us(),
                **extra,
            },
        )
        expired = await channel.get_exchange(f"{settings.prefix}.expired", ensure=False)
        await expired.publish(message, routing_key="expired", mandatory=True)


def broker_version(connection: aio_pika.abc.AbstractConnection) -> tuple[int, ...]:
    """The RabbitMQ version a connection's broker gave in ``connection.start``, e.g.
    ``(4, 0, 5)``."""
    underlay = connection.transport.connection  # type: ignore[attr-defined]
    version = underlay.server_properties["version"]
    text = version.decode() if isinstance(version, bytes) else str(version)
    return tuple(int(part) for part in text.split("-")[0].split("."))


async def get_all(
    connection: aio_pika.abc.AbstractConnection, queue: str
) -> list[AbstractIncomingMessage]:
    """``basic.get`` every ready message of ``queue`` (acked), in queue order."""
    got: list[AbstractIncomingMessage] = []
    async with connection.channel() as channel:
        declared = await channel.get_queue(queue, ensure=False)
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            got.append(message)
    return got


#: A command prefix that runs ``rabbitmqctl`` against the broker at ``HOPSCHED_TEST_URL``
#: (e.g. ``rabbitmqctl -n rmq4@localhost``, or one inside a chroot); default: the
#: ``rabbitmqctl`` on PATH, which reaches the local node.
RABBITMQCTL_VARIABLE = "HOPSCHED_TEST_RABBITMQCTL"


def rabbitmqctl_command() -> list[str] | None:
    """The command that runs ``rabbitmqctl`` against the test broker, or None."""
    configured = os.environ.get(RABBITMQCTL_VARIABLE, "").strip()
    if configured:
        return shlex.split(configured)
    path = shutil.which("rabbitmqctl")
    return [path] if path is not None else None


def missing(reason: str) -> NoReturn:
    """Skip the test for want of ``reason``'s tool; under ``CI=true`` fail it: CI must
    run every test."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run this test", pytrace=False)
    pytest.skip(reason)


def require_rabbitmqctl() -> list[str]:
    """The test broker's ``rabbitmqctl`` command; ``missing()`` without one."""
    command = rabbitmqctl_command()
    if command is not None:
        return command
    missing(f"no rabbitmqctl for the test broker (set {RABBITMQCTL_VARIABLE})")


def rabbitmqctl_path() -> str | None:
    """The test broker's ``rabbitmqctl`` command as one string, or None if there is none."""
    command = rabbitmqctl_command()
    return shlex.join(command) if command is not None else None


async def rabbitmqctl(*args: str, within: float = 60) -> str:
    """Run ``rabbitmqctl args…`` against the test broker (``HOPSCHED_TEST_RABBITMQCTL``)
    and return its stdout; fail the test on a non-zero exit. (A private node has
    ``PrivateBroker.rabbitmqctl``.)"""
    command = rabbitmqctl_command()
    assert command is not None
    try:
        status, out, err = await run_bounded([*command, *args], within=within)
    except TimeoutError:
        pytest.fail(f"rabbitmqctl {' '.join(args)} did not finish in {within} s")
    if status != 0:
        pytest.fail(f"rabbitmqctl {' '.join(args)} exited {status}: {err}")
    return out


async def management_url() -> str | None:
    """The test broker's management API base URL with the test URL's login (e.g.
    ``http://guest:guest@127.0.0.1:15672/``), from the HTTP listener ``rabbitmqctl
    status`` lists; None without the management plugin. Only ``HOPSCHED_TEST_URL`` and
    ``HOPSCHED_TEST_RABBITMQCTL`` are needed to find it."""
    status = json.loads(await rabbitmqctl("status", "--formatter", "json"))
    ports = [listener["port"] for listener in status["listeners"] if listener["protocol"] == "http"]
    if not ports:
        return None
    parts = urlsplit(BROKER_URL)
    login = parts.netloc.rpartition("@")[0]
    return f"http://{login}@{parts.hostname}:{ports[0]}/"


async def queue_arguments(vhost: str = "/") -> dict[str, dict[str, tuple[str, Any]]]:
    """Every queue's arguments as the broker stores them: name -> {arg: (amqp type, value)}."""
    out = await rabbitmqctl(
        "list_queues", "-q", "-p", vhost, "name", "arguments", "--formatter", "json"
    )
    return {
        row["name"]: {name: (kind, value) for name, kind, value in row["arguments"]}
        for row in json.loads(out)
    }


async def explain_missing(
    settings: hopsched.Settings, target: Collector, wanted: Iterable[str], relays: Relays
) -> None:
    """Print where ids not yet delivered may be, for a failure's report (asserts nothing):
    the ids, every queue of the prefix with its counts (``messages_dlx``: dead-letters a
    quorum step's at-least-once worker still holds, where ``list_queues`` has the column),
    and each running relay's held, in-flight and parked messages and counters."""
    missing = sorted(set(wanted) - set(target.counts()))
    print(f"\nmissing {len(missing)}: {missing[:10]}")
    rabbitmqctl = rabbitmqctl_command()
    if rabbitmqctl is not None:
        columns = ["name", "messages", "messages_ready", "messages_unacknowledged", "consumers"]
        for extra in (["messages_dlx"], []):
            command = [*rabbitmqctl, "list_queues", "-q", *columns, *extra]
            status, out, err = await run_bounded(command, within=60)
            if status == 0:
                print("\n".join(line for line in out.splitlines() if settings.prefix in line))
                break
            print(f"list_queues {extra}: exit {status}: {err.strip().splitlines()[:1]}")
    for relay in relays.tasks:
        now = relay.stats.snapshot()
        parked = {kind.value: n for kind, n in now.parked_by_kind.items() if n}
        print(
            f"relay {relay.settings.prefix}: held {now.held}, in flight {now.in_flight}, "
            f"parked {parked}, {now.counters}"
        )


class Cleanup:
    """Names to delete after the test: queues and exchanges, including a whole topology."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queues: set[str] = set()
        self.exchanges: set[str] = set()

    def topology(self, settings: hopsched.Settings) -> None:
        topology = hopsched.Topology.from_settings(settings)
        self.queues.update(topology.all_queues())
        self.exchanges.add(topology.expired_exchange)

    async def run(self) -> list[str]:
        """Delete everything registered; return what could not be deleted."""
        problems: list[str] = []
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel()
            for kind, names in (("queue", self.queues), ("exchange", self.exchanges)):
                for name in sorted(names):
                    try:
                        if kind == "queue":
                            await channel.queue_delete(name)
                        else:
                            await channel.exchange_delete(name)
                    except Exception as error:
                        problems.append(f"{kind} {name}: {error!r}")
                        if channel.is_closed:
                            channel = await connection.channel()
        finally:
            await connection.close()
        return problems


class Targets:
    """Declares target queues/exchanges (cleaned up after) and consumes them."""

    def __init__(self, connection: aio_pika.abc.AbstractConnection, cleanup: Cleanup) -> None:
        self._connection = connection
        self._cleanup = cleanup
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def channel(self) -> aio_pika.abc.AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._connection.channel()
        return self._channel

    def name(self, what: str = "target") -> str:
        return unique(what)

    async def queue(
        self,
        name: str | None = None,
        *,
        arguments: dict[str, Any] | None = None,
        consume: bool = True,
    ) -> Collector:
        """Declare a durable classic queue; with ``consume``, collect what arrives."""
        name = name or self.name()
        self._cleanup.queues.add(name)
        channel = await self.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments)
        collector = Collector(name)
        if consume:
            await self._consume(collector)
        return collector

    async def _consume(self, collector: Collector) -> None:
        """Consume with aiormq directly: the raw properties, no aio-pika defaults filled in."""
        channel = await (await self.channel()).get_underlay_channel()
        await channel.basic_consume(collector.name, collector.on_message, no_ack=True)

    async def consume(self, name: str) -> Collector:
        """Collect what arrives on an existing queue (e.g. ``{prefix}.parked``)."""
        channel = await self.channel()
        await channel.get_queue(name, ensure=True)
        collector = Collector(name)
        await self._consume(collector)
        return collector

    async def exchange(
        self,
        name: str | None = None,
        kind: aio_pika.ExchangeType = aio_pika.ExchangeType.DIRECT,
    ) -> str:
        name = name or self.name("exchange")
        self._cleanup.exchanges.add(name)
        channel = await self.channel()
        await channel.declare_exchange(name, kind, durable=True)
        return name

    async def bind(self, queue: str, exchange: str, routing_key: str = "") -> None:
        channel = await self.channel()
        declared = await channel.get_queue(queue, ensure=False)
        await declared.bind(exchange, routing_key=routing_key)


class Relays:
    """Runs ``hopsched.Relay`` instances as tasks; a relay task that raised fails the test."""

    def __init__(self) -> None:
        self.tasks: dict[hopsched.Relay, asyncio.Task[None]] = {}

    async def start(self, settings: hopsched.Settings, **kwargs: Any) -> hopsched.Relay:
        relay = hopsched.Relay(settings, **kwargs)
        task = asyncio.create_task(relay.run(), name=f"relay {settings.prefix}")
        self.tasks[relay] = task
        consuming = asyncio.create_task(relay.wait_consuming())
        done, _ = await asyncio.wait(
            {task, consuming}, timeout=RELAY_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if consuming not in done:
            consuming.cancel()
            if task in done:
                del self.tasks[relay]
                task.result()  # raises what run() raised
                pytest.fail("Relay.run() returned before consuming")
            pytest.fail(f"the relay was not consuming after {RELAY_START_TIMEOUT_S} s")
        return relay

    def is_running(self, relay: hopsched.Relay) -> bool:
        return not self.tasks[relay].done()

    async def stop(self, relay: hopsched.Relay) -> None:
        """``await relay.stop()``, then the task; re-raise whatever ``run()`` raised."""
        task = self.tasks.pop(relay)
        await relay.stop()
        try:
            async with asyncio.timeout(RELAY_STOP_TIMEOUT_S):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            pytest.fail(f"Relay.run() did not return within {RELAY_STOP_TIMEOUT_S} s of stop()")

    async def stop_all(self) -> None:
        failures: list[str] = []
        for relay in list(self.tasks):
            try:
                await self.stop(relay)
            except BaseException as error:
                failures.append(f"relay {relay.settings.prefix}: {error!r}")
        if failures:
            pytest.fail(f"relay task(s) failed: {failures}")


def settings_env(settings: hopsched.Settings) -> dict[str, str]:
    """The variables that give a ``hopsched`` subprocess ``settings``' broker, prefix and
    queue type."""
    return {
        "HOPSCHED_URL": str(settings.url),
        "HOPSCHED_PREFIX": settings.prefix,
        "HOPSCHED_QUEUE_TYPE": settings.queue_type,
    }


async def hopsched_cli(
    *args: str,
    settings: hopsched.Settings | None = None,
    within: float = 60,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str, str]:
    """Run ``python -m hopsched ARGS``; return (exit status, stdout, stderr).

    ``HOPSCHED_URL`` is the test broker's (a command without ``--url`` goes there, never
    to a broker the test does not test); ``settings`` set ``HOPSCHED_URL``, ``_PREFIX``
    and ``_QUEUE_TYPE``; ``env`` adds variables on top of the test's environment.
    """
    env = dict(os.environ) | {"HOPSCHED_URL": BROKER_URL} | dict(env or {})
    if settings is not None:
        env |= settings_env(settings)
    return await run_bounded([sys.executable, "-m", "hopsched", *args], within=within, env=env)
