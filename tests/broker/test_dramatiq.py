"""Dramatiq through hopsched (issue 32): a real worker, a real broker, no mocks.

Each test makes a ``HopschedBroker`` (Dramatiq's ``RabbitmqBroker`` whose delays go
through hopsched) and runs a real ``dramatiq.Worker`` on it in-process, with a relay
on the test's prefix. Actors record the instant they ran and the message they got
(``CurrentMessage``). Every queue (the actor's, its ``.DQ`` and ``.XQ``) carries the
run's marker and is deleted after the test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage, Retries
from support import HEADER_PARKED_REASON, Cleanup, Targets, lateness_line, message_count, unique
from support.relays import RelayProcess

import hopsched
from hopsched.core.clock import now_us
from hopsched.integrations.dramatiq import HopschedBroker

WITHIN_S = 10.0


@dataclass(frozen=True)
class Run:
    message_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    queue_name: str
    at_us: int


@dataclass
class Runs:
    """What the worker's threads ran."""

    runs: list[Run] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, *args: Any, **kwargs: Any) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        run = Run(
            message.message_id, args, kwargs, dict(message.options), message.queue_name, now_us()
        )
        with self.lock:
            self.runs.append(run)

    def of(self, message_id: str) -> list[Run]:
        with self.lock:
            return [run for run in self.runs if run.message_id == message_id]

    def counts(self) -> Counter[str]:
        with self.lock:
            return Counter(run.message_id for run in self.runs)

    async def wait_for(self, count: int, within: float = WITHIN_S) -> list[Run]:
        try:
            async with asyncio.timeout(within):
                while len(self.runs) < count:  # noqa: ASYNC110  (worker threads append)
                    await asyncio.sleep(0.02)
        except TimeoutError:
            pytest.fail(f"{len(self.runs)} of {count} actor runs after {within} s")
        with self.lock:
            return list(self.runs)


@dataclass
class Setup:
    broker: HopschedBroker
    queue: str
    unconsumed_queue: str
    runs: Runs
    record: Any  # actor on ``queue``
    flaky: Any  # actor on ``queue``: fails its first run, the Retries middleware retries it
    orphan: Any  # actor on ``unconsumed_queue``, which no worker consumes


def dramatiq_queues(cleanup: Cleanup, *names: str) -> None:
    for name in names:
        cleanup.queues.update({name, f"{name}.DQ", f"{name}.XQ"})


def make_broker(broker_url: str, settings: hopsched.Settings, cleanup: Cleanup) -> Setup:
    queue, unconsumed = unique("dramatiq"), unique("dramatiq-unconsumed")
    dramatiq_queues(cleanup, queue, unconsumed)
    broker = HopschedBroker(
        hopsched_settings=settings,
        url=broker_url,
        max_priority=9,
        middleware=[
            CurrentMessage(),
            Retries(min_backoff=500, max_backoff=1000, max_retries=3),
        ],
    )
    runs = Runs()
    failed: set[str] = set()

    def flaky(*args: Any) -> None:
        runs.record(*args)
        message = CurrentMessage.get_current_message()
        assert message is not None
        if message.message_id not in failed:
            failed.add(message.message_id)
            raise RuntimeError("first attempt fails (a test actor)")

    def actor(fn: Callable[..., None], name: str, queue_name: str) -> Any:
        return dramatiq.actor(fn, actor_name=unique(name), queue_name=queue_name, broker=broker)

    return Setup(
        broker,
        queue,
        unconsumed,
        runs,
        actor(runs.record, "record", queue),
        actor(flaky, "flaky", queue),
        actor(runs.record, "orphan", unconsumed),
    )


@pytest.fixture
async def setup(
    broker_url: str, settings: hopsched.Settings, relay: hopsched.Relay, cleanup: Cleanup
) -> AsyncIterator[Setup]:
    """The broker and a worker, with a relay in the test process."""
    async with running(broker_url, settings, cleanup) as made:
        yield made


@contextlib.asynccontextmanager
async def running(
    broker_url: str, settings: hopsched.Settings, cleanup: Cleanup
) -> AsyncIterator[Setup]:
    made = make_broker(broker_url, settings, cleanup)
    worker = dramatiq.Worker(made.broker, queues={made.queue}, worker_threads=4, worker_timeout=100)
    await asyncio.to_thread(worker.start)
    try:
        yield made
    finally:
        await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(made.broker.close)


async def send(actor: Any, *args: Any, **options: Any) -> dramatiq.Message[Any]:
    """``actor.send_with_options(args=args, **options)`` off the event loop."""
    message: dramatiq.Message[Any] = await asyncio.to_thread(
        actor.send_with_options, args=args, **options
    )
    return message


async def test_delayed_messages_arrive_once_when_due_on_the_actor_queue(
    setup: Setup, amqp: Any
) -> None:
    # The delays leave seconds for the sends and the checks below on a loaded machine (with
    # 1 s, one came before the undelayed one was even sent).
    now = await send(setup.record, "now")
    sent = await send(setup.record, 1, "two", kwargs={"three": [3]}, delay=4000, broker_priority=5)
    later = await send(setup.record, "later", delay=4500)
    due_us = {m.message_id: m.options["eta"] * 1000 for m in (sent, later)}

    first = await setup.runs.wait_for(1)
    assert [run.message_id for run in first] == [now.message_id]
    # Pending: in hopsched's ladder, not on the actor's queue nor its delay queue.
    assert await message_count(amqp, f"{setup.queue}.DQ") == 0
    assert await message_count(amqp, setup.queue) == 0

    await setup.runs.wait_for(3)
    await asyncio.sleep(1.0)  # a duplicate would come now
    assert setup.runs.counts() == Counter(
        {now.message_id: 1, sent.message_id: 1, later.message_id: 1}
    )
    (run,) = setup.runs.of(sent.message_id)
    assert run.args == (1, "two")
    assert run.kwargs == {"three": [3]}
    assert run.queue_name == setup.queue
    assert "eta" not in run.options, "encoded as the worker re-enqueues from .DQ: no eta"
    assert run.options["broker_priority"] == 5
    lateness = []
    for message_id, due in due_us.items():
        (delayed_run,) = setup.runs.of(message_id)
        assert delayed_run.at_us >= due, "never early"
        lateness.append(delayed_run.at_us - due)
    assert await message_count(amqp, f"{setup.queue}.DQ") == 0
    print(f"dramatiq via hopsched: {lateness_line(lateness)}")


async def test_retries_back_off_through_hopsched(setup: Setup, amqp: Any) -> None:
    sent = await send(setup.flaky, "x")
    first, second = await setup.runs.wait_for(2)
    await asyncio.sleep(0.5)
    assert first.message_id == second.message_id == sent.message_id
    assert second.options["retries"] == 1
    assert second.at_us - first.at_us >= 250_000, "Retries' back-off (0.25-1 s) was kept"
    assert len(setup.runs.runs) == 2
    assert await message_count(amqp, f"{setup.queue}.DQ") == 0
    info = await asyncio.to_thread(setup.broker.hopsched.get, sent.message_id)
    assert info is not None, "the retry was scheduled on hopsched (its journal knows it)"


async def test_cancel(setup: Setup) -> None:
    cancelled = await send(setup.record, "cancelled", delay=1500)
    kept = await send(setup.record, "kept", delay=1500)
    outcome = await asyncio.to_thread(setup.broker.cancel, cancelled.message_id)
    assert outcome.schedule_id == cancelled.message_id
    await setup.runs.wait_for(1)
    await asyncio.sleep(1.0)
    assert setup.runs.counts() == Counter({kept.message_id: 1})


async def test_a_message_whose_queue_is_gone_when_due_is_parked_with_a_reason(
    setup: Setup, amqp: Any, targets: Targets, prefix: str
) -> None:
    parked = await targets.consume(f"{prefix}.parked")
    sent = await send(setup.orphan, "orphan", delay=3000)  # time to delete its queue, loaded
    async with amqp.channel() as channel:  # the queue goes before the message is due
        await channel.queue_delete(setup.unconsumed_queue)
    (message,) = await parked.wait_for(1, within=WITHIN_S)
    assert message.schedule_id == sent.message_id
    assert message.headers[HEADER_PARKED_REASON]
    assert dramatiq.Message.decode(message.body).message_id == sent.message_id
    print(f"parked: {message.headers[HEADER_PARKED_REASON]}")


async def test_a_delay_hopsched_cannot_take_goes_through_dramatiq_s_own_delay_queue(
    broker_url: str, settings: hopsched.Settings, cleanup: Cleanup
) -> None:
    """A prefix never declared (a worker's misconfiguration): the delayed message and a
    Retries back-off go through ``.DQ``, as without hopsched, and run once, not early;
    a retry that raised was acked and lost. With ``fallback=False`` the send raises."""
    undeclared = dataclasses.replace(settings, prefix=unique())
    async with running(broker_url, undeclared, cleanup) as made:
        sent = await send(made.record, "fallback", delay=1500)
        flaky = await send(made.flaky, "retried")
        await made.runs.wait_for(3, within=WITHIN_S + 5)
        await asyncio.sleep(1.0)  # a duplicate would come now
        assert made.runs.counts() == Counter({sent.message_id: 1, flaky.message_id: 2})
        (run,) = made.runs.of(sent.message_id)
        assert run.at_us >= sent.options["eta"] * 1000, "never early"
    strict = HopschedBroker(
        hopsched_settings=undeclared, url=broker_url, max_priority=9, fallback=False
    )
    try:
        actor = dramatiq.actor(
            lambda: None, actor_name=unique("strict"), queue_name=made.queue, broker=strict
        )
        with pytest.raises(hopsched.PrefixNotDeclaredError):
            await send(actor, delay=1500)
    finally:
        await asyncio.to_thread(strict.close)


@pytest.mark.slow
async def test_a_relay_killed_under_1000_pending_messages_loses_none(
    broker_url: str, settings: hopsched.Settings, cleanup: Cleanup, amqp: Any
) -> None:
    """1,000 messages due over 5 s; the relay (``hopsched relay``) is SIGKILLed once
    they start coming due and started again 1 s later. Dramatiq has no de-duplication
    of its own: duplicates are bounded as docs/guarantees.md says (at most 256 per
    busy lane, two lanes here)."""
    relay = RelayProcess(settings)
    await relay.start()
    try:
        async with running(broker_url, settings, cleanup) as made:
            start_ms = now_us() // 1000
            delays = [6000 + 5 * i for i in range(1000)]  # ms from start_ms

            def send_all() -> list[dramatiq.Message[Any]]:
                def one(delay: int) -> dramatiq.Message[Any]:
                    message: dramatiq.Message[Any] = made.record.send_with_options(
                        args=("x",), delay=start_ms + delay - now_us() // 1000
                    )
                    return message

                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    return list(pool.map(one, delays))

            sent = await asyncio.to_thread(send_all)
            due_us = {m.message_id: m.options["eta"] * 1000 for m in sent}
            await asyncio.sleep(max(0.0, (start_ms + 6000) / 1000 - now_us() / 1e6) + 1.0)
            await relay.kill()
            await asyncio.sleep(1.0)
            await relay.start()
            await made.runs.wait_for(1000, within=60)
            await asyncio.sleep(2.0)  # duplicates still on their way
            runs = list(made.runs.runs)
            assert await message_count(amqp, f"{made.queue}.DQ") == 0
    finally:
        if relay.returncode is None:
            await relay.terminate(within=30)
    counts = Counter(run.message_id for run in runs)
    lost = set(due_us) - set(counts)
    duplicates = sum(count - 1 for count in counts.values())
    early = [run.message_id for run in runs if run.at_us < due_us[run.message_id]]
    print(
        f"dramatiq, relay SIGKILLed under 1,000 messages: lost {len(lost)}, duplicates "
        f"{duplicates}, early {len(early)}; "
        + lateness_line(run.at_us - due_us[run.message_id] for run in runs)
    )
    assert not lost
    assert not early
    assert duplicates <= 2 * 256
