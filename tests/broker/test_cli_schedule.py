"""``hopsched schedule``'s edges (issue 24, item 5): compound durations, the properties
and typed headers it can set, a past ``--at``, a body the broker refuses for its size;
and ``permissions`` with an empty user or vhost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import aio_pika
import pytest
from support import BROKER_URL, Relays, Targets, hopsched_cli, message_count, settings_env
from support.private_nodes import PrivateBroker
from support.proxy import BrokerProxy

import hopsched
from hopsched.broker.objects import declare_topology
from hopsched.core.clock import datetime_to_us, now_us


async def test_in_takes_a_compound_duration(settings: hopsched.Settings) -> None:
    await declare_topology(settings)

    before = now_us()
    status, out, err = await hopsched_cli(
        "schedule", "--in", "1m30s", "--routing-key", "q", settings=settings
    )
    after = now_us()  # the process's start takes seconds on a loaded machine

    assert status == 0, err
    due = datetime.fromisoformat(out.split()[3])
    assert datetime.fromtimestamp(before / 1e6, UTC) + timedelta(seconds=90) <= due
    assert due <= datetime.fromtimestamp(after / 1e6, UTC) + timedelta(seconds=90)


async def test_schedule_sets_every_property_and_typed_header_it_offers(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets
) -> None:
    target = await targets.queue()

    status, _, err = await hopsched_cli(
        *("schedule", "--in", "300ms", "--routing-key", target.name, "--body", "hi"),
        *("--message-id", "m-1", "--correlation-id", "c-1", "--expiration", "30s"),
        *("--priority", "7", "--transient", "--content-type", "text/plain"),
        *("--header", "s=text", "--header", "n:int=5", "--header", "f:float=1.5"),
        *("--header", "d:decimal=19.99", "--header", "b:bool=true"),
        *("--header", "t:datetime=2030-01-01T09:00:00+01:00"),
        *("--header", 'j:json={"a": [1, "x"]}', "--header", "a:b:str=c"),
        settings=settings,
    )

    assert status == 0, err
    (received,) = await target.wait_for(1, within=30)
    properties = received.properties
    assert (properties.message_id, properties.correlation_id) == ("m-1", "c-1")
    assert (properties.expiration, properties.priority) == ("30000", 7)
    assert (properties.delivery_mode, properties.content_type) == (1, "text/plain")
    headers = received.headers
    assert headers["s"] == "text"
    assert headers["n"] == 5
    assert headers["f"] == 1.5
    assert headers["d"] == Decimal("19.99")
    assert headers["b"] is True
    assert headers["t"] == datetime(2030, 1, 1, 8, tzinfo=UTC)
    assert headers["j"] == {"a": [1, "x"]}
    assert headers["a:b"] == "c"
    target.assert_never_early()


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ("n:int=abc", "not an int (write a whole number"),
        ("x:weird=1", "unknown header type 'weird'"),
        ("j:json={bad", "not a JSON table or array"),
        ("j:json=5", "that is a number; for a lone value use the type int"),
        ("j:json=null", "that is null"),
        ("b:bool=maybe", "write true or false"),
        ("t:datetime=2030-01-01T09:00:00", "add a UTC offset"),
        ("f:float=nan", "write a finite number"),
        ("big:int=99999999999999999999", "beyond a signed 64-bit integer"),
        (":int=5", "key is empty"),
    ],
)
async def test_a_header_its_type_refuses_is_bad_input(
    settings: hopsched.Settings, header: str, says: str
) -> None:
    if header.startswith("big:"):  # the others are refused before connecting (exit 2, not 4)
        await declare_topology(settings)

    status, out, err = await hopsched_cli(
        "schedule", "--in", "1h", "--routing-key", "q", "--header", header, settings=settings
    )

    assert status == 2, (out, err)
    assert says in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--expiration", "1.5ms"], "whole milliseconds"),
        (["--expiration", "1500us"], "whole milliseconds"),
        (["--expiration", "-1s"], "must be 0 or more"),
        (["--message-id", ""], "empty"),
        (["--correlation-id", ""], "empty"),
        (["--content-type", ""], "empty"),
    ],
)
async def test_a_property_option_the_help_does_not_allow_is_bad_input(
    option: list[str], says: str
) -> None:
    """Found by a trial: ``--expiration 1.5ms`` was sent as 1 ms (the help says whole ms),
    ``--message-id ''`` was dropped for the schedule id. Refused before connecting."""
    status, out, err = await hopsched_cli("schedule", "--in", "1h", "--routing-key", "q", *option)

    assert status == 2, (out, err)
    assert option[0] in err
    assert says in err
    assert out == ""


async def test_an_at_more_than_a_minute_past_is_delivered_at_once_with_a_warning(
    settings: hopsched.Settings, relays: Relays, targets: Targets
) -> None:
    await relays.start(settings)
    target = await targets.queue()
    long_ago = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    just_now = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()

    status, _, err = await hopsched_cli(
        "schedule", "--at", long_ago, "--routing-key", target.name, settings=settings
    )
    assert status == 0, err
    assert "in the past: it is due now and will be delivered at once" in err
    assert re.search(r"is 5m(\ds)? in the past", err), err  # (the CLI takes a second to start)
    status, _, err = await hopsched_cli(
        "schedule", "--at", just_now, "--routing-key", target.name, settings=settings
    )
    assert status == 0, err
    assert "in the past" not in err
    await target.wait_for(2, within=30)


@pytest.mark.parametrize("option", [["--user", ""], ["--user", " "], ["--vhost", ""]])
async def test_permissions_refuse_an_empty_user_or_vhost(option: list[str]) -> None:
    status, out, err = await hopsched_cli("permissions", *option)

    assert status == 2, (out, err)
    assert option[0] in err
    assert out == ""


@pytest.mark.slow
async def test_a_body_over_the_brokers_max_message_size_is_bad_input(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]], tmp_path: Path
) -> None:
    """Found by a new-user trial: a 200 MB body exited 1 (broker trouble). On a node whose
    max_message_size is 4 KiB (16 MiB by default on RabbitMQ 4.x), a 10 KB one. The limit
    is configured, not set at run time: RabbitMQ 4.0 reads it once at boot, so an
    ``application:set_env`` then changes nothing."""
    private_broker = await start_private_broker(config="max_message_size = 4096")
    settings = hopsched.Settings(url=private_broker.url, prefix="big")
    await declare_topology(settings)
    body = tmp_path / "body"
    body.write_bytes(b"x" * 10_000)

    status, out, err = await hopsched_cli(
        *("schedule", "--in", "1h", "--routing-key", "q", "--body-file", str(body)),
        settings=settings,
    )

    assert status == 2, (out, err)
    assert "message size 10000 is larger than configured max size 4096" in err
    assert len(err.strip().splitlines()) == 1


async def test_a_recurring_start_in_the_past_says_which_occurrence_the_relay_delivers(
    settings: hopsched.Settings, relays: Relays, targets: Targets
) -> None:
    """Found by a trial: ``--every 1h --start`` two days ago printed the start as the
    due time, and the relay delivered today's latest occurrence instead (catch_up
    latest). The warning names the one delivered; the relay delivers exactly that one."""
    await relays.start(settings)
    target = await targets.queue()
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=3)

    status, out, err = await hopsched_cli(
        *("schedule", "--every", "20s", "--start", start.isoformat(), "--count", "1"),
        *("--routing-key", target.name),
        settings=settings,
    )

    assert status == 0, err
    found = re.search(
        r"with --catch-up latest, the latest occurrence due by now \((\S+)\) is delivered "
        r"at once, the others not; and the schedule ends there",
        err,
    )
    assert found, err
    assert "first occurrence, in the past: see the warning" in out
    [received] = await target.wait_for(1, within=30)
    assert received.due_us == datetime_to_us(datetime.fromisoformat(found[1]))
    assert received.due_us > datetime_to_us(start)
    await target.settle(2.0)
    assert len(target.received) == 1


async def test_a_reschedule_more_than_a_minute_past_is_said(settings: hopsched.Settings) -> None:
    long_ago = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()

    status, _, err = await hopsched_cli(
        "reschedule", "nobody-knows", "--at", long_ago, settings=settings
    )

    assert status == 4, err  # the prefix was never declared: nothing changed, but said first
    assert re.search(r"--at \S+ is 5m(\ds)? in the past: it is due now", err), err


# --- Ctrl-C while the publish is in flight ----------------------------------------------


class ConfirmWithholdingProxy(BrokerProxy):
    """A TCP proxy to the broker that, once a client has sent ``marker`` (a message body),
    passes nothing more from the broker to any client: the publish reached the broker,
    its confirm never comes back."""

    def __init__(self, broker_url: str, marker: bytes) -> None:
        super().__init__(broker_url)
        self.marker = marker
        self.withholding = asyncio.Event()

    async def up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = b""
        with contextlib.closing(writer):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
                seen = seen[-len(self.marker) :] + data
                if self.marker in seen:
                    self.withholding.set()

    async def down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer):
            while data := await reader.read(65536):
                if self.withholding.is_set():
                    await asyncio.Event().wait()  # never: the client waits for its confirm
                writer.write(data)
                await writer.drain()


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_ctrl_c_during_the_publish_says_it_may_be_scheduled_and_how_to_check(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    await declare_topology(settings)
    body = f"interrupt-me-{uuid.uuid4().hex}".encode()
    proxy = ConfirmWithholdingProxy(BROKER_URL, body)
    async with proxy as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "hopsched", "schedule", "--in", "1h"),
            *("--routing-key", "q", "--body", body.decode()),
            env=dict(os.environ) | settings_env(settings) | {"HOPSCHED_URL": url},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_sigint_as_in_a_terminal,  # as a terminal's Ctrl-C finds it
        )
        await asyncio.wait_for(proxy.withholding.wait(), 30)  # published, unconfirmed
        await asyncio.sleep(0.2)
        process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), 15)

    assert process.returncode == 130, err.decode()
    assert out == b""
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    found = re.fullmatch(
        r"Error: interrupted: schedule ([0-9a-f]{32}) may or may not have been scheduled; check "
        r"with: hopsched get \1 \(unknown to it, it may still be on its way: to have it "
        r"once, schedule it again with --schedule-id \1 --replace\)",
        lines[0],
    )
    assert found, lines[0]
    # It was: the broker has the message in a step queue (no relay serves the prefix).
    topology = hopsched.Topology.from_settings(settings)
    counts = [await message_count(amqp, queue) for queue in topology.step_queues]
    assert sum(counts) == 1


async def test_the_same_schedule_id_twice_without_replace_is_scheduled_with_a_warning(
    settings: hopsched.Settings,
) -> None:
    await declare_topology(settings)
    schedule_id = f"order-{uuid.uuid4().hex}"

    async def schedule(*extra: str) -> str:
        status, out, err = await hopsched_cli(
            *("schedule", "--in", "1h", "--routing-key", "q", "--schedule-id", schedule_id),
            *extra,
            settings=settings,
        )
        assert status == 0, err
        assert out.startswith(f"scheduled {schedule_id} due ") or out.startswith(
            f"scheduled (replacing any before) {schedule_id} due "
        ), out
        return err

    assert "pending" not in await schedule()
    warned = await schedule()
    assert (
        f"{schedule_id} now has 2 messages pending: it was scheduled before, and --replace "
        "was not given, so each is delivered at its own due time. To keep only this one, "
        f"schedule it again with --replace; to cancel them all: hopsched cancel {schedule_id}"
    ) in warned
    assert " WARNING " in warned
    assert "pending" not in await schedule("--replace")  # the others cancelled, no read
    status, out, err = await hopsched_cli("get", schedule_id, "--json", settings=settings)
    assert status == 0, err
    assert json.loads(out)["pending_copies"] == 1


async def test_F43_an_at_before_2001_is_refused_naming_the_fix(settings: hopsched.Settings) -> None:
    await declare_topology(settings)

    status, out, err = await hopsched_cli(
        "schedule", "--at", "2000-12-31T23:00:00Z", "--routing-key", "q", settings=settings
    )

    assert (status, out) == (2, "")
    assert (
        "Error: at=2000-12-31T23:00:00+00:00 is before 2001-01-01: a relay parks so early a "
        "due time as a unit mistake (implausible_due); for at once, pass delay=0 (CLI: --in 0)"
    ) in err
