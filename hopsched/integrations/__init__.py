"""Task-framework integrations: Celery (``hopsched[celery]``) and Dramatiq
(``hopsched[dramatiq]``), and the synchronous scheduler both use (``sync``)."""
