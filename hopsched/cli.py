"""``hopsched`` command line: parse, configure logging, call one coroutine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

import aio_pika
import click

from hopsched.arguments import parse_header
from hopsched.cancel import RecordTally
from hopsched.cancel_reader import tally_records
from hopsched.cli_notes import interrupted_schedule, other_pending
from hopsched.clock import datetime_to_us, now_us, us_to_datetime
from hopsched.connect import connect
from hopsched.demo import run_demo_or_local
from hopsched.durations import parse_duration
from hopsched.errors import (
    HopschedError,
    InvalidScheduleError,
    InvalidSettingsError,
    PrefixNotDeclaredError,
    TopologyMismatchError,
)
from hopsched.ingress import DELAYED_TYPES, DelayedType, Ingress
from hopsched.ingress_io import (
    bind_to_due_exchange,
    declare_ingress,
    list_ingresses,
    remove_ingress,
)
from hopsched.journal import CANCELLED, JournalFold, ScheduleInfo
from hopsched.journal_io import read_journal
from hopsched.logs import LogFormat, configure_logging
from hopsched.nodes import RelayNodes, management_urls, relay_nodes, unacknowledged
from hopsched.parked import ParkedListing, list_parked, replay_parked
from hopsched.policies import PROTECT_PRIORITY
from hopsched.policy_watch import PolicyCheck, check_policies, protect, unprotect
from hopsched.prepare import check_schedule_id, due_time_us
from hopsched.recurring import CatchUp, Rule, plan_link
from hopsched.relay import Relay
from hopsched.scheduler import Cancelled, Scheduled, Scheduler
from hopsched.settings import Settings
from hopsched.topology import (
    ANY_STEP_MS,
    ROLES,
    QueueDepth,
    Role,
    Teardown,
    Topology,
    ladder_mismatch,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_NOT_REPLAYED", "EXIT_NO_PREFIX", "EXIT_UNKNOWN", "main"]

F = TypeVar("F", bound=Callable[..., Any])

#: Bad input: a usage error, a setting or a message hopsched cannot use; nothing was done.
EXIT_BAD_INPUT = 2
#: ``parked replay``: some messages asked for were not replayed (not parked, or left parked).
EXIT_NOT_REPLAYED = 3
#: ``get``, ``reschedule``: the journal knows no (pending) schedule of that id.
EXIT_UNKNOWN = 3
#: Nothing of the prefix exists where the command needs it (a mistyped --prefix?):
#: nothing was done (scheduled, cancelled, upgraded, removed).
EXIT_NO_PREFIX = 4
#: ``schedule`` interrupted (Ctrl-C) before the broker confirmed: it may or may not be
#: scheduled (128 + SIGINT, as a shell reports a process Ctrl-C ended).
EXIT_INTERRUPTED = 130
#: ``schedule --at`` further in the past than this (µs) gets a warning.
_PAST_WARNING_US = 60_000_000
#: ``Context.meta`` key: ``main()`` has configured logging.
_LOGGING_SET = "hopsched.logging"
#: ``upgrade`` prints a progress line every this many messages moved.
_PROGRESS_EVERY = 1000
#: ``pending`` writes its lines this many at a time: ``click.echo`` writes and flushes
#: each call, a quarter of the listing's time when it was called per line.
_LINES_PER_WRITE = 1000


class _Failure(click.ClickException):
    """A one-line ``Error:``, exit status 1."""


class _BadInput(_Failure):
    exit_code = EXIT_BAD_INPUT


class _NoPrefix(_Failure):
    exit_code = EXIT_NO_PREFIX


class _Unknown(_Failure):
    exit_code = EXIT_UNKNOWN


class _Interrupted(_Failure):
    exit_code = EXIT_INTERRUPTED


class _JsonFailure(click.ClickException):
    """A command's error, shown as a JSON log line (``--log-format json``)."""

    def __init__(self, error: click.ClickException) -> None:
        super().__init__(error.format_message())
        self.exit_code = error.exit_code  # type: ignore[misc]  # click's is a ClassVar

    def show(self, file: Any = None) -> None:
        logging.getLogger("hopsched.cli").error("%s", self.message)


class _Group(click.Group):
    """The ``hopsched`` group: with ``--log-format json`` a command's error (usage errors
    included) is a JSON line like every other, not click's text."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as error:
            if ctx.params.get("log_format") == "json":
                if not ctx.meta.get(_LOGGING_SET):  # an unknown command: main() did not run
                    configure_logging(0, "json")
                raise _JsonFailure(error) from None
            raise


def _connection_options(command: F) -> F:
    """--url, --prefix, --queue-type; each defaults to its HOPSCHED_* variable."""
    for option in reversed(
        [
            click.option(
                "--url",
                help="AMQP URL, or the URLs of a cluster's nodes comma-separated "
                "[env HOPSCHED_URL; default local guest].",
            ),
            click.option("--prefix", help="Namespace of the broker objects [HOPSCHED_PREFIX]."),
            click.option(
                "--queue-type",
                type=click.Choice(["quorum", "classic"]),
                help="Queue type of the ladder [HOPSCHED_QUEUE_TYPE; default quorum].",
            ),
        ]
    ):
        command = option(command)
    return command


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings.from_env(**overrides)
    except HopschedError as error:
        raise _BadInput(str(error)) from None


def _run(
    coroutine: Coroutine[Any, Any, Any],
    settings: Settings | None = None,
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> Any:
    """Run ``coroutine`` (on ``loop_factory``'s loop if given); a HopschedError becomes a
    one-line error: exit status 2 for bad input, 4 for a prefix that is not there
    (``settings`` name its URL), 1 for anything else (broker unreachable, topology
    mismatch)."""
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(coroutine)
    except (InvalidScheduleError, InvalidSettingsError) as error:
        raise _BadInput(str(error)) from None
    except PrefixNotDeclaredError as error:
        where = f"{settings.masked_url}: " if settings is not None else ""
        raise _NoPrefix(f"{where}{error}") from None
    except HopschedError as error:
        raise _Failure(str(error)) from None


async def _cancelled_by_sigterm(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Await ``coroutine``; SIGTERM cancels it as Ctrl-C does, so that its clean-up runs
    (a demo's throwaway node outlived a ``kill`` or ``timeout``). None if it did."""
    task = asyncio.ensure_future(coroutine)
    loop = asyncio.get_running_loop()
    terminated = asyncio.Event()

    def on_sigterm() -> None:
        terminated.set()
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await task
    except asyncio.CancelledError:
        if terminated.is_set():
            return None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _parse_at(_: click.Context, __: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: use ISO 8601, e.g. 2030-01-01T09:00:00Z") from None
    if at.tzinfo is None:
        example = at.isoformat()
        raise click.BadParameter(
            f"{value!r} has no UTC offset; add one, e.g. {example}Z or {example}+01:00"
        )
    return at


def _parse_in(_: click.Context, __: click.Parameter, value: str | None) -> Any:
    try:
        return None if value is None else parse_duration(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
      3  parked replay: some messages asked for were not replayed
      4  nothing of the prefix exists where the command needs it (check
         --prefix): nothing was scheduled, cancelled, upgraded or removed;
         status: nothing of the prefix exists
      130 schedule interrupted (Ctrl-C): it may or may not be scheduled; the
         line says how to check
    """
    configure_logging(verbose, cast(LogFormat, log_format))
    click.get_current_context().meta[_LOGGING_SET] = True


@main.command()
@_connection_options
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
def relay(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    prefetch: int | None,
    allowed_targets: tuple[str, ...],
    metrics_port: int | None,
    metrics_address: str | None,
) -> None:
    """Run the relay daemon until SIGINT or SIGTERM; logs totals once a minute and, with
    --metrics-port, serves Prometheus metrics (docs/operations.md, "Metrics")."""
    settings = _settings(
        url=url,
        prefix=prefix,
        queue_type=queue_type,
        prefetch=prefetch,
        allowed_targets=allowed_targets or None,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
    )

    async def serve() -> None:
        daemon = Relay(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.stop()))
        await daemon.run()

    _run(serve(), settings, loop_factory=_fastest_loop())


def _fastest_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (``hopsched[fast]``, installed for this), else
    asyncio's; benchmarks/README.md, "Event loops", compares them."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@main.command()
@_connection_options
@click.option("--at", "at", callback=_parse_at, help="Due time, ISO 8601 with offset.")
@click.option(
    "--in",
    "delay",
    callback=_parse_in,
    help="Delay: 250ms, 90s, 5m, 1m30s, 2h, 1d12h (<= 0: now).",
)
@click.option(
    "--routing-key",
    "-k",
    required=True,
    help="Target routing key (queue name for the default exchange).",
)
@click.option("--exchange", "-x", default="", show_default=True, help="Target exchange.")
@click.option("--body", help="Message body text.")
@click.option("--body-file", type=click.File("rb"), help="Message body from a file (- = stdin).")
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="K[:TYPE]=V",
    help="Header (repeatable); TYPE: str (default), int, float, decimal, bool, datetime "
    "(ISO 8601 with offset), json (a table or array), e.g. --header attempt:int=3.",
)
@click.option("--content-type", help="content_type property, e.g. application/json.")
@click.option("--message-id", help="message_id property [default: the schedule id].")
@click.option("--correlation-id", help="correlation_id property.")
@click.option(
    "--expiration",
    callback=_parse_in,
    help="The delivered message's TTL in its target queue (RabbitMQ's per-message "
    "expiration, whole ms), e.g. 30s; none by default.",
)
@click.option("--priority", type=click.IntRange(0, 255), help="priority property, 0-255.")
@click.option(
    "--persistent/--transient",
    default=True,
    show_default=True,
    help="delivery_mode of the delivered message (hops are always persistent).",
)
@click.option(
    "--schedule-id",
    help="Your id for it, to cancel or reschedule by, e.g. order-42-timeout (default random).",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Replace every message of --schedule-id scheduled before (a retry after a "
    "timeout: one is delivered, not two).",
)
@click.option(
    "--check-target",
    is_flag=True,
    help="First check, publishing nothing, that the target exchange exists and routes the "
    "routing key to a queue (other exchanges than the default: the management API).",
)
@click.option(
    "--management-url",
    help="Management API base URL(s) for --check-target [default http://HOST:15672/].",
)
@click.option(
    "--every",
    callback=_parse_in,
    help="Recurring: every this long (at least 1s), e.g. 30s, 5m, 1h; first at --start "
    "[default: one interval from now].",
)
@click.option(
    "--cron",
    metavar="EXPR",
    help="Recurring: on a cron expression, e.g. '0 9 * * 1-5' (6 fields: seconds first).",
)
@click.option("--tz", metavar="ZONE", help="Time zone of --cron, e.g. Europe/Paris [default UTC].")
@click.option("--start", callback=_parse_at, help="Recurring: no occurrence before (ISO 8601).")
@click.option("--until", callback=_parse_at, help="Recurring: no occurrence after (ISO 8601).")
@click.option(
    "--count", type=click.IntRange(min=1), help="Recurring: at most this many deliveries."
)
@click.option(
    "--catch-up",
    type=click.Choice(["latest", "all", "none"]),
    help="Recurring: occurrences missed while no relay ran: latest (default: the latest once), "
    "all, none.",
)
def schedule(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    at: datetime | None,
    delay: timedelta | None,
    routing_key: str,
    exchange: str,
    body: str | None,
    body_file: Any,
    headers: tuple[str, ...],
    content_type: str | None,
    message_id: str | None,
    correlation_id: str | None,
    expiration: timedelta | None,
    priority: int | None,
    persistent: bool,
    schedule_id: str | None,
    replace: bool,
    check_target: bool,
    management_url: str | None,
    every: timedelta | None,
    cron: str | None,
    tz: str | None,
    start: datetime | None,
    until: datetime | None,
    count: int | None,
    catch_up: str | None,
) -> None:
    """Schedule one message, or a recurring one (--every or --cron: docs/recurring.md);
    prints its schedule id and (first) due time (UTC). Refused (exit 4) on a prefix that
    has no relay queue: start a relay or run `hopsched declare` first. An --at more than
    a minute past is delivered at once, with a warning."""
    recurring: dict[str, Any] = {"every": every, "cron": cron, "tz": tz, "start": start}
    recurring |= {"until": until, "count": count, "catch_up": catch_up}
    if sum(value is not None for value in (at, delay, every, cron)) != 1:
        raise click.UsageError("give exactly one of --at, --in, --every and --cron")
    if replace and schedule_id is None:
        raise click.UsageError("--replace needs the --schedule-id of what it replaces")
    if body is not None and body_file is not None:
        raise click.UsageError("give at most one of --body and --body-file")
    if expiration is not None and expiration < timedelta(0):
        raise click.BadParameter("must be 0 or more", param_hint="--expiration")
    for option, text in (
        ("--message-id", message_id),
        ("--correlation-id", correlation_id),
        ("--content-type", content_type),
    ):
        if text == "":
            raise click.BadParameter("empty: give a value, or leave it out", param_hint=option)
    if expiration is not None and expiration % timedelta(milliseconds=1):
        raise click.BadParameter(
            f"{expiration.total_seconds() * 1000:g} ms: RabbitMQ's expiration is whole "
            "milliseconds, e.g. 2ms or 30s",
            param_hint="--expiration",
        )
    header_table: dict[str, Any] = {}
    for item in headers:
        try:
            key, value = parse_header(item)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--header") from None
        if key.startswith("x-hopsched-"):
            raise click.BadParameter(
                f"{key!r}: x-hopsched-* headers are hopsched's own", param_hint="--header"
            )
        if key in header_table:
            raise click.BadParameter(f"{key!r} given twice", param_hint="--header")
        header_table[key] = value
    # surrogateescape: the exact bytes of a non-UTF-8 argument, as the shell passed them
    payload = (
        body_file.read()
        if body_file is not None
        else (body or "").encode("utf-8", "surrogateescape")
    )
    message = aio_pika.Message(
        payload,
        headers=header_table,
        content_type=content_type,
        message_id=message_id,
        correlation_id=correlation_id,
        expiration=expiration,
        priority=priority,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        if persistent
        else aio_pika.DeliveryMode.NOT_PERSISTENT,
    )
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    now = now_us()
    try:  # before connecting: bad input should not declare anything
        if every is None and cron is None:
            if any(value is not None for value in recurring.values()):
                raise InvalidScheduleError(
                    "--tz, --start, --until, --count and --catch-up are for a recurring "
                    "schedule: give --every or --cron"
                )
            due, rule = due_time_us(at, delay, now), None
        else:
            rule = Rule.make(now_us=now, **{**recurring, "catch_up": catch_up or "latest"})
            due = rule.first_us() or now
    except InvalidScheduleError as error:
        raise click.UsageError(str(error)) from None
    past_start = rule is not None and now - due > _PAST_WARNING_US
    if at is not None:
        _warn_if_past(at, now)
    elif rule is not None and past_start:
        _warn_of_a_past_start(rule, due, now)
    if refusal := settings.target_policy.refusal(exchange, routing_key):
        raise click.UsageError(refusal)

    given_id, schedule_id = schedule_id, schedule_id or check_schedule_id(None)  # for Ctrl-C

    async def go() -> None:
        async with Scheduler(settings, management_url=management_url) as scheduler:
            result = await scheduler.schedule(
                message,
                at=at,
                delay=delay,
                exchange=exchange,
                routing_key=routing_key,
                schedule_id=schedule_id,
                check_target=check_target,
                replace=replace,
                **recurring,
            )
            if given_id and not replace and (warning := await other_pending(scheduler, given_id)):
                logging.getLogger("hopsched.cli").warning("%s", warning)
        done = "scheduled (replacing any before)" if replace else "scheduled"
        what = "" if rule is None else " (first occurrence; recurring)"
        if past_start:
            what = " (first occurrence, in the past: see the warning; recurring)"
        click.echo(f"{done} {result.schedule_id} due {result.due.isoformat()}{what}")

    try:
        _run(go())
    except KeyboardInterrupt:
        raise _Interrupted(interrupted_schedule(schedule_id)) from None


@main.command()
@_connection_options
@click.argument("schedule_ids", nargs=-1, required=True)
def cancel(
    url: str | None, prefix: str | None, queue_type: str | None, schedule_ids: tuple[str, ...]
) -> None:
    """Cancel schedules by id: their messages scheduled before now are not delivered (a
    cancel confirmed 50 ms or more before the due time, never). Then says, from the
    journal, which ids had something pending. An id nothing is scheduled for, or already
    delivered, is not an error."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> tuple[list[Cancelled], JournalFold | str]:
        async with Scheduler(settings) as scheduler:  # refuses a prefix that does not exist
            results = await scheduler.cancel_many(schedule_ids)
        try:
            return results, await read_journal(settings, copies=False)
        except HopschedError as error:
            return results, str(error)

    started_us = now_us()
    results, journal = _run(go())
    hold_us = settings.ladder.hold_window_ms * 1000
    for result in results:
        info = (
            None
            if isinstance(journal, str)
            else journal.info(result.schedule_id, now_us(), hold_us)
        )
        if isinstance(journal, str):
            click.echo(f"cancel recorded {result.schedule_id}")
        elif info is None:
            click.echo(f"cancel recorded {result.schedule_id}: the journal knows no such schedule")
        elif info.state == CANCELLED and (info.cancelled_us or 0) < started_us:
            when = us_to_datetime(info.cancelled_us or 0).isoformat()
            click.echo(
                f"{result.schedule_id} was cancelled already, at {when} (was due "
                f"{info.due.isoformat()}): nothing changed"
            )
        elif info.state == CANCELLED:
            click.echo(f"cancelled {result.schedule_id} (was due {info.due.isoformat()})")
        else:
            click.echo(
                f"cancel recorded {result.schedule_id}: {_not_pending(result.schedule_id, info)}"
            )
    if isinstance(journal, str):
        click.echo(
            f"the journal could not be read ({journal}): a message of each id "
            "scheduled before now will not be delivered, if one is pending",
            err=True,
        )


@main.command()
@_connection_options
@click.argument("schedule_id")
@click.option("--at", "at", callback=_parse_at, help="New due time, ISO 8601 with offset.")
@click.option(
    "--in", "delay", callback=_parse_in, help="New delay from now: 250ms, 90s, 5m, 2h, 1d."
)
def reschedule(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    schedule_id: str,
    at: datetime | None,
    delay: Any,
) -> None:
    """Move a pending schedule to a new due time, earlier or later: a new message from the
    journal's copy, then a cancel of the old one; prints the new due time (UTC). Exit 3
    if the journal knows no pending schedule of that id (nothing was changed)."""
    if (at is None) == (delay is None):
        raise click.UsageError("give exactly one of --at and --in")
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    if at is not None:
        _warn_if_past(at, now_us())

    async def go() -> tuple[Scheduled | None, ScheduleInfo | None]:
        async with Scheduler(settings) as scheduler:  # refuses a prefix that does not exist
            result = await scheduler.reschedule(schedule_id, at=at, delay=delay)
            return result, None if result is not None else await scheduler.get(schedule_id)

    result, info = _run(go())
    if result is None:
        raise _Unknown(f"nothing rescheduled: {_not_pending(schedule_id, info)}")
    click.echo(f"rescheduled {result.schedule_id} due {result.due.isoformat()}")


def _warn_if_past(at: datetime, now: int) -> None:
    """A due time (``--at``) further in the past than a minute: said, as it is delivered
    at once (a typo'd year, say)."""
    ago = now - datetime_to_us(at)
    if ago > _PAST_WARNING_US:
        logging.getLogger("hopsched.cli").warning(
            "--at %s is %s in the past: it is due now and will be delivered at once",
            at.isoformat(),
            timedelta(seconds=ago // 1_000_000),
        )


def _warn_of_a_past_start(rule: Rule, first_us: int, now: int) -> None:
    """A recurring schedule whose first occurrence is past: what the relay will do with
    the occurrences due by now (``plan_link``, as the relay does on reaching the first)."""
    link = plan_link(rule, first_us, 0, now)
    if rule.catch_up is CatchUp.ALL:
        when = (
            f"each of the {rule.count_between_us(first_us, now + 1)} occurrence(s) due by "
            "now (1,000 counted at most) is delivered at once, one after another"
        )
    elif link.deliver_us is not None:
        when = (
            f"the latest occurrence due by now ({us_to_datetime(link.deliver_us).isoformat()})"
            " is delivered at once, the others not"
        )
    else:
        when = "the occurrences due by now are missed (over 10 s late): none is delivered"
    if link.next_us is None:
        then = "and the schedule ends there"
    elif rule.catch_up is CatchUp.ALL:
        then = "then the rule goes on"
    else:
        then = f"then the next is due {us_to_datetime(link.next_us).isoformat()}"
    ago = timedelta(seconds=(now - first_us) // 1_000_000)
    logging.getLogger("hopsched.cli").warning(
        "the first occurrence (%s) is %s in the past: with --catch-up %s, %s; %s",
        us_to_datetime(first_us).isoformat(),
        ago,
        rule.catch_up.value,
        when,
        then,
    )


def _not_pending(schedule_id: str, info: ScheduleInfo | None) -> str:
    """Why the journal has nothing pending for ``schedule_id``."""
    if info is None:
        return (
            f"the journal knows no schedule {schedule_id!r} (never scheduled on this prefix, "
            "or its last record is older than the journal keeps)"
        )
    when = info.delivered_us or info.parked_us or info.cancelled_us
    at = f" at {us_to_datetime(when).isoformat()}" if when is not None else ""
    return f"schedule {schedule_id!r} is {info.state}{at}, no longer pending"


def _info_lines(info: ScheduleInfo) -> list[str]:
    lines = [
        f"{info.schedule_id}: {info.state}",
        f"  due      {info.due.isoformat()}",
        f"  target   exchange {info.exchange!r} routing key {info.routing_key!r}",
    ]
    if info.size is not None:
        lines.append(f"  size     {info.size} bytes")
    if info.occurrence:
        lines.append(f"  recurring, occurrence {info.occurrence} (docs/recurring.md)")
    if info.pending_copies and info.pending_copies > 1:
        lines.append(
            f"  {info.pending_copies} messages of this id are pending (scheduled more than "
            "once without --replace; each is delivered); this is the newest"
        )
    if info.origin is not None and info.origin != "recurring":
        lines.append(f"  by       {info.origin}() at {us_to_datetime(info.created_us).isoformat()}")
    for label, when in (
        ("delivered", info.delivered_us),
        ("parked", info.parked_us),
        ("cancelled", info.cancelled_us),
    ):
        if when is not None:
            lines.append(f"  {label:<8} {us_to_datetime(when).isoformat()}")
    if info.parked_reason is not None:
        lines.append(f"  reason   {info.parked_reason}")
    return lines


@main.command()
@_connection_options
@click.argument("schedule_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def get(
    url: str | None, prefix: str | None, queue_type: str | None, schedule_id: str, as_json: bool
) -> None:
    """What the journal says of one schedule: state (pending, held, delivered, cancelled,
    parked), due time, target, size, when it was delivered, cancelled or parked. Exit 3
    if it knows no such schedule."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> ScheduleInfo | None:
        async with Scheduler(settings) as scheduler:
            return await scheduler.get(schedule_id)

    info = _run(go())
    if info is None:
        if as_json:
            click.echo(json.dumps({"schedule_id": schedule_id, "state": None}))
        raise _Unknown(_not_pending(schedule_id, None))
    if as_json:
        click.echo(json.dumps(info.to_json()))
    else:
        click.echo("\n".join(_info_lines(info)))


@main.command()
@_connection_options
@click.option("--due-before", "due_before", callback=_parse_at, help="ISO 8601 with offset.")
@click.option("--routing-key", "routing_key", help="Only those with this routing key.")
@click.option("--limit", type=click.IntRange(min=1), help="Show at most this many (1 or more).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def pending(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    due_before: datetime | None,
    routing_key: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """The pending schedules, in due order: one line each (due time, id, target)."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> int:
        count, lines = 0, []
        async with Scheduler(settings) as scheduler:
            async for info in scheduler.pending(due_before, routing_key, limit):
                count += 1
                lines.append(
                    json.dumps(info.to_json())
                    if as_json
                    else f"{info.due.isoformat()}  {info.schedule_id}  {info.state}  "
                    f"{info.exchange!r}/{info.routing_key!r}"
                )
                if len(lines) == _LINES_PER_WRITE:
                    click.echo("\n".join(lines))
                    lines.clear()
        if lines:
            click.echo("\n".join(lines))
        return count

    count = _run(go())
    if not as_json:
        shown = f"the first {count} pending (--limit)" if limit == count else f"{count} pending"
        click.echo(shown, err=True)


@main.command()
@_connection_options
def declare(url: str | None, prefix: str | None, queue_type: str | None) -> None:
    """Declare the ladder, relay and parked queues (idempotent) and print them."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)

    async def go() -> dict[str, QueueDepth | None]:
        connection = await connect(settings)
        async with connection:
            await topology.declare(connection)
            return await topology.inspect(connection, check_arguments=False)

    depths = _run(go(), settings)
    click.echo(f"declared on {settings.masked_url}:")
    click.echo(f"  exchange {topology.expired_exchange} (direct) -> queue {topology.relay_queue}")
    for name, arguments in topology.all_queues().items():
        click.echo(f"  queue {name} {json.dumps(arguments, sort_keys=True)}")
    for name in topology.holding_queues:
        if (depth := depths.get(name)) is not None:
            click.echo(
                f"warning: {name} holds {depth.messages} message(s) of an interrupted "
                f"upgrade: stop the relays and run `hopsched upgrade --prefix "
                f"{settings.prefix}` again",
                err=True,
            )


@main.command()
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--nodes",
    "per_node",
    is_flag=True,
    help="Per node: the relay queue's leader and members and the relays consuming through "
    "it (from the management API; the default with several URLs).",
)
@click.option(
    "--management-url",
    help="Management API base URL(s), comma-separated [default http://HOST:15672/ per URL].",
)
def status(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    as_json: bool,
    per_node: bool,
    management_url: str | None,
) -> None:
    """Depth of every step queue, the relay and parked queues; relay consumers, and with
    several URLs (or --nodes) which node each relay is on; the cancel stream's records by
    signature (checked with HOPSCHED_SIGNING_KEYS) and the messages relays parked for
    their signature or target; the schedules pending and the next due time, from the
    journal. Declares nothing (it writes one marker record to each stream to read it to
    its end, as a relay does); a queue of another type (--queue-type) is an error."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    per_node = per_node or len(settings.urls) > 1 or management_url is not None

    async def go() -> tuple[
        dict[str, QueueDepth | None],
        RelayNodes | None,
        str | None,
        RecordTally | str,
        tuple[int, int | None] | str,
    ]:
        connection = await connect(settings)
        async with connection:
            depths = await topology.inspect(connection, check_arguments=False)
            try:  # after the depths: an interrupted upgrade shows whatever the arguments
                await topology.inspect(connection)
            except TopologyMismatchError as error:
                mismatch: str | None = str(error)
            else:
                mismatch = None
        records = await _records(settings, depths.get(topology.cancel_stream) is not None)
        journal = await _journal(settings, depths.get(topology.journal_stream) is not None)
        if not per_node:
            return depths, None, mismatch, records, journal
        urls = management_urls(settings, management_url)
        nodes = await relay_nodes(settings, topology.relay_queue, urls)
        return depths, nodes, mismatch, records, journal

    depths, nodes, mismatch, records, journal = cast(
        tuple[
            dict[str, QueueDepth | None],
            RelayNodes | None,
            str | None,
            RecordTally | str,
            tuple[int, int | None] | str,
        ],
        _run(go()),
    )
    if all(depth is None for depth in depths.values()):  # a mistyped --prefix, say
        # The queues, every one missing, and the error; no policy lines: about queues
        # that do not exist, they read as reassurance (a new-user trial).
        _show_status(settings, topology, depths, nodes, as_json, records, None, journal)
        raise _NoPrefix(
            f"nothing of prefix {settings.prefix!r} exists on this broker (vhost): check "
            "--prefix and --url, or declare it with `hopsched declare` (a relay declares "
            "it when it starts)"
        )
    checked = _check_policies(settings, management_url)
    _show_status(settings, topology, depths, nodes, as_json, records, checked.as_json(), journal)
    if not as_json:
        _echo_policies(checked)
    problems = _status_problems(settings, topology, depths)
    if mismatch is not None:
        problems.insert(0, mismatch)
    if (risk := _policy_risk(checked)) is not None:
        problems.append(risk)
    if problems:
        raise _Failure("; ".join(problems))


def _status_problems(
    settings: Settings, topology: Topology, depths: dict[str, QueueDepth | None]
) -> list[str]:
    """What makes ``status`` exit 1: missing queues, an interrupted upgrade, messages
    that wait with no relay to take them."""
    problems = []
    # the stream is declared on the first cancel: missing until then is normal
    missing = [name for name in topology.queues_but_stream() if depths.get(name) is None]
    found = [step for step in ANY_STEP_MS if depths.get(topology.step_queue(step)) is not None]
    other_ladder = None
    if depths.get(topology.relay_queue) is not None:
        other_ladder = ladder_mismatch(settings.prefix, topology.ladder, found)
    if other_ladder is not None:  # names both ladders, and which steps are missing
        problems.append(str(other_ladder))
    elif missing:
        problems.append(
            f"{len(missing)} of the prefix's queues are missing ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): check --prefix and --queue-type, or "
            "declare them with `hopsched declare` (a relay declares them when it starts)"
        )
    for name in topology.holding_queues:
        if (depth := depths.get(name)) is not None:
            problems.append(
                f"{name} holds {depth.messages} message(s) of an interrupted upgrade: stop "
                f"the relays and run `hopsched upgrade --prefix {settings.prefix}` again"
            )
    relay = depths.get(topology.relay_queue)
    waiting = sum(
        depth.messages
        for name in (*topology.step_queues, topology.relay_queue)
        if (depth := depths.get(name)) is not None
    )
    if relay is not None and not relay.consumers and waiting:
        problems.append(
            f"{waiting} message(s) wait on the ladder and no relay consumes "
            f"{topology.relay_queue}: start one (hopsched relay --prefix {settings.prefix})"
        )
    return problems


async def _records(settings: Settings, declared: bool) -> RecordTally | str:
    """The cancel stream's records by signature, or why they could not be read."""
    if not declared:
        return "the cancel stream is not declared yet"
    try:
        return await tally_records(settings)
    except HopschedError as error:
        return f"not read: {error}"


async def _journal(settings: Settings, declared: bool) -> tuple[int, int | None] | str:
    """(schedules pending, the next due time in µs or None) from the journal, or why it
    could not be read."""
    if not declared:
        return "the journal is not declared yet (a relay of this version declares it)"
    try:
        fold = await read_journal(settings, copies=False)
    except HopschedError as error:
        return f"not read: {error}"
    count, next_due = 0, None
    for schedule_id in fold.pending():
        if not count:
            next_due = fold.due_us(schedule_id)
        count += 1
    return count, next_due


def _journal_line(journal: tuple[int, int | None] | str) -> str:
    if isinstance(journal, str):
        return f"pending: {journal}"
    count, next_due = journal
    if next_due is None:
        return f"pending: {count} (journal)"
    return f"pending: {count} (journal), next due {us_to_datetime(next_due).isoformat()}"


def _records_lines(tally: RecordTally | str) -> list[str]:
    if isinstance(tally, str):
        return [f"records: {tally}"]
    refused = ", ".join(f"{n} {why}" for why, n in sorted(tally.refused.items())) or "none"
    if tally.checked:
        lines = [f"records: {tally.signed} signed, {tally.unsigned} unsigned; ignored: {refused}"]
    else:
        lines = [
            f"records: {tally.signed} carry a signature, {tally.unsigned} do not (not checked: "
            f"no signing keys); ignored: {refused}"
        ]
    parked = ", ".join(f"{n} {kind}" for kind, n in sorted(tally.parked.items())) or "none"
    lines.append(f"parked by relays as forged or aimed at hopsched's own objects: {parked}")
    return lines


def _show_status(
    settings: Settings,
    topology: Topology,
    depths: dict[str, QueueDepth | None],
    nodes: RelayNodes | None,
    as_json: bool,
    records: RecordTally | str,
    policies: dict[str, Any] | None,
    journal: tuple[int, int | None] | str,
) -> None:
    relay_depth = depths.get(topology.relay_queue)
    relay_consumers = relay_depth.consumers if relay_depth is not None else 0
    if as_json:
        shown: dict[str, Any] = {
            "url": settings.masked_url,
            "prefix": settings.prefix,
            "queues": {
                name: None if depth is None else dataclasses.asdict(depth)
                for name, depth in depths.items()
            },
            "relay_consumers": relay_consumers,
            "records": records if isinstance(records, str) else dataclasses.asdict(records),
            "pending": journal
            if isinstance(journal, str)
            else {
                "count": journal[0],
                "next_due": None if journal[1] is None else us_to_datetime(journal[1]).isoformat(),
            },
        }
        if nodes is not None:
            shown["nodes"] = {name: dataclasses.asdict(view) for name, view in nodes.nodes.items()}
            shown["nodes_unavailable"] = nodes.unavailable
        shown["policies"] = policies
        click.echo(json.dumps(shown, indent=2))
        return
    click.echo(f"{settings.masked_url} prefix {settings.prefix}")
    for name, depth in depths.items():
        text = "missing" if depth is None else f"{depth.messages:>9} messages"
        if depth is None and name == topology.cancel_stream:
            text = "not declared yet (the first cancel declares it)"
        elif depth is None and name == topology.journal_stream:
            text = "not declared yet (a relay or the first schedule declares it)"
        elif name in topology.holding_queues:
            text += " (an interrupted upgrade: run `hopsched upgrade` again)"
        click.echo(f"  {name:<40} {text}")
    click.echo(f"relay consumers: {relay_consumers}")
    click.echo(_journal_line(journal))
    for line in _records_lines(records):
        click.echo(line)
    if nodes is None:
        return
    if nodes.unavailable is not None:
        click.echo(f"per node: unknown; {nodes.unavailable}")
        return
    click.echo(f"per node ({topology.relay_queue}, from {nodes.source}):")
    for name, view in sorted(nodes.nodes.items()):
        state = f"{view.role or 'no replica'}{'' if view.online or not view.role else ', down'}"
        click.echo(f"  {name}: {state}; {len(view.consumers)} relay consumer(s)")
        for consumer in view.consumers:
            click.echo(f"    {consumer}")


@main.command()
@_connection_options
@click.option(
    "--force",
    is_flag=True,
    help="Delete even queues that hold messages or have consumers (the messages are lost).",
)
@click.option(
    "--management-url",
    help="Management API base URL(s), comma-separated, to count what consumers hold "
    "[default http://HOST:15672/ per URL].",
)
def teardown(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    force: bool,
    management_url: str | None,
) -> None:
    """Delete the prefix's queues and exchange, printing each as it goes; refuses (exit 1)
    while a queue holds messages or has consumers, unless --force. With --force it counts
    what it deletes: the ready messages, and what consumers (a running relay) held, from
    the management API. Exit 4 if nothing of the prefix exists. Interrupted, run it
    again: it removes what is left."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    apis = management_urls(settings, management_url)

    async def count_held(consumers: Mapping[str, int]) -> dict[str, int] | str:
        return await unacknowledged(settings, consumers, apis)

    def removed(step: str, lost: int) -> None:
        click.echo(f"{step} ({lost} ready message(s) deleted with it)" if lost else step)

    async def go() -> Teardown:
        try:  # read before the registry stream goes with the rest
            ingresses = await list_ingresses(settings)
        except PrefixNotDeclaredError:
            ingresses = []
        connection = await connect(settings)
        async with connection:
            done = await topology.teardown(
                connection, force=force, count_held=count_held, progress=removed
            )
            channel = await connection.channel()
            for each in ingresses:  # their exchanges, now that nothing routes into them
                for name in (each.exchange, topology.due_exchange(each.exchange)):
                    await channel.exchange_delete(name)
                    done.removed.append(name)
                    removed(f"removed {name}", 0)
            return done

    done: Teardown = _run(go(), settings)
    for name in done.missing:
        click.echo(f"did not exist: {name}")
    for name, consumers in done.consumers.items():
        held = (
            f"{done.held[name]} unacknowledged message(s) at the broker's last statistics "
            "round (the management API's count, refreshed every 5 s by default)"
            if name in done.held
            else f"an unknown number of messages ({done.held_unknown})"
        )
        click.echo(
            f"{name} had {consumers} consumer(s) (a running relay?) holding {held}; they "
            "were in no queue any more: a relay delivers what it holds, or they are lost"
        )
    lost = sum(done.lost.values())
    held_total = "an unknown number" if done.held_unknown else str(sum(done.held.values()))
    click.echo(
        f"{settings.prefix} on {settings.masked_url}: {len(done.removed)} removed, "
        f"{len(done.missing)} did not exist; {lost} ready message(s) deleted"
        + (f", {held_total} held by consumers" if done.consumers else "")
    )
    if management_url:
        settings = dataclasses.replace(settings, management_url=management_url)
    for name in _run(_unprotect_quietly(settings)):
        click.echo(f"removed policy {name}")


@main.command()
@_connection_options
def upgrade(url: str | None, prefix: str | None, queue_type: str | None) -> None:
    """Re-declare the relay and parked queues of a prefix declared by hopsched < 0.2 with
    this version's delivery limit and dead-lettering, keeping every message. Stop every
    relay of the prefix first. Interrupted at any point (even killed), run it again: it
    finishes the move (at most one message duplicated per interruption, none lost).
    Exit 4, declaring nothing, if nothing of the prefix exists."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)

    def report(step: str, count: int) -> None:
        if not step.startswith("moved ") or count % _PROGRESS_EVERY == 0:
            click.echo(f"  {step}" + (f": {count}" if step.startswith("moved ") else ""))

    async def go() -> list[str]:
        connection = await connect(settings, name="hopsched-upgrade")
        async with connection:
            done = await topology.upgrade(connection, progress=report)
            await topology.declare(connection)  # and the rest, as any process would
            return done

    for line in _run(go(), settings):
        click.echo(line)


@main.command()
@_connection_options
@click.option(
    "--role",
    type=click.Choice(ROLES),
    help="One role's grant for --user [default: every role's, for USER-ROLE each].",
)
@click.option("--user", default="hopsched", show_default=True, help="RabbitMQ user name.")
@click.option("--vhost", help="Virtual host [default: the URL's, '/' if it names none].")
@click.option(
    "--target-exchange",
    "target_exchanges",
    multiple=True,
    help="An exchange the relay delivers to (repeatable; the default exchange needs none).",
)
@click.option(
    "--ingress",
    "ingress_exchanges",
    multiple=True,
    help="An ingress exchange (repeatable): the producer's grant writes there and nowhere "
    "else; the operator's may declare it.",
)
def permissions(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    role: Role | None,
    user: str,
    vhost: str | None,
    target_exchanges: tuple[str, ...],
    ingress_exchanges: tuple[str, ...],
) -> None:
    """Print the rabbitmqctl commands granting each role (producer, relay, operator) the
    least it needs; docs/security.md says what each grant allows."""
    if not user.strip():
        raise click.BadParameter("empty: give the RabbitMQ user's name", param_hint="--user")
    if vhost is not None and not vhost.strip():
        raise click.BadParameter(
            "empty: give a virtual host (the default vhost is '/'), or leave --vhost out "
            "for the URL's",
            param_hint="--vhost",
        )
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    vhost = settings.vhost if vhost is None else vhost
    if role is not None:
        grant = topology.permissions(role, target_exchanges, ingress_exchanges)
        click.echo(grant.command(user, vhost))
        return
    for each in ROLES:
        click.echo(f"# {each}: {_ROLE_DOES[each]}")
        grant = topology.permissions(each, target_exchanges, ingress_exchanges)
        click.echo(grant.command(f"{user}-{each}", vhost))


_ROLE_DOES: dict[Role, str] = {
    "producer": "schedule, cancel (declares nothing; reads nothing, not the journal)",
    "relay": "hopsched relay",
    "operator": "declare, status, teardown, upgrade, parked list/replay, cancel, reschedule, "
    "get, pending",
}


def _check_policies(settings: Settings, management_url: str | None) -> PolicyCheck:
    if management_url:
        settings = dataclasses.replace(settings, management_url=management_url)
    checked: PolicyCheck = _run(check_policies(settings))
    return checked


def _echo_policies(checked: PolicyCheck) -> None:
    for line in checked.lines():
        click.echo(line)


def _policy_risk(checked: PolicyCheck) -> str | None:
    """Why ``checked`` makes a command exit 1: a policy in force can lose or stall
    messages; else None."""
    report = checked.report
    if report is None or not report.at_risk:
        return None
    return (
        f"{len(report.findings)} finding(s) on the policies in force: messages can be lost "
        f"or stalled; the worst: {report.findings[0].line()}"
    )


async def _unprotect_quietly(settings: Settings) -> list[str]:
    """Remove the protective policies after a teardown, if the API lets us."""
    try:
        return await unprotect(settings)
    except HopschedError:
        return []


_MANAGEMENT_URL = click.option(
    "--management-url",
    help="Management API base URL(s), comma-separated [HOPSCHED_MANAGEMENT_URL; default "
    "http://HOST:15672/ per URL].",
)


@main.group()
def policies() -> None:
    """The broker's policies on the prefix's queues: check them, keep user policies off.

    \b
    A user policy (rabbitmqctl set_policy) or an operator policy matching the prefix's
    queues can delete them (expires), drop their messages (max-length, message-ttl on
    the parking queue) or turn off at-least-once dead-lettering (overflow drop-head).
    `protect` sets hopsched's own policies, of higher priority, that keep every other
    user policy off them; an operator policy cannot be masked: `check` prints the
    rabbitmqctl command that excludes the prefix from it (docs/operations.md, "Policies").
    """


@policies.command("check")
@_connection_options
@_MANAGEMENT_URL
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def policies_check(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    management_url: str | None,
    as_json: bool,
) -> None:
    """What the policies in force do to the prefix's queues, each with its fix. Exits 1
    if one can lose or stall messages, or if the management API cannot tell."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    checked = _check_policies(settings, management_url)
    if as_json:
        click.echo(json.dumps(checked.as_json(), indent=2))
    else:
        _echo_policies(checked)
    if checked.report is None:
        raise _Failure(f"cannot read the policies in force: {checked.unavailable}")
    if (risk := _policy_risk(checked)) is not None:
        raise _Failure(risk)


@policies.command("protect")
@_connection_options
@_MANAGEMENT_URL
@click.option(
    "--priority",
    type=int,
    default=PROTECT_PRIORITY,
    show_default=True,
    help="Priority of the protective policies: above every user policy matching the "
    "prefix's queues.",
)
def policies_protect(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    management_url: str | None,
    priority: int,
) -> None:
    """Set hopsched's protective policies on the prefix's queues (the user needs the tag
    policymaker); without the right, print the rabbitmqctl commands and exit 1."""
    settings = _settings(
        url=url, prefix=prefix, queue_type=queue_type, management_url=management_url
    )
    done = _run(protect(settings, priority))
    if done.error is not None:
        click.echo("run these where you may set policies:")
        for command in done.commands:
            click.echo(f"  {command}")
        raise _Failure(f"the protective policies were not set: {done.error}")
    for policy in done.policies:
        click.echo(
            f"set policy {policy.name} (priority {policy.priority}) on {policy.pattern}: "
            f"{json.dumps(dict(policy.definition))}"
        )


@policies.command("unprotect")
@_connection_options
@_MANAGEMENT_URL
def policies_unprotect(
    url: str | None, prefix: str | None, queue_type: str | None, management_url: str | None
) -> None:
    """Remove hopsched's protective policies from the prefix."""
    settings = _settings(
        url=url, prefix=prefix, queue_type=queue_type, management_url=management_url
    )
    removed = _run(unprotect(settings))
    for name in removed:
        click.echo(f"removed policy {name}")
    if not removed:
        click.echo(f"no protective policy on prefix {settings.prefix}")


@main.group()
def parked() -> None:
    """Messages the relay could not deliver: list them, replay them."""


def _when(value_us: int | None) -> str:
    return "?" if value_us is None else us_to_datetime(value_us).isoformat(timespec="milliseconds")


@parked.command("list")
@_connection_options
@click.option("--limit", type=click.IntRange(min=1), help="Show at most this many.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def parked_list(
    url: str | None, prefix: str | None, queue_type: str | None, limit: int | None, as_json: bool
) -> None:
    """Show parked messages with reason, target and due time, in queue order; they stay
    parked (each is returned to the queue, which counts as a delivery attempt on RabbitMQ
    4.0-4.2 quorum queues). --json prints the list of those shown; `status` counts all."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    listing: ParkedListing = _run(list_parked(settings, limit=limit))
    if as_json:
        click.echo(
            json.dumps([dataclasses.asdict(message) for message in listing.messages], indent=2)
        )
        return
    click.echo(
        f"showing {len(listing.messages)} of {listing.total} parked message(s) in "
        f"{settings.prefix}.parked"
    )
    for message in listing.messages:
        click.echo(
            f"{message.schedule_id or '?'}  due {_when(message.due_us)}  target "
            f"{message.exchange!r}/{message.routing_key!r}  {message.body_bytes} bytes  "
            f"parked {_when(message.parked_at_us)}\n    "
            f"{f'[{message.kind}] ' if message.kind else ''}{message.reason}"
        )


@parked.command("replay")
@_connection_options
@click.option("--id", "ids", multiple=True, help="Schedule id to replay (repeatable).")
@click.option("--all", "replay_all", is_flag=True, help="Replay every parked message.")
def parked_replay(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    ids: tuple[str, ...],
    replay_all: bool,
) -> None:
    """Send parked messages back to the relay, once their target is fixed: the relay
    delivers each (at once if past due) or parks it again with the new reason.

    Exits 3 if some messages asked for were not replayed (an --id not parked, or a
    message left parked, each named with why); the others were."""
    if ids and replay_all:
        raise click.UsageError("--all and --id exclude each other: give one of them")
    if not ids and not replay_all:
        raise click.UsageError("give --id ID (repeatable) or --all")
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    result = _run(replay_parked(settings, None if replay_all else set(ids)))
    count, relay_queue = len(result.replayed), f"{settings.prefix}.relay"
    if result.to_ingress:
        click.echo(
            f"replayed {count} message(s): {count - result.to_ingress} to {relay_queue}, "
            f"{result.to_ingress} to their ingress exchange"
        )
    else:
        click.echo(f"replayed {count} message(s) to {relay_queue}")
    for name, why in result.left.items():
        click.echo(f"left parked: {name}: {why}")
    missing = set(ids) - set(result.replayed) - set(result.left)
    for name in sorted(missing):
        click.echo(f"not parked: {name}", err=True)
    if missing or result.left:
        sys.exit(EXIT_NOT_REPLAYED)


@main.command()
@_connection_options
@click.option("--count", default=300, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option(
    "--max-delay",
    default="60s",
    show_default=True,
    callback=_parse_in,
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
    settings = _settings(url=url, prefix=prefix or default_prefix, queue_type=queue_type)
    max_delay_s = max_delay.total_seconds()
    if max_delay_s <= 0.01:
        raise click.BadParameter("must be more than 10ms", param_hint="--max-delay")
    report = _run(
        _cancelled_by_sigterm(
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


@main.group()
def ingress() -> None:
    """Ingresses: exchanges producers publish to with an x-delay header (ms), as to the
    delayed-message plugin's x-delayed-message exchange; hopsched delivers each message
    through the due exchange {prefix}.due.EXCHANGE when due (docs/ingress.md).

    \b
    declare EXCHANGE --type T   the producers' exchange, and its due exchange of type T
    bind EXCHANGE QUEUE         a consumer queue to its due exchange (as it was bound to
                                the plugin's exchange)
    list                        the prefix's ingresses
    remove EXCHANGE             both exchanges
    """


@ingress.command("declare")
@_connection_options
@click.argument("exchange")
@click.option(
    "--type",
    "delayed_type",
    type=click.Choice(DELAYED_TYPES),
    required=True,
    help="The plugin exchange's x-delayed-type: how the due exchange routes.",
)
@click.option(
    "--key",
    "keys",
    multiple=True,
    help="A routing key the plugin's direct exchange routed (repeatable): only while its "
    "messages are still pending in the plugin (docs/migrating-from-the-delayed-message-"
    "plugin.md).",
)
@click.option(
    "--bind",
    "bindings",
    multiple=True,
    metavar="QUEUE[:KEY]",
    help="Bind a consumer queue to the due exchange with KEY (repeatable), before the "
    "exchange itself is declared.",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Delete an exchange of that name first (the delayed-message plugin's: keep the "
    "plugin enabled until its longest pending delay has passed).",
)
def ingress_declare(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    exchange: str,
    delayed_type: DelayedType,
    keys: tuple[str, ...],
    bindings: tuple[str, ...],
    replace: bool,
) -> None:
    """Declare ingress EXCHANGE (idempotent). A relay of the prefix must have run there:
    exit 4 if the prefix has no ingress queue."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    try:
        declared = Ingress(exchange, delayed_type, keys)
    except HopschedError as error:
        raise _BadInput(str(error)) from None
    pairs = tuple((queue, key) for queue, _, key in (item.partition(":") for item in bindings))
    _run(declare_ingress(settings, declared, bindings=pairs, replace=replace), settings)
    topology = Topology.from_settings(settings)
    click.echo(
        f"ingress {exchange} on {settings.masked_url}: producers publish to exchange "
        f"{exchange} (x-delay in ms); each is due x-delay after the broker's receipt stamp "
        "(RabbitMQ >= 3.12 with the timestamp interceptor), else after a relay takes it in, "
        f"and then goes to exchange {topology.due_exchange(exchange)} ({delayed_type}): bind "
        f"the consumers' queues there (hopsched ingress bind {exchange} QUEUE --key KEY)"
    )


@ingress.command("bind")
@_connection_options
@click.argument("exchange")
@click.argument("queue")
@click.option("--key", default="", help="Binding routing key (direct, topic).")
@click.option(
    "--argument",
    "arguments",
    multiple=True,
    metavar="K=V",
    help="A binding argument (headers exchanges: x-match=all|any, header values; "
    "K:TYPE=V for a typed one), repeatable.",
)
def ingress_bind(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    exchange: str,
    queue: str,
    key: str,
    arguments: tuple[str, ...],
) -> None:
    """Bind QUEUE to ingress EXCHANGE's due exchange (what it received from the plugin's
    exchange through its binding, it receives from there, when due)."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    try:
        table = dict(parse_header(item) for item in arguments)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--argument") from None
    due = _run(bind_to_due_exchange(settings, exchange, queue, key, table), settings)
    click.echo(f"bound queue {queue} to {due} (key {key!r})")


@ingress.command("list")
@_connection_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def ingress_list(
    url: str | None, prefix: str | None, queue_type: str | None, as_json: bool
) -> None:
    """The prefix's ingresses: exchange, type and due exchange, one a line."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    for each in _run(list_ingresses(settings), settings):
        due = topology.due_exchange(each.exchange)
        if as_json:
            click.echo(json.dumps({**each.to_json(), "due_exchange": due}))
        else:
            keys = f" keys {', '.join(each.keys)}" if each.keys else ""
            click.echo(f"{each.exchange} ({each.delayed_type}) -> {due}{keys}")


@ingress.command("remove")
@_connection_options
@click.argument("exchange")
@click.option(
    "--force",
    is_flag=True,
    help="Remove the due exchange even with consumers bound (its pending messages will be "
    "parked at their due time).",
)
def ingress_remove(
    url: str | None, prefix: str | None, queue_type: str | None, exchange: str, force: bool
) -> None:
    """Remove ingress EXCHANGE: the producers' exchange and the due exchange."""
    settings = _settings(url=url, prefix=prefix, queue_type=queue_type)
    for name in _run(remove_ingress(settings, exchange, force=force), settings):
        click.echo(f"removed exchange {name}")
