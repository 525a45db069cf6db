"""Scale-out: deliveries per second with 1, 2 and 4 relay processes on one prefix, on a
private three-node RabbitMQ cluster on this machine.

Each run fills a fresh prefix's ``{prefix}.relay`` with ``--count`` envelopes already due
(``bench_scenarios.relay_hops``, ``deliver``) and starts N relay processes given every
node's URL (each starts at a random node). It times them until the target queue holds
every message: deliveries/s, and the relays' CPU per delivery. All nodes and relays share
this machine's cores, so the figures show the shape (what another relay adds while one
relay queue's leader does the work), not a real cluster's size.

    python -P benchmarks/scale_out.py [--count 20000] [--relays 1,2,4] [--rounds 2]

``HOPSCHED_RABBITMQ_ROOT`` picks the RabbitMQ installation (``hopsched.testing.localbroker``).
Writes ``result.json`` and ``table.md`` to ``benchmarks/results/scale-out/rabbitmq-VERSION/``
(``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_run import Progress
from bench_scenarios import relay_hops

from hopsched.testing.localbroker import PrivateCluster, private_cluster, rabbitmq_installation

PREFETCH = 20_000


def commit() -> str:
    here = Path(__file__).parent
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
    ).stdout.strip()


def table(result: dict[str, Any]) -> str:
    lines = [
        f"Scale-out on a private 3-node RabbitMQ {result['rabbitmq']} cluster, "
        f"{result['cpu_count']} cores shared by the nodes and the relays; "
        f"{result['count']:,} due envelopes per run, median of {result['rounds']} runs "
        "(interleaved, each once the nodes were quiet) "
        f"(commit {result['commit']}).",
        "",
        "| relays | deliveries/s | vs 1 relay | relay CPU µs per delivery "
        "| node CPU s, first / second / third | load before |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    one = result["runs"][0]["deliveries_per_s"]
    for run in result["runs"]:
        lines.append(
            f"| {run['relays']} | {run['deliveries_per_s']:,.0f} | "
            f"{run['deliveries_per_s'] / one:.2f}x | {run['relay_cpu_us_per_delivery']:.0f} | "
            f"{' / '.join(f'{cpu:.1f}' for cpu in run['node_cpu_s'])} | "
            f"{run['load_before']:.2f} |"
        )
    return "\n".join(lines) + "\n"


async def quiet(cluster: PrivateCluster, within_s: float = 60.0) -> float:
    """Wait (up to ``within_s``) until the nodes use under a tenth of a core together
    (the last run's clean-up is over); the 1-minute load average then."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = cluster.cpu_seconds()
        await asyncio.sleep(2.0)
        if cluster.cpu_seconds() - before < 0.2:
            break
    return os.getloadavg()[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000, help="Envelopes per run.")
    parser.add_argument("--relays", default="1,2,4", help="Relay processes per run.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs per relay count.")
    parser.add_argument("--out", type=Path, help="Default: results/scale-out/rabbitmq-VERSION.")
    args = parser.parse_args()
    counts = [int(n) for n in args.relays.split(",")]
    progress = Progress(10.0)
    installation = rabbitmq_installation()
    if installation is None:
        sys.exit("no RabbitMQ installation for private nodes (see HOPSCHED_RABBITMQ_ROOT)")
    started = time.monotonic()
    async with private_cluster(3, installation=installation) as cluster:
        progress.say(f"cluster up in {time.monotonic() - started:.0f} s", force=True)
        rounds: dict[int, list[dict[str, Any]]] = {relays: [] for relays in counts}
        for _ in range(args.rounds):  # interleaved: a drift in load reaches every count
            for relays in counts:
                load = await quiet(cluster)
                node_cpu = [node.cpu_seconds() for node in cluster.nodes]
                one = await relay_hops(
                    cluster.urls[0], f"scale-{uuid.uuid4().hex[:8]}", PREFETCH, args.count,
                    progress, relays, deliver=True, relay_url=cluster.url,
                )  # fmt: skip
                one["load_before"] = load
                one["node_cpu_s"] = [  # the fill, the deliveries and the clean-up
                    round(node.cpu_seconds() - before, 2)
                    for node, before in zip(cluster.nodes, node_cpu, strict=True)
                ]
                rounds[relays].append(one)
                progress.say(f"[{relays} relays] {one['hops_per_s']} deliveries/s", force=True)
        runs = [
            {
                "relays": relays,
                "deliveries_per_s": statistics.median(r["hops_per_s"] for r in each),
                "relay_cpu_us_per_delivery": statistics.median(
                    r["relay_cpu_us_per_hop"] for r in each
                ),
                "load_before": statistics.median(r["load_before"] for r in each),
                "node_cpu_s": [
                    statistics.median(r["node_cpu_s"][i] for r in each) for i in range(3)
                ],
                "rounds": each,
            }
            for relays, each in rounds.items()
        ]
    result = {
        "commit": commit(),
        "rabbitmq": installation.version,
        "cpu_count": os.cpu_count(),
        "count": args.count,
        "rounds": args.rounds,
        "runs": runs,
        "how": "bench_scenarios.relay_hops(deliver=True) per run on a fresh prefix; the "
        "relay queue and target are declared through the first node; each relay is "
        "given every node's URL and starts at a random one; node_cpu_s: each node's "
        "CPU over the run (fill, deliveries, clean-up); the first node is where the "
        "relay queue was declared (its leader: queue_leader_locator client-local)",
    }
    if args.out is None:
        version = f"rabbitmq-{result['rabbitmq']}"
        args.out = Path(__file__).parent / "results" / "scale-out" / version
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "table.md").write_text(table(result))
    print(table(result))


asyncio.run(main())
