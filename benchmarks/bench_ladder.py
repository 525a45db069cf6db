"""``--ladder`` for the benchmarks: which ladder hopsched runs with (issue 23, item 4).

A ladder is given as ``step_ratio=4,min_step_ms=16`` (any of ``step_ratio``,
``min_step_ms``, ``max_step_ms``; ``default`` or empty: the default ladder). The same text
reaches the Scheduler (as ``Settings`` fields) and a relay process (as the
``HOPSCHED_*`` variables it reads), so both run the one ladder.
"""

from __future__ import annotations

import hopsched

#: The ladder fields ``--ladder`` may set.
LADDER_FIELDS = ("step_ratio", "min_step_ms", "max_step_ms")


def parse_ladder(text: str) -> dict[str, int]:
    """``step_ratio=4,min_step_ms=16`` as Settings fields; ``default`` or '': none.

    Raises:
        ValueError: a field that is no ladder field or a value that is no integer; an
            invalid ladder (``InvalidSettingsError`` names the field and the fix).
    """
    fields: dict[str, int] = {}
    if text.strip() in ("", "default"):
        return fields
    for part in (part.strip() for part in text.split(",") if part.strip()):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in LADDER_FIELDS:
            raise ValueError(
                f"--ladder {text!r}: {part!r}: give NAME=VALUE, NAME one of "
                f"{', '.join(LADDER_FIELDS)}"
            )
        fields[name] = _integer(text, name, value.strip())
    hopsched.Ladder(**fields)  # refuses a ladder no Settings would take
    return fields


def _integer(text: str, name: str, value: str) -> int:
    """``1024``, ``1_024`` or ``2**10``."""
    base, power, exponent = value.partition("**")
    try:
        return int(base) ** int(exponent) if power else int(value)
    except ValueError:
        raise ValueError(f"--ladder {text!r}: {name}={value!r} is not an integer") from None


def ladder_name(fields: dict[str, int]) -> str:
    """A short label: ``default``, ``ratio4``, ``min1024``, ``ratio4-min1024``."""
    parts = []
    if fields.get("step_ratio", 2) != 2:
        parts.append(f"ratio{fields['step_ratio']}")
    if fields.get("min_step_ms", 16) != 16:
        parts.append(f"min{fields['min_step_ms']}")
    if fields.get("max_step_ms", 2**32) != 2**32:
        parts.append(f"max{fields['max_step_ms']}")
    return "-".join(parts) or "default"


_LABELS = {"ratio": "step_ratio", "min": "min_step_ms", "max": "max_step_ms"}


def parse_label(label: str) -> dict[str, int]:
    """The fields ``ladder_name`` labelled ``label`` (``ratio4-min1024``); ``default``:
    none.

    Raises:
        ValueError: not such a label.
    """
    fields: dict[str, int] = {}
    for part in label.split("-") if label != "default" else ():
        name = _LABELS.get(part.rstrip("0123456789"))
        number = part[len(part.rstrip("0123456789")) :]
        if name is None or not number:
            raise ValueError(f"ladder label {label!r}: parts are ratioN, minN, maxN")
        fields[name] = int(number)
    return fields


def ladder_environment(fields: dict[str, int]) -> dict[str, str]:
    """The ``HOPSCHED_*`` variables that give a relay process this ladder."""
    return {f"HOPSCHED_{name.upper()}": str(value) for name, value in fields.items()}
