"""Task-framework integrations: Celery (``hopsched[celery]``), Dramatiq
(``hopsched[dramatiq]``), the synchronous scheduler both use (``sync``), and Taskiq
(``hopsched[taskiq]``, asyncio: the ``Scheduler`` itself)."""
