"""The ``hopsched`` command, run as a user runs it: a subprocess against the real broker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from datetime import datetime
from urllib.parse import quote

import aio_pika
import aiormq
import pytest
from support import Targets, hopsched_cli

import hopsched
from hopsched.clock import datetime_to_us

SECRET = "pa/ss#w?rd-s3cret"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["--in", "5"], "not a duration", id="duration-without-unit"),
        pytest.param(["--in", "abc"], "not a duration", id="duration-garbage"),
        pytest.param(["--in", "10000000000d"], "too long", id="duration-overflow"),
        pytest.param(["--at", "2030-01-01T09:00:00"], "2030-01-01T09:00:00Z", id="naive-at"),
        pytest.param(["--at", "2030-01-01"], "2030-01-01T00:00:00Z", id="date-only-at"),
        pytest.param(["--at", "tomorrow"], "ISO 8601", id="at-garbage"),
        pytest.param(["--in", "1s", "--at", "2030-01-01T09:00:00Z"], "exactly one", id="both"),
        pytest.param([], "exactly one", id="neither"),
        pytest.param(["--in", "1s", "--header", "novalue"], "K=V", id="header-without-equals"),
        pytest.param(["--in", "1s", "--header", "x-hopsched-due=5"], "hopsched's own", id="ours"),
    ],
)
async def test_schedule_rejects_bad_input_with_usage_error(args: list[str], says: str) -> None:
    status, out, err = await hopsched_cli("schedule", "--routing-key", "q", *args)

    assert status == 2, (out, err)
    assert says in err
    assert "Traceback" not in err


async def test_a_password_with_reserved_characters_is_refused_and_never_shown() -> None:
    url = f"amqp://someone:{SECRET}@127.0.0.1:5672/"

    status, out, err = await hopsched_cli("status", "--url", url)

    assert status == 2, (out, err)
    assert "percent-encode" in err
    assert "Traceback" not in err
    for part in ("pa", "ss", "s3cret"):
        assert f":{part}" not in err + out
        assert f"{part}@" not in err + out


async def test_wrong_password_is_one_clear_line_and_exit_1(broker_url: str) -> None:
    url = broker_url.replace("guest:guest@", f"guest:{quote(SECRET, safe='')}@")

    status, out, err = await hopsched_cli("relay", "--url", url)

    assert status == 1, (out, err)
    assert "login refused" in err
    assert "s3cret" not in out + err
    assert "Traceback" not in err


async def test_schedule_declare_and_status_on_the_real_broker(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets
) -> None:
    target = await targets.queue()

    status, out, err = await hopsched_cli(
        "schedule",
        "--in",
        "300ms",
        "--routing-key",
        target.name,
        "--body",
        "hi",
        "--header",
        "kind=cli",
        settings=settings,
    )
    assert status == 0, err
    words = out.split()  # "scheduled ID due ISO8601"
    assert (words[0], words[2]) == ("scheduled", "due")
    schedule_id, due = words[1], datetime.fromisoformat(words[3])

    [received] = await target.wait_for(1, within=30)
    assert received.body == b"hi"
    assert received.schedule_id == schedule_id
    assert received.headers["kind"] == "cli"
    assert received.due_us == datetime_to_us(due)
    target.assert_never_early()

    status, out, err = await hopsched_cli("status", "--json", settings=settings)
    assert status == 0, err
    report = json.loads(out)
    topology = hopsched.Topology.from_settings(settings)
    assert set(report["queues"]) == set(topology.queues())
    assert report["relay_consumers"] == 1
    assert "guest:guest" not in out

    status, out, err = await hopsched_cli("declare", settings=settings)
    assert status == 0, err
    assert topology.step_queue(2**32) in out


async def test_an_out_of_range_due_time_is_refused_before_connecting(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    status, out, err = await hopsched_cli(
        "schedule", "--in", "3000000d", "--routing-key", "q", settings=settings
    )

    assert status == 2, (out, err)
    assert "after year 9999" in err
    channel = await amqp.channel()
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):  # nothing was declared
        await channel.declare_queue(settings.prefix + ".relay", passive=True)


async def test_relay_exits_0_on_sigterm(settings: hopsched.Settings) -> None:
    env = dict(os.environ) | {"HOPSCHED_URL": settings.url, "HOPSCHED_PREFIX": settings.prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hopsched", "relay", env=env, stderr=asyncio.subprocess.PIPE
    )
    assert process.stderr is not None
    while b"relay consuming" not in (line := await asyncio.wait_for(process.stderr.readline(), 30)):
        assert line, "the relay exited before consuming"
    process.send_signal(signal.SIGTERM)
    rest = await asyncio.wait_for(process.stderr.read(), 15)

    assert await process.wait() == 0
    assert b"relay stopped" in rest


async def test_demo_runs_end_to_end(settings: hopsched.Settings) -> None:
    status, out, err = await hopsched_cli(
        "demo", "--count", "30", "--max-delay", "1s", "--prefix", settings.prefix, within=120
    )

    assert status == 0, err
    rows = dict(
        (cells[1].strip(), cells[2].strip())
        for line in out.splitlines()
        if len(cells := line.split("|")) == 4
    )
    assert (rows["scheduled"], rows["delivered"], rows["early"], rows["lost"]) == (
        "30",
        "30",
        "0",
        "0",
    )
