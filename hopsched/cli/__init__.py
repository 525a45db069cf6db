"""The ``hopsched`` command (``commands``, click) and its helpers: header and duration
parsing (``arguments``, ``durations``), logging (``logs``), what ``schedule`` says
besides its result (``notes``) and the demo (``demo``).
"""
