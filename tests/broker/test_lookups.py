"""Look-ups answered by relays (``Settings.lookups``, ``hopsched.journal.lookups``) on
the real broker: the answer is what reading the journal says (``pending_copies`` aside)
and knows what was confirmed just before it was asked; without a relay answering,
``get()`` reads the journal; a request that is not one, or a reply address the broker
refuses (RabbitMQ closes the connection), stops no answer and costs no reading.
Timing is for the benchmark (benchmarks/journal_lookups.py); here the relay's count of
answers says who answered."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest
from support import Relays, Targets, hopsched_cli, until

import hopsched
from hopsched.errors import BrokerConnectionLost, ChannelClosedError
from hopsched.journal.lookups import LookupServer
from hopsched.journal.records import CANCELLED, DELIVERED, PENDING, ScheduleInfo
from hopsched.journal.stream import read_journal

UNKNOWN = uuid.uuid4().hex


async def from_the_stream(settings: hopsched.Settings, ids: list[str]) -> dict[str, Any]:
    """What reading the journal says of ``ids``, as a relay answers it."""
    fold = await read_journal(settings, copies=False)
    hold_us = settings.hold_window_ms * 1000
    now = hopsched.Scheduler(settings)._clock()
    return {i: fold.info(i, now, hold_us) for i in ids}


async def state_of(scheduler: hopsched.Scheduler, schedule_id: str) -> str | None:
    info = await scheduler.get(schedule_id)
    return None if info is None else info.state


async def answering(relays: Relays, settings: hopsched.Settings) -> hopsched.Relay:
    """A relay started with ``settings`` (look-ups on), once it answers them."""
    relay = await relays.start(settings)
    await until(lambda: relay.lookups is not None and relay.lookups.ready, within=10)
    return relay


async def get_unless_404(scheduler: hopsched.Scheduler, schedule_id: str) -> Any:
    """``get()``, or "404" while the journal is missing. RabbitMQ 3.10.8 also closes
    the connection of a write to a stream just deleted (541) or just declared and not
    yet started (506): the same gap, seen from the reading's marker."""
    try:
        return await scheduler.get(schedule_id)
    except ChannelClosedError as error:
        if error.reply_code != 404:
            raise
        return "404"
    except BrokerConnectionLost as error:
        if not any(code in str(error) for code in ("506 RESOURCE_ERROR", "541 INTERNAL_ERROR")):
            raise
        return "404"


def same(info: ScheduleInfo | None) -> Any:
    """``info`` without what only one look-up of one id by reading counts."""
    return None if info is None else dataclasses.replace(info, pending_copies=None)


async def test_a_relay_answers_what_reading_the_journal_says_of_what_was_just_done(
    relays: Relays, make_settings: Callable[..., hopsched.Settings], targets: Targets
) -> None:
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        assert isinstance(relay.lookups, LookupServer)
        pending = await scheduler.schedule(b"p", delay=3600, routing_key=target.name)
        cancelled = await scheduler.schedule(b"c", delay=3600, routing_key=target.name)
        soon = await scheduler.schedule(b"d", delay=0.2, routing_key=target.name)
        ids = [pending.schedule_id, cancelled.schedule_id, soon.schedule_id, UNKNOWN]

        # Asked at once after schedule(): the relay's answer waits for its marker.
        answered = relay.lookups.answered
        assert await state_of(scheduler, pending.schedule_id) == PENDING
        assert relay.lookups.answered == answered + 1
        await scheduler.cancel(cancelled)
        assert await state_of(scheduler, cancelled.schedule_id) == CANCELLED
        await target.wait_for(1, within=30)
        await until(lambda: relay.stats.journal_records >= 1, within=10)
        assert await state_of(scheduler, soon.schedule_id) == DELIVERED
        assert await scheduler.get(UNKNOWN) is None

        many = await scheduler.get_many([*ids, pending.schedule_id])
        assert relay.lookups.answered == answered + 5
        stream = await from_the_stream(settings, ids)
        assert {i: same(many[i]) for i in ids} == {i: same(stream[i]) for i in ids}
        assert all(many[i] is None or many[i].pending_copies is None for i in ids)  # type: ignore[union-attr]

        # An id scheduled twice: count_copies reads the journal, which counts them.
        await scheduler.schedule(
            b"again", delay=3600, routing_key=target.name, schedule_id=pending.schedule_id
        )
        asked = relay.lookups.answered
        counted = await scheduler.get(pending.schedule_id, count_copies=True)
        assert counted is not None
        assert counted.pending_copies == 2
        assert relay.lookups.answered == asked


async def test_without_a_relay_answering_get_reads_the_journal(
    relays: Relays,
    make_settings: Callable[..., hopsched.Settings],
    targets: Targets,
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    settings = make_settings(lookups=True)
    first = await answering(relays, settings)
    target = await targets.queue()
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await scheduler.schedule(b"p", delay=3600, routing_key=target.name)
        got = await scheduler.get(scheduled.schedule_id)
        assert first.lookups is not None
        assert first.lookups.answered == 1

        # The last relay answering gone, its exchange and queue go with it (auto-delete);
        # a relay without look-ups then serves the prefix, and get() reads the journal.
        await relays.stop(first)
        quiet = await relays.start(dataclasses.replace(settings, lookups=False))
        for _ in range(2):
            channel = await amqp.channel()
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_exchange(f"{settings.prefix}.lookups", passive=True)
        again = await scheduler.get(scheduled.schedule_id)
        assert same(again) == same(got)
        assert quiet.lookups is None
        # pending_copies: counted by reading (one id), not by a relay's answer.
        assert got is not None
        assert got.pending_copies is None
        assert again is not None
        assert again.pending_copies == 1


async def test_a_request_that_is_not_one_and_a_refused_reply_address_stop_no_answer(
    relays: Relays,
    make_settings: Callable[..., hopsched.Settings],
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await scheduler.schedule(b"p", delay=3600, routing_key="nowhere")
        assert await scheduler.get(scheduled.schedule_id) is not None
        assert relay.lookups is not None
        channel = await amqp.channel()
        replies: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        underlay = await channel.get_underlay_channel()
        await underlay.basic_consume(
            "amq.rabbitmq.reply-to",
            lambda m: replies.put_nowait(m),  # type: ignore[arg-type,return-value]
            no_ack=True,
        )
        exchange = await channel.get_exchange(f"{settings.prefix}.lookups", ensure=False)
        for body, reply_to in (
            (b"not json", "amq.rabbitmq.reply-to"),
            (b'{"ids": [1]}', "amq.rabbitmq.reply-to"),
            (b'{"ids": ["x"]}', "amq.rabbitmq.reply-to.bm90IGEgY2hhbm5lbA=="),
            # RabbitMQ 3.10.8 and 4.0.5 close the connection of a publish to this one (541).
            (b'{"ids": ["x"]}', "amq.rabbitmq.reply-to.g2gDZAAPcmFiYml0QGxvY2FsaG9zdGEBYQE=.x"),
            (b'{"ids": ["x"]}', ""),
        ):
            await exchange.publish(aio_pika.Message(body, reply_to=reply_to), routing_key="")
        for _ in range(2):  # the two that were not requests, answered as such
            async with asyncio.timeout(10):
                reply = await replies.get()
            assert b"not a request" in reply.body
        await asyncio.sleep(0.5)  # the refused addresses' requests answered meanwhile
        answered = relay.lookups.answered
        for _ in range(3):
            assert await state_of(scheduler, scheduled.schedule_id) == PENDING
        assert relay.lookups.answered == answered + 3
        assert relay.lookups.readings == 1  # the journal was not read again


async def test_the_cli_warns_of_an_id_scheduled_twice_and_counts_its_copies_on_asking(
    relays: Relays, make_settings: Callable[..., hopsched.Settings]
) -> None:
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    schedule_id = f"order-{uuid.uuid4().hex}"
    for _ in range(2):
        status, out, err = await hopsched_cli(
            *("schedule", "--in", "1h", "--routing-key", "q", "--schedule-id", schedule_id),
            settings=settings,
        )
        assert status == 0, err
    assert f"{schedule_id} now has 2 messages pending" in err  # read, relay or not

    status, out, err = await hopsched_cli("get", schedule_id, settings=settings)
    assert status == 0, err
    assert "2 messages of this id are pending" not in out  # the relay counts no copies
    assert relay.lookups is not None
    assert relay.lookups.answered >= 1
    status, out, err = await hopsched_cli("get", schedule_id, "--count-copies", settings=settings)
    assert status == 0, err
    assert "2 messages of this id are pending" in out
    status, out, err = await hopsched_cli(
        "get", schedule_id, UNKNOWN, "--count-copies", settings=settings
    )
    assert status == 2
    assert "--count-copies counts one id's copies: give one id" in err
    status, out, err = await hopsched_cli("status", settings=settings)
    assert "relays answering look-ups: 1\n" in out, (status, out, err)


async def test_a_relay_stopping_while_asked_leaves_no_asker_wrong_and_warns_of_nothing(
    relays: Relays,
    make_settings: Callable[..., hopsched.Settings],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await scheduler.schedule(b"p", delay=3600, routing_key="nowhere")
        states: list[str | None] = []

        async def ask() -> None:
            while True:
                states.append(await state_of(scheduler, scheduled.schedule_id))

        asking = asyncio.ensure_future(ask())
        await until(lambda: len(states) >= 20, within=30)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hopsched"):
            await relays.stop(relay)
            asked = len(states)
            await until(lambda: len(states) >= asked + 3, within=30)  # read: no relay
        asking.cancel()
        await asyncio.wait({asking})
    assert set(states) == {PENDING}
    assert relay.lookups is not None
    assert relay.lookups.answered >= 20
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == []


async def test_a_journal_declared_anew_under_an_answering_relay_is_read_anew(
    relays: Relays,
    make_settings: Callable[..., hopsched.Settings],
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    """Its reading resumes at an offset the new stream has not reached: its marker never
    comes back, so after ``_MARKER_READ_S`` it reads the new stream from its start;
    meanwhile the askers read the journal themselves, never a wrong answer."""
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    assert relay.lookups is not None
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        for _ in range(5):
            await scheduler.schedule(b"old", delay=3600, routing_key="nowhere")
        await scheduler.get_many([UNKNOWN])  # read up to here
        journal = hopsched.Topology.from_settings(settings).journal_stream
        channel = await amqp.channel()
        await channel.queue_delete(journal)
        arguments = hopsched.Topology.from_settings(settings).queues()[journal]
        await channel.declare_queue(journal, durable=True, arguments=arguments)
        scheduled = await scheduler.schedule(b"new", delay=3600, routing_key="nowhere")
        started = time.monotonic()
        while relay.lookups.readings < 2 or not relay.lookups.ready:
            assert await state_of(scheduler, scheduled.schedule_id) == PENDING
            assert time.monotonic() - started < 60, "the relay did not read the new journal"
        answered = relay.lookups.answered
        assert await state_of(scheduler, scheduled.schedule_id) == PENDING
        assert relay.lookups.answered == answered + 1


async def test_a_journal_deleted_under_an_idle_answering_relay_is_declared_again_when_asked(
    relays: Relays,
    make_settings: Callable[..., hopsched.Settings],
    amqp: aio_pika.abc.AbstractConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing due, so the relay writes no record; a look-up finds no journal, and the
    relay declares it again: get() answers again (the deleted history aside), and the
    relay's log says what happened, not that get() reads it meanwhile."""
    caplog.set_level(logging.WARNING, "hopsched")
    settings = make_settings(lookups=True)
    relay = await answering(relays, settings)
    assert relay.lookups is not None
    async with hopsched.Scheduler(settings) as scheduler:
        old = await scheduler.schedule(b"old", delay=3600, routing_key="nowhere")
        assert await state_of(scheduler, old.schedule_id) == PENDING
        channel = await amqp.channel()
        await channel.queue_delete(hopsched.Topology.from_settings(settings).journal_stream)
        await channel.close()
        started = time.monotonic()
        while (answer := await get_unless_404(scheduler, old.schedule_id)) == "404":
            assert time.monotonic() - started < 60, "the journal was not declared again"
            await asyncio.sleep(0.2)
        assert answer is None  # its record went with the journal
        new = await scheduler.schedule(b"new", delay=3600, routing_key="nowhere")
        assert await state_of(scheduler, new.schedule_id) == PENDING
    logged = [r.getMessage() for r in caplog.records]
    assert any("is gone" in line and "declaring it again" in line for line in logged), logged
    assert not any("get() reads it meanwhile" in line for line in logged), logged
