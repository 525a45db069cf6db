"""The delayed-message plugin's own test suite (rabbitmq-delayed-message-exchange,
``test/plugin_SUITE.erl``) ported to hopsched's ``x-delay`` ingress, as acceptance tests.

Each test names the plugin case it ports. Where the plugin declares an
``x-delayed-message`` exchange ``E`` of ``x-delayed-type`` T and binds its queue to ``E``,
these declare the ingress ``Ingress(E, T)`` and bind the queue to the due exchange
``{prefix}.due.E`` (``bind_to_due_exchange``): producers still publish to ``E`` with an
``x-delay`` header. Outcomes asserted: each message delivered once, never early (arrival
>= publish instant + x-delay), in due order where the case says so (with the plugin's
delays ten times over: order is then an outcome, not a figure of lateness), its headers
intact (``x-delay`` reads ``-delay`` on delivery, as the plugin delivers it).

Not ported: ``wrong_exchange_argument_type`` and ``exchange_argument_type_not_self`` (the
plugin's exchange-declare validation: ``Ingress`` refuses a bad type itself, see
test_ingress_*), ``no_message_for_index`` (corrupts the plugin's Mnesia table) and the
``fine_stats`` group (channel metrics of the plugin's exchange).

Then the cases the plugin gets wrong: a delay over 2^32 - 1 ms (sent at once by the
plugin: its issues #225 and #227), an unroutable message (dropped by the plugin) and a
non-numeric ``x-delay`` (sent at once by the plugin).

The two node-restart cases are in the slow tier, on a private node.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aio_pika
import pytest
from support import (
    HEADER_PARKED_REASON,
    Cleanup,
    Collector,
    Relays,
    Targets,
    get_all,
    message_count,
    unique,
    wait_until_count,
)
from support.private_nodes import PrivateBroker

import hopsched
from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress
from hopsched.core.clock import now_us
from hopsched.core.ingress import Ingress

#: The plugin suite's delays (e2e_delay, delay_order, string_delay_header), ms.
PLUGIN_DELAYS = [500, 100, 300, 200, 100, 400]
#: The same, ten times over: the cases that check order use these. Order among messages
#: due 100 ms apart is a figure of lateness (a loaded machine made one 100 ms late, after
#: the next), so order is checked only between due times over ORDER_GAP_MS apart: it then
#: fails only if a message comes about a second late.
ORDERED_DELAYS = [10 * delay for delay in PLUGIN_DELAYS]
ORDER_GAP_MS = 500
#: A header of the producer's own, to see the headers arrive intact.
OWN_HEADER = ("x-producer-note", "kept as published")
#: 2^32 - 1 ms: the largest delay the plugin's timer takes (over it, it sends at once).
PLUGIN_MAX_DELAY_MS = 2**32 - 1


async def ingress(settings: hopsched.Settings, cleanup: Cleanup, kind: str, what: str = "x") -> str:
    """Declare an ingress of ``x-delayed-type`` ``kind`` (cleaned up after); its name."""
    name = unique(what)
    cleanup.exchanges.update({name, f"{settings.prefix}.due.{name}"})
    await declare_ingress(settings, Ingress(name, kind))  # type: ignore[arg-type]
    return name


async def publish(
    connection: aio_pika.abc.AbstractConnection,
    exchange: str,
    delays: Sequence[Any],
    routing_key: str = "",
    *,
    extra_headers: dict[str, Any] | None = None,
    message_id: str | None = None,
) -> list[tuple[int, int]]:
    """Publish one persistent message per delay (the ``x-delay`` value as given: an int, a
    string, ...), confirmed, body ``{"n": index, "delay": value}``, as the plugin's
    ``publish_messages``; return (index, publish instant µs) of each, taken before it."""
    sent = []
    async with connection.channel() as channel:  # publisher confirms
        target = await channel.get_exchange(exchange, ensure=False)
        for index, delay in enumerate(delays):
            headers: dict[str, Any] = {"x-delay": delay, OWN_HEADER[0]: OWN_HEADER[1]}
            headers |= extra_headers or {}
            if delay is None:
                del headers["x-delay"]
            body = json.dumps({"n": index, "delay": delay}).encode()
            instant = now_us()
            await target.publish(
                aio_pika.Message(
                    body,
                    headers=headers,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=message_id,
                ),
                routing_key,
            )
            sent.append((index, instant))
    return sent


def body_of(received: Any) -> dict[str, Any]:
    value = json.loads(received.body)
    assert isinstance(value, dict)
    return value


def delay_of(value: Any) -> int:
    return max(0, int(value)) if value is not None else 0


def assert_delivered_as_the_plugin(
    collector: Collector,
    delays: Sequence[Any],
    sent: list[tuple[int, int]],
    *,
    ordered: bool,
    unordered_between: tuple[int, int] | None = None,
) -> None:
    """Each message once, never early, headers intact; with ``ordered``, in due order,
    except among those due within ``unordered_between`` (wall-clock µs): a node restart,
    during which the due ones wait in several queues and come out together."""
    got = [body_of(r)["n"] for r in collector.received]
    assert sorted(got) == list(range(len(delays))), f"delivered (by index): {got}"
    published = dict(sent)
    for received in collector.received:
        n = body_of(received)["n"]
        delay = delay_of(delays[n])
        early_ms = (published[n] + delay * 1000 - received.received_us) / 1000
        assert early_ms <= 0, f"message {n} (x-delay {delays[n]!r}) came {early_ms:.1f} ms early"
        headers = received.headers
        assert headers["x-delay"] == -delay, headers  # swapped, as the plugin delivers it
        assert headers[OWN_HEADER[0]] in (OWN_HEADER[1], OWN_HEADER[1].encode()), headers
        assert received.properties.delivery_mode == 2
    if ordered:  # by each one's due time: its start (the broker's or the relay's receipt)
        # + x-delay; by x-delay alone only if publishing took no time (a loaded machine
        # took over 100 ms for six, and the last published was due after the first)
        dues = [received.due_us for received in collector.received]
        arrived = [delay_of(delays[n]) for n in got]
        start, end = unordered_between or (0, 0)
        checked = [not start <= due <= end for due in dues]
        inversions = [
            (arrived[i], arrived[j])
            for i in range(len(dues))
            for j in range(i + 1, len(dues))
            if checked[i] and checked[j] and dues[i] - dues[j] > ORDER_GAP_MS * 1000
        ]
        assert not inversions, (
            f"came before one due over {ORDER_GAP_MS} ms earlier (x-delay, x-delay): "
            f"{inversions}; arrival order by x-delay {arrived}, due times {dues}"
        )


async def routing_case(
    settings: hopsched.Settings,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    kind: str,
    bindings: Sequence[tuple[str, dict[str, Any] | None]],
    keys: Sequence[tuple[str, dict[str, Any] | None]],
    routed: int,
) -> None:
    """The plugin's ``routing_test0``: bind one queue with each binding, publish one
    message with delay 0 per key, and count what reached the queue. hopsched also parks
    each one no binding matches (the plugin drops it)."""
    name = await ingress(settings, cleanup, kind)
    queue = await targets.queue(consume=False)
    for key, arguments in bindings:
        await bind_to_due_exchange(settings, name, queue.name, key, arguments)
    for key, headers in keys:
        await publish(amqp, name, [0], key, extra_headers=headers)
    await wait_until_count(amqp, queue.name, routed, within=10)
    unroutable = len(keys) - routed
    parked = hopsched.Topology.from_settings(settings).parked_queue
    await wait_until_count(amqp, parked, unroutable, within=10)
    await asyncio.sleep(0.5)  # nothing more comes
    assert await message_count(amqp, queue.name) == routed
    assert await message_count(amqp, parked) == unroutable
    for message in await get_all(amqp, queue.name):
        assert message.headers["x-delay"] == 0


# --- the plugin's cases ------------------------------------------------------------------


async def test_routing_topic(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE routing_topic: bindings a.b.c, a.*.c, a.# ; keys a.b.c, a.z.c, a.j.k,
    b.b.c: all but b.b.c routed (one copy each to the one queue)."""
    bindings = [("a.b.c", None), ("a.*.c", None), ("a.#", None)]
    keys = [("a.b.c", None), ("a.z.c", None), ("a.j.k", None), ("b.b.c", None)]
    await routing_case(settings, cleanup, targets, amqp, "topic", bindings, keys, 3)


async def test_routing_direct(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE routing_direct: binding mykey; keys mykey, noroute, mykey: 2 routed."""
    keys = [("mykey", None), ("noroute", None), ("mykey", None)]
    await routing_case(settings, cleanup, targets, amqp, "direct", [("mykey", None)], keys, 2)


async def test_routing_fanout(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE routing_fanout: bindings mykey, "", otherkey; keys mykey, noroute,
    mykey: all 3 routed (fanout ignores keys)."""
    bindings = [("mykey", None), ("", None), ("otherkey", None)]
    keys = [("mykey", None), ("noroute", None), ("mykey", None)]
    await routing_case(settings, cleanup, targets, amqp, "fanout", bindings, keys, 3)


async def test_routing_headers(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE routing_test0 with x-delayed-type headers (the suite has topic,
    direct and fanout): bindings x-match all kind=a, x-match any colour=red|size=9;
    messages kind=a, colour=red, kind=b, size=1: 2 routed."""
    bindings: list[tuple[str, dict[str, Any] | None]] = [
        ("", {"x-match": "all", "kind": "a"}),
        ("", {"x-match": "any", "colour": "red", "size": 9}),
    ]
    keys: list[tuple[str, dict[str, Any] | None]] = [
        ("k", {"kind": "a"}),
        ("k", {"colour": "red"}),
        ("k", {"kind": "b"}),
        ("k", {"size": 1}),
    ]
    await routing_case(settings, cleanup, targets, amqp, "headers", bindings, keys, 2)


async def e2e_case(
    settings: hopsched.Settings,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    delays: Sequence[int],
) -> None:
    """The plugin's ``e2e_test0``: exchange Ex (delayed, direct) bound to exchange Ex2
    (direct) with a queue: here the due exchange of Ex is bound to Ex2."""
    name = await ingress(settings, cleanup, "direct")
    second = await targets.exchange(unique("x2"))
    queue = await targets.queue()
    await targets.bind(queue.name, second)
    channel = await targets.channel()
    due = await channel.get_exchange(f"{settings.prefix}.due.{name}", ensure=False)
    await (await channel.get_exchange(second, ensure=False)).bind(due, routing_key="")
    sent = await publish(amqp, name, delays)
    await queue.wait_for(len(delays), within=max(delays) / 1000 + 5)
    await queue.settle(0.5)
    assert_delivered_as_the_plugin(queue, delays, sent, ordered=True)


async def test_e2e_nodelay(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE e2e_nodelay: x-delay 0, through an exchange-to-exchange binding."""
    await e2e_case(settings, cleanup, targets, amqp, [0])


async def test_e2e_delay(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE e2e_delay: its delays (500, 100, 300, 200, 100, 400 ms) ten times over,
    through an exchange-to-exchange binding (the due exchange bound to another exchange
    with a queue), delivered in due order."""
    await e2e_case(settings, cleanup, targets, amqp, ORDERED_DELAYS)


async def delay_order_case(
    settings: hopsched.Settings,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    delays: Sequence[Any],
) -> None:
    name = await ingress(settings, cleanup, "direct")
    queue = await targets.queue()
    await bind_to_due_exchange(settings, name, queue.name, "")
    sent = await publish(amqp, name, delays)
    await queue.wait_for(len(delays), within=max(delay_of(d) for d in delays) / 1000 + 5)
    await queue.settle(0.5)
    assert_delivered_as_the_plugin(queue, delays, sent, ordered=True)


async def test_delay_order(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE delay_order: its delays (500, 100, 300, 200, 100, 400 ms) ten times over
    arrive sorted."""
    await delay_order_case(settings, cleanup, targets, amqp, ORDERED_DELAYS)


async def test_string_delay_header(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE string_delay_header: the same delays as longstr headers ("5000", ...):
    read as numbers, delivered sorted; on delivery x-delay is the integer -delay."""
    await delay_order_case(settings, cleanup, targets, amqp, [str(d) for d in ORDERED_DELAYS])


async def test_delayed_messages_count(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """plugin_SUITE delayed_messages_count: six messages (500, 200, 300, 200, 300, 400 ms)
    count as delayed before they are due (the plugin's ``messages_delayed``; here the
    relay's ``stats.ingested`` and ``Scheduler.pending()``), and all arrive."""
    delays = [1500, 1200, 1300, 1200, 1300, 1400]  # the plugin's, + 1 s: time to count
    name = await ingress(settings, cleanup, "direct")
    queue = await targets.queue()
    await bind_to_due_exchange(settings, name, queue.name, "")
    ingested_before = relay.stats.ingested
    journaled_before = relay.stats.journal_records
    ids = [f"count-{uuid.uuid4().hex[:8]}-{n}" for n in range(len(delays))]
    sent = []
    for message_id, delay in zip(ids, delays, strict=True):
        [(_, instant)] = await publish(amqp, name, [delay], message_id=message_id)
        sent.append(instant)
    # Ingested, and their journal records confirmed: the relay counts a message ingested
    # before its record, written in a batch, is in the journal that pending() reads.
    async with asyncio.timeout(5):
        while (  # noqa: ASYNC110
            relay.stats.ingested - ingested_before < len(delays)
            or relay.stats.journal_records - journaled_before < len(delays)
        ):
            await asyncio.sleep(0.02)
    pending = {info.schedule_id: info async for info in scheduler.pending()}
    assert len(queue) == 0  # none due yet
    assert set(pending) == set(ids), pending
    for message_id, delay, instant in zip(ids, delays, sent, strict=True):
        info = pending[message_id]
        assert info.state in ("pending", "held"), info
        assert info.exchange == f"{settings.prefix}.due.{name}"
        assert 0 <= info.due_us - (instant + delay * 1000) < 2_000_000, info
    await queue.wait_for(len(delays), within=8)
    await queue.settle(0.5)
    assert sorted(r.schedule_id for r in queue.received) == sorted(ids)
    assert [info async for info in scheduler.pending()] == []


# --- what the plugin gets wrong ----------------------------------------------------------


async def test_delay_over_plugin_maximum_stays_pending(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Plugin issues #225/#227: an x-delay over 2^32 - 1 ms is sent at once by the plugin.
    hopsched keeps it pending (for ~49.7 days), due at its receipt + x-delay."""
    name = await ingress(settings, cleanup, "direct")
    queue = await targets.queue()
    await bind_to_due_exchange(settings, name, queue.name, "")
    delays = [PLUGIN_MAX_DELAY_MS + 1, PLUGIN_MAX_DELAY_MS + 1000, 2**40]
    ids = [f"huge-{uuid.uuid4().hex[:8]}-{n}" for n in range(len(delays))]
    instants = []
    for message_id, delay in zip(ids, delays, strict=True):
        [(_, instant)] = await publish(amqp, name, [delay], message_id=message_id)
        instants.append(instant)
    parked = hopsched.Topology.from_settings(settings).parked_queue
    await asyncio.sleep(3)
    assert len(queue) == 0, "a delay over 2^32 - 1 ms was delivered"
    assert await message_count(amqp, parked) == 0
    for message_id, delay, instant in zip(ids, delays, instants, strict=True):
        info = await scheduler.get(message_id)
        assert info is not None, message_id
        assert info.state == "pending", info
        expected = instant + delay * 1000
        assert 0 <= info.due_us - expected < 5_000_000, (info.due_us - expected, info)


async def test_unroutable_message_is_parked_not_dropped(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """The plugin drops a delayed message no binding routes when due (nor can it return
    it: mandatory is lost). hopsched parks it in {prefix}.parked with the reason."""
    name = await ingress(settings, cleanup, "direct")
    queue = await targets.queue()
    await bind_to_due_exchange(settings, name, queue.name, "bound")
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    sent = await publish(amqp, name, [300], "nobody-binds-this")
    await parked.wait_for(1, within=5)
    await parked.settle(0.5)
    assert len(parked) == 1
    assert len(queue) == 0
    got = parked.received[0]
    assert got.received_us >= sent[0][1] + 300_000  # parked when due, not before
    reason = got.headers[HEADER_PARKED_REASON]
    reason = reason.decode() if isinstance(reason, bytes) else reason
    assert "unroutable" in reason, reason
    assert "nobody-binds-this" in reason, reason
    assert body_of(got) == {"n": 0, "delay": 300}


@pytest.mark.parametrize("value", ["soon", "12ms", "", "1e3x", "0x10", True, [500]])
async def test_non_numeric_delay_is_parked_not_sent(
    value: Any,
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """The plugin sends a message whose x-delay is no number at once; hopsched parks it,
    with a reason naming x-delay. (A float infinity is not tried: RabbitMQ 3.10 closes
    the producer's connection with INTERNAL_ERROR on it, before hopsched sees it.)"""
    name = await ingress(settings, cleanup, "direct")
    queue = await targets.queue()
    await bind_to_due_exchange(settings, name, queue.name, "")
    parked = await targets.consume(hopsched.Topology.from_settings(settings).parked_queue)
    await publish(amqp, name, [value])
    await parked.wait_for(1, within=5)
    await parked.settle(0.5)
    assert len(queue) == 0, "a non-numeric x-delay was delivered"
    assert len(parked) == 1
    reason = parked.received[0].headers[HEADER_PARKED_REASON]
    reason = reason.decode() if isinstance(reason, bytes) else reason
    assert "x-delay" in reason, reason


# --- node restarts (slow tier) -----------------------------------------------------------


async def restart_case(
    node: PrivateBroker, relays: Relays, delays: Sequence[int], *, wait_s: float, how: str
) -> None:
    """Durable ingress (direct) and durable queue on a private node, a relay in-process;
    publish ``delays``, wait ``wait_s``, restart the node (``how``: kill or stop), then
    consume: every message once, never early, in due order except among those due while
    the node or the relay was away."""
    settings = hopsched.Settings(url=node.url, prefix=unique(), log_interval_s=5.0)
    relay = await relays.start(settings)
    name = unique("x")
    await declare_ingress(settings, Ingress(name, "direct"))
    queue_name = unique("q")
    connection = await aio_pika.connect(node.url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue_name, durable=True)
        await bind_to_due_exchange(settings, name, queue_name, "")
        if how == "kill":
            # A node killed soon after a declaration can come back without it
            # (docs/operations.md, 'Declared just before a crash'): its first stream
            # down for good within 3 min on RabbitMQ 3.10, a moment on 4.0; on 4.0.5
            # (Mnesia) this binding, made 0.2 s before the kill, came back missing in 2
            # of 4 runs, every message then parked as unroutable. The setup is not
            # what this test is about: it settles before the publishes.
            await asyncio.sleep(15 if node.installation.version.startswith(("4", "5")) else 185)
        sent = await publish(connection, name, delays)
    await asyncio.sleep(wait_s)
    restarted = time.monotonic()
    restarted_us = now_us()
    if how == "kill":
        await node.kill()
    else:
        await node.stop()
    await node.start()
    print(f"node restarted in {time.monotonic() - restarted:.1f} s")
    back = asyncio.create_task(relay_reconnected_us(relay))
    collector = Collector(queue_name)
    connection = await aio_pika.connect(node.url)
    async with connection:
        channel = await connection.channel()
        underlay = await channel.get_underlay_channel()
        await underlay.basic_consume(queue_name, collector.on_message, no_ack=True)
        try:
            # After a kill -9 a node recovers its streams (the cancel stream the relay
            # reads first) in tens of seconds on a loaded machine.
            recovery_s = 150 if how == "kill" else 30
            await collector.wait_for(len(delays), within=max(delays) / 1000 + recovery_s)
        finally:
            topology = hopsched.Topology.from_settings(settings)
            depths = {
                q: await message_count(connection, q)
                for q in (topology.ingress_queue, topology.relay_queue, topology.parked_queue)
            }
            steps = [await message_count(connection, q) for q in topology.step_queues]
            print(f"depths {depths} steps {steps} stats {relay.stats.snapshot()}")
        await collector.settle(2.0)
    published = dict(sent)
    for r in collector.received:
        n = body_of(r)["n"]
        late_ms = (r.received_us - published[n]) / 1000 - delays[n]
        print(f"x-delay {delays[n]} arrived {late_ms:.0f} ms after due, id {r.schedule_id}")
    back_us = await asyncio.wait_for(back, 30)  # the relay's back-off reaches 5 s
    # Due while the node was down or the relay away, a message waits in its step queue or
    # the relay queue, and all such come out together when both are back: in any order
    # (a CI run saw x-delay 1000 after 2000 and 3000, all three overdue at the restart).
    window = (restarted_us, back_us + ORDER_GAP_MS * 1000)
    assert_delivered_as_the_plugin(collector, delays, sent, ordered=True, unordered_between=window)


async def relay_reconnected_us(relay: hopsched.Relay) -> int:
    """When (wall clock, µs) the relay counted its first reconnect."""
    while relay.stats.reconnects < 1:  # noqa: ASYNC110 (a counter: it signals nothing)
        await asyncio.sleep(0.02)
    return now_us()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_node_restart_before_delay_expires(
    how: str, private_broker: PrivateBroker, relays: Relays
) -> None:
    """plugin_SUITE node_restart_before_delay_expires: delays 5, 10, 3, 2, 15, 1, 4 s; the
    node restarts at once; all arrive, in due order."""
    delays = [5000, 10000, 3000, 2000, 15000, 1000, 4000]
    await restart_case(private_broker, relays, delays, wait_s=0.2, how=how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_node_restart_after_delay_expires(
    how: str, private_broker: PrivateBroker, relays: Relays
) -> None:
    """plugin_SUITE node_restart_after_delay_expires: delays 5, 1, 3, 2, 1, 4 s; the node
    restarts after max + 3 s (all delivered into the durable queue, unconsumed); after
    it, every message is there once, in due order."""
    delays = [5000, 1000, 3000, 2000, 1000, 4000]
    await restart_case(private_broker, relays, delays, wait_s=max(delays) / 1000 + 3, how=how)
