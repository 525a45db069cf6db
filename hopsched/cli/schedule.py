"""``hopsched schedule``, ``cancel``, ``reschedule``, ``get`` and ``pending``: a
producer's commands and look-ups."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import Any

import aio_pika
import click

from hopsched.cli.arguments import parse_header
from hopsched.cli.common import (
    LINES_PER_WRITE,
    PAST_WARNING_US,
    Interrupted,
    Unknown,
    connection_options,
    parse_at,
    parse_in,
    run,
    settings_from_env,
)
from hopsched.cli.durations import describe_duration
from hopsched.cli.notes import interrupted_schedule, other_pending
from hopsched.client.prepare import check_schedule_id, due_time_us
from hopsched.client.scheduler import CANCEL_LEAD_S, Cancelled, Scheduler
from hopsched.client.sending import Scheduled
from hopsched.core.cancel import reaches, writer_scope
from hopsched.core.clock import datetime_to_us, now_us, us_to_datetime
from hopsched.core.recurring import CatchUp, Rule, plan_link
from hopsched.errors import (
    HopschedError,
    InvalidScheduleError,
)
from hopsched.journal.records import CANCELLED, HELD, PENDING, JournalFold, ScheduleInfo
from hopsched.journal.stream import read_journal
from hopsched.settings import Settings


@click.command()
@connection_options
@click.option("--at", "at", callback=parse_at, help="Due time, ISO 8601 with offset.")
@click.option(
    "--in",
    "delay",
    callback=parse_in,
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
    callback=parse_in,
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
    callback=parse_in,
    help="Recurring: every this long (at least 1s), e.g. 30s, 5m, 1h; first at --start "
    "[default: one interval from now].",
)
@click.option(
    "--cron",
    metavar="EXPR",
    help="Recurring: on a cron expression, e.g. '0 9 * * 1-5' (6 fields: seconds first).",
)
@click.option("--tz", metavar="ZONE", help="Time zone of --cron, e.g. Europe/Paris [default UTC].")
@click.option("--start", callback=parse_at, help="Recurring: no occurrence before (ISO 8601).")
@click.option("--until", callback=parse_at, help="Recurring: no occurrence after (ISO 8601).")
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
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
    past_start = rule is not None and now - due > PAST_WARNING_US
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
        run(go())
    except KeyboardInterrupt:
        raise Interrupted(interrupted_schedule(schedule_id)) from None


@click.command()
@connection_options
@click.argument("schedule_ids", nargs=-1, required=True)
def cancel(
    url: str | None, prefix: str | None, queue_type: str | None, schedule_ids: tuple[str, ...]
) -> None:
    """Cancel schedules by id: their messages scheduled before now are not delivered (a
    cancel confirmed 50 ms or more before the due time, never). Then says, from the
    journal, which ids had something pending. An id nothing is scheduled for, or already
    delivered, is not an error. Exit 3 if a schedule stays pending: another RabbitMQ
    user's, or another key's, which this login's cancel does not reach
    (docs/security.md)."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> tuple[list[Cancelled], int, JournalFold | str]:
        async with Scheduler(settings) as scheduler:  # refuses a prefix that does not exist
            results = await scheduler.cancel_many(schedule_ids)
            confirmed_us = now_us()  # at the latest: when the in-time lead counts from
        try:
            return results, confirmed_us, await read_journal(settings, copies=False)
        except HopschedError as error:
            return results, confirmed_us, str(error)

    started_us = now_us()
    results, confirmed_us, journal = run(go())
    hold_us = settings.ladder.hold_window_ms * 1000
    not_ours = []
    for result in results:
        info = (
            None
            if isinstance(journal, str)
            else journal.info(result.schedule_id, now_us(), hold_us)
        )
        if isinstance(journal, str):
            click.echo(f"cancel recorded {result.schedule_id}")
        elif info is None:
            click.echo(
                f"{result.schedule_id}: nothing pending to cancel: "
                f"{_not_pending(result.schedule_id, info)}; the cancel is recorded all the same, "
                "for a message of this id scheduled before now that the journal does not show "
                f"yet (not one published with x-delay still waiting in {settings.prefix}.ingress "
                "for a relay to take it in: that one is scheduled only then, after this cancel; "
                "`hopsched status` shows such messages)"
            )
        elif info.state == CANCELLED and (info.cancelled_us or 0) < started_us:
            when = us_to_datetime(info.cancelled_us or 0).isoformat()
            click.echo(
                f"{result.schedule_id} was cancelled already, at {when} (was due "
                f"{info.due.isoformat()}): nothing changed"
            )
        elif info.state == CANCELLED:
            due = info.due.isoformat()
            click.echo(
                f"cancelled {result.schedule_id} (was due {due}){_timing(info, confirmed_us)}"
            )
        elif info.state in (PENDING, HELD) and not _ours(info, settings):
            not_ours.append(result.schedule_id)
            click.echo(
                f"not cancelled {result.schedule_id}: {_not_pending(result.schedule_id, info)}"
            )
        elif info.state in (PENDING, HELD):
            click.echo(
                f"cancel recorded {result.schedule_id}: the journal does not show it yet (its "
                "write may have failed; the relays apply the cancel): check with hopsched get"
            )
        else:
            click.echo(
                f"{result.schedule_id}: nothing pending to cancel: "
                f"{_not_pending(result.schedule_id, info)} (the cancel is recorded all the same; "
                "it reaches no message scheduled after it)"
            )
    if isinstance(journal, str):
        click.echo(
            f"the journal could not be read ({journal}): a message of each id "
            "scheduled before now will not be delivered, if one is pending and this "
            "login's to change (scheduled by the same RabbitMQ user, or signed with its "
            "key: docs/security.md); `hopsched get ID` (with read on the journal) tells",
            err=True,
        )
    if not_ours:
        raise Unknown(f"not cancelled, still pending: {', '.join(not_ours)}")


@click.command()
@connection_options
@click.argument("schedule_id")
@click.option("--at", "at", callback=parse_at, help="New due time, ISO 8601 with offset.")
@click.option(
    "--in", "delay", callback=parse_in, help="New delay from now: 250ms, 90s, 5m, 2h, 1d."
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    if at is not None:
        _warn_if_past(at, now_us())

    async def go() -> tuple[Scheduled | None, ScheduleInfo | None]:
        async with Scheduler(settings) as scheduler:  # refuses a prefix that does not exist
            result = await scheduler.reschedule(schedule_id, at=at, delay=delay)
            return result, None if result is not None else await scheduler.get(schedule_id)

    result, info = run(go())
    if result is None:
        raise Unknown(f"nothing rescheduled: {_not_pending(schedule_id, info)}")
    click.echo(f"rescheduled {result.schedule_id} due {result.due.isoformat()}")


def _warn_if_past(at: datetime, now: int) -> None:
    """A due time (``--at``) further in the past than a minute: said, as it is delivered
    at once (a typo'd year, say)."""
    ago = now - datetime_to_us(at)
    if ago > PAST_WARNING_US:
        logging.getLogger("hopsched.cli").warning(
            "--at %s is %s in the past: it is due now and will be delivered at once",
            at.isoformat(),
            describe_duration(timedelta(microseconds=ago)),
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
    ago = describe_duration(timedelta(microseconds=now - first_us))
    logging.getLogger("hopsched.cli").warning(
        "the first occurrence (%s) is %s in the past: with --catch-up %s, %s; %s",
        us_to_datetime(first_us).isoformat(),
        ago,
        rule.catch_up.value,
        when,
        then,
    )


def _ours(info: ScheduleInfo, settings: Settings) -> bool:
    """Whether this login's records reach the schedule, as the relays decide
    (``hopsched.core.cancel.reaches``): signed with each of its keys, else unsigned."""
    scopes: list[str | None] = [key.key_id for key in settings.signatures.keys]
    scopes = scopes or [writer_scope(settings.owner, settings.trusted_users)]
    return any(reaches(scope, info.owner, info.user) for scope in scopes)


def _timing(info: ScheduleInfo, confirmed_us: int) -> str:
    """Whether a cancel confirmed by ``confirmed_us`` came in time (as
    ``Cancelled.in_time``): ``CANCEL_LEAD_S`` or more before the due time, or not."""
    lead_s = (info.due_us - confirmed_us) / 1e6
    if lead_s >= CANCEL_LEAD_S:
        return ": in time, it will not be delivered"
    return (
        f": late ({lead_s * 1000:.0f} ms before its due time; under {CANCEL_LEAD_S * 1000:.0f} "
        "ms the delivery may win): it may have been delivered"
    )


def _not_pending(schedule_id: str, info: ScheduleInfo | None) -> str:
    """Why the journal has nothing pending for ``schedule_id``."""
    if info is None:
        return (
            f"the journal knows no schedule {schedule_id!r} (never scheduled on this prefix, "
            "its last record older than the journal keeps, or the journal deleted since)"
        )
    if info.state in (PENDING, HELD):  # after a cancel or reschedule of this login's
        return (
            f"schedule {schedule_id!r} stays {info.state}: it is not this login's to change "
            "(scheduled by another RabbitMQ user, or signed with another key; "
            "docs/security.md)"
        )
    when = info.delivered_us or info.parked_us or info.cancelled_us
    at = f" at {us_to_datetime(when).isoformat()}" if when is not None else ""
    return f"schedule {schedule_id!r} was {info.state}{at}, no longer pending"


#: How a copy came (``ScheduleInfo.origin``), in words: the API and the CLI write alike.
_ORIGINS = {
    "schedule": "scheduled",
    "replace": "scheduled with replace",
    "reschedule": "rescheduled",
    "ingress": "taken from an ingress (x-delay)",
}


#: Characters that a target's plain spelling cannot hold and read back one way only.
_UNPLAIN = set("/ '\"")


def target_text(exchange: str, routing_key: str) -> str:
    """A target as ``--allow-target`` spells it: ``orders/timeout.eu``, ``/reminders``
    for the default exchange; quoted (``'a b'/'c/d'``) when a name holds a ``/``, a
    space, a quote or nothing to see, so that it reads back one way only."""
    plain = all(name.isprintable() and not _UNPLAIN & set(name) for name in (exchange, routing_key))
    if plain and routing_key:
        return f"{exchange}/{routing_key}"
    return f"{exchange!r}/{routing_key!r}"


def _info_lines(info: ScheduleInfo) -> list[str]:
    lines = [
        f"{info.schedule_id}: {info.state}",
        f"  due       {info.due.isoformat()}",
        f"  target    exchange {info.exchange!r} routing key {info.routing_key!r}",
    ]
    if info.size is not None:
        lines.append(f"  size      {info.size} bytes")
    # Whose records change it; named as in --json (``user``, ``owner``).
    if info.user is not None:
        lines.append(f"  user      RabbitMQ user {info.user!r}")
    if info.owner is not None:
        lines.append(f"  owner     signing key {info.owner!r}")
    if info.occurrence:
        lines.append(f"  recurring, occurrence {info.occurrence} (docs/recurring.md)")
    if info.pending_copies and info.pending_copies > 1:
        lines.append(
            f"  {info.pending_copies} messages of this id are pending (scheduled more than "
            "once without --replace; each is delivered); this is the newest"
        )
    if info.origin is not None and info.origin != "recurring":
        how = _ORIGINS.get(info.origin, info.origin)
        lines.append(f"  created   {us_to_datetime(info.created_us).isoformat()} ({how})")
    for label, when in (
        ("delivered", info.delivered_us),
        ("parked", info.parked_us),
        ("cancelled", info.cancelled_us),
    ):
        if when is not None:
            lines.append(f"  {label:<9} {us_to_datetime(when).isoformat()}")
    if info.parked_reason is not None:
        lines.append(f"  reason    {info.parked_reason}")
    return lines


@click.command()
@connection_options
@click.argument("schedule_ids", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one line each).")
@click.option(
    "--count-copies",
    is_flag=True,
    help="Read the journal, even where a relay answers look-ups, and count the id's "
    "pending messages (one id: an id scheduled twice without --replace has two).",
)
def get(
    url: str | None,
    prefix: str | None,
    queue_type: str | None,
    schedule_ids: tuple[str, ...],
    as_json: bool,
    count_copies: bool,
) -> None:
    """What the journal says of schedules, by id: state (pending, held, delivered,
    cancelled, parked), due time, target, size, when it was delivered, cancelled or
    parked. A relay started with --lookups answers in milliseconds; without one, it
    reads the journal, once for several ids. pending_copies is counted for one id read
    from the journal (--count-copies), else null. Exit 3 if it knows any of them not,
    naming those."""
    if count_copies and len(schedule_ids) > 1:
        raise click.UsageError("--count-copies counts one id's copies: give one id")
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> dict[str, ScheduleInfo | None]:
        async with Scheduler(settings) as scheduler:
            if len(schedule_ids) == 1:  # read from the journal, it counts the copies too
                info = await scheduler.get(schedule_ids[0], count_copies=count_copies)
                return {schedule_ids[0]: info}
            return await scheduler.get_many(schedule_ids)

    infos = run(go())
    unknown = [schedule_id for schedule_id, info in infos.items() if info is None]
    if as_json:
        click.echo(
            "\n".join(
                json.dumps(info.to_json() if info else {"schedule_id": schedule_id, "state": None})
                for schedule_id, info in infos.items()
            )
        )
    else:
        known = [_info_lines(info) for info in infos.values() if info is not None]
        if known:
            click.echo("\n\n".join("\n".join(lines) for lines in known))
    if len(unknown) == 1:
        raise Unknown(_not_pending(unknown[0], None))
    if unknown:
        raise Unknown(
            f"the journal knows no schedule {', '.join(map(repr, unknown))} (never scheduled "
            "on this prefix, their last records older than the journal keeps, or the "
            "journal deleted since)"
        )


@click.command()
@connection_options
@click.option("--due-before", "due_before", callback=parse_at, help="ISO 8601 with offset.")
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)

    async def go() -> int:
        count, lines = 0, []
        async with Scheduler(settings) as scheduler:
            async for info in scheduler.pending(due_before, routing_key, limit):
                count += 1
                lines.append(
                    json.dumps(info.to_json())
                    if as_json
                    else f"{info.due.isoformat()}  {info.schedule_id}  {info.state}  "
                    f"{target_text(info.exchange, info.routing_key)}"
                )
                if len(lines) == LINES_PER_WRITE:
                    click.echo("\n".join(lines))
                    lines.clear()
        if lines:
            click.echo("\n".join(lines))
        return count

    count = run(go())
    if not as_json:
        shown = f"the first {count} pending (--limit)" if limit == count else f"{count} pending"
        click.echo(shown, err=True)
