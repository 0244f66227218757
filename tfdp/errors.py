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


class UnknownArgumentError(TfdpError, TypeError):
    """An unknown keyword argument (a TypeError, as Python raises for one, and a TfdpError)."""


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


def unknown_arguments(callable_name: str, received: dict, valid: Iterable[str], *,
                      hints: dict | None = None) -> UnknownArgumentError:
    """Build the error for unknown keyword arguments: names the valid ones and the likely intent.

    Args:
      callable_name: e.g. ``"DataParallelStrategy"``.
      received: the unknown keyword arguments (name -> value).
      valid: the valid keyword arguments.
      hints: name -> sentence for names whose intent is known (``num_replicas`` -> how replicas
        are chosen); other names get the closest valid name, if one is close.
    """
    import difflib
    valid = list(valid)
    names = ", ".join(f"{k}={v!r}" for k, v in received.items())
    intents = []
    for name, value in received.items():
        hint = (hints or {}).get(name)
        if hint is not None:
            intents.append(hint.format(value=value))
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        if close:
            intents.append(f"Did you mean {close[0]}={value!r}?")
    fix = "Valid: " + ", ".join(valid) + "." + "".join(" " + i for i in intents)
    plural = "s" if len(received) > 1 else ""
    return UnknownArgumentError(message(f"{callable_name} got unknown argument{plural}", names,
                                        fix))
