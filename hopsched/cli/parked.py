"""``hopsched parked list|replay``: what the relay could not deliver, and its replay."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from hopsched.broker.parked import ParkedListing, list_parked, replay_parked
from hopsched.cli.common import (
    EXIT_NOT_REPLAYED,
    connection_options,
    run,
    settings_from_env,
)
from hopsched.core.clock import us_to_datetime


@click.group()
def parked() -> None:
    """Messages the relay could not deliver: list them, replay them."""


def when(value_us: int | None) -> str:
    return "?" if value_us is None else us_to_datetime(value_us).isoformat(timespec="milliseconds")


@parked.command("list")
@connection_options
@click.option("--limit", type=click.IntRange(min=1), help="Show at most this many.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def parked_list(
    url: str | None, prefix: str | None, queue_type: str | None, limit: int | None, as_json: bool
) -> None:
    """Show parked messages with reason, target and due time, in queue order; they stay
    parked (each is returned to the queue, which counts as a delivery attempt on RabbitMQ
    4.0-4.2 quorum queues). --json prints the list of those shown; `status` counts all."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    listing: ParkedListing = run(list_parked(settings, limit=limit))
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
            f"{message.schedule_id or '?'}  due {when(message.due_us)}  target "
            f"{message.exchange!r}/{message.routing_key!r}  {message.body_bytes} bytes  "
            f"parked {when(message.parked_at_us)}\n    "
            f"{f'[{message.kind}] ' if message.kind else ''}{message.reason}"
        )


@parked.command("replay")
@connection_options
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    result = run(replay_parked(settings, None if replay_all else set(ids)))
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
