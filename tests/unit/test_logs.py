"""``hopsched.cli.logs``: levels per verbosity, text and JSON lines, AMQP passwords masked."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime

import pytest

from hopsched.cli.logs import AMQP_LOGGERS, configure_logging

SECRET = "s3cretPW"
URL = f"amqp://guest:{SECRET}@127.0.0.1:5672/"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Where ``configure_logging`` writes; the logging setup is restored afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    names = ["hopsched", *AMQP_LOGGERS]
    saved_levels = {name: logging.getLogger(name).level for name in names}
    yield io.StringIO()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in saved_handlers:
        root.addHandler(handler)
    root.setLevel(saved_level)
    for name, level in saved_levels.items():
        logging.getLogger(name).setLevel(level)


def log_one_of_each() -> None:
    logging.getLogger("hopsched.relay").debug("hopsched debug")
    logging.getLogger("hopsched.relay").info("hopsched info")
    logging.getLogger("aiormq.connection").debug("frame debug")
    logging.getLogger("aio_pika.channel").info("aio-pika info")
    logging.getLogger("aiormq.connection").warning("lost %s", URL)
    try:
        raise ConnectionError(f"cannot reach {URL}")
    except ConnectionError:
        logging.getLogger("aio_pika.robust_connection").exception("reconnecting to %r", URL)


@pytest.mark.parametrize(
    ("verbosity", "shown"),
    [
        pytest.param(0, {"hopsched info", "lost", "reconnecting"}, id="default"),
        pytest.param(1, {"hopsched debug", "hopsched info", "lost", "reconnecting"}, id="-v"),
        pytest.param(
            2,
            {"hopsched debug", "hopsched info", "frame debug", "aio-pika info", "lost"}
            | {"reconnecting"},
            id="-vv",
        ),
    ],
)
def test_each_verbosity_shows_its_lines(
    stream: io.StringIO, verbosity: int, shown: set[str]
) -> None:
    configure_logging(verbosity, "text", stream)

    log_one_of_each()

    text = stream.getvalue()
    every = {"hopsched debug", "hopsched info", "frame debug", "aio-pika info", "lost"}
    assert {line for line in every | {"reconnecting"} if line in text} == shown


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_amqp_passwords_are_masked_in_messages_and_tracebacks(
    stream: io.StringIO, log_format: str
) -> None:
    configure_logging(0, log_format, stream)  # type: ignore[arg-type]

    log_one_of_each()

    text = stream.getvalue()
    assert SECRET not in text
    assert text.count("amqp://guest:***@127.0.0.1:5672/") >= 3  # message, repr, traceback


def test_json_lines_parse_with_time_level_logger_message_and_exception(
    stream: io.StringIO,
) -> None:
    configure_logging(1, "json", stream)

    log_one_of_each()

    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["level"], line["logger"]) for line in lines] == [
        ("DEBUG", "hopsched.relay"),
        ("INFO", "hopsched.relay"),
        ("WARNING", "aiormq.connection"),
        ("ERROR", "aio_pika.robust_connection"),
    ]
    assert lines[0]["message"] == "hopsched debug"
    assert "exception" not in lines[0]
    assert "ConnectionError: cannot reach amqp://guest:***@" in lines[-1]["exception"]
    for line in lines:
        assert line["time"].endswith("Z")
        assert datetime.fromisoformat(line["time"]).utcoffset().total_seconds() == 0


def log_the_reader_warning() -> None:
    """aiormq's warning as it logs it: with the reader's exception."""
    try:
        raise ConnectionError("CHANNEL_ERROR - expected 'channel.open'")
    except ConnectionError:
        logging.getLogger("aiormq.connection").warning(
            "Cancelling cause reader exited abnormally", exc_info=True
        )


def test_aiormq_s_reader_warning_comes_without_its_traceback(stream: io.StringIO) -> None:
    """The broker's close is on the line before it, and hopsched reports it; its
    traceback (seen after a Ctrl-C of ``hopsched demo``) only alarmed. ``-vv`` keeps it."""
    configure_logging(0, "text", stream)
    log_the_reader_warning()
    text = stream.getvalue()
    assert "Cancelling cause reader exited abnormally" in text
    assert "Traceback" not in text

    configure_logging(2, "text", stream)
    log_the_reader_warning()
    assert "Traceback" in stream.getvalue()
