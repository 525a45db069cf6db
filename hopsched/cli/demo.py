"""The demo: a relay in-process, real messages scheduled, received and measured."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import math
import random
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO
from urllib.parse import urlsplit

import aio_pika
import aiormq

from hopsched.broker.objects import declare_topology, teardown
from hopsched.client.scheduler import Scheduler
from hopsched.connect import connect
from hopsched.core.clock import now_us
from hopsched.core.envelope import DeliveryInfo
from hopsched.errors import BrokerUnavailableError, HopschedError
from hopsched.relay.loop import Relay
from hopsched.relay.stats import LatenessStats
from hopsched.settings import Settings
from hopsched.testing.localbroker import private_node, rabbitmq_installation
from hopsched.topology import Topology

__all__ = [
    "GET_A_BROKER",
    "DemoReport",
    "log_uniform_delays",
    "nothing_answers",
    "run_demo",
    "run_demo_or_local",
]

_GRACE_S = 10.0  # how long past the last due time a message may still arrive
_PROBE_TIMEOUT_S = 2.0  # for a TCP connect to this machine

#: How to get a broker, for a demo that finds none and cannot start one.
GET_A_BROKER = (
    "install RabbitMQ (Debian/Ubuntu: the rabbitmq-server package) or run its official "
    "container image (docker run -d -p 5672:5672 rabbitmq:3-management), or point --url "
    "(HOPSCHED_URL) at a broker"
)


@dataclass
class DemoReport:
    """What the demo measured.

    Attributes:
        scheduled: messages whose ``schedule()`` returned (confirmed by the broker).
        delivered: distinct schedule ids the demo's consumer received; ``duplicates``
            counts the further copies of one (delivery is at-least-once).
        hops: each delivered message's ``x-hopsched-hops``.
        lateness: at the consumer, µs: the instant it received a message (this
            process's clock) minus the message's due time (``x-hopsched-due``).
        relay_lateness: the relay's own measure, the one its log lines and the metric
            ``hopsched_lateness_seconds`` give: the instant the broker's confirm of its
            final publish reached it, minus the due time (messages that reached the relay
            more than a second past due excluded: ``RelayStats.overdue``).
        target: the queue the messages were scheduled to.
    """

    scheduled: int = 0
    delivered: int = 0
    duplicates: int = 0
    hops: list[int] = field(default_factory=list)
    lateness: LatenessStats = field(default_factory=LatenessStats)
    relay_lateness: LatenessStats = field(default_factory=LatenessStats)
    target: str = ""

    @property
    def lost(self) -> int:
        return self.scheduled - self.delivered

    @property
    def early(self) -> int:
        return self.lateness.early

    @property
    def ok(self) -> bool:
        return self.early == 0 and self.lost == 0

    def table(self) -> str:
        """The measures as a two-column Markdown table, then what they say in plain words."""
        hops_mean = sum(self.hops) / len(self.hops) if self.hops else 0.0
        consumer, relay = self.lateness, self.relay_lateness
        rows = [
            ("scheduled", f"{self.scheduled}"),
            ("delivered", f"{self.delivered}"),
            ("duplicates", f"{self.duplicates}"),
            ("early", f"{self.early}"),
            ("lost", f"{self.lost}"),
            *_lateness_rows("at the consumer", consumer),
            *_lateness_rows("relay's publish confirmed", relay),
            ("hops mean", f"{hops_mean:.2f}"),
            ("hops max", f"{max(self.hops, default=0)}"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'measure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
        return "\n".join([*lines, "", self.in_words()])

    def in_words(self) -> str:
        """What the table says, in sentences (lines of at most about 88 characters)."""
        to = f" to queue {self.target}" if self.target else ""
        said = [
            f"{self.delivered} of the {self.scheduled} messages scheduled were delivered{to}: "
            f"{_count(self.early, 'early')}, {_count(self.lost, 'lost')}, "
            f"{_count(self.duplicates, 'duplicate')}."
        ]
        if self.lateness.count:
            said.append(
                "Their lateness at the consumer (the instant it received one minus its due "
                f"time, x-hopsched-due): half within {_ms(self.lateness.percentile_ms(50))}, "
                f"99\N{NO-BREAK SPACE}% within {_ms(self.lateness.percentile_ms(99))}, all within "
                f"{_ms(self.lateness.max_ms)}: what an application sees."
            )
        said.append(
            "The relay's log lines (last N\N{NO-BREAK SPACE}s: … lateness p50=… p99=…, "
            "each line for its own interval) and its metric measure another instant: "
            "when the broker's confirm of the relay's final publish reached the relay"
            + (
                f" (over the whole demo: half within {_ms(self.relay_lateness.percentile_ms(50))}, "
                f"99\N{NO-BREAK SPACE}% within {_ms(self.relay_lateness.percentile_ms(99))})."
                if self.relay_lateness.count
                else "."
            )
        )
        if self.early:
            said.append(f"{_count(self.early, 'message')} came before the due time: a bug.")
        if self.lost:
            said.append(
                f"{_count(self.lost, 'message')} had not arrived {_GRACE_S:g} s after the "
                "last due time."
            )
        if self.duplicates:
            said.append(
                "A duplicate is a second copy of a schedule id (delivery is at-least-once: "
                "consumers de-duplicate on x-hopsched-id)."
            )
        return "\n".join(textwrap.wrap(" ".join(said), 88, break_on_hyphens=False))


def _lateness_rows(where: str, lateness: LatenessStats) -> list[tuple[str, str]]:
    def value(ms: float) -> str:
        return f"{ms:.2f}" if lateness.count else "n/a"

    return [
        (f"lateness p50 (ms), {where}", value(lateness.percentile_ms(50))),
        (f"lateness p99 (ms), {where}", value(lateness.percentile_ms(99))),
        (f"lateness max (ms), {where}", value(lateness.max_ms)),
    ]


def _count(number: int, what: str) -> str:
    if number == 0:
        return f"none {what}" if what in ("early", "lost") else f"no {what}"
    return f"{number} {what}" + ("s" if number > 1 and what not in ("early", "lost") else "")


def _ms(value: float) -> str:
    return f"{value:.1f}\N{NO-BREAK SPACE}ms"  # never wrapped apart


def log_uniform_delays(count: int, low_s: float, high_s: float, seed: int | None) -> list[float]:
    """``count`` delays in seconds spread log-uniformly over [low_s, high_s]."""
    rng = random.Random(seed)
    low, high = math.log(low_s), math.log(high_s)
    return [math.exp(rng.uniform(low, high)) for _ in range(count)]


async def run_demo(
    settings: Settings,
    *,
    count: int,
    max_delay_s: float,
    min_delay_s: float = 0.01,
    rate: float = 200.0,
    seed: int | None = None,
    out: TextIO = sys.stderr,
    throwaway: bool = False,
) -> DemoReport:
    """Run a relay, schedule ``count`` messages to a demo queue, wait for them, measure.

    Messages are scheduled at ``rate`` per second with delays log-uniform in
    [``min_delay_s``, ``max_delay_s``]; lateness is measured at the demo's consumer, and
    taken from the relay's stats as the relay measures it (``DemoReport``).

    Progress goes to ``out``. A ladder the demo declared (``settings.prefix`` had no
    relay queue before) is torn down at the end, also on an error or a cancellation,
    unless messages are still on it (said on ``out``, with the command that removes it);
    on a ``throwaway`` node it is left to go with the node. The demo's target queue is
    exclusive and goes with the connection.

    Raises:
        BrokerUnavailableError, TopologyMismatchError: as Scheduler and Relay do.
    """
    target = f"{settings.prefix}-demo-target"  # not {prefix}.…: hopsched's own
    report = DemoReport(target=target)
    seen: set[str] = set()
    everything = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received = now_us()
        await message.ack()
        info = DeliveryInfo.from_headers(message.headers)
        if info.schedule_id in seen:
            report.duplicates += 1
            return
        seen.add(info.schedule_id)
        report.delivered += 1
        report.lateness.record(received - info.due_us)
        report.hops.append(info.hops)
        if report.delivered == count:
            everything.set()

    topology = Topology.from_settings(settings)
    connection = await connect(settings, name="hopsched-demo")
    ours = not await _queue_exists(connection, topology.relay_queue)
    relay = Relay(settings)

    async def run_relay() -> None:
        if ours:  # declared on purpose: no mistyped prefix for the relay to warn of
            await declare_topology(settings)
        await relay.run()

    relay_task = asyncio.create_task(run_relay())
    consuming = asyncio.create_task(relay.wait_consuming())
    try:
        await asyncio.wait({relay_task, consuming}, return_when=asyncio.FIRST_COMPLETED)
        if relay_task.done():
            relay_task.result()  # raises the relay's error
        channel = await connection.channel()
        try:
            queue = await channel.declare_queue(target, exclusive=True)
        except aiormq.exceptions.ChannelLockedResource:
            raise HopschedError(
                f"another demo is running with prefix {settings.prefix!r} on this broker "
                f"(its queue {target} is exclusive): wait for it to finish, or give this "
                "one its own with --prefix"
            ) from None
        await queue.consume(on_message, no_ack=False)
        delays = log_uniform_delays(count, min_delay_s, max_delay_s, seed)
        out.write(
            f"scheduling {count} messages, delays {min_delay_s * 1000:g} ms to "
            f"{max_delay_s:g} s (log-uniform), {rate:g}/s, to queue {target} "
            f"via {settings.masked_url}\n"
        )
        async with Scheduler(settings) as scheduler:

            async def schedule_one(number: int, delay: float) -> None:
                body = f"demo message {number}, delay {delay * 1000:.1f} ms".encode()
                await scheduler.schedule(body, delay=delay, routing_key=target)
                report.scheduled += 1

            # Paced like a real producer: a burst would make short delays late by the
            # time the burst takes to publish, which says nothing about the ladder.
            publishes = []
            for number, delay in enumerate(delays):
                publishes.append(asyncio.create_task(schedule_one(number, delay)))
                await asyncio.sleep(1 / rate)
            await asyncio.gather(*publishes)
        deadline = now_us() + int((max_delay_s + _GRACE_S) * 1_000_000)
        await _wait_with_progress(everything, deadline, lambda: report.delivered, count, out)
    finally:
        consuming.cancel()
        await relay.stop()
        with contextlib.suppress(Exception):
            await relay_task  # its error, if any, was raised above
        report.relay_lateness = relay.stats.lateness
        try:
            if ours and not throwaway:  # leave nothing: 31 quorum queues hold broker resources
                await _remove_ladder(connection, settings, topology, out)
        finally:
            await connection.close()
    return report


async def _queue_exists(connection: aio_pika.abc.AbstractConnection, name: str) -> bool:
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    if not channel.is_closed:
        await channel.close()
    return True


async def _remove_ladder(
    connection: aio_pika.abc.AbstractConnection,
    settings: Settings,
    topology: Topology,
    out: TextIO,
) -> None:
    try:
        done = await teardown(topology, connection)
    except HopschedError as refused:  # messages still on it (interrupted): never delete those
        out.write(
            f"the demo's ladder {topology.prefix} stays declared, its messages still on it "
            f"({refused}); to remove it and them: hopsched teardown --url "
            f"{settings.masked_url} --prefix {topology.prefix} --force\n"
        )
    else:
        out.write(f"removed the demo's ladder {topology.prefix} ({len(done.removed)} objects)\n")
    out.flush()


async def _wait_with_progress(
    done: asyncio.Event, deadline_us: int, delivered: Callable[[], int], count: int, out: TextIO
) -> None:
    interactive = out.isatty()
    last_line = 0.0
    while not done.is_set() and now_us() < deadline_us:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.5)
        remaining_s = max(0.0, (deadline_us - now_us()) / 1e6 - _GRACE_S)
        line = f"delivered {delivered()}/{count}, last due in {remaining_s:5.1f} s"
        if interactive:
            out.write(f"\r{line}")
        elif now_us() / 1e6 - last_line >= 5:
            out.write(line + "\n")
            last_line = now_us() / 1e6
        out.flush()
    if interactive:
        out.write("\n")


async def nothing_answers(url: str) -> bool:
    """Whether ``url`` names this machine (a loopback host) and nothing accepts a TCP
    connection at its port: a broker that is simply not running here."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:  # another host name
            return False
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:  # something is there, if slow: let the connect report it
        return False
    except OSError:  # refused on every address
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def run_demo_or_local(
    settings: Settings,
    *,
    count: int,
    max_delay_s: float,
    rate: float = 200.0,
    seed: int | None = None,
    out: TextIO = sys.stderr,
) -> DemoReport:
    """``run_demo`` with these arguments; but if nothing answers at the URL on this
    machine (``nothing_answers``) and RabbitMQ is installed (``rabbitmq_installation``), on a
    throwaway private node instead (``private_node``): said on ``out``, and the node
    and its directory removed at the end, also on an error or a cancellation (Ctrl-C).

    Raises:
        BrokerUnavailableError: nothing answers and RabbitMQ is not installed; the
            message says how to get a broker (``GET_A_BROKER``).
        LocalBrokerError: the private node did not start.
    """

    demo_on = functools.partial(
        run_demo, count=count, max_delay_s=max_delay_s, rate=rate, seed=seed, out=out
    )

    if not all([await nothing_answers(url) for url in settings.urls]):
        return await demo_on(settings)
    installation = rabbitmq_installation()
    if installation is None:
        raise BrokerUnavailableError(
            f"nothing answers at {settings.masked_url} and RabbitMQ is not installed "
            f"here: {GET_A_BROKER}"
        )
    out.write(
        f"nothing answers at {settings.masked_url}: starting a throwaway RabbitMQ node "
        f"({installation}) for this demo\n"
    )
    out.flush()
    try:
        # With the management API the relay can read the policies in force (and says
        # nothing alarming about not being able to).
        async with private_node(installation=installation, management=True) as node:
            out.write(f"throwaway node {node.node} on 127.0.0.1:{node.port}, in {node.root}\n")
            out.flush()
            return await demo_on(
                dataclasses.replace(
                    settings, url=node.url, management_url=node.management_url or ""
                ),
                throwaway=True,
            )
    finally:
        out.write("throwaway node stopped and removed\n")
        out.flush()
