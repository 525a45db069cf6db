"""The relay's CPU per message with and without the journal: runs alternate a relay
imported from another checkout (``--base``, e.g. a worktree of main before the journal)
and this one, on the throughput scenario's relay phase (``bench_scenarios.relay_hops``:
one relay process works through N envelopes waiting in its queue, CPU from its first
delivery on); ``--deliver``: the envelopes are due and delivered (one journal record
each), else hopped (no record below a 2^26 ms step).

    git worktree add /tmp/base <commit before the journal>
    python -P benchmarks/journal_cpu.py --base /tmp/base --count 20000 --rounds 3 --deliver
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_run import Progress
from bench_scenarios import relay_hops


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=os.environ.get("HOPSCHED_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--base", type=Path, required=True, help="The other checkout.")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3, help="Runs each way, alternated.")
    parser.add_argument("--deliver", action="store_true")
    args = parser.parse_args()
    trees = {"base": str(args.base), "this": str(Path(__file__).parent.parent)}
    runs: dict[str, list[float]] = {name: [] for name in trees}
    for index in range(args.rounds):
        for name in ("base", "this") if index % 2 == 0 else ("this", "base"):
            os.environ["PYTHONPATH"] = trees[name]  # the relay process imports this one
            result = await relay_hops(
                args.url, f"jcpu-{uuid.uuid4().hex[:6]}", 20_000, args.count, Progress(60.0),
                deliver=args.deliver,
            )  # fmt: skip
            runs[name].append(result["relay_cpu_us_per_hop"])
            print(name, result["relay_cpu_us_per_hop"], result["hops_per_s"], flush=True)
    print(json.dumps({k: {"runs": v, "median": statistics.median(v)} for k, v in runs.items()}))


asyncio.run(main())
