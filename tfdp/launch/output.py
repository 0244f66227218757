"""Worker output under ``tfdp launch``: live or line by line, prefixed, filtered, logged.

Each worker pipe (stdout, stderr) has one reader thread (:func:`pump`) that

* appends the raw bytes to the worker's log file, if it has one (``worker-<rank>.log``: both
  streams, unfiltered, flushed at once so ``tail -f`` follows it),
* assembles lines for the worker's tail (shown when it fails) and its first peer-failure report
  (a ``tfdp: peer failure: ...`` line, see :mod:`tfdp.failures`),
* and, when the worker is shown on the terminal, forwards its output with the ``[worker i] ``
  prefix, either **live** (partial lines and ``\\r`` progress updates as they arrive, the prefix
  after every newline and carriage return: Keras's progress bar stays one updating line) or by
  **lines** (``--output all``: every worker, whole lines, as before).

TensorFlow prints a few C++ log lines before it applies ``TF_CPP_MIN_LOG_LEVEL`` (absl's
"All log messages before absl::InitializeLog() is called are written to STDERR" and the oneDNN
notice, once per library load). Lines in TensorFlow's C++ log format whose severity is below the
level in effect are therefore dropped from the terminal here (never from the log files); errors
and everything else pass.
"""

from __future__ import annotations

import codecs
import collections
import re
import threading
from typing import IO

from tfdp.failures import PEER_FAILURE_MARK

TAIL_LINES = 30  # lines of a failed worker's output shown on the terminal
_READ = 1 << 16
# TF/absl C++ log line: "I0000 00:00:1796122748.896802   11406 port.cc:153] ..."
_TF_LOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s:\]]+:\d+\] ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_PRELUDE = "WARNING: All log messages before absl::InitializeLog() is called are written"
_TF_LOG_START = re.compile(r"^[IWEF](?:\d{0,4}$|\d{4} )")
_NEWLINE = re.compile(r"(\r\n|\n|\r)")


def hidden_line(line: str, level: int | None) -> bool:
    """Whether a complete output line is a TensorFlow C++ log line below ``level`` (the
    ``TF_CPP_MIN_LOG_LEVEL`` in effect: 1 hides INFO, 2 also WARNING, 3 also ERROR)."""
    if not level:
        return False
    m = _TF_LOG.match(line)
    if m:
        return _SEVERITY[m.group(1)] < level
    return level >= 2 and line.startswith(_ABSL_PRELUDE)


def _may_become_hidden(partial: str) -> bool:
    """Whether an incomplete line could still turn into a TF C++ log line (held back until its
    newline instead of being forwarded live; TF writes each log line in one piece)."""
    return bool(_TF_LOG_START.match(partial) or _ABSL_PRELUDE.startswith(partial)
                or partial.startswith(_ABSL_PRELUDE))


def parse_level(value) -> int | None:
    """``TF_CPP_MIN_LOG_LEVEL`` as an int (None when unset or not a number)."""
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


class WorkerLog:
    """What one worker printed: its log file (optional), its last lines, its first peer-failure
    report. Shared by the worker's two pipe readers."""

    def __init__(self, path: str | None = None, tail: int = TAIL_LINES):
        self.path = path
        self.lock = threading.Lock()
        self.tail: collections.deque[str] = collections.deque(maxlen=tail)
        self.peer_report: str | None = None
        self._file = open(path, "ab", buffering=0) if path else None  # noqa: SIM115

    def write(self, data: bytes) -> None:
        with self.lock:
            if self._file is not None:
                try:
                    self._file.write(data)
                except (OSError, ValueError):
                    pass  # a full disk must not block the worker

    def note(self, text: str) -> None:
        """A launcher line in the log file (e.g. a restart)."""
        self.write(text.encode("utf-8", "replace"))

    def add_line(self, line: str) -> None:
        with self.lock:
            if line.startswith(PEER_FAILURE_MARK) and self.peer_report is None:
                self.peer_report = line[len(PEER_FAILURE_MARK):].strip()
            shown = line.rsplit("\r", 1)[-1]  # the last state of a \r-updated progress line
            self.tail.append(shown)

    def reset(self) -> None:
        """Forget the tail and the peer report (a restart); the log file goes on."""
        with self.lock:
            self.tail.clear()
            self.peer_report = None

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Terminal:
    """Writes to the launcher's streams, one write at a time across all workers."""

    def __init__(self):
        self.lock = threading.Lock()

    def write(self, stream: IO[str], text: str) -> None:
        if not text:
            return
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # closed or broken stream: don't let a worker block on a full pipe


class _Prefixer:
    """Inserts ``prefix`` at the start of every line and after every carriage return (so a
    ``\\r``-updated progress line keeps its prefix), across chunks."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.at_start = True

    def __call__(self, text: str) -> str:
        out = []
        for piece in _NEWLINE.split(text):
            if not piece:
                continue
            if piece in ("\n", "\r\n", "\r"):
                out.append(piece)
                self.at_start = True
                continue
            if self.at_start:
                out.append(self.prefix)
                self.at_start = False
            out.append(piece)
        return "".join(out)


def pump(pipe, log: WorkerLog, terminal: Terminal | None, stream: IO[str] | None, prefix: str,
         live: bool, level: int | None) -> None:
    """Read ``pipe`` until EOF; see the module docstring. ``stream`` None: log only."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    prefixer = _Prefixer(prefix)
    pending = ""   # the current, incomplete line
    sent = 0       # how much of ``pending`` was already forwarded (live mode)

    def show(text):
        if stream is not None and terminal is not None:
            terminal.write(stream, prefixer(text))

    def lines(text):
        nonlocal pending, sent
        pending += text
        *complete, pending = pending.split("\n")
        for i, line in enumerate(complete):
            log.add_line(line)
            done = sent if i == 0 else 0
            if done:  # its start was forwarded live already: finish it
                show(line[done:] + "\n")
            elif not hidden_line(line, level):
                show(line + "\n")
        if complete:
            sent = 0
        if live and pending and len(pending) > sent and (
                sent or not (level and _may_become_hidden(pending))):
            show(pending[sent:])
            sent = len(pending)

    unlogged = b""  # the log gets whole lines: stdout's and stderr's pumps share the file

    while True:
        try:
            data = pipe.read1(_READ)
        except (OSError, ValueError):
            break
        if not data:
            break
        unlogged += data
        cut = unlogged.rfind(b"\n") + 1
        if cut:
            log.write(unlogged[:cut])
            unlogged = unlogged[cut:]
        lines(decoder.decode(data))
    if unlogged:
        log.write(unlogged)
    lines(decoder.decode(b"", final=True))
    if pending:  # a last line without a newline
        log.add_line(pending)
        if sent:
            show(pending[sent:] + "\n")
        elif not hidden_line(pending, level):
            show(pending + "\n")
