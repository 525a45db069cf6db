"""The two streams a prefix keeps: the schedule journal (``records``: records, codec,
the public ``ScheduleInfo`` and the fold; ``stream``: writing and reading
``{prefix}.journal``; ``backlog`` and ``retry``: a Scheduler's records whose write
failed, written again) and the cancel stream (``cancels``: reading ``{prefix}.cancelled``).
"""
