"""F07: unroutable, missing and deleted targets are parked with a reason; `hopsched parked
list` shows them and `hopsched parked replay` re-delivers them once the target is fixed.
Also the relay's allow list (`--allow-target`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aio_pika
import pytest
from support import (
    HEADER_DUE,
    HEADER_EXCHANGE,
    HEADER_PARKED_REASON,
    HEADER_ROUTING_KEY,
    Relays,
    Targets,
    hopsched_cli,
    message_count,
    wait_until_count,
)

import hopsched


async def test_parked_list_and_replay_after_the_targets_are_fixed(
    settings: hopsched.Settings,
    relays: Relays,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Three broken kinds of target among valid messages; all parked, listed, replayed."""
    topology = hopsched.Topology.from_settings(settings)
    valid = await targets.queue()
    unbound = await targets.exchange()  # exists, no binding for the key
    missing = targets.name("missing")  # never declared (yet)
    doomed = await targets.exchange()  # deleted while its messages are in the ladder
    doomed_queue = await targets.queue(consume=False)
    await targets.bind(doomed_queue.name, doomed, "rk")

    broken: dict[str, tuple[str, str]] = {}  # schedule id -> (exchange, routing key)
    due: dict[str, int] = {}
    valid_ids: list[str] = []
    for i in range(40):
        result = await scheduler.schedule(
            f"v{i}".encode(), delay=0.2 + i * 0.05, routing_key=valid.name
        )
        valid_ids.append(result.schedule_id)
        if i % 10 == 0:
            for exchange, key in ((unbound, "nobody"), (missing, "rk"), (doomed, "rk")):
                result = await scheduler.schedule(
                    f"{exchange} {i}".encode(),
                    delay=1.0 + i * 0.05,
                    exchange=exchange,
                    routing_key=key,
                )
                broken[result.schedule_id] = (exchange, key)
                due[result.schedule_id] = result.due_us
    channel = await targets.channel()
    await channel.exchange_delete(doomed)  # the messages for it are in the ladder now
    # The relay starts only now. Running from the start, it delivered a doomed message
    # whose due time (1 s after it was scheduled) came before the delete: scheduling the
    # 52 took over 1 s on a loaded machine. That copy went to doomed_queue, rightly, and
    # never to the parked queue, however long the wait ("11 of 12 parked after 90 s").
    relay = await relays.start(settings)

    # Only a stalled broker needs these bounds: parking takes one confirmed publish.
    await valid.wait_for_ids(valid_ids, within=90)
    await wait_until_count(amqp, topology.parked_queue, len(broken), within=90)
    valid.assert_never_early()
    assert relays.is_running(relay)
    assert await message_count(amqp, doomed_queue.name) == 0  # nothing reached the old target

    # list: every parked message with its reason, target and due time; none removed.
    status, out, err = await hopsched_cli("parked", "list", "--json", settings=settings)
    assert status == 0, err
    listed = {entry["schedule_id"]: entry for entry in json.loads(out)}
    assert set(listed) == set(broken)
    # A listing's reads go back to the queue a little after the command exits (the broker
    # returns a closed channel's unacked gets asynchronously): a count read at once may be
    # short. Wait for them (none removed) before the next command reads the queue.
    await wait_until_count(amqp, topology.parked_queue, len(broken), within=30)
    for schedule_id, (exchange, key) in broken.items():
        entry = listed[schedule_id]
        assert (entry["exchange"], entry["routing_key"], entry["due_us"]) == (
            exchange,
            key,
            due[schedule_id],
        )
        assert exchange in entry["reason"]
        expected = "no queue is bound" if exchange == unbound else "does not exist"
        assert expected in entry["reason"], entry["reason"]
        # a missing exchange is a refusal (404), not an unroutable message: docs/parked.md
        assert entry["kind"] == ("unroutable" if exchange == unbound else "refused")
    status, out, _ = await hopsched_cli("parked", "list", settings=settings)
    assert status == 0
    assert f"showing {len(broken)} of {len(broken)} parked message(s)" in out
    unroutable = sum(exchange == unbound for exchange, _ in broken.values())
    assert out.count("[unroutable] ") == unroutable, out
    assert out.count("[refused] ") == len(broken) - unroutable, out
    await wait_until_count(amqp, topology.parked_queue, len(broken), within=30)

    # Fix the targets: bind the key, create the missing exchange, re-create the deleted one.
    fixed = await targets.queue()
    await targets.exchange(missing)
    await targets.exchange(doomed)
    for exchange, key in {(unbound, "nobody"), (missing, "rk"), (doomed, "rk")}:
        await targets.bind(fixed.name, exchange, key)

    one = next(iter(broken))
    status, out, err = await hopsched_cli("parked", "replay", "--id", one, settings=settings)
    assert (status, out.strip()) == (0, f"replayed 1 message(s) to {topology.relay_queue}"), err
    await fixed.wait_for_ids([one], within=30)
    await wait_until_count(amqp, topology.parked_queue, len(broken) - 1, within=30)

    status, out, err = await hopsched_cli("parked", "replay", "--all", settings=settings)
    assert status == 0, err
    assert f"replayed {len(broken) - 1} message(s)" in out
    delivered = await fixed.wait_for_ids(broken, within=30)
    await fixed.settle(0.5)
    assert fixed.counts() == dict.fromkeys(broken, 1)
    for copy in delivered:
        assert copy.body.decode().startswith(broken[copy.schedule_id][0])
        assert HEADER_PARKED_REASON not in copy.headers
        assert copy.headers[HEADER_DUE] == due[copy.schedule_id]
    fixed.assert_never_early()
    assert await message_count(amqp, topology.parked_queue) == 0

    status, _, err = await hopsched_cli("parked", "replay", "--id", "nope", settings=settings)
    assert status == 3
    assert "not parked: nope" in err
    status, _, err = await hopsched_cli("parked", "replay", settings=settings)
    assert status == 2
    assert "--all" in err
    print(
        f"\nF07: {len(valid_ids)} valid on time ({valid.lateness_line()}); "
        f"{len(broken)} parked (unbound, missing, deleted), listed and replayed once each"
    )


async def test_relay_parks_targets_outside_its_allow_list(
    make_settings: Any,
    relays: Relays,
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    allowed = await targets.queue()
    other = await targets.queue()
    relay_settings = make_settings(allowed_targets=(f"/{allowed.name}", "orders.*/timeout.*"))
    await relays.start(relay_settings)
    open_settings = dataclasses.replace(relay_settings, allowed_targets=())
    async with hopsched.Scheduler(open_settings) as scheduler:
        ok = await scheduler.schedule(b"ok", delay=0.3, routing_key=allowed.name)
        refused = await scheduler.schedule(b"no", delay=0.3, routing_key=other.name)
    topology = hopsched.Topology.from_settings(relay_settings)
    parked = await targets.consume(topology.parked_queue)
    await allowed.wait_for_ids([ok.schedule_id], within=20)
    (copy,) = await parked.wait_for(1, within=20)
    assert copy.schedule_id == refused.schedule_id
    reason = copy.headers[HEADER_PARKED_REASON]
    assert "not allowed" in reason
    assert other.name in reason
    assert (copy.headers[HEADER_EXCHANGE], copy.headers[HEADER_ROUTING_KEY]) == ("", other.name)
    await asyncio.sleep(0.3)
    assert len(other) == 0

    # A scheduler with the same allow list refuses at once, before publishing anything.
    async with hopsched.Scheduler(relay_settings) as scheduler:
        with pytest.raises(hopsched.InvalidScheduleError, match="not allowed"):
            await scheduler.schedule(b"no", delay=0.3, routing_key=other.name)
        await scheduler.schedule(b"ok", delay=0, exchange="orders.eu", routing_key="timeout.42")


@pytest.mark.parametrize("pattern", ["no-slash", ""])
async def test_a_bad_allow_target_pattern_is_a_usage_error(pattern: str) -> None:
    status, _, err = await hopsched_cli("relay", "--allow-target", pattern)
    assert status == 2
    assert "EXCHANGE/ROUTING-KEY" in err
