"""Recurring schedules while relays or the broker die: three relay processes compete, one
SIGKILLed and started again every few seconds; or the broker (a private node) killed and
started again. Every occurrence is delivered (none lost), each at most once per kill, and
once the kills stop each schedule runs once per interval (the chain did not fork)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from support import Received, Relays, Targets
from support.private_nodes import PrivateBroker, consume_after_restart, node_settings, node_targets  # noqa: F401 (a fixture)
from support.relays import RelayProcess

import hopsched
from hopsched.core.clock import now_us, us_to_datetime
from hopsched.core.envelope import HEADER_KEY

S = 1_000_000
SCHEDULES = 20
KILLS = 6


@pytest.mark.slow
async def test_three_relays_killed_at_random_lose_no_occurrence_and_never_fork_a_chain(
    settings: hopsched.Settings,
    targets: Targets,
    relay_processes: Callable[..., Awaitable[RelayProcess]],
) -> None:
    relays = [await relay_processes(settings) for _ in range(3)]
    target = await targets.queue()
    start = (now_us() // S + 2) * S
    async with hopsched.Scheduler(settings) as scheduler:
        for n in range(SCHEDULES):
            await scheduler.schedule(
                b"tick",
                every=1,
                start=us_to_datetime(start),
                catch_up="all",  # every occurrence must come: "none lost" is exact
                routing_key=target.name,
                schedule_id=f"chain-{n}",
            )
        rng = random.Random(22)
        kills = 0
        kill_at: list[float] = []
        killing_until = time.monotonic() + 3.0 * KILLS
        while time.monotonic() < killing_until:
            await asyncio.sleep(rng.uniform(1.5, 4.5))
            victim = rng.randrange(3)
            await relays[victim].kill()
            kill_at.append(round((now_us() - start) / S, 1))
            kills += 1
            relays[victim] = await relay_processes(settings)
        stopped_killing = now_us()
        await asyncio.sleep(6.0)
        end = now_us()
        await scheduler.cancel_many([f"chain-{n}" for n in range(SCHEDULES)])
    await target.settle(2.0)

    copies = Counter(r.headers[HEADER_KEY] for r in target.received)
    last_due = (stopped_killing // S + 2) * S
    expected = {
        f"chain-{n}@{start + k * S}"
        for n in range(SCHEDULES)
        for k in range(0, (last_due - start) // S + 1)
    }
    lost = expected - set(copies)
    by_chain = Counter(key.partition("@")[0] for key in lost)
    first_lost = {
        chain: min(
            int(key.partition("@")[2]) - start for key in lost if key.startswith(chain + "@")
        )
        / S
        for chain in by_chain
    }
    logs = "".join(
        line
        for relay in relays
        for line in relay.lines
        if ("WARNING" in line and "policies" not in line) or "ERROR" in line or "dropped" in line
    )
    assert not lost, (
        f"{len(lost)} lost: {dict(by_chain)}, first at {first_lost}; kills at {kill_at}\n{logs}"
    )
    assert max(copies.values()) <= 1 + kills
    # no fork: in the quiet seconds after the kills, each chain delivers each due once
    quiet = range((stopped_killing // S + 3) * S, (end // S - 1) * S, S)
    for n in range(SCHEDULES):
        for due in quiet:
            assert copies[f"chain-{n}@{due}"] == 1, (
                n,
                (due - start) / S,
                copies[f"chain-{n}@{due}"],
            )
    target.assert_never_early()
    duplicates = sum(count - 1 for count in copies.values())
    print(
        f"\n{SCHEDULES} chains every 1 s, 3 relays, {kills} SIGKILLs: {len(copies)} occurrences, "
        f"{duplicates} duplicates, none lost, none forked; {target.lateness_line()}"
    )
    for relay in relays:
        assert relay.count("Traceback") == 0, relay.log


@pytest.mark.slow
async def test_a_broker_killed_under_running_chains_loses_no_occurrence(
    private_broker: PrivateBroker,
    prefix: str,
    relays: Relays,
    node_targets: Targets,  # noqa: F811
) -> None:
    """``kill -9`` of the node while chains run, down 3 s, then started again: the relay
    reconnects, catches up (``all``) and every occurrence is delivered; each at most twice
    (a delivery confirmed just before the kill, its ack lost), and after the restart
    once per due time: the chains did not fork."""
    settings = node_settings(private_broker, prefix)
    target = await node_targets.queue()  # first: see consume_after_restart
    await relays.start(settings)
    await private_broker.save_ra_directory()  # a young node's streams survive kill -9
    start = (now_us() // S + 2) * S
    count = 14
    async with hopsched.Scheduler(settings) as scheduler:
        for n in range(5):
            await scheduler.schedule(
                b"tick",
                every=1,
                start=us_to_datetime(start),
                count=count,
                catch_up="all",
                routing_key=target.name,
                schedule_id=f"survivor-{n}",
            )
    await target.wait_for(5 * 3, within=30)
    await private_broker.kill()
    await asyncio.sleep(3.0)  # occurrences fall due while the broker is down
    await private_broker.start()
    after = await consume_after_restart(private_broker, target.name)

    def received() -> list[Received]:
        return [*target.received, *after.received]

    async with asyncio.timeout(90):
        while len({r.headers[HEADER_KEY] for r in received()}) < 5 * count:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    await after.settle(2.0)
    copies = Counter(r.headers[HEADER_KEY] for r in received())
    expected = {f"survivor-{n}@{start + k * S}" for n in range(5) for k in range(count)}
    assert set(copies) == expected
    assert max(copies.values()) <= 2, copies.most_common(3)
    later = Counter(r.headers[HEADER_KEY] for r in after.received if r.due_us > now_us() - 3 * S)
    assert all(c == 1 for c in later.values()), later.most_common(3)
    print(
        f"\n5 chains every 1 s, broker kill -9 for 3 s: {len(copies)} occurrences, "
        f"{sum(copies.values()) - len(copies)} duplicates, none lost"
    )
