"""Fixtures for private RabbitMQ nodes, to crash and restart without touching the shared one.

The nodes are ``hopsched.localbroker.PrivateBroker`` (see that module for the recipe).

Fixtures (registered by ``conftest.py``):

* ``private_broker``: a node with the default configuration.
* ``start_private_broker``: ``await start_private_broker(config="consumer_timeout = 60000")``
  starts a node with extra ``rabbitmq.conf`` lines (and ``plugins=[...]`` enabled); every
  node started is killed and its directory removed when the test ends, passed or failed.

Where RabbitMQ is not installed the tests using them are skipped, with the reason,
except under ``CI=true``, where they fail: CI must not pass without running them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from hopsched.localbroker import DEBIAN_BIN_DIR, PrivateBroker, private_node, rabbitmq_bin_dir

__all__ = ["PrivateBroker", "private_broker", "require_rabbitmq", "start_private_broker"]


def require_rabbitmq() -> Path:
    """The directory of ``rabbitmq-server``; skips the test if there is none (fails it
    under ``CI=true``)."""
    bin_dir = rabbitmq_bin_dir()
    if bin_dir is not None:
        return bin_dir
    reason = (
        f"RabbitMQ is not installed (no rabbitmq-server in HOPSCHED_RABBITMQ_BIN, "
        f"{DEBIAN_BIN_DIR} or PATH): the private-node fault tests need it"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run them", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
async def start_private_broker() -> AsyncIterator[Callable[..., Awaitable[PrivateBroker]]]:
    """``await start_private_broker(config="", plugins=())``: a started private node (see
    module doc)."""
    bin_dir = require_rabbitmq()
    async with contextlib.AsyncExitStack() as nodes:

        async def start(config: str = "", plugins: Sequence[str] = ()) -> PrivateBroker:
            return await nodes.enter_async_context(
                private_node(config, plugins=plugins, bin_dir=bin_dir)
            )

        yield start


@pytest.fixture
async def private_broker(
    start_private_broker: Callable[..., Awaitable[PrivateBroker]],
) -> PrivateBroker:
    """A private node with the default configuration, started."""
    return await start_private_broker()
