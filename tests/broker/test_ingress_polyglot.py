"""The x-delay ingress with real producers in other languages, written exactly as a user of
the delayed-message plugin writes them today (tests/polyglot/): Node.js with amqplib, Go
with amqp091-go, Java with the RabbitMQ Java client. Each publishes with publisher
confirms, persistent, an ``x-delay`` header (the integer and the string form by turns),
to an exchange hopsched declared (the one change from the plugin: no declare of type
``x-delayed-message``). Each message must come out of the due exchange once, never before
its producer's publish instant + ``x-delay``, with the properties and headers the producer
set (``x-delay`` reading ``-delay``, as the plugin delivers it).

Builds (``npm ci``, ``go build``, ``javac``) happen once per source change, under a file
lock (xdist workers share them): node_modules in tests/polyglot/node, the rest in
tests/polyglot/build (both gitignored). A missing toolchain is ``support.missing()``: a
skip locally, a failure under CI=true (``.ci/run`` installs them).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest
from support import ADDED_ON_DELIVERY, Cleanup, Received, Targets, missing, unique

import hopsched
from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress
from hopsched.core.ingress import Ingress

POLYGLOT = Path(__file__).parents[1] / "polyglot"
BUILD = POLYGLOT / "build"
#: Debian's amqp091-go source (golang-github-rabbitmq-amqp091-go-dev): built offline in
#: GOPATH mode, no module proxy.
GOPATH = Path("/usr/share/gocode")
AMQP091 = GOPATH / "src/github.com/rabbitmq/amqp091-go"
#: Debian's RabbitMQ Java client (librabbitmq-client-java) and an SLF4J binding that
#: keeps the client's logging quiet.
JAVA_CLASSPATH = (Path("/usr/share/java/amqp-client.jar"), Path("/usr/share/java/slf4j-api.jar"))
SLF4J_NOP = Path("/usr/share/java/slf4j-nop.jar")
LANGUAGES = ("node", "go", "java")
#: One message per delay, ms: now, soon, and long enough to pass a few ladder steps.
DELAYS_MS = (0, 300, 1000, 1700, 2500)
ROUTING_KEY = "order.created"
BUILD_TIMEOUT_S = 180
PRODUCE_TIMEOUT_S = 30
#: The producer's clock has ms resolution: its publish instant may be up to 1 ms late.
CLOCK_ROUNDING_US = 1000


def _stale(output: Path, *sources: Path) -> bool:
    """Whether ``output`` is missing or older than any of ``sources``."""
    if not output.exists():
        return True
    built = output.stat().st_mtime
    return any(source.stat().st_mtime > built for source in sources)


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run a build step; fail the test with its output if it fails."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(command[:2])} failed (exit {result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}",
            pytrace=False,
        )


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"no {name} (Debian package {package})")
    return path


def _node() -> list[str]:
    node = _tool("node", "nodejs")
    npm = _tool("npm", "npm")
    source = POLYGLOT / "node"
    installed = source / "node_modules" / ".package-lock.json"
    if _stale(installed, source / "package.json", source / "package-lock.json"):
        _run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], source)
    return [node, str(source / "producer.js")]


def _go() -> list[str]:
    go = _tool("go", "golang-go")
    if not AMQP091.is_dir():
        missing(f"no {AMQP091} (Debian package golang-github-rabbitmq-amqp091-go-dev)")
    source = POLYGLOT / "go" / "producer.go"
    binary = BUILD / "go" / "producer"
    if _stale(binary, source):
        binary.parent.mkdir(parents=True, exist_ok=True)
        env = {
            "GO111MODULE": "off",
            "GOPATH": str(GOPATH),
            "GOCACHE": str(BUILD / "go" / "cache"),
            "GOFLAGS": "",
        }
        _run([go, "build", "-o", str(binary), str(source)], source.parent, env)
    return [str(binary)]


def _java() -> list[str]:
    javac = _tool("javac", "default-jdk-headless")
    java = _tool("java", "default-jdk-headless")
    for jar in JAVA_CLASSPATH:
        if not jar.exists():
            missing(f"no {jar} (Debian package librabbitmq-client-java)")
    source = POLYGLOT / "java" / "Producer.java"
    classes = BUILD / "java"
    if _stale(classes / "Producer.class", source):
        classes.mkdir(parents=True, exist_ok=True)
        classpath = ":".join(map(str, JAVA_CLASSPATH))
        _run([javac, "-d", str(classes), "-cp", classpath, str(source)], source.parent)
    jars = [*JAVA_CLASSPATH, *([SLF4J_NOP] if SLF4J_NOP.exists() else [])]
    return [java, "-cp", ":".join(map(str, [classes, *jars])), "Producer"]


BUILDERS: dict[str, Callable[[], list[str]]] = {"node": _node, "go": _go, "java": _java}


@pytest.fixture(scope="session")
def producer_command() -> Callable[[str], list[str]]:
    """``producer_command(language)``: the producer's command line (before its
    arguments), built first if its sources changed; ``missing()`` without the toolchain."""
    commands: dict[str, list[str]] = {}

    def command(language: str) -> list[str]:
        if language not in commands:
            BUILD.mkdir(parents=True, exist_ok=True)
            with (BUILD / f".{language}.lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # other xdist workers build the same
                commands[language] = BUILDERS[language]()
        return commands[language]

    return command


@pytest.fixture(params=LANGUAGES)
def producer(
    request: pytest.FixtureRequest, producer_command: Callable[[str], list[str]]
) -> tuple[str, list[str]]:
    """(language, command line) of each producer: built in set-up, not in the test."""
    language: str = request.param
    return language, producer_command(language)


async def _produce(command: list[str], url: str, exchange: str, delays: tuple[int, ...]) -> None:
    """Run a producer to its end; fail the test if it fails (its stderr, never the URL)."""
    process = await asyncio.create_subprocess_exec(
        *command,
        url,
        exchange,
        ROUTING_KEY,
        *map(str, delays),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(PRODUCE_TIMEOUT_S):
            stdout, stderr = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"{command[-1]}: still running after {PRODUCE_TIMEOUT_S} s", pytrace=False)
    assert process.returncode == 0, (
        f"{command[-1]} exited {process.returncode}:\n{stdout.decode()}\n{stderr.decode()}"
    )


def _spec_url(url: str) -> str:
    """``url`` with its vhost explicit and %-encoded, as the AMQP URI spec reads it: every
    client then takes the same vhost (the Java client reads ``amqp://host/`` as vhost
    ``""``, amqplib and amqp091-go as ``"/"``; a user's URL names their vhost)."""
    parts = urlsplit(url)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


def _body(received: Received) -> dict[str, object]:
    value = json.loads(received.body)
    assert isinstance(value, dict), value
    return value


async def test_plugin_producer(
    producer: tuple[str, list[str]],
    settings: hopsched.Settings,
    relay: hopsched.Relay,
    targets: Targets,
    cleanup: Cleanup,
) -> None:
    language, command = producer
    exchange = unique("orders")
    cleanup.exchanges.update({exchange, f"{settings.prefix}.due.{exchange}"})
    await declare_ingress(settings, Ingress(exchange, "direct"))
    orders = await targets.queue()
    other = await targets.queue()  # bound by another key: the due exchange routes by key
    await bind_to_due_exchange(settings, exchange, orders.name, ROUTING_KEY)
    await bind_to_due_exchange(settings, exchange, other.name, "order.cancelled")

    await _produce(command, _spec_url(settings.url), exchange, DELAYS_MS)
    await orders.wait_for(len(DELAYS_MS), within=max(DELAYS_MS) / 1000 + 10)
    received = await orders.settle(quiet_s=0.5)

    assert not other.received
    by_index = {_body(message)["index"]: message for message in received}
    assert sorted(by_index) == list(range(len(DELAYS_MS))), "each message once"
    assert len(received) == len(DELAYS_MS), "no duplicates"
    for index, delay in enumerate(DELAYS_MS):
        message = by_index[index]
        body = _body(message)
        assert body["producer"] == language
        assert body["delay"] == delay
        published_ms = body["published_ms"]
        assert isinstance(published_ms, int)
        earliest_us = (published_ms + delay) * 1000 - CLOCK_ROUNDING_US
        assert message.received_us >= earliest_us, (
            f"message {index} (x-delay {delay} ms) arrived "
            f"{(earliest_us - message.received_us) / 1000:.1f} ms early"
        )
        properties = message.properties
        assert properties.content_type == "application/json"
        assert properties.content_encoding == "utf-8"
        assert properties.delivery_mode == 2
        assert properties.message_id == f"{exchange}-{language}-{index}"
        assert properties.correlation_id == f"{language}-{index}"
        assert properties.app_id == f"polyglot-{language}"
        assert properties.message_type == "order.created"
        headers = message.headers
        assert headers["x-delay"] == -delay, "x-delay reads -delay on delivery"
        assert headers["x-producer"] == language
        assert set(headers) - ADDED_ON_DELIVERY == {"x-delay", "x-producer"}
