"""Error texts say what happened (issue 24, item 2): a refused login is a refused login,
a peer that never speaks AMQP is not first blamed on the port, a refused vhost is named,
and ``Error:`` lines follow ``--log-format json``."""

from __future__ import annotations

import json
import socket

import pytest
from support import hopsched_cli


def with_password(broker_url: str, password: str) -> str:
    return broker_url.replace("guest:guest@", f"guest:{password}@")


@pytest.mark.parametrize(
    "command",
    [
        ["relay"],
        ["schedule", "--in", "1s", "--routing-key", "q"],
        ["cancel", "order-42"],
        ["status"],
        ["declare"],
    ],
)
async def test_a_refused_login_is_reported_as_one_by_every_command(
    broker_url: str, command: list[str]
) -> None:
    """Found by a new-user trial: the relay's and the Scheduler's line ended "is RabbitMQ
    running and listening there?", as if the broker could not be reached."""
    status, out, err = await hopsched_cli(*command, "--url", with_password(broker_url, "wrong"))

    assert status == 1, (out, err)
    assert "login refused" in err
    assert "running and listening" not in err
    assert "cannot reach" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["relay"], ["status"]])
async def test_a_refused_vhost_is_named(broker_url: str, command: list[str]) -> None:
    status, out, err = await hopsched_cli(*command, "--url", f"{broker_url}no-such-vhost")

    assert status == 1, (out, err)
    assert "refused the vhost 'no-such-vhost'" in err
    assert "cannot reach" not in err


async def test_error_lines_follow_the_json_log_format(broker_url: str) -> None:
    status, out, err = await hopsched_cli(
        "--log-format", "json", "status", "--url", with_password(broker_url, "wrong")
    )
    assert status == 1, (out, err)
    line = json.loads(err.strip().splitlines()[-1])
    assert line["level"] == "ERROR"
    assert "login refused" in line["message"]

    status, out, err = await hopsched_cli(
        "--log-format", "json", "schedule", "--routing-key", "q"
    )  # a usage error: none of --at, --in, --every and --cron
    assert status == 2, (out, err)
    (line,) = [json.loads(text) for text in err.strip().splitlines()]
    assert line["level"] == "ERROR"
    assert "exactly one of --at, --in, --every and --cron" in line["message"]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_nothing_listening_is_said_once_by_status(log_format: str) -> None:
    """Found by a new-user trial: aiormq's raw "error when creating transport" ERROR line
    came before ``status``'s own error, which says the same and what to check."""
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"

    status, out, err = await hopsched_cli("--log-format", log_format, "status", "--url", url)

    assert status == 1, (out, err)
    (line,) = err.strip().splitlines()
    assert "cannot reach the broker" in line
    assert "creating transport" not in err


async def test_an_unknown_command_follows_the_json_log_format() -> None:
    status, out, err = await hopsched_cli("--log-format", "json", "no-such-command")

    assert status == 2, (out, err)
    (line,) = [json.loads(text) for text in err.strip().splitlines()]
    assert line["level"] == "ERROR"
    assert "No such command 'no-such-command'" in line["message"]
