"""Delay-accuracy benchmark: hopsched side by side with the alternatives users would pick.

Every strategy runs, one after another, the same generated workload on the same broker;
lateness is measured at a real consumer of the target queue (receive instant - due time).
See benchmarks/README.md for the method, the scenarios and the caveats.

    python benchmarks/accuracy.py --scenario quick --json out.json --plot out/
    python benchmarks/accuracy.py --count 500 --rate 100 --delays loguniform:10ms:5s
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import click

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench_* helper modules

from bench_ladder import ladder_name, parse_ladder
from bench_measure import use_broker_cpu, use_rabbitmqctl
from bench_report import (
    burst_table,
    decade_table,
    ingest_lag_table,
    markdown_table,
    plot,
    publish_throughput_table,
    throughput_summary,
)
from bench_run import (
    Progress,
    Run,
    Session,
    measure_strategy,
    publish_throughput,
    run_workload,
)
from bench_scenarios import (
    BURST_COUNTS,
    BURST_LEAD_S,
    BURST_STRATEGIES,
    run_backlog,
    run_bursts,
    run_throughput,
)
from bench_strategies import STRATEGIES, make_strategy
from bench_workload import Workload, parse_delays

import hopsched
from hopsched.cli.durations import parse_duration
from hopsched.urls import mask_url

#: The scenarios that run a paced workload: ``--rabbitmq`` may name several installations.
PACED = ("quick", "standard", "mixed", "custom")
SCENARIOS: dict[str, dict[str, Any]] = {
    "quick": {"count": 500, "rate": 100.0, "delays": "loguniform:10ms:5s"},
    "standard": {"count": 5000, "rate": 500.0, "delays": "loguniform:10ms:10m"},
    "mixed": {"count": 1000, "rate": 100.0, "delays": "mixed"},
    "backlog": {
        "count": 500,
        "rate": 100.0,
        "delays": "loguniform:10ms:5s",
        "strategies": "hopsched-quorum",
    },
    "throughput": {"count": 0, "rate": 0.0, "delays": "loguniform:10ms:5s"},
    "burst": {
        "count": 0,
        "rate": 0.0,
        "delays": "loguniform:10ms:5s",
        "strategies": ",".join(BURST_STRATEGIES),
    },
}
DEFAULTS: dict[str, Any] = {
    "count": 500,
    "rate": 100.0,
    "delays": "loguniform:10ms:10m",
    "strategies": ",".join(STRATEGIES),
}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


#: The hopsched this process imported: the repository's, or --hopsched-path's checkout.
HOPSCHED_ROOT = Path(hopsched.__file__).resolve().parent.parent
_REEXEC = "HOPSCHED_BENCH_REEXEC"  # set in the process started again by _use_hopsched


def _use_hopsched(path: Path) -> None:
    """Make this run measure the hopsched in checkout ``path``: unless it is the one
    imported already, start this command again with ``path`` first on PYTHONPATH, so
    that this process (the scheduler side) and every process it starts (relays, the
    consumer, the workers) import hopsched from there."""
    path = path.resolve()
    if path == HOPSCHED_ROOT:
        return
    if not (path / "hopsched" / "__init__.py").is_file():
        raise click.BadParameter(f"{path} holds no hopsched/ package", param_hint="--hopsched-path")
    if os.environ.get(_REEXEC):
        raise click.ClickException(f"hopsched was imported from {HOPSCHED_ROOT}, not {path}")
    env = {**os.environ, _REEXEC: "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _hopsched_version() -> dict[str, Any]:
    """Which hopsched this run measures: its checkout, commit and whether it has
    uncommitted changes (None outside git), and the API it offers."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", "-C", str(HOPSCHED_ROOT), *args],
                capture_output=True, text=True, check=True, timeout=10,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "path": str(HOPSCHED_ROOT),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
        "has_schedule_many": hasattr(hopsched.Scheduler, "schedule_many"),
        "default_prefetch": hopsched.Settings().prefetch,
    }


async def _broker(url: str) -> dict[str, Any]:
    connection = await aio_pika.connect(url, name="bench-probe")
    async with connection:
        properties = connection.transport.connection.server_properties  # type: ignore[union-attr]
    return {
        "product": str(properties.get("product", "")),
        "version": str(properties.get("version", "")),
        "platform": str(properties.get("platform", "")),
        "url": mask_url(url),
    }


async def run_strategies(
    url: str,
    names: list[str],
    workload: Workload,
    run_id: str,
    prefetch: int,
    throughput: tuple[int, int, int] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Run]]:
    """Each strategy in turn on ``workload``; rows for the JSON, runs for the plots.
    ``throughput`` (messages, producers, in flight per producer): after its workload, in
    the same session, each strategy that has producers for it is measured in the
    publish-throughput phase (``bench_run.publish_throughput``, the row's
    ``publish_throughput``)."""
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    progress = Progress()
    for name in names:

        async def measure(session: Session, name: str = name) -> Run:
            run = await run_workload(session, workload, tag=name, progress=progress)
            if throughput is not None:
                count, producers, in_flight = throughput
                run.summary["publish_throughput"] = await publish_throughput(
                    session, count, producers, in_flight, tag=name, progress=progress
                )
            return run

        strategy = make_strategy(name, url, run_id, prefetch)
        rows[name], run = await measure_strategy(strategy, name, measure, progress)
        if run is not None:
            runs[name] = run
    return rows, runs


def _throughput(options: dict[str, Any]) -> tuple[int, int, int] | None:
    """``run_strategies``' ``throughput`` from ``--publish-throughput`` and its options."""
    if not options["publish_throughput"]:
        return None
    return options["publish_throughput"], options["producers"], options["producer_in_flight"]


async def _main(options: dict[str, Any]) -> dict[str, Any]:
    if options["cluster"] or (options["installations"] and options["scenario"] in PACED):
        return await _main_private(options)
    if options["installations"]:
        return await _main_private_node(options)
    return await _main_on(options["url"], options)


def _private_options(options: dict[str, Any]) -> dict[str, Any]:
    """``private_node``'s and ``private_cluster``'s arguments from ``--plugins-dir`` and
    ``--enable-plugin``; none when not given (a hopsched measured through
    ``--hopsched-path`` may predate ``plugins_dirs``)."""
    given = {"plugins": options["enable_plugins"], "plugins_dirs": options["plugins_dirs"]}
    extra: dict[str, Any] = {key: list(value) for key, value in given.items() if value}
    if options["node_config"]:
        extra["config"] = "\n".join(options["node_config"])
    return extra


async def _node_plugins(node: Any) -> dict[str, str] | None:
    """The plugins running on private node ``node`` with their versions; None from a
    hopsched (``--hopsched-path``) whose ``PrivateBroker`` cannot tell."""
    if not hasattr(node, "active_plugins"):
        return None
    plugins: dict[str, str] = await node.active_plugins()
    return plugins


async def _main_private_node(options: dict[str, Any]) -> dict[str, Any]:
    """A scenario that is not paced (throughput, burst, backlog) on a private node of the
    one installation ``--rabbitmq`` gives."""
    from hopsched.testing.localbroker import private_node

    [installation] = options["installations"]
    async with private_node(installation=installation, **_private_options(options)) as node:
        use_rabbitmqctl(node.rabbitmqctl_command)
        use_broker_cpu(node.cpu_seconds)
        try:
            result = await _main_on(node.url, options)
        finally:
            use_rabbitmqctl(None)
            use_broker_cpu(None)
        label = f"RabbitMQ {installation.version}"
        result["machine"]["note"] = (
            f"a private RabbitMQ node ({label}), relay and load generator share this "
            "machine with other work"
        )
        result["broker"]["url"] = None
        result["brokers"] = {label: {**result["broker"], "plugins": await _node_plugins(node)}}
        result["rss_bytes_after_run"] = {label: node.rss_bytes()}
    return result


async def _main_on(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The chosen scenario on the broker at ``url``."""
    run_id = uuid.uuid4().hex[:6]
    result: dict[str, Any] = {
        "scenario": options["scenario"],
        "command": " ".join(["python", "benchmarks/accuracy.py", *sys.argv[1:]]),
        "run_id": run_id,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_avg_1m_start": _load(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            "note": "broker, relay or worker, and load generator share this machine "
            "with other work",
        },
        "broker": await _broker(url),
        "hopsched": _hopsched_version(),
        "prefetch": options["prefetch"],
    }
    workload = Workload(
        count=options["count"],
        rate=options["rate"],
        delays=options["delays"],
        payload_bytes=options["payload_bytes"],
        seed=options["seed"],
    )
    started = time.monotonic()
    runs: dict[str, Run] = {}
    if options["scenario"] == "throughput":
        result["throughput"] = await run_throughput(url, run_id, options["prefetch"])
        result["workload"] = {"delays": f"rate steps, {result['throughput']['step_delays']}"}
        result["strategies"] = result["throughput"].pop("strategies")
        runs = result["throughput"].pop("runs")
    elif options["scenario"] == "burst":
        result["burst"] = await run_bursts(
            url,
            run_id,
            options["prefetch"],
            options["strategies"],
            options["burst_counts"],
            options["burst_lead"],
        )
        counts = " and ".join(f"{n:,}" for n in options["burst_counts"])
        result["workload"] = {
            "delays": f"{counts} messages due at one instant, "
            f"{options['burst_lead']:g} s after scheduling starts"
        }
        result["strategies"] = result["burst"].pop("strategies")
        runs = result["burst"].pop("runs")
    elif options["scenario"] == "backlog":
        result["workload"] = workload.describe()
        result["backlog"] = await run_backlog(
            url, run_id, options["prefetch"], workload, options["backlog_count"]
        )
        result["strategies"] = result["backlog"].pop("strategies")
        runs = result["backlog"].pop("runs")
    else:
        result["workload"] = workload.describe()
        result["strategies"], runs = await run_strategies(
            url,
            options["strategies"],
            workload,
            run_id,
            options["prefetch"],
            _throughput(options),
        )
    result["duration_s"] = round(time.monotonic() - started, 1)
    result["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["machine"]["load_avg_1m_end"] = _load()
    result["_runs"] = runs
    return result


async def _main_private(options: dict[str, Any]) -> dict[str, Any]:
    """The workload on private nodes, one setup after the other on this machine:
    ``--cluster``: hopsched-quorum on one node, then on a three-node cluster (URLs of all
    three); ``--rabbitmq``: the chosen strategies on one node of each installation."""
    # here, not at the top: a hopsched measured through --hopsched-path may predate it
    from hopsched.testing.localbroker import PrivateCluster, private_cluster, private_node

    setups: list[tuple[str, Callable[[], Any]]]
    extra = _private_options(options)
    if options["cluster"]:
        names = ["hopsched-quorum"]
        setups = [
            ("1 node", functools.partial(private_node, **extra)),
            ("3-node cluster", functools.partial(private_cluster, 3, **extra)),
        ]
    else:
        names = options["strategies"]
        setups = [
            (
                f"RabbitMQ {found.version}",
                functools.partial(private_node, installation=found, **extra),
            )
            for found in options["installations"]
        ]
    workload = Workload(
        count=options["count"],
        rate=options["rate"],
        delays=options["delays"],
        payload_bytes=options["payload_bytes"],
        seed=options["seed"],
    )
    run_id = uuid.uuid4().hex[:6]
    started = time.monotonic()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    memory: dict[str, int] = {}
    brokers: dict[str, dict[str, Any]] = {}
    load_start = _load()
    for number, (label, start) in enumerate(setups):
        async with start() as broker:
            node = broker.nodes[0] if isinstance(broker, PrivateCluster) else broker
            brokers[label] = await _broker(broker.url) | {"plugins": await _node_plugins(node)}
            use_rabbitmqctl(node.rabbitmqctl_command)  # its queue depths, not another node's
            use_broker_cpu(broker.cpu_seconds)  # every node's, on a cluster
            try:
                got, got_runs = await run_strategies(
                    broker.url,
                    names,
                    workload,
                    f"{run_id}{number}",
                    options["prefetch"],
                    _throughput(options),
                )
            finally:
                use_rabbitmqctl(None)
                use_broker_cpu(None)
            memory[label] = broker.rss_bytes()
        rows |= {f"{name} ({label})": row for name, row in got.items()}
        runs |= {f"{name} ({label})": run for name, run in got_runs.items()}
    first = next(iter(brokers.values()))
    versions = sorted({broker["version"] for broker in brokers.values()})
    result: dict[str, Any] = {
        "scenario": options["scenario"],
        "command": " ".join(["python", "benchmarks/accuracy.py", *sys.argv[1:]]),
        "run_id": run_id,
        "started_at": started_at,
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": _load(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            "note": f"private RabbitMQ nodes ({', '.join(brokers)}, one after the other), "
            "relay and load generator share this machine with other work",
        },
        "broker": {
            **{key: value for key, value in first.items() if key != "plugins"},
            "version": " and ".join(versions),
            "url": None,
        },
        "brokers": brokers,
        "rss_bytes_after_run": memory,
        "hopsched": _hopsched_version(),
        "prefetch": options["prefetch"],
        "workload": workload.describe(),
        "strategies": rows,
        "duration_s": round(time.monotonic() - started, 1),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "_runs": runs,
    }
    if options["cluster"]:
        result["cluster"] = {
            "nodes": 3,
            "note": "the relay and scheduler get all three node URLs; quorum queues "
            "replicate to all three, leaders placed 'balanced'",
        }
    return result


def _installations(given: str | None, options: dict[str, Any]) -> list[Any]:
    """``--rabbitmq``'s installations (``hopsched.testing.localbroker.Installation``)."""
    if not given:
        return []
    from hopsched.testing.localbroker import installation_in, machine_installation

    if options["cluster"]:
        raise click.BadParameter("not with --cluster", param_hint="--rabbitmq")
    found = []
    for part in (part.strip() for part in given.split(",") if part.strip()):
        installation = machine_installation() if part == "machine" else installation_in(Path(part))
        if installation is None:
            raise click.BadParameter(f"no RabbitMQ installation in {part}", param_hint="--rabbitmq")
        found.append(installation)
    if len(found) > 1 and options["scenario"] not in PACED:
        raise click.BadParameter(
            f"the {options['scenario']} scenario runs on one installation; several only for "
            f"the paced scenarios ({', '.join(PACED)})",
            param_hint="--rabbitmq",
        )
    return found


def _run_cancellable(coroutine: Any, loop: str = "asyncio") -> Any:
    """Run ``coroutine`` on ``loop`` (``asyncio`` or ``uvloop``); SIGTERM cancels it like
    Ctrl-C, so its cleanup still runs."""

    async def wrapper() -> Any:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await coroutine

    if loop == "uvloop":
        import uvloop  # hopsched[fast]

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(wrapper())
    return asyncio.run(wrapper())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    help="Preset: quick, standard, mixed, backlog, throughput or burst (options below override).",
)
@click.option("--count", type=click.IntRange(1), help="Messages (mixed: short ones).")
@click.option("--rate", type=click.FloatRange(min=0.1), help="Messages scheduled per second.")
@click.option(
    "--delays",
    help="loguniform:LOW:HIGH (default loguniform:10ms:10m), uniform:LOW:HIGH, fixed:D, mixed.",
)
@click.option("--payload-bytes", default=64, show_default=True, type=click.IntRange(0))
@click.option("--seed", default=1, show_default=True, type=int)
@click.option(
    "--strategies",
    help=f"Comma-separated, from: {', '.join(STRATEGIES)} (default: all).",
)
@click.option(
    "--ladder",
    "ladders",
    multiple=True,
    help="Run each hopsched strategy with this ladder, e.g. step_ratio=4 or "
    "min_step_ms=1024 or step_ratio=4,min_step_ms=16 (Settings fields, for the Scheduler "
    "and the relay process); give it again for each ladder, 'default' for the default "
    "one. Rows are named hopsched-quorum/ratio4 etc. [default: the default ladder].",
)
@click.option(
    "--url",
    default=lambda: os.environ.get("HOPSCHED_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    help="AMQP URL [env HOPSCHED_URL; default local guest].",
)
@click.option(
    "--prefetch",
    type=click.IntRange(1, 65535),
    help="The relay's prefetch (and the raw loop's in the throughput scenario) "
    "[default: the measured hopsched's own, Settings().prefetch].",
)
@click.option(
    "--burst-counts",
    default=",".join(map(str, BURST_COUNTS)),
    show_default=True,
    help="Burst scenario: messages due at one instant, one burst per count (comma-separated).",
)
@click.option(
    "--burst-lead",
    default=f"{BURST_LEAD_S:g}s",
    show_default=True,
    help="Burst scenario: the due instant, this long after scheduling starts.",
)
@click.option(
    "--hopsched-path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Measure the hopsched of this checkout (e.g. an earlier commit's git worktree) "
    "instead of the repository's: it goes first on PYTHONPATH for this process and every "
    "process it starts.",
)
@click.option(
    "--backlog-count",
    default=1_000_000,
    show_default=True,
    type=click.IntRange(1),
    help="Backlog scenario: messages pending with delays of 1-24 h.",
)
@click.option(
    "--cluster",
    is_flag=True,
    help="Run hopsched-quorum on a private single node, then on a private 3-node cluster "
    "(hopsched.testing.localbroker), to show what replication costs; --url is not used.",
)
@click.option(
    "--rabbitmq",
    "installations",
    help="Run on a private node of each RabbitMQ installation given, one after the other "
    "in one run, each row labelled with the node's version: comma-separated 'machine' "
    "(this machine's own) or a chroot directory holding another (e.g. RabbitMQ 4.0.5 from "
    ".ci/rabbitmq4, /opt/hopsched-rabbitmq4); --url is not used.",
)
@click.option(
    "--plugins-dir",
    "plugins_dirs",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="With --rabbitmq or --cluster: a directory of more RabbitMQ plugins for the private "
    "nodes, searched after the installation's own (repeatable).",
)
@click.option(
    "--enable-plugin",
    "enable_plugins",
    multiple=True,
    metavar="NAME",
    help="With --rabbitmq or --cluster: enable this plugin on the private nodes, e.g. "
    "rabbitmq_delayed_message_exchange (repeatable).",
)
@click.option(
    "--node-config",
    "node_config",
    multiple=True,
    metavar="LINE",
    help="With --rabbitmq or --cluster: a rabbitmq.conf line for the private nodes, e.g. "
    "'message_interceptors.incoming.set_header_timestamp.overwrite = false' (RabbitMQ "
    ">= 3.12: the broker stamps its receipt time, from which the ingress's delay then "
    "starts) (repeatable).",
)
@click.option(
    "--publish-throughput",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Paced scenarios: after each strategy's workload, N messages (due in 1 h) published "
    "as fast as --producers producers go, each on its own connection, with confirms: "
    "msgs/s per strategy (hopsched-quorum: schedule(); hopsched-ingress and "
    "delayed-exchange: x-delay publishes; others not measured). 0: off.",
)
@click.option(
    "--producers",
    default=10,
    show_default=True,
    type=click.IntRange(1),
    help="With --publish-throughput: concurrent producers.",
)
@click.option(
    "--producer-in-flight",
    default=50,
    show_default=True,
    type=click.IntRange(1),
    help="With --publish-throughput: publishes awaiting their confirm per producer.",
)
@click.option(
    "--loop",
    type=click.Choice(["asyncio", "uvloop"]),
    default="asyncio",
    show_default=True,
    help="The event loop of this process: the in-process relay's, the scheduler's and the "
    "consumers' (uvloop: pip install -e '.[fast]').",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--markdown",
    "markdown_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the table to this file.",
)
def main(**options: Any) -> None:
    """Measure how late (or early) scheduled messages arrive, per strategy."""
    if options["hopsched_path"] is not None:
        _use_hopsched(options["hopsched_path"])
    for noisy in ("aiormq", "aio_pika"):  # the delayed-exchange probe closes a connection
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    if options["prefetch"] is None:
        options["prefetch"] = hopsched.Settings().prefetch
    try:
        options["burst_counts"] = [int(n) for n in options["burst_counts"].split(",")]
        if min(options["burst_counts"]) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            "give positive integers, e.g. 2000,10000", param_hint="--burst-counts"
        ) from None
    try:
        options["burst_lead"] = parse_duration(options["burst_lead"]) / timedelta(seconds=1)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--burst-lead") from None
    preset = SCENARIOS.get(options["scenario"] or "", {})
    for key, default in DEFAULTS.items():
        if options.get(key) is None:
            options[key] = preset.get(key, default)
    options["scenario"] = options["scenario"] or "custom"
    try:
        options["delays"] = parse_delays(options["delays"])
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--delays") from None
    names = [name.strip() for name in options["strategies"].split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise click.BadParameter(
            f"{', '.join(unknown) or 'none given'}: choose from {', '.join(STRATEGIES)}",
            param_hint="--strategies",
        )
    try:
        ladders = [parse_ladder(text) for text in options["ladders"]]
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--ladder") from None
    if ladders:  # each hopsched strategy once per ladder, where it stood in the list
        names = [
            variant
            for name in names
            for variant in (
                [name if not ladder else f"{name}/{ladder_name(ladder)}" for ladder in ladders]
                if name.startswith("hopsched-")
                else [name]
            )
        ]
    options["strategies"] = names
    options["installations"] = _installations(options["installations"], options)
    if (options["plugins_dirs"] or options["enable_plugins"] or options["node_config"]) and not (
        options["installations"] or options["cluster"]
    ):
        raise click.BadParameter(
            "they are for private nodes: add --rabbitmq or --cluster",
            param_hint="--plugins-dir/--enable-plugin/--node-config",
        )
    try:
        result = _run_cancellable(_main(options), options["loop"])
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; every queue and exchange declared was deleted", err=True)
        sys.exit(130)
    runs: dict[str, Run] = result.pop("_runs")
    if "burst" in result:
        table = burst_table(result["strategies"])
    else:
        table = markdown_table(result["strategies"])
    if "throughput" in result:
        table += "\n\n" + throughput_summary(result["throughput"])
    if published := publish_throughput_table(result["strategies"]):
        table += "\n\n" + published
    if lags := ingest_lag_table(result["strategies"]):
        table += "\n\n" + lags
    if decades := decade_table(result["strategies"]):
        table += "\n\n" + decades
    measured = result["hopsched"]
    header = (
        f"{result['scenario']}: {result.get('workload', {}).get('delays', '')} · hopsched "
        f"{measured['commit'] or measured['path']}{'+' if measured['uncommitted_changes'] else ''}"
        f" · broker {result['broker']['product']} {result['broker']['version']} · "
        f"{result['machine']['cpu_count']} CPUs, load {result['machine']['load_avg_1m_start']}"
        f" → {result['machine']['load_avg_1m_end']}"
    )
    click.echo(header)
    click.echo(table)
    if options["markdown_path"]:
        options["markdown_path"].parent.mkdir(parents=True, exist_ok=True)
        options["markdown_path"].write_text(f"{header}\n\n{table}\n")
    if options["json_path"]:
        options["json_path"].parent.mkdir(parents=True, exist_ok=True)
        options["json_path"].write_text(json.dumps(result, indent=2) + "\n")
    if options["plot_dir"]:
        title = header.replace(" · broker", "\nbroker", 1)
        plot({name: run.points for name, run in runs.items()}, options["plot_dir"], title)


if __name__ == "__main__":
    main()
