"""Keras's own file-writing callbacks across workers (stub: filled in by the callbacks work).

``install(strategy)`` is called by every multi-worker tfdp strategy when it is created.
"""

from __future__ import annotations


def install(strategy) -> None:
    """Make Keras's file-writing callbacks safe under ``strategy`` (idempotent)."""
    del strategy


__all__ = ["install"]
