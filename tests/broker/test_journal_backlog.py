"""A Scheduler's journal records whose write failed are kept and written again: against
the real broker, with ``{prefix}.journal`` deleted under the Scheduler (each write is
returned: no queue) and declared again later, by a relay starting or by hand.

What is exact: every schedule made while the journal took no writes is known to
``get()`` afterwards, none delivered early, none lost. The waits are bounds far above
the back-off's (30 s at most between tries) on a loaded two-core machine.
"""

from __future__ import annotations

import logging
import time

import aio_pika
import pytest
from support import Relays, Targets, explain_missing, until

import hopsched
from hopsched.broker.objects import declare_topology
from hopsched.errors import ChannelClosedError
from hopsched.journal.records import DELIVERED, HELD, PENDING
from hopsched.topology import Topology

COUNT = 20


async def delete_journal(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection
) -> None:
    channel = await amqp.channel()
    await channel.queue_delete(Topology.from_settings(settings).journal_stream)
    await channel.close()


async def schedule_while_the_journal_is_gone(
    scheduler: hopsched.Scheduler,
    amqp: aio_pika.abc.AbstractConnection,
    routing_key: str,
    delay: float,
) -> list[hopsched.Scheduled]:
    """One schedule to open the journal's writer, the journal deleted, then ``COUNT``."""
    await scheduler.schedule(b"before", delay=delay, routing_key=routing_key)
    await delete_journal(scheduler.settings, amqp)
    scheduled, took = [], []
    for index in range(COUNT):
        started = time.monotonic()
        scheduled.append(
            await scheduler.schedule(b"%d" % index, delay=delay, routing_key=routing_key)
        )
        took.append(time.monotonic() - started)
    print(f"\nschedule() while the journal was gone: max {max(took) * 1000:.1f} ms")
    assert (scheduler.journal_backlog, scheduler.journal_failures) == (COUNT, COUNT)
    return scheduled


async def test_schedules_the_journal_did_not_take_are_known_once_it_takes_writes_again(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    targets: Targets,
    relays: Relays,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = await targets.queue()
    caplog.set_level(logging.INFO, "hopsched.scheduler")
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await schedule_while_the_journal_is_gone(scheduler, amqp, target.name, 10)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings  # once, not per write
        assert "did not take 1 records" in warnings[0]
        assert "written again" in warnings[0]
        with pytest.raises(ChannelClosedError, match="404"):  # no journal to read yet
            await scheduler.get(scheduled[0].schedule_id)

        await relays.start(settings)  # it declares the journal again
        started = time.monotonic()
        await until(lambda: scheduler.journal_backlog == 0, within=60)  # back-off alone
        print(f"written again {time.monotonic() - started:.1f} s after the relay started")
        for one in scheduled:
            info = await scheduler.get(one.schedule_id)
            assert info is not None
            assert (info.state in {PENDING, HELD, DELIVERED}, info.due_us) == (True, one.due_us)
        assert (scheduler.journal_rewritten, scheduler.journal_dropped) == (COUNT, 0)
        assert any("takes writes again" in r.getMessage() for r in caplog.records)

    wanted = {one.schedule_id for one in scheduled}
    try:
        await target.wait_for_ids(wanted, within=60)
    except pytest.fail.Exception:
        await explain_missing(settings, target, wanted, relays)
        raise
    target.assert_never_early()
    assert len({r.schedule_id for r in target.received}) == COUNT + 1  # "before" too


async def test_the_next_write_the_journal_takes_writes_the_kept_records_at_once(
    settings: hopsched.Settings, amqp: aio_pika.abc.AbstractConnection, targets: Targets
) -> None:
    target = await targets.queue()
    journal = Topology.from_settings(settings).journal_stream
    async with hopsched.Scheduler(settings, declare=True) as scheduler:
        scheduled = await schedule_while_the_journal_is_gone(scheduler, amqp, target.name, 600)
        # Three tries (after 1, 2 and 4 s): the next is 8 s after the third.
        await until(lambda: scheduler.journal_failures >= COUNT + 3, within=30)
        await declare_topology(settings, [journal])
        started = time.monotonic()
        await scheduler.schedule(b"after", delay=600, routing_key=target.name)
        await until(lambda: scheduler.journal_backlog == 0, within=4)
        print(f"\nwritten again {time.monotonic() - started:.2f} s after the next write")
        for one in scheduled:
            info = await scheduler.get(one.schedule_id)
            assert info is not None
            assert (info.state, info.due_us) == (PENDING, one.due_us)


async def test_close_tries_once_more_and_says_what_it_gives_up(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    targets: Targets,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = await targets.queue()
    journal = Topology.from_settings(settings).journal_stream
    async with hopsched.Scheduler(settings, declare=True) as given_up:
        await schedule_while_the_journal_is_gone(given_up, amqp, target.name, 600)
    assert (given_up.journal_backlog, given_up.journal_dropped) == (0, COUNT)
    assert any(
        f"closing: {COUNT} journal records remain unwritten" in r.getMessage()
        and "stands all the same" in r.getMessage()
        for r in caplog.records
    )

    async with hopsched.Scheduler(settings, declare=True) as closing:
        await schedule_while_the_journal_is_gone(closing, amqp, target.name, 600)
        await declare_topology(settings, [journal])
        written = closing.journal_rewritten  # 0 unless a try came before the close
    assert (closing.journal_backlog, closing.journal_dropped) == (0, 0)
    assert closing.journal_rewritten == COUNT
    print(f"\nwritten by the background before close(): {written}")
    async with hopsched.Scheduler(settings) as reader:
        fold = [info async for info in reader.pending()]
    assert len(fold) == COUNT  # ("before" went with the journal deleted)


async def test_a_running_relay_declares_a_deleted_journal_again_at_its_next_write(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    targets: Targets,
    relays: Relays,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The journal deleted under a relay and a Scheduler: the relay's next write (a
    delivery's record) comes back, and it declares the journal again and writes that
    record; the Scheduler's kept records follow at its next try."""
    target = await targets.queue()
    caplog.set_level(logging.WARNING, "hopsched")
    await relays.start(settings)
    async with hopsched.Scheduler(settings) as scheduler:
        await scheduler.schedule(b"before", delay=600, routing_key=target.name)
        await delete_journal(settings, amqp)
        soon = await scheduler.schedule(b"soon", delay=0.5, routing_key=target.name)
        assert scheduler.journal_backlog == 1  # returned: kept
        await target.wait_for_ids({soon.schedule_id}, within=30)
        await until(lambda: scheduler.journal_backlog == 0, within=60)  # back-off alone

        info = await scheduler.get(soon.schedule_id)
        assert info is not None
        # The relay's delivered record, written again once it declared the journal.
        assert (info.state, info.due_us) == (DELIVERED, soon.due_us)
    logged = [r.getMessage() for r in caplog.records]
    declared = [line for line in logged if "declaring it again" in line]
    assert len(declared) == 1, declared
    assert "went with it" in declared[0]
    # the relay's writer does not say the records are lost, then write them
    assert not any("did not take" in line and "journal records" in line for line in logged)
    target.assert_never_early()
    assert [r.schedule_id for r in target.received] == [soon.schedule_id]


async def test_a_relay_starting_on_a_prefix_without_its_journal_says_it_declared_it(
    settings: hopsched.Settings,
    amqp: aio_pika.abc.AbstractConnection,
    relays: Relays,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "hopsched.relay")
    await declare_topology(settings)
    await delete_journal(settings, amqp)
    await relays.start(settings)
    journal = Topology.from_settings(settings).journal_stream
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(journal)]
    assert len(said) == 1, said
    assert "was missing" in said[0]
    assert "know a schedule made before only from its next record" in said[0]
