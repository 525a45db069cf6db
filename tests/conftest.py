"""Fixtures for integration tests against a real RabbitMQ broker.

The broker is ``HOPSCHED_TEST_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``);
whatever the tests do to it besides AMQP goes through ``HOPSCHED_TEST_RABBITMQCTL``
(``support.rabbitmqctl``). If it cannot be reached, every test that needs it fails with
a clear message; none is skipped. Each test gets its own prefix and deletes every queue
and exchange it made. Every name a test gives a broker object carries the run's marker
(``support.RUN_MARKER``): at the end of the run, anything carrying it that a test left on
the broker (a queue, exchange, user, vhost or policy) fails the run and is removed, and
what others made or removed meanwhile is reported, never touched (``leftovers.py``). The
run refuses to start when ``rabbitmqctl`` reaches another broker than the test URL. A test during
which asyncio logs "Task exception was never retrieved" (a task that failed with nobody
awaiting it: its work silently stopped) fails at its teardown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import pytest
from support import (
    BROKER_URL,
    RUN_MARKER,
    Cleanup,
    Relays,
    Targets,
    rabbitmqctl_command,
    unique,
)
from support.leftovers import LeftoverCheck, NotTheTestBroker, Thing
from support.private_nodes import node_targets as node_targets
from support.private_nodes import node_tmp_path as node_tmp_path
from support.private_nodes import private_broker as private_broker
from support.private_nodes import start_private_broker as start_private_broker
from support.relays import relay_processes as relay_processes

import hopsched
import hopsched.urls

#: What this run leaves on the test broker, checked once the run ends.
LEFTOVERS = LeftoverCheck(rabbitmqctl_command(), RUN_MARKER)
_LEFTOVER_REPORT: list[str] = []


class _NeverRetrieved(logging.Handler):
    """Keeps asyncio's "Task (or Future) exception was never retrieved" reports."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "exception was never retrieved" in record.getMessage():
            self.reports.append(logging.Formatter().format(record))


NEVER_RETRIEVED = _NeverRetrieved()
logging.getLogger("asyncio").addHandler(NEVER_RETRIEVED)


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not _is_xdist_worker(config) and bool(getattr(config.option, "numprocesses", None))


#: Workers for the fast tier (pyproject's ``-n auto``): its tests mostly wait on the
#: broker and on timers (about 90 s of CPU in a 7-minute serial run), so four share two
#: cores well (about 3 minutes).
FAST_TIER_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: ``FAST_TIER_WORKERS``, but one process (no xdist) for the slow tier
    (its tests kill and restart private nodes and time what follows: alone, they time
    hopsched, not each other) and for tests picked by node id. The environment's
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins (xdist's own hook reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    marks = config.getoption("markexpr") or ""
    if ("slow" in marks and "not slow" not in marks) or any("::" in arg for arg in config.args):
        return 0
    return FAST_TIER_WORKERS


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist (``-n N``) the controller takes the leftover check's first
    snapshot before any worker starts, and its last after all have ended: a worker's own
    check would count (and remove) what the others are still using."""
    if _is_xdist_controller(session.config) and _probe(BROKER_URL) is None:
        _start_leftover_check()


def _vhost(url: str) -> str:
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def _start_leftover_check() -> None:
    """The leftover check's first snapshot, once ``rabbitmqctl`` is shown to reach the
    test URL's broker (it lists a queue just declared there); else the run stops (F40:
    with the URL on a private node and no ``HOPSCHED_TEST_RABBITMQCTL``, the check had
    listed, and cleaned, the machine's own broker)."""

    def probe(take: Callable[[], frozenset[Thing]]) -> Thing:
        name = unique("probe")

        async def declared_while_taking() -> None:
            connection = await asyncio.wait_for(aio_pika.connect(BROKER_URL), 10)
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue(name, exclusive=True)
                await asyncio.to_thread(take)

        asyncio.run(declared_while_taking())
        return Thing("queue", name, _vhost(BROKER_URL))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # no event loop is touched
        try:
            pool.submit(LEFTOVERS.start, probe).result()
        except NotTheTestBroker as error:
            pytest.exit(f"refusing to run the tests: {error}", pytest.ExitCode.USAGE_ERROR)


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped by SIGTERM (a CI time-out, a ``kill``) ends as Ctrl-C ends it: the
    current test's fixtures are torn down and the leftover check removes what the run
    made. Found by a new-user trial: a SIGTERM'd run left its prefix on the broker (F38)."""

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupted)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Fail a test at its teardown if a task failed unawaited meanwhile (asyncio says so
    when the task is collected: collect now). The young generations only: what the test
    made is there, and a full collection per test (~90 ms, growing with the heap) had
    doubled the fast tier; the session's end collects everything (below)."""
    if call.when == "teardown":
        gc.collect(1)
    report = yield
    if call.when == "teardown" and NEVER_RETRIEVED.reports:
        reports, NEVER_RETRIEVED.reports = NEVER_RETRIEVED.reports, []
        report.outcome = "failed"
        report.longrepr = "asyncio: a task failed with nobody awaiting it:\n" + "\n".join(reports)
    return report


def _probe(url: str) -> str | None:
    """None if ``url`` accepts a login, else why not (the password masked)."""

    async def attempt() -> None:
        connection = await asyncio.wait_for(aio_pika.connect(url), 10)
        await connection.close()

    try:
        asyncio.run(attempt())
    except BaseException as error:  # report whatever it was
        text = f"{type(error).__name__}: {error}"
        password = urlsplit(url).password
        return text.replace(password, "***") if password else text
    return None


@pytest.fixture(scope="session")
def broker_url(pytestconfig: pytest.Config) -> str:
    """The broker URL, checked once per session (in a thread: no event loop is touched)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        problem = pool.submit(_probe, BROKER_URL).result()
    if problem is not None:
        pytest.fail(
            f"RabbitMQ is not reachable at {hopsched.urls.mask_url(BROKER_URL)} ({problem}). "
            "The integration tests need a running broker: start it "
            "(rabbitmq-server -detached) or point HOPSCHED_TEST_URL at one.",
            pytrace=False,
        )
    if not hasattr(pytestconfig, "workerinput"):  # under xdist, the controller's check
        _start_leftover_check()
    return BROKER_URL


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if it left anything on the test broker (F38), and remove it. An
    xdist worker only hands its never-retrieved reports to the controller (below)."""
    if _is_xdist_worker(session.config):
        gc.collect()
        session.config.workeroutput["never_retrieved"] = NEVER_RETRIEVED.reports  # type: ignore[attr-defined]
        return
    passed, lines = LEFTOVERS.finish()
    if LEFTOVERS.command is None and os.environ.get("CI") == "true":
        passed = False
        lines = [*lines, "FAILED: CI must check what the tests leave on the broker"]
    gc.collect()  # whatever outlived its test's young generations
    if NEVER_RETRIEVED.reports:  # after the last teardown
        passed = False
        lines = [*lines, "FAILED: a task failed with nobody awaiting it", *NEVER_RETRIEVED.reports]
    _LEFTOVER_REPORT[:] = lines
    if not passed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_testnodedown(node: Any, error: object) -> None:
    """An xdist worker ended: keep what it saw of tasks failing unawaited."""
    NEVER_RETRIEVED.reports.extend(getattr(node, "workeroutput", {}).get("never_retrieved", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LEFTOVER_REPORT:
        terminalreporter.section("left on the test broker")
        for line in _LEFTOVER_REPORT:
            terminalreporter.line(line)


@pytest.fixture
async def cleanup(broker_url: str) -> AsyncIterator[Cleanup]:
    registry = Cleanup(broker_url)
    yield registry
    problems = await registry.run()
    assert not problems, f"cleanup failed: {problems}"


@pytest.fixture
def queue_type() -> str:
    """Override with ``@pytest.mark.parametrize("queue_type", ["classic"])``."""
    return "quorum"


@pytest.fixture
def prefix() -> str:
    """A fresh prefix carrying the run's marker."""
    return unique()


@pytest.fixture
def make_settings(
    broker_url: str, prefix: str, queue_type: str, cleanup: Cleanup
) -> Callable[..., hopsched.Settings]:
    """``make_settings(**overrides)``: Settings on this test's prefix, cleaned up after."""

    def make(**overrides: Any) -> hopsched.Settings:
        values: dict[str, Any] = {
            "url": broker_url,
            "prefix": prefix,
            "queue_type": queue_type,
            "log_interval_s": 5.0,
        }
        values.update(overrides)
        settings = hopsched.Settings(**values)
        cleanup.topology(settings)
        return settings

    return make


@pytest.fixture
def settings(make_settings: Callable[..., hopsched.Settings]) -> hopsched.Settings:
    return make_settings()


@pytest.fixture
async def amqp(broker_url: str, cleanup: Cleanup) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    """A plain aio-pika connection for the test's own declares, consumers and probes."""
    connection = await aio_pika.connect(broker_url)
    yield connection
    await connection.close()


@pytest.fixture
async def targets(amqp: aio_pika.abc.AbstractConnection, cleanup: Cleanup) -> Targets:
    return Targets(amqp, cleanup)


@pytest.fixture
async def relays(cleanup: Cleanup) -> AsyncIterator[Relays]:
    runner = Relays()
    yield runner
    await runner.stop_all()


@pytest.fixture
async def relay(relays: Relays, settings: hopsched.Settings) -> hopsched.Relay:
    """A relay consuming ``settings``' prefix for the whole test."""
    return await relays.start(settings)


@pytest.fixture
async def scheduler(
    settings: hopsched.Settings, cleanup: Cleanup
) -> AsyncIterator[hopsched.Scheduler]:
    async with hopsched.Scheduler(settings, declare=True) as entered:
        yield entered
