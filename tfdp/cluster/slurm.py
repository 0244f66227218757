"""Cluster from SLURM environment variables (one process per SLURM task, started by ``srun``).

Same variables and port scheme as ``tf.distribute.cluster_resolver.SlurmClusterResolver``
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
``SLURM_STEP_TASKS_PER_NODE``; tasks on one node get consecutive ports from a base port), but
read from a mapping (testable, no ``os.environ`` writes, no ``CUDA_VISIBLE_DEVICES`` side effect,
no ``nvidia-smi``/``scontrol``) and validated with clear errors.

Differences from TF's resolver, on purpose:

* every task is a ``"worker"`` (no chief); ``rank == task_id == SLURM_PROCID`` and rank 0 acts as
  chief (``ClusterInfo.is_chief``).
* nodes keep the nodelist's order (TF sorts host names, so ``node10`` would precede ``node9``):
  task ranks follow SLURM's default block distribution. When ``SLURMD_NODENAME`` is set it is
  checked against the node this rank was placed on.
* the step variables fall back to the job ones (``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``,
  ``SLURM_TASKS_PER_NODE``).
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from tfdp.cluster.spec import ClusterInfo, build_cluster_info
from tfdp.errors import invalid_argument

DEFAULT_PORT = 8888
PORT_ENV = "TFDP_SLURM_PORT"
NTASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
MAX_TASKS = 65536  # caps hostlist expansion: a typo like n[0-99999999] fails fast, never hangs
_SRUN_FIX = "These are set by srun: start one process per task with `srun python train.py`."
_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?$")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    """``(name, value)`` of the first of ``names`` in ``environ``, else ``(names[0], None)``."""
    for name in names:
        if name in environ:
            return name, environ[name]
    return names[0], None


def _int_var(name: str, raw, minimum: int) -> int:
    text = raw.strip() if isinstance(raw, str) else ""
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        what = f"{name} is not set" if raw is None else f"Invalid {name}"
        raise invalid_argument(name, raw, what=what,
                               fix=f"It must be an integer >= {minimum}. {_SRUN_FIX}")
    return int(text)


def _split_top_level(text: str, name: str) -> list[str]:
    """Split at commas outside ``[...]``; reject unbalanced brackets and empty parts."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth not in (0, 1):
            break
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0 or not all(parts):
        raise invalid_argument(name, text, what=f"Cannot parse {name}",
                               fix='Expected a SLURM hostlist like "node[01-03],gpu7".')
    return parts


def _too_many(name: str, text: str):
    return invalid_argument(name, text, what=f"{name} expands to more than {MAX_TASKS} hosts",
                            fix="Check the ranges for a typo.")


def expand_nodelist(text: str, name: str = "SLURM_STEP_NODELIST") -> list[str]:
    """Expand a SLURM hostlist, keeping its order: ``"n[01-02],m5,o[3,5-6]-ib"`` ->
    ``["n01", "n02", "m5", "o3-ib", "o5-ib", "o6-ib"]``.

    Ranges keep the lower bound's zero padding; several ``[...]`` groups in one name expand as a
    product. ``name`` labels errors.
    """
    fix = 'Expected a SLURM hostlist like "node[01-03],gpu7".'
    if not isinstance(text, str) or not text.strip():
        raise invalid_argument(name, text, what=f"{name} is empty or not set",
                               fix=f"{fix} {_SRUN_FIX}")
    hosts: list[str] = []
    for part in _split_top_level(text.strip(), name):
        pieces = re.split(r"\[([^\[\]]*)\]", part)  # literal, group, literal, group, ..., literal
        choices: list[list[str]] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if any(c in "[]" or c.isspace() for c in piece):
                    raise invalid_argument(name, text, what=f"Cannot parse {name}", fix=fix)
                choices.append([piece])
                continue
            values = []
            for item in piece.split(","):
                m = _RANGE.match(item)
                if m is None or (m.group(2) and int(m.group(2)) < int(m.group(1))):
                    raise invalid_argument(name, text, what=f"Invalid range [{piece}] in {name}",
                                           fix=fix + ' Ranges are "lo-hi" with lo <= hi.')
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                if len(values) + hi - lo >= MAX_TASKS:
                    raise _too_many(name, text)
                values.extend(str(v).zfill(len(m.group(1))) for v in range(lo, hi + 1))
            choices.append(values)
        if len(hosts) + math.prod(len(c) for c in choices) > MAX_TASKS:
            raise _too_many(name, text)
        expanded = [""]
        for options in choices:
            expanded = [prefix + option for prefix in expanded for option in options]
        if not all(expanded):
            raise invalid_argument(name, text, what=f"Cannot parse {name}", fix=fix)
        hosts.extend(expanded)
    return hosts


def expand_tasks_per_node(text: str, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM's tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in (text.strip().split(",") if isinstance(text, str) else [None]):
        m = _TASKS.match(part or "")
        if m is None or int(m.group(1)) < 1 or int(m.group(2) or 1) < 1 \
                or len(counts) + int(m.group(2) or 1) > MAX_TASKS:
            raise invalid_argument(name, text, what=f"Cannot parse {name}",
                                   fix='Expected counts >= 1 like "2(x3),1" (2 tasks on each of '
                                       f"3 nodes, then 1). {_SRUN_FIX}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _base_port(environ: Mapping[str, str], port) -> tuple[str, int]:
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise invalid_argument("port", port, fix="It must be an integer in 1..65535.")
        return "port", port
    if PORT_ENV in environ:
        raw = environ[PORT_ENV].strip()
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 65535:
            raise invalid_argument(PORT_ENV, environ[PORT_ENV], fix="It must be an integer in "
                                   f"1..65535 (unset it for the default {DEFAULT_PORT}).")
        return PORT_ENV, int(raw)
    return "port", DEFAULT_PORT


def parse_slurm(environ: Mapping[str, str], port: int | None = None) -> ClusterInfo:
    """Build and validate the cluster of a SLURM job step from its environment variables.

    Every SLURM task is a ``"worker"`` with ``rank = task_id = SLURM_PROCID``. Node ``i`` of the
    nodelist runs ``tasks_per_node[i]`` consecutive ranks on ports ``base, base+1, ...``; the base
    port is ``port``, else ``$TFDP_SLURM_PORT``, else 8888.

    Raises:
      TfdpError: naming the SLURM variable, the received value and the fix.
    """
    ntasks_name, raw = _first(environ, NTASKS_VARS)
    ntasks = _int_var(ntasks_name, raw, 1)
    procid = _int_var("SLURM_PROCID", environ.get("SLURM_PROCID"), 0)
    if procid >= ntasks:
        raise invalid_argument("SLURM_PROCID", environ["SLURM_PROCID"],
                               fix=f"It must be in 0..{ntasks - 1} ({ntasks_name}={ntasks}). "
                                   f"{_SRUN_FIX}")
    nodelist_name, raw = _first(environ, NODELIST_VARS)
    hosts = expand_nodelist(raw, nodelist_name)
    duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
    if duplicates:
        raise invalid_argument(nodelist_name, raw, what=f"{nodelist_name} repeats host(s) "
                               f"{', '.join(duplicates)}", fix="List every node once.")
    tpn_name, raw = _first(environ, TASKS_PER_NODE_VARS)
    if raw is not None:
        counts = expand_tasks_per_node(raw, tpn_name)
    elif ntasks % len(hosts) == 0:
        counts = [ntasks // len(hosts)] * len(hosts)
    else:
        raise invalid_argument(tpn_name, None, what=f"{tpn_name} is not set and {ntasks_name}="
                               f"{ntasks} does not divide evenly over {len(hosts)} node(s)",
                               fix=f"Set {tpn_name}. {_SRUN_FIX}")
    if len(counts) != len(hosts) or sum(counts) != ntasks:
        raise invalid_argument(tpn_name, raw, what=f"{tpn_name} does not match the other SLURM "
                               f"variables: {len(counts)} node(s) with {sum(counts)} task(s), but "
                               f"{nodelist_name} has {len(hosts)} node(s) and {ntasks_name}="
                               f"{ntasks}", fix=f"Do not mix job and step variables. {_SRUN_FIX}")
    port_name, base = _base_port(environ, port)
    if base + max(counts) - 1 > 65535:
        raise invalid_argument(port_name, base, what=f"{max(counts)} tasks on one node need "
                               f"ports {base}..{base + max(counts) - 1}, past 65535",
                               fix="Use a lower base port.")
    node_of_rank = [host for host, count in zip(hosts, counts) for _ in range(count)]
    workers = [f"{host}:{base + i}" for host, count in zip(hosts, counts) for i in range(count)]
    node = environ.get("SLURMD_NODENAME")
    if node is not None and node != node_of_rank[procid]:
        raise invalid_argument("SLURMD_NODENAME", node, what=f"SLURM placed rank {procid} on a "
                               f"different node than block distribution over {nodelist_name} "
                               f"predicts ({node_of_rank[procid]!r})",
                               fix="Launch with `srun --distribution=block` (the default), or "
                                   "set TF_CONFIG yourself.")
    return build_cluster_info({"worker": workers}, "worker", procid, source="slurm",
                              where=f"cluster from {nodelist_name}",
                              type_name="task type", index_name="SLURM_PROCID")


# --- tfdp launch --slurm: one launcher per node --------------------------------------------------

DEFAULT_LAUNCH_PORT = 29500  # the rendezvous port on the first node (torchrun's default port)
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")


def slurm_nodes(environ: Mapping[str, str]) -> tuple[int, int, str]:
    """``(nnodes, node_rank, first_node)`` for ``srun --ntasks-per-node=1 tfdp launch --slurm``:
    one launcher task per node, node rank ``SLURM_PROCID``, the coordinator on the step's first
    node (in the nodelist's order, as :func:`parse_slurm` places ranks).

    Raises:
      TfdpError: not inside ``srun``, or not one task per node (naming the variables).
    """
    fix = ("Run it as `srun --ntasks-per-node=1 tfdp launch --slurm --workers-per-node K -- "
           "CMD` (one launcher per node), or give --nnodes/--node-rank/--coordinator.")
    if "SLURM_PROCID" not in environ:
        raise invalid_argument("SLURM_PROCID", None, what="--slurm needs srun's environment "
                               "(SLURM_PROCID is not set)", fix=fix)
    nodelist_name, raw = _first(environ, NODELIST_VARS)
    hosts = expand_nodelist(raw, nodelist_name)
    nnodes_name, raw_nodes = _first(environ, NNODES_VARS)
    nnodes = _int_var(nnodes_name, raw_nodes, 1) if raw_nodes is not None else len(hosts)
    if nnodes != len(hosts):
        raise invalid_argument(nnodes_name, raw_nodes, what=f"{nnodes_name} does not match "
                               f"{nodelist_name} ({len(hosts)} node(s))",
                               fix="Do not mix job and step variables. " + fix)
    ntasks_name, raw_tasks = _first(environ, NTASKS_VARS)
    ntasks = _int_var(ntasks_name, raw_tasks, 1)
    if ntasks != nnodes:
        raise invalid_argument(ntasks_name, raw_tasks, what=f"--slurm runs one tfdp launch per "
                               f"node, but this step has {ntasks} task(s) on {nnodes} node(s)",
                               fix=fix)
    rank = _int_var("SLURM_PROCID", environ.get("SLURM_PROCID"), 0)
    if rank >= nnodes:
        raise invalid_argument("SLURM_PROCID", environ["SLURM_PROCID"],
                               fix=f"It must be in 0..{nnodes - 1}. {fix}")
    node = environ.get("SLURMD_NODENAME")
    if node is not None and node != hosts[rank]:
        raise invalid_argument("SLURMD_NODENAME", node, what=f"SLURM placed launcher {rank} on "
                               f"another node than {nodelist_name} predicts ({hosts[rank]!r})",
                               fix="Launch with `srun --distribution=block` (the default). "
                                   + fix)
    return nnodes, rank, hosts[0]
