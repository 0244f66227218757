"""Quiet by default, loud on request: TensorFlow's C++ log level for tfdp's commands.

TensorFlow prints its C++ INFO and WARNING lines (oneDNN, CPU features, gRPC server, coordination
service, "GeneratorDatasetOp ... will not be optimized") to stderr from the moment it loads. tfdp's
commands (``tfdp train``, ``tfdp launch``, ``tfdp bench``) hide them by default: errors and tfdp's
own log lines are never hidden. The user's own ``TF_CPP_MIN_LOG_LEVEL`` always wins, and
``--verbose`` shows everything. This is the one place that decides it.

In a user's own script (no tfdp command to set the level), :func:`dropping_cpp_lines` keeps out
the one INFO line that tfdp's input path makes TensorFlow print and plain Keras does not: a
distributed iterator's per-replica generator datasets make TF log "Memory patch applied:
M_TRIM_THRESHOLD=128 kb was set" once per process (generator_dataset_op.cc), the first time a
generator dataset's iterator is made. The first such iterator tfdp makes is made with that one
line filtered out of the process's stderr; everything else written meanwhile is passed on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator, MutableMapping

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


#: TF's one-time C++ INFO line when the process's first generator dataset iterator is made.
GENERATOR_NOTICE = "generator_dataset_op.cc"
_GENERATOR_NOTICE_TEXT = "Memory patch applied"


@contextlib.contextmanager
def dropping_cpp_lines(*markers: str) -> Iterator[None]:
    """Run the block with the process's stderr (file descriptor 2, where TF's C++ logs go)
    captured; then write back every captured line except those containing all of ``markers``.
    Nothing is dropped when the user set ``TF_CPP_MIN_LOG_LEVEL`` (their choice of what TF logs
    stands) or when stderr cannot be redirected (no file descriptor 2)."""
    if os.environ.get(LEVEL_ENV, "").strip() or not markers:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True)
                    if not all(m.encode() in line for m in markers)]
            data = b"".join(kept)
            while data:
                data = data[os.write(2, data):]


def dropping_generator_notice():
    """:func:`dropping_cpp_lines` for TF's "Memory patch applied" generator-dataset line."""
    return dropping_cpp_lines(GENERATOR_NOTICE, _GENERATOR_NOTICE_TEXT)


__all__ = ["GENERATOR_NOTICE", "LEVEL_ENV", "QUIET_LEVEL", "dropping_cpp_lines",
           "dropping_generator_notice", "quiet_tensorflow"]
