"""The relay on a real broker: parking, malformed envelopes, stop(), throughput."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest
from pamqp.commands import Basic
from support import (
    HEADER_DUE,
    HEADER_EXCHANGE,
    HEADER_HOPS,
    HEADER_ID,
    HEADER_PARKED_REASON,
    HEADER_ROUTING_KEY,
    Relays,
    Targets,
    lateness_line,
    schedule_all,
    until,
)

import hopsched
from hopsched.core.clock import datetime_to_us, now_us
from hopsched.core.envelope import HEADER_HOP_EXPIRES

AMQP = aio_pika.abc.AbstractConnection


async def test_parks_unroutable_and_missing_exchange(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    relays: Relays,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """F07-lite: no binding (10) and no exchange (5) among 50 valid: parked with a reason."""
    topology = hopsched.Topology.from_settings(settings)
    target = await targets.queue()
    unbound = await targets.exchange()  # a direct exchange with no bindings at all
    missing = targets.name("missing")  # never declared
    parked = await targets.consume(topology.parked_queue)

    rng = random.Random(7)
    kinds: list[str] = []
    calls: list[dict[str, Any]] = []
    for i in range(50):
        calls.append({"exchange": "", "routing_key": target.name})
        kinds.append("valid")
        if i % 5 == 0:
            calls.append({"exchange": unbound, "routing_key": f"nobody-{i}"})
            kinds.append("unroutable")
        if i % 10 == 3:
            calls.append({"exchange": missing, "routing_key": f"rk-{i}"})
            kinds.append("missing")
    for i, call in enumerate(calls):
        body = f"{kinds[i]} {i}".encode()
        # The missing-exchange ones carry the login as user_id: a parked copy moves it to
        # a header (the broker refuses a user_id other than the publisher's login).
        user_id = urlsplit(settings.url).username if kinds[i] == "missing" else None
        call.update(
            message=aio_pika.Message(body, user_id=user_id),
            body=body,
            delay=rng.uniform(0.1, 2.0),
        )
    scheduled = await schedule_all(
        scheduler, [{k: v for k, v in c.items() if k != "body"} for c in calls], concurrency=20
    )
    by_kind: dict[str, dict[str, tuple[dict[str, Any], hopsched.Scheduled]]] = {}
    for kind, call, result in zip(kinds, calls, scheduled, strict=True):
        by_kind.setdefault(kind, {})[result.schedule_id] = (call, result)
    assert [len(by_kind[k]) for k in ("valid", "unroutable", "missing")] == [50, 10, 5]

    await target.wait_for_ids(by_kind["valid"], within=30)
    await parked.wait_for(15, within=30)
    await target.settle(0.5)
    await parked.settle(0.5)

    target.assert_never_early()
    counts = target.counts()
    assert set(counts) == set(by_kind["valid"])
    # At least once: a publish to the missing exchange closes the relay's publishing
    # channel, and a valid publish unconfirmed on it at that moment is published again.
    duplicates = {k: n for k, n in counts.items() if n > 1}
    parked_counts = parked.counts()
    parked_twice = {k: n for k, n in parked_counts.items() if n > 1}
    print(
        f"\nparking: {target.lateness_line()}; duplicate deliveries {duplicates}, "
        f"parked twice {parked_twice}"
    )
    assert set(parked_counts) == {*by_kind["unroutable"], *by_kind["missing"]}
    for copy in parked.received:
        kind = "unroutable" if copy.schedule_id in by_kind["unroutable"] else "missing"
        call, result = by_kind[kind][copy.schedule_id]
        headers = copy.headers
        reason = headers[HEADER_PARKED_REASON]
        assert isinstance(reason, str)
        assert headers[HEADER_EXCHANGE] == call["exchange"]
        assert headers[HEADER_ROUTING_KEY] == call["routing_key"]
        assert headers[HEADER_DUE] == result.due_us
        assert copy.body == call["body"]
        assert copy.properties.user_id is None
        assert headers.get("x-hopsched-user-id") == call["message"].user_id
        if kind == "unroutable":
            assert "NO_ROUTE" in reason or "no queue is bound" in reason, reason
            assert call["exchange"] in reason, reason
            assert call["routing_key"] in reason, reason
        else:
            assert "NOT_FOUND" in reason or "does not exist" in reason, reason
            assert missing in reason, reason
    reasons = sorted({c.headers[HEADER_PARKED_REASON] for c in parked.received})
    print(f"parked reasons, e.g.: {reasons[0]!r} / {reasons[-1]!r}")

    assert relays.is_running(relay)
    assert relay.totals.parked == sum(parked_counts.values())
    assert relay.totals.delivered == sum(counts.values())


def envelope_headers(target: str, due_us: int, schedule_id: str) -> dict[str, Any]:
    """A valid version-1 envelope, written out by hand (not with the library's codec)."""
    return {
        "x-hopsched-version": 1,
        "x-hopsched-id": schedule_id,
        "x-hopsched-due": due_us,
        "x-hopsched-exchange": "",
        "x-hopsched-routing-key": target,
        "x-hopsched-hops": 0,
        "app-header": "kept",
    }


async def test_parks_malformed_envelopes(
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    relays: Relays,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    amqp: AMQP,
) -> None:
    """Messages put on the relay queue by hand with bad envelopes are parked, with a reason."""
    topology = hopsched.Topology.from_settings(settings)
    target = await targets.queue()
    parked = await targets.consume(topology.parked_queue)
    due = now_us() + 100_000

    def without(name: str, **changes: Any) -> dict[str, Any]:
        headers = envelope_headers(target.name, due, f"id-{name}")
        headers.update(changes)
        return {k: v for k, v in headers.items() if k != name}

    # message_id -> (body, headers or None, what the reason must mention)
    malformed: dict[str, tuple[bytes, dict[str, Any] | None, str]] = {
        "missing-due": (b"a", without("x-hopsched-due"), "x-hopsched-due"),
        "due-str": (b"b", without("", **{"x-hopsched-due": str(due)}), "x-hopsched-due"),
        "due-float": (b"c", without("", **{"x-hopsched-due": float(due)}), "x-hopsched-due"),
        "due-bool": (b"d", without("", **{"x-hopsched-due": True}), "x-hopsched-due"),
        "version-99": (b"e", without("", **{"x-hopsched-version": 99}), "99"),
        "no-headers": (b"f", None, "x-hopsched-version"),
        "empty-body": (b"", {"app-header": "only"}, "x-hopsched-version"),
        "non-utf8-body": (b"\xff\xfe\x80 \xc3", without("x-hopsched-due"), "x-hopsched-due"),
    }
    valid: dict[str, bytes] = {"valid-empty-body": b"", "valid-non-utf8-body": b"\xff\xfe\x80"}

    channel = await amqp.channel(publisher_confirms=True)
    raw = await channel.get_underlay_channel()
    messages = [
        (message_id, body, headers) for message_id, (body, headers, _) in malformed.items()
    ] + [
        (message_id, body, envelope_headers(target.name, due, message_id))
        for message_id, body in valid.items()
    ]
    for message_id, body, headers in messages:
        confirm = await raw.basic_publish(
            body,
            exchange="",
            routing_key=topology.relay_queue,
            properties=Basic.Properties(message_id=message_id, headers=headers, delivery_mode=2),
        )
        assert isinstance(confirm, Basic.Ack)
    await channel.close()

    await parked.wait_for(len(malformed), within=30)
    await target.wait_for(len(valid), within=30)
    await parked.settle(0.5)
    got = {copy.properties.message_id: copy for copy in parked.received}
    assert len(parked) == len(malformed)
    assert set(got) == set(malformed)
    for message_id, (body, headers, mention) in malformed.items():
        copy = got[message_id]
        reason = copy.headers.get(HEADER_PARKED_REASON)
        assert isinstance(reason, str)
        assert reason.startswith("malformed envelope"), reason
        assert mention in reason, (message_id, reason)
        assert copy.body == body
        for name, value in (headers or {}).items():
            if name != "x-hopsched-due" or type(value) is not float:  # 32-bit on the wire
                assert copy.headers[name] == value, (message_id, name)
        print(f"\n{message_id}: {reason}")

    assert {r.properties.message_id: r.body for r in target.received} == valid
    target.assert_never_early()

    # The relay keeps running and delivering.
    normal = await scheduler.schedule(b"normal", delay=0.2, routing_key=target.name)
    await target.wait_for(len(valid) + 1, within=30)
    assert target.received[-1].schedule_id == normal.schedule_id
    assert relays.is_running(relay)
    assert relay.totals.parked == len(malformed)


async def test_stop_returns_promptly_and_loses_nothing(
    settings: hopsched.Settings, relays: Relays, targets: Targets
) -> None:
    """stop() midway through 200 messages; a new relay on the prefix delivers the rest."""
    target = await targets.queue()
    first = await relays.start(settings)
    rng = random.Random(11)
    async with hopsched.Scheduler(settings) as scheduler:
        scheduled = await schedule_all(
            scheduler,
            [
                {
                    "message": f"m{i}".encode(),
                    "delay": rng.uniform(1, 3),
                    "routing_key": target.name,
                }
                for i in range(200)
            ],
        )
    # Stopped once some are delivered and while others are due up to 3 s later: a fixed
    # 1 s after the start found all 200 delivered when scheduling took 2 s (loaded CI).
    await until(lambda: len(target) > 0, within=30)
    before_stop = len(target)
    last_due_s = max(s.due_us for s in scheduled) / 1e6 - time.time()
    stop_started = time.monotonic()
    await relays.stop(first)
    stop_s = time.monotonic() - stop_started
    print(
        f"\nstop: run() returned {stop_s * 1000:.0f} ms after stop(); "
        f"{before_stop} delivered before, first relay totals {first.totals}"
    )
    # It delivers what it holds when due (within the hold window), then returns.
    assert stop_s < max(0.0, last_due_s) + 1.0
    assert 0 < before_stop < 200, "the relay was not stopped midway"

    second = await relays.start(settings)
    ids = {s.schedule_id for s in scheduled}
    await target.wait_for_ids(ids, within=30)
    await target.settle(0.5)
    target.assert_never_early()
    counts = target.counts()
    assert set(counts) == ids
    duplicates = sum(counts.values()) - len(ids)
    print(
        f"stop: {target.lateness_line()}; {duplicates} duplicate(s); "
        f"second relay delivered {second.totals.delivered}"
    )
    assert first.totals.delivered + second.totals.delivered == sum(counts.values())


@pytest.mark.slow  # 15-20 s each
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
async def test_throughput_2000_due_at_once(
    queue_type: str,
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """2,000 messages due at the same instant ~2 s ahead: all delivered, never early."""
    target = await targets.queue()
    at = datetime.now(UTC) + timedelta(seconds=2)
    due_us = datetime_to_us(at)
    started = time.monotonic()
    scheduled = await schedule_all(
        scheduler,
        [{"message": f"{i}".encode(), "at": at, "routing_key": target.name} for i in range(2000)],
    )
    scheduled_s = time.monotonic() - started
    remaining_ms = (due_us - now_us()) / 1000
    await target.wait_for_ids({s.schedule_id for s in scheduled}, within=60)
    last_ms = (max(r.received_us for r in target.received) - due_us) / 1000
    await target.settle(0.5)
    target.assert_never_early()
    counts = target.counts()
    assert set(counts) == {s.schedule_id for s in scheduled}
    print(
        f"\nthroughput ({queue_type}): scheduled 2000 in {scheduled_s:.2f} s "
        f"({remaining_ms:.0f} ms before due); "
        f"last arrived {last_ms:.0f} ms after due; {sum(counts.values()) - 2000} duplicate(s); "
        f"{lateness_line(r.lateness_us for r in target.received)}"
    )
    assert relay.totals.parked == 0


async def test_hand_published_envelope_ids_are_unique_per_message(
    settings: hopsched.Settings, relay: hopsched.Relay, targets: Targets, amqp: AMQP
) -> None:
    """Two hand-published valid envelopes with the same message_id are both delivered."""
    topology = hopsched.Topology.from_settings(settings)
    target = await targets.queue()
    channel = await amqp.channel(publisher_confirms=True)
    raw = await channel.get_underlay_channel()
    due = now_us() + 50_000
    for n in range(2):
        await raw.basic_publish(
            f"same id {n}".encode(),
            exchange="",
            routing_key=topology.relay_queue,
            properties=Basic.Properties(
                message_id="same", headers=envelope_headers(target.name, due, f"s{n}")
            ),
        )
    await channel.close()
    await target.wait_for(2, within=30)
    await target.settle(0.3)
    assert sorted(r.headers[HEADER_ID] for r in target.received) == ["s0", "s1"]
    target.assert_never_early()


async def park_when_due_together(
    relay: hopsched.Relay,
    relays: Relays,
    scheduler: hopsched.Scheduler,
    targets: Targets,
    settings: hopsched.Settings,
    invalid: str,
) -> None:
    """100 valid and 10 invalid messages (``invalid``: "unroutable" or "missing"), all due
    at the same instant: the invalid ones are parked, every valid one delivered."""
    topology = hopsched.Topology.from_settings(settings)
    target = await targets.queue()
    parked = await targets.consume(topology.parked_queue)
    bad_exchange = await targets.exchange() if invalid == "unroutable" else targets.name("nope")
    at = datetime.now(UTC) + timedelta(seconds=1.5)
    calls: list[dict[str, Any]] = []
    for i in range(110):
        if i % 11 == 5:
            calls.append({"message": b"bad", "exchange": bad_exchange, "routing_key": f"k{i}"})
        else:
            calls.append({"message": b"good", "routing_key": target.name})
    scheduled = await schedule_all(scheduler, [{**call, "at": at} for call in calls])
    valid = {
        s.schedule_id for s, c in zip(scheduled, calls, strict=True) if c["message"] == b"good"
    }
    bad = {s.schedule_id for s in scheduled} - valid

    await target.wait_for_ids(valid, within=20)
    await parked.wait_for(len(bad), within=20)
    await target.settle(0.5)
    target.assert_never_early()
    assert set(target.counts()) == valid
    assert set(parked.counts()) == bad
    duplicates = sum(target.counts().values()) - len(valid)
    print(f"\n{invalid} due together: {target.lateness_line()}; {duplicates} duplicate(s)")
    assert relays.is_running(relay)


@pytest.mark.parametrize("invalid", ["unroutable", "missing"])
async def test_parks_invalid_targets_due_at_the_same_instant_as_valid_ones(
    invalid: str,
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    relays: Relays,
    scheduler: hopsched.Scheduler,
    targets: Targets,
) -> None:
    """A 404 among confirms in flight must not take the relay's connection down."""
    await park_when_due_together(relay, relays, scheduler, targets, settings, invalid)


async def test_bodies_of_8_mib_empty_and_non_utf8_arrive_intact(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """Bad-input bodies through real hops, byte for byte, once each, never early."""
    target = await targets.queue()
    bodies = {
        "8MiB": random.Random(1).randbytes(8 * 1024 * 1024),
        "empty": b"",
        "non-utf8": b"\xff\xfe\x80\x00 \xc3\x28 \xed\xa0\x80",
    }
    sent: dict[str, bytes] = {}
    for name, body in bodies.items():
        for delay in (0.0, 0.4, 2.5):
            result = await scheduler.schedule(
                aio_pika.Message(body, message_id=f"{name}-{delay}"),
                delay=delay,
                routing_key=target.name,
            )
            sent[result.schedule_id] = body
    await target.wait_for_ids(sent, within=30)
    await target.settle(0.5)
    assert target.counts() == dict.fromkeys(sent, 1)
    for copy in target.received:
        assert copy.body == sent[copy.schedule_id]
    target.assert_never_early()
    hops = max(copy.headers["x-hopsched-hops"] for copy in target.received)
    print(f"\nbodies 8 MiB / empty / non-UTF-8, {hops} hops at most: {target.lateness_line()}")


async def test_a_crowded_relay_hops_instead_of_holding(
    make_settings: Any, relays: Relays, targets: Targets
) -> None:
    """With nine tenths of its prefetch held, the relay hops short remainders instead of
    holding, even once its own backlog has made hops look late (the learned margin at
    its cap). An uncrowded relay makes no hop at all for delays of 0.1-2 s (the
    scheduler's first hop lands within the hold window), so a few dozen relay hops show
    the rule at work; how many depends on how fast the broker dead-letters."""
    settings = make_settings(prefetch=8)  # holds at most 7 at once
    target = await targets.queue()
    relay = await relays.start(settings)
    rng = random.Random(5)
    async with hopsched.Scheduler(settings) as scheduler:
        scheduled = await schedule_all(
            scheduler,
            [
                {"message": b"short", "delay": rng.uniform(0.1, 2.0), "routing_key": target.name}
                for _ in range(300)
            ],
        )
    await target.wait_for_ids({s.schedule_id for s in scheduled}, within=60)
    await target.settle(0.5)
    target.assert_never_early()
    assert set(target.counts()) == {s.schedule_id for s in scheduled}
    hops = [r.headers[HEADER_HOPS] for r in target.received]
    print(
        f"\ncrowded relay: {relay.totals.hops} relay hops for 300 messages, hops per message "
        f"max {max(hops)}; hop overshoot {relay.totals.overshoot.summary()}; "
        f"{target.lateness_line()}"
    )
    assert hops.count(0) >= 1, "nothing was held"
    # Uncrowded it would make none; how many depends on the machine's load (30+ quiet,
    # fewer in a loaded CI run): any shows the rule.
    assert relay.totals.hops >= 1, "a crowded relay kept holding"


async def test_a_callers_hop_expiry_header_is_replaced(
    relay: hopsched.Relay, scheduler: hopsched.Scheduler, targets: Targets
) -> None:
    """``x-hopsched-hop-expires`` belongs to hopsched: a caller's own never reaches the relay."""
    target = await targets.queue()
    forged = {HEADER_HOP_EXPIRES: 0}
    held = await scheduler.schedule(
        aio_pika.Message(b"held", headers=forged), delay=0.3, routing_key=target.name
    )
    await target.wait_for_ids({held.schedule_id}, within=30)
    assert relay.totals.overshoot.count == 0  # no hop, so nothing to measure

    hopped = await scheduler.schedule(
        aio_pika.Message(b"hopped", headers=forged), delay=5.0, routing_key=target.name
    )
    await target.wait_for_ids({held.schedule_id, hopped.schedule_id}, within=30)
    target.assert_never_early()
    # The scheduler's first hop is measured against the producer's clock: its offset
    # estimate would be 56 years had the forged expiry reached the relay.
    offset_us = relay.totals.clock_offsets[scheduler.producer]
    assert abs(offset_us) < 60_000_000, "the forged expiry was measured"


async def test_hops_carry_their_expiry_and_the_relay_measures_overshoot(
    make_settings: Any, relays: Relays, targets: Targets
) -> None:
    """Each hop says when its TTL runs out; the relay measures how late the hops it made
    came back (a 0.5 s hold window and 4 s: the scheduler's 2.048 s hop, then the relay's
    1.024 and 0.512 s), and the target never sees that header."""
    settings = make_settings(hold_window_ms=500)
    relay = await relays.start(settings)
    async with hopsched.Scheduler(settings) as scheduler:
        target = await targets.queue()
        scheduled = await schedule_all(
            scheduler,
            [{"message": b"hop", "delay": 4.0, "routing_key": target.name} for _ in range(20)],
        )
    await target.wait_for_ids({s.schedule_id for s in scheduled}, within=30)
    target.assert_never_early()
    assert all(HEADER_HOP_EXPIRES not in r.headers for r in target.received)
    assert all(r.headers[HEADER_HOPS] >= 1 for r in target.received)
    overshoot = relay.totals.overshoot
    print(f"\nhop overshoot at the relay: {overshoot.summary()} over {overshoot.count} hops")
    assert overshoot.count >= 40
    assert overshoot.percentile_ms(50) < 1000
