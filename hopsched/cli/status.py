"""``hopsched status``: what a prefix holds, who serves it and what is wrong with it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, cast

import click

from hopsched.broker.nodes import RelayNodes, management_urls, relay_nodes
from hopsched.broker.objects import inspect, passive_depth
from hopsched.cli.common import (
    Failure,
    NoPrefix,
    connection_options,
    run,
    settings_from_env,
)
from hopsched.cli.policies import check_policies_or_fail, echo_policies, policy_risk
from hopsched.connect import connect
from hopsched.core.cancel import RecordTally
from hopsched.core.clock import now_us, us_to_datetime
from hopsched.errors import (
    HopschedError,
    TopologyMismatchError,
)
from hopsched.journal.cancels import journal_copies, tally_records
from hopsched.journal.stream import read_journal
from hopsched.settings import Settings
from hopsched.topology import (
    ANY_STEP_MS,
    QueueDepth,
    Topology,
    ladder_mismatch,
)


@click.command()
@connection_options
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
    """Depth of every step queue, the relay and parked queues; relay consumers and those
    answering look-ups, and with several URLs (or --nodes) which node each relay is on;
    the cancel stream's records by
    signature (checked with HOPSCHED_SIGNING_KEYS) and the messages relays parked for
    their signature or target; the schedules pending and the next due time, from the
    journal. Declares nothing (it writes one marker record to each stream to read it to
    its end, as a relay does); a queue of another type (--queue-type) is an error."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    per_node = per_node or len(settings.urls) > 1 or management_url is not None

    async def go() -> tuple[
        dict[str, QueueDepth | None],
        RelayNodes | None,
        str | None,
        RecordTally | str,
        Pending | str,
        int,
    ]:
        connection = await connect(settings)
        async with connection:
            depths = await inspect(topology, connection, check_arguments=False)
            try:  # after the depths: an interrupted upgrade shows whatever the arguments
                await inspect(topology, connection)
            except TopologyMismatchError as error:
                mismatch: str | None = str(error)
            else:
                mismatch = None
            lookups = await passive_depth(connection, topology.lookups)
        answering = 0 if lookups is None else lookups.consumers
        records = await _records(settings, depths.get(topology.cancel_stream) is not None)
        journal = await _journal(settings, depths.get(topology.journal_stream) is not None)
        if not per_node:
            return depths, None, mismatch, records, journal, answering
        urls = management_urls(settings, management_url)
        nodes = await relay_nodes(settings, topology.relay_queue, urls)
        return depths, nodes, mismatch, records, journal, answering

    depths, nodes, mismatch, records, journal, answering = cast(
        tuple[
            dict[str, QueueDepth | None],
            RelayNodes | None,
            str | None,
            RecordTally | str,
            Pending | str,
            int,
        ],
        run(go()),
    )
    if all(depth is None for depth in depths.values()):  # a mistyped --prefix, say
        # The queues, every one missing, and the error; no policy lines: about queues
        # that do not exist, they read as reassurance (a new-user trial).
        _show_status(settings, topology, depths, nodes, as_json, records, None, journal, answering)
        raise NoPrefix(
            f"nothing of prefix {settings.prefix!r} exists on this broker (vhost): check "
            "--prefix and --url, or declare it with `hopsched declare` (a relay declares "
            "it when it starts)"
        )
    checked = check_policies_or_fail(settings, management_url)
    _show_status(
        settings, topology, depths, nodes, as_json, records, checked.as_json(), journal, answering
    )
    if not as_json:
        echo_policies(checked)
    problems = _status_problems(settings, topology, depths)
    if mismatch is not None:
        problems.insert(0, mismatch)
    # a cancel stream declared anew, or deleted while the prefix lives on: cancels the
    # journal kept may be missing from it until a relay restores them
    anew = isinstance(records, RecordTally) and records.unrestored
    gone = depths.get(topology.cancel_stream) is None and depths.get(topology.journal_stream)
    if (anew or gone) and (missing := run(_unrestored(settings, gone=bool(gone)))) is not None:
        problems.append(missing)
    if (risk := policy_risk(checked)) is not None:
        problems.append(risk)
    if problems:
        raise Failure("; ".join(problems))


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
            f"{len(missing)} of the prefix's queues {'is' if len(missing) == 1 else 'are'} "
            f"missing ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): check --prefix and --queue-type, or "
            "declare them with `hopsched declare` (a relay declares them when it starts, "
            "and one it needs again when it is gone)"
        )
    for name in topology.holding_queues:
        if (depth := depths.get(name)) is not None:
            problems.append(
                f"{name} holds {depth.messages} message(s) of an interrupted upgrade: stop "
                f"the relays and run `hopsched upgrade --prefix {settings.prefix}` again"
            )
    relay = depths.get(topology.relay_queue)
    if relay is not None and depths.get(topology.journal_stream) is None:
        problems.append(
            f"the journal {topology.journal_stream} is missing (deleted?): get() and "
            "pending() fail until it is declared again, by a relay at its start or its "
            "next write to it, or by `hopsched declare`; the schedules it knew are known "
            "again only from their next record"
        )
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
    ingress = depths.get(topology.ingress_queue)
    relays_run = relay is not None and relay.consumers > 0
    if relay is not None and ingress is None:
        problems.append(
            f"{topology.ingress_queue} is missing (deleted?): x-delay messages published to "
            "the ingresses are unroutable. A relay declares it again (at once if one runs, "
            "else at its start; or `hopsched declare`); then bind each ingress again: "
            "`hopsched ingress declare EXCHANGE --type TYPE` (`hopsched ingress list`)"
        )
    elif ingress is not None and not ingress.consumers and relays_run:
        problems.append(
            f"relays consume {topology.relay_queue} but none consumes "
            f"{topology.ingress_queue} ({ingress.messages} message(s) there): their log says "
            'why (docs/operations.md, "An ingress queue that does not answer")'
        )
    elif ingress is not None and not ingress.consumers and ingress.messages:
        problems.append(
            f"{ingress.messages} message(s) published with x-delay wait in "
            f"{topology.ingress_queue} and no relay consumes it: none of them is scheduled "
            "(nor known to get(), pending() or cancel) until one takes it in, and the delay "
            "of each counts from then unless the broker stamps its receipt (RabbitMQ >= "
            f"3.12, docs/ingress.md): start one (hopsched relay --prefix {settings.prefix})"
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


async def _unrestored(settings: Settings, *, gone: bool) -> str | None:
    """Why cancels may be missing: the cancel stream is ``gone`` (deleted) or was declared
    anew and no relay has restored it yet (``CancelReader.needs_restore``); None if the
    journal kept none of its records."""
    topology = Topology.from_settings(settings)
    try:
        copies = len(await journal_copies(settings))
    except HopschedError as error:
        copies, read = 1, f"the journal could not be read ({error})"
    else:
        read = f"the journal kept {copies} of its stream messages"
    if not copies:
        return None
    what = "is missing (deleted?)" if gone else "was declared anew (deleted?)"
    return (
        f"{topology.cancel_stream} {what} and no relay has restored its cancels and "
        f"reschedules yet ({read}): messages cancelled before may be delivered. Start or "
        "restart a relay of this version: it declares the stream and restores them "
        "before it delivers anything"
    )


#: Past its due time by more than this, a schedule the journal calls pending while a
#: relay runs is not one on its way (a relay delivers within ms, catches up in seconds).
LONG_OVERDUE_US = 60_000_000


@dataclasses.dataclass(frozen=True)
class Pending:
    """What the journal says is pending: how many, the next due time (µs since the
    epoch, None: none), and how many are over ``LONG_OVERDUE_US`` past their due time."""

    count: int
    next_due_us: int | None
    overdue: int


async def _journal(settings: Settings, declared: bool) -> Pending | str:
    """What the journal says is pending, or why it could not be read."""
    if not declared:
        return (
            "the journal is not declared (a relay declares it at its start or its next "
            "journal write; so does `hopsched declare`)"
        )
    try:
        fold = await read_journal(settings, copies=False)
    except HopschedError as error:
        return f"not read: {error}"
    count, next_due, overdue = 0, None, 0
    long_ago = now_us() - LONG_OVERDUE_US
    for schedule_id in fold.pending():  # in due order: the overdue come first
        if count == overdue:  # no due time looked up past them
            due = fold.due_us(schedule_id)
            if not count:
                next_due = due
            if due is not None and due < long_ago:
                overdue += 1
        count += 1
    return Pending(count, next_due, overdue)


def _journal_lines(journal: Pending | str, relay_consumers: int) -> list[str]:
    if isinstance(journal, str):
        return [f"pending: {journal}"]
    line = f"pending: {journal.count} (journal)"
    if journal.next_due_us is not None:
        line += f", next due {us_to_datetime(journal.next_due_us).isoformat()}"
    lines = [line]
    if journal.overdue and relay_consumers:
        lines.append(
            f"  {journal.overdue} of them over {LONG_OVERDUE_US // 1_000_000} s past their "
            "due time while a relay runs: delivered with no record of it (a relay killed "
            "before writing it), or lost from the ladder (a queue deleted); `hopsched "
            "pending` lists them, `hopsched get ID` tells one"
        )
    return lines


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
    journal: Pending | str,
    answering: int = 0,
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
            "relays_answering_lookups": answering,
            "records": records if isinstance(records, str) else dataclasses.asdict(records),
            "pending": journal
            if isinstance(journal, str)
            else {
                "count": journal.count,
                "next_due": None
                if journal.next_due_us is None
                else us_to_datetime(journal.next_due_us).isoformat(),
                "overdue": journal.overdue,
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
        plural = "" if depth is not None and depth.messages == 1 else "s"
        text = "missing" if depth is None else f"{depth.messages:>9} message{plural}"
        if depth is None and name == topology.cancel_stream:
            text = "missing (a relay or the first cancel declares it)"
        elif depth is None and name == topology.journal_stream:
            text = "missing (a relay declares it at its start or next write to it)"
        elif name in topology.holding_queues:
            text += " (an interrupted upgrade: run `hopsched upgrade` again)"
        elif depth is not None and name in (*topology.streams, topology.ingress_registry):
            text += " in the stream (batches of records; none to deliver)"
        click.echo(f"  {name:<40} {text}")
    click.echo(f"relay consumers: {relay_consumers}")
    click.echo(
        f"relays answering look-ups: {answering}"
        + ("" if answering else " (get() reads the journal; `hopsched relay --lookups`)")
    )
    for line in _journal_lines(journal, relay_consumers):
        click.echo(line)
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
