"""``ClusterInfo`` and the validation shared by every cluster source.

Whatever the source (``TF_CONFIG``, SLURM, an explicit cluster resolver), the cluster ends up as
``{"chief": [...], "worker": [...]}`` plus this task's type and index, and goes through
:func:`build_cluster_info`, so every source is checked by the same rules and fails with the same
kind of message.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import json

from tfdp.errors import TfdpError, invalid_argument

TASK_TYPES = ("chief", "worker")
EXAMPLE_TF_CONFIG = ('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                     '"task": {"type": "worker", "index": 0}}')
_SNIPPET_CHARS = 120


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process sits in the cluster: a validated, immutable view.

    ``ClusterInfo()`` is the local, single-process case (no cluster, ``num_workers == 1``).

    Attributes:
      workers: ``"host:port"`` of every task in rank order: the chief first (if any), then the
        workers. Empty when local.
      task_type: ``"chief"``, ``"worker"``, or ``"local"`` (single process, no cluster).
      task_id: index of this task within ``task_type``.
      rank: global index of this task into ``workers`` (the chief, when present, is rank 0).
      source: where the cluster came from: ``"tf_config"``, ``"slurm"``, ``"explicit"``
        (a cluster resolver) or ``"local"``.
      cluster_spec: ``{"chief": [...], "worker": [...]}`` as in ``TF_CONFIG`` (``{}`` when local).
    """

    workers: tuple[str, ...] = ()
    task_type: str = "local"
    task_id: int = 0
    rank: int = 0
    source: str = "local"
    cluster_spec: dict = dataclasses.field(default_factory=dict, hash=False)

    @property
    def num_workers(self) -> int:
        """Number of processes in the cluster (1 when local)."""
        return max(1, len(self.workers))

    @property
    def is_chief(self) -> bool:
        """True for the process of rank 0 (it saves checkpoints, writes summaries, ...)."""
        return self.rank == 0

    @property
    def address(self) -> str | None:
        """This task's ``"host:port"``, or None when local."""
        return self.workers[self.rank] if self.workers else None

    def tf_config(self) -> dict:
        """A ``TF_CONFIG`` dict equivalent to this info (``{}`` when local: no TF_CONFIG)."""
        if not self.workers:
            return {}
        return {"cluster": copy.deepcopy(self.cluster_spec),
                "task": {"type": self.task_type, "index": self.task_id}}

    def to_resolver(self):
        """A ``tf.distribute.cluster_resolver.SimpleClusterResolver`` for this cluster.

        Imports TensorFlow (lazily) but does not start its runtime.
        """
        import tensorflow as tf

        spec = tf.train.ClusterSpec(copy.deepcopy(self.cluster_spec))
        if not self.workers:
            return tf.distribute.cluster_resolver.SimpleClusterResolver(spec)
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type=self.task_type, task_id=self.task_id, rpc_layer="grpc")


def _err(name: str, value, what: str, *, valid=None, fix: str | None = None) -> TfdpError:
    return invalid_argument(name, value, what=what, valid=valid, fix=fix)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def split_address(address, name: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[ipv6]:port"`` into ``(host, port)``; ``name`` labels errors."""
    fix = 'Use "host:port" with a port in 1..65535, e.g. "10.0.0.1:2222" or "[::1]:2222".'
    if not isinstance(address, str):
        raise _err(name, address, f"{name} must be a \"host:port\" string", fix=fix)
    host, sep, port = address.rpartition(":")
    if not sep:
        raise _err(name, address, f"{name} has no port", fix=fix)
    if not host:
        raise _err(name, address, f"{name} must be \"host:port\" with a non-empty host", fix=fix)
    if host.startswith("[") or host.endswith("]"):
        if not _is_ipv6(host[1:-1]) or not (host.startswith("[") and host.endswith("]")):
            raise _err(name, address, f"{name} has an invalid bracketed IPv6 host", fix=fix)
    elif any(c.isspace() or c in "/[]@" for c in host):
        raise _err(name, address, f"{name} has an invalid host",
                   fix=fix + " No scheme (grpc://), path or whitespace.")
    elif ":" in host:
        raise _err(name, address, f"{name} has a bare IPv6 host",
                   fix='Wrap IPv6 addresses in brackets, e.g. "[::1]:2222".')
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise _err(name, address, f"{name} has an invalid port", fix=fix)
    return host, int(port)


def _task_type_hint(task_type) -> str | None:
    """A fix for a near-miss task type name (TF1's "master", wrong case), else None."""
    if not isinstance(task_type, str):
        return None
    if task_type.lower() == "master":
        return "'master' is TensorFlow 1's name for the chief: use 'chief'."
    if task_type != task_type.lower() and task_type.lower() in TASK_TYPES:
        return f"Task types are lower case: use {task_type.lower()!r}."
    return None


def validate_cluster(cluster, where: str) -> dict:
    """Check a ``{"chief": [...], "worker": [...]}`` dict; ``where`` names it in errors.

    Returns a copy with only the present task types, chief first.
    """
    if not isinstance(cluster, dict) or not cluster:
        raise _err(where, cluster, f"{where} must be a non-empty object of task lists",
                   fix=f"Example TF_CONFIG: {EXAMPLE_TF_CONFIG}")
    for key in cluster:
        if key not in TASK_TYPES:
            fix = "tfdp does synchronous data parallel training and uses no parameter servers " \
                  "or evaluators; remove that key." if key in ("ps", "evaluator") \
                else _task_type_hint(key)
            raise _err(f"{where} key", key, f"{where} has an unsupported task type",
                       valid=TASK_TYPES, fix=fix)
    seen: dict[tuple[str, int], str] = {}
    for key in TASK_TYPES:
        if key not in cluster:
            continue
        addresses, name = cluster[key], f'{where}["{key}"]'
        if not isinstance(addresses, list) or not addresses:
            raise _err(name, addresses, f"{name} must be a non-empty list of \"host:port\"",
                       fix=f"Example TF_CONFIG: {EXAMPLE_TF_CONFIG}")
        if key == "chief" and len(addresses) > 1:
            raise _err(name, addresses, "A cluster has at most one chief",
                       fix='List the others under "worker".')
        for i, address in enumerate(addresses):
            host, port = split_address(address, f"{name}[{i}]")
            key_ = (host.lower(), port)  # host names are case-insensitive
            if key_ in seen:
                raise _err(f"{name}[{i}]", address, "Every host:port in the cluster must be "
                           f"unique, but this one is also {seen[key_]}",
                           fix="Give each task its own port (or host).")
            seen[key_] = f"{name}[{i}]"
    return {t: list(cluster[t]) for t in TASK_TYPES if t in cluster}


def build_cluster_info(cluster, task_type, task_id, *, source: str, where: str,
                       type_name: str, index_name: str) -> ClusterInfo:
    """Validate a cluster dict plus this task's type/index and return a :class:`ClusterInfo`.

    Args:
      cluster: ``{"chief": [addr], "worker": [addr, ...]}``.
      task_type, task_id: this task's type and index within it.
      source: the ``ClusterInfo.source`` to record.
      where, type_name, index_name: how to name the cluster, the task type and the task index in
        error messages, e.g. ``'TF_CONFIG["cluster"]'``, ``'TF_CONFIG["task"]["type"]'``, ...

    Raises:
      TfdpError: naming the offending field, the received value and the fix.
    """
    spec = validate_cluster(cluster, where)
    if task_type in ("ps", "evaluator"):
        raise _err(type_name, task_type, f"Unsupported {type_name}", valid=TASK_TYPES,
                   fix="tfdp does synchronous data parallel training and does not use parameter "
                       "servers (ps) or evaluators; run every process as chief or worker.")
    present = list(spec)
    if task_type not in present:
        what = (f"Invalid {type_name}" if task_type not in TASK_TYPES
                else f"{type_name} names a task type missing from {where}")
        fix = (_task_type_hint(task_type) if task_type not in TASK_TYPES
               else f'Add a "{task_type}" list to {where}, or use a task type it has.')
        raise _err(type_name, task_type, what, valid=present, fix=fix)
    count = len(spec[task_type])
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < count:
        raise _err(index_name, task_id, f"Invalid {index_name}",
                   fix=f"It must be an integer in 0..{count - 1} (the {task_type} list has "
                       f"{count} entr{'y' if count == 1 else 'ies'}).")
    chiefs = spec.get("chief", [])
    workers = tuple(chiefs + spec.get("worker", []))
    rank = task_id + (len(chiefs) if task_type == "worker" else 0)
    return ClusterInfo(workers=workers, task_type=task_type, task_id=task_id, rank=rank,
                       source=source, cluster_spec=spec)


def _snippet(text: str, pos: int | None = None) -> str:
    """At most ~120 characters of ``text`` around ``pos`` (for error messages)."""
    if len(text) <= _SNIPPET_CHARS:
        return text
    start = max(0, min((pos or 0) - _SNIPPET_CHARS // 2, len(text) - _SNIPPET_CHARS))
    head, tail = ("..." if start else ""), ("..." if start + _SNIPPET_CHARS < len(text) else "")
    return head + text[start:start + _SNIPPET_CHARS] + tail


def parse_tf_config(text: str) -> ClusterInfo:
    """Parse and validate a ``TF_CONFIG`` string.

    Stricter than TensorFlow: a ``TF_CONFIG`` that is empty, lacks ``"cluster"`` or ``"task"``
    (which TensorFlow would silently run as a single worker), uses ``ps``/``evaluator`` tasks, or
    repeats a ``host:port`` is an error here.

    Raises:
      TfdpError: naming TF_CONFIG, the received value and the fix.
    """
    example = f"Example: TF_CONFIG='{EXAMPLE_TF_CONFIG}'"
    if not isinstance(text, str) or not text.strip():
        raise _err("TF_CONFIG", text, "TF_CONFIG is set but empty",
                   fix=f"Unset TF_CONFIG to run a single process, or set it to a JSON object. "
                       f"{example}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise _err("TF_CONFIG", _snippet(text, e.pos),
                   f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                   fix=f"Check the quoting: JSON needs double quotes. {example}") from None
    if not isinstance(config, dict):
        raise _err("TF_CONFIG", _snippet(text), "TF_CONFIG must be a JSON object", fix=example)
    if "cluster" not in config:
        raise _err("TF_CONFIG", _snippet(text), 'TF_CONFIG has no "cluster" (TensorFlow would '
                   "silently run a single worker)",
                   fix=f'Add "cluster", or unset TF_CONFIG to run a single process. {example}')
    validate_cluster(config["cluster"], 'TF_CONFIG["cluster"]')
    task = config.get("task")
    if not isinstance(task, dict):
        raise _err('TF_CONFIG["task"]', task, 'TF_CONFIG needs a "task" object',
                   fix=f'Add "task": {{"type": "worker", "index": N}}. {example}')
    for key in ("type", "index"):
        if key not in task:
            raise _err('TF_CONFIG["task"]', task, f'TF_CONFIG["task"] has no "{key}"',
                       fix=f'Set "task": {{"type": "worker", "index": N}}. {example}')
    return build_cluster_info(config["cluster"], task["type"], task["index"], source="tf_config",
                              where='TF_CONFIG["cluster"]', type_name='TF_CONFIG["task"]["type"]',
                              index_name='TF_CONFIG["task"]["index"]')
