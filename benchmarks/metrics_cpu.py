"""The relay's CPU per message with its metrics endpoint off and on.

Runs the throughput scenario's relay-hops phase (``bench_scenarios.relay_hops``: a
relay process hops N envelopes waiting in its queue) several times, alternating the
relay without and with ``--metrics-port``, and prints the relay's CPU µs per message
each way. The envelopes carry a relay's hop stamp, so each one is also measured as a
hop's overshoot (a histogram record, like a delivery's lateness). With the endpoint on,
this process scrapes it every ``--scrape-every`` seconds while the relay works (a
Prometheus server scrapes every 15-60 s).

    python benchmarks/metrics_cpu.py --count 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench_run import Progress
from bench_scenarios import relay_hops


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _scrape_every(port: int, every_s: float, scrapes: list[float]) -> None:
    """Scrape ``port`` every ``every_s`` until cancelled; the time each took goes in ``scrapes``."""

    def scrape() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            response.read()

    while True:
        started = time.monotonic()
        try:
            await asyncio.to_thread(scrape)
            scrapes.append(time.monotonic() - started)
        except OSError:
            pass  # the relay is not listening yet
        await asyncio.sleep(every_s)


async def _one(
    url: str, count: int, prefetch: int, metrics: bool, every_s: float
) -> dict[str, Any]:
    prefix = f"hopsched-bench-metrics-{uuid.uuid4().hex[:8]}"
    args: tuple[str, ...] = ()
    scrapes: list[float] = []
    scraper = None
    if metrics:
        port = _free_port()
        args = ("--metrics-port", str(port))
        scraper = asyncio.create_task(_scrape_every(port, every_s, scrapes))
    try:
        result = await relay_hops(
            url, prefix, prefetch, count, Progress(), relay_args=args, stamped=True
        )
    finally:
        if scraper is not None:
            scraper.cancel()
    result["metrics"] = metrics
    result["scrapes"] = len(scrapes)
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default=os.environ.get("HOPSCHED_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--count", type=int, default=20_000, help="Messages per run.")
    parser.add_argument("--rounds", type=int, default=3, help="Runs each way, alternated.")
    parser.add_argument("--prefetch", type=int, default=20_000)
    parser.add_argument("--scrape-every", type=float, default=1.0, help="Seconds between scrapes.")
    parser.add_argument("--json", type=Path, help="Write every run's figures here.")
    options = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for round_ in range(options.rounds):
        for metrics in (False, True):
            run = await _one(
                options.url, options.count, options.prefetch, metrics, options.scrape_every
            )
            runs.append(run)
            print(
                f"round {round_ + 1} metrics {'on ' if metrics else 'off'}: "
                f"{run['relay_cpu_us_per_hop']} µs/msg, {run['hops_per_s']} msgs/s, "
                f"{run['scrapes']} scrapes",
                file=sys.stderr,
            )
    for metrics in (False, True):
        figures = [run["relay_cpu_us_per_hop"] for run in runs if run["metrics"] is metrics]
        print(
            f"metrics {'on ' if metrics else 'off'}: relay CPU per message median "
            f"{statistics.median(figures):.1f} µs (runs: {', '.join(map(str, figures))})"
        )
    if options.json:
        options.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
