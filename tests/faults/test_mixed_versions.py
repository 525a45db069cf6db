"""Versions that mix (issue 30, item 3): the previous release's relay beside this
version's client, and the reverse, on one prefix: one-shots, a cancel, a reschedule and a
recurring schedule each delivered as asked, once, never early (docs/operations.md,
"Upgrading: versions that mix").

The previous release is the last commit that called itself 0.1.0 (``PREVIOUS``), taken
from the repository's history with ``git archive`` and run from that tree on this
environment's packages (``PYTHONPATH``): its relay as ``python -m hopsched relay``, its
client as the script below, which both versions run unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from support import Collector, Targets
from support.relays import RelayProcess

import hopsched

pytestmark = pytest.mark.slow

#: The last commit of hopsched 0.1.0, before versions that mix (0.2.0: features, --version).
PREVIOUS = "0377ff6"
REPOSITORY = Path(__file__).resolve().parents[2]
S = 1_000_000

#: Schedules what the test checks, with either version's API (they agree), and prints
#: their ids and due times as JSON. Argument: the target queue.
CLIENT = """
import asyncio, json, os, sys
import hopsched

async def main(target):
    settings = hopsched.Settings.from_env()
    async with hopsched.Scheduler(settings) as scheduler:
        kept = [await scheduler.schedule(b"kept", delay=4 + i / 10, routing_key=target)
                for i in range(3)]
        gone = await scheduler.schedule(b"gone", delay=4, routing_key=target)
        await scheduler.cancel(gone)
        moved = await scheduler.schedule(b"moved", delay=30, routing_key=target)
        moved = await scheduler.reschedule(moved, delay=5)
        chain = await scheduler.schedule(b"every", every=2, count=3, routing_key=target)
    print(json.dumps({
        "code": hopsched.__file__,
        "kept": {s.schedule_id: s.due_us for s in kept},
        "gone": gone.schedule_id,
        "moved": [moved.schedule_id, moved.due_us],
        "chain": [chain.schedule_id, chain.due_us],
    }))

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, extracted from the repository's history."""
    tree = tmp_path_factory.mktemp("previous")

    def git(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["git", "-C", str(REPOSITORY), *args], capture_output=True, check=False, timeout=120
        )

    archive = git("archive", PREVIOUS, "hopsched")
    if (
        archive.returncode != 0
        and git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
    ):
        git("fetch", "--quiet", "--unshallow")  # a shallow clone: its origin has the history
        archive = git("archive", PREVIOUS, "hopsched")
    assert archive.returncode == 0, (
        f"git archive {PREVIOUS} failed ({archive.stderr.decode().strip()}): this test needs "
        "the repository's history (a full clone, not a shallow one)"
    )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def version_env(previous: Path | None) -> dict[str, str]:
    """Environment variables that run ``previous``'s code (None: this version's)."""
    return {} if previous is None else {"PYTHONPATH": str(previous)}


async def run_client(
    settings: hopsched.Settings, target: str, previous: Path | None
) -> dict[str, Any]:
    env = (
        dict(os.environ)
        | version_env(previous)
        | {
            "HOPSCHED_URL": str(settings.url),
            "HOPSCHED_PREFIX": settings.prefix,
            "HOPSCHED_QUEUE_TYPE": settings.queue_type,
        }
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        target,
        env=env,
        cwd="/",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip  (cwd: "-c" puts it first on sys.path; a checkout's package would win)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    answer: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    return answer


@pytest.mark.parametrize("relay_is", ["previous", "current"])
async def test_a_relay_and_a_client_of_the_versions_next_to_each_other(
    make_settings: Callable[..., hopsched.Settings],
    targets: Targets,
    previous: Path,
    relay_is: str,
) -> None:
    """The previous release's relay with this version's client, and this version's relay
    with the previous release's client."""
    settings = make_settings()
    relay_code, client_code = (previous, None) if relay_is == "previous" else (None, previous)
    target = await targets.queue()
    relay = RelayProcess(settings, env=version_env(relay_code))
    await relay.start()  # it declares the prefix, as a relay of either version does
    try:
        asked = await run_client(settings, target.name, client_code)
        kept: dict[str, int] = asked["kept"]
        moved_id, moved_due = asked["moved"]
        chain_id, first_due = asked["chain"]
        # each side ran the code it was meant to: the client's package, the relay's start
        # line (the previous release's names no version)
        client_tree = str(client_code or Path(hopsched.__file__).parents[1])  # or this one's
        assert str(asked["code"]).startswith(client_tree), (asked["code"], client_tree)
        (start_line,) = [line for line in relay.lines if "relay consuming" in line]
        assert ("(hopsched " in start_line) == (relay_is == "current"), start_line
        print(f"\nrelay {relay_is}, client from {asked['code']}")
        wanted = {*kept, moved_id, chain_id}
        await target.wait_for_ids(wanted, within=60)
        await wait_for_count(target, chain_id, 3, within=30)
        await target.settle(2.0)
    finally:
        await relay.terminate(within=30)
    counts = target.counts()
    target.assert_never_early()
    assert counts == {**{schedule_id: 1 for schedule_id in kept}, moved_id: 1, chain_id: 3}
    assert asked["gone"] not in counts
    arrived = {r.schedule_id: r for r in target.received}
    assert arrived[moved_id].due_us == moved_due  # at its new time, not the old one
    occurrences = sorted(r.due_us for r in target.received if r.schedule_id == chain_id)
    assert occurrences == [first_due + k * 2 * S for k in range(3)]
    assert all(r.lateness_us < 2 * S for r in target.received), target.lateness_line()
    if relay_is == "current":  # the previous one delivers x-hopsched-owner, new to it
        assert not any("x-hopsched-owner" in r.headers for r in target.received)
    print(f"delivered as asked; lateness {target.lateness_line()}")


async def wait_for_count(target: Collector, schedule_id: str, count: int, within: float) -> None:
    async with asyncio.timeout(within):
        while target.counts()[schedule_id] < count:  # noqa: ASYNC110 (the consumer appends)
            await asyncio.sleep(0.1)
