"""The ``hopsched`` command, run as a user runs it: a subprocess against the real broker."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import shlex
import signal
import sys
import uuid
from datetime import datetime
from pathlib import Path
from urllib.parse import quote, urlsplit

import aio_pika
import aiormq
import pytest
from support import (
    Relays,
    Targets,
    hopsched_cli,
    message_count,
    rabbitmqctl,
    rabbitmqctl_path,
    unique,
    wait_until_count,
)
from support.private_nodes import require_rabbitmq

import hopsched
from hopsched.broker.objects import declare
from hopsched.cli.common import EXIT_NO_PREFIX
from hopsched.core.clock import datetime_to_us, now_us
from hopsched.testing.localbroker import free_port

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
    assert set(report["queues"]) == set(topology.all_queues())
    assert report["relay_consumers"] == 1
    assert "guest:guest" not in out

    status, out, err = await hopsched_cli("declare", settings=settings)
    assert status == 0, err
    assert topology.step_queue(2**32) in out


async def test_status_of_a_prefix_with_no_queues_exits_4_saying_check_the_prefix(
    broker_url: str,
) -> None:
    """Found by new-user trials: status of a mistyped --prefix listed every queue as
    missing and exited 0, then 1 (broker trouble); the exit table gives 4 when nothing of
    the prefix exists, as for cancel, upgrade and teardown."""
    prefix = unique()

    status, out, err = await hopsched_cli("status", "--url", broker_url, "--prefix", prefix)

    assert status == EXIT_NO_PREFIX, (out, err)
    assert f"{prefix}.relay" in out
    assert "missing" in out
    assert "polic" not in out  # a trial: "no policy in force can lose ..." of no queue
    [line] = err.splitlines()
    assert f"nothing of prefix {prefix!r} exists" in line
    assert "check --prefix" in line
    assert "Traceback" not in err


async def test_status_exits_1_naming_a_deleted_journal_and_declares_nothing(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """Found by a new-user trial: with the journal deleted, status said "not declared
    yet" and exited 0, while get() and pending() failed with 404."""
    topology = hopsched.Topology.from_settings(settings)
    await declare(topology, amqp)
    await (await amqp.channel()).queue_delete(topology.journal_stream)

    status, out, err = await hopsched_cli("status", settings=settings)

    assert status == 1, (out, err)
    assert re.search(rf"{re.escape(topology.journal_stream)} +missing", out)
    assert f"the journal {topology.journal_stream} is missing" in err
    assert "get() and pending() fail" in err
    assert "Traceback" not in err
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):  # still not declared
        await (await amqp.channel()).declare_queue(topology.journal_stream, passive=True)


@pytest.mark.parametrize(
    "command", [["cancel", "order-42"], ["reschedule", "order-42", "--in", "1h"]]
)
async def test_cancel_or_reschedule_for_a_prefix_with_nothing_scheduled_is_refused(
    command: list[str], amqp: aio_pika.abc.AbstractConnection, broker_url: str
) -> None:
    """Found by a new-user trial: with a mistyped --prefix, cancel printed "cancelled"
    and declared a whole new prefix, and the real message was still delivered."""
    prefix = unique()

    status, out, err = await hopsched_cli(*command, "--url", broker_url, "--prefix", prefix)

    assert status == 4, (out, err)
    assert f"prefix {prefix!r} has no relay queue" in err
    assert "check --prefix" in err
    channel = await amqp.channel()
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):  # nothing declared
        await channel.declare_queue(f"{prefix}.relay", passive=True)


@pytest.mark.parametrize("page", ["operations.md", "security.md"])
async def test_the_permissions_example_in_the_docs_is_what_the_command_prints(
    page: str, broker_url: str
) -> None:
    """docs/operations.md and docs/security.md show `hopsched permissions` runs; they must
    not drift from the command (a new-user trial found one without the cancel stream)."""
    docs = (Path(__file__).parents[2] / "docs" / page).read_text()
    example = re.search(r"\$ (hopsched permissions [^\n]+)\n((?:[#r][^\n]+\n)+)", docs)
    assert example is not None
    command, printed = example.groups()

    status, out, err = await hopsched_cli(*shlex.split(command)[1:], "--url", broker_url)

    assert status == 0, err
    assert out == printed


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


async def test_version_is_the_installed_packages() -> None:
    status, out, err = await hopsched_cli("--version")

    assert (status, err) == (0, "")
    assert out == f"hopsched, version {importlib.metadata.version('hopsched')}\n"
    assert hopsched.__version__ == importlib.metadata.version("hopsched")
    major, minor, *_ = (int(part) for part in hopsched.__version__.split("."))
    assert (major, minor) >= (0, 2)


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_relay_exits_0_on_sigterm(settings: hopsched.Settings, log_format: str) -> None:
    env = dict(os.environ) | {"HOPSCHED_URL": settings.url, "HOPSCHED_PREFIX": settings.prefix}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "--log-format", log_format, "relay"),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[bytes] = []
    while b"relay consuming" not in (line := await asyncio.wait_for(process.stderr.readline(), 30)):
        assert line, "the relay exited before consuming"
        lines.append(line)
    process.send_signal(signal.SIGTERM)
    rest = await asyncio.wait_for(process.stderr.read(), 15)

    assert await process.wait() == 0
    assert f"(hopsched {hopsched.__version__}, prefetch".encode() in line
    assert b"relay stopped" in rest
    if log_format == "json":
        records = [json.loads(line) for line in [*lines, line, *rest.splitlines()]]
        assert {"time", "level", "logger", "message"} <= set(records[-1])
        assert records[-1]["message"] == "relay stopped"
        assert "guest:guest" not in json.dumps(records)


async def test_demo_runs_end_to_end_and_removes_the_ladder_it_declared(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
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
    assert f"removed the demo's ladder {settings.prefix} (36 objects)" in err
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
        await (await amqp.channel()).declare_queue(f"{settings.prefix}.relay", passive=True)


@pytest.mark.parametrize("delay", ["0", "-5s"])
async def test_a_delay_of_zero_or_less_means_now(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets, delay: str
) -> None:
    target = await targets.queue()
    before_us = now_us()

    status, _, err = await hopsched_cli(
        "schedule", "--in", delay, "--routing-key", target.name, "--body", "now", settings=settings
    )

    assert status == 0, err
    [received] = await target.wait_for(1, within=30)
    assert received.body == b"now"
    assert before_us <= received.due_us <= now_us()  # due when scheduled, not 5 s before
    target.assert_never_early()


async def test_permissions_take_the_urls_vhost_and_the_grant_works_there(
    broker_url: str,
) -> None:
    if rabbitmqctl_path() is None:
        pytest.skip("needs rabbitmqctl for the shared broker, to add a vhost and a user")
    tag = unique()
    vhost, user, password = f"team/a b#1%é {tag}", f"hopsched-{tag}", f"pw{tag}"
    prefix = tag
    node = urlsplit(broker_url).netloc.rpartition("@")[2]  # the test broker's host:port
    url = f"amqp://{user}:{password}@{node}/{quote(vhost, safe='')}"

    status, out, err = await hopsched_cli(
        "permissions", "--url", url, "--user", user, "--prefix", prefix, "--role", "operator"
    )
    assert status == 0, err
    command = shlex.split(out)
    assert command[:5] == ["rabbitmqctl", "set_permissions", "-p", vhost, user]
    for other_url, expected in ((broker_url, "/"), ("amqp://u:p@127.0.0.1", "/")):
        status, out, err = await hopsched_cli("permissions", "--url", other_url, "--role", "relay")
        assert status == 0, err
        assert shlex.split(out)[3] == expected
    status, out, err = await hopsched_cli(
        "permissions", "--url", url, "--vhost", "other", "--role", "producer"
    )
    assert shlex.split(out)[3] == "other"

    await rabbitmqctl("add_vhost", vhost)
    try:
        await rabbitmqctl("add_user", user, password)
        await rabbitmqctl(*command[1:])
        status, out, err = await hopsched_cli(
            "declare", "--url", url, "--prefix", prefix, "--queue-type", "classic"
        )
        assert status == 0, err
        status, out, err = await hopsched_cli(
            "status", "--json", "--url", url, "--prefix", prefix, "--queue-type", "classic"
        )
        assert status == 0, err
        assert json.loads(out)["queues"][f"{prefix}.relay"] == {"messages": 0, "consumers": 0}
    finally:
        await rabbitmqctl("delete_user", user)
        await rabbitmqctl("delete_vhost", vhost)


async def test_status_and_parked_list_report_a_queue_type_mismatch_and_declare_nothing(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    topology = hopsched.Topology.from_settings(settings)
    await declare(topology, amqp)  # quorum
    gone = topology.step_queue(16)
    await (await amqp.channel()).queue_delete(gone)

    for args in (["status"], ["status", "--json"], ["parked", "list"]):
        status, out, err = await hopsched_cli(*args, "--queue-type", "classic", settings=settings)

        assert status == 1, (args, out, err)
        [line] = err.splitlines()
        first = topology.step_queue(32)
        assert f"queue {first!r} already exists with x-queue-type=quorum" in line
        assert "declares x-queue-type=classic" in line
        assert "Fix:" in line
    status, out, err = await hopsched_cli("status", settings=settings)
    assert status == 1, err  # a missing queue
    assert re.search(rf"{re.escape(gone)} +missing", out)
    assert gone in err
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):  # still not declared
        await (await amqp.channel()).declare_queue(gone, passive=True)


async def test_parked_list_limit_and_replay_exit_statuses(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    topology = hopsched.Topology.from_settings(settings)
    for _ in range(3):
        await scheduler.schedule(b"x", delay=0, routing_key=f"t{uuid.uuid4().hex}.nowhere")
    await wait_until_count(amqp, topology.parked_queue, 3, within=30)

    status, out, err = await hopsched_cli("parked", "list", "--limit", "1", settings=settings)
    assert status == 0, err
    assert out.splitlines()[0] == f"showing 1 of 3 parked message(s) in {topology.parked_queue}"
    assert len(out.splitlines()) == 3  # the header, one message in two lines

    status, out, err = await hopsched_cli("parked", "replay", "--id", "UNKNOWN", settings=settings)
    assert (status, out.strip()) == (3, f"replayed 0 message(s) to {topology.relay_queue}")
    assert err.strip() == "not parked: UNKNOWN"

    status, out, err = await hopsched_cli(
        "parked", "replay", "--all", "--id", "X", settings=settings
    )
    assert status == 2
    assert "--all and --id exclude each other" in err
    assert await message_count(amqp, topology.parked_queue) == 3


async def test_verbose_shows_hopsched_debug_lines_and_amqp_frames_only_when_very_verbose(
    settings: hopsched.Settings,
) -> None:
    status, _, err = await hopsched_cli("-v", "declare", settings=settings)

    assert status == 0, err
    assert f"DEBUG hopsched.topology: declared queue {settings.prefix}.relay" in err
    assert "aiormq" not in err
    assert "aio_pika" not in err

    status, _, err = await hopsched_cli("-vv", "declare", settings=settings)
    assert status == 0, err
    assert "DEBUG aiormq.connection:" in err


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_no_password_in_any_log_line_even_very_verbose(
    broker_url: str, log_format: str
) -> None:
    url = broker_url.replace("guest:guest@", f"guest:{quote(SECRET, safe='')}@")

    status, out, err = await hopsched_cli("-vv", "--log-format", log_format, "status", "--url", url)

    assert status == 1, (out, err)
    assert "s3cret" not in out + err
    *logged, error = err.splitlines()
    assert "login refused" in error
    assert any("aiormq" in line for line in logged)
    if log_format == "json":  # the Error line too is a JSON line
        assert all(json.loads(line)["level"] for line in logged)
        assert json.loads(error)["level"] == "ERROR"
    else:
        assert error.startswith("Error: ")


async def test_teardown_refuses_while_messages_wait_then_removes_everything_with_force(
    settings: hopsched.Settings,
    scheduler: hopsched.Scheduler,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    topology = hopsched.Topology.from_settings(settings)
    # the cancel stream first: a running relay takes its deletion for the teardown
    queues = [name for name in topology.queues() if name != topology.cancel_stream]
    everything = [topology.cancel_stream, *queues, topology.expired_exchange]
    await scheduler.schedule(b"later", delay=3600, routing_key="q")
    await scheduler.cancel("something-else")  # the stream's records are no pending messages

    status, out, err = await hopsched_cli("teardown", settings=settings)
    assert status == 1, (out, err)
    assert "(1 message(s), 0 consumer(s))" in err
    assert "--force" in err
    assert out == ""
    assert await message_count(amqp, topology.relay_queue) == 0  # still there

    # --force deletes whatever the queue type: teardown is the fix for a mismatch.
    status, out, err = await hopsched_cli(
        "teardown", "--force", "--queue-type", "classic", settings=settings
    )
    assert status == 0, err
    removed = [line.split()[1] for line in out.splitlines() if line.startswith("removed ")]
    assert removed == everything
    assert "(1 ready message(s) deleted with it)" in out
    for name in topology.all_queues():
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await (await amqp.channel()).declare_queue(name, passive=True)
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
        await (await amqp.channel()).declare_exchange(topology.expired_exchange, passive=True)

    status, out, err = await hopsched_cli("teardown", settings=settings)
    assert status == 4, (out, err)  # nothing left: one line, not 33 "did not exist"
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert f"nothing of prefix {settings.prefix!r} exists" in err


async def test_teardown_refuses_while_a_relay_consumes(
    settings: hopsched.Settings, relay: hopsched.Relay, relays: Relays
) -> None:
    status, out, err = await hopsched_cli("teardown", settings=settings)

    assert status == 1, (out, err)
    assert f"{settings.prefix}.relay (0 message(s), 1 consumer(s))" in err
    assert relays.is_running(relay)


def demo_rows(out: str) -> dict[str, str]:
    return {
        cells[1].strip(): cells[2].strip()
        for line in out.splitlines()
        if len(cells := line.split("|")) == 4
    }


def node_is_gone(root: str) -> bool:
    """Whether the private node of directory ``root`` has no process and no directory
    (its processes see the directory by another path when they run in a chroot)."""
    marker = f"/{Path(root).name}/home\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                return False
        except OSError:
            continue
    return not Path(root).exists()


async def test_demo_with_nothing_at_its_url_runs_on_a_throwaway_node() -> None:
    require_rabbitmq()
    port = free_port()  # nothing listens there: never the shared broker

    status, out, err = await hopsched_cli(
        *("demo", "--url", f"amqp://guest:guest@127.0.0.1:{port}/"),
        *("--count", "20", "--max-delay", "1s"),
        within=180,
    )

    assert status == 0, err
    assert f"nothing answers at amqp://guest:***@127.0.0.1:{port}/" in err
    found = re.search(r"throwaway node \S+ on 127\.0\.0\.1:(\d+), in (\S+)\n", err)
    assert found, err
    assert int(found[1]) != port
    assert "throwaway node stopped and removed" in err
    # The node has the management API, so the relay reads the policies in force and has
    # nothing to warn a new user about.
    assert not re.search(r" (WARNING|ERROR) ", err), err
    rows = demo_rows(out)
    assert (rows["delivered"], rows["early"], rows["lost"]) == ("20", "0", "0")
    assert node_is_gone(found[2])


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def demo_scheduling(
    *args: str, within: float = 60
) -> tuple[asyncio.subprocess.Process, bytes]:
    """``hopsched demo --count 100 --max-delay 60s ARGS`` started, once it says it is
    scheduling; and what it said so far."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hopsched", "demo", "--count", "100", "--max-delay", "60s"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # As a terminal's Ctrl-C finds it: SIGINT not ignored. A run started in the
        # background (nohup, '&' in a script: CI) ignores SIGINT, and its children
        # inherit that, as Unix means them to (found by a new-user trial: exit 0).
        preexec_fn=_sigint_as_in_a_terminal,
    )
    assert process.stderr is not None
    said = b""
    while b"scheduling 100 messages" not in said:
        line = await asyncio.wait_for(process.stderr.readline(), within)
        assert line, said.decode()
        said += line
    return process, said


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_demo_interrupted_removes_its_throwaway_node(stop: signal.Signals) -> None:
    """Ctrl-C, or SIGTERM (``kill``, ``timeout``, a cancelled CI job: a new-user trial
    found the node left running after it), removes the node; nothing is said of its
    ladder, which goes with the node."""
    require_rabbitmq()
    process, said = await demo_scheduling(
        "--url", f"amqp://guest:guest@127.0.0.1:{free_port()}/", within=120
    )
    found = re.search(rb"throwaway node \S+ on \S+, in (\S+)\n", said)
    assert found, said.decode()
    root = found[1].decode()
    assert not node_is_gone(root)

    process.send_signal(stop)
    _, rest = await asyncio.wait_for(process.communicate(), 60)

    assert process.returncode != 0
    if stop == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM
        assert b"demo stopped by SIGTERM" in rest
    assert b"throwaway node stopped and removed" in rest
    assert b"stays declared" not in rest, rest.decode()
    assert b"Traceback" not in rest, rest.decode()
    assert node_is_gone(root)


async def test_demo_interrupted_on_a_broker_names_the_command_that_removes_its_ladder(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    """Its messages still on the ladder, the demo does not delete them; it says the
    command that does, and that command works as said."""
    process, _ = await demo_scheduling("--url", settings.url, "--prefix", settings.prefix)
    topology = hopsched.Topology.from_settings(settings)
    async with asyncio.timeout(60):  # some are scheduled (a loaded machine takes seconds)
        while True:  # the broker signals no event for a publish: polling is the only way
            if sum([await message_count(amqp, q) for q in topology.step_queues]):
                break
            await asyncio.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, rest = await asyncio.wait_for(process.communicate(), 60)

    assert process.returncode == 128 + signal.SIGTERM, rest.decode()
    found = re.search(rb"; to remove it and them: (hopsched teardown .*)\n", rest)
    assert found, rest.decode()
    command = found[1].decode().split()
    masked = hopsched.Settings(url=settings.url).masked_url
    assert command == [
        *("hopsched", "teardown", "--url", masked, "--prefix", settings.prefix, "--force")
    ]
    assert "guest:guest" not in rest.decode()
    # As the user would, with the password the masked URL leaves out (HOPSCHED_URL).
    status, out, err = await hopsched_cli("teardown", "--prefix", settings.prefix, "--force")
    assert status == 0, err
    assert "removed" in out + err


async def test_demo_with_nothing_at_its_url_and_no_rabbitmq_says_how_to_get_one(
    tmp_path: Path,
) -> None:
    status, out, err = await hopsched_cli(
        *("demo", "--url", f"amqp://guest:guest@127.0.0.1:{free_port()}/"),
        env={"HOPSCHED_RABBITMQ_BIN": str(tmp_path)},  # holds no rabbitmq-server
    )

    assert status == 1, (out, err)
    [line] = err.splitlines()
    for advice in ("rabbitmq-server package", "rabbitmq:3-management", "--url"):
        assert advice in line
