"""A CronJob schedule checked as Kubernetes reads it, before a manifest exists.

Five fields (minute hour day-of-month month day-of-week), each `*` or a comma list of values,
ranges `a-b` and steps `*/n` / `a-b/n` / `a/n` within the field's bounds (months and weekdays
also by name, JAN / SUN), or one of the macros @yearly, @annually, @monthly, @weekly, @daily,
@midnight, @hourly. A time zone belongs in the CronJob's timeZone field, so CRON_TZ= / TZ= in
the schedule is refused, as Kubernetes refuses it.
"""

from __future__ import annotations

import re

MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
# (name, lowest, highest, names from `lowest` on)
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
_TERM = re.compile(r"^(?P<range>\*|\??|[0-9A-Za-z]+(-[0-9A-Za-z]+)?)(/(?P<step>[0-9]+))?$")


def _value(text: str, low: int, high: int, names: tuple[str, ...]) -> int | None:
    if text.isdigit():
        n = int(text)
    elif text.upper() in names:
        n = low + names.index(text.upper())
    else:
        return None
    return n if low <= n <= high else None


def _term_ok(term: str, low: int, high: int, names: tuple[str, ...]) -> bool:
    match = _TERM.match(term)
    if not match or not match.group("range"):
        return False
    step = match.group("step")
    if step is not None and int(step) == 0:
        return False
    if match.group("range") in ("*", "?"):
        return True
    first, _, last = match.group("range").partition("-")
    a = _value(first, low, high, names)
    b = a if not last else _value(last, low, high, names)
    return a is not None and b is not None and a <= b


def check_schedule(schedule: str) -> str:
    """``schedule`` unchanged when Kubernetes would run it; ValueError naming the bad field."""
    text = " ".join(schedule.split())
    example = "write five fields, e.g. '0 3 * * *' (03:00 daily), or a macro such as @daily"
    if text.startswith(("CRON_TZ=", "TZ=")):
        raise ValueError(f"'{schedule}': a time zone in the schedule is refused by Kubernetes; {example}")
    if text.startswith("@"):
        if text in MACROS:
            return text
        raise ValueError(f"'{schedule}' is not a cron macro (one of {', '.join(MACROS)}); {example}")
    fields = text.split(" ")
    if len(fields) != len(_FIELDS):
        raise ValueError(f"'{schedule}' has {len(fields)} fields, a cron schedule has 5; {example}")
    for value, (field, low, high, names) in zip(fields, _FIELDS, strict=True):
        if not all(_term_ok(term, low, high, names) for term in value.split(",")):
            raise ValueError(f"'{schedule}': {field} '{value}' is not a cron field ({low}-{high}, *, a-b, */n, lists); {example}")
    return text
