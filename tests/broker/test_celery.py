"""Celery through hopsched (issue 32): real workers, a real broker, no mocks.

Each test runs a real Celery worker (``celery -A support.celery_app worker``, solo pool, a
subprocess) of an app ``hopsched.integrations.celery.install()`` was called on
(``tests/support/celery_app.py``), and a relay on the test's prefix; the test process sends
tasks with the same app. Each task run appends what its request carried and the
instant it ran to a file the test reads. Every queue and exchange the app makes
carries the run's marker and is deleted after the test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue
from support import HEADER_PARKED_REASON, Cleanup, Targets, lateness_line, message_count, unique
from support.celery_app import make_app
from support.relays import RelayProcess

import hopsched
from hopsched.core.clock import now_us
from hopsched.integrations import celery as hopsched_celery

TESTS = Path(__file__).parents[1]
#: How long a task may take to reach the worker after its due time here, s (lateness
#: is printed, not asserted: a shared two-core machine).
WITHIN_S = 10.0
WORKER_START_S = 30.0


@dataclass(frozen=True)
class Run:
    """One execution of a task, as its request saw it (``celery_app.make_app``)."""

    task_id: str
    args: list[Any]
    kwargs: dict[str, Any]
    eta: str | None
    retries: int
    tenant: str | None
    priority: int | None
    routing_key: str
    at_us: int


class CeleryWorker:
    """``celery -A support.celery_app worker`` on both queues (solo pool), and its runs."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.runs_file = Path(config["runs"])
        self.lines: list[str] = []
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = dict(os.environ) | {
            "HOPSCHED_TEST_CELERY": json.dumps(self.config),
            "PYTHONPATH": str(TESTS),
        }
        self._process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "celery", "-A", "support.celery_app", "worker", "-P", "solo"),
            *("-Q", f"{self.config['queue']},{self.config['other_queue']}", "-l", "INFO"),
            *("--without-mingle", "--without-gossip"),
            *("-n", f"{unique('worker')}@%h"),
            cwd=TESTS,
            env=env,
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        self._reader = asyncio.create_task(self._read(self._process))
        try:
            async with asyncio.timeout(WORKER_START_S):
                while not any(" ready." in line for line in self.lines):
                    if self._reader.done():
                        pytest.fail("the celery worker exited:\n" + "".join(self.lines))
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pytest.fail("the celery worker was not ready:\n" + "".join(self.lines))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            self.lines.append(line.decode(errors="replace"))

    async def stop(self) -> None:
        """Cold shutdown (SIGQUIT: a warm one takes ~9 s, and the tests end with the
        worker idle); SIGKILL after 20 s."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGQUIT)
        try:
            async with asyncio.timeout(20):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
        if self._reader is not None:
            await self._reader

    def runs(self) -> list[Run]:
        if not self.runs_file.exists():
            return []
        lines = self.runs_file.read_text().splitlines()
        return [_run(json.loads(line)) for line in lines if line.endswith("}")]

    def of(self, task_id: str) -> list[Run]:
        return [run for run in self.runs() if run.task_id == task_id]

    def counts(self) -> Counter[str]:
        return Counter(run.task_id for run in self.runs())

    async def wait_for(self, count: int, within: float = WITHIN_S) -> list[Run]:
        try:
            async with asyncio.timeout(within):
                # Runs are lines in a file: polling is the only way to see them.
                while len(runs := self.runs()) < count:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pytest.fail(f"{len(self.runs())} of {count} task runs after {within} s")
        return runs


def _run(line: dict[str, Any]) -> Run:
    return Run(
        line["id"],
        line["args"],
        line["kwargs"],
        line["eta"],
        line["retries"],
        line["tenant"],
        line["priority"],
        line["routing_key"],
        line["at_us"],
    )


@dataclass
class CeleryApp:
    """The test process's app (the producer), its worker and its queues."""

    app: Celery
    worker: CeleryWorker
    queue: str
    other_queue: str

    @property
    def record(self) -> Any:
        return self.app.tasks[self.worker.config["record"]]

    @property
    def retrying(self) -> Any:
        return self.app.tasks[self.worker.config["retrying"]]


def celery_config(settings: hopsched.Settings, cleanup: Cleanup, runs: Path) -> dict[str, Any]:
    """Names for ``celery_app.make_app``, each carrying the run's marker, registered for
    deletion: queues, their exchanges, the event and control exchanges."""
    config = {
        "url": str(settings.url),
        "prefix": settings.prefix,
        "app": unique("app"),
        "queue": unique("celery"),
        "other_queue": unique("celery-other"),
        "events": unique("celeryev"),
        "control": unique("control"),
        "record": unique("record"),
        "retrying": unique("retrying"),
        "runs": str(runs),
    }
    cleanup.queues.update({config["queue"], config["other_queue"]})
    cleanup.exchanges.update(
        {
            config["queue"],
            config["other_queue"],
            config["events"],
            f"{config['control']}.pidbox",
            f"reply.{config['control']}.pidbox",
        }
    )
    return config


@pytest.fixture
async def celery_app(
    settings: hopsched.Settings, relay: hopsched.Relay, cleanup: Cleanup, tmp_path: Path
) -> AsyncIterator[CeleryApp]:
    """The app and its worker, with a relay in the test process."""
    async with running_app(settings, cleanup, tmp_path) as made:
        yield made


@contextlib.asynccontextmanager
async def running_app(
    settings: hopsched.Settings, cleanup: Cleanup, tmp_path: Path
) -> AsyncIterator[CeleryApp]:
    config = celery_config(settings, cleanup, tmp_path / "runs.jsonl")
    app = make_app(config)
    worker = CeleryWorker(config)
    await worker.start()
    try:
        yield CeleryApp(app, worker, config["queue"], config["other_queue"])
    finally:
        await worker.stop()
        await asyncio.to_thread(hopsched_celery.scheduler(app).close)


def _send(task: Any, *args: Any, **options: Any) -> Any:
    return task.apply_async(args, **options)


async def send(task: Any, *args: Any, **options: Any) -> Any:
    """``task.apply_async(args, **options)`` off the event loop (the relay runs on it)."""
    return await asyncio.to_thread(_send, task, *args, **options)


def _due_us(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000)


async def test_delayed_tasks_run_once_when_due_with_everything_intact(
    celery_app: CeleryApp, amqp: Any
) -> None:
    made = celery_app
    # The delays leave seconds for the three sends and the undelayed task's run on a
    # loaded machine: with 1 s, the countdown task came first (a CI run).
    start = datetime.now(UTC)
    at_eta = start + timedelta(seconds=5.5)
    by_eta = await send(
        made.record,
        1,
        "two",
        eta=at_eta,
        kwargs={"three": [3, 3.5], "four": None},
        headers={"tenant": "acme"},
        priority=7,
    )
    by_countdown = await send(made.record, "late", countdown=5.0, queue=made.other_queue)
    at_now = await send(made.record, "now")  # not delayed: sent to the queue as usual
    sent_us = now_us()
    countdown_due_us = _due_us(start) + 5_000_000

    first = await made.worker.wait_for(1)
    assert [run.task_id for run in first] == [at_now.id], "only the undelayed task ran at once"
    # Pending tasks sit in hopsched's ladder: not on the worker's queues, nor in its memory.
    assert await message_count(amqp, made.queue) == 0
    assert await message_count(amqp, made.other_queue) == 0

    await made.worker.wait_for(3)
    await asyncio.sleep(1.0)  # a duplicate would come now
    assert made.worker.counts() == Counter({at_now.id: 1, by_eta.id: 1, by_countdown.id: 1})
    (eta_run,) = made.worker.of(by_eta.id)
    (countdown_run,) = made.worker.of(by_countdown.id)
    assert eta_run.at_us >= _due_us(at_eta), "never early"
    assert countdown_run.at_us >= countdown_due_us, "never early"
    assert eta_run.args == [1, "two"]
    assert eta_run.kwargs == {"three": [3, 3.5], "four": None}
    assert eta_run.tenant == "acme"
    assert eta_run.eta is None, "the worker got no eta: it held nothing"
    assert eta_run.priority == 7
    assert eta_run.routing_key == made.queue
    assert countdown_run.routing_key == made.other_queue
    assert countdown_run.eta is None
    print(
        f"celery via hopsched: sent in {(sent_us - _due_us(start)) / 1000:.0f} ms; "
        + lateness_line([eta_run.at_us - _due_us(at_eta), countdown_run.at_us - countdown_due_us])
    )


async def test_retry_with_a_countdown_goes_through_hopsched(celery_app: CeleryApp) -> None:
    made = celery_app
    sent = await send(made.retrying, "x")
    runs = await made.worker.wait_for(2, within=WITHIN_S + 1)
    await asyncio.sleep(0.5)
    first, second = runs
    assert first.task_id == second.task_id == sent.id
    assert second.retries == 1
    assert second.eta is None, "the retry reached the worker when due"
    assert second.at_us - first.at_us >= 1_000_000, "never early"
    assert len(made.worker.runs()) == 2
    info = await asyncio.to_thread(hopsched_celery.scheduler(made.app).get, sent.id)
    assert info is not None, "the retry was scheduled on hopsched (its journal knows it)"


async def test_cancel_and_schedule_signature(celery_app: CeleryApp) -> None:
    made = celery_app
    # 5 s: time for three calls that each connect, on a loaded machine (CI at load ~10
    # saw 1.5 s run out before the cancel: in_time False)
    at = datetime.now(UTC) + timedelta(seconds=5)
    kept_id, cancelled_id = unique("kept"), unique("cancelled")
    kept = await asyncio.to_thread(
        hopsched_celery.schedule_signature, made.record.s("kept"), at=at, schedule_id=kept_id
    )
    await asyncio.to_thread(
        hopsched_celery.schedule_signature,
        made.record.s("cancelled"),
        at=at,
        schedule_id=cancelled_id,
    )
    assert kept.id == kept_id
    cancelled = await asyncio.to_thread(hopsched_celery.cancel, made.app, cancelled_id, due=at)
    assert cancelled.in_time is True
    (run,) = await made.worker.wait_for(1)
    await asyncio.sleep(1.0)  # the cancelled one would have come by now
    assert made.worker.counts() == Counter({kept_id: 1})
    assert run.at_us >= _due_us(at)
    assert run.args == ["kept"]


def test_schedule_signature_refuses_a_naive_time(settings: hopsched.Settings) -> None:
    app = Celery(unique("app"), set_as_current=False)
    hopsched_celery.install(app, settings)

    @app.task(name=unique("noop"), shared=False)
    def noop() -> None:
        pass

    with pytest.raises(hopsched.InvalidScheduleError, match="timezone-aware"):
        hopsched_celery.schedule_signature(noop.s(), at=datetime.now() + timedelta(seconds=1))


def test_an_app_without_install_is_named() -> None:
    app = Celery("plain", set_as_current=False)
    with pytest.raises(hopsched.InvalidSettingsError, match="install"):
        hopsched_celery.cancel(app, "some-task-id")


async def test_a_task_whose_queue_is_gone_when_due_is_parked_with_a_reason(
    celery_app: CeleryApp, amqp: Any, targets: Targets, prefix: str, cleanup: Cleanup
) -> None:
    made = celery_app
    parked = await targets.consume(f"{prefix}.parked")
    name = unique("celery-gone")  # a queue no worker consumes: Celery declares it on send
    cleanup.queues.add(name)
    cleanup.exchanges.add(name)
    sent = await send(  # 3 s: time to delete its queue first, on a loaded machine too
        made.record, "orphan", countdown=3.0, queue=Queue(name, Exchange(name), name)
    )
    async with amqp.channel() as channel:  # the queue goes before the task is due
        await channel.queue_delete(name)
    (message,) = await parked.wait_for(1, within=WITHIN_S)
    assert message.schedule_id == sent.id
    assert message.headers[HEADER_PARKED_REASON]
    assert message.headers["id"] == sent.id, "Celery's headers travel with it"
    assert made.worker.of(sent.id) == []
    print(f"parked: {message.headers[HEADER_PARKED_REASON]}")


async def test_a_task_hopsched_cannot_take_is_sent_with_its_eta_as_celery_would(
    settings: hopsched.Settings, cleanup: Cleanup, tmp_path: Path
) -> None:
    """A prefix never declared (a worker's misconfiguration): a countdown task and a
    ``retry(countdown=…)`` are sent with their eta, as without hopsched, and run once,
    not early; a retry that raised was rejected and lost."""
    undeclared = dataclasses.replace(settings, prefix=unique())
    async with running_app(undeclared, cleanup, tmp_path) as made:
        start = datetime.now(UTC)
        sent = await send(made.record, "fallback", countdown=2.0)
        retried = await send(made.retrying, "x")
        await made.worker.wait_for(3, within=WITHIN_S + 5)
        await asyncio.sleep(1.0)  # a duplicate would come now
        assert made.worker.counts() == Counter({sent.id: 1, retried.id: 2})
        (run,) = made.worker.of(sent.id)
        assert run.eta is not None, "Celery's own eta: the worker held it"
        assert run.at_us >= _due_us(start) + 2_000_000, "never early"
        first, second = made.worker.of(retried.id)
        assert second.at_us - first.at_us >= 1_000_000, "never early"


@pytest.mark.slow
async def test_a_relay_killed_under_1000_pending_tasks_loses_none(
    settings: hopsched.Settings, cleanup: Cleanup, tmp_path: Path
) -> None:
    """1,000 tasks due over 5 s; the relay (``hopsched relay``) is SIGKILLed once they
    start coming due and started again 1 s later. Celery has no de-duplication of its
    own: duplicates are bounded as docs/guarantees.md says (the relay's publishes in
    flight: at most 256 per busy lane, two lanes here)."""
    relay = RelayProcess(settings)
    await relay.start()
    try:
        async with running_app(settings, cleanup, tmp_path) as made:
            base = datetime.now(UTC) + timedelta(seconds=6)
            etas = [base + timedelta(seconds=5 * i / 1000) for i in range(1000)]

            def send_all() -> list[str]:
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    results = pool.map(lambda eta: made.record.apply_async(("x",), eta=eta), etas)
                    return [result.id for result in results]

            ids = await asyncio.to_thread(send_all)
            due_us = {task_id: _due_us(eta) for task_id, eta in zip(ids, etas, strict=True)}
            await asyncio.sleep(max(0.0, (base - datetime.now(UTC)).total_seconds()) + 1.0)
            await relay.kill()
            await asyncio.sleep(1.0)
            await relay.start()
            await made.worker.wait_for(1000, within=60)
            await asyncio.sleep(2.0)  # duplicates still on their way
            runs = made.worker.runs()
    finally:
        if relay.returncode is None:
            await relay.terminate(within=30)
    counts = Counter(run.task_id for run in runs)
    lost = set(ids) - set(counts)
    duplicates = sum(count - 1 for count in counts.values())
    early = [run.task_id for run in runs if run.at_us < due_us[run.task_id]]
    print(
        f"celery, relay SIGKILLed under 1,000 tasks: lost {len(lost)}, duplicates "
        f"{duplicates}, early {len(early)}; "
        + lateness_line(run.at_us - due_us[run.task_id] for run in runs)
    )
    assert not lost
    assert not early
    assert set(counts) == set(ids)
    assert duplicates <= 2 * 256
