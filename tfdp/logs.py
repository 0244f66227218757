"""Quiet by default, loud on request: TensorFlow's C++ log lines, decided in one place.

TensorFlow prints its C++ INFO and WARNING lines (oneDNN, CPU features, gRPC server, coordination
service, "GeneratorDatasetOp ... will not be optimized") to stderr from the moment it loads. tfdp's
commands (``tfdp train``, ``tfdp launch``, ``tfdp bench``) hide them by default: errors and tfdp's
own log lines are never hidden. The user's own ``TF_CPP_MIN_LOG_LEVEL`` always wins, and
``--verbose`` shows everything (:func:`quiet_tensorflow`).

``TF_CPP_MIN_LOG_LEVEL`` filters TF's lines once absl logging is initialised. TF 2.21 prints two
lines per shared library *before* that, at ``import tensorflow``, whatever the level::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. You may see slightly ...

(measured: twice each, with ``TF_CPP_MIN_LOG_LEVEL`` 2 or 3). :func:`import_tensorflow` imports
TensorFlow with those filtered by the level in effect (``I...`` at level >= 1, ``W...`` and the
"before absl::InitializeLog()" notice at >= 2); errors (``E``/``F`` lines), Python warnings and
tracebacks are written back unchanged.

In a user's own script (no tfdp command to set the level), :func:`dropping_generator_notice`
keeps out the one INFO line that tfdp's input path makes TensorFlow print and plain Keras does
not: a distributed iterator's per-replica generator datasets make TF log "Memory patch applied:
M_TRIM_THRESHOLD=128 kb was set" once per process (generator_dataset_op.cc), the first time a
generator dataset's iterator is made; tfdp makes its first one with that line filtered out.

Both filter through :func:`filtered_stderr`: the process's stderr (file descriptor 2, where TF's
C++ logs go) captured while a block runs, then every line the filter keeps written back.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
from typing import Callable, Iterator, MutableMapping

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


@contextlib.contextmanager
def filtered_stderr(keep: Callable[[bytes], bool]) -> Iterator[None]:
    """Run the block with the process's stderr (fd 2) captured, then write back every captured
    line for which ``keep(line)`` is true, in order. Without a file descriptor 2 to redirect, the
    block runs unfiltered."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            data = b"".join(ln for ln in captured.read().splitlines(keepends=True) if keep(ln))
            while data:
                data = data[os.write(2, data):]


# --- TensorFlow's load-time lines ------------------------------------------------------------------

_ABSL_LINE = re.compile(rb"^([IWEF])\d{4} ")
_BEFORE_INIT = b"WARNING: All log messages before absl::InitializeLog() is called"


def _hidden(line: bytes, level: int) -> bool:
    if line.startswith(_BEFORE_INIT):
        return level >= 2
    m = _ABSL_LINE.match(line)
    if not m:
        return False
    return {b"I": level >= 1, b"W": level >= 2, b"E": level >= 3, b"F": False}[m.group(1)]


def level_in_effect(environ=None) -> int:
    """``TF_CPP_MIN_LOG_LEVEL`` as a number (unset or not a number: 0)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get(LEVEL_ENV, "0").strip() or 0)
    except ValueError:
        return 0


@contextlib.contextmanager
def _lines_hidden_by_level(environ=None) -> Iterator[None]:
    level = level_in_effect(environ)
    if level <= 0:
        yield
        return
    with filtered_stderr(lambda line: not _hidden(line, level)):
        yield


@contextlib.contextmanager
def load_lines_filtered(environ=None) -> Iterator[None]:
    """While the block runs (TensorFlow being imported), hide the absl INFO/WARNING lines the log
    level in effect hides (nothing is filtered at level 0 or when TensorFlow was already
    imported)."""
    if "tensorflow" in sys.modules:
        yield
        return
    with _lines_hidden_by_level(environ):
        yield


class _FilteringLoader(importlib.abc.Loader):
    """TensorFlow's own loader, its ``exec_module`` run with the load-time lines filtered."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with _lines_hidden_by_level():
            self._loader.exec_module(module)

    def __getattr__(self, name):          # get_resource_reader, get_source, ...
        return getattr(self._loader, name)


class _FilteredTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` once, as the path would, and wraps its loader (then leaves)."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        _remove_finder()
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _FilteringLoader(spec.loader)
        return spec


def _remove_finder():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FilteredTensorFlowImport)]


def filter_tensorflow_import() -> bool:
    """Filter TensorFlow's load-time lines (as :func:`import_tensorflow` does) whenever this
    process imports it, for processes where someone else's code imports it (Ray's workers:
    ``tfdp.ray.runtime_env``). The level is read at that import; level 0 or unset filters
    nothing. False when TensorFlow is already imported (too late to filter)."""
    if "tensorflow" in sys.modules:
        return False
    _remove_finder()
    sys.meta_path.insert(0, _FilteredTensorFlowImport())
    return True


def import_tensorflow(environ=None) -> None:
    """``import tensorflow`` (and keras) with the load-time lines filtered by the log level in
    effect (``TF_CPP_MIN_LOG_LEVEL``; unset or 0: nothing is filtered)."""
    with load_lines_filtered(environ):
        import tensorflow  # noqa: F401
        import keras  # noqa: F401


# --- the line tfdp's input path makes TensorFlow print ------------------------------------------

#: TF's one-time C++ INFO line when the process's first generator dataset iterator is made.
GENERATOR_NOTICE = ("generator_dataset_op.cc", "Memory patch applied")


def dropping_cpp_lines(*markers: str):
    """:func:`filtered_stderr` dropping the lines that contain all of ``markers``. Nothing is
    dropped when the user set ``TF_CPP_MIN_LOG_LEVEL`` (their choice of what TF logs stands)."""
    if os.environ.get(LEVEL_ENV, "").strip() or not markers:
        return contextlib.nullcontext()
    wanted = [m.encode() for m in markers]
    return filtered_stderr(lambda line: not all(m in line for m in wanted))


def dropping_generator_notice():
    """:func:`dropping_cpp_lines` for TF's "Memory patch applied" generator-dataset line."""
    return dropping_cpp_lines(*GENERATOR_NOTICE)


__all__ = ["GENERATOR_NOTICE", "LEVEL_ENV", "QUIET_LEVEL", "dropping_cpp_lines",
           "dropping_generator_notice", "filtered_stderr", "import_tensorflow",
           "load_lines_filtered", "quiet_tensorflow"]
