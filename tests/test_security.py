"""Least privilege and TLS, on a private RabbitMQ node.

* A user holding only what ``hopsched permissions`` prints schedules, relays, lists
  parked messages and reads status; a target outside its permissions is parked.
* ``amqps://`` URLs with aio-pika's TLS options (``cafile``, ``certfile``, ``keyfile``)
  reach a node that requires a client certificate; a missing CA or client certificate
  gives one clear error, the password never shown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aio_pika
import aiormq
import pytest
from broker import PrivateBroker, seen_by_nodes
from support import Collector, Relays, hopsched_cli

import hopsched
from hopsched.localbroker import free_port

SECRET = "s3cret/#?pw"
PREFIX = "app-sched"


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


async def test_least_privilege_user_schedules_relays_and_parks(
    private_broker: PrivateBroker,
) -> None:
    status, command, err = await hopsched_cli(
        "permissions", "--prefix", PREFIX, "--user", "app", "--target-exchange", "orders"
    )
    assert status == 0, err
    await private_broker.rabbitmqctl("add_user", "app", SECRET)
    granted = shlex.split(command)
    assert granted[:2] == ["rabbitmqctl", "set_permissions"]
    await private_broker.rabbitmqctl(*granted[1:])
    print(f"\npermissions granted: {command.strip()}")

    port = private_broker.port
    app = hopsched.Settings(
        url=f"amqp://app:{quote(SECRET, safe='')}@127.0.0.1:{port}/", prefix=PREFIX
    )
    admin = await aio_pika.connect(private_broker.url)
    relays = Relays()
    try:
        orders = await declare_target(admin, "orders", "orders.timeout", "timeout")
        forbidden = await declare_target(admin, "forbidden", "forbidden.q", "x")
        await relays.start(app)
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
        await orders.wait_for_ids([s.schedule_id for s in good], within=30)
        orders.assert_never_early()
        parked = await consume(admin, f"{PREFIX}.parked")
        copies = await parked.wait_for(3, within=30)
        assert {c.schedule_id for c in copies} == {s.schedule_id for s in refused}
        for copy in copies:
            assert "access refused" in copy.headers["x-hopsched-parked-reason"]
        await asyncio.sleep(0.2)
        assert len(forbidden) == 0

        # The CLI's read-only commands work with the same grant; the password never shows.
        for args in (["status"], ["status", "--json"], ["declare"]):
            status, out, err = await hopsched_cli(*args, settings=app)
            assert status == 0, err
            assert SECRET not in out + err
            assert quote(SECRET, safe="") not in out + err

        # ... and the grant is really the least: nothing outside the prefix.
        connection = await aio_pika.connect(app.url)
        async with connection:
            for name in ("elsewhere", "orders.timeout"):
                channel = await connection.channel()
                with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                    await channel.declare_queue(name, durable=True)
            underlay = await (await connection.channel()).get_underlay_channel()
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await underlay.basic_get("orders.timeout")
        print(
            f"least privilege: {len(good)} delivered ({orders.lateness_line()}), "
            f"{len(refused)} to a forbidden exchange parked, 0 delivered there"
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
