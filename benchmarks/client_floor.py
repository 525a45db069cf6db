"""The floor under issue 34's CPU targets: what the bare I/O of a relay and of
``schedule()`` costs a Python process per message, paced, beside hopsched's own, in one run.

Every row is a process of its own on hopsched's lean AMQP client (uvloop when installed,
as the relay runs), its CPU time (user + system) read before and after its work:

* ``publish``: one confirmed publish to a quorum queue at a time, paced (the floor under
  ``schedule()``: it also wakes for its pacing and for the confirm);
* ``publish, then a second on another connection``: ``schedule()``'s I/O (the message,
  then its journal record on the journal's own connection);
* ``schedule()``: hopsched's, one call at a time at the same pace;
* ``consume, ack``: a relay that acks each delivery of ``{prefix}.relay`` (one wake-up a
  message);
* ``consume, publish, ack``: publishes each to the target at once, acks on its confirm;
* ``consume, hold, publish, ack``: holds each until its ``x-hopsched-due`` first
  (``hopsched.relay.holds``, the relay's own timer): the I/O of hopsched's relay, with none
  of its decisions, journal records or statistics;
* ``hopsched relay``: the real one (``python -m hopsched relay``).

The relay rows are fed the same workload by ``schedule()`` (delays log-uniform 10 ms to 2 s:
held by the relay, no hops) and end once the target queue holds every message. Rows are
interleaved round by round; the table gives each row's median and range.

    python -P benchmarks/client_floor.py --url URL [--count 5000] [--rate 500] [--rounds 3] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from pamqp import commands

sys.path.insert(0, str(Path(__file__).parent))
from bench_strategies import relay_command

from hopsched import Scheduler, Settings, amqp
from hopsched.core.clock import now_us
from hopsched.core.envelope import HEADER_DUE
from hopsched.relay.holds import Holds

ROWS = {
    "publish": "publish",
    "publish2": "publish, then a second on another connection",
    "schedule": "schedule()",
    "ack": "consume, ack",
    "publish-ack": "consume, publish, ack",
    "hold": "consume, hold, publish, ack",
    "relay": "hopsched relay",
}
RELAY_ROWS = ("ack", "publish-ack", "hold", "relay")
HOPSCHED = (sys.executable, "-P", "-m", "hopsched")
_UVLOOP: ModuleType | None
try:
    import uvloop as _UVLOOP  # hopsched[fast]
except ImportError:
    _UVLOOP = None


def _cpu_s() -> tuple[float, float]:
    """This process's CPU time so far, s: (user, system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """Process ``pid``'s CPU time so far, s: (user, system) (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _per_message(before: tuple[float, float], after: tuple[float, float], count: int) -> Any:
    """CPU µs per message between two readings, and the system (kernel) share of it."""
    user, system = after[0] - before[0], after[1] - before[1]
    total = user + system
    share = system / total if total else 0.0  # a tiny run may read no tick at all
    return {"cpu_us_per_message": total / count * 1e6, "system_share": share}


def _run_loop(main: Any) -> Any:
    """Run ``main`` on the loop the relay runs on: uvloop where installed."""
    return asyncio.run(main) if _UVLOOP is None else _UVLOOP.run(main)


# --- the measured processes ----------------------------------------------------------------


async def publisher(url: str, queue: str, count: int, rate: float, connections: int) -> None:
    """``count`` confirmed publishes to ``queue``, paced, one at a time; with two
    connections, each followed by a second on the other. Prints its CPU µs per message."""
    channels = []
    for _ in range(connections):
        connection = await amqp.connect(amqp.ConnectionParams.from_url(url))
        channel = await connection.channel()
        await channel.confirm_select()
        channels.append(channel)
    properties = amqp.Properties(delivery_mode=2).encode()
    loop = asyncio.get_running_loop()

    async def publish(channel: amqp.Channel) -> None:
        confirmed = loop.create_future()
        channel.publish(
            "", queue, b"x" * 64, properties, callback=lambda o, d: confirmed.set_result(o)
        )
        if await confirmed is not amqp.Outcome.ACK:
            raise RuntimeError("a publish was not confirmed")

    start, cpu = time.monotonic(), _cpu_s()
    for i in range(count):
        if (wait := start + i / rate - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        for channel in channels:
            await publish(channel)
    print(json.dumps(_per_message(cpu, _cpu_s(), count)))


async def scheduler(url: str, prefix: str, target: str, count: int, rate: float) -> None:
    """``count`` ``schedule()`` calls to ``target``, paced, one at a time, delays
    log-uniform 10 ms to 2 s. Prints its CPU µs per call."""
    draw = random.Random(1)
    async with Scheduler(Settings(url=url, prefix=prefix), declare=True) as scheduling:
        start, cpu = time.monotonic(), _cpu_s()
        for i in range(count):
            if (wait := start + i / rate - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            delay = math.exp(draw.uniform(math.log(0.01), math.log(2.0)))
            await scheduling.schedule(b"x" * 64, delay=delay, routing_key=target)
        print(json.dumps(_per_message(cpu, _cpu_s(), count)))


async def bare_relay(url: str, source: str, target: str, mode: str) -> None:
    """Consume ``source``; ``ack`` each at once, or publish it to ``target`` (at once,
    or held until its due time) and ack it on the confirm. Runs until SIGTERM."""
    connection = await amqp.connect(amqp.ConnectionParams.from_url(url))
    channel = await connection.channel()
    await channel.confirm_select()
    await channel.qos(20_000)
    properties = amqp.Properties(delivery_mode=2).encode()

    def release(delivery: amqp.Delivery) -> None:
        def confirmed(outcome: amqp.Outcome, detail: Any) -> None:
            channel.ack(delivery.delivery_tag, lazy=True)

        channel.publish("", target, delivery.body, properties, callback=confirmed)

    holds = Holds(now_us, release)

    def received(delivery: amqp.Delivery) -> None:
        if mode == "ack":
            channel.ack(delivery.delivery_tag, lazy=True)
        elif mode == "publish-ack":
            release(delivery)
        else:
            assert delivery.properties is not None
            assert delivery.properties.headers is not None
            holds.hold(delivery.properties.headers[HEADER_DUE], delivery)

    await channel.consume(source, received, lambda tag: None)
    stopping = asyncio.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(number, stopping.set)
    await stopping.wait()
    holds.cancel()
    await connection.close()


# --- the run -------------------------------------------------------------------------------


def _child(*args: str) -> list[str]:
    return [sys.executable, "-P", __file__, *args]


def _measured_child(args: list[str]) -> dict[str, float]:
    """Run a measured process; its figures (``_per_message``)."""
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{args[3:]} failed: {done.stderr.strip()[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


async def _queue_state(url: str, queue: str) -> tuple[int, int]:
    """``queue``'s ready messages and consumers (a passive declare)."""
    connection = await amqp.connect(amqp.ConnectionParams.from_url(url))
    try:
        channel = await connection.channel()
        declared = await channel.call(commands.Queue.Declare(queue=queue, passive=True))
        ok = cast(commands.Queue.DeclareOk, declared)
        return ok.message_count or 0, ok.consumer_count or 0
    finally:
        await connection.close()


def _wait_for(what: str, ready: Callable[[], bool], within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {within_s:g} s")
        time.sleep(0.2)


async def _declare(url: str, queue: str, quorum: bool) -> str:
    """Declare ``queue``; the broker's name and version, as it gives them."""
    connection = await amqp.connect(amqp.ConnectionParams.from_url(url))
    try:
        channel = await connection.channel()
        arguments: dict[str, Any] = {}
        if quorum:  # bounded: the publish rows' messages are never consumed
            arguments = {"x-queue-type": "quorum", "x-max-length": 10_000}
        await channel.call(commands.Queue.Declare(queue=queue, durable=True, arguments=arguments))
        said = connection.server_properties
        return f"{said.get('product', '?')} {said.get('version', '?')}"
    finally:
        await connection.close()


async def _delete(url: str, queue: str) -> None:
    connection = await amqp.connect(amqp.ConnectionParams.from_url(url))
    try:
        channel = await connection.channel()
        await channel.call(commands.Queue.Delete(queue=queue))
    finally:
        await connection.close()


def relay_row(
    url: str, row: str, count: int, rate: float, run: str
) -> tuple[Any, dict[str, float]]:
    """One relay row: its figures per delivery, and ``schedule()``'s per call feeding it."""
    prefix, target = f"hopsched-floor-{run}-{row}", f"hopsched-floor-{run}-{row}-target"

    def _state(queue: str) -> tuple[int, int]:
        return asyncio.run(_queue_state(url, queue))

    asyncio.run(_declare(url, target, quorum=False))
    subprocess.run(
        [*HOPSCHED, "declare", "--url", url, "--prefix", prefix],
        capture_output=True,
        check=True,
    )
    if row == "relay":
        command = relay_command(url, prefix, Settings().prefetch)  # as accuracy.py runs it
    else:
        command = _child("--role", "bare-relay", "--mode", row, "--url", url)
        command += ["--source", f"{prefix}.relay", "--target", target]
    relay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        source = f"{prefix}.relay"
        _wait_for(f"{row}: a consumer of {source}", lambda: _state(source)[1] > 0)
        cpu = _proc_cpu_s(relay.pid)
        feeding = _child(
            "--role", "scheduler", "--url", url, "--prefix", prefix, "--rate", str(rate)
        )
        scheduled = _measured_child([*feeding, "--target", target, "--count", str(count)])
        if row == "ack":  # nothing reaches the target: every delivery taken
            _wait_for(f"{row}: {source} taken", lambda: _state(source)[0] == 0)
        else:
            _wait_for(f"{row}: {count} in {target}", lambda: _state(target)[0] >= count)
        relay_figures = _per_message(cpu, _proc_cpu_s(relay.pid), count)
    finally:
        relay.send_signal(signal.SIGTERM)
        try:
            relay.wait(30)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()
        subprocess.run(
            [*HOPSCHED, "teardown", "--url", url, "--prefix", prefix, "--force"],
            capture_output=True,
            check=False,
        )
        asyncio.run(_delete(url, target))
    return relay_figures, scheduled


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text}: must be above 0")
        return value

    parse.__name__ = kind.__name__  # argparse names it: "invalid float value: 'x'"
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("HOPSCHED_URL", Settings().url))
    parser.add_argument("--count", type=_positive(int), default=5000, help="messages per row")
    parser.add_argument("--rate", type=_positive(float), default=500.0, help="messages per s")
    parser.add_argument("--rounds", type=_positive(int), default=3, help="runs of every row")
    parser.add_argument("--json")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    url = str(args.url)
    if args.role == "publisher":
        _run_loop(publisher(url, args.target, args.count, args.rate, args.connections))
        return
    if args.role == "scheduler":
        _run_loop(scheduler(url, args.prefix, args.target, args.count, args.rate))
        return
    if args.role == "bare-relay":
        _run_loop(bare_relay(url, args.source, args.target, args.mode))
        return

    run = uuid.uuid4().hex[:8]
    figures: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    sink = f"hopsched-floor-{run}-sink"
    load_before = os.getloadavg()[0]
    try:
        broker = asyncio.run(_declare(url, sink, quorum=True))
    except OSError as error:  # BrokerUnavailableError, a refused connect
        masked = amqp.ConnectionParams.from_url(url).masked_url
        parser.exit(2, f"client_floor.py: no broker to measure on at {masked}: {error}\n")
    try:
        for round_ in range(args.rounds):
            for connections, row in ((1, "publish"), (2, "publish2")):
                command = _child("--role", "publisher", "--url", url, "--target", sink)
                command += ["--count", str(args.count), "--rate", str(args.rate)]
                figures[row].append(_measured_child([*command, "--connections", str(connections)]))
            for row in RELAY_ROWS:
                relay_figures, scheduled = relay_row(url, row, args.count, args.rate, run)
                figures[row].append(relay_figures)
                figures["schedule"].append(scheduled)
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    finally:
        asyncio.run(_delete(url, sink))

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    machine = {
        "broker": broker,
        "python": platform.python_version(),
        "event_loop": "asyncio" if _UVLOOP is None else "uvloop",
        "cpu_count": os.cpu_count(),
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(
        f"{args.count:,} messages at {args.rate:g}/s, {args.rounds} rounds, hopsched {commit}, "
        f"{broker}, Python {machine['python']} on {machine['event_loop']}, "
        f"{machine['cpu_count']} CPUs, 1-minute load {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print("\n| row | runs | CPU µs per message, median | range | of it in the kernel |")
    print("| --- | --- | --- | --- | --- |")
    for row, label in ROWS.items():
        values = [run["cpu_us_per_message"] for run in figures[row]]
        kernel = statistics.median(run["system_share"] for run in figures[row])
        low, high, median = min(values), max(values), statistics.median(values)
        print(
            f"| {label} | {len(values)} | {median:.0f} | {low:.0f} to {high:.0f} | {kernel:.0%} |"
        )
    if args.json:
        result = {
            "commit": commit,
            "count": args.count,
            "rate": args.rate,
            "rounds": args.rounds,
            "machine": machine,
            "runs": figures,
            "rows": ROWS,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
