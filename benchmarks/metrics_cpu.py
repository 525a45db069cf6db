"""The relay's CPU per message with its metrics endpoint off and on (or signing).

Runs the throughput scenario's relay-hops phase (``bench_scenarios.relay_hops``: a
relay process hops N envelopes waiting in its queue) several times, alternating the
relay without and with ``--metrics-port`` (off-on, then on-off), and prints the relay's
CPU µs per message each way. The envelopes carry a relay's hop stamp, so each one is
also measured as a hop's overshoot (a histogram record, like a delivery's lateness).
With the endpoint on, this process scrapes it every ``--scrape-every`` seconds while the
relay works (a Prometheus server scrapes every 15-60 s).

``--compare signing`` alternates instead a relay without signing keys (unsigned
envelopes) and one that holds a key and requires signatures (envelopes signed with it):
the cost of signatures (docs/security.md). ``--deliver``: the envelopes are due, and the
relay delivers them to a queue instead of hopping them (a delivery is where it checks a
signature's MAC; at a hop only its key id).

    python benchmarks/metrics_cpu.py --count 20000 --rounds 3
    python benchmarks/metrics_cpu.py --count 20000 --rounds 4 --compare signing [--deliver]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
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
    url: str,
    count: int,
    prefetch: int,
    metrics: bool,
    every_s: float,
    signing: bool = False,
    deliver: bool = False,
) -> dict[str, Any]:
    prefix = f"hopsched-bench-metrics-{uuid.uuid4().hex[:8]}"
    args: tuple[str, ...] = ()
    scrapes: list[float] = []
    scraper = None
    key = None
    if signing:
        key = "bench:" + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    if metrics:
        port = _free_port()
        args = ("--metrics-port", str(port))
        scraper = asyncio.create_task(_scrape_every(port, every_s, scrapes))
    try:
        result = await relay_hops(
            url,
            prefix,
            prefetch,
            count,
            Progress(),
            relay_args=args,
            stamped=True,
            signing_key=key,
            deliver=deliver,
        )
    finally:
        if scraper is not None:
            scraper.cancel()
    result["metrics"] = metrics
    result["signing"] = signing
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
    parser.add_argument(
        "--compare",
        choices=["metrics", "signing"],
        default="metrics",
        help="What alternates: the metrics endpoint, or signed envelopes verified.",
    )
    parser.add_argument(
        "--deliver", action="store_true", help="Deliver due envelopes instead of hopping them."
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=5.0,
        help="Seconds to wait before each run, while the broker deletes the last one's queues.",
    )
    parser.add_argument("--json", type=Path, help="Write every run's figures here.")
    options = parser.parse_args()
    what = options.compare
    runs: list[dict[str, Any]] = []
    for round_ in range(options.rounds):
        # off, on, then on, off: a run pays for the one before it (the broker deleting its
        # queues, beyond --pause), so neither way always runs second
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            await asyncio.sleep(options.pause)
            metrics, signing = (on, False) if what == "metrics" else (False, on)
            run = await _one(
                options.url, options.count, options.prefetch, metrics, options.scrape_every,
                signing, options.deliver,
            )  # fmt: skip
            runs.append(run)
            print(
                f"round {round_ + 1} {what} {'on ' if on else 'off'}: "
                f"{run['relay_cpu_us_per_hop']} µs/msg, {run['hops_per_s']} msgs/s, "
                f"{run['scrapes']} scrapes",
                file=sys.stderr,
            )
    for on in (False, True):
        figures = [run["relay_cpu_us_per_hop"] for run in runs if run[what] is on]
        print(
            f"{what} {'on ' if on else 'off'}: relay CPU per message median "
            f"{statistics.median(figures):.1f} µs (runs: {', '.join(map(str, figures))})"
        )
    if options.json:
        options.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
