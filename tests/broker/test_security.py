"""Who may do what to a prefix (docs/security.md), on the real broker.

* Each role (producer, relay, operator) holding only what ``hopsched permissions``
  prints does its work; a target outside the relay's grant is parked.
* F30: hopsched's own objects are never a target; no message, by whatever route it
  reaches hopsched's queues or stream, cancels or moves a schedule it does not own when
  signing is on; with signing off the same attacks behave as docs/security.md says.
* F45: without keys, a record changes only the schedules of the RabbitMQ user that wrote
  it (and those whose user is unknown); a trusted user's, every one.
* Key rotation: a relay with keys [new, old] accepts both; without old, old-signed
  envelopes are parked with the reason.
* ``amqps://`` URLs with aio-pika's TLS options (``cafile``, ``certfile``, ``keyfile``)
  reach a node that requires a client certificate; a missing CA or client certificate
  gives one clear error, the password never shown.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import json
import logging
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aio_pika
import aiormq
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support import Collector, Relays, Targets, hopsched_cli, until, wait_until_count
from support.private_nodes import PrivateBroker, seen_by_nodes

import hopsched
import hopsched.core.envelope
from hopsched.core.cancel import CANCEL, RESCHEDULE, Record, encode_records
from hopsched.core.clock import now_us
from hopsched.core.signing import SigningKey
from hopsched.relay.metrics import RelayCollector
from hopsched.testing.localbroker import free_port

SECRET = "s3cret/#?pw"
PREFIX = "app-sched"
S = 1_000_000
ALICE = SigningKey("alice", b"alice's secret, 32 bytes long..")
MALLORY = SigningKey("mallory", b"mallory's secret, 32 bytes long")
NEW = SigningKey("2026-12", b"the new key's secret, 32 bytes.")
OLD = SigningKey("2026-06", b"the old key's secret, 32 bytes.")


def key_text(key: SigningKey) -> str:
    """``KEY-ID:SECRET`` as HOPSCHED_SIGNING_KEYS gives it."""
    return f"{key.key_id}:{base64.urlsafe_b64encode(key.secret).decode()}"


#: What ``hopsched status`` needs to check records as the tests' relays do.
RELAYS_KEYS = {
    "HOPSCHED_SIGNING_KEYS": f"{key_text(ALICE)},{key_text(MALLORY)}",
    "HOPSCHED_REQUIRE_SIGNATURES": "true",
}


async def consume(connection: aio_pika.abc.AbstractConnection, queue: str) -> Collector:
    channel = await (await connection.channel()).get_underlay_channel()
    collector = Collector(queue)
    await channel.basic_consume(queue, collector.on_message, no_ack=True)
    return collector


async def declare_target(
    connection: aio_pika.abc.AbstractConnection, exchange: str, queue: str, routing_key: str
) -> Collector:
    async with connection.channel() as channel:
        declared_exchange = await channel.declare_exchange(exchange, durable=True)
        declared_queue = await channel.declare_queue(queue, durable=True)
        await declared_queue.bind(declared_exchange, routing_key)
    return await consume(connection, queue)


async def publish(
    connection: aio_pika.abc.AbstractConnection,
    routing_key: str,
    body: bytes,
    headers: dict[str, Any] | None = None,
    exchange: str = "",
    user_id: str | None = None,
) -> None:
    """A raw publish, confirmed, as any user with write on the exchange can make it."""
    async with connection.channel(publisher_confirms=True) as channel:
        target = (
            channel.default_exchange
            if exchange == ""
            else await channel.get_exchange(exchange, ensure=False)
        )
        message = aio_pika.Message(body, headers=headers, delivery_mode=2, user_id=user_id)
        await target.publish(message, routing_key=routing_key)


async def grant(node: PrivateBroker, role: str, user: str, *targets: str) -> hopsched.Settings:
    """Add ``user`` with exactly ``hopsched permissions --role role``'s grant."""
    exchanges = [arg for target in targets for arg in ("--target-exchange", target)]
    status, command, err = await hopsched_cli(
        "permissions", "--prefix", PREFIX, "--role", role, "--user", user, *exchanges
    )
    assert status == 0, err
    granted = shlex.split(command)
    assert granted[:2] == ["rabbitmqctl", "set_permissions"]
    await node.rabbitmqctl("add_user", user, SECRET)
    await node.rabbitmqctl(*granted[1:])
    print(f"\n{role}: {command.strip()}")
    url = f"amqp://{user}:{quote(SECRET, safe='')}@127.0.0.1:{node.port}/"
    return hopsched.Settings(url=url, prefix=PREFIX, log_interval_s=1.0)


@pytest.mark.slow  # a private node and three users with their grants: over 20 s on 2 cores
async def test_each_role_holding_only_its_printed_grant_does_its_work(
    private_broker: PrivateBroker,
) -> None:
    operator = await grant(private_broker, "operator", "app-operator")
    relay = await grant(private_broker, "relay", "app-relay", "orders")
    app = await grant(private_broker, "producer", "app-producer")
    admin = await aio_pika.connect(private_broker.url)
    relays = Relays()
    try:
        orders = await declare_target(admin, "orders", "orders.timeout", "timeout")
        forbidden = await declare_target(admin, "forbidden", "forbidden.q", "x")
        status, out, err = await hopsched_cli("declare", settings=operator)
        assert status == 0, err
        relaying = await relays.start(dataclasses.replace(relay, lookups=True))
        async with hopsched.Scheduler(app) as scheduler:
            good = [
                await scheduler.schedule(
                    f"{i}".encode(), delay=0.1 * i, exchange="orders", routing_key="timeout"
                )
                for i in range(20)
            ]
            # The default exchange needs no grant beyond amq.default.
            good.append(await scheduler.schedule(b"d", delay=0.5, routing_key="orders.timeout"))
            refused = [
                await scheduler.schedule(b"f", delay=0.2, exchange="forbidden", routing_key="x")
                for _ in range(3)
            ]
            cancelled = await scheduler.schedule(b"c", delay=5, routing_key="orders.timeout")
            await scheduler.cancel(cancelled)
        await orders.wait_for_ids([s.schedule_id for s in good], within=30)
        orders.assert_never_early()
        parked = await consume(admin, f"{PREFIX}.parked")
        copies = await parked.wait_for(3, within=30)
        assert {c.schedule_id for c in copies} == {s.schedule_id for s in refused}
        for copy in copies:
            assert "access refused" in copy.headers["x-hopsched-parked-reason"]
        await asyncio.sleep(0.2)
        assert len(forbidden) == 0

        # A relay with its grant answers look-ups, to the operator's grant only: a
        # producer's may not ask (nor read the journal), and is refused as before.
        await until(lambda: relaying.lookups is not None and relaying.lookups.ready, within=10)
        assert relaying.lookups is not None
        async with hopsched.Scheduler(operator) as looking:
            info = await looking.get(good[0].schedule_id)
            assert info is not None
            assert info.state in ("pending", "held", "delivered")
            assert relaying.lookups.answered == 1
        async with hopsched.Scheduler(app) as producer:
            with pytest.raises(hopsched.AccessRefusedError, match="read permission"):
                await producer.get(good[0].schedule_id)

        # The operator's commands work with its grant; the password never shows.
        for args in (["status"], ["status", "--json"], ["declare"], ["parked", "list"]):
            status, out, err = await hopsched_cli(*args, settings=operator)
            assert status == 0, err
            assert SECRET not in out + err
            assert quote(SECRET, safe="") not in out + err
        # A producer's grant does not reach status (it checks arguments by declaring):
        # refused, naming the grant that does (a trial found it named none).
        status, out, err = await hopsched_cli("status", settings=app)
        assert status == 1, (out, err)
        assert "ACCESS_REFUSED" in err
        assert "the relay's or the operator's grant" in err
        assert SECRET not in out + err

        # ... and each grant is really the least: nothing outside the prefix, and the
        # relay may not read the parking queue.
        for settings, names in ((operator, ("elsewhere", "orders.timeout")), (relay, ("x",))):
            connection = await aio_pika.connect(settings.urls[0])
            async with connection:
                for name in names:
                    channel = await connection.channel()
                    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                        await channel.declare_queue(name, durable=True)
                underlay = await (await connection.channel()).get_underlay_channel()
                with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                    await underlay.basic_get(
                        "orders.timeout" if settings is operator else f"{PREFIX}.parked"
                    )
        await orders.settle(1.0)
        assert cancelled.schedule_id not in orders.counts()
        print(
            f"least privilege: {len(good)} delivered ({orders.lateness_line()}), "
            f"{len(refused)} to a forbidden exchange parked, 0 delivered there, "
            "1 cancelled by its producer"
        )
    finally:
        await relays.stop_all()
        await admin.close()


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""
    paths = {name: directory / f"{name}.pem" for name in ("ca", "server", "client")}
    keys = {name: directory / f"{name}.key" for name in paths}

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ca_subject = "/CN=hopsched-test-ca"
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", ca_subject,
        "-keyout", str(keys["ca"]), "-out", str(paths["ca"]))  # fmt: skip
    for name in ("server", "client"):
        csr = directory / f"{name}.csr"
        extensions = directory / f"{name}.ext"
        extensions.write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n" if name == "server" else "\n"
        )
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(keys[name]), "-out", str(csr))  # fmt: skip
        run("x509", "-req", "-in", str(csr), "-CA", str(paths["ca"]), "-CAkey", str(keys["ca"]),
            "-CAcreateserial", "-days", "1", "-extfile", str(extensions),
            "-out", str(paths[name]))  # fmt: skip
    return {**paths, **{f"{name}_key": key for name, key in keys.items()}}


TLS_CONFIG = """
listeners.ssl.default = 127.0.0.1:{port}
ssl_options.cacertfile = {ca}
ssl_options.certfile = {server}
ssl_options.keyfile = {server_key}
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
"""


@pytest.mark.slow  # a private node of its own and TLS listeners: over 20 s on 2 cores
async def test_amqps_with_tls_options_passes_through_to_aio_pika(
    start_private_broker: Any, node_tmp_path: Path
) -> None:
    certificates = make_certificates(node_tmp_path)
    port = free_port()
    seen = {name: seen_by_nodes(path) for name, path in certificates.items()}
    broker: PrivateBroker = await start_private_broker(TLS_CONFIG.format(port=port, **seen))
    await broker.rabbitmqctl("add_user", "app", SECRET)
    await broker.rabbitmqctl("set_permissions", "app", ".*", ".*", ".*")
    base = f"amqps://app:{quote(SECRET, safe='')}@127.0.0.1:{port}/"
    options = {
        "cafile": certificates["ca"],
        "certfile": certificates["client"],
        "keyfile": certificates["client_key"],
    }
    tls = hopsched.Settings(url=f"{base}?{urlencode(options)}", prefix=PREFIX)

    admin = await aio_pika.connect(broker.url)
    relays = Relays()
    try:
        target = await declare_target(admin, "tls", "tls.q", "k")
        await relays.start(tls)
        async with hopsched.Scheduler(tls) as scheduler:
            sent = [
                await scheduler.schedule(b"x", delay=0.2 * i, exchange="tls", routing_key="k")
                for i in range(5)
            ]
        await target.wait_for_ids([s.schedule_id for s in sent], within=30)
        target.assert_never_early()
    finally:
        await relays.stop_all()
        await admin.close()

    without_ca = {k: v for k, v in options.items() if k != "cafile"}
    without_cert = {"cafile": options["cafile"]}
    for query, says in ((without_ca, "CERTIFICATE_VERIFY_FAILED"), (without_cert, "certfile=")):
        settings = dataclasses.replace(tls, url=f"{base}?{urlencode(query)}")
        status, out, err = await hopsched_cli("status", settings=settings)
        assert status == 1, (out, err)
        assert says in err, err
        assert "Traceback" not in err
        assert SECRET not in err
        assert quote(SECRET, safe="") not in err
        print(f"\nTLS error: {err.strip()}")
    print(f"amqps: {len(sent)} delivered over TLS, client certificate: {target.lateness_line()}")


# --- F30: hopsched's own namespace, and records obeyed only from their owner ---------------


def own_targets(prefix: str) -> list[tuple[str, str]]:
    return [
        ("", f"{prefix}.relay"),
        ("", f"{prefix}.step.16"),
        ("", f"{prefix}.parked"),
        ("", f"{prefix}.cancelled"),
        (f"{prefix}.expired", "expired"),
    ]


async def test_F30_schedule_refuses_every_internal_target(
    make_settings: Callable[..., hopsched.Settings],
) -> None:
    settings = make_settings()
    scheduler = hopsched.Scheduler(settings)  # refused before it connects
    for exchange, routing_key in own_targets(settings.prefix):
        named = f"target exchange {exchange!r} routing key {routing_key!r}"
        with pytest.raises(hopsched.InvalidScheduleError, match=named):
            await scheduler.schedule(b"x", delay=1, exchange=exchange, routing_key=routing_key)
        request = hopsched.ScheduleRequest(b"x", routing_key, delay=1, exchange=exchange)
        with pytest.raises(hopsched.InvalidScheduleError, match=f"request 0: {named}"):
            await scheduler.schedule_many([request])
        status, out, err = await hopsched_cli(
            "schedule", "--in", "1s", "-x", exchange, "-k", routing_key, settings=settings
        )
        assert status == 2, (out, err)
        assert "hopsched's own namespace" in err
        assert routing_key in err
    assert scheduler.node is None  # nothing was declared or sent


async def test_F30_the_relay_parks_each_raw_internal_publish(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    settings = make_settings()
    relay = await relays.start(settings)
    topology = hopsched.Topology.from_settings(settings)
    parked = await targets.consume(topology.parked_queue)
    sent = {}
    for exchange, routing_key in own_targets(settings.prefix):
        for entry in (topology.step_queue(16), topology.relay_queue):
            schedule_id = f"{entry}->{exchange}/{routing_key}"
            envelope = hopsched.core.envelope.Envelope(schedule_id, now_us(), exchange, routing_key)
            await publish(amqp, entry, b"into hopsched", envelope.to_headers())
            sent[schedule_id] = routing_key
    copies = await parked.wait_for(len(sent), within=30)
    assert {copy.schedule_id for copy in copies} == set(sent)
    for copy in copies:
        assert "hopsched's own namespace" in copy.headers["x-hopsched-parked-reason"]
    # The relay counts a park once its copy is confirmed, which may be after the parking
    # queue's consumer has it (a CI run read 9 of 10 at once).
    internal = hopsched.ParkKind.INTERNAL_TARGET
    await until(lambda: relay.stats.parked_by_kind[internal] >= len(sent), within=10)
    assert relay.stats.parked_by_kind[internal] == len(sent)
    assert relay.stats.delivered == 0
    await until(lambda: relay.stats.record_tally.parked["internal_target"] == len(sent), 30)
    # nothing reached the queues or the stream it named
    assert relay.stats.delivered == relay.stats.hops == 0
    tally = relay.stats.record_tally
    assert (tally.signed, tally.unsigned, sum(tally.refused.values())) == (0, 0, 0)


@dataclasses.dataclass
class Victims:
    """Alice's schedules, one per route of attack, due together."""

    ids: dict[str, str]
    due_us: int
    #: Alice's ``get()`` of some victims after the attacks (before their due time, on
    #: a machine that is not overloaded).
    looked_up: dict[str, str] = dataclasses.field(default_factory=dict)


async def attack(
    settings: hopsched.Settings,
    mallory: hopsched.Scheduler,
    amqp: aio_pika.abc.AbstractConnection,
    victims: Victims,
    bound_exchange: str,
) -> None:
    """Every route a producer (Mallory) has to cancel or move Alice's schedules."""
    topology = hopsched.Topology.from_settings(settings)
    v = victims.ids
    later = 3600 * S

    # 1. through the API, with Mallory's own key (or none)
    await mallory.cancel(v["api cancel"])
    await mallory.reschedule(v["api reschedule"], delay=3600)
    # 2. schedule() to the cancel stream, with a record as the body: refused
    body = encode_records([Record(CANCEL, v["api cancel"], now_us())])
    with pytest.raises(hopsched.InvalidScheduleError):
        await mallory.schedule(body, delay=0, routing_key=topology.cancel_stream)
    # 3. straight into the stream through the default exchange, as the user both log in
    #    as: unsigned, and with a made-up MAC claiming Alice's key; and without a
    #    user_id, which reaches no schedule of a known user
    now, login = now_us(), mallory.settings.login
    await publish(
        amqp,
        topology.cancel_stream,
        encode_records([Record(CANCEL, v["stream cancel"], now)]),
        user_id=login,
    )
    await publish(
        amqp,
        topology.cancel_stream,
        encode_records([Record(RESCHEDULE, v["stream reschedule"], now, now + later)]),
        user_id=login,
    )
    await publish(
        amqp,
        topology.cancel_stream,
        encode_records([Record(CANCEL, v["stream forged mac"], now, key_id="alice", mac="0" * 64)]),
        user_id=login,
    )
    await publish(
        amqp, topology.cancel_stream, encode_records([Record(CANCEL, v["stream no user_id"], now)])
    )
    # 4. into a step queue and 5. into the relay queue: an envelope whose target is the
    #    stream and whose body is a record, unsigned and signed with Mallory's key
    for entry, name in ((topology.step_queue(16), "step"), (topology.relay_queue, "relay")):
        record = encode_records([Record(CANCEL, v[f"{name} envelope"], now_us())])
        envelope = hopsched.core.envelope.Envelope(
            f"m-{name}", now_us(), "", topology.cancel_stream, created_us=now_us()
        )
        await publish(amqp, entry, record, envelope.to_headers())
        signed = mallory.settings.signatures.sign_envelope(
            dataclasses.replace(envelope, schedule_id=f"m-{name}-signed"), record
        )
        await publish(amqp, entry, record, signed.to_headers())
    # 6. through an exchange an operator bound to the stream: the relay delivers it there
    record = encode_records([Record(CANCEL, v["bound exchange"], now_us())])
    await mallory.schedule(record, delay=0, exchange=bound_exchange, routing_key="")


async def run_attacks(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    *,
    signing: bool,
) -> tuple[hopsched.Relay, Collector, Collector, Victims, hopsched.Settings]:
    keys: dict[str, Any] = {}
    if signing:
        keys = {"signing_keys": (key_text(ALICE), key_text(MALLORY)), "require_signatures": True}
    relay_settings = make_settings(**keys)
    alice_settings = make_settings(signing_keys=(ALICE,) if signing else ())
    mallory_settings = make_settings(signing_keys=(MALLORY,) if signing else ())
    relay = await relays.start(relay_settings)
    topology = hopsched.Topology.from_settings(relay_settings)
    target = await targets.queue()
    parked = await targets.consume(topology.parked_queue)
    bound = await targets.exchange(kind=aio_pika.ExchangeType.FANOUT)
    await targets.bind(topology.cancel_stream, bound)
    routes = [
        "api cancel", "api reschedule", "stream cancel", "stream reschedule",
        "stream forged mac", "stream no user_id", "step envelope", "relay envelope",
        "bound exchange", "api cancel while held", "stream cancel while held",
    ]  # fmt: skip
    async with hopsched.Scheduler(alice_settings) as alice:
        due = await alice.schedule(b"control", delay=8, routing_key=target.name)
        ids = {}
        for route in routes:
            scheduled = await alice.schedule(route.encode(), at=due.due, routing_key=target.name)
            ids[route] = scheduled.schedule_id
        victims = Victims(ids, due.due_us)
        # Alice's own cancel and reschedule work, signed or not
        mine = await alice.schedule(b"mine", at=due.due, routing_key=target.name)
        moved = await alice.schedule(b"moved", at=due.due, routing_key=target.name)
        await alice.cancel(mine)
        await alice.reschedule(moved, delay=2)
        victims.ids["own cancel"] = mine.schedule_id
        victims.ids["own reschedule"] = moved.schedule_id
        async with hopsched.Scheduler(mallory_settings) as mallory:
            await attack(relay_settings, mallory, amqp, victims, bound)
            assert now_us() < victims.due_us - 2 * S, "the attacks took too long to test anything"
            # and while the relay holds the victims (their last 4 s)
            await asyncio.sleep((victims.due_us - now_us()) / S - 2.5)
            assert relay.stats.held_now() >= 3
            await mallory.cancel(ids["api cancel while held"])
            record = Record(CANCEL, ids["stream cancel while held"], now_us())
            await publish(
                amqp,
                topology.cancel_stream,
                encode_records([record]),
                user_id=mallory.settings.login,
            )
        for route in ("api cancel", "own cancel"):  # what Alice's look-ups show
            info = await alice.get(victims.ids[route])
            assert info is not None, route
            victims.looked_up[route] = info.state
    return relay, target, parked, victims, relay_settings


@pytest.mark.parametrize("signing", [True, False], ids=["signing on", "signing off"])
async def test_F30_forged_cancels_and_reschedules_by_every_route(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
    signing: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/security.md's table: with signing on, none of Mallory's routes changes
    Alice's schedules; with signing off and one RabbitMQ user for both, the API and the
    stream routes do (what the default-exchange grant allows), but a record without a
    ``user_id`` does not; the others are refused, parked or ignored. The relay logs the
    records it ignored as a WARNING (docs/security.md, "Watching it")."""
    caplog.set_level(logging.INFO, logger="hopsched.relay")
    relay, target, parked, victims, settings = await run_attacks(
        make_settings, relays, targets, amqp, signing=signing
    )
    v = victims.ids
    # the relay read every forged record before the due time
    tally = relay.stats.record_tally
    if signing:
        await until(lambda: tally.refused["unsigned"] >= 4 and tally.refused["bad_signature"] >= 1
                    and tally.refused["relayed"] >= 1, within=2)  # fmt: skip
    else:
        await until(lambda: tally.refused["relayed"] >= 1 and tally.unsigned >= 9, within=2)
    assert now_us() < victims.due_us, "the relay read the records too late to test anything"

    if signing:
        untouched = set(v) - {"own cancel", "own reschedule"}
        changed = {"own cancel", "own reschedule"}
    else:  # what docs/security.md says a producer can do without signing
        changed = {"api cancel", "api reschedule", "stream cancel", "stream reschedule",
                   "stream forged mac", "api cancel while held", "stream cancel while held",
                   "own cancel", "own reschedule"}  # fmt: skip
        untouched = set(v) - changed
    # look-ups agree with the relays: Mallory's cancel shows only where it applies
    assert victims.looked_up["own cancel"] == "cancelled"
    if signing:  # ignored by the relays: not shown as cancelled (delivered once due)
        assert victims.looked_up["api cancel"] != "cancelled", victims.looked_up
    else:
        assert victims.looked_up["api cancel"] == "cancelled", victims.looked_up
    await target.wait_for_ids({v[route] for route in untouched}, within=30)
    await asyncio.sleep(max(0.0, (victims.due_us - now_us()) / S) + 3.0)  # the moved one: +2 s
    delivered = target.counts()
    target.assert_never_early()
    late = {r.schedule_id: r.lateness_us for r in target.received}
    for route in untouched:
        assert delivered[v[route]] == 1, route
        assert late[v[route]] < 2 * S, f"{route}: moved"
    assert v["own cancel"] not in delivered
    assert late[v["own reschedule"]] >= 0  # at its new time, 2 s after the call
    for route in changed - {"own cancel", "own reschedule"}:
        assert v[route] not in delivered, f"{route}: not applied without signing?"

    # what reached hopsched's queues as an envelope was parked, with its reason
    kinds = {"m-step": "unsigned", "m-relay": "unsigned", "m-step-signed": "internal_target",
             "m-relay-signed": "internal_target"} if signing else {
             "m-step": "internal_target", "m-relay": "internal_target",
             "m-step-signed": "internal_target", "m-relay-signed": "internal_target"}  # fmt: skip
    copies = await parked.wait_for(len(kinds), within=30)
    assert {c.schedule_id for c in copies} == set(kinds)
    expected = collections.Counter(hopsched.ParkKind(kind) for kind in kinds.values())
    # counted once each copy is confirmed, maybe after the consumer has it
    await until(lambda: sum(relay.stats.parked_by_kind.values()) >= len(kinds), within=10)
    assert {kind: relay.stats.parked_by_kind[kind] for kind in expected} == expected

    # hopsched status and the metrics show what was refused
    await until(lambda: sum(tally.parked.values()) >= len(kinds), within=10)
    status, out, err = await hopsched_cli(
        "status", settings=settings, env=RELAYS_KEYS if signing else {"HOPSCHED_SIGNING_KEYS": ""}
    )
    assert status == 0, err
    registry = CollectorRegistry()
    registry.register(RelayCollector(relay.stats))
    metrics = generate_latest(registry).decode()
    records_line = next(line for line in out.splitlines() if line.startswith("records:"))
    parked_line = next(line for line in out.splitlines() if line.startswith("parked by relays"))
    print(f"\n{'signing on' if signing else 'signing off'}:\n  {records_line}\n  {parked_line}")
    assert "1 relayed" in records_line
    assert 'hopsched_records_refused_total{reason="relayed"} 1.0' in metrics
    if signing:
        assert "bad_signature" in records_line
        assert "unsigned" in records_line.split("ignored:")[1]
        assert "2 unsigned" in parked_line
        assert "2 internal_target" in parked_line
        assert 'hopsched_parked_total{kind="unsigned"} 2.0' in metrics
        assert 'hopsched_records_refused_total{reason="bad_signature"} 1.0' in metrics
    else:
        assert "4 internal_target" in parked_line
        assert 'hopsched_parked_total{kind="internal_target"} 4.0' in metrics
        assert 'hopsched_records_refused_total{reason="unsigned"} 0.0' in metrics

    # ignored after the relay caught up: its next interval report warns of them
    def warned() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "hopsched.relay" and r.levelno == logging.WARNING
            and "records of the cancel stream ignored since start" in r.getMessage()
        ]  # fmt: skip

    # the next interval report, bounded generously: the loop may lag on a loaded machine
    await until(lambda: bool(warned()), within=2 * settings.log_interval_s + 30)
    assert "relayed 1" in warned()[-1]


async def test_F30_key_rotation_new_and_old_then_new_alone(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """A relay with keys [new, old] accepts both, and a cancel signed by a producer
    holding [new, old] reaches an old-signed message; once old is dropped, an old-signed
    envelope is parked with the reason; with the key back, its replay is delivered."""
    rotating = make_settings(signing_keys=(NEW, OLD), require_signatures=True)
    rotated = dataclasses.replace(rotating, signing_keys=(NEW,))
    target = await targets.queue()
    relay = await relays.start(rotating)
    async with (
        hopsched.Scheduler(dataclasses.replace(rotating, signing_keys=(OLD,))) as old,
        hopsched.Scheduler(rotating) as both,
    ):
        by_old = await old.schedule(b"old", delay=0.5, routing_key=target.name)
        by_new = await both.schedule(b"new", delay=0.5, routing_key=target.name)
        doomed = await old.schedule(b"doomed", delay=3, routing_key=target.name)
        await both.cancel(doomed)
        await target.wait_for_ids({by_old.schedule_id, by_new.schedule_id}, within=30)
        await until(lambda: relay.stats.cancelled == 1, within=30)
        await relays.stop(relay)

        relay = await relays.start(rotated)
        stale = await old.schedule(b"stale", delay=0.5, routing_key=target.name)
        fresh = await both.schedule(b"fresh", delay=0.5, routing_key=target.name)
        await target.wait_for_ids({fresh.schedule_id}, within=30)
        await wait_until_count(amqp, f"{rotating.prefix}.parked", 1, within=30)
    status, out, err = await hopsched_cli("parked", "list", "--json", settings=rotated)
    assert status == 0, err
    (listed,) = json.loads(out)
    assert listed["schedule_id"] == stale.schedule_id
    assert "signed with key id '2026-06', which this process does not hold" in listed["reason"]
    assert listed["kind"] == hopsched.ParkKind.BAD_SIGNATURE
    await until(lambda: relay.stats.parked_by_kind[hopsched.ParkKind.BAD_SIGNATURE] >= 1, 10)
    assert relay.stats.parked_by_kind[hopsched.ParkKind.BAD_SIGNATURE] == 1
    assert doomed.schedule_id not in target.counts()
    assert stale.schedule_id not in target.counts()
    for key in (NEW, OLD):
        assert key.secret.decode() not in out

    await relays.stop(relay)  # the old key back: the parked one is delivered on replay
    await relays.start(rotating)
    status, out, err = await hopsched_cli("parked", "replay", "--all", settings=rotating)
    assert status == 0, err
    await target.wait_for_ids({stale.schedule_id}, within=30)
    target.assert_never_early()


@pytest.mark.slow  # a private node of its own and every route of attack: over 20 s on 2 cores
async def test_F30_a_producer_holding_only_its_grant_tries_every_attack(
    private_broker: PrivateBroker,
) -> None:
    """Mallory holds exactly the producer grant and a key of her own; the relay holds
    Alice's and Mallory's keys and requires signatures. Nothing she does changes Alice's
    schedules, reads or deletes anything of the prefix, or reaches a target herself."""
    operator = await grant(private_broker, "operator", "ops")
    relay_settings = dataclasses.replace(
        await grant(private_broker, "relay", "relay", "orders"),
        signing_keys=(ALICE, MALLORY),
        require_signatures=True,
    )
    alice_settings = dataclasses.replace(
        await grant(private_broker, "producer", "alice"), signing_keys=(ALICE,)
    )
    mallory_settings = dataclasses.replace(
        await grant(private_broker, "producer", "mallory"), signing_keys=(MALLORY,)
    )
    topology = hopsched.Topology.from_settings(operator)
    admin = await aio_pika.connect(private_broker.url)
    relays = Relays()
    try:
        orders = await declare_target(admin, "orders", "orders.timeout", "timeout")
        relay = await relays.start(relay_settings)
        async with hopsched.Scheduler(alice_settings) as alice:
            victims = [
                await alice.schedule(b"v", delay=6, exchange="orders", routing_key="timeout")
                for _ in range(4)
            ]
            mine = await alice.schedule(b"mine", delay=6, exchange="orders", routing_key="timeout")
            await alice.cancel(mine)
        mallory_connection = await aio_pika.connect(mallory_settings.urls[0])
        async with mallory_connection, hopsched.Scheduler(mallory_settings) as mallory:
            # the broker refuses her every configure and read, and the target exchange
            for what in (
                lambda ch: ch.queue_delete(topology.relay_queue),
                lambda ch: ch.queue_purge(topology.step_queue(16)),
                lambda ch: ch.queue_declare(f"{PREFIX}.mine", durable=True),
                lambda ch: ch.basic_get(topology.step_queue(4096)),
                lambda ch: ch.basic_get(topology.parked_queue),
                lambda ch: ch.basic_consume(topology.cancel_stream, lambda m: None),
                lambda ch: ch.basic_consume(topology.relay_queue, lambda m: None),
                lambda ch: ch.basic_consume(topology.journal_stream, lambda m: None),
            ):  # fmt: skip
                channel = await (await mallory_connection.channel()).get_underlay_channel()
                with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                    await what(channel)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await publish(mallory_connection, "timeout", b"direct", exchange="orders")
            # the API: her own key's records reach her own schedules only
            await mallory.cancel(victims[0])
            # reschedule() reads the journal (message copies): not with a producer's grant
            with pytest.raises(hopsched.AccessRefusedError, match="journal"):
                await mallory.reschedule(victims[1], delay=3600)
            with pytest.raises(hopsched.InvalidScheduleError):
                await mallory.schedule(b"x", delay=0, routing_key=topology.cancel_stream)
            # the default exchange: records straight into the stream (the broker takes
            # them: her grant allows it), and a hand-made envelope for a target only the
            # relay may write to (a confused deputy)
            now = now_us()
            await publish(mallory_connection, topology.cancel_stream, encode_records([
                Record(CANCEL, victims[2].schedule_id, now),
                Record(RESCHEDULE, victims[3].schedule_id, now, now + 3600 * S),
                Record(CANCEL, victims[3].schedule_id, now, key_id="alice", mac="0" * 64),
            ]))  # fmt: skip
            deputy = hopsched.core.envelope.Envelope(
                "deputy", now_us(), "orders", "timeout", created_us=now
            )
            await publish(
                mallory_connection, topology.step_queue(16), b"deputy", deputy.to_headers()
            )
            await publish(
                mallory_connection,
                topology.relay_queue,
                b"deputy",
                dataclasses.replace(deputy, schedule_id="deputy-2").to_headers(),
            )
        tally = relay.stats.record_tally
        await until(
            lambda: tally.refused["unsigned"] >= 2 and tally.refused["bad_signature"] >= 1, within=5
        )
        assert now_us() < victims[0].due_us, "too late to test anything"
        await orders.wait_for_ids([v.schedule_id for v in victims], within=30)
        await orders.settle(1.0)
        orders.assert_never_early()
        assert all(r.lateness_us < 2 * S for r in orders.received)
        assert set(orders.counts()) == {v.schedule_id for v in victims}  # mine cancelled
        parked = await consume(admin, topology.parked_queue)
        copies = await parked.wait_for(2, within=30)
        assert {c.schedule_id for c in copies} == {"deputy", "deputy-2"}
        unsigned = hopsched.ParkKind.UNSIGNED
        await until(lambda: relay.stats.parked_by_kind[unsigned] >= 2, within=10)
        assert relay.stats.parked_by_kind[unsigned] == 2
        # the operator sees it
        status, out, err = await hopsched_cli("status", settings=operator, env=RELAYS_KEYS)
        assert status == 0, err
        assert "ignored: 1 bad_signature, 2 unsigned" in out
        print(f"\nproducer grant: every attack failed; operator's status:\n{out}")
    finally:
        await relays.stop_all()
        await admin.close()


@pytest.mark.slow  # a private node and five users with their grants: over 20 s on 2 cores
async def test_F45_without_keys_a_record_changes_only_its_own_user_s_schedules(
    private_broker: PrivateBroker,
) -> None:
    """No signing keys. Alice and Mallory hold the producer grant each; "ops" and "ops2"
    the operator's, and only "ops" is in ``trusted_users`` (on the relay and the
    operators alike). Mallory's records, by every route she has (the API; the stream
    with her ``user_id``, without one, and naming Alice in ``own``), leave Alice's
    schedules alone, and reach her own and one whose user is unknown. ops's cancel
    reaches Alice's; ops2's does not, nor does its reschedule. Look-ups agree."""
    trusted = ("ops",)
    relay_settings = dataclasses.replace(
        await grant(private_broker, "relay", "relay", "orders"), trusted_users=trusted
    )
    ops = dataclasses.replace(await grant(private_broker, "operator", "ops"), trusted_users=trusted)
    ops2 = dataclasses.replace(
        await grant(private_broker, "operator", "ops2"), trusted_users=trusted
    )
    alice_settings = await grant(private_broker, "producer", "alice")
    mallory_settings = await grant(private_broker, "producer", "mallory")
    topology = hopsched.Topology.from_settings(ops)
    admin = await aio_pika.connect(private_broker.url)
    relays = Relays()
    try:
        orders = await declare_target(admin, "orders", "orders.timeout", "timeout")
        relay = await relays.start(relay_settings)
        routes = ["api", "stream", "stream no user_id", "stream own", "ops2 cancel", "ops2 move"]
        async with hopsched.Scheduler(alice_settings) as alice:
            first = await alice.schedule(b"api", delay=10, exchange="orders", routing_key="timeout")
            victims = {"api": first}
            for route in routes[1:]:
                victims[route] = await alice.schedule(
                    route.encode(), at=first.due, exchange="orders", routing_key="timeout"
                )
            mine = await alice.schedule(
                b"mine", at=first.due, exchange="orders", routing_key="timeout"
            )
            await alice.cancel(mine)
            by_ops = await alice.schedule(
                b"ops", at=first.due, exchange="orders", routing_key="timeout"
            )
        # an envelope whose user is unknown: hand-made, straight into the relay queue
        unowned = hopsched.core.envelope.Envelope(
            "unowned", first.due_us, "orders", "timeout", created_us=now_us()
        )
        alice_connection = await aio_pika.connect(alice_settings.urls[0])
        async with alice_connection:
            await publish(alice_connection, topology.relay_queue, b"?", unowned.to_headers())
        mallory_connection = await aio_pika.connect(mallory_settings.urls[0])
        async with mallory_connection, hopsched.Scheduler(mallory_settings) as mallory:
            hers = await mallory.schedule(
                b"hers", at=first.due, exchange="orders", routing_key="timeout"
            )
            await mallory.cancel(hers)
            await mallory.cancel(victims["api"])
            await mallory.cancel("unowned")
            now = now_us()
            for route, user_id, own in (
                ("stream", "mallory", None),
                ("stream no user_id", None, None),
                ("stream own", "mallory", "alice"),
            ):
                record = Record(CANCEL, victims[route].schedule_id, now, own=own)
                await publish(
                    mallory_connection,
                    topology.cancel_stream,
                    encode_records([record]),
                    user_id=user_id,
                )
        async with hopsched.Scheduler(ops) as operator:
            await operator.cancel(by_ops)
        # the CLI says a cancel that does not reach the schedule did nothing (exit 3)
        trust = {"HOPSCHED_TRUSTED_USERS": ",".join(trusted)}
        ops2_id = victims["ops2 cancel"].schedule_id
        code, out, err = await hopsched_cli("cancel", ops2_id, settings=ops2, env=trust)
        assert code == 3, (out, err)
        assert out.startswith(f"not cancelled {ops2_id}: schedule {ops2_id!r} stays"), out
        assert "not this login's to change" in out
        code, out, err = await hopsched_cli(
            "reschedule", victims["ops2 move"].schedule_id, "--in", "1h", settings=ops2, env=trust
        )
        assert code == 3, (out, err)
        assert "scheduled by RabbitMQ user 'alice'" in err, err
        async with hopsched.Scheduler(ops2) as other:
            assert await other.reschedule(victims["ops2 move"], delay=3600) is None
            looked_up = {
                name: (await other.get(scheduled.schedule_id)).state  # type: ignore[union-attr]
                for name, scheduled in {
                    "api": victims["api"], "ops2 cancel": victims["ops2 cancel"],
                    "mine": mine, "by ops": by_ops, "hers": hers,
                }.items()
            }  # fmt: skip
        assert now_us() < first.due_us - 2 * S, "the attacks took too long to test anything"
        print(f"\nlook-ups before the due time: {looked_up}")
        assert looked_up["mine"] == looked_up["by ops"] == looked_up["hers"] == "cancelled"
        assert looked_up["api"] != "cancelled"
        assert looked_up["ops2 cancel"] != "cancelled"

        expected = {scheduled.schedule_id for scheduled in victims.values()}
        await orders.wait_for_ids(expected, within=30)
        await asyncio.sleep(2.0)  # a cancelled one would come with them
        orders.assert_never_early()
        assert orders.counts() == {schedule_id: 1 for schedule_id in expected}
        late = {r.schedule_id: r.lateness_us for r in orders.received}
        assert late[victims["ops2 move"].schedule_id] < 2 * S, "moved by ops2"
        assert relay.stats.cancelled >= 4  # mine, by ops, hers, unowned
    finally:
        await relays.stop_all()
        await admin.close()
