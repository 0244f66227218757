"""Pick the cluster source (resolver, TF_CONFIG, SLURM, local) and check this task's port."""

from __future__ import annotations

import errno
import os
import socket
from typing import Mapping

from tfdp.cluster.slurm import NTASKS_VARS, parse_slurm
from tfdp.cluster.spec import ClusterInfo, build_cluster_info, parse_tf_config
from tfdp.errors import TfdpError, invalid_argument, message


def _from_resolver(resolver) -> ClusterInfo:
    """Validate an explicit ``tf.distribute.cluster_resolver.ClusterResolver``."""
    if not callable(getattr(resolver, "cluster_spec", None)):
        raise invalid_argument(
            "cluster_resolver", resolver,
            fix="Pass a tf.distribute.cluster_resolver.ClusterResolver (e.g. "
                "SimpleClusterResolver, TFConfigClusterResolver), or None to read TF_CONFIG/SLURM.")
    spec = resolver.cluster_spec()  # before task_type: some resolvers (SLURM) set it here
    # as_dict() gives lists, or {index: address} for sparse task lists (rejected as not a list).
    cluster = spec.as_dict() if callable(getattr(spec, "as_dict", None)) else spec
    return build_cluster_info(cluster, getattr(resolver, "task_type", None),
                              getattr(resolver, "task_id", None), source="explicit",
                              where="cluster_resolver.cluster_spec()",
                              type_name="cluster_resolver.task_type",
                              index_name="cluster_resolver.task_id")


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True inside a multi-task SLURM job (an invalid task count also counts: parse_slurm says)."""
    if "SLURM_PROCID" not in environ and "SLURM_JOB_ID" not in environ:
        return False
    ntasks = next((environ[n] for n in NTASKS_VARS if n in environ), None)
    return ntasks is not None and ntasks.strip() != "1"


def resolve_cluster(cluster_resolver=None, environ: Mapping[str, str] | None = None
                    ) -> ClusterInfo:
    """Find and validate this process's cluster. First match wins:

    1. ``cluster_resolver`` (a ``tf.distribute.cluster_resolver.ClusterResolver``): its
       ``cluster_spec()``, ``task_type`` and ``task_id``; ``source="explicit"``.
    2. ``TF_CONFIG`` if set in ``environ``, even empty (an empty one is an error).
    3. SLURM, when ``SLURM_PROCID`` or ``SLURM_JOB_ID`` is set and the task count
       (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``) is not 1: see :func:`parse_slurm`.
    4. Local: ``ClusterInfo()``, one process, no cluster.

    Args:
      cluster_resolver: an explicit resolver, or None.
      environ: the environment to read (default ``os.environ``).

    Raises:
      TfdpError: the chosen source is invalid (never falls through to the next one).
    """
    environ = os.environ if environ is None else environ
    if cluster_resolver is not None:
        return _from_resolver(cluster_resolver)
    if "TF_CONFIG" in environ:
        return parse_tf_config(environ["TF_CONFIG"])
    if _in_slurm_step(environ):
        return parse_slurm(environ)
    return ClusterInfo()


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`TfdpError` if a socket already listens on (or holds) ``host:port``.

    Binds a TCP socket there and closes it at once. ``host`` may be ``"[::1]"``-style IPv6, or
    ``""`` / ``"0.0.0.0"`` to check every IPv4 interface (as the TF server binds). A port held only
    by connections in ``TIME_WAIT`` (a run that just ended) counts as free on POSIX, as the TF
    server (which sets ``SO_REUSEADDR``) can bind it.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise invalid_argument("port", port, fix="It must be an integer in 1..65535.")
    if not isinstance(host, str):
        raise invalid_argument("host", host, fix='Pass a host name or address, e.g. "127.0.0.1".')
    bind_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    # First without SO_REUSEADDR (strict); if that fails, retry with it on POSIX, where it only
    # gets past TIME_WAIT leftovers, never past a listening socket.
    for reuse in ((0, 1) if os.name == "posix" else (0,)):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                sock.bind((bind_host, port))
            return
        except socket.gaierror as e:
            raise TfdpError(message(f"Cannot resolve host {host!r} ({e.strerror})",
                                    f"host={host!r}, port={port}",
                                    "Use a host name or address of this machine.")) from None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise TfdpError(message(f"Cannot bind {host}:{port} ({e.strerror})",
                                        f"host={host!r}, port={port}",
                                        "Use an address of this machine and a port you may "
                                        "bind.")) from None
    where = "every interface" if bind_host in ("", "0.0.0.0") else repr(host)
    raise TfdpError(message(f"Port {port} on {where} is already in use",
                            f"host={host!r}, port={port}",
                            "Stop the process holding it (e.g. a worker left from an earlier "
                            "run: `ss -ltnp | grep :%d`) or choose another port." % port))
