"""One template for every user-facing error in tfdp.

Each message says what is wrong, what was received, and what is valid or how to fix it::

    invalid_argument("all_reduce", "rnig", valid=["auto", "nccl", "ring"])
    -> ValueError: Invalid all_reduce. Received: all_reduce='rnig'. Valid: 'auto', 'nccl', 'ring'.
"""

from __future__ import annotations

from typing import Iterable


class TfdpError(ValueError):
    """A user-facing tfdp error (a ValueError, so callers can catch either)."""


class UsageError(TfdpError):
    """A command-line usage error: printed as one line, exit code 2."""


def message(what: str, received: str, fix: str) -> str:
    """Format ``what is wrong. Received: ... . fix``."""
    what = what.rstrip(". ")
    fix = fix.strip()
    return f"{what}. Received: {received}. {fix}"


def invalid_argument(name: str, value, *, valid: Iterable | None = None,
                     fix: str | None = None, what: str | None = None,
                     cls: type = TfdpError) -> TfdpError:
    """Build an error for a bad argument value.

    Args:
      name: the argument's name, e.g. ``"all_reduce"``.
      value: the received value.
      valid: the valid choices, listed in the message.
      fix: a sentence telling how to fix it (used when ``valid`` is not given or in addition).
      what: what is wrong (default ``"Invalid <name>"``).
    """
    parts = []
    if valid is not None:
        parts.append("Valid: " + ", ".join(repr(v) for v in valid) + ".")
    if fix:
        parts.append(fix)
    return cls(message(what or f"Invalid {name}", f"{name}={value!r}", " ".join(parts)))
