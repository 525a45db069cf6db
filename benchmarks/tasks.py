"""Task frameworks on time (issue 32, item 5): Celery's ETA on a classic queue, Celery
5.5+'s native delayed delivery on quorum queues and Dramatiq's ``delay``, each as it is
and each through hopsched (``hopsched.integrations``), side by side on one private
RabbitMQ node, with real workers (subprocesses) and a real relay.

**Lateness.** Every way gets the same ``--count`` delays (seeded, uniform in
``--min-delay`` .. ``--max-delay`` s, shuffled), all ways at once in one window: one
producer thread per way sends its tasks one after another, each with its due time =
the clock read just before sending + its delay (Celery: ``apply_async(eta=due)``;
Dramatiq: ``send_with_options(delay=ms)``, due = the ``eta`` Dramatiq stamped). The
task body's first act reads the clock (``tasks_apps.py``): lateness = body start - due.
Early (< 0) counts separately; missing = sent, never run by ``max due + --grace``.

**Worker RSS.** Per way, one after another: a fresh worker, its idle RSS after
``--settle`` s, then ``--rss-count`` tasks due ``--rss-ahead`` s ahead (``--producers``
threads), then its RSS once it has taken what it will take (the counts of its queues,
``rabbitmqctl``, and its RSS unchanged over three 2 s samples), and the broker's RSS
beside it; then the worker is stopped and everything pending purged. RSS = VmRSS of
the worker process and every child (Celery's prefork pool, Dramatiq's worker process).

    python benchmarks/tasks.py --json benchmarks/results/tasks/result.json \
        --markdown benchmarks/results/tasks/README.md
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aio_pika
import click
import psutil

from hopsched.core.clock import now_us
from hopsched.settings import Settings
from hopsched.topology import Topology

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from recurring import percentiles  # noqa: E402  (the same nearest-rank percentiles)
from tasks_apps import ENV, WAYS, make_celery, make_dramatiq  # noqa: E402

S = 1_000_000
MB = 1024 * 1024
READY_S = 60.0


def checkout() -> dict[str, Any]:
    """The commit this run measures and whether the checkout has uncommitted changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
    }


def tree_rss(pid: int) -> dict[str, Any]:
    """VmRSS of ``pid`` and of every descendant (``/proc/PID/status``), MB."""
    processes = [psutil.Process(pid)]
    with contextlib.suppress(psutil.Error):
        processes += processes[0].children(recursive=True)
    each: dict[str, float] = {}
    for process in processes:
        try:
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    each[str(process.pid)] = round(int(line.split()[1]) / 1024, 1)
        except OSError:
            continue
    return {"total_mb": round(sum(each.values()), 1), "processes": each}


class Worker:
    """One way's worker, a subprocess as users run it: ``celery -A tasks_apps worker``
    (prefork pool, ``--concurrency``) or ``dramatiq tasks_apps:broker`` (one worker process,
    ``--threads``). Its log goes to a file."""

    def __init__(self, config: dict[str, Any], workdir: Path, options: dict[str, Any]) -> None:
        self.config = config
        self.way = config["way"]
        self.log = workdir / f"{config['queue']}.log"
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def framework(self) -> str:
        return WAYS[self.way][0]

    def start(self) -> None:
        env = dict(os.environ) | {ENV: json.dumps(self.config), "PYTHONPATH": str(HERE)}
        if self.framework == "celery":
            command = [
                *(sys.executable, "-m", "celery", "-A", "tasks_apps", "worker"),
                *("--pool", "prefork", "--concurrency", str(self.options["concurrency"])),
                *("-Q", self.config["queue"], "-n", f"{self.config['queue']}@%h", "-l", "INFO"),
                *("--without-mingle", "--without-gossip", "--without-heartbeat"),
            ]
        else:
            command = [
                *(
                    sys.executable,
                    "-m",
                    "dramatiq",
                    "tasks_apps:broker",
                    "-Q",
                    self.config["queue"],
                ),
                *("--processes", "1", "--threads", str(self.options["threads"])),
            ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def ready(self) -> bool:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"the {self.way} worker exited:\n{text[-3000:]}")
        return (" ready." in text) if self.framework == "celery" else "ready for action" in text

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.way} worker was not ready: see {self.log}")
            await asyncio.sleep(0.2)

    def rss(self) -> dict[str, Any]:
        assert self.process is not None
        return tree_rss(self.process.pid)

    async def stop(self) -> None:
        """Celery: cold shutdown (SIGQUIT); Dramatiq: SIGTERM; SIGKILL (the worker and
        its children, by pid) after 20 s."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            children = psutil.Process(process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        process.send_signal(signal.SIGQUIT if self.framework == "celery" else signal.SIGTERM)
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        if process.poll() is None:
            process.kill()
        await asyncio.to_thread(process.wait)
        for child in children:  # a pool child the cold shutdown left behind
            try:
                if child.is_running():
                    child.kill()
            except psutil.Error:
                pass


class Producer:
    """One way's app (made as the worker makes it) in the benchmark process: sends a
    task due at a given instant and returns (its id, its due time in µs)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.way = config["way"]
        if WAYS[self.way][0] == "celery":
            self.app, self.task = make_celery(config)
        else:
            self.app, self.task = make_dramatiq(config)

    def send(self, delay_us: int) -> tuple[str, int]:
        if WAYS[self.way][0] == "celery":
            due = now_us() + delay_us
            result = self.task.apply_async(eta=datetime.fromtimestamp(due / S, UTC))
            return str(result.id), due
        sent = self.task.send_with_options(delay=-(-delay_us // 1000))
        return str(sent.message_id), int(sent.options["eta"]) * 1000

    def close(self) -> None:
        if WAYS[self.way][0] == "celery":
            scheduler = getattr(self.app.amqp, "hopsched_scheduler", None)
            if scheduler is not None:
                scheduler.close()
            self.app.close()
        else:
            self.app.close()


def send_all(producer: Producer, delays_us: list[int], threads: int) -> dict[str, Any]:
    """Send one task per delay from ``threads`` threads: {id: due} of those sent, how long
    it took, and the errors of those not sent (message: count)."""
    sent: dict[str, int] = {}
    lock = threading.Lock()
    errors: Counter[str] = Counter()
    chunks = [delays_us[n::threads] for n in range(threads)]

    def work(chunk: list[int]) -> None:
        for delay in chunk:
            try:
                task_id, due = producer.send(delay)
            except Exception as error:  # counted in the result, the run goes on
                with lock:
                    errors[f"{type(error).__name__}: {error}"] += 1
                continue
            with lock:
                sent[task_id] = due

    began = time.monotonic()
    workers = [threading.Thread(target=work, args=(chunk,)) for chunk in chunks]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    took = time.monotonic() - began
    return {"sent": sent, "send_s": round(took, 1), "errors": dict(errors)}


def read_runs(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    runs = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            runs.append((parts[0], int(parts[1])))
    return runs


async def start_relay(url: str, prefix: str, log: Path) -> subprocess.Popen[bytes]:
    """``hopsched relay`` on ``prefix``, as users run it; returns once it consumes."""
    env = dict(os.environ) | {"HOPSCHED_URL": url, "HOPSCHED_PREFIX": prefix}
    with log.open("ab") as out:
        relay = subprocess.Popen(  # noqa: ASYNC220  (returns at once)
            [sys.executable, "-P", "-m", "hopsched", "relay"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while "relay consuming" not in log.read_text(errors="replace"):  # noqa: ASYNC240
        if relay.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the relay did not start: see " + str(log))
        await asyncio.sleep(0.2)
    return relay


def config_of(
    way: str, run: str, url: str, prefix: str, workdir: Path, phase: str
) -> dict[str, Any]:
    queue = f"tb-{run}-{phase}-{way.replace('+', '-')}"
    return {
        "way": way,
        "url": url,
        "prefix": prefix,
        "queue": queue,
        "runs": str(workdir / f"{queue}.runs"),
    }


async def lateness_phase(
    url: str, prefix: str, run: str, workdir: Path, options: dict[str, Any]
) -> dict[str, Any]:
    rng = random.Random(options["seed"])
    low, high = options["min_delay"], options["max_delay"]
    delays = [int(rng.uniform(low, high) * S) for _ in range(options["count"])]
    ways = options["ways"]
    configs = {way: config_of(way, run, url, prefix, workdir, "lat") for way in ways}
    workers = {way: Worker(configs[way], workdir, options) for way in ways}
    for worker in workers.values():
        worker.start()
    try:
        for worker in workers.values():
            await worker.wait_ready()
        producers = {way: Producer(configs[way]) for way in ways}
        began = now_us()
        print(f"lateness: sending {len(delays)} tasks per way, {len(ways)} ways", file=sys.stderr)
        sends = await asyncio.gather(
            *(asyncio.to_thread(send_all, producers[way], delays, 1) for way in ways)
        )
        sent = dict(zip(ways, sends, strict=True))
        last_due = max((due for s in sends for due in s["sent"].values()), default=began)
        deadline = last_due + int(options["grace"] * S)
        while now_us() < deadline:
            counts = {way: len(read_runs(Path(configs[way]["runs"]))) for way in ways}
            print(
                f"lateness: {round((now_us() - began) / S)} s, ran "
                + ", ".join(f"{way} {n}/{len(sent[way]['sent'])}" for way, n in counts.items()),
                file=sys.stderr,
            )
            if all(counts[way] >= len(sent[way]["sent"]) for way in ways):
                break
            await asyncio.sleep(10)
        for producer in producers.values():
            producer.close()
    finally:
        for worker in workers.values():
            await worker.stop()
    result: dict[str, Any] = {}
    for way in ways:
        dues: dict[str, int] = sent[way]["sent"]
        runs = read_runs(Path(configs[way]["runs"]))
        times = Counter(task_id for task_id, _ in runs)
        first: dict[str, int] = {}
        for task_id, at in runs:
            first.setdefault(task_id, at)
        lateness = [first[t] - due for t, due in dues.items() if t in first]
        result[way] = {
            "sent": len(dues),
            "send_s": sent[way]["send_s"],
            "send_errors": sent[way]["errors"],
            "ran": sum(1 for t in dues if t in first),
            "missing": sum(1 for t in dues if t not in first),
            "duplicates": sum(n - 1 for t, n in times.items() if n > 1 and t in dues),
            "strays": sum(1 for t in times if t not in dues),
            "early": sum(1 for value in lateness if value < 0),
            "lateness": percentiles(lateness),
        }
    return result


async def queue_counts(node: Any) -> dict[str, tuple[int, int]]:
    """Every queue's (ready, unacknowledged) messages, from ``rabbitmqctl``."""
    text = await node.rabbitmqctl(
        "list_queues", "-q", "--no-table-headers", "name", "messages_ready",
        "messages_unacknowledged",
    )  # fmt: skip
    counts = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            counts[parts[0]] = (int(parts[1]), int(parts[2]))
    return counts


async def purge(url: str, node: Any, names: set[str], prefixes: tuple[str, ...]) -> int:
    """Purge the queues named in ``names`` or starting with one of ``prefixes`` that hold
    messages; the number of messages purged."""
    purged = 0
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for name, (ready, unacked) in (await queue_counts(node)).items():
            if ready + unacked == 0 or not (name in names or name.startswith(prefixes)):
                continue
            queue = await channel.declare_queue(name, passive=True)
            purged += (await queue.purge()).message_count or 0
    return purged


async def rss_phase(
    url: str, prefix: str, run: str, workdir: Path, node: Any, options: dict[str, Any]
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    count, ahead_us = options["rss_count"], int(options["rss_ahead"] * S)
    for way in options["ways"]:
        config = config_of(way, run, url, prefix, workdir, "rss")
        worker = Worker(config, workdir, options)
        worker.start()
        producer: Producer | None = None
        try:
            await worker.wait_ready()
            await asyncio.sleep(options["settle"])
            idle = worker.rss()
            broker_idle_mb = round(node.rss_bytes() / MB, 1)
            producer = Producer(config)
            print(f"rss: {way}: sending {count} tasks {ahead_us // S} s ahead", file=sys.stderr)
            sent = await asyncio.to_thread(
                send_all, producer, [ahead_us] * count, options["producers"]
            )
            samples: list[dict[str, Any]] = []
            began = time.monotonic()
            while time.monotonic() - began < options["rss_wait"]:
                counts = await queue_counts(node)
                mine = {q: c for q, c in counts.items() if q.startswith(config["queue"])}
                sample = {
                    "t_s": round(time.monotonic() - began, 1),
                    "worker_rss_mb": worker.rss()["total_mb"],
                    "queues": mine,
                }
                samples.append(sample)
                print(f"rss: {way}: {sample}", file=sys.stderr)
                last = samples[-3:]
                if len(last) == 3 and all(
                    row["queues"] == last[0]["queues"]
                    and abs(row["worker_rss_mb"] - last[0]["worker_rss_mb"]) < 1.0
                    for row in last
                ):
                    break
                await asyncio.sleep(2)
            loaded = worker.rss()
            counts = await queue_counts(node)
            taken = sum(
                unacked for q, (_, unacked) in counts.items() if q.startswith(config["queue"])
            )
            where = {q: c for q, c in counts.items() if sum(c)}
            result[way] = {
                "tasks": len(sent["sent"]),
                "send_s": sent["send_s"],
                "send_errors": sent["errors"],
                "worker_idle_mb": idle["total_mb"],
                "worker_loaded_mb": loaded["total_mb"],
                "worker_growth_mb": round(loaded["total_mb"] - idle["total_mb"], 1),
                "worker_processes": {"idle": idle["processes"], "loaded": loaded["processes"]},
                "held_by_worker": taken,
                "broker_idle_mb": broker_idle_mb,
                "broker_loaded_mb": round(node.rss_bytes() / MB, 1),
                "queues_holding_them": where,
                "waited_s": round(time.monotonic() - began, 1),
                "samples": samples,
            }
        finally:
            if producer is not None:
                producer.close()
            await worker.stop()
            # the way's queues (Dramatiq's .DQ too), Celery's native delayed-delivery
            # queues, hopsched's step queues: what the tasks sent here wait in
            steps = set(Topology.from_settings(Settings(url=url, prefix=prefix)).step_queues)
            purged = await purge(url, node, steps, (config["queue"], "celery_delayed_"))
            print(f"rss: {way}: purged {purged} messages", file=sys.stderr)
    return result


async def main_async(options: dict[str, Any]) -> dict[str, Any]:
    from hopsched.testing.localbroker import installation_in, machine_installation, private_node

    given = options["rabbitmq"]
    installation = machine_installation() if given == "machine" else installation_in(Path(given))
    if installation is None:
        raise click.BadParameter(f"no RabbitMQ installation in {given}", param_hint="--rabbitmq")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65_536 if hard == resource.RLIM_INFINITY else min(65_536, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))  # the node inherits
    run = uuid.uuid4().hex[:6]
    prefix = f"hopsched-bench-tasks-{run}"
    started = datetime.now(UTC)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tasksbench-") as tmp:
        workdir = Path(tmp)
        async with private_node(installation=installation) as node:
            url = node.url
            relay = await start_relay(url, prefix, workdir / "relay.log")
            try:
                lateness = rss = None
                if "lateness" in options["phases"]:
                    lateness = await lateness_phase(url, prefix, run, workdir, options)
                if "rss" in options["phases"]:
                    rss = await rss_phase(url, prefix, run, workdir, node, options)
            finally:
                relay.terminate()
                await asyncio.to_thread(relay.wait)
            relay_tail = (workdir / "relay.log").read_text(errors="replace").splitlines()[-3:]
    return {
        "setup": {
            "command": " ".join(["python", "benchmarks/tasks.py", *sys.argv[1:]]),
            "started": started.isoformat(timespec="seconds"),
            "ended": datetime.now(UTC).isoformat(timespec="seconds"),
            "broker": f"private node, RabbitMQ {installation.version}",
            "hopsched": version("hopsched"),
            **checkout(),
            "celery": version("celery"),
            "kombu": version("kombu"),
            "dramatiq": version("dramatiq"),
            "pika": version("pika"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m_start": round(load_start, 2),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            **{k: v for k, v in options.items() if k not in ("json_path", "markdown_path")},
        },
        "lateness": lateness,
        "rss": rss,
        "relay_log_tail": relay_tail,
    }


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [
        f"Measured {setup['started']} to {setup['ended']} at commit {setup['commit']}"
        f"{' (uncommitted changes)' if setup['uncommitted_changes'] else ''}, {setup['broker']}, "
        f"hopsched {setup['hopsched']}, Celery {setup['celery']} (kombu {setup['kombu']}), "
        f"Dramatiq {setup['dramatiq']} (pika {setup['pika']}), Python {setup['python']}, "
        f"{setup['cpus']} CPUs, load {setup['load_avg_1m_start']} → {setup['load_avg_1m_end']}.",
        "",
        f"`{setup['command']}`",
        "",
    ]
    if result["lateness"]:
        lines += [
            f"Lateness (task body start - due), {setup['count']:,} tasks per way, delays "
            f"uniform {setup['min_delay']:g} to {setup['max_delay']:g} s, all ways at once, ms:",
            "",
            "| way | sent | ran | missing | dup | early | p50 | p99 | max | min | send s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for way, row in result["lateness"].items():
            late = row["lateness"]
            cells = [
                way, row["sent"], row["ran"], row["missing"], row["duplicates"], row["early"],
                late["p50_ms"], late["p99_ms"], late["max_ms"], late["min_ms"], row["send_s"],
            ]  # fmt: skip
            lines.append("| " + " | ".join(fmt(cell) for cell in cells) + " |")
        lines.append("")
    if result["rss"]:
        lines += [
            f"Worker RSS (the worker process and its children), {setup['rss_count']:,} tasks "
            f"due {setup['rss_ahead']:g} s ahead, MB:",
            "",
            "| way | tasks | held by the worker | worker idle | worker with them pending "
            "| growth | broker idle → with them |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for way, row in result["rss"].items():
            cells = [
                way, row["tasks"], row["held_by_worker"], row["worker_idle_mb"],
                row["worker_loaded_mb"], row["worker_growth_mb"],
                f"{fmt(row['broker_idle_mb'])} → {fmt(row['broker_loaded_mb'])}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(fmt(cell) for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


@click.command()
@click.option(
    "--rabbitmq",
    default="machine",
    show_default=True,
    help="The installation of the private node: machine, or a chroot directory.",
)
@click.option("--ways", default=",".join(WAYS), show_default=True, help="Comma-separated.")
@click.option("--phases", default="lateness,rss", show_default=True)
@click.option("--count", default=1000, show_default=True, help="Lateness: tasks per way.")
@click.option("--min-delay", default=1.0, show_default=True, help="Lateness: shortest, s.")
@click.option("--max-delay", default=600.0, show_default=True, help="Lateness: longest, s.")
@click.option("--grace", default=60.0, show_default=True, help="Lateness: wait past the last due.")
@click.option("--seed", default=1, show_default=True)
@click.option("--rss-count", default=100_000, show_default=True, help="RSS: tasks per way.")
@click.option("--rss-ahead", default=3600.0, show_default=True, help="RSS: due in, s.")
@click.option("--rss-wait", default=600.0, show_default=True, help="RSS: longest wait, s.")
@click.option("--settle", default=5.0, show_default=True, help="RSS: idle before the baseline.")
@click.option("--producers", default=8, show_default=True, help="RSS: sending threads.")
@click.option("--concurrency", default=1, show_default=True, help="Celery's prefork children.")
@click.option("--threads", default=8, show_default=True, help="Dramatiq's worker threads.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path))
def main(**options: Any) -> None:
    """Celery ETA, Celery native delayed delivery and Dramatiq's delay, each with and
    without hopsched: lateness, and worker RSS with many tasks pending."""
    options["ways"] = [way.strip() for way in options["ways"].split(",") if way.strip()]
    unknown = [way for way in options["ways"] if way not in WAYS]
    if unknown:
        raise click.BadParameter(f"unknown ways {unknown}; known: {list(WAYS)}")
    options["phases"] = [phase.strip() for phase in options["phases"].split(",")]

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM too stops the workers, the relay and the node

    signal.signal(signal.SIGTERM, interrupt)
    result = asyncio.run(main_async(options))
    text = json.dumps(result, indent=2)
    table = markdown(result)
    print(table)
    if options["json_path"] is not None:
        options["json_path"].parent.mkdir(parents=True, exist_ok=True)
        options["json_path"].write_text(text + "\n")
    if options["markdown_path"] is not None:
        options["markdown_path"].parent.mkdir(parents=True, exist_ok=True)
        options["markdown_path"].write_text(table + "\n")


if __name__ == "__main__":
    main()
