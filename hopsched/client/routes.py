"""Where a publish would go, told without publishing: ``schedule(check_target=True)``.

AMQP has no dry run: a mandatory publish says whether a message routes only by routing
it, to the target's consumers too, and inside a transaction RabbitMQ sends
``basic.return`` on commit only (measured on 3.10.8 and 4.0.5: a mandatory publish to
a routing key with no binding, rolled back, returns nothing; see also
https://www.rabbitmq.com/docs/semantics). So hopsched routes on paper: the default
exchange routes by queue name (a passive ``queue.declare`` tells, over AMQP); any other
exchange by its bindings, read from the management API
(``GET /api/exchanges/VHOST/NAME`` and ``.../bindings/source``), which ``reached``
follows as RabbitMQ does: direct, fanout, topic and headers exchanges, exchange-to-
exchange bindings and alternate exchanges
(https://www.rabbitmq.com/docs/ae, https://www.rabbitmq.com/docs/e2e).

``reached`` is pure; ``exchange_views`` reads the API; ``check_route`` is what
``schedule(check_target=True)`` runs. Nothing is published, declared or bound.
"""

from __future__ import annotations

import asyncio
import urllib.error
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

from hopsched.broker.management import api_get, management_urls, why
from hopsched.broker.objects import exists
from hopsched.connect import connect
from hopsched.errors import TargetCheckError, UnroutableTargetError
from hopsched.settings import Settings
from hopsched.urls import mask_url

__all__ = [
    "Binding",
    "CannotTell",
    "ExchangeView",
    "check_route",
    "exchange_views",
    "headers_match",
    "reached",
    "topic_matches",
]

_TIMEOUT_S = 5.0
#: Exchange types ``reached`` follows (RabbitMQ's built-in ones).
KNOWN_TYPES = frozenset({"direct", "fanout", "topic", "headers"})


class CannotTell(Exception):
    """Whether the target routes cannot be told (an exchange type ``reached`` does not
    follow, an exchange it was not given); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Binding:
    """One binding of an exchange: to a queue, or to another exchange."""

    destination: str
    to_exchange: bool
    routing_key: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ExchangeView:
    """An exchange as routing sees it.

    Attributes:
        name, type: the exchange and its type (``direct``, ``topic``...).
        internal: clients may not publish to it.
        alternate: its alternate exchange (argument or policy), if any.
        bindings: its bindings as the source.
    """

    name: str
    type: str
    internal: bool = False
    alternate: str | None = None
    bindings: tuple[Binding, ...] = ()


def reached(
    exchanges: Mapping[str, ExchangeView],
    exchange: str,
    routing_key: str,
    headers: Mapping[str, Any] | None = None,
) -> set[str]:
    """The queues a publish to ``exchange`` with ``routing_key`` and ``headers`` reaches.

    Follows exchange-to-exchange bindings, and an exchange's alternate exchange when none
    of its own bindings match (RabbitMQ's ``rabbit_exchange:route``), each exchange once.

    Raises:
        CannotTell: an exchange on the way is not in ``exchanges`` (it does not exist) or
            is of a type other than ``KNOWN_TYPES``.
    """
    queues: set[str] = set()
    seen: set[str] = set()
    todo = [exchange]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        view = exchanges.get(name)
        if view is None:
            raise CannotTell(f"exchange {name!r} (on the way) does not exist")
        if view.type not in KNOWN_TYPES:
            raise CannotTell(
                f"exchange {name!r} is of type {view.type!r}, whose routing hopsched does not "
                f"follow (it does {', '.join(sorted(KNOWN_TYPES))})"
            )
        matched = [b for b in view.bindings if _matches(view.type, b, routing_key, headers or {})]
        if not matched and view.alternate is not None:
            todo.append(view.alternate)
        for binding in matched:
            if binding.to_exchange:
                todo.append(binding.destination)
            else:
                queues.add(binding.destination)
    return queues


def _matches(kind: str, binding: Binding, routing_key: str, headers: Mapping[str, Any]) -> bool:
    if kind == "fanout":
        return True
    if kind == "direct":
        return binding.routing_key == routing_key
    if kind == "topic":
        return topic_matches(binding.routing_key, routing_key)
    return headers_match(binding.arguments, headers)


def _words(key: str) -> list[str]:
    return key.split(".") if key else []


def topic_matches(pattern: str, routing_key: str) -> bool:
    """Whether a topic binding ``pattern`` matches ``routing_key``: words split at ``.``,
    ``*`` one word, ``#`` zero or more (https://www.rabbitmq.com/tutorials/tutorial-five-python)."""
    words, parts = _words(routing_key), _words(pattern)
    # can[j]: the parts seen so far match the first j words
    can = [True] + [False] * len(words)
    for part in parts:
        if part == "#":
            for j in range(1, len(words) + 1):
                can[j] = can[j] or can[j - 1]
        else:
            can = [False] + [
                can[j] and (part == "*" or part == words[j]) for j in range(len(words))
            ]
    return can[len(words)]


def headers_match(arguments: Mapping[str, Any], headers: Mapping[str, Any]) -> bool:
    """Whether a headers-exchange binding's ``arguments`` match a message's ``headers``,
    as RabbitMQ's ``rabbit_exchange_type_headers``: ``x-match`` ``all`` (the default),
    ``any``, ``all-with-x`` or ``any-with-x``; keys starting ``x-`` count only in the
    ``-with-x`` modes; a binding value of no value (None) matches the header's presence;
    values compare within their type class (numbers with numbers, text with text)."""
    mode = str(arguments.get("x-match", "all"))
    with_x = mode.endswith("-with-x")
    wanted = {
        key: value
        for key, value in arguments.items()
        if key != "x-match" and (with_x or not key.startswith("x-"))
    }
    found = [key in headers and _same(value, headers[key]) for key, value in wanted.items()]
    return any(found) if mode.startswith("any") else all(found)


def _same(wanted: Any, value: Any) -> bool:
    if wanted is None:
        return True  # presence
    if isinstance(wanted, bool) or isinstance(value, bool):
        return isinstance(wanted, bool) and isinstance(value, bool) and wanted == value
    number = (int, float, Decimal)
    if isinstance(wanted, number) or isinstance(value, number):
        return isinstance(wanted, number) and isinstance(value, number) and wanted == value
    if isinstance(wanted, str) or isinstance(value, str):
        return isinstance(wanted, str) and isinstance(value, str) and wanted == value
    return bool(wanted == value)


async def exchange_views(
    settings: Settings, base: str, exchange: str
) -> dict[str, ExchangeView] | str:
    """``exchange`` and every exchange a publish to it may pass through (bound to it,
    its alternate), from the management API at ``base``; or why the API could not tell.
    An exchange that does not exist is left out (``reached`` says so)."""
    views: dict[str, ExchangeView] = {}
    todo = [exchange]
    try:
        while todo:
            name = todo.pop()
            if name in views:
                continue
            view = await asyncio.to_thread(_view, settings, base, name)
            if view is None:
                continue
            views[name] = view
            todo.extend(b.destination for b in view.bindings if b.to_exchange)
            if view.alternate is not None:
                todo.append(view.alternate)
    except (OSError, ValueError) as error:  # URLError and HTTPError are OSErrors
        return why(error)
    return views


def _view(settings: Settings, base: str, name: str) -> ExchangeView | None:
    path = f"{quote(settings.vhost, safe='')}/{quote(name, safe='')}"
    found = _get(settings, base, f"exchanges/{path}")
    if found is None:
        return None
    alternate = (found.get("arguments") or {}).get("alternate-exchange")
    policy = found.get("policy")
    if alternate is None and policy:
        definition = _get(settings, base, f"policies/{quote(settings.vhost, safe='')}/{policy}")
        alternate = ((definition or {}).get("definition") or {}).get("alternate-exchange")
    bindings = tuple(
        Binding(
            destination=str(row.get("destination")),
            to_exchange=row.get("destination_type") == "exchange",
            routing_key=str(row.get("routing_key", "")),
            arguments=row.get("arguments") or {},
        )
        for row in _get(settings, base, f"exchanges/{path}/bindings/source") or []
    )
    return ExchangeView(
        name=name,
        type=str(found.get("type")),
        internal=bool(found.get("internal")),
        alternate=alternate if isinstance(alternate, str) else None,
        bindings=bindings,
    )


def _get(settings: Settings, base: str, path: str) -> Any:
    """The JSON at ``base/api/path``; None for 404."""
    try:
        return api_get(settings, base, path)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


async def check_route(
    settings: Settings,
    exchange: str,
    routing_key: str,
    headers: Mapping[str, Any],
    *,
    management_url: str | None = None,
    first: str | None = None,
) -> None:
    """Check that a publish to ``exchange`` with ``routing_key`` (and ``headers``, for a
    headers exchange) reaches at least one queue, publishing nothing.

    The default exchange: a passive ``queue.declare`` of the routing key (over AMQP, at
    the node URL ``first`` if it answers). Any other: a passive ``exchange.declare``,
    then its bindings from the management API at ``management_url`` (comma-separated;
    default port 15672 of each URL's host, ``nodes.management_urls``).

    Raises:
        UnroutableTargetError: the exchange does not exist or is internal, the queue does
            not exist, or no binding takes the routing key.
        TargetCheckError: no management API answered, or an exchange on the way is of a
            type ``reached`` does not follow.
        BrokerUnavailableError: no broker answers.
    """
    target = f"exchange {exchange!r} with routing key {routing_key!r}"
    connection = await connect(settings, name="hopsched-check-target", first=first)
    async with connection:
        if not exchange:
            if not await exists(connection, lambda c: c.declare_queue(routing_key, passive=True)):
                raise UnroutableTargetError(
                    f"target: no queue {routing_key!r}, so the default exchange (which routes "
                    "by queue name) would not deliver to it; declare the queue or fix the "
                    "routing key"
                )
            return
        if not await exists(connection, lambda c: c.declare_exchange(exchange, passive=True)):
            raise UnroutableTargetError(
                f"target {target}: the exchange does not exist; declare it or fix the name"
            )
    problems = []
    for base in management_urls(settings, management_url):
        views = await exchange_views(settings, base, exchange)
        if isinstance(views, str):
            problems.append(f"{mask_url(base)}: {views}")
            continue
        view = views.get(exchange)
        if view is not None and view.internal:
            raise UnroutableTargetError(
                f"target {target}: the exchange is internal, publishers may not use it"
            )
        try:
            queues = reached(views, exchange, routing_key, headers)
        except CannotTell as error:
            raise TargetCheckError(
                f"cannot check target {target}: {error.reason}; schedule it without check_target"
            ) from None
        if not queues:
            raise UnroutableTargetError(
                f"target {target}: no binding routes it to a queue (nor an alternate "
                "exchange); bind a queue to the exchange for that key, or fix the key"
            )
        return
    raise TargetCheckError(
        f"cannot check target {target}: it needs the management API's bindings, and it "
        f"answers nowhere ({'; '.join(problems)}); give its URL (management_url, "
        "--management-url), or schedule without check_target"
    )
