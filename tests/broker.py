"""A private RabbitMQ node per test, to crash and restart without touching the shared one.

The recipe is ``shared/DESIGN.md`` ("Running a broker"): the node runs from
``/usr/lib/rabbitmq/bin`` (the ``/usr/sbin`` wrappers switch to the ``rabbitmq`` user
and drop the variables) with ``HOME``, data, logs, pid file and plugins in a temporary
directory, on free loopback ports. Its config file is its own too: the machine's
``/etc/rabbitmq/rabbitmq.conf`` pins the AMQP listener to 127.0.0.1:5672.

Fixtures (registered by ``conftest.py``):

* ``private_broker``: a node with the default configuration.
* ``start_private_broker``: ``await start_private_broker(config="consumer_timeout = 60000")``
  starts a node with extra ``rabbitmq.conf`` lines; every node started is killed and
  its directory removed when the test ends, passed or failed.

Where RabbitMQ is not installed the tests using them are skipped, with the reason,
except under ``CI=true``, where they fail: CI must not pass without running them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aio_pika
import pytest
from support import rabbitmqctl

__all__ = ["PrivateBroker", "private_broker", "rabbitmq_bin_dir", "start_private_broker"]

START_TIMEOUT_S = 90.0
KILL_TIMEOUT_S = 30.0
#: Where Debian's package keeps the real scripts; ``HOPSCHED_RABBITMQ_BIN`` overrides it.
DEBIAN_BIN_DIR = "/usr/lib/rabbitmq/bin"


def rabbitmq_bin_dir() -> Path | None:
    """The directory holding the real ``rabbitmq-server`` and ``rabbitmqctl`` scripts."""
    candidates = [os.environ.get("HOPSCHED_RABBITMQ_BIN"), DEBIAN_BIN_DIR]
    if found := shutil.which("rabbitmq-server"):
        resolved = Path(found).resolve()
        if resolved.name == "rabbitmq-server":  # not Debian's user-switching wrapper
            candidates.append(str(resolved.parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "rabbitmq-server").is_file():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in {"Z", "X"}


class PrivateBroker:
    """One RabbitMQ node in ``root``: ``start()``, ``kill()`` (a crash), ``start()`` again.

    Args:
        bin_dir: the directory of the real ``rabbitmq-server`` and ``rabbitmqctl``.
        root: an empty directory the node owns (data, logs, config, ``HOME``).
        config: extra ``rabbitmq.conf`` lines, e.g. ``consumer_timeout = 60000``.
    """

    def __init__(self, bin_dir: Path, root: Path, config: str = "") -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.node = f"hopsched-{uuid.uuid4().hex[:8]}@localhost"
        self.port = _free_port()
        self.dist_port = _free_port()
        self.pid: int | None = None
        self.starts = 0
        self.kills = 0
        self._pid_file = root / "pid"
        home, data, logs = root / "home", root / "data", root / "log"
        for directory in (home, data, logs):
            directory.mkdir()
        (root / "enabled_plugins").write_text("[].\n")
        (root / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's NODENAME
        (root / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n{config.strip()}\n"
        )
        self.log_file = logs / f"{self.node}.log"
        self.env = {
            **os.environ,
            "HOME": str(home),  # the Erlang cookie, shared by the node and rabbitmqctl
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(data),
            "RABBITMQ_LOG_BASE": str(logs),
            "RABBITMQ_PID_FILE": str(self._pid_file),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(root / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",  # should this node have to start epmd
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def log(self) -> str:
        """The node's log so far (all starts)."""
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    async def start(self, within: float = START_TIMEOUT_S) -> None:
        """Start the node (again, on the same data) and return once it accepts AMQP logins."""
        assert self.pid is None or not _alive(self.pid), "the node is already running"
        self._pid_file.unlink(missing_ok=True)  # else `wait` reads the killed node's pid
        started = time.monotonic()
        server = await asyncio.create_subprocess_exec(
            str(self.bin_dir / "rabbitmq-server"), "-detached", env=self.env
        )
        await server.wait()
        try:
            await self.rabbitmqctl("wait", str(self._pid_file), "--timeout", str(int(within)))
        except pytest.fail.Exception as failure:
            tail = "\n".join(self.log().splitlines()[-15:])
            pytest.fail(f"node {self.node} did not start: {failure}\nits log ends:\n{tail}")
        finally:
            self.pid = self._read_pid()
        self.starts += 1
        remaining = within - (time.monotonic() - started)
        await self._wait_accepting(max(remaining, 5.0))

    async def _wait_accepting(self, within: float) -> None:
        problem: BaseException | None = None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                connection = await asyncio.wait_for(aio_pika.connect(self.url), 5)
            except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as error:
                problem = error
                await asyncio.sleep(0.2)
                continue
            await connection.close()
            return
        pytest.fail(f"node {self.node}: no AMQP login within {within:.0f} s ({problem!r})")

    async def kill(self) -> None:
        """``kill -9`` the node (a crash) and return once the process is gone."""
        assert self.pid is not None, "the node was never started"
        assert _alive(self.pid), "the node is not running"
        os.kill(self.pid, signal.SIGKILL)
        self.kills += 1
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while _alive(self.pid):
            if time.monotonic() > deadline:
                pytest.fail(f"node {self.node} (pid {self.pid}) outlived kill -9")
            await asyncio.sleep(0.05)

    async def rabbitmqctl(self, *args: str, within: float = 60) -> str:
        """``rabbitmqctl -n NODE args…`` against this node; its stdout."""
        return await rabbitmqctl(
            "-n",
            self.node,
            *args,
            within=within,
            executable=str(self.bin_dir / "rabbitmqctl"),
            env=self.env,
        )

    def _read_pid(self) -> int | None:
        try:
            return int(self._pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def close(self) -> None:
        """Kill the node if it runs (synchronously: this runs however the test ended)."""
        self.pid = self.pid or self._read_pid()
        if self.pid is not None and _alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_TIMEOUT_S
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def _require_bin_dir() -> Path:
    bin_dir = rabbitmq_bin_dir()
    if bin_dir is not None:
        return bin_dir
    reason = (
        f"RabbitMQ is not installed (no rabbitmq-server in {DEBIAN_BIN_DIR}, "
        "HOPSCHED_RABBITMQ_BIN or PATH): the private-node fault tests need it"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run them", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
async def start_private_broker() -> AsyncIterator[Callable[..., Awaitable[PrivateBroker]]]:
    """``await start_private_broker(config="")``: a started private node (see module doc)."""
    bin_dir = _require_bin_dir()
    nodes: list[PrivateBroker] = []
    roots: list[str] = []

    async def start(config: str = "") -> PrivateBroker:
        roots.append(tempfile.mkdtemp(prefix="hopsched-rmq-"))
        node = PrivateBroker(bin_dir, Path(roots[-1]), config)
        nodes.append(node)
        await node.start()
        return node

    try:
        yield start
    finally:
        for node in nodes:
            node.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def private_broker(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
) -> PrivateBroker:
    """A private node with the default configuration, started."""
    return await start_private_broker()
