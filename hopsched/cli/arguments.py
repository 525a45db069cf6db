"""The command line's typed header values: ``--header K=V`` or ``--header K:TYPE=V``.

Pure: each parses to the Python value ``schedule()`` sends with its AMQP type
(``validate.check_headers`` then checks it as for any caller).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["HEADER_TYPES", "parse_header"]

_TRUE, _FALSE = frozenset({"true", "yes", "1"}), frozenset({"false", "no", "0"})


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("write true or false")


def _decimal(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError("write a decimal number, e.g. 19.99") from None
    if not value.is_finite():
        raise ValueError("write a finite decimal number")
    return value


def _datetime(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("add a UTC offset, e.g. 2030-01-01T09:00:00Z")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("write a whole number, e.g. 3") from None


def _json(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{error}; e.g. '{{\"a\": [1]}}'") from None
    if not isinstance(value, dict | list):
        kind = {bool: "a boolean", str: "a string", type(None): "null"}.get(type(value), "a number")
        raise ValueError(f"that is {kind}; for a lone value use the type int, float, bool or str")
    return value


def _float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("write a finite number")
    return value


#: Each type a header may be given as, and what it becomes: ``str`` (the default),
#: ``int`` (AMQP signed 64-bit), ``float`` (AMQP sends 32 bits: about 7 digits),
#: ``decimal`` (AMQP decimal, exact), ``bool``, ``datetime`` (AMQP timestamp, whole
#: seconds; ISO 8601 with an offset), ``json`` (a table or an array).
HEADER_TYPES: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": _int,
    "float": _float,
    "decimal": _decimal,
    "bool": _bool,
    "datetime": _datetime,
    "json": _json,
}


#: What a value of each type is called in an error ("not an int").
_NAMES = {"int": "an int", "json": "a JSON table or array"}


def parse_header(item: str) -> tuple[str, Any]:
    """``"n:int=5"`` → ``("n", 5)``; ``"k=v"`` → ``("k", "v")``. The type is what follows
    the key's last ``:``; a key holding ``:`` names its type, e.g. ``"a:b:str=c"``.

    Raises:
        ValueError: no ``=``, an empty key, an unknown type, or a value its type refuses;
            the message says which and how to write it.
    """
    name, sep, text = item.partition("=")
    if not sep or not name:
        raise ValueError(f"{item!r}: write K=V, or K:TYPE=V (TYPE: {', '.join(HEADER_TYPES)})")
    key, colon, kind = name.rpartition(":")
    if not colon:
        key, kind = name, "str"
    if kind not in HEADER_TYPES:
        raise ValueError(
            f"{item!r}: unknown header type {kind!r}; use one of {', '.join(HEADER_TYPES)} "
            f"(a key holding ':' names its type, e.g. '{name}:str={text}')"
        )
    if not key:
        raise ValueError(f"{item!r}: the header's key is empty")
    try:
        return key, HEADER_TYPES[kind](text)
    except ValueError as error:
        raise ValueError(f"{item!r}: not {_NAMES.get(kind, 'a ' + kind)} ({error})") from None
