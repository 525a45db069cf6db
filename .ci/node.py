"""CI: a private RabbitMQ node for a test tier, until stopped.

    .venv/bin/python .ci/node.py ENV_FILE

Starts a private node (``hopsched.testing.localbroker``: ``HOPSCHED_RABBITMQ_ROOT`` picks the
installation) with the management plugin and as many file descriptors as allowed, writes
``export HOPSCHED_TEST_URL=...`` and ``export HOPSCHED_TEST_RABBITMQCTL=...`` lines that
reach it into ENV_FILE (for ``source``), and runs until SIGTERM or SIGINT; then the node
is killed and its directory removed.
"""

from __future__ import annotations

import asyncio
import resource
import shlex
import signal
import sys
from pathlib import Path

from hopsched.testing.localbroker import PrivateBroker, private_node

#: Enough for every quorum queue the tests declare at once (RabbitMQ 3.10 counts ~3 each).
WANTED_FDS = 65_536


def write_env(env_file: Path, node: PrivateBroker) -> None:
    rabbitmqctl = shlex.join(node.rabbitmqctl_command)
    env_file.write_text(
        f"export HOPSCHED_TEST_URL={shlex.quote(node.url)}\n"
        f"export HOPSCHED_TEST_RABBITMQCTL={shlex.quote(rabbitmqctl)}\n"
    )


async def main(env_file: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_FDS if hard == resource.RLIM_INFINITY else min(WANTED_FDS, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))  # the node inherits
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with private_node(management=True) as node:
        write_env(env_file, node)
        print(
            f"node {node.node}: RabbitMQ {node.installation.version} on {node.url}, "
            f"management {node.management_url}, in {node.root}",
            flush=True,
        )
        await stop.wait()
    print(f"node {node.node} stopped and removed", flush=True)


if __name__ == "__main__":
    env = Path(sys.argv[1])
    try:
        asyncio.run(main(env))
    finally:
        env.unlink(missing_ok=True)  # it named a node that is gone
