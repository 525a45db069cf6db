"""``hopsched ingress declare|bind|list|remove``: the ``x-delay`` ingress."""

from __future__ import annotations

import json

import click

from hopsched.broker.ingress import (
    bind_to_due_exchange,
    declare_ingress,
    list_ingresses,
    remove_ingress,
)
from hopsched.cli.arguments import parse_header
from hopsched.cli.common import (
    BadInput,
    connection_options,
    run,
    settings_from_env,
)
from hopsched.core.ingress import DELAYED_TYPES, DelayedType, Ingress
from hopsched.errors import (
    HopschedError,
)
from hopsched.topology import (
    Topology,
)


@click.group()
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


#: What ``ingress bind`` takes besides the queue, by the due exchange's type.
_BIND_HINTS = {"direct": " --key KEY", "topic": " --key PATTERN", "headers": " --argument K=V"}


@ingress.command("declare")
@connection_options
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    try:
        declared = Ingress(exchange, delayed_type, keys)
    except HopschedError as error:
        raise BadInput(str(error)) from None
    pairs = tuple((queue, key) for queue, _, key in (item.partition(":") for item in bindings))
    run(declare_ingress(settings, declared, bindings=pairs, replace=replace), settings)
    topology = Topology.from_settings(settings)
    for queue, key in pairs:
        click.echo(f"bound queue {queue} to {topology.due_exchange(exchange)} (key {key!r})")
    click.echo(
        f"ingress {exchange} on {settings.masked_url}: producers publish to exchange "
        f"{exchange} (x-delay in ms); each is due x-delay after the broker's receipt stamp "
        "(RabbitMQ >= 3.12 with the timestamp interceptor), else after a relay takes it in, "
        f"and then goes to exchange {topology.due_exchange(exchange)} ({delayed_type}): bind "
        f"the consumers' queues there (hopsched ingress bind {exchange} QUEUE"
        f"{_BIND_HINTS.get(delayed_type, '')})"
    )


@ingress.command("bind")
@connection_options
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    try:
        table = dict(parse_header(item) for item in arguments)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--argument") from None
    due = run(bind_to_due_exchange(settings, exchange, queue, key, table), settings)
    with_arguments = f", arguments {table}" if table else ""
    click.echo(f"bound queue {queue} to {due} (key {key!r}{with_arguments})")


@ingress.command("list")
@connection_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def ingress_list(
    url: str | None, prefix: str | None, queue_type: str | None, as_json: bool
) -> None:
    """The prefix's ingresses: exchange, type and due exchange, one a line."""
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    topology = Topology.from_settings(settings)
    for each in run(list_ingresses(settings), settings):
        due = topology.due_exchange(each.exchange)
        if as_json:
            click.echo(json.dumps({**each.to_json(), "due_exchange": due}))
        else:
            keys = f" keys {', '.join(each.keys)}" if each.keys else ""
            click.echo(f"{each.exchange} ({each.delayed_type}) -> {due}{keys}")


@ingress.command("remove")
@connection_options
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
    settings = settings_from_env(url=url, prefix=prefix, queue_type=queue_type)
    for name in run(remove_ingress(settings, exchange, force=force), settings):
        click.echo(f"removed exchange {name}")
