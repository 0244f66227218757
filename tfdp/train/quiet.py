"""The lines TensorFlow prints while it loads, before its log level applies.

``TF_CPP_MIN_LOG_LEVEL`` (decided by :func:`tfdp.logs.quiet_tensorflow`) filters TensorFlow's
C++ log lines once absl logging is initialised. TF 2.21 prints two lines per shared library
*before* that, at ``import tensorflow``, whatever the level::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. You may see slightly ...

(measured: twice each, with ``TF_CPP_MIN_LOG_LEVEL`` 2 or 3). :func:`import_tensorflow` imports
TensorFlow with the process's stderr captured and writes back every captured line except the
absl INFO/WARNING lines the level in effect hides (``I...`` at level >= 1, ``W...`` and the
"before absl::InitializeLog()" notice at >= 2). Errors (``E``/``F`` lines), Python warnings and
tracebacks are written back unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

from tfdp.logs import LEVEL_ENV

_ABSL_LINE = re.compile(r"^([IWEF])\d{4} ")
_BEFORE_INIT = "WARNING: All log messages before absl::InitializeLog() is called"


def _hidden(line: str, level: int) -> bool:
    if line.startswith(_BEFORE_INIT):
        return level >= 2
    m = _ABSL_LINE.match(line)
    if not m:
        return False
    return {"I": level >= 1, "W": level >= 2, "E": level >= 3, "F": False}[m.group(1)]


@contextlib.contextmanager
def load_lines_filtered(environ=None):
    """Capture the process's stderr (fd 2) while the block runs, then write back every line
    except the absl INFO/WARNING lines the log level in effect hides (nothing is filtered at
    level 0 or when TensorFlow was already imported)."""
    environ = os.environ if environ is None else environ
    try:
        level = int(environ.get(LEVEL_ENV, "0").strip() or 0)
    except ValueError:
        level = 0
    if level <= 0 or "tensorflow" in sys.modules:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            kept = [ln for ln in text.splitlines(keepends=True) if not _hidden(ln, level)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def import_tensorflow(environ=None) -> None:
    """``import tensorflow`` (and keras) with the load-time lines filtered by the log level in
    effect (``TF_CPP_MIN_LOG_LEVEL``; unset or 0: nothing is filtered)."""
    with load_lines_filtered(environ):
        import tensorflow  # noqa: F401
        import keras  # noqa: F401
