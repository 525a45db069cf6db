"""Fixtures for private RabbitMQ nodes, to crash and restart without touching the shared one.

The nodes are ``hopsched.testing.localbroker.PrivateBroker`` (see that module for the recipe).
Which RabbitMQ runs them is chosen by the environment, as for every user of
``hopsched.testing.localbroker``: the machine's own installation, or with
``HOPSCHED_RABBITMQ_ROOT=/opt/hopsched-rabbitmq4`` the one in that chroot (RabbitMQ 4.0.5
from ``.ci/rabbitmq4``). With ``HOPSCHED_TEST_KHEPRI=1`` every private node and cluster
keeps its metadata in Khepri (the ``khepri_db`` feature flag, RabbitMQ >= 4.0).

Fixtures (registered by ``conftest.py``):

* ``private_broker``: a node with the default configuration.
* ``node_tmp_path``: a temporary directory the nodes can read too (in the chroot, when
  the installation has one); ``seen_by_nodes(path)`` is its files' path as they see it.
* ``start_private_broker``: ``await start_private_broker(config="consumer_timeout = 60000")``
  starts a node with extra ``rabbitmq.conf`` lines (and ``plugins=[...]`` enabled); every
  node started is killed and its directory removed when the test ends, passed or failed.

``write_probe_plugin(directory)`` writes a small plugin there, for the nodes'
``plugins_dirs``.

Where RabbitMQ is not installed the tests using them are skipped, with the reason,
except under ``CI=true``, where they fail: CI must not pass without running them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import aio_pika
import pytest

import hopsched
from hopsched.testing.localbroker import (
    Installation,
    PrivateBroker,
    not_installed,
    private_node,
    rabbitmq_installation,
)
from support import Cleanup, Collector, Targets, missing

__all__ = [
    "PROBE_PLUGIN",
    "PROBE_PLUGIN_VERSION",
    "PrivateBroker",
    "freeze",
    "khepri",
    "node_tmp_path",
    "private_broker",
    "require_rabbitmq",
    "seen_by_nodes",
    "start_private_broker",
    "write_probe_plugin",
]

#: ``1``: private nodes keep their metadata in Khepri (RabbitMQ >= 4.0).
KHEPRI_VARIABLE = "HOPSCHED_TEST_KHEPRI"


def _thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (``T``: stopped), from /proc (Linux)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
    return states


async def freeze(pid: int, within: float = 5.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it has stopped: ``kill``
    returns before a thread running on another CPU stops, and in that moment a node
    acked a publish sent after the kill (seen in CI)."""
    os.kill(pid, signal.SIGSTOP)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    # The kernel signals no event for a stopped thread: polling /proc is the only way.
    while loop.time() < deadline:
        states = _thread_states(pid)  # reads of /proc do not block
        if states and all(state in ("T", "t") for state in states):
            return
        await asyncio.sleep(0.005)
    pytest.fail(f"process {pid} did not stop within {within} s of SIGSTOP")


#: A plugin ``write_probe_plugin`` writes: an Erlang application with no code (only its
#: ``.app`` file) that depends on a plugin shipped with RabbitMQ, so enabling it enables
#: that one too (its ``x-random`` exchange type).
PROBE_PLUGIN = "hopsched_probe_plugin"
PROBE_PLUGIN_VERSION = "1.0.0"
_PROBE_APP = f"""{{application, {PROBE_PLUGIN}, [
    {{description, "hopsched test: a plugin found in an extra plugins directory"}},
    {{vsn, "{PROBE_PLUGIN_VERSION}"}}, {{modules, []}}, {{registered, []}},
    {{applications, [kernel, stdlib, rabbit_common, rabbit, rabbitmq_random_exchange]}},
    {{env, []}}, {{broker_version_requirements, []}}
]}}.
"""


def write_probe_plugin(plugins_dir: Path) -> None:
    """Write ``PROBE_PLUGIN`` (``NAME-VERSION/ebin/NAME.app``) into ``plugins_dir``, a
    directory for ``private_node(plugins_dirs=...)``."""
    ebin = plugins_dir / f"{PROBE_PLUGIN}-{PROBE_PLUGIN_VERSION}" / "ebin"
    ebin.mkdir(parents=True)
    (ebin / f"{PROBE_PLUGIN}.app").write_text(_PROBE_APP)


def khepri() -> bool:
    """Whether the private nodes of this run keep their metadata in Khepri."""
    return os.environ.get(KHEPRI_VARIABLE, "") not in ("", "0")


def require_rabbitmq() -> Installation:
    """The installation private nodes run from; ``missing()`` if there is none."""
    installation = rabbitmq_installation()
    if installation is not None:
        return installation
    missing(f"{not_installed()}: the private-node fault tests need it")


@pytest.fixture
async def start_private_broker() -> AsyncIterator[Callable[..., Awaitable[PrivateBroker]]]:
    """``await start_private_broker(config="", plugins=(), management=False)``: a started
    private node (see module doc)."""
    installation = require_rabbitmq()
    async with contextlib.AsyncExitStack() as nodes:

        async def start(
            config: str = "", plugins: Sequence[str] = (), *, management: bool = False
        ) -> PrivateBroker:
            return await nodes.enter_async_context(
                private_node(
                    config,
                    plugins=plugins,
                    management=management,
                    khepri=khepri(),
                    installation=installation,
                )
            )

        yield start


@pytest.fixture
async def private_broker(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
) -> PrivateBroker:
    """A private node with the default configuration, started."""
    return await start_private_broker()


@pytest.fixture
def node_tmp_path() -> Iterator[Path]:
    """A new directory (this process's path) whose files private nodes can read: for
    their configuration's files (certificates, say); removed after the test."""
    path = require_rabbitmq().make_directory()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def seen_by_nodes(path: str | Path) -> str:
    """``path`` (in ``node_tmp_path``) as the private nodes see it."""
    return str(require_rabbitmq().inside(Path(path)))


# Targets and settings on a private node ----------------------------------------------


@pytest.fixture
async def node_targets(private_broker: PrivateBroker) -> AsyncIterator[Targets]:
    """Target queues on the private node (cleaned up with it)."""
    connection = await aio_pika.connect(private_broker.url)
    yield Targets(connection, Cleanup(private_broker.url))
    await connection.close()


#: ``dead_letter_worker_publisher_confirm_timeout`` for nodes a test restarts, ms (180 s by
#: default). A quorum step queue that restarts before its node has the dead-letter
#: exchange back logs "Cannot forward any dead-letter messages ... exchange ... does not
#: exist" and forwards its expired messages only after this timeout (RabbitMQ 4.0.5: 227
#: messages 180.6 s late in F09; a reschedule's one message in test_journal): late, not
#: lost. docs/cluster.md advises lowering it where lateness matters.
DEAD_LETTER_RESEND_MS = 5000


def resend_dead_letters_soon(node: PrivateBroker) -> None:
    """Give ``node`` an ``advanced.config`` with ``DEAD_LETTER_RESEND_MS``: read at each
    (re)start, so a test that restarts it waits seconds, not 3 minutes, for dead-letters
    stuck by that race."""
    (node.root / "advanced.config").write_text(
        "[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, "
        f"{DEAD_LETTER_RESEND_MS}}}]}}].\n"
    )


def node_settings(node: PrivateBroker, prefix: str, **overrides: object) -> hopsched.Settings:
    return hopsched.Settings(url=node.url, prefix=prefix, log_interval_s=5.0, **overrides)  # type: ignore[arg-type]


async def consume_after_restart(node: PrivateBroker, queue: str) -> Collector:
    """A collector on the test's durable target ``queue`` over a new connection (the
    test's first died with the node); the node's end closes it. The queue is declared
    again, as its owner would: once in CI a RabbitMQ 4.0.5 node (Mnesia) killed about a
    second after the declare came back without it, which is the broker's metadata store,
    not what these tests are about (hopsched's own queues are declared again by the
    relay, F27)."""
    connection = await aio_pika.connect(node.url)
    channel = await connection.channel()
    await channel.declare_queue(queue, durable=True)
    await channel.close()
    return await Targets(connection, Cleanup(node.url)).consume(queue)
