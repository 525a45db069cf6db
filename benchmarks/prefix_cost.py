"""What a declared hopsched prefix costs the broker, idle: queues, file handles, memory.

    python benchmarks/prefix_cost.py --prefixes 10 --rabbitmq machine,/opt/hopsched-rabbitmq4
    python benchmarks/prefix_cost.py --ladder default --ladder step_ratio=4 \
        --ladder min_step_ms=1024

For each RabbitMQ installation (``machine``: this machine's; a directory: the one in that
chroot, e.g. RabbitMQ 4.0.5 from ``.ci/rabbitmq4``) it starts a private node
(``hopsched.testing.localbroker``), reads what the node reports (``rabbitmqctl status``: the file
handles its file-handle cache counts, RabbitMQ 3.x only, against its limit; its memory
by category) and what the OS sees (open descriptors, resident memory), declares
``--prefixes`` ladders (the default settings, or each ``--ladder``: ``bench_ladder``) with
nothing in them, lets them settle, reads again, tears them down, and prints the cost per
prefix and per quorum queue, a row per installation and ladder. Nothing is left: the
node and its directory are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import aio_pika

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_* helper modules

from bench_ladder import ladder_name, parse_ladder

import hopsched
from hopsched.broker.objects import declare_topology, teardown
from hopsched.testing.localbroker import (
    Installation,
    PrivateBroker,
    installation_in,
    machine_installation,
    private_node,
)

#: Seconds the node is left alone before each reading (quorum queues elect, write).
SETTLE_S = 10.0
_MIB = 2**20


async def reading(node: PrivateBroker) -> dict[str, int]:
    """What the node and the OS report now."""
    status = json.loads(await node.rabbitmqctl("status", "--formatter", "json"))
    memory = status["memory"]
    assert node.pid is not None
    return {
        "handles_counted": int(status["file_descriptors"]["total_used"]),
        "handles_limit": int(status["file_descriptors"]["total_limit"]),
        "os_descriptors": len(os.listdir(f"/proc/{node.pid}/fd")),
        "erlang_bytes": int(memory["total"]["erlang"]),
        "quorum_bytes": int(memory.get("quorum_queue_procs", 0)) + int(memory.get("quorum_ets", 0)),
        "rss_bytes": node.rss_bytes(),
    }


async def measure(
    installation: Installation, prefixes: int, ladder: dict[str, int] | None = None
) -> dict[str, Any]:
    """Declare ``prefixes`` empty ladders (``ladder``: Settings fields) on a private node
    of ``installation``."""
    ladder = ladder or {}
    async with private_node(installation=installation) as node:
        await asyncio.sleep(SETTLE_S)
        before = await reading(node)
        names = [f"cost{uuid.uuid4().hex[:8]}" for _ in range(prefixes)]
        settings = [hopsched.Settings(url=node.url, prefix=name, **ladder) for name in names]
        for one in settings:
            await declare_topology(one)
        await asyncio.sleep(SETTLE_S)
        declared = await reading(node)
        connection = await aio_pika.connect(node.url)
        async with connection:
            for one in settings:
                await teardown(hopsched.Topology.from_settings(one), connection)
        await asyncio.sleep(SETTLE_S)
        after = await reading(node)
    topology = hopsched.Topology.from_settings(settings[0])
    queues = len(topology.queues())
    quorum = len(topology.queues_but_stream())
    per_prefix = {key: (declared[key] - before[key]) / prefixes for key in before}
    return {
        "rabbitmq": installation.version,
        "installation": str(installation),
        "ladder": ladder_name(ladder),
        "ladder_settings": settings[0].ladder.description,
        "prefixes": prefixes,
        "queues_per_prefix": queues,
        "quorum_queues_per_prefix": quorum,
        "before": before,
        "declared": declared,
        "torn_down": after,
        "per_prefix": per_prefix,
        "per_quorum_queue": {key: value / quorum for key, value in per_prefix.items()},
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| RabbitMQ | ladder | per prefix: queues (quorum) | handles counted | OS descriptors "
        "| Erlang memory | quorum memory | RSS | per quorum queue: handles, memory "
        "| handle limit | after teardown: handles, Erlang memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, q = r["per_prefix"], r["per_quorum_queue"]
        lines.append(
            f"| {r['rabbitmq']} | {r['ladder']} "
            f"| {r['queues_per_prefix']} ({r['quorum_queues_per_prefix']}) "
            f"| {p['handles_counted']:.1f} | {p['os_descriptors']:.1f} "
            f"| {p['erlang_bytes'] / _MIB:.2f} MiB | {p['quorum_bytes'] / _MIB:.2f} MiB "
            f"| {p['rss_bytes'] / _MIB:.2f} MiB "
            f"| {q['handles_counted']:.2f}, {q['erlang_bytes'] / 1024:.0f} KiB "
            f"| {r['before']['handles_limit']} "
            f"| {r['torn_down']['handles_counted']}, "
            f"{r['torn_down']['erlang_bytes'] / _MIB:.0f} MiB "
            f"(before: {r['before']['handles_counted']}, "
            f"{r['before']['erlang_bytes'] / _MIB:.0f} MiB) |"
        )
    return "\n".join(lines)


def installations(given: str) -> list[Installation]:
    found = []
    for part in (part.strip() for part in given.split(",") if part.strip()):
        installation = machine_installation() if part == "machine" else installation_in(Path(part))
        if installation is None:
            sys.exit(f"no RabbitMQ installation in {part}")
        found.append(installation)
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=10, help="Ladders declared at once.")
    parser.add_argument(
        "--rabbitmq",
        default="machine",
        help="Comma-separated: 'machine' (this machine's RabbitMQ) or a chroot directory.",
    )
    parser.add_argument(
        "--ladder",
        action="append",
        type=parse_ladder,
        help="A ladder to measure, e.g. step_ratio=4 or min_step_ms=1024 (default: the "
        "default ladder); give it again for each ladder.",
    )
    parser.add_argument("--json", type=Path, help="Write every reading here.")
    options = parser.parse_args()
    ladders = options.ladder or [{}]
    results = [
        await measure(found, options.prefixes, ladder)
        for found in installations(options.rabbitmq)
        for ladder in ladders
    ]
    print(table(results))
    if options.json:
        options.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
