"""Fault tests (issue 4): relays and brokers crash, relays stop, waits outlast timeouts.

The relay runs as users run it, ``hopsched relay`` in a subprocess, and is killed with
SIGKILL or stopped with SIGTERM. Broker crashes use a private node (``broker.py``),
never the shared broker. Each test prints one coverage line (``pytest -s``): messages,
kills, restarts, lost, duplicates, early and lateness; and asserts exact outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aiormq.abc import DeliveredMessage
from support import (
    ADDED_ON_DELIVERY,
    HEADER_ID,
    Cleanup,
    Collector,
    Received,
    Targets,
    get_all,
    lateness_line,
    message_count,
    schedule_all,
    unique,
    wait_until_count,
)
from support.private_nodes import PrivateBroker, resend_dead_letters_soon
from support.relays import RelayProcess

import hopsched
from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress
from hopsched.core.clock import now_us
from hopsched.core.ingress import Ingress
from hopsched.journal.stream import read_journal
from hopsched.topology import Topology

#: Every fault test is in the slow tier (``pytest -m slow``).
pytestmark = pytest.mark.slow

#: The 2 h wait of F08 cannot run in CI (90 min limit): set this to 7200 to run it.
F08_LONG_S = float(os.environ.get("HOPSCHED_F08_LONG_S", "0"))


@dataclass
class Outcome:
    """What arrived for a set of schedule ids: lost, duplicated, early; lateness."""

    scheduled: Schedule
    received: Sequence[Received]
    kills: int = 0
    restarts: int = 0
    #: copies the target queue redelivered to the test's consumer (flag ``redelivered``):
    #: the consumer's at-least-once, not a hopsched duplicate.
    consumer_redeliveries: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def copies(self) -> Counter[str]:
        return Counter(r.schedule_id for r in self.received)

    @property
    def lost(self) -> set[str]:
        return set(self.scheduled.due_us) - set(self.copies)

    @property
    def duplicated(self) -> dict[str, int]:
        return {k: n for k, n in self.copies.items() if n > 1}

    @property
    def early(self) -> list[Received]:
        return [r for r in self.received if r.lateness_us < 0]

    def first_copies(self) -> dict[str, Received]:
        first: dict[str, Received] = {}
        for r in self.received:
            if r.schedule_id not in first or r.received_us < first[r.schedule_id].received_us:
                first[r.schedule_id] = r
        return first

    def line(self, fault: str) -> str:
        lateness = lateness_line(r.lateness_us for r in self.first_copies().values())
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (
            f"COVERAGE {fault}: messages={len(self.scheduled.due_us)} kills={self.kills} "
            f"restarts={self.restarts} lost={len(self.lost)} "
            f"duplicates={sum(n - 1 for n in self.duplicated.values())} "
            f"max_copies={max(self.copies.values(), default=0)} early={len(self.early)} "
            f"consumer_redeliveries={self.consumer_redeliveries} "
            f"{lateness}{extra}"
        )

    def assert_exact(self, *, duplicates_allowed: int = 0, lost_allowed: int = 0) -> None:
        """None early, every copy one of ours, at most that many extra copies and lost."""
        unknown = set(self.copies) - set(self.scheduled.due_us)
        assert not unknown, f"{len(unknown)} deliveries with schedule ids never scheduled"
        assert len(self.lost) <= lost_allowed, (
            f"{len(self.lost)} lost, e.g. {sorted(self.lost)[:5]}"
        )
        assert not self.early, [(r.schedule_id, r.lateness_us) for r in self.early[:10]]
        for r in self.received:  # a copy carries its own schedule id, due time and body
            assert r.body == self.scheduled.body[r.schedule_id], r.schedule_id
            assert r.due_us == self.scheduled.due_us[r.schedule_id], r.schedule_id
            assert r.headers.keys() == ADDED_ON_DELIVERY, r.headers  # no broker bookkeeping
        extra = sum(n - 1 for n in self.duplicated.values())
        assert extra <= duplicates_allowed, (
            f"{extra} duplicate deliveries, at most {duplicates_allowed} were in flight"
        )


@dataclass
class Schedule:
    """What the test scheduled: schedule id -> due time (µs) and body."""

    due_us: dict[str, int] = field(default_factory=dict)
    body: dict[str, bytes] = field(default_factory=dict)
    #: ``time.monotonic()`` when the first message was scheduled.
    started: float = field(default_factory=time.monotonic)

    async def add(
        self,
        scheduler: hopsched.Scheduler,
        delays_s: Sequence[float],
        routing_key: str,
        size: int = 16,
    ) -> list[str]:
        """Schedule one persistent message per delay, each with a body of its own (bytes)."""
        bodies = [uuid.uuid4().bytes.ljust(size, b".") for _ in delays_s]
        calls = [
            {
                "message": aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                "delay": delay,
                "routing_key": routing_key,
            }
            for body, delay in zip(bodies, delays_s, strict=True)
        ]
        scheduled = await schedule_all(scheduler, calls)
        for body, done in zip(bodies, scheduled, strict=True):
            self.due_us[done.schedule_id] = done.due_us
            self.body[done.schedule_id] = body
        return [done.schedule_id for done in scheduled]


def _node_settings(node: PrivateBroker, queue_type: str) -> hopsched.Settings:
    return hopsched.Settings(
        url=node.url,
        prefix=unique(),
        queue_type=queue_type,  # type: ignore[arg-type]
    )


# --- F08: waits far longer than consumer_timeout ------------------------------------------


@pytest.mark.timeout(max(300.0, F08_LONG_S) + 240)
async def test_f08_waits_longer_than_consumer_timeout_close_no_channel(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    node = await start_private_broker(config="consumer_timeout = 60000")
    settings = _node_settings(node, "quorum")
    relay = await relay_processes(settings)
    connection = await aio_pika.connect(node.url)
    target = await Targets(connection, Cleanup(node.url)).queue()
    groups = {70.0: 100, 180.0: 100, 300.0: 500} | ({F08_LONG_S: 500} if F08_LONG_S else {})
    scheduled = Schedule()
    async with hopsched.Scheduler(settings) as scheduler:
        for delay, count in groups.items():  # 100 due per second
            await scheduled.add(scheduler, _spread(count, delay, delay + count / 100), target.name)
    started = time.monotonic()

    for delay in sorted(groups):
        arrived = sum(groups[d] for d in groups if d <= delay)
        await target.wait_for(arrived, within=delay - (time.monotonic() - started) + 60)
        print(f"F08 {delay:.0f} s: {arrived} arrived; {target.lateness_line()}")
    await target.settle(2.0)
    outcome = Outcome(scheduled, target.received)
    print(outcome.line(f"F08 consumer_timeout=60s delays={sorted(groups)}"))

    outcome.assert_exact()
    # On time: far below the 60 s a message would wait for a closed channel to reopen.
    assert max(r.lateness_us for r in target.received) < 10_000_000
    assert relay.returncode is None
    assert relay.count("relay consuming") == 1, relay.log
    assert relay.count("lost the connection") == 0, relay.log
    assert relay.count("reconnecting") == 0, relay.log
    node_log = node.log()
    # RabbitMQ 3.10 logs "Consumer 1 on channel 1 has timed out waiting for delivery
    # acknowledgement" (4.x: "... for a consumer acknowledgement of a delivery"), then
    # "Channel error on connection ..." and PRECONDITION_FAILED (seen in a negative control).
    assert "has timed out waiting for" not in node_log
    assert "PRECONDITION_FAILED" not in node_log
    # The only channel errors allowed are the relay's passive look-ups at its start (its
    # ladder check asks whether the prefix's relay queue exists: not_found on a new one).
    exceptions = re.findall(r"operation (\S+) caused a channel exception (\w+)", node_log)
    assert all(e == ("queue.declare", "not_found") for e in exceptions), exceptions
    print(f"F08 relay log:\n{relay.log}")
    await connection.close()


# --- F10: the relay crashes -----------------------------------------------------------------


async def _requeued_after_kill(connection: aio_pika.abc.AbstractConnection, queue: str) -> int:
    """Ready messages in ``queue`` once the broker has seen its only consumer go.

    What the killed relay held unacked is requeued, so this bounds from above the
    deliveries it had in flight (messages that arrived since the kill add to it).
    """
    async with asyncio.timeout(15):
        while True:
            async with connection.channel() as channel:
                declared = await channel.declare_queue(queue, passive=True)
            result = declared.declaration_result
            if result.consumer_count == 0:
                assert result.message_count is not None
                return result.message_count
            await asyncio.sleep(0.01)


def _spread(count: int, first_s: float, last_s: float) -> list[float]:
    """``count`` delays evenly from ``first_s`` to ``last_s``."""
    return [first_s + (last_s - first_s) * i / (count - 1) for i in range(count)]


async def test_f10_relay_sigkilled_repeatedly_loses_nothing(
    settings: hopsched.Settings,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    relay = await relay_processes(settings)
    target = await targets.queue()
    scheduled = Schedule()
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduled.add(scheduler, _spread(2500, 3.0, 23.0), target.name)
    relay_queue = hopsched.Topology.from_settings(settings).relay_queue
    in_flight_bound = 0

    for kill_at in (5.0, 9.0, 13.0, 17.0, 21.0):  # s after scheduling; every 4 s
        await asyncio.sleep(max(0.0, kill_at - (time.monotonic() - scheduled.started)))
        await relay.kill()
        in_flight_bound += await _requeued_after_kill(amqp, relay_queue)
        await relay.start()

    await target.wait_for_ids(scheduled.due_us, within=60)
    await target.settle(2.0)
    outcome = Outcome(scheduled, target.received, kills=5, restarts=5)
    outcome.extra["in_flight_bound"] = in_flight_bound
    print(outcome.line("F10 relay SIGKILL x5 (quorum)"))

    outcome.assert_exact(duplicates_allowed=in_flight_bound)
    assert max(outcome.copies.values()) <= 1 + outcome.kills
    assert relay.count("Traceback") == 0, relay.log


async def test_f10_competing_relays_one_killed_loses_nothing(
    settings: hopsched.Settings,
    targets: Targets,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    prefetch = 300  # what the killed relay can hold unacked: the duplicates' bound
    relays = [await relay_processes(settings, "--prefetch", str(prefetch)) for _ in range(3)]
    target = await targets.queue()
    scheduled = Schedule()
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduled.add(scheduler, _spread(2000, 2.0, 12.0), target.name)

    await asyncio.sleep(max(0.0, 7.0 - (time.monotonic() - scheduled.started)))
    await relays[0].kill()
    await target.wait_for_ids(scheduled.due_us, within=60)
    await target.settle(2.0)
    outcome = Outcome(scheduled, target.received, kills=1)
    print(outcome.line("F10 3 competing relays, 1 SIGKILLed (quorum)"))

    outcome.assert_exact(duplicates_allowed=prefetch)
    assert all(relay.returncode is None for relay in relays[1:])


#: F35's bound: the lanes that can be busy when the relay is killed mid-burst, the
#: ladder's (hops of messages that reach the relay more than a hold window early, as
#: they do when scheduling lags on a loaded machine) and the target's; each has at most
#: ``LANE_WINDOW`` publishes sent and not confirmed and ``LANE_HELD`` confirmed and not
#: acked, waiting for their journal record (docs/guarantees.md).
F35_BUSY_LANES = 2


async def test_F35_a_relay_killed_mid_burst_duplicates_at_most_its_lane_windows(
    settings: hopsched.Settings,
    targets: Targets,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    """F35: 6,000 messages due at one instant; the relay is killed once the burst is
    being delivered (0.1 s after it came due, or at the first delivery if that is later;
    stopped first, so that the broker reads all it wrote) and started again 1 s later.
    Before: 9,800 delivered (3,800 duplicates). The relay acks each delivery once its
    publish and its journal record are confirmed, writes those acks ahead of the
    publishes they let go, and keeps at most ``LANE_WINDOW`` publishes unconfirmed and
    ``LANE_HELD`` unrecorded per lane, so only those can be delivered twice: nothing
    lost, nothing early, at most ``F35_BUSY_LANES * (LANE_WINDOW + LANE_HELD)`` (768,
    12.8 %) duplicated; one busy lane, the usual case, 384 (6.4 %). The journal then says
    none is pending (before, up to 512 acked between their confirm and their record's
    batch stayed "held")."""
    from hopsched.relay.loop import LANE_HELD, LANE_WINDOW

    count = 6000
    relay = await relay_processes(settings)
    target = await targets.queue()
    due = datetime.now(UTC) + timedelta(seconds=25)  # every hop done by then
    bodies = [uuid.uuid4().bytes for _ in range(count)]
    scheduled = Schedule()
    async with hopsched.Scheduler(settings) as scheduler:
        done = await scheduler.schedule_many(
            [
                hopsched.ScheduleRequest(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    at=due,
                    routing_key=target.name,
                )
                for body in bodies
            ]
        )
    for body, one in zip(bodies, done, strict=True):
        scheduled.due_us[one.schedule_id] = one.due_us
        scheduled.body[one.schedule_id] = body
    await asyncio.sleep((due - datetime.now(UTC)).total_seconds() + 0.1)
    # Loaded, the relay may not have begun the burst yet: the kill waits for it.
    await target.wait_for(1, within=120)
    # Stopped, then killed once the broker has read all it wrote: a kill alone resets
    # the connection, and the broker may drop the last acks it had not read yet, which
    # would hide an ack sent before its delivery's journal record.
    relay.pause()
    await asyncio.sleep(0.5)
    await relay.kill()
    at_kill = len({r.schedule_id for r in target.received})
    await asyncio.sleep(1.0)
    await relay.start()
    await target.wait_for_ids(scheduled.due_us, within=120)
    await target.settle(2.0)
    outcome = Outcome(scheduled, target.received, kills=1, restarts=1)
    outcome.extra["delivered_before_kill"] = at_kill
    outcome.extra["lane_window"] = LANE_WINDOW
    outcome.extra["lane_held"] = LANE_HELD
    fold = await read_journal(settings, copies=False)
    still_pending = set(fold.pending()) & scheduled.due_us.keys()
    outcome.extra["journal_still_pending"] = len(still_pending)
    print(outcome.line("F35 relay SIGKILLed mid-burst, 6,000 due at once (quorum)"))

    outcome.assert_exact(duplicates_allowed=F35_BUSY_LANES * (LANE_WINDOW + LANE_HELD))
    # Each delivery is acked once its record is written: a kill between its confirm and
    # its record's batch delivers it again, never leaves it "held" in the journal.
    assert not still_pending, f"delivered, and pending in the journal: {sorted(still_pending)[:5]}"


#: The ingress test's pace (s between publishes).
PACED_S = 0.004


async def test_a_relay_killed_mid_ingest_leaves_every_ingress_message_known(
    settings: hopsched.Settings,
    targets: Targets,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
    cleanup: Cleanup,
) -> None:
    """1,000 messages published to an ingress at about 250/s (``x-delay`` 15 s, a
    ``message_id`` each); the relay is stopped and killed while it takes them in, and
    started again 1 s later. An ingress message is acked only once its ``scheduled``
    record is written too, so the journal knows every one before it comes due, and
    every one is delivered once or more, none early. Before, one acked between its
    hop's confirm and its record's batch was unknown to ``get`` and ``pending`` until
    delivered."""
    count, delay_ms = 1000, 15_000
    relay = await relay_processes(settings)
    exchange = unique("x")
    cleanup.exchanges.update({exchange, Topology.from_settings(settings).due_exchange(exchange)})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    target = await targets.queue()
    await bind_to_due_exchange(settings, exchange, target.name, "k")
    ids = [uuid.uuid4().hex for _ in range(count)]
    published_us: dict[str, int] = {}
    connection = await aio_pika.connect(settings.url)
    async with connection, connection.channel() as channel:  # publisher confirms
        ingress = await channel.get_exchange(exchange, ensure=False)

        sends = []
        # Stopped while it takes them in, at no particular phase of a publish.
        pause = asyncio.get_running_loop().call_later(
            count * PACED_S * random.uniform(0.4, 0.6), relay.pause
        )
        for schedule_id in ids:
            published_us[schedule_id] = now_us()
            message = aio_pika.Message(
                schedule_id.encode(),
                message_id=schedule_id,
                headers={"x-delay": delay_ms},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            sends.append(asyncio.ensure_future(ingress.publish(message, routing_key="k")))
            await asyncio.sleep(PACED_S)  # paced: a batch of records waits its 10 ms
        await asyncio.gather(*sends)
    assert pause.when() < asyncio.get_running_loop().time(), "paused after the publishes"
    # Killed once the broker has read all it wrote (see F35).
    await asyncio.sleep(0.5)
    await relay.kill()
    await asyncio.sleep(1.0)
    await relay.start()
    # Until they come due, every one must be known (pending): the restarted relay takes
    # in what was not acked, and what was acked had its record written first.
    hold_us = settings.ladder.hold_window_ms * 1000
    first_due_us = min(published_us.values()) + delay_ms * 1000
    while True:
        fold = await read_journal(settings, copies=False)
        unknown = [i for i in ids if fold.info(i, now_us(), hold_us) is None]
        if not unknown or now_us() > first_due_us - 2_000_000:
            break
        await asyncio.sleep(0.5)
    await target.wait_for_ids(set(ids), within=120)
    await target.settle(2.0)
    copies = Counter(r.schedule_id for r in target.received)
    due_us = {i: published_us[i] + delay_ms * 1000 for i in ids}
    early = [r.schedule_id for r in target.received if r.received_us < due_us[r.schedule_id]]
    duplicates = sum(n - 1 for n in copies.values())
    print(
        f"COVERAGE relay killed mid-ingest: messages={count} lost={count - len(copies)} "
        f"duplicates={duplicates} early={len(early)} unknown_before_due={len(unknown)}"
    )
    assert set(copies) == set(ids)
    assert not early, early[:5]
    # Unacked when it was killed, each taken in again: at most the prefetch.
    assert duplicates <= settings.prefetch
    assert not unknown, f"{len(unknown)} unknown to the journal before due: {unknown[:5]}"


# --- Graceful shutdown under load ---------------------------------------------------------


async def test_sigterm_under_load_exits_0_promptly_and_loses_nothing(
    make_settings: Callable[..., hopsched.Settings],
    targets: Targets,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    # A 2 s hold window: the burst below is surely held in-process at the SIGTERM, even
    # when a loaded machine makes the broker's expiries run late (seen in CI at 50 ms).
    settings = make_settings(hold_window_ms=2000)
    relay = await relay_processes(settings)
    target = await targets.queue()
    scheduled = Schedule()
    term_at = 6.0  # s after scheduling
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduled.add(scheduler, _spread(2000, 2.0, 10.0), target.name)
        # Due 1-1.5 s after the SIGTERM: held in the relay's hold window when it comes.
        burst = _spread(300, term_at + 1.0, term_at + 1.5)
        await scheduled.add(
            scheduler, [d - (time.monotonic() - scheduled.started) for d in burst], target.name
        )

    await asyncio.sleep(max(0.0, term_at - (time.monotonic() - scheduled.started)))
    exit_s = await relay.terminate(within=30)
    exit_status, delivered_by_first = relay.returncode, len(target)
    await relay.start()
    await target.wait_for_ids(scheduled.due_us, within=60)
    await target.settle(2.0)
    outcome = Outcome(scheduled, target.received, restarts=1)
    finishing = re.search(r"finishing (\d+) unacked deliveries", relay.log)
    held = int(finishing.group(1)) if finishing else 0
    outcome.extra |= {"held_at_sigterm": held, "exit_s": f"{exit_s:.2f}"}
    outcome.extra["delivered_before_restart"] = delivered_by_first
    print(outcome.line("SIGTERM under load (quorum)"))

    assert exit_status == 0, relay.log
    assert held > 0, f"the relay held nothing at SIGTERM: no load to stop under\n{relay.log}"
    assert exit_s <= 10.0
    assert "relay stopped" in relay.log
    outcome.assert_exact()  # a clean stop duplicates nothing


# --- F09: the broker crashes ----------------------------------------------------------------


class CrashProofCollector(Collector):
    """Consumes a queue on a node that crashes: acks each message, reconnects after a loss.

    A copy the queue redelivers (flag ``redelivered``) of a schedule id already recorded
    is the test consumer's own at-least-once, not a hopsched duplicate: counted apart.
    """

    def __init__(self, url: str, name: str) -> None:
        super().__init__(name)
        self.url = url
        self.consumer_redeliveries = 0
        self._seen: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def on_message(self, delivery: DeliveredMessage) -> None:
        schedule_id = dict(delivery.header.properties.headers or {}).get(HEADER_ID)
        if delivery.redelivered and schedule_id in self._seen:
            self.consumer_redeliveries += 1
        else:
            self._seen.add(str(schedule_id))
            await super().on_message(delivery)
        with contextlib.suppress(Exception):  # unacked: redelivered, flagged, after the crash
            await delivery.channel.basic_ack(delivery.delivery_tag or 0)

    async def start(self) -> CrashProofCollector:
        connection = await aio_pika.connect(self.url)
        async with connection.channel() as channel:
            await channel.declare_queue(self.name, durable=True)
        await connection.close()
        self._task = asyncio.create_task(self._consume_forever())
        return self

    async def _consume_forever(self) -> None:
        while True:
            with contextlib.suppress(OSError, aio_pika.exceptions.AMQPError):
                await self._consume_until_lost()
            await asyncio.sleep(0.2)

    async def _consume_until_lost(self) -> None:
        connection = await aio_pika.connect(self.url)
        lost = asyncio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        try:
            channel = await (await connection.channel()).get_underlay_channel()
            await channel.basic_qos(prefetch_count=500)
            await channel.basic_consume(self.name, self.on_message)
            await lost.wait()
        finally:
            with contextlib.suppress(Exception):
                await connection.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def _wait_for_ids_or_quiet(
    collector: Collector, ids: Iterable[str], until_us: int, quiet_s: float
) -> None:
    """Wait until every id arrived, or (past ``until_us``) nothing arrived for ``quiet_s`` s."""
    wanted = set(ids)
    seen = -1
    while wanted - {r.schedule_id for r in collector.received}:
        if now_us() > until_us and len(collector) == seen:
            return
        seen = len(collector)
        await asyncio.sleep(quiet_s)


async def _depths(
    connection: aio_pika.abc.AbstractConnection, settings: hopsched.Settings
) -> tuple[int, int]:
    """Ready messages in the step queues (together) and in the relay queue."""
    topology = hopsched.Topology.from_settings(settings)
    steps = [await message_count(connection, q) for q in topology.step_queues]
    return sum(steps), await message_count(connection, topology.relay_queue)


async def _dead_letter_resend_s(node: PrivateBroker) -> float:
    """The node's ``dead_letter_worker_publisher_confirm_timeout``, s (180 s by default): a
    quorum step queue's at-least-once dead-letter worker sends a dead-letter again only
    after it when no confirm came (docs/cluster.md): the longest such a message is late."""
    with contextlib.suppress(Exception):
        out = await node.rabbitmqctl(
            "eval", "application:get_env(rabbit, dead_letter_worker_publisher_confirm_timeout)."
        )
        if found := re.search(r"\{ok,\s*(\d+)\}", out):
            return int(found[1]) / 1000
    return 180.0


async def _where_missing_are(
    node: PrivateBroker,
    settings: hopsched.Settings,
    target: str,
    missing: set[str],
    relay: RelayProcess,
) -> str:
    """For a failure: where the ids the target's consumer never got are, as hopsched's
    journal tells (``delivered``: the target queue confirmed the relay's persistent
    publish, so hopsched's part was done; ``pending``/``held``: on the ladder or in the
    relay queue; ``parked``: with the reason; a journal write lost in a crash leaves a
    delivered one ``held``), the queues' depths and the quorum steps' dead-letters not
    yet forwarded (``messages_dlx``), the node log's unclean-shutdown recovery lines and
    the relay's warnings."""
    lines = [f"{len(missing)} ids not received when the wait ended"]
    try:
        fold = await read_journal(settings, copies=False)
        hold_us = settings.ladder.hold_window_ms * 1000
        states: Counter[str] = Counter()
        for schedule_id in sorted(missing):
            info = fold.info(schedule_id, now_us(), hold_us)
            states[info.state if info else "unknown"] += 1
            if info is None:
                lines.append(f"  {schedule_id}: no journal record")
            else:
                lines.append(
                    f"  {schedule_id}: {info.state}, due {info.due_us}, delivered "
                    f"{info.delivered_us}, parked {info.parked_us} {info.parked_reason or ''}"
                )
        lines.insert(1, f"journal states: {dict(states)}")
    except Exception as error:  # a diagnosis: say why it could not read
        lines.append(f"journal not read: {error!r}")
    items = ("name", "type", "messages_ready", "messages_unacknowledged")
    try:
        listing = await node.rabbitmqctl("list_queues", "-q", "--no-table-headers", *items)
        for line in listing.splitlines():
            name, *counts = line.split("\t")
            holding = set(counts[1:]) - {"0", ""} and counts[:1] != ["stream"]
            if name.startswith((settings.prefix, target)) and holding:
                lines.append(f"queue {line}")  # those holding anything (not the streams)
        # rabbitmqctl list_queues has no messages_dlx (4.0.5): ask the queues themselves
        dead_letters = await node.rabbitmqctl(
            "eval",
            "[{element(4, amqqueue:get_name(Q)), N} || Q <- rabbit_amqqueue:list(), "
            "amqqueue:get_type(Q) =:= rabbit_quorum_queue, "
            "{messages_dlx, N} <- rabbit_amqqueue:info(Q, [messages_dlx]), N > 0].",
        )
        lines.append(f"quorum queues' dead-letters not yet forwarded: {dead_letters.strip()}")
    except Exception as error:
        lines.append(f"queue depths not read: {error!r}")
    lines += [
        f"node log: {line}"
        for line in node.log().splitlines()
        if ("dropped" in line and "dropped 0/0/0 " not in line)
        or "Restarting crashed queue" in line
        or "Cannot forward any dead-letter" in line
    ]
    lines += [f"relay: {line.rstrip()}" for line in relay.lines if " INFO " not in line]
    return "\n".join(lines)


F09_PREFETCH = 200
#: At-least-once dead-lettering keeps at most this many messages per quorum queue
#: unconfirmed (RabbitMQ's ``dead_letter_worker_consumer_prefetch``): a crash may repeat them.
QUORUM_DEAD_LETTER_WINDOW = 32


@pytest.mark.timeout(600)  # 300 s and the wait for what is missing at the end (quorum)
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_f09_broker_killed_twice_delivers_everything_after_recovery(
    queue_type: str,
    private_broker: PrivateBroker,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    node = private_broker
    password = f"pw-{uuid.uuid4().hex}"
    await node.rabbitmqctl("add_user", "f09", password)
    await node.rabbitmqctl("set_permissions", "-p", "/", "f09", ".*", ".*", ".*")
    url = node.url.replace("guest:guest@", f"f09:{password}@")
    resend_dead_letters_soon(node)
    settings = hopsched.Settings(url=url, prefix=unique(), queue_type=queue_type)  # type: ignore[arg-type]
    relay = await relay_processes(settings, "--prefetch", str(F09_PREFETCH))
    target = await CrashProofCollector(url, unique("target")).start()
    scheduled = Schedule()
    outages: list[tuple[int, int]] = []  # (killed, accepting AMQP again), µs
    at_kills: list[tuple[int, int]] = []  # ready in (the steps, the relay queue) at each kill
    try:
        for kill, kill_at in enumerate((10.0, 10.0)):  # s after the node (re)started
            ready = time.monotonic()
            async with hopsched.Scheduler(settings) as scheduler:
                # Small bodies, and 8 KiB ones: RabbitMQ keeps bodies over 4 KiB apart from
                # a classic queue's index (queue_index_embed_msgs_below), on another path.
                for size in (16, 8192):
                    if kill == 0:  # in the steps at both kills: due from 5 s to 45 s
                        await scheduled.add(scheduler, _spread(850, 5.0, 45.0), target.name, size)
                    # Due from the kill to 100 ms after: held, in flight or in the last steps.
                    elapsed = time.monotonic() - ready
                    burst = _spread(75, kill_at - elapsed, kill_at - elapsed + 0.1)
                    await scheduled.add(scheduler, burst, target.name, size)
            probe = await aio_pika.connect(url)
            if kill == 1:  # the relay stalls first: messages wait in the relay queue too
                await asyncio.sleep(max(0.0, kill_at - 1.5 - (time.monotonic() - ready)))
                relay.pause()
            await asyncio.sleep(max(0.0, kill_at - 0.05 - (time.monotonic() - ready)))
            at_kills.append(await _depths(probe, settings))
            killed_us = now_us()
            await node.kill()
            await node.start()
            outages.append((killed_us, now_us()))
            relay.resume()
            await relay.wait_for("relay consuming", kill + 2, within=60)

        last_due = max(scheduled.due_us.values())
        await _wait_for_ids_or_quiet(target, scheduled.due_us, last_due + 30_000_000, 5.0)
        await target.settle(2.0)
        # Missing now: where are they, and are they lost or late? A dead-letter a quorum
        # step's at-least-once worker had in flight when the node died is sent again only
        # after the broker's dead_letter_worker_publisher_confirm_timeout (180 s).
        missing = set(scheduled.due_us) - {r.schedule_id for r in target.received}
        waited_for_missing_s, diagnosis = 0.0, ""
        if missing and queue_type == "quorum":  # classic ones may lose some (below)
            diagnosis = await _where_missing_are(node, settings, target.name, missing, relay)
            print(f"F09 ({queue_type}) at the end of the wait: {diagnosis}")
            started = time.monotonic()
            resend_us = int((await _dead_letter_resend_s(node) + 30) * 1e6)
            await _wait_for_ids_or_quiet(target, missing, now_us() + resend_us, 5.0)
            waited_for_missing_s = time.monotonic() - started
    finally:
        await target.close()

    outcome = Outcome(
        scheduled,
        target.received,
        kills=2,
        restarts=2,
        consumer_redeliveries=target.consumer_redeliveries,
    )
    first = outcome.first_copies()
    after_restart = [  # due during an outage: how long after the node was back
        first[i].received_us - back
        for killed, back in outages
        for i, due in scheduled.due_us.items()
        if killed <= due <= back and i in first
    ]
    steps_used = sum(step <= 45_000 for step in settings.ladder.steps)  # delays up to 45 s
    in_flight_max = F09_PREFETCH + QUORUM_DEAD_LETTER_WINDOW * steps_used  # quorum, per kill
    outcome.extra |= {
        "ready_at_kills(steps,relay)": at_kills,
        "outages_s": [round((back - killed) / 1e6, 1) for killed, back in outages],
        "reconnect_attempts_logged": relay.count("reconnect attempt"),
        "lost_with_8KiB_bodies": sum(len(scheduled.body[i]) == 8192 for i in outcome.lost),
        "due_in_outages": len(after_restart),
        "arrival_after_restart": lateness_line(after_restart).removeprefix("lateness "),
        "dead_letter_resend_s": await _dead_letter_resend_s(node),
        "missing_after_30s": len(missing),
        "waited_for_missing_s": round(waited_for_missing_s),
    }
    print(outcome.line(f"F09 broker kill -9 x2 ({queue_type})"))

    assert password not in relay.log
    assert relay.count("reconnect attempt") >= 1, relay.log  # each attempt is logged
    assert relay.count("lost the connection") == 2, relay.log
    assert relay.returncode is None
    assert at_kills[0][0] > 0, at_kills  # in the steps at the first kill
    # At the second kill the steps' depths are not asserted: a quorum queue's count reads
    # 0 for a while after its node restarted (seen on a loaded machine: (0, 520) with the
    # messages due 33-45 s still to come, all delivered), and classic ones may have lost
    # their messages in the first kill.
    assert at_kills[1][1] > 0, at_kills  # waiting in the relay queue at the second kill
    assert after_restart, "no message fell due during an outage"
    assert max(after_restart) < 15_000_000, "messages due in an outage came late after it"
    if queue_type == "quorum" and missing:  # late (and how late) or lost, and where
        late = missing & {r.schedule_id for r in target.received}
        late_s = max((first[i].lateness_us / 1e6 for i in late), default=0.0)
        pytest.fail(
            f"{len(missing)} not received 30 s after the last due time: {len(late)} came "
            f"within {waited_for_missing_s:.0f} s more (at most {late_s:.1f} s late), "
            f"{len(missing - late)} never. Where they were then: {diagnosis}"
        )
    if queue_type == "quorum":
        # A crash repeats at most what was in flight: the relay's unacked deliveries and
        # each step queue's unconfirmed dead-letters. Nothing is lost.
        outcome.assert_exact(duplicates_allowed=outcome.kills * in_flight_max)
    else:
        # Reported above, not bounded: after a crash a classic queue gives back messages
        # already acked or expired (the broker had not yet written those removals: 11 to
        # 1,185 extra copies of 2,000, up to 3 of one message, in our runs), and it
        # dead-letters at-most-once, so a crash at the instant of expiry may lose a message
        # (none was lost in our runs). Still none early, every copy the scheduled one.
        everything = len(scheduled.due_us)
        outcome.assert_exact(duplicates_allowed=2 * everything, lost_allowed=everything)


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_f09_dead_lettering_across_a_broker_crash_with_no_relay_running(
    queue_type: str, private_broker: PrivateBroker
) -> None:
    """The broker's own part, measured: kill -9 while a step queue dead-letters 8 KiB messages
    into the relay queue (no relay: they wait there), and count what is left after restart."""
    node = private_broker
    settings = _node_settings(node, queue_type)
    topology = hopsched.Topology.from_settings(settings)
    count = 5000  # 40 MiB: more than one 16 MiB file of the classic message store
    scheduled = Schedule()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:  # all into the 4096 ms step
        await scheduled.add(scheduler, [4.2] * count, "nowhere", size=8192)
    connection = await aio_pika.connect(node.url)
    await wait_until_count(connection, topology.relay_queue, 3000, within=30, at_least=True)
    at_kill = await _depths(connection, settings)
    await node.kill()
    await node.start()

    connection = await aio_pika.connect(node.url)
    left = await _settled_depths(connection, settings)
    got = await get_all(connection, topology.relay_queue)
    await connection.close()
    copies = Counter(str(m.headers[HEADER_ID]) for m in got)
    lost = set(scheduled.due_us) - set(copies)
    duplicates = sum(n - 1 for n in copies.values())
    print(
        f"COVERAGE F09 dead-lettering across kill -9, no relay ({queue_type}): messages={count} "
        f"kills=1 restarts=1 lost={len(lost)} duplicates={duplicates} "
        f"ready_at_kill(steps,relay)={at_kill} after_restart(steps,relay)={left}"
    )

    assert at_kill[0] > 0, at_kill  # the kill came while the step queue was dead-lettering
    assert left[0] == 0
    assert set(copies) <= set(scheduled.due_us)
    if queue_type == "quorum":  # at-least-once: only the unconfirmed dead-letters repeat
        assert not lost
        assert duplicates <= QUORUM_DEAD_LETTER_WINDOW
    # classic: reported above, not asserted. It dead-letters at-most-once: in our runs the
    # crash lost 1,949 of these 5,000 (the ones waiting in the relay queue, not yet written
    # by the broker), while 5,000 messages of 16 bytes came through whole.


async def _settled_depths(
    connection: aio_pika.abc.AbstractConnection, settings: hopsched.Settings
) -> tuple[int, int]:
    """Depths once the steps are empty and nothing changed for 3 s (a quorum queue's count
    reads low for a few seconds while it recovers)."""
    last, stable_since = (-1, -1), time.monotonic()
    async with asyncio.timeout(90):
        while True:
            depths = await _depths(connection, settings)
            if depths != last:
                last, stable_since = depths, time.monotonic()
            elif depths[0] == 0 and time.monotonic() - stable_since >= 3:
                return depths
            await asyncio.sleep(0.2)
