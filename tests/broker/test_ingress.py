"""The x-delay ingress (``hopsched.core.ingress``): the plugin's x-delay rules as a table and
as properties, and a delivery through a real relay and broker."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aio_pika
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import (
    Cleanup,
    Targets,
    broker_version,
    hopsched_cli,
    unique,
    until,
    wait_until_count,
)

import hopsched
from hopsched.amqp import Properties, Table
from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress, list_ingresses
from hopsched.broker.objects import declare
from hopsched.core.decide import ParkKind
from hopsched.core.envelope import HEADER_CREATED, HEADER_DUE, HEADER_ID, Envelope
from hopsched.core.ingress import (
    BROKER_TIMESTAMP_HEADER,
    DELAY_HEADER,
    Ingested,
    Ingress,
    IngressRegistry,
    NotIngested,
    delay_ms,
    ingest,
)
from hopsched.errors import InvalidSettingsError

NOW_US = 1_796_000_000_000_000


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        (0, 0),
        (-5000, 0),  # negative: now (and what the plugin writes on delivery)
        (1500, 1500),
        ("1500", 1500),  # string_delay_header
        (" 42 ", 42),
        (b"7", 7),
        (2.9, 2),  # the plugin truncates a float
        (2**32, 2**32),  # the plugin sends this at once (its issues #225, #227): kept
        (10 * 365 * 86_400_000, 10 * 365 * 86_400_000),
    ],
)
def test_x_delay_is_read_as_the_plugin_reads_it(value: Any, expected: int) -> None:
    assert delay_ms({} if value is None else {DELAY_HEADER: value}) == expected


@pytest.mark.parametrize(
    ("value", "named"),
    [("soon", "'soon'"), ("1.5", "'1.5'"), (True, "boolean"), (float("nan"), "nan"), ([1], "list")],
)
def test_an_x_delay_that_is_no_number_is_refused_naming_it(value: Any, named: str) -> None:
    with pytest.raises(ValueError, match="x-delay") as caught:
        delay_ms({DELAY_HEADER: value})
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("value", "delivered"),
    [(2500, -2500), ("2500", -2500), (2.9, -2), (0, 0), (-5000, -5000), ("-7", "-7")],
)
def test_x_delay_reads_as_the_plugin_delivers_it(value: Any, delivered: Any) -> None:
    """A delayed message's x-delay is swapped to -delay (an integer); one the plugin does
    not delay (zero or negative) it routes with its header untouched."""
    ingested = _ingest({DELAY_HEADER: value})
    assert isinstance(ingested, Ingested)
    assert ingested.properties.headers is not None
    assert ingested.properties.headers[DELAY_HEADER] == delivered


@pytest.mark.parametrize("value", [10**15, "99999999999999999999", 2**63 - 1])
def test_an_x_delay_past_the_year_9999_is_refused_naming_it(value: Any) -> None:
    """The plugin would deliver it at once; hopsched cannot keep its due time."""
    refused = _ingest({DELAY_HEADER: value}, message_id="far")
    assert isinstance(refused, NotIngested)
    assert "puts its due time after the year 9999" in refused.reason
    assert f"is {int(value)} ms" in refused.reason
    refused.properties.encode()  # parked as it came: its header unchanged


def test_a_refused_ingress_message_is_recorded_by_its_id_as_due_at_receipt() -> None:
    """What the journal records it as once parked (get() knows its id): due when it came,
    as the plugin would have delivered it; none for an id too long to be one."""
    refused = _ingest({DELAY_HEADER: "soon"}, message_id="order-7")
    assert isinstance(refused, NotIngested)
    assert refused.envelope == Envelope(
        schedule_id="order-7",
        due_us=NOW_US,
        exchange="p.due.orders",
        routing_key="eu.created",
        created_us=NOW_US,
    )
    too_long = _ingest({DELAY_HEADER: "soon"}, message_id="x" * 256)
    assert isinstance(too_long, NotIngested)
    assert too_long.envelope is None


def _ingest(headers: dict[str, Any] | None = None, **properties: Any) -> Ingested | NotIngested:
    return ingest(
        prefix="p",
        exchange="orders",
        routing_key="eu.created",
        properties=Properties(headers=Table.from_dict(headers), **properties),
        received_us=NOW_US,
    )


def test_an_ingress_message_is_due_at_receipt_plus_delay_for_its_due_exchange() -> None:
    ingested = _ingest(
        {DELAY_HEADER: 2500, "app": "kept"},
        message_id="order-42",
        content_type="application/json",
        priority=7,
        expiration="60000",
        delivery_mode=1,
    )

    assert isinstance(ingested, Ingested)
    envelope = ingested.envelope
    assert envelope == Envelope(
        schedule_id="order-42",
        due_us=NOW_US + 2_500_000,
        exchange="p.due.orders",
        routing_key="eu.created",
        expiration="60000",
        delivery_mode=1,
        created_us=NOW_US,
    )
    properties = ingested.properties
    assert properties.headers is not None
    assert properties.headers["app"] == "kept"
    assert properties.headers[DELAY_HEADER] == -2500  # as the plugin delivers it
    assert properties.headers[HEADER_ID] == "order-42"
    assert properties.headers[HEADER_DUE] == NOW_US + 2_500_000
    assert properties.headers[HEADER_CREATED] == NOW_US
    assert (properties.content_type, properties.priority) == ("application/json", 7)
    assert properties.expiration is None  # on the ladder it would expire the message
    assert properties.delivery_mode == 2  # persistent on the ladder, 1 again on delivery
    assert not ingested.stamped


def test_the_brokers_receipt_stamp_is_the_start_of_the_delay() -> None:
    stamp_ms = NOW_US // 1000 - 4000  # received 4 s before the relay took it
    ingested = _ingest({DELAY_HEADER: 10_000, BROKER_TIMESTAMP_HEADER: stamp_ms})

    assert isinstance(ingested, Ingested)
    assert ingested.stamped
    # the stamp is truncated to the ms: the delay starts at the end of that ms
    assert ingested.envelope.due_us == (stamp_ms + 1 + 10_000) * 1000
    assert ingested.envelope.created_us == (stamp_ms + 1) * 1000


def test_a_producers_own_hopsched_headers_cannot_choose_the_target() -> None:
    ingested = _ingest({"x-hopsched-exchange": "elsewhere", "x-hopsched-due": 1})

    assert isinstance(ingested, Ingested)
    assert ingested.envelope.exchange == "p.due.orders"
    assert ingested.envelope.due_us == NOW_US


def test_without_message_id_the_schedule_id_is_generated() -> None:
    first, second = _ingest(), _ingest()

    assert isinstance(first, Ingested)
    assert isinstance(second, Ingested)
    assert first.envelope.schedule_id.startswith("ingress-")
    assert first.envelope.schedule_id != second.envelope.schedule_id
    assert first.properties.message_id == first.envelope.schedule_id


@pytest.mark.parametrize(
    ("exchange", "headers", "reason"),
    [
        ("", {}, "published straight to p.ingress"),
        ("orders", {DELAY_HEADER: "tomorrow"}, "not a whole number of ms"),
    ],
)
def test_what_cannot_be_scheduled_is_said(
    exchange: str, headers: dict[str, Any], reason: str
) -> None:
    result = ingest(
        prefix="p",
        exchange=exchange,
        routing_key="k",
        properties=Properties(headers=Table.from_dict(headers)),
        received_us=NOW_US,
    )
    assert isinstance(result, NotIngested)
    assert reason in result.reason


@given(
    delay=st.one_of(st.integers(-(2**40), 2**40), st.integers(0, 2**40).map(str)),
    received_us=st.integers(0, 2**52),
    stamp_ms=st.one_of(st.none(), st.integers(1, 2**42)),
)
def test_never_due_before_the_start_plus_the_delay(
    delay: int | str, received_us: int, stamp_ms: int | None
) -> None:
    headers: dict[str, Any] = {DELAY_HEADER: delay}
    if stamp_ms is not None:
        headers[BROKER_TIMESTAMP_HEADER] = stamp_ms
    ingested = ingest(
        prefix="p",
        exchange="x",
        routing_key="",
        properties=Properties(headers=Table.from_dict(headers)),
        received_us=received_us,
    )
    assert isinstance(ingested, Ingested)
    start_us = (stamp_ms + 1) * 1000 if stamp_ms is not None else received_us
    assert ingested.envelope.due_us == start_us + max(0, int(delay)) * 1000
    assert Envelope.from_headers(ingested.properties.headers) == ingested.envelope


@pytest.mark.parametrize(
    ("exchange", "kind"), [("amq.orders", "direct"), ("", "direct"), ("a b", "topic"), ("o", "x")]
)
def test_a_bad_ingress_is_refused_naming_it(exchange: str, kind: Any) -> None:
    with pytest.raises(InvalidSettingsError, match="ingress"):
        Ingress(exchange, kind)


def test_the_registry_folds_declarations_and_removals() -> None:
    registry = IngressRegistry()
    for body in (
        IngressRegistry.declared(Ingress("b", "topic")),
        IngressRegistry.declared(Ingress("a", "direct", ("k",))),
        b"not json",
        IngressRegistry.removed("b"),
        IngressRegistry.declared(Ingress("c", "fanout")),
    ):
        assert registry.apply(body) is None
    assert registry.apply(IngressRegistry.marker("m1")) == "m1"
    assert registry.sorted() == [Ingress("a", "direct", ("k",)), Ingress("c", "fanout")]


def test_permissions_let_an_ingress_producer_write_its_exchange_only() -> None:
    topology = hopsched.Topology.from_settings(hopsched.Settings(prefix="p"))

    producer = topology.permissions("producer", ingress_exchanges=["orders", "a.b"])
    relay = topology.permissions("relay")

    assert (producer.configure, producer.write, producer.read) == ("^$", r"^(a\.b|orders)$", "^$")
    assert r"p\.(expired|relay|due\..+|lookups)" in relay.write
    assert "ingress" in relay.read


async def test_a_message_published_with_x_delay_is_delivered_through_the_due_exchange(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    targets: Targets,
    cleanup: Cleanup,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """A producer written for the plugin: publish to the exchange with x-delay (an int,
    a string, none); each arrives once, never before publish + delay, headers and
    properties as published, x-delay negated as the plugin delivers it; a routing key
    no consumer binds is parked with a reason, not dropped."""
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    target = await targets.queue()
    await bind_to_due_exchange(settings, exchange, target.name, "created")
    assert await list_ingresses(settings) == [Ingress(exchange, "direct")]
    channel = await amqp.channel(publisher_confirms=True)
    entry = await channel.get_exchange(exchange)
    published: dict[str, float] = {}
    for delay in (None, 0, 300, "700", 1200):
        published[str(delay)] = time.time()
        headers = {"app": "kept"} if delay is None else {DELAY_HEADER: delay, "app": "kept"}
        await entry.publish(
            aio_pika.Message(
                str(delay).encode(), headers=headers, content_type="text/plain", priority=3
            ),
            "created",
        )
    await entry.publish(aio_pika.Message(b"lost?", headers={DELAY_HEADER: 100}), "nobody")

    received = await target.wait_for(5, within=15)
    await target.settle(0.3)  # nothing more comes (once each)
    assert len(target) == 5
    for message in received:
        body = message.body.decode()
        delay_s = 0 if body == "None" else int(body) / 1000
        assert message.received_us / 1e6 >= published[body] + delay_s - 0.001, body
        assert message.headers["app"] == "kept"
        assert message.headers.get(DELAY_HEADER) == (None if body == "None" else -int(body))
        assert (message.properties.content_type, message.properties.priority) == ("text/plain", 3)
    topology = hopsched.Topology.from_settings(settings)
    parked = await amqp.channel()
    queue = await parked.declare_queue(topology.parked_queue, passive=True)
    await wait_until_count(amqp, topology.parked_queue, 1, within=10)
    got = await queue.get()
    assert got.body == b"lost?"
    assert "unroutable" in str(got.headers["x-hopsched-parked-reason"])
    await got.ack()
    assert relay.stats.ingested == 6


async def test_the_cli_replaces_an_exchange_of_that_name_with_the_consumers_bound_first(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    targets: Targets,
    cleanup: Cleanup,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """The migration's cut-over: an exchange of the name exists with another type (here
    a direct one, as the plugin's would be an x-delayed-message one): without --replace
    the declare is refused naming the way out; with it and --bind, the consumer's queue
    is bound to the due exchange and producers' messages arrive through it."""
    exchange = f"{settings.prefix}-legacy"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    target = await targets.queue()
    channel = await amqp.channel()
    await channel.declare_exchange(exchange, "fanout", durable=True)

    status, _, err = await hopsched_cli(
        "ingress", "declare", exchange, "--type", "direct", settings=settings
    )
    assert status == 1, err
    assert "--replace" in err

    status, out, err = await hopsched_cli(
        "ingress", "declare", exchange, "--type", "direct", "--replace",
        "--bind", f"{target.name}:created", settings=settings,
    )  # fmt: skip
    assert status == 0, err
    assert out.startswith(
        f"bound queue {target.name} to {settings.prefix}.due.{exchange} (key 'created')\n"
    )  # a trial: nothing said the --bind was done, and the hint said to bind again
    assert "(hopsched ingress bind" in out
    status, out, err = await hopsched_cli("ingress", "list", settings=settings)
    assert (status, out) == (0, f"{exchange} (direct) -> {settings.prefix}.due.{exchange}\n")
    published = time.time()
    confirming = await amqp.channel(publisher_confirms=True)
    await (await confirming.get_exchange(exchange)).publish(
        aio_pika.Message(b"x", headers={DELAY_HEADER: "400"}), "created"
    )
    [message] = await target.wait_for(1, within=10)
    assert message.received_us / 1e6 >= published + 0.4 - 0.001
    status, out, err = await hopsched_cli("ingress", "remove", exchange, settings=settings)
    assert status == 1
    assert "still has bindings" in err
    status, out, err = await hopsched_cli(
        "ingress", "remove", exchange, "--force", settings=settings
    )
    assert status == 0, err
    assert f"removed exchange {exchange}" in out


async def test_teardown_keeps_a_due_exchange_consumers_are_bound_to_as_ingress_remove_does(
    make_settings: Any, targets: Targets, cleanup: Cleanup
) -> None:
    """Without --force, `teardown` refuses as `ingress remove` does while a consumer's
    queue is bound to an ingress's due exchange, and removes nothing else (a rerun finds
    the ingresses again); with --force it removes it all (before: the bound due exchange
    went without a word)."""
    settings = make_settings()
    exchange = f"{settings.prefix}-orders"
    due = f"{settings.prefix}.due.{exchange}"
    cleanup.exchanges.update({exchange, due})
    target = await targets.queue()
    status, _, err = await hopsched_cli("declare", settings=settings)
    assert status == 0, err
    status, _, err = await hopsched_cli(
        "ingress",
        "declare",
        exchange,
        "--type",
        "direct",
        "--bind",
        f"{target.name}:k",
        settings=settings,
    )
    assert status == 0, err

    status, out, err = await hopsched_cli("teardown", settings=settings)
    assert status == 1, (out, err)
    assert f"not removed: {due} still bound" in err
    assert "--force" in err
    status, out, _ = await hopsched_cli("ingress", "list", settings=settings)
    assert (status, out) == (0, f"{exchange} (direct) -> {due}\n")  # nothing removed

    status, out, err = await hopsched_cli("teardown", "--force", settings=settings)
    assert status == 0, err
    assert f"removed {due}" in out
    assert f"removed {exchange}" in out
    assert f"removed {settings.prefix}.relay" in out


#: rabbitmq.conf's line for the broker's receipt stamp (RabbitMQ >= 3.12).
STAMP_CONFIG = "message_interceptors.incoming.set_header_timestamp.overwrite = false"


@pytest.mark.slow  # a private node (two where it stamps), a relay outage of 3 s
async def test_the_delay_starts_at_the_brokers_receipt_and_never_earlier_after_an_outage(
    start_private_broker: Any, relays: Any
) -> None:
    """A message published with x-delay 2 s while no relay runs, a relay started 3 s
    later. Where the broker stamps its receipt (RabbitMQ >= 3.12 with the timestamp
    interceptor), the due time is that stamp + 2 s: delivered at once when the relay
    comes. Where it does not (3.10), the delay starts at the relay's receipt: late by the
    outage, never early. Either way the message arrives once."""
    node = await start_private_broker()
    probe = await aio_pika.connect(node.url)
    version = broker_version(probe)
    await probe.close()
    stamped = version >= (3, 12)
    if stamped:  # the same test on a node that stamps
        node = await start_private_broker(config=STAMP_CONFIG)
    settings = hopsched.Settings(url=node.url, prefix=unique(), queue_type="quorum")
    relay = await relays.start(settings)
    exchange = f"{settings.prefix}-orders"
    await declare_ingress(settings, Ingress(exchange, "fanout"))
    connection = await aio_pika.connect(node.url)
    channel = await connection.channel(publisher_confirms=True)
    queue = await channel.declare_queue(unique("target"), durable=True)
    await bind_to_due_exchange(settings, exchange, queue.name)
    await relays.stop(relay)

    published = time.time()
    entry = await channel.get_exchange(exchange)
    await entry.publish(aio_pika.Message(b"x", headers={DELAY_HEADER: 2000}), "")
    await asyncio.sleep(3)
    restarted = time.time()
    relay = await relays.start(settings)
    message = await _wait_get(queue, 15)
    arrived = time.time()
    await message.ack()
    await connection.close()

    assert message.headers is not None
    due_us = int(message.headers["x-hopsched-due"])  # type: ignore[call-overload]
    if stamped:
        stamp_ms = int(message.headers[BROKER_TIMESTAMP_HEADER])  # type: ignore[call-overload]
        assert due_us == (stamp_ms + 1 + 2000) * 1000  # the end of the stamp's ms
        assert relay.stats.ingested_unstamped == 0
        assert arrived - restarted < 2  # overdue: at once, not 2 s more
    else:
        assert due_us >= int((restarted + 2) * 1e6) - 1000  # counted from the relay's receipt
        assert arrived >= restarted + 2 - 0.001
        assert relay.stats.ingested_unstamped == 1
    assert arrived >= published + 2 - 0.001  # never early


async def _wait_get(queue: aio_pika.abc.AbstractQueue, within: float) -> Any:
    async with asyncio.timeout(within):
        while True:  # basic.get: the broker signals no event for a message arriving
            if (message := await queue.get(fail=False)) is not None:
                return message
            await asyncio.sleep(0.05)


async def test_an_ingress_message_that_cannot_be_scheduled_is_parked_named_and_replayed_there(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Found by a new-user trial: a message with x-delay 'soon' was parked with no id or
    target (None/None), and a replay re-parked it as a malformed envelope, its reason
    lost. Parked, it is named by its message_id and due exchange; replayed, it goes back
    to its ingress exchange and is parked again for the same reason."""
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    channel = await amqp.channel(publisher_confirms=True)
    await (await channel.get_exchange(exchange)).publish(
        aio_pika.Message(b"x", headers={DELAY_HEADER: "soon"}, message_id="bad-soon"), "created"
    )
    topology = hopsched.Topology.from_settings(settings)
    await wait_until_count(amqp, topology.parked_queue, 1, within=10)

    status, out, err = await hopsched_cli("parked", "list", "--json", settings=settings)
    assert status == 0, err
    [parked] = json.loads(out)
    assert parked["schedule_id"] == "bad-soon"
    assert (parked["exchange"], parked["routing_key"]) == (
        f"{settings.prefix}.due.{exchange}",
        "created",
    )
    assert "'x-delay' is 'soon'" in parked["reason"]
    # get() knows it by its id (a trial: "the journal knows no schedule 'odd-soon'")
    async with hopsched.Scheduler(settings) as scheduler:
        async with asyncio.timeout(10):
            while (info := await scheduler.get("bad-soon")) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    assert info.state == "parked"
    assert info.parked_reason is not None
    assert "'x-delay' is 'soon'" in info.parked_reason
    assert info.exchange == f"{settings.prefix}.due.{exchange}"

    status, out, err = await hopsched_cli("parked", "replay", "--all", settings=settings)
    assert status == 0, err
    assert out.strip() == (
        f"replayed 1 message(s): 0 to {topology.relay_queue}, 1 to their ingress exchange"
    )
    await until(lambda: relay.stats.parked_by_kind[ParkKind.MALFORMED] == 2, within=10)
    await wait_until_count(amqp, topology.parked_queue, 1, within=10)
    status, out, err = await hopsched_cli("parked", "list", "--json", settings=settings)
    [again] = json.loads(out)
    assert again["schedule_id"] == "bad-soon"
    assert "'x-delay' is 'soon'" in again["reason"]


async def test_an_x_delay_past_the_year_9999_is_parked_saying_so_and_every_listing_works(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    cleanup: Cleanup,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Found by a new-user trial: x-delay 10^15 ms was recorded pending with a due time
    no datetime can name, and status, pending, parked list, get and cancel then failed
    with OverflowError for the whole prefix; a numeric string past 64 bits failed the
    relay on that delivery (a traceback, and parked with no id)."""
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    channel = await amqp.channel(publisher_confirms=True)
    entry = await channel.get_exchange(exchange)
    for schedule_id, delay in (("big-int", 10**15), ("big-str", "99999999999999999999")):
        message = aio_pika.Message(b"x", headers={DELAY_HEADER: delay}, message_id=schedule_id)
        await entry.publish(message, "created")
    await until(lambda: relay.stats.parked_by_kind[ParkKind.MALFORMED] == 2, within=10)
    topology = hopsched.Topology.from_settings(settings)
    await wait_until_count(amqp, topology.parked_queue, 2, within=10)

    status, out, err = await hopsched_cli("parked", "list", "--json", settings=settings)
    assert status == 0, err
    parked = {entry["schedule_id"]: entry["reason"] for entry in json.loads(out)}
    assert parked.keys() == {"big-int", "big-str"}
    for reason in parked.values():
        assert "puts its due time after the year 9999" in reason, reason
    for command in (["status"], ["pending"], ["parked", "list"]):
        status, out, err = await hopsched_cli(*command, settings=settings)
        assert "Traceback" not in err, (command, err)
        assert status == 0, (command, out, err)
    async with asyncio.timeout(20):  # get knows it by its message_id, once its record is read
        while (got := await hopsched_cli("get", "big-int", settings=settings))[0] == 3:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    status, out, err = got
    assert (status, "Traceback" in err) == (0, False), (out, err)
    assert "parked" in out, out
    assert relay.stats.rejected == 0  # parked by the relay, not handed back


async def test_status_exits_1_when_x_delay_messages_wait_in_the_ingress_with_no_relay(
    settings: hopsched.Settings, cleanup: Cleanup, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """Found by a new-user trial: with the relays stopped and messages waiting in the
    ingress queue, status said pending: 0 and exited 0."""
    topology = hopsched.Topology.from_settings(settings)
    await declare(topology, amqp)
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "fanout"))
    channel = await amqp.channel(publisher_confirms=True)
    entry = await channel.get_exchange(exchange)
    for index in range(3):
        await entry.publish(aio_pika.Message(b"x", headers={DELAY_HEADER: 1000}), f"k{index}")
    await wait_until_count(amqp, topology.ingress_queue, 3, within=10)

    status, out, err = await hopsched_cli("status", settings=settings)

    assert status == 1, (out, err)
    assert f"3 message(s) published with x-delay wait in {topology.ingress_queue}" in err
    assert "no relay consumes it" in err


async def test_a_relay_that_finds_the_ingress_queue_deleted_says_to_bind_the_ingresses_again(
    settings: hopsched.Settings,
    relays: Any,
    targets: Targets,
    cleanup: Cleanup,
    amqp: aio_pika.abc.AbstractConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``{prefix}.ingress`` deleted while no relay ran (an operator's repair of a queue
    that did not answer, docs/operations.md): status says so (exit 1), the next relay
    declares it, and says that
    the ingresses' bindings went with it and how to bind them; bound again so, an
    ``x-delay`` message arrives once, never early."""
    exchange = f"{settings.prefix}-orders"
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    topology = hopsched.Topology.from_settings(settings)
    relay = await relays.start(settings)
    await declare_ingress(settings, Ingress(exchange, "fanout"))
    target = await targets.queue()
    await bind_to_due_exchange(settings, exchange, target.name)
    await relays.stop(relay)
    channel = await amqp.channel(publisher_confirms=True)
    await channel.queue_delete(topology.ingress_queue)
    status, out, err = await hopsched_cli("status", settings=settings)
    assert status == 1, (out, err)
    assert f"{topology.ingress_queue} is missing (deleted?)" in err, err

    caplog.clear()
    await relays.start(settings)
    said = [r.getMessage() for r in caplog.records if "was missing: declared it" in r.getMessage()]
    assert len(said) == 1, said
    assert "hopsched ingress declare EXCHANGE --type TYPE" in said[0], said
    await declare_ingress(settings, Ingress(exchange, "fanout"))
    entry = await channel.get_exchange(exchange)
    published = time.time()
    await entry.publish(aio_pika.Message(b"x", headers={DELAY_HEADER: 300}), "")
    received = await target.wait_for(1, within=15)
    await target.settle(0.5)
    assert len(target) == 1
    assert received[0].received_us / 1e6 >= published + 0.3 - 0.001
