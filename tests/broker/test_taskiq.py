"""Taskiq through hopsched (issue 32, item 3): a real taskiq receiver, a real broker, no
mocks.

Each test makes two ``HopschedBroker`` (taskiq-aio-pika's ``AioPikaBroker`` whose delays
go through hopsched): one kicks tasks, the other is a worker, run in-process by taskiq's
own ``run_receiver_task``, with a relay on the test's prefix. The task records its task
id, its argument and the instant it ran. Every exchange and queue carries the run's
marker and is deleted after the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from support import Cleanup, lateness_line, message_count, unique
from taskiq import AsyncTaskiqDecoratedTask, Context, TaskiqDepends
from taskiq.api import run_receiver_task
from taskiq_aio_pika import Exchange, Queue

import hopsched
from hopsched.core.clock import now_us
from hopsched.integrations.taskiq import HopschedBroker

WITHIN_S = 15.0
S = 1_000_000


@dataclass
class Setup:
    producer: HopschedBroker
    queue: str
    task: AsyncTaskiqDecoratedTask[..., None]
    runs: list[tuple[str, Any, int]] = field(default_factory=list)  # task id, argument, µs

    def counts(self) -> Counter[str]:
        return Counter(task_id for task_id, _, _ in self.runs)

    async def wait_for(self, count: int, within: float = WITHIN_S) -> None:
        try:
            async with asyncio.timeout(within):
                while len(self.runs) < count:  # noqa: ASYNC110  (the receiver appends)
                    await asyncio.sleep(0.02)
        except TimeoutError:
            pytest.fail(f"{len(self.runs)} of {count} task runs after {within} s")


@contextlib.asynccontextmanager
async def running(
    broker_url: str, settings: hopsched.Settings, cleanup: Cleanup, **options: Any
) -> AsyncIterator[Setup]:
    """A producer and a worker on the test's queues; ``options`` go to both brokers."""
    exchange, queue, dead = unique("taskiq"), unique("taskiq"), unique("taskiq-dead")
    cleanup.exchanges.add(exchange)
    cleanup.queues.update({queue, dead})
    name = unique("record")

    def make() -> HopschedBroker:
        return HopschedBroker(
            hopsched_settings=settings,
            url=broker_url,
            exchange=Exchange(name=exchange),
            task_queues=[Queue(name=queue)],
            dead_letter_queue=Queue(name=dead),
            **options,
        )

    producer, worker = make(), make()
    runs: list[tuple[str, Any, int]] = []

    async def record(argument: Any, context: Context = TaskiqDepends()) -> None:  # noqa: B008 (taskiq's injection)
        runs.append((context.message.task_id, argument, now_us()))

    task = producer.register_task(record, task_name=name)
    worker.register_task(record, task_name=name)
    worker.is_worker_process = True
    await producer.startup()
    await worker.startup()
    receiver = asyncio.create_task(run_receiver_task(worker))
    try:
        yield Setup(producer, queue, task, runs)
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        await worker.shutdown()
        await producer.shutdown()


@pytest.fixture
async def setup(
    broker_url: str, settings: hopsched.Settings, relay: hopsched.Relay, cleanup: Cleanup
) -> AsyncIterator[Setup]:
    async with running(broker_url, settings, cleanup) as made:
        yield made


async def kick(setup: Setup, argument: Any, delay: float | None = None) -> tuple[str, int]:
    """Kick the task (with a ``delay`` label if given): its id and the instant before
    which it must not run, µs."""
    kicker = setup.task.kicker()
    if delay is not None:
        kicker = kicker.with_labels(delay=delay)
    not_before = now_us() + (0 if delay is None else int(delay * S))
    sent = await kicker.kiq(argument)
    return sent.task_id, not_before


async def test_delayed_tasks_run_once_when_due_and_undelayed_ones_at_once(
    setup: Setup, amqp: Any
) -> None:
    now_id, _ = await kick(setup, "now")
    # 5 s or more: time for the sends and the undelayed run on a loaded machine
    delayed = [await kick(setup, {"n": n}, delay=5 + n / 10) for n in range(10)]
    await setup.wait_for(1)
    assert [task_id for task_id, _, _ in setup.runs] == [now_id]
    assert await message_count(amqp, setup.queue) == 0  # the delayed ones wait in hopsched

    await setup.wait_for(11)
    await asyncio.sleep(1.0)  # a duplicate would come now
    assert setup.counts() == Counter({now_id: 1} | {task_id: 1 for task_id, _ in delayed})
    ran = {task_id: (argument, at) for task_id, argument, at in setup.runs}
    lateness = []
    for n, (task_id, not_before) in enumerate(delayed):
        argument, at = ran[task_id]
        assert argument == {"n": n}
        assert at >= not_before, "never early"
        lateness.append(at - not_before)
    print(f"taskiq via hopsched: {lateness_line(lateness)}")


async def test_a_delayed_task_is_cancelled_by_its_task_id(setup: Setup) -> None:
    kept, _ = await kick(setup, "kept", delay=2)
    dropped, _ = await kick(setup, "dropped", delay=2)
    cancelled = await setup.producer.cancel(dropped)
    assert cancelled.schedule_id == dropped
    await setup.wait_for(1)
    await asyncio.sleep(2.0)  # the cancelled one was due with the kept one
    assert setup.counts() == Counter({kept: 1})


async def test_the_schedule_id_is_the_task_id(setup: Setup) -> None:
    """``hopsched get TASK_ID`` finds a pending task (the journal keys it by task id)."""
    task_id, _ = await kick(setup, "looked-up", delay=60)
    info = await setup.producer.hopsched.get(task_id)
    assert info is not None
    assert info.state in ("pending", "held"), info
    await setup.producer.cancel(task_id)


async def test_a_delay_hopsched_cannot_take_goes_through_taskiq_s_own_delay_queue(
    broker_url: str, settings: hopsched.Settings, cleanup: Cleanup, caplog: Any
) -> None:
    """A prefix never declared (a worker's misconfiguration), with ``fallback`` and a
    ``delay_queue``: the delayed task goes through taskiq-aio-pika's delay queue, as
    without hopsched, with a WARNING, and runs once, not early. Without ``fallback`` the
    startup raises; ``fallback`` with no delay of taskiq's own to fall back to is refused."""
    undeclared = dataclasses.replace(settings, prefix=unique())
    delay_queue = unique("taskiq-delay")
    cleanup.queues.add(delay_queue)
    async with running(
        broker_url, undeclared, cleanup, fallback=True, delay_queue=Queue(name=delay_queue)
    ) as made:
        task_id, not_before = await kick(made, "fallback", delay=1.5)
        await made.wait_for(1)
        await asyncio.sleep(1.0)  # a duplicate would come now
        assert made.counts() == Counter({task_id: 1})
        ((_, argument, at),) = made.runs
        assert argument == "fallback"
        assert at >= not_before, "never early"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(task_id in line and "hopsched did not take" in line for line in warnings), warnings

    exchange, queue = unique("taskiq"), unique("taskiq")
    cleanup.exchanges.add(exchange)
    cleanup.queues.update({queue, f"{queue}.dead_letter"})
    strict = HopschedBroker(
        hopsched_settings=undeclared,
        url=broker_url,
        fallback=False,
        exchange=Exchange(name=exchange),
        task_queues=[Queue(name=queue)],
        dead_letter_queue=Queue(name=f"{queue}.dead_letter"),
    )
    try:
        with pytest.raises(hopsched.PrefixNotDeclaredError):
            await strict.startup()
    finally:
        await strict.shutdown()
    with pytest.raises(hopsched.InvalidSettingsError, match="delay_queue"):
        HopschedBroker(hopsched_settings=undeclared, url=broker_url, fallback=True)
