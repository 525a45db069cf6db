"""Broker URLs as text: a comma-separated list split into node URLs, and any password
masked for logs, errors, metrics and output. Pure; at the bottom of the package (the
transport, ``hopsched.amqp``, masks with it too)."""

from __future__ import annotations

import re

__all__ = ["mask_url", "split_urls"]

# Several node URLs: split at a comma only where the next URL starts, so that an
# unencoded comma inside a password does not split it.
_URL_SEPARATOR = re.compile(r"\s*,\s*(?=amqps?://)")


def split_urls(url: str) -> list[str]:
    """The node URLs in a comma-separated ``url`` (one URL gives a list of one).

    A comma separates two URLs only where ``amqp://`` or ``amqps://`` follows it.
    """
    return [part for part in _URL_SEPARATOR.split(url.strip()) if part]


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and output); a
    comma-separated list of URLs has each one masked.

    Works on the raw text, not a URL parser: the user info is everything between
    ``://`` and the last ``@``, so a password holding unencoded ``/``, ``#`` or ``?``
    is masked too.
    """
    parts = split_urls(url)
    if len(parts) > 1:
        return ",".join(_mask_one(part) for part in parts)
    return _mask_one(url)


def _mask_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not sep:  # malformed (e.g. no scheme): mask everything from the first ':' to the '@'
        head, at, hostpart = url.rpartition("@")
        if not at or ":" not in head:
            return url
        return f"{head.split(':', 1)[0]}:***@{hostpart}"
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostpart}"
