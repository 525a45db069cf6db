"""A private, throwaway RabbitMQ node: for tests that crash a broker, and for the demo.

A test helper shipped with the package, so your own tests can use it too::

    async with private_node() as node:  # started, on free loopback ports
        settings = Settings(url=node.url)
        ...
        await node.kill()  # kill -9: a crash
        await node.start()  # the same node again, on the same data

The node runs the real ``rabbitmq-server`` script (not Debian's ``/usr/sbin`` wrapper,
which switches to the ``rabbitmq`` user and drops the variables below) with everything
of its own in one directory: ``HOME`` (the Erlang cookie), ``RABBITMQ_NODENAME``, the
AMQP and distribution ports, ``RABBITMQ_MNESIA_BASE`` (data), ``RABBITMQ_LOG_BASE``,
``RABBITMQ_PID_FILE``, ``RABBITMQ_ENABLED_PLUGINS_FILE`` (none) and its own config file
(a machine's ``/etc/rabbitmq/rabbitmq.conf`` may pin the AMQP listener to port 5672).
It starts with ``rabbitmq-server -detached``, then ``rabbitmqctl wait`` on its pid file.

``private_cluster(3)`` starts several such nodes with one Erlang cookie and joins them
into one cluster (``rabbitmqctl stop_app``, ``join_cluster``, ``start_app``)::

    async with private_cluster(3) as cluster:
        settings = Settings(url=cluster.urls)  # every node's URL
        await cluster.nodes[0].kill()  # the others go on (a quorum of 2 of 3)

``rabbitmq_installation()`` finds the scripts: ``HOPSCHED_RABBITMQ_BIN`` if set, else
``/usr/lib/rabbitmq/bin`` (Debian's package), else ``rabbitmq-server`` on ``PATH``. With
``HOPSCHED_RABBITMQ_ROOT`` set, the nodes run inside that directory with ``chroot`` (as
root): another RabbitMQ beside the machine's own, e.g. RabbitMQ 4.0.5 from Debian 13
installed by debootstrap (the project's ``.ci/rabbitmq4``). A node's directory is then
under the chroot's ``/tmp``, where its processes see it; kills, freezes, restarts and
clusters work as they do outside (same pids, ports and epmd)::

    HOPSCHED_RABBITMQ_ROOT=/opt/hopsched-rabbitmq4 pytest -m slow   # the slow tier on 4.0.5
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aio_pika

from hopsched.errors import HopschedError

__all__ = [
    "DEBIAN_BIN_DIR",
    "Installation",
    "LocalBrokerError",
    "PrivateBroker",
    "PrivateCluster",
    "free_port",
    "installation_in",
    "machine_installation",
    "private_cluster",
    "private_node",
    "rabbitmq_installation",
    "run_bounded",
]

#: RabbitMQ keeps a node's Ra directory (which Ra server has which data directory) in
#: ``names.dets``, saved every 3 minutes on 3.10 (Ra 2.2), within a second on 4.0.5
#: (Ra 2.14). A node killed before the save that follows its first stream restarts
#: without its stream coordinator: every stream stays "down" and can be neither
#: declared nor deleted; a quorum queue declared just before restarts as a new member
#: ("configured member ... was not found on this node ... name_not_registered") that
#: never answers basic.consume (4.0.5). This saves both Ra systems' directories now.
SAVE_RA_DIRECTORY = (
    "[dets:sync(maps:get(directory_rev, maps:get(names, ra_system:fetch(S)))) "
    "|| S <- [coordination, quorum_queues]]."
)
#: ``_watch``'s loop ($1: this process, $2: the node, $3: its directory), run in the
#: background by a shell that exits at once (no child left for this process to reap).
_WATCH = (
    'while kill -0 "$1" && kill -0 "$2"; do sleep 1; done 2>/dev/null; '
    'if ! kill -0 "$1" 2>/dev/null; then kill -9 "$2" 2>/dev/null; rm -rf "$3"; fi'
)
#: Mnesia's transaction log is an Erlang ``disk_log``, which keeps what it is given in
#: the node's memory before writing it: ``mnesia:sync_log()`` writes and fsyncs it. On
#: Khepri (or a node where Mnesia does not run) there is nothing to write: Ra answers a
#: command once its write-ahead log is on disk.
SYNC_METADATA = "case mnesia:system_info(is_running) of yes -> mnesia:sync_log(); _ -> ok end."
#: ... and this registers the coordinator's data directory again and restarts it: the
#: one directory in ``coordination/`` no Ra server of the node claims (on 4.x, Khepri's
#: is there too): the streams come back with their messages.
RESTORE_STREAM_COORDINATOR = (
    "#{data_dir := D, names := #{directory_rev := R}} = ra_system:fetch(coordination), "
    "Known = [K || {_, K} <- dets:match_object(R, '_')], "
    "[U] = [list_to_binary(F) || F <- element(2, file:list_dir(D)), "
    "filelib:is_dir(filename:join(D, F))] -- Known, "
    "ok = dets:insert(R, {rabbit_stream_coordinator, U}), ok = dets:sync(R), "
    "rabbit_stream_coordinator:recover()."
)
#: The running plugins as ``"NAME/VERSION"`` strings.
ACTIVE_PLUGINS = (
    '[atom_to_list(A) ++ "/" ++ V || {A, _, V} <- application:which_applications(), '
    "lists:member(A, rabbit_plugins:active())]."
)
#: Seconds a node may take to start and accept an AMQP login.
START_TIMEOUT_S = 90.0
#: A node's first start, on new ports each time, when its process exits while starting.
FIRST_START_ATTEMPTS = 3
#: Seconds a killed node's process may take to disappear.
KILL_TIMEOUT_S = 30.0
#: Where Debian's ``rabbitmq-server`` package keeps the real scripts.
DEBIAN_BIN_DIR = "/usr/lib/rabbitmq/bin"
#: Overrides the search for the scripts: the directory holding ``rabbitmq-server``.
BIN_DIR_VARIABLE = "HOPSCHED_RABBITMQ_BIN"
#: A directory holding another installation, whose scripts run there with ``chroot``.
ROOT_VARIABLE = "HOPSCHED_RABBITMQ_ROOT"
#: The feature flag that moves a node's metadata from Mnesia to Khepri (RabbitMQ >= 4.0,
#: opt-in there: https://www.rabbitmq.com/docs/metadata-store).
KHEPRI_FLAG = "khepri_db"


class LocalBrokerError(HopschedError):
    """A private node did not start, stop or answer ``rabbitmqctl`` as expected."""


@dataclass(frozen=True)
class Installation:
    """A RabbitMQ installation whose real scripts start private nodes.

    Attributes:
        bin_dir: the directory of ``rabbitmq-server`` and ``rabbitmqctl``, as the
            scripts see it (inside ``chroot`` when there is one).
        chroot: the directory the scripts run in with ``chroot`` (which needs root), or
            None for this machine's own root.
    """

    bin_dir: Path
    chroot: Path | None = None

    def command(self, script: str, *args: str, env: Sequence[str] = ()) -> list[str]:
        """The command line that runs ``script`` (e.g. ``"rabbitmqctl"``) with ``args``,
        and with ``env`` (``NAME=value`` items) set by ``env`` first if given."""
        command = [*(["env", *env] if env else []), str(self.bin_dir / script), *args]
        return command if self.chroot is None else ["chroot", str(self.chroot), *command]

    def host_path(self, path: Path) -> Path:
        """A path as the scripts see it (``path``), as this process sees it."""
        return path if self.chroot is None else self.chroot / path.relative_to("/")

    def inside(self, path: Path) -> Path:
        """``path`` (of this process) as the scripts see it; it must be in the chroot."""
        return path if self.chroot is None else Path("/") / path.relative_to(self.chroot)

    def make_directory(self) -> Path:
        """A new empty directory the scripts can use (under the chroot's ``/tmp``)."""
        parent = None if self.chroot is None else str(self.host_path(Path("/tmp")))
        return Path(tempfile.mkdtemp(prefix="hopsched-rmq-", dir=parent))

    @property
    def lib_dir(self) -> Path:
        """The ``rabbitmq_server-VERSION`` directory (its ``plugins/``), as seen here:
        Debian's ``…/lib/rabbitmq_server-*`` beside ``bin``, or the one holding ``sbin``
        (RabbitMQ's generic Unix archive)."""
        parent = self.host_path(self.bin_dir).resolve().parent
        if parent.name.startswith("rabbitmq_server-"):
            return parent
        found = sorted((parent / "lib").glob("rabbitmq_server-*"))
        if not found:
            raise LocalBrokerError(f"no rabbitmq_server-* directory beside {self}")
        return found[-1]

    @property
    def version(self) -> str:
        """The installed RabbitMQ version, e.g. ``"4.0.5"`` (from ``lib_dir``'s name)."""
        return self.lib_dir.name.removeprefix("rabbitmq_server-")

    def __str__(self) -> str:
        where = str(self.bin_dir / "rabbitmq-server")
        return where if self.chroot is None else f"{where} in the chroot {self.chroot}"


def rabbitmq_installation() -> Installation | None:
    """The RabbitMQ installation private nodes run from, or None if there is none:
    ``installation_in($HOPSCHED_RABBITMQ_ROOT)`` if that is set (and not empty), else
    ``machine_installation()``."""
    if chroot := os.environ.get(ROOT_VARIABLE):
        return installation_in(Path(chroot))
    return machine_installation()


def installation_in(chroot: Path) -> Installation | None:
    """The installation in directory ``chroot`` (run there with ``chroot``), or None:
    its scripts in ``$HOPSCHED_RABBITMQ_BIN`` (as seen inside it) or else
    ``/usr/lib/rabbitmq/bin``."""
    bin_dir = Path(os.environ.get(BIN_DIR_VARIABLE) or DEBIAN_BIN_DIR)
    inside = Installation(bin_dir, chroot.resolve())
    found = inside.host_path(inside.bin_dir) / "rabbitmq-server"
    return inside if found.is_file() else None


def machine_installation() -> Installation | None:
    """This machine's own installation, or None: ``$HOPSCHED_RABBITMQ_BIN`` if set (and
    nothing else), else Debian's ``/usr/lib/rabbitmq/bin``, else the directory of
    ``rabbitmq-server`` on ``PATH``."""
    chosen = os.environ.get(BIN_DIR_VARIABLE)
    if chosen is not None:
        candidates = [chosen]
    else:
        candidates = [DEBIAN_BIN_DIR]
        if found_on_path := shutil.which("rabbitmq-server"):
            resolved = Path(found_on_path).resolve()
            if resolved.name == "rabbitmq-server":  # not Debian's user-switching wrapper
                candidates.append(str(resolved.parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "rabbitmq-server").is_file():
            return Installation(Path(candidate))
    return None


def not_installed() -> str:
    """Why ``rabbitmq_installation()`` found nothing: where it looked."""
    if chroot := os.environ.get(ROOT_VARIABLE):
        inside = os.environ.get(BIN_DIR_VARIABLE) or DEBIAN_BIN_DIR
        return f"RabbitMQ is not installed in ${ROOT_VARIABLE} ({chroot}: no {inside})"
    return (
        f"RabbitMQ is not installed (no rabbitmq-server in ${BIN_DIR_VARIABLE}, "
        f"{DEBIAN_BIN_DIR} or PATH)"
    )


def _ephemeral_ports() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections and ``bind(0)``: 32768-60999 by
    default (https://www.kernel.org/doc/html/latest/networking/ip-sysctl.html)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the kernel's ephemeral
    range: there, any outgoing connection on the machine may take it as its source port
    before the node listens (a CI run's node lost its distribution port so and never
    started). Chosen at random, so that nodes started at once by other processes rarely
    pick the same; a node that loses its ports anyway is started again on new ones
    (``PrivateBroker.start``). Below 32768 too (RabbitMQ's CLI tools take the node's
    distribution port + 10000 and the 10 above it)."""
    low = min(_ephemeral_ports()[0], 32768)
    for _ in range(200):
        port = random.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            found: int = probe.getsockname()[1]
            return found
    raise LocalBrokerError("no free TCP port on 127.0.0.1 in 200 tries")


async def run_bounded(
    command: Sequence[str], *, within: float, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run ``command`` and return its exit status, stdout and stderr (decoded).

    Args:
        command: the program and its arguments.
        within: seconds it may take.
        env: its environment; default: this process's.

    Raises:
        TimeoutError: it took longer. Its whole process group is killed first, as when
            the caller is cancelled (RabbitMQ's
            scripts run ``erl`` as a child, which a kill of the script alone leaves
            running) and its pipes read to their end: a pipe left open is closed by the
            garbage collector at some later moment, with a ResourceWarning that a CI run
            saw fail an unrelated test.
    """
    process = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(within):
            out, err = await process.communicate()
    except BaseException:  # the bound, or the caller cancelled: nothing may outlive it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.communicate()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in {"Z", "X"}


class _ExitedWhileStarting(Exception):
    """The node's process was gone before it started."""


class PrivateBroker:
    """One RabbitMQ node in ``root``: ``start()``, ``kill()`` (a crash), ``start()`` again.

    Args:
        installation: the RabbitMQ whose scripts run the node.
        root: an empty directory the node owns (data, logs, config, ``HOME``), as this
            process sees it (inside the installation's chroot if it has one:
            ``Installation.make_directory()``).
        config: extra ``rabbitmq.conf`` lines, e.g. ``consumer_timeout = 60000``.
        plugins: plugins to enable, e.g. ``["rabbitmq_auth_mechanism_ssl"]``: found in
            the installation's ``plugins/`` directory or in ``plugins_dirs``.
        plugins_dirs: more directories of plugins (each holding ``NAME-VERSION/`` plugin
            directories or ``.ez`` archives), searched after the installation's own:
            ``RABBITMQ_PLUGINS_DIR``, a colon-separated list
            (https://www.rabbitmq.com/docs/relocate). With a chroot, a directory outside
            it is copied into ``root``, where the node sees it.
        cookie: the Erlang cookie (nodes of one cluster share one); default: a random
            one. Always written before the node starts: left to Erlang, the node and a
            ``rabbitmqctl wait`` started beside it each made one, and in a CI run the node
            refused the CLI ("Invalid challenge reply") and never counted as started.
        management: enable the management plugin on a free loopback port
            (``management_url``).
    """

    def __init__(
        self,
        installation: Installation,
        root: Path,
        config: str = "",
        plugins: Sequence[str] = (),
        *,
        plugins_dirs: Sequence[str | os.PathLike[str]] = (),
        cookie: str | None = None,
        management: bool = False,
    ) -> None:
        for name, given in (("plugins", plugins), ("plugins_dirs", plugins_dirs)):
            if isinstance(given, str | os.PathLike):  # would be read letter by letter
                raise LocalBrokerError(
                    f"{name}={given!r}: give a sequence, e.g. {name}=({given!r},)"
                )
        self.installation = installation
        self.root = root
        self.node = f"hopsched-{uuid.uuid4().hex[:8]}@localhost"
        self._config = config.strip()
        self._management = management
        if management:
            plugins = [*plugins, "rabbitmq_management"]
        self.pid: int | None = None
        self.starts = 0
        self.kills = 0
        self._pid_file = root / "pid"
        home, data, logs = root / "home", root / "data", root / "log"
        for directory in (home, data, logs):
            directory.mkdir()
        inside = installation.inside
        cookie_file = home / ".erlang.cookie"  # Erlang refuses one others may read
        cookie_file.write_text(cookie if cookie is not None else uuid.uuid4().hex.upper())
        cookie_file.chmod(0o400)
        (root / "enabled_plugins").write_text(f"[{','.join(plugins)}].\n")
        (root / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's NODENAME
        self.log_file = logs / f"{self.node}.log"
        self.env = {  # the paths as the scripts see them
            **os.environ,
            "HOME": str(inside(home)),  # the Erlang cookie, for the node and rabbitmqctl
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(inside(data)),
            "RABBITMQ_LOG_BASE": str(inside(logs)),
            "RABBITMQ_PID_FILE": str(inside(self._pid_file)),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(inside(root / "enabled_plugins")),
            "RABBITMQ_CONFIG_FILE": str(inside(root / "rabbitmq.conf")),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(inside(root / "advanced.config")),
            "RABBITMQ_CONF_ENV_FILE": str(inside(root / "rabbitmq-env.conf")),
            "ERL_EPMD_ADDRESS": "127.0.0.1",  # should this node have to start epmd
        }
        if plugins_dirs:
            self.env["RABBITMQ_PLUGINS_DIR"] = ":".join(
                str(path) for path in self._plugins_path(plugins_dirs)
            )
        self._take_ports()

    def _take_ports(self) -> None:
        """Choose the node's AMQP, distribution and management ports and write them into
        its configuration and environment (again when it lost one while first starting)."""
        self.port = free_port()
        self.dist_port = free_port()
        self.management_port: int | None = free_port() if self._management else None
        management = (
            f"management.tcp.port = {self.management_port}\nmanagement.tcp.ip = 127.0.0.1\n"
            if self._management
            else ""
        )
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n{management}{self._config}\n"
        )
        self.env["RABBITMQ_NODE_PORT"] = str(self.port)
        self.env["RABBITMQ_DIST_PORT"] = str(self.dist_port)

    def _plugins_path(self, plugins_dirs: Sequence[str | os.PathLike[str]]) -> list[Path]:
        """The installation's ``plugins/`` and then ``plugins_dirs``, as the scripts see
        them: a directory outside the installation's chroot is copied into ``root``."""
        installation = self.installation
        path = [installation.inside(installation.lib_dir / "plugins")]
        for number, given in enumerate(plugins_dirs):
            directory = Path(given).resolve()
            if not directory.is_dir():
                raise LocalBrokerError(f"plugins directory {given} does not exist")
            chroot = installation.chroot
            if chroot is not None and not directory.is_relative_to(chroot):
                copy = self.root / f"plugins-{number}"
                shutil.copytree(directory, copy)
                directory = copy
            path.append(installation.inside(directory))
        return path

    @property
    def url(self) -> str:
        """The node's AMQP URL (user ``guest``, which RabbitMQ allows on loopback)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def management_url(self) -> str | None:
        """The management API's base URL, None without the plugin."""
        if self.management_port is None:
            return None
        return f"http://127.0.0.1:{self.management_port}/"

    @property
    def is_running(self) -> bool:
        """Whether the node's process runs (a killed one not yet reaped does not)."""
        return self.pid is not None and _alive(self.pid)

    def rss_bytes(self) -> int:
        """The node's resident memory (its Erlang VM), bytes; 0 when not running."""
        if self.pid is None or not _alive(self.pid):
            return 0
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            pass
        return 0

    def cpu_seconds(self) -> float:
        """The CPU time the node's Erlang VM has used since it started (user and system,
        from ``/proc/PID/stat``), s; 0.0 when not running. For benchmarks: read it before
        and after a workload for the broker's own cost."""
        if self.pid is None or not _alive(self.pid):
            return 0.0
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        utime, stime = int(fields[11]), int(fields[12])  # stat(5) fields 14 and 15, in ticks
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        """The node's log so far (all starts)."""
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    async def start(self, within: float = START_TIMEOUT_S) -> None:
        """Start the node (again, on the same data) and return once it accepts AMQP logins.

        Args:
            within: seconds the start may take.

        Raises:
            LocalBrokerError: it did not start in time; the message ends with its log's
                last lines.
        """
        if self.pid is not None and _alive(self.pid):
            raise LocalBrokerError(f"node {self.node} is already running")
        if self.installation.chroot is not None and os.geteuid() != 0:
            raise LocalBrokerError(
                f"node {self.node}: {self.installation} runs with chroot, which needs root"
            )
        started = time.monotonic()
        for attempt in range(1, FIRST_START_ATTEMPTS + 1):
            try:
                await self._boot(within - (time.monotonic() - started))
                break
            except _ExitedWhileStarting as exited:
                # Never started before: its ports may be chosen anew (a restart keeps
                # them: its clients know them).
                if self.starts > 0 or attempt == FIRST_START_ATTEMPTS:
                    raise LocalBrokerError(str(exited)) from None
                self._take_ports()
        self.starts += 1
        remaining = within - (time.monotonic() - started)
        await self._wait_accepting(max(remaining, 5.0))

    async def _boot(self, within: float) -> None:
        """``rabbitmq-server -detached``, then ``rabbitmqctl wait`` for its pid file and
        boot; ``_ExitedWhileStarting`` as soon as its process is gone."""
        self._pid_file.unlink(missing_ok=True)  # else `wait` reads the killed node's pid
        logged = len(self.log())
        server = await asyncio.create_subprocess_exec(
            *self.installation.command("rabbitmq-server", "-detached"), env=self.env
        )
        await server.wait()  # the VM runs detached by now, or has failed
        pid_file = str(self.installation.inside(self._pid_file))
        # rabbitmqctl's own bound first (its message says more), then ours
        waiting = asyncio.ensure_future(
            self.rabbitmqctl("wait", pid_file, "--timeout", str(int(within)), within=within + 10)
        )
        try:
            misses = 0
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=1.0)
                gone = self._read_pid() is None and self._find_pid() is None
                misses = misses + 1 if gone and not waiting.done() else 0
                if misses == 2:  # twice, a second apart: not a /proc read's hiccup
                    raise _ExitedWhileStarting(
                        f"node {self.node} exited while starting (AMQP port {self.port}, "
                        f"distribution port {self.dist_port}: one may have been taken)"
                        f"\nits log ends:\n{self._log_tail()}"
                    )
            waiting.result()
        except LocalBrokerError as failure:
            if "eaddrinuse" in self.log()[logged:]:  # its AMQP or management port was taken
                self.close()
                raise _ExitedWhileStarting(
                    f"node {self.node} did not start: a port was taken (AMQP {self.port}, "
                    f"management {self.management_port}): {failure}"
                ) from None
            raise LocalBrokerError(
                f"node {self.node} did not start: {failure}\nits log ends:\n{self._log_tail()}"
            ) from None
        finally:
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError, LocalBrokerError):
                    await waiting
            self.pid = self._read_pid()
            if self.pid is not None:
                self._watch(self.pid)

    def _watch(self, pid: int) -> None:
        """Kill node ``pid`` and remove its directory if this process ends first without
        ``close()`` (killed by SIGTERM or SIGKILL, where no ``finally`` runs: a CI job's
        timeout): a detached shell loop checks both once a second, and ends with the
        node."""
        background = f"({_WATCH}) </dev/null >/dev/null 2>&1 &"
        arguments = [str(os.getpid()), str(pid), str(self.root)]
        subprocess.run(["sh", "-c", background, "hopsched-node-watch", *arguments], check=True)

    def _log_tail(self) -> str:
        return "\n".join(self.log().splitlines()[-15:])

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
        raise LocalBrokerError(
            f"node {self.node}: no AMQP login within {within:.0f} s ({problem!r})"
        )

    async def kill(self) -> None:
        """``kill -9`` the node (a crash) and return once the process is gone.

        Raises:
            LocalBrokerError: it is not running, or outlived the kill by
                ``KILL_TIMEOUT_S`` seconds.
        """
        if self.pid is None or not _alive(self.pid):
            raise LocalBrokerError(f"node {self.node} is not running")
        os.kill(self.pid, signal.SIGKILL)
        self.kills += 1
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while _alive(self.pid):
            if time.monotonic() > deadline:
                raise LocalBrokerError(f"node {self.node} (pid {self.pid}) outlived kill -9")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop the node cleanly (``rabbitmqctl shutdown``: it waits for the process to
        end), as in a rolling restart; ``start()`` starts it again.

        Raises:
            LocalBrokerError: it is not running, or did not stop.
        """
        if self.pid is None or not _alive(self.pid):
            raise LocalBrokerError(f"node {self.node} is not running")
        await self.rabbitmqctl("shutdown", within=KILL_TIMEOUT_S * 4)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while _alive(self.pid):
            if time.monotonic() > deadline:
                raise LocalBrokerError(f"node {self.node} (pid {self.pid}) outlived shutdown")
            await asyncio.sleep(0.05)

    async def save_ra_directory(self) -> None:
        """Save the node's Ra directories now (streams' coordinator and quorum queues), as
        RabbitMQ 3.10 does every 3 minutes: a node killed after that keeps its stream
        coordinator (see ``restore_stream_coordinator``) and its quorum queues."""
        await self.rabbitmqctl("eval", SAVE_RA_DIRECTORY)

    async def sync_metadata(self) -> None:
        """Write the node's metadata store (queues, exchanges, bindings, users) to disk
        now. A node killed moments after a declaration can come back without it though
        the declaration was answered (measured on RabbitMQ 4.0.5 with Mnesia: a durable
        queue declared just before a ``kill -9`` was missing in 1 of 20 tries, 1 of 15
        with a second between them, none of 40 with this call between;
        docs/operations.md, "Declared just before a crash").
        Call it before ``kill()`` when what a test crashes for is not that. On Khepri
        it does nothing: Ra answers once its log is on disk."""
        await self.rabbitmqctl("eval", SYNC_METADATA)

    async def restore_stream_coordinator(self) -> None:
        """Register the node's stream coordinator again, after a ``kill -9`` made the
        node forget it: docs/operations.md, "A stream down after a crash"."""
        await self.rabbitmqctl("eval", RESTORE_STREAM_COORDINATOR)

    async def enable_khepri(self) -> None:
        """Move the node's metadata store from Mnesia to Khepri (RabbitMQ >= 4.0): the
        ``khepri_db`` feature flag, which cannot be disabled again. In a cluster, any
        one node enables it for all."""
        await self.rabbitmqctl("enable_feature_flag", "--opt-in", KHEPRI_FLAG, within=120)

    async def metadata_store(self) -> str:
        """``"khepri"`` or ``"mnesia"``: which store the node keeps its metadata in."""
        flags = await self.rabbitmqctl("list_feature_flags", "-q", "--no-table-headers")
        for line in flags.splitlines():
            fields = line.split()
            if fields[:1] == [KHEPRI_FLAG]:
                return "khepri" if fields[1:2] == ["enabled"] else "mnesia"
        return "mnesia"  # RabbitMQ < 4.0 knows no Khepri

    async def active_plugins(self) -> dict[str, str]:
        """The plugins running on the node (enabled ones and their dependencies), each
        with its version: ``rabbit_plugins:active()`` and the applications' versions."""
        out = await self.rabbitmqctl("eval", ACTIVE_PLUGINS)
        pairs = (name.rpartition("/") for name in re.findall(r'"([^"]+)"', out))
        return {name: version for name, _, version in pairs}

    @property
    def rabbitmqctl_command(self) -> list[str]:
        """A command prefix that runs ``rabbitmqctl`` against this node from anywhere
        (``shlex.join`` it for ``HOPSCHED_TEST_RABBITMQCTL``): with the node's ``HOME``,
        which holds its Erlang cookie, in the chroot if any, and ``-n NODE``."""
        home = f"HOME={self.env['HOME']}"
        return self.installation.command("rabbitmqctl", "-n", self.node, env=[home])

    async def rabbitmqctl(self, *args: str, within: float = 60) -> str:
        """Run ``rabbitmqctl -n NODE args…`` against this node; return its stdout.

        Args:
            args: the command and its arguments, e.g. ``"list_queues", "-q", "name"``.
            within: seconds it may take.

        Raises:
            LocalBrokerError: it exited non-zero (with its stderr) or took too long.
        """
        command = " ".join(args)
        try:
            status, out, err = await run_bounded(
                self.installation.command("rabbitmqctl", "-n", self.node, *args),
                within=within,
                env=self.env,
            )
        except TimeoutError:
            raise LocalBrokerError(f"rabbitmqctl {command} did not finish in {within} s") from None
        if status != 0:
            raise LocalBrokerError(f"rabbitmqctl {command} exited {status}: {err}")
        return out

    def _read_pid(self) -> int | None:
        try:
            return int(self._pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _find_pid(self) -> int | None:
        """The node's process found by its ``-home`` argument, before it wrote its pid
        file; ``-s rabbit`` tells it from a CLI tool's VM run with the same ``HOME``."""
        marker = f"-home\0{self.installation.inside(self.root / 'home')}\0".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    command = (entry / "cmdline").read_bytes()
                    if marker in command and b"\0-s\0rabbit\0" in command:
                        return int(entry.name)
        return None

    def close(self) -> None:
        """Kill the node if it runs (synchronously: this runs however the caller ended)."""
        self.pid = self.pid or self._read_pid() or self._find_pid()
        if self.pid is not None and _alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_TIMEOUT_S
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def _installed(installation: Installation | None) -> Installation:
    installation = installation or rabbitmq_installation()
    if installation is None:
        raise LocalBrokerError(not_installed())
    return installation


@contextlib.asynccontextmanager
async def private_node(
    config: str = "",
    *,
    plugins: Sequence[str] = (),
    plugins_dirs: Sequence[str | os.PathLike[str]] = (),
    management: bool = False,
    khepri: bool = False,
    installation: Installation | None = None,
) -> AsyncIterator[PrivateBroker]:
    """A started node in a new temporary directory; on exit, however it comes (an error,
    a cancellation, Ctrl-C), the node is killed and the directory removed; if this
    process is killed (SIGTERM, SIGKILL), the node's watch does it within seconds.

    Args:
        config: extra ``rabbitmq.conf`` lines.
        plugins: plugins to enable.
        plugins_dirs: more directories of plugins, after the installation's own
            (``PrivateBroker``).
        management: the management plugin (``management_url``).
        khepri: keep the metadata in Khepri (``enable_khepri()``; RabbitMQ >= 4.0).
        installation: the RabbitMQ to run; default ``rabbitmq_installation()``.

    Raises:
        LocalBrokerError: RabbitMQ is not installed, or the node did not start.
    """
    installation = _installed(installation)
    root = installation.make_directory()
    node: PrivateBroker | None = None
    try:
        node = PrivateBroker(
            installation, root, config, plugins, plugins_dirs=plugins_dirs, management=management
        )
        await node.start()
        if khepri:
            await node.enable_khepri()
        yield node
    finally:
        if node is not None:
            node.close()
        shutil.rmtree(root, ignore_errors=True)


class PrivateCluster:
    """Private nodes joined into one RabbitMQ cluster (``private_cluster``).

    Attributes:
        nodes: the nodes, the first being the one the others joined.
    """

    def __init__(self, nodes: Sequence[PrivateBroker]) -> None:
        self.nodes = list(nodes)

    @property
    def urls(self) -> list[str]:
        """Every node's AMQP URL, in the order of ``nodes``."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's AMQP URL, comma-separated (as ``HOPSCHED_URL`` takes them)."""
        return ",".join(self.urls)

    def running(self) -> list[PrivateBroker]:
        """The nodes whose process runs."""
        return [node for node in self.nodes if node.is_running]

    def by_name(self, name: str) -> PrivateBroker:
        """The node named ``name`` (e.g. ``hopsched-1a2b3c4d@localhost``).

        Raises:
            LocalBrokerError: no such node here.
        """
        for node in self.nodes:
            if node.node == name:
                return node
        raise LocalBrokerError(f"no node {name!r} in this cluster")

    async def leader(self, queue: str, vhost: str = "/") -> PrivateBroker:
        """The node that leads quorum queue ``queue`` now (asked of a running node).

        Raises:
            LocalBrokerError: no running node answers, or the queue has no leader.
        """
        problem = "no node runs"
        for node in self.running():
            try:
                out = await node.rabbitmqctl(
                    "list_queues", "-p", vhost, "-q", "--no-table-headers", "name", "leader"
                )
            except LocalBrokerError as error:
                problem = str(error)
                continue
            for line in out.splitlines():
                fields = line.split()
                if len(fields) == 2 and fields[0] == queue:
                    return self.by_name(fields[1])
            problem = f"queue {queue!r} not listed with a leader"
        raise LocalBrokerError(f"leader of {queue!r}: {problem}")

    def rss_bytes(self) -> int:
        """The resident memory of every running node together, bytes."""
        return sum(node.rss_bytes() for node in self.nodes)

    def cpu_seconds(self) -> float:
        """The CPU time of every running node together, s (``PrivateBroker.cpu_seconds``)."""
        return sum(node.cpu_seconds() for node in self.nodes)

    async def save_ra_directories(self) -> None:
        """``save_ra_directory()`` on every running node: call it after creating a
        stream and before a ``kill -9`` (RabbitMQ 3.10's lost stream coordinator)."""
        for node in self.running():
            await node.save_ra_directory()

    def close(self) -> None:
        """Kill every node that runs."""
        for node in self.nodes:
            node.close()


@contextlib.asynccontextmanager
async def private_cluster(
    size: int = 3,
    config: str = "",
    *,
    plugins: Sequence[str] = (),
    plugins_dirs: Sequence[str | os.PathLike[str]] = (),
    management: bool = False,
    khepri: bool = False,
    installation: Installation | None = None,
) -> AsyncIterator[PrivateCluster]:
    """``size`` private nodes (distinct node names, AMQP and distribution ports, one
    Erlang cookie) joined into one cluster; on exit, however it comes, every node is
    killed and its directory removed.

    The nodes start together; then each but the first runs ``rabbitmqctl stop_app``,
    ``join_cluster FIRST`` and ``start_app``. About 40 s for three nodes on two cores.

    Args:
        size: how many nodes (3 lets quorum queues survive one node down).
        config: extra ``rabbitmq.conf`` lines for every node.
        plugins: plugins to enable on every node.
        plugins_dirs: more directories of plugins, after the installation's own
            (``PrivateBroker``).
        management: the management plugin on every node (``management_url``).
        khepri: the cluster keeps its metadata in Khepri (enabled once formed).
        installation: the RabbitMQ to run; default ``rabbitmq_installation()``.

    Raises:
        LocalBrokerError: RabbitMQ is not installed, a node did not start or join.
    """
    installation = _installed(installation)
    cookie = uuid.uuid4().hex.upper()
    roots = [installation.make_directory() for _ in range(size)]
    cluster = PrivateCluster([])
    try:
        for root in roots:
            cluster.nodes.append(
                PrivateBroker(
                    installation,
                    root,
                    config,
                    plugins,
                    plugins_dirs=plugins_dirs,
                    cookie=cookie,
                    management=management,
                )
            )
        await asyncio.gather(*(node.start() for node in cluster.nodes))
        first = cluster.nodes[0]
        for node in cluster.nodes[1:]:
            await node.rabbitmqctl("stop_app")
            await node.rabbitmqctl("join_cluster", first.node)
            await node.rabbitmqctl("start_app")
            await node._wait_accepting(START_TIMEOUT_S)
        if khepri:
            await first.enable_khepri()
        yield cluster
    finally:
        cluster.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
