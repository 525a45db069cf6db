"""Logging for the ``hopsched`` command: levels, text or JSON lines, passwords masked.

The library itself only logs (to ``hopsched.*`` loggers); the command configures this.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Literal, TextIO

from hopsched.urls import mask_url

__all__ = [
    "AMQP_LOGGERS",
    "JsonFormatter",
    "LogFormat",
    "MaskUrlFilter",
    "RaisedAnywayFilter",
    "configure_logging",
]

LogFormat = Literal["text", "json"]

#: The client libraries' loggers: frame-level lines at DEBUG, connection trouble at WARNING+.
AMQP_LOGGERS = ("aiormq", "aio_pika")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# An AMQP URL up to the next blank or quote; ``mask_url`` masks up to its last '@'.
_URL = re.compile(r"amqps?://[^\s'\"<>]+")


def _masked(text: str) -> str:
    return _URL.sub(lambda match: mask_url(match[0]), text)


class MaskUrlFilter(logging.Filter):
    """Replaces the password of every AMQP URL in a record's message and exception text
    by ``***`` (``hopsched.urls.mask_url``); lets every record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = _masked(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _masked(record.exc_text)
        if record.stack_info:
            record.stack_info = _masked(record.stack_info)
        return True


class RaisedAnywayFilter(logging.Filter):
    """Drops aiormq's "error when creating transport" line: aiormq logs it at ERROR and
    then raises the same error, which hopsched reports as a ``BrokerUnavailableError``
    naming the URL and what to check (the line came first, a second, rawer report of one
    cause). Takes the traceback off aiormq's "reader exited abnormally" warning: the
    broker's close it comes from is logged on the line before and raised to hopsched (a
    Ctrl-C during a channel close printed it). Lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "aiormq.connection" or not isinstance(record.msg, str):
            return True
        if record.msg.startswith("Cancelling cause reader exited abnormally"):
            record.exc_info = record.exc_text = None
        return not record.msg.startswith("error when creating transport")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC, ms), ``level``, ``logger``,
    ``message`` and, if the record has one, ``exception`` (the traceback text)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(
    verbosity: int = 0, log_format: LogFormat = "text", stream: TextIO | None = None
) -> None:
    """Send every log record to ``stream`` (default stderr), replacing the root handlers.

    Args:
        verbosity: 0: INFO and above; 1: hopsched's own DEBUG lines too; 2 or more:
            also aiormq's and aio-pika's frame-level DEBUG lines. Below 2 those two
            libraries log WARNING and above only, and not what ``RaisedAnywayFilter``
            drops.
        log_format: ``"text"`` (one line per record) or ``"json"`` (``JsonFormatter``).
        stream: where the lines go.

    Whatever the settings, every record passes ``MaskUrlFilter``: no AMQP password is
    written.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    )
    handler.addFilter(MaskUrlFilter())
    if verbosity < 2:
        handler.addFilter(RaisedAnywayFilter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    logging.getLogger("hopsched").setLevel(logging.DEBUG if verbosity >= 1 else logging.INFO)
    for name in AMQP_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
