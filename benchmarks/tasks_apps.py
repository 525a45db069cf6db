"""The task apps ``tasks.py`` measures: one Celery app or Dramatiq broker per way, made
the same in the producer (``tasks.py``) and in the worker it runs as a subprocess
(``celery -A tasks_apps worker``, ``dramatiq tasks_apps:broker``), configured by the JSON in
``HOPSCHED_BENCH_TASKS``: the way, the broker URL, hopsched's prefix, the queue and the
file the task body appends its runs to. The body's first act is to read the clock: one
line ``TASK_ID AT_US`` per run (µs since the epoch).

Ways (``WAYS``): ``celery-eta`` (Celery's ETA on a classic queue: the worker holds the
task in memory until due; ``celery-eta-unlimited``: the same with
``worker_prefetch_multiplier = 0``, no prefetch limit), ``celery-native`` (Celery
5.5+'s native delayed delivery: a quorum queue on a topic exchange, the task cycles
through the ``celery_delayed_*`` quorum queues), ``dramatiq`` (``delay``: the worker
holds ``.DQ`` messages in memory), and each but the unlimited one ``+hopsched``
(``hopsched.integrations``, a relay on the prefix).
"""

from __future__ import annotations

import json
import os
from typing import Any

from hopsched.core.clock import now_us

#: way -> (framework, queue kind, through hopsched)
WAYS: dict[str, tuple[str, str, bool]] = {
    "celery-eta": ("celery", "classic", False),
    "celery-eta+hopsched": ("celery", "classic", True),
    "celery-eta-unlimited": ("celery", "classic", False),
    "celery-native": ("celery", "quorum", False),
    "celery-native+hopsched": ("celery", "quorum", True),
    "dramatiq": ("dramatiq", "classic", False),
    "dramatiq+hopsched": ("dramatiq", "classic", True),
}
ENV = "HOPSCHED_BENCH_TASKS"


def _recorder(runs_path: str) -> Any:
    def write(task_id: str, at_us: int) -> None:
        with open(runs_path, "a") as runs:
            runs.write(f"{task_id} {at_us}\n")

    return write


def make_celery(config: dict[str, Any]) -> tuple[Any, Any]:
    """The Celery app of ``config`` and its task ``record``."""
    from celery import Celery
    from kombu import Exchange, Queue

    import hopsched
    from hopsched.integrations import celery as hopsched_celery

    _, kind, through_hopsched = WAYS[config["way"]]
    name = config["queue"]
    app = Celery(f"bench-{name}", broker=config["url"], set_as_current=False)
    if kind == "quorum":  # native delayed delivery needs a topic (or fanout) exchange
        queue = Queue(
            name, Exchange(name, type="topic"), routing_key=name,
            queue_arguments={"x-queue-type": "quorum"},
        )  # fmt: skip
    else:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    app.conf.update(
        task_queues=[queue],
        task_default_queue=name,
        task_default_exchange=name,
        task_default_routing_key=name,
        task_create_missing_queues=False,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        broker_native_delayed_delivery_queue_type="quorum",
        enable_utc=True,
        # celery-eta-unlimited: no prefetch limit (0), so the worker takes every ETA task
        # at once; by default it takes them a few per second (the prefetch grows by one
        # per ETA task it has seen, a few per event-loop turn)
        worker_prefetch_multiplier=0 if config["way"] == "celery-eta-unlimited" else 4,
    )
    if through_hopsched:
        hopsched_celery.install(app, hopsched.Settings(url=config["url"], prefix=config["prefix"]))
    write = _recorder(config["runs"])

    @app.task(bind=True, name="bench.record", shared=False)
    def record(self: Any) -> None:
        write(self.request.id, now_us())

    return app, record


def make_dramatiq(config: dict[str, Any]) -> tuple[Any, Any]:
    """The Dramatiq broker of ``config`` and its actor ``record``."""
    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.middleware import CurrentMessage

    import hopsched
    from hopsched.integrations.dramatiq import HopschedBroker

    _, _, through_hopsched = WAYS[config["way"]]
    url = config["url"]
    if through_hopsched:
        settings = hopsched.Settings(url=url, prefix=config["prefix"])
        made: RabbitmqBroker = HopschedBroker(url=url, hopsched_settings=settings)
    else:
        made = RabbitmqBroker(url=url)
    made.add_middleware(CurrentMessage())
    write = _recorder(config["runs"])

    def record() -> None:
        at = now_us()
        message = CurrentMessage.get_current_message()
        write(message.message_id if message is not None else "?", at)

    actor = dramatiq.actor(
        record, broker=made, queue_name=config["queue"], actor_name="record", max_retries=0
    )
    return made, actor


if ENV in os.environ:  # in a worker: celery -A tasks_apps worker / dramatiq tasks_apps
    _config = json.loads(os.environ[ENV])
    if WAYS[_config["way"]][0] == "celery":
        app, _ = make_celery(_config)
    else:
        import dramatiq

        broker, _ = make_dramatiq(_config)
        dramatiq.set_broker(broker)  # never Dramatiq's default broker (localhost:5672)
