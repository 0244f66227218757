"""Peer failures across workers: detection settings and the one-line messages naming a lost worker.

A dead or stuck worker must end the job promptly, also without the launcher (two real hosts). This
module holds the settings (``heartbeat_timeout`` / ``collective_timeout``), the translation of
TF's deep gRPC errors into one line naming the worker and its address, the ``sys.excepthook`` that
prints that line after the traceback, and the marker (``PEER_FAILURE_MARK``) by which
``tfdp launch`` recognises and repeats it. It imports TensorFlow only when a message is built, so
the launcher can import it without starting TensorFlow.
"""

from __future__ import annotations

import os
import re
import sys

from tfdp.errors import invalid_argument
from tfdp.keras import adapter

# A worker that loses a peer prints one line starting with this mark (after the traceback of the
# uncaught error); the launcher repeats that line in its summary and names that peer first.
PEER_FAILURE_MARK = "tfdp: peer failure: "

# How failures are detected:
#
# A dead or stuck worker must end the job promptly, also without the launcher (two real hosts):
#
# * TF's coordination service (started by MultiWorkerMirroredStrategy; its leader is task 0): each
#   task's agent sends heartbeats to the leader; when a task's heartbeats stop for
#   ``heartbeat_timeout`` seconds (dead, SIGSTOPped, frozen host, cut network) the service aborts
#   the collectives of every other task with UnavailableError ("stopped sending heartbeats"), and
#   when the leader itself stops answering, the other tasks' heartbeat RPCs fail and abort theirs.
#   This is independent of step time (heartbeats run in TF's C++ threads), so slow steps never
#   cause a false alarm. Default 6 s (TF's own default is 10 s); ``TFDP_HEARTBEAT_TIMEOUT``.
# * A crashed peer whose socket closes fails the pending RPCs at once (gRPC "Connection reset").
# * Optionally, a collective timeout (``collective_timeout`` / ``TFDP_COLLECTIVE_TIMEOUT``, off by
#   default) catches a worker that is alive (heartbeats flowing) but never reaches the next
#   collective (a deadlock in Python code); it must exceed the slowest legitimate wait between
#   workers (worker 0 saving a checkpoint, an evaluation, the first step's tracing).
#
# TF's error then names the peer deep in a gRPC message; ``peer_failure_message`` turns it into one
# line naming the worker and its address, printed (with PEER_FAILURE_MARK, which the launcher
# repeats in its own summary) after the traceback of the uncaught error.

HEARTBEAT_TIMEOUT_ENV = "TFDP_HEARTBEAT_TIMEOUT"
COLLECTIVE_TIMEOUT_ENV = "TFDP_COLLECTIVE_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 6.0

_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*((?:/job:\S+\s*)+)")
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_ADDRESS = re.compile(r"(?:ipv4:|ipv6:)?(\[[0-9a-fA-F:.]+\]|[\w.-]+):(\d{2,5})")


def _peer_errors():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (launcher: no TF)
    return (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.FailedPreconditionError,
            tf.errors.InternalError, tf.errors.CancelledError, tf.errors.UnknownError)


def seconds_setting(value, name, env, default, off_ok=True):
    """kwarg -> environment variable -> default: a positive number of seconds, or None (off:
    ``0`` / ``none`` in the environment variable, where ``off_ok``)."""
    if value is None and os.environ.get(env, "").strip():
        raw = os.environ[env].strip()
        fix = "Set a positive number of seconds" + (", or 0 / 'none' to turn it off."
                                                    if off_ok else ".")
        if off_ok and raw.lower() in ("0", "none", "off"):
            return None
        try:
            value = float(raw)
        except ValueError:
            raise invalid_argument(env, raw, fix=fix) from None
        if not value > 0 or value == float("inf"):  # (NaN fails value > 0)
            raise invalid_argument(env, raw, fix=fix)
        return value
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or value == float("inf")):
        raise invalid_argument(name, value, fix="Pass a positive number of seconds, or None.")
    return float(value)


def _task_rank(cluster, job: str, task: int):
    """Global rank (index into ``cluster.workers``) of TF task ``/job:<job>/task:<task>``."""
    spec = cluster.cluster_spec or {"worker": list(cluster.workers)}
    order = [j for j in ("chief", "worker") if j in spec]
    if job not in order or task >= len(spec[job]):
        return None
    return sum(len(spec[j]) for j in order[:order.index(job)]) + task


def _name(cluster, rank: int) -> str:
    return f"worker {rank} ({cluster.workers[rank]})"


def peer_failure_message(error, cluster, heartbeat_timeout=None, collective_timeout=None):
    """A one-line account of which worker was lost, for a TF error caused by a lost peer, e.g.
    "worker 1 (127.0.0.1:37981) has stopped responding (no heartbeat for 6 s: crashed, killed,
    frozen or unreachable)"; None for other errors.

    Args:
      error: the exception (typically a ``tf.errors.UnavailableError`` from a collective).
      cluster: the job's ``tfdp.cluster.ClusterInfo``.
      heartbeat_timeout, collective_timeout: the settings in effect (for the message).
    """
    if cluster is None or not cluster.workers:
        return None
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if not isinstance(error, _peer_errors()):
        return None
    text = str(getattr(error, "message", None) or error)
    hb = f"{heartbeat_timeout:g} s" if heartbeat_timeout else "the heartbeat timeout"
    m = _UNHEALTHY.search(text)
    if m:
        ranks = []
        for job, task in _TASK.findall(m.group(1)):
            r = _task_rank(cluster, job, int(task))
            if r is not None and r not in ranks:
                ranks.append(r)
        if ranks:
            who = ", ".join(_name(cluster, r) for r in ranks)
            verb = "has" if len(ranks) == 1 else "have"
            return (f"{who} {verb} stopped responding (no heartbeat for {hb}: crashed, killed, "
                    f"frozen or unreachable)")
    if "CoordinationService/Heartbeat" in text or ("CoordinationService" in text and (
            "Deadline" in text or "unavailable" in text.lower())):
        leader = 0  # the coordination service runs on the first task (chief, else worker 0)
        if leader != cluster.rank:
            return (f"{_name(cluster, leader)} (the coordination leader) has stopped responding "
                    f"(heartbeats unanswered for {hb}: crashed, killed, frozen or "
                    f"unreachable)")
    ranks = []
    for job, task in _TASK.findall(text):
        r = _task_rank(cluster, job, int(task))
        if r is not None and r != cluster.rank and r not in ranks:
            ranks.append(r)
    for host, port in _ADDRESS.findall(text):
        for r, addr in enumerate(cluster.workers):
            if r != cluster.rank and r not in ranks and addr in (f"{host}:{port}",
                                                                   f"[{host}]:{port}"):
                ranks.append(r)
    if isinstance(error, tf.errors.DeadlineExceededError) and "ollective" in text and not ranks:
        limit = f"{collective_timeout:g} s" if collective_timeout else "its timeout"
        others = [_name(cluster, r) for r in range(len(cluster.workers)) if r != cluster.rank]
        who = others[0] if len(others) == 1 else "one of " + ", ".join(others)
        return (f"{who} did not reach a collective within {limit} ({COLLECTIVE_TIMEOUT_ENV}): "
                f"stuck or much slower")
    if ranks and isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                                    tf.errors.FailedPreconditionError,
                                    tf.errors.DeadlineExceededError)):
        who = ", ".join(_name(cluster, r) for r in ranks)
        return f"lost the connection to {who} (crashed, killed or unreachable)"
    return None


_SHAPE_MISMATCH = re.compile(r"expected shape (\[[^\]]*\]) but another member in the group "
                             r"expected shape (\[[^\]]*\])")
_TYPE_MISMATCH = re.compile(r"Collective instance \d+ expected type \d+ and data_type (\d+) but "
                            r"got type \d+ and data_type (\d+)")


def _dtype_name(enum: str) -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.dtypes.as_dtype(int(enum)).name
    except (TypeError, ValueError):
        return f"dtype #{enum}"


def model_mismatch_message(error, variable, num_workers):
    """One clear line for TF's collective shape/dtype mismatch at variable creation, else None.

    Worker 0 broadcasts each initial value in creation order; a worker whose model differs makes
    the broadcast of some variable meet another shape (same variable, other shape) or another
    variable entirely (one model has more variables: the next broadcast, e.g. the optimizer's
    int64 counter, meets a float kernel). TF reports either deep in a collective error.
    """
    text = str(error)
    m = _SHAPE_MISMATCH.search(text)
    if m is not None and "Shape mismatch in the collective" in text:
        what = (f"variable {variable!r} has shape {m.group(1)} here but {m.group(2)} on another "
                "worker")
        received = f"{variable}.shape={m.group(1)} vs {m.group(2)}"
    else:
        m = _TYPE_MISMATCH.search(text)
        if m is None:
            return None
        a, b = _dtype_name(m.group(1)), _dtype_name(m.group(2))
        what = (f"the broadcast of variable {variable!r} met a variable of another dtype on "
                "another worker (the models have different variables)")
        received = f"dtypes {a} vs {b} at variable {variable!r}"
    return (f"The model differs between workers: {what} (worker 0 broadcasts every initial value "
            f"to the {num_workers} workers, in creation order). Received: {received}. Fix: build "
            "the same model (same layers, shapes and dtypes, created in the same order) on every "
            "worker; derive nothing in the model from the worker's rank.")


class PeerFailureHook:
    """``sys.excepthook`` wrapper: after the usual traceback of an uncaught error caused by a
    lost peer, print one ``PEER_FAILURE_MARK`` line naming it; other errors pass through
    unchanged. In ``sys.excepthook`` while a multi-worker strategy lives (the adapter's
    ``peer_failure`` set, ``tfdp.keras.adapter``); the newest strategy's settings are used."""

    settings = (None, None, None)  # (cluster, heartbeat_timeout, collective_timeout)

    def __init__(self, previous):
        self.previous = previous

    @property
    def cluster(self):
        return type(self).settings[0]

    @property
    def heartbeat_timeout(self):
        return type(self).settings[1]

    @property
    def collective_timeout(self):
        return type(self).settings[2]

    @classmethod
    def install(cls, strategy, cluster, heartbeat_timeout, collective_timeout):
        """Wrap ``sys.excepthook`` for as long as ``strategy`` lives."""
        cls.settings = (cluster, heartbeat_timeout, collective_timeout)
        adapter.use(strategy, "peer_failure")

    def __call__(self, exc_type, exc, tb):
        self.previous(exc_type, exc, tb)
        try:
            line = peer_failure_message(exc, self.cluster, self.heartbeat_timeout,
                                        self.collective_timeout)
        except Exception:  # pylint: disable=broad-except  (never hide the original error)
            line = None
        if line:
            sys.stderr.write(f"{PEER_FAILURE_MARK}{line}\n")
            sys.stderr.flush()


adapter.provide("peer_failure", {"excepthook": PeerFailureHook})

__all__ = ["PEER_FAILURE_MARK", "PeerFailureHook", "model_mismatch_message",
           "peer_failure_message", "seconds_setting"]
