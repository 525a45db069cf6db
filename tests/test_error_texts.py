"""Error texts say what happened (issue 24, item 2): a refused login is a refused login,
a peer that never speaks AMQP is not first blamed on the port, a refused vhost is named,
and ``Error:`` lines follow ``--log-format json``."""

from __future__ import annotations

import json

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
    )  # a usage error: neither --at nor --in
    assert status == 2, (out, err)
    (line,) = [json.loads(text) for text in err.strip().splitlines()]
    assert line["level"] == "ERROR"
    assert "exactly one of --at and --in" in line["message"]
