"""Quiet by default, loud on request: TensorFlow's C++ log level for tfdp's commands.

TensorFlow prints its C++ INFO and WARNING lines (oneDNN, CPU features, gRPC server, coordination
service, "GeneratorDatasetOp ... will not be optimized") to stderr from the moment it loads. tfdp's
commands (``tfdp train``, ``tfdp launch``, ``tfdp bench``) hide them by default: errors and tfdp's
own log lines are never hidden. The user's own ``TF_CPP_MIN_LOG_LEVEL`` always wins, and
``--verbose`` shows everything. This is the one place that decides it.
"""

from __future__ import annotations

import os
from typing import MutableMapping

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LEVEL = "2"   # 0: all, 1: no INFO, 2: no INFO/WARNING (errors stay), 3: no ERROR either


def quiet_tensorflow(environ: MutableMapping[str, str] | None = None, *,
                     verbose: bool = False) -> str | None:
    """Set ``TF_CPP_MIN_LOG_LEVEL`` in ``environ`` (default ``os.environ``; a child process's
    environment for the launcher) unless the user set it or asked for ``verbose``. Must run before
    TensorFlow is imported in that process. Returns the level in effect (None: TF's default)."""
    environ = os.environ if environ is None else environ
    if environ.get(LEVEL_ENV, "").strip():
        return environ[LEVEL_ENV]
    if verbose:
        return None
    environ[LEVEL_ENV] = QUIET_LEVEL
    return QUIET_LEVEL


__all__ = ["LEVEL_ENV", "QUIET_LEVEL", "quiet_tensorflow"]
