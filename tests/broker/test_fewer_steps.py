"""Fewer steps (issue 23, item 4), on a real broker: a ladder of powers of four
(``step_ratio=4``) and one with a coarse smallest step (``min_step_ms=1024``) deliver
never early and lose nothing, declare only their own step queues, and a Scheduler or
relay whose ladder lacks steps of the prefix's is refused, naming both ladders.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika
import pytest
from support import Relays, Targets, hopsched_cli, schedule_all

import hopsched
from hopsched.broker.objects import found_steps
from hopsched.topology import ANY_STEP_MS

AMQP = aio_pika.abc.AbstractConnection
#: Delays (s) that go straight to the target, through the hold window only, and through
#: one or more hops of each lighter ladder (hold window 200 ms).
DELAYS_S = (0, 0.02, 0.15, 0.4, 1.1, 2.5, 5.0)


@pytest.mark.parametrize(
    "ladder",
    [
        pytest.param({"step_ratio": 4}, id="ratio-4"),
        pytest.param({"min_step_ms": 1024}, id="coarse-min-1024"),
        pytest.param({"step_ratio": 4, "min_step_ms": 64, "max_step_ms": 4**10}, id="ratio-4-64"),
    ],
)
async def test_a_lighter_ladder_delivers_never_early_loses_nothing_and_declares_its_steps(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: AMQP,
    ladder: dict[str, int],
) -> None:
    settings = make_settings(hold_window_ms=200, **ladder)
    relay = await relays.start(settings)
    target = await targets.queue()

    async with hopsched.Scheduler(settings) as scheduler:
        scheduled = await schedule_all(
            scheduler,
            [
                {"message": f"m{i}".encode(), "delay": delay, "routing_key": target.name}
                for i, delay in enumerate(DELAYS_S * 3)
            ],
        )
    await target.wait_for_ids({s.schedule_id for s in scheduled}, within=60)
    await target.settle(0.5)

    target.assert_never_early()
    assert target.counts() == {s.schedule_id: 1 for s in scheduled}
    assert relay.totals.parked == 0
    steps = settings.ladder.steps
    for one in scheduled:
        if one.first_queue.startswith(f"{settings.prefix}.step."):
            assert int(one.first_queue.rsplit(".", 1)[1]) in steps
    found = await found_steps(hopsched.Topology.from_settings(settings), amqp)
    assert found == set(steps), "the relay or Scheduler declared a step of another ladder"
    assert len(found) < len(hopsched.Ladder().steps)
    print(f"\n{settings.ladder.description}: {target.lateness_line()}")


async def test_a_scheduler_and_a_relay_of_another_ladder_are_refused_naming_both(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """A ratio-4 prefix: a default-ladder Scheduler (its 32 ms, 128 ms ... steps do not
    exist) and relay are refused before they publish anything; a coarse one too (2048 ms
    ...). The ratio-4 relay keeps delivering what was scheduled before, nothing is lost,
    and no queue of another ladder is created."""
    light = make_settings(step_ratio=4, hold_window_ms=200)
    relay = await relays.start(light)
    target = await targets.queue()
    async with hopsched.Scheduler(light) as scheduler:
        before = await schedule_all(
            scheduler,
            [{"message": b"b", "delay": d, "routing_key": target.name} for d in (0.3, 1.5, 3)],
        )

    for other in (make_settings(), make_settings(min_step_ms=1024)):
        with pytest.raises(hopsched.LadderMismatchError) as caught:
            async with hopsched.Scheduler(other):
                pytest.fail("a Scheduler of another ladder entered")
        text = str(caught.value)
        assert light.ladder.description in text
        assert other.ladder.description in text
        assert "HOPSCHED_STEP_RATIO" in text
        assert f"hopsched teardown --prefix {light.prefix}" in text
        assert isinstance(caught.value, hopsched.TopologyMismatchError)
        with pytest.raises(hopsched.LadderMismatchError):
            await asyncio.wait_for(hopsched.Relay(other).run(), 30)

    status, _, err = await hopsched_cli("relay", settings=light, env={"HOPSCHED_STEP_RATIO": "2"})
    assert status == 1, err
    assert "another ladder" in err
    assert light.ladder.description in err

    await target.wait_for_ids({s.schedule_id for s in before}, within=30)
    target.assert_never_early()
    assert target.counts() == {s.schedule_id: 1 for s in before}
    assert relays.is_running(relay)
    assert relay.totals.parked == 0
    found = await found_steps(hopsched.Topology.from_settings(light), amqp)
    assert found == set(light.ladder.steps), "a refused process declared a step queue"


async def test_a_lighter_scheduler_runs_on_a_default_prefix_and_teardown_removes_every_step(
    make_settings: Callable[..., hopsched.Settings],
    relays: Relays,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """Its steps are a subset of the default's: a ratio-4 Scheduler on a default prefix is
    fine (as a sub-range one is, F02b). A teardown with either ladder's settings removes
    the step queues of both."""
    default = make_settings(hold_window_ms=200)
    relay = await relays.start(default)
    target = await targets.queue()
    light = make_settings(step_ratio=4, hold_window_ms=200)
    async with hopsched.Scheduler(light) as scheduler:
        sent = await schedule_all(
            scheduler,
            [{"message": b"l", "delay": d, "routing_key": target.name} for d in (0.3, 1.5, 3)],
        )
    await target.wait_for_ids({s.schedule_id for s in sent}, within=30)
    target.assert_never_early()
    assert relay.totals.parked == 0
    await relays.stop(relay)

    status, out, err = await hopsched_cli(
        "teardown", settings=light, env={"HOPSCHED_STEP_RATIO": "4"}
    )
    assert status == 0, err + out
    assert await found_steps(hopsched.Topology.from_settings(light), amqp) == set()
    assert len(ANY_STEP_MS) == 33  # 1 ms .. 2**32 ms: every step any ladder can have
