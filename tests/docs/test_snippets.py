"""Every Python block of README.md and docs/*.md runs as written, or says it is a fragment.

A block whose first line starts with ``# fragment:`` is part of a larger program (it says
which): it must compile (``await`` allowed at its top level). Every other block is a whole
program: each is run here, in a process of its own, against the test broker and a relay
of this test's prefix, and what it did is checked. Only two things of a block change
before it runs: its URL ``amqp://guest:guest@localhost:5672/`` becomes the test broker's,
and its prefix the test's (``Settings(url=`` gains ``prefix=``, ``PREFIX = "hopsched"``
becomes the test's): see ``as_run``.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest
from support import Cleanup, Relays, Targets, unique, until
from support.private_nodes import require_rabbitmq

import hopsched
from hopsched.core.clock import now_us

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment:"
LOCAL_URL = "amqp://guest:guest@localhost:5672/"
_FENCE = re.compile(r"^```python\n(.*?)^```\n", re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Snippet:
    document: str  # e.g. "README.md", "docs/envelope.md"
    line: int  # of its opening fence
    heading: str  # the nearest heading above it
    code: str

    @property
    def fragment(self) -> bool:
        return self.code.startswith(FRAGMENT)

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line} ({self.heading})"


def snippets() -> list[Snippet]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for block in _FENCE.finditer(text):
            headings = _HEADING.findall(text, 0, block.start())
            found.append(
                Snippet(
                    document=str(path.relative_to(ROOT)),
                    line=text.count("\n", 0, block.start()) + 1,
                    heading=headings[-1] if headings else "",
                    code=block[1],
                )
            )
    return found


def snippet(document: str, heading: str) -> Snippet:
    """The one whole program under ``heading`` in ``document``."""
    (found,) = [
        each
        for each in snippets()
        if (each.document, each.heading) == (document, heading) and not each.fragment
    ]
    return found


#: The whole programs, by (document, heading): each has its test below.
PROGRAMS = {
    ("README.md", "hopsched"),
    ("README.md", "Scheduling"),
    ("README.md", "Cancelling and rescheduling"),
    ("docs/envelope.md", "Scheduling without hopsched: a raw AMQP producer"),
    ("docs/private-nodes.md", "Private RabbitMQ nodes for your tests"),
}


#: The targets the programs name. A run gives them its marker (``TARGETS[name]``), as
#: every test object has: two runs on one broker, or a user's own ``orders``, never meet.
TARGETS = {name: unique(name) for name in ("orders", "order.timeout", "orders.timeout")}


def as_run(code: str, url: str, prefix: str) -> str:
    """``code`` pointed at the test broker (``url``), the test's ``prefix`` and the
    run's target names (``TARGETS``)."""
    assert LOCAL_URL in code, "a whole program names its broker"
    for name, marked in TARGETS.items():
        code = code.replace(f'"{name}"', f'"{marked}"')
    code = code.replace(repr(LOCAL_URL).replace("'", '"'), repr(url))
    code = code.replace("Settings(url=", f"Settings(prefix={prefix!r}, url=")
    return code.replace('PREFIX = "hopsched"', f"PREFIX = {prefix!r}")


async def run(code: str, within: float = 60, *, fails: bool = False) -> str:
    """Run ``code`` as ``python -c``; its stdout (the test fails if it exits non-zero),
    or with ``fails`` its stderr (the test fails if it exits 0)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), within)
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"the snippet was still running after {within} s")
    if fails:
        assert process.returncode != 0, out.decode()
        return err.decode()
    assert process.returncode == 0, err.decode()
    return out.decode()


def test_every_python_block_is_a_program_with_its_test_or_a_fragment_that_compiles() -> None:
    found = snippets()
    assert len(found) >= len(PROGRAMS)
    programs = set()
    for each in found:
        compile(each.code, each.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if each.fragment:
            assert len(each.code.splitlines()[0]) > len(FRAGMENT) + 10, (
                f"{each.where}: a fragment says what it is part of"
            )
            continue
        compile(each.code, each.where, "exec")  # no top-level await: runs as it is
        assert LOCAL_URL in each.code or "private_node(" in each.code, (
            f"{each.where}: a program names its broker, or starts its own"
        )
        assert (each.document, each.heading) not in programs, f"{each.where}: two programs"
        programs.add((each.document, each.heading))
    assert programs == PROGRAMS, "every whole program has its test here"


async def _ladder_depth(
    connection: aio_pika.abc.AbstractConnection, settings: hopsched.Settings
) -> int:
    """Messages in the prefix's step queues now."""
    topology = hopsched.Topology.from_settings(settings)
    channel = await connection.channel()
    depth = 0
    for queue in topology.queues():
        if ".step." in queue:
            declared = await channel.declare_queue(queue, passive=True)
            depth += declared.declaration_result.message_count or 0
    await channel.close()
    return depth


@pytest.fixture
async def quorum_relay(
    make_settings: Callable[..., hopsched.Settings], relays: Relays
) -> tuple[hopsched.Settings, hopsched.Relay]:
    """A relay on this test's prefix, with the defaults a snippet's Settings has."""
    settings = make_settings(queue_type="quorum")
    return settings, await relays.start(settings)


async def test_the_readme_first_program_schedules_its_message_into_the_ladder(
    broker_url: str,
    quorum_relay: tuple[hopsched.Settings, hopsched.Relay],
    amqp: aio_pika.abc.AbstractConnection,
) -> None:
    settings, relay = quorum_relay

    await run(as_run(snippet("README.md", "hopsched").code, broker_url, settings.prefix))

    assert await _ladder_depth(amqp, settings) == 1  # due in 30 minutes
    assert relay.stats.parked == 0


async def test_the_readme_scheduling_program_delivers_its_short_delays_on_time(
    broker_url: str,
    quorum_relay: tuple[hopsched.Settings, hopsched.Relay],
    amqp: aio_pika.abc.AbstractConnection,
    targets: Targets,
    cleanup: Cleanup,
) -> None:
    settings, relay = quorum_relay
    cleanup.exchanges.add(TARGETS["orders"])
    target = await targets.queue(TARGETS["order.timeout"])  # the program declares it as well
    started_us = now_us()

    out = await run(as_run(snippet("README.md", "Scheduling").code, broker_url, settings.prefix))

    assert out.startswith("order-42-timeout ")
    received = await target.wait_for(4, within=30)  # 2.5 s, then 1, 2 and 3 s
    await target.settle(1.0)
    assert sorted(r.body for r in received) == [b"retry", b"tick", b"tick", b"tick"]
    target.assert_never_early()
    assert all(r.due_us > started_us for r in received)
    assert await _ladder_depth(amqp, settings) == 1  # order-42-timeout, due in 30 min
    assert relay.stats.parked == 0


async def test_the_readme_cancelling_program_cancels_in_time(
    broker_url: str, quorum_relay: tuple[hopsched.Settings, hopsched.Relay]
) -> None:
    settings, relay = quorum_relay
    code = snippet("README.md", "Cancelling and rescheduling").code

    out = await run(as_run(code, broker_url, settings.prefix))

    assert out.splitlines() == ["True", "None", "cancelled"]  # nothing else pending
    assert relay.stats.parked == 0


async def test_the_raw_amqp_recipe_is_delivered_once_never_early(
    broker_url: str,
    quorum_relay: tuple[hopsched.Settings, hopsched.Relay],
    targets: Targets,
) -> None:
    settings, relay = quorum_relay
    target = await targets.queue(TARGETS["orders.timeout"])  # the recipe declares it as well
    code = snippet("docs/envelope.md", "Scheduling without hopsched: a raw AMQP producer").code
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert imported == {"asyncio", "time", "aio_pika"}, "nothing of hopsched"

    out = await run(as_run(code, broker_url, settings.prefix))

    due_us = int(out.split()[-1])
    (received,) = await target.wait_for(1, within=30)
    await target.settle(1.0)
    assert len(target) == 1
    assert (received.body, received.schedule_id, received.due_us) == (
        b"close order 42",
        "order-42-timeout",
        due_us,
    )
    assert received.received_us >= due_us, "never early"
    await until(lambda: relay.stats.delivered >= 1, within=10)  # counted once confirmed
    assert relay.stats.delivered == 1
    assert relay.stats.parked == 0


async def test_the_raw_amqp_recipe_fails_loudly_on_a_prefix_no_one_declared(
    broker_url: str, prefix: str, cleanup: Cleanup
) -> None:
    cleanup.queues.add(TARGETS["orders.timeout"])  # the recipe declares its target first
    code = snippet("docs/envelope.md", "Scheduling without hopsched: a raw AMQP producer").code

    err = await run(as_run(code, broker_url, prefix), fails=True)

    assert f"NOT_FOUND - no exchange '{prefix}.expired'" in err


@pytest.mark.slow  # starts a private RabbitMQ node
async def test_the_private_nodes_program_runs_and_removes_its_node() -> None:
    require_rabbitmq()
    code = snippet("docs/private-nodes.md", "Private RabbitMQ nodes for your tests").code

    out = await run(code, within=180)

    assert "delivered b'hello' after the crash" in out
