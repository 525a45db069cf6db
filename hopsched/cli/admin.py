"""``hopsched declare``, ``upgrade``, ``teardown`` and ``permissions``: a prefix's life on
the broker."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import click

from hopsched.broker import objects
from hopsched.broker.ingress import (
    list_ingresses,
)
from hopsched.broker.nodes import management_urls, unacknowledged
from hopsched.broker.objects import Teardown
from hopsched.cli.common import (
    PROGRESS_EVERY,
    connection_options,
    run,
    settings_from_env,
)
from hopsched.cli.policies import unprotect_quietly
from hopsched.connect import connect
from hopsched.errors import PrefixNotDeclaredError
from hopsched.topology import ROLES, QueueDepth, Role, Topology


@click.command()
@connection_options
def declare(url: str | None, prefix: str | None, queue_type: str | None) -> None:
    """Declare the ladder, relay and parked queues (idempotent) and print them."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)

    async def go() -> dict[str, QueueDepth | None]:
        connection = await connect(settings)
        async with connection:
            await objects.declare(topology, connection)
            return await objects.inspect(topology, connection, check_arguments=False)

    depths = run(go(), settings)
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


@click.command()
@connection_options
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
    the management API. An ingress's due exchange that consumers' queues are still bound
    to stays, as `ingress remove` leaves it (exit 1 after the rest), unless --force.
    Exit 4 if nothing of the prefix exists. Interrupted, run it again: it removes what is
    left."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
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
            done = await objects.teardown(
                topology,
                connection,
                force=force,
                count_held=count_held,
                progress=removed,
                # as `ingress remove`: consumers' bindings to a due exchange stay theirs
                shared_exchanges=[topology.due_exchange(each.exchange) for each in ingresses],
            )
            channel = await connection.channel()
            for each in ingresses:  # their exchanges, now that nothing routes into them
                await channel.exchange_delete(each.exchange)
                done.removed.append(each.exchange)
                removed(f"removed {each.exchange}", 0)
            return done

    done: Teardown = run(go(), settings)
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
    for name in run(unprotect_quietly(settings)):
        click.echo(f"removed policy {name}")


@click.command()
@connection_options
def upgrade(url: str | None, prefix: str | None, queue_type: str | None) -> None:
    """Re-declare the relay and parked queues of a prefix declared by hopsched < 0.2 with
    this version's delivery limit and dead-lettering, keeping every message. Stop every
    relay of the prefix first. Interrupted at any point (even killed), run it again: it
    finishes the move (at most one message duplicated per interruption, none lost).
    Exit 4, declaring nothing, if nothing of the prefix exists."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)

    def report(step: str, count: int) -> None:
        if not step.startswith("moved ") or count % PROGRESS_EVERY == 0:
            click.echo(f"  {step}" + (f": {count}" if step.startswith("moved ") else ""))

    async def go() -> list[str]:
        connection = await connect(settings, name="hopsched-upgrade")
        async with connection:
            done = await objects.upgrade(topology, connection, progress=report)
            await objects.declare(topology, connection)  # and the rest, as any process would
            return done

    for line in run(go(), settings):
        click.echo(line)


@click.command()
@connection_options
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
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
