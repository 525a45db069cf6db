"""``hopsched`` command line: parse, configure logging, call one coroutine.

The ``hopsched`` group and the commands that run something (``relay``, ``demo``) are
here; the others are in a module per group (``schedule``, ``status``, ``admin``,
``policies``, ``parked``, ``ingress``) and added to the group at the end."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any, cast

import click

from hopsched.cli import admin, ingress, parked, policies, schedule, status
from hopsched.cli.common import (
    LOGGING_SET,
    CommandGroup,
    cancelled_by_sigterm,
    connection_options,
    parse_in,
    run,
    settings_from_env,
)
from hopsched.cli.demo import run_demo_or_local
from hopsched.cli.logs import LogFormat, configure_logging
from hopsched.relay.loop import Relay

__all__ = ["main"]


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hopsched", prog_name="hopsched")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="-v: hopsched's debug lines; -vv: also aiormq's and aio-pika's frame-level lines.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line (time, level, logger, message, exception).",
)
def main(verbose: int, log_format: str) -> None:
    """hopsched: deliver RabbitMQ messages at a future instant, never early.

    \b
    Exit status:
      0  done
      1  the broker cannot be reached or refused (login, access), a topology
         mismatch, a missing queue; status: messages wait with no relay, or an
         interrupted upgrade; teardown refused (queues in use); the relay's
         metrics port is in use; the demo saw an early or lost message
      2  bad input (usage error, a setting or URL option, a message)
      3  parked replay: some messages asked for were not replayed; get,
         reschedule: no pending schedule of that id; cancel, reschedule: a
         schedule this login may not change stays pending
      4  nothing of the prefix exists where the command needs it (check
         --prefix): nothing was scheduled, cancelled, upgraded or removed;
         status: nothing of the prefix exists
      130 schedule interrupted (Ctrl-C): it may or may not be scheduled; the
         line says how to check
    """
    configure_logging(verbose, cast(LogFormat, log_format))
    click.get_current_context().meta[LOGGING_SET] = True


@main.command()
@connection_options
@click.option("--prefetch", type=click.IntRange(1, 65535), help="Deliveries held at once.")
@click.option(
    "--allow-target",
    "allowed_targets",
    multiple=True,
    metavar="EXCHANGE/ROUTING-KEY",
    help="Publish only to targets matching these globs (repeatable; e.g. 'orders/timeout.*', "
    "'/reminders' for the default exchange); others are parked. Default: any target "
    "[HOPSCHED_ALLOWED_TARGETS, comma-separated].",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics over HTTP on this port, path /metrics "
    "[HOPSCHED_METRICS_PORT; default 0: off].",
)
@click.option(
    "--metrics-address",
    help="Address the metrics endpoint listens on; 0.0.0.0 or :: for every interface "
    "[HOPSCHED_METRICS_ADDRESS; default 127.0.0.1].",
)
@click.option(
    "--lookups/--no-lookups",
    default=None,
    help="Answer look-ups (get) from the journal read once and kept: milliseconds "
    "however long the journal, for its memory (about 127 bytes per pending schedule) "
    "[HOPSCHED_LOOKUPS; default off].",
)
def relay(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    prefetch: int | None,
    allowed_targets: tuple[str, ...],
    metrics_port: int | None,
    metrics_address: str | None,
    lookups: bool | None,
) -> None:
    """Run the relay daemon until SIGINT or SIGTERM; logs totals once a minute and, with
    --metrics-port, serves Prometheus metrics (docs/operations.md, "Metrics")."""
    settings = settings_from_env(
        url=url,
        prefix=prefix,
        queue_type=queue_type,
        prefetch=prefetch,
        allowed_targets=allowed_targets or None,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        lookups=lookups,
    )

    async def serve() -> None:
        daemon = Relay(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.stop()))
        await daemon.run()

    run(serve(), settings, loop_factory=_fastest_loop())


def _fastest_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (``hopsched[fast]``, installed for this), else
    asyncio's; benchmarks/README.md, "Event loops", compares them."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@main.command()
@connection_options
@click.option("--count", default=300, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option(
    "--max-delay",
    default="60s",
    show_default=True,
    callback=parse_in,
    help="Longest delay; delays are log-uniform from 10 ms to this.",
)
@click.option(
    "--rate",
    default=200.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Messages scheduled per second.",
)
@click.option("--seed", type=int, help="Random seed for the delays.")
def demo(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    count: int,
    max_delay: Any,
    rate: float,
    seed: int | None,
) -> None:
    """Run a relay in-process, schedule COUNT real messages, print how late they came.

    If nothing answers at the URL on this machine and RabbitMQ is installed
    (HOPSCHED_RABBITMQ_BIN, /usr/lib/rabbitmq/bin or PATH), the demo runs on a throwaway
    RabbitMQ node it starts and removes at the end."""
    # A prefix of its own per queue type: one prefix holds one kind of ladder.
    default_prefix = "hopsched-demo" + ("-classic" if queue_type == "classic" else "")
    settings = settings_from_env(url=url, prefix=prefix or default_prefix, queue_type=queue_type)
    max_delay_s = max_delay.total_seconds()
    if max_delay_s <= 0.01:
        raise click.BadParameter("must be more than 10ms", param_hint="--max-delay")
    report = run(
        cancelled_by_sigterm(
            run_demo_or_local(settings, count=count, max_delay_s=max_delay_s, rate=rate, seed=seed)
        )
    )
    if report is None:
        click.echo("demo stopped by SIGTERM: nothing to report", err=True)
        sys.exit(128 + signal.SIGTERM)
    click.echo(report.table())
    if not report.ok:
        click.echo(f"FAILED: {report.early} early, {report.lost} lost", err=True)
        sys.exit(1)


for command in (
    admin.declare,
    admin.permissions,
    admin.teardown,
    admin.upgrade,
    ingress.ingress,
    parked.parked,
    policies.policies,
    schedule.cancel,
    schedule.get,
    schedule.pending,
    schedule.reschedule,
    schedule.schedule,
    status.status,
):
    main.add_command(command)
