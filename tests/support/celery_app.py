"""The Celery app ``tests/broker/test_celery.py`` runs real workers of
(``celery -A support.celery_app worker``) and sends tasks with: configured by
``HOPSCHED_TEST_CELERY`` (JSON: broker URL, hopsched prefix, names carrying the run's
marker, the file runs are written to).
Each task appends one JSON line per run: task id, args, kwargs, what its request
carried and the instant it ran (µs since the epoch)."""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

import hopsched
from hopsched.core.clock import now_us
from hopsched.integrations import celery as hopsched_celery


def make_app(config: dict[str, Any]) -> Celery:
    """The app of ``config`` (see the module's docstring), hopsched installed, with two
    tasks: ``record`` and ``retrying`` (which retries once with a 1 s countdown)."""
    queue, other = config["queue"], config["other_queue"]
    app = Celery(config["app"], broker=config["url"], set_as_current=False)
    app.conf.update(
        task_queues=[
            Queue(queue, Exchange(queue), routing_key=queue, queue_arguments={"x-max-priority": 9}),
            Queue(other, Exchange(other), routing_key=other),
        ],
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
        task_create_missing_queues=False,
        event_exchange=config["events"],
        control_exchange=config["control"],
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_prefetch_multiplier=100,
        broker_connection_retry_on_startup=True,
    )
    hopsched_celery.install(app, hopsched.Settings(url=config["url"], prefix=config["prefix"]))

    def write(request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        line = {
            "id": request.id,
            "args": list(args),
            "kwargs": kwargs,
            "eta": request.eta,
            "retries": request.retries,
            "tenant": getattr(request, "tenant", None),
            "priority": request.delivery_info.get("priority"),
            "routing_key": request.delivery_info.get("routing_key"),
            "at_us": now_us(),
        }
        with open(config["runs"], "a") as runs:
            runs.write(json.dumps(line) + "\n")

    @app.task(bind=True, name=config["record"], shared=False)
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        write(self.request, args, kwargs)

    @app.task(bind=True, name=config["retrying"], max_retries=3, shared=False)
    def retrying(self: Any, *args: Any) -> None:
        write(self.request, args, {})
        if self.request.retries == 0:
            raise self.retry(countdown=1.0)

    return app


if "HOPSCHED_TEST_CELERY" in os.environ:  # in the worker: celery -A support.celery_app worker
    app = make_app(json.loads(os.environ["HOPSCHED_TEST_CELERY"]))
