"""Start N local worker processes with ``TF_CONFIG`` and supervise them (like ``torchrun``).

Each worker runs the same command in its own session (process group), with:

* ``TF_CONFIG`` describing an N-worker cluster on free loopback ports (not set when N == 1),
* ``TFDP_WORKER_RANK``, ``TFDP_NUM_WORKERS``, ``TFDP_RESTART_COUNT`` and ``PYTHONUNBUFFERED=1``,
* ``TFDP_CPU_REPLICAS`` and a per-worker ``CUDA_VISIBLE_DEVICES`` slice when asked for.

Every output line is prefixed with ``[worker i] ``. If a worker fails, the others are stopped
(SIGTERM to their process groups, SIGKILL after a grace period, at once for a stopped
process) and the job fails, or is restarted as a whole up to ``max_restarts`` times. The failure
is one line naming the worker and its address; when the failed worker reported a lost peer (a
``tfdp: peer failure: ...`` line, see ``tfdp.failures``), that peer is named first.
SIGINT/SIGTERM sent to the launcher are forwarded to all workers. Every wait is bounded, so the
launcher never hangs.

Security: the TensorFlow gRPC server the workers start is unauthenticated and unencrypted:
anyone who can reach a worker's port can run code in it. The launcher therefore only accepts and
advertises loopback addresses (127.0.0.1 by default) in ``TF_CONFIG``, so the workers talk over
loopback only. TensorFlow's server itself listens on every interface of its port (not
configurable), so on a shared or exposed machine keep those ports behind a firewall.

This module must start instantly: it never imports TensorFlow.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import sys
import time
from typing import IO, Mapping, Sequence

from tfdp import errors
from tfdp.errors import UsageError
from tfdp.launch.job import (  # noqa: F401 (_replicas_note: also read by tests)
    _ForwardedSignals, _Job, _replicas_note, _supervise, _visible_gpus)

OUTPUT_MODES = ("all", "worker0")


def make_tf_configs(workers: int, host: str = "127.0.0.1") -> list[dict]:
    """Return one ``TF_CONFIG`` dict per worker for a ``workers``-worker cluster on ``host``.

    Ports are distinct free ports from ``portpicker.pick_unused_port()``; worker ``i`` gets
    ``{"cluster": {"worker": [addr0, ...]}, "task": {"type": "worker", "index": i}}``.
    """
    _check_workers(workers, "workers")
    _check_host(host, "host")
    import portpicker

    ports: list[int] = []
    while len(ports) < workers:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
    fmt = "[{}]:{}" if ":" in host else "{}:{}"
    addrs = [fmt.format(host, p) for p in ports]
    return [{"cluster": {"worker": list(addrs)}, "task": {"type": "worker", "index": i}}
            for i in range(workers)]


def validate(cmd: Sequence[str], workers, *, cpu_replicas=None, gpus_per_worker=None,
             max_restarts=0, timeout=None, host="127.0.0.1", env: Mapping[str, str] | None = None,
             cli: bool = False, output: str = "all", log_dir=None, loopback_only: bool = True
             ) -> None:
    """Raise :class:`~tfdp.errors.UsageError` if the launch arguments are invalid.

    Nothing is started. With ``cli=True`` the messages name the command-line flags.
    """
    def name(n):
        return "--" + n.replace("_", "-") if cli else n

    env = os.environ if env is None else env
    _check_workers(workers, name("workers"))
    if isinstance(cmd, (str, bytes)) or not isinstance(cmd, (list, tuple)) \
            or not all(isinstance(a, (str, os.PathLike)) for a in cmd):
        raise errors.invalid_argument(
            "command", cmd, what="The command must be a list of strings", cls=UsageError,
            fix="Split it into the program and its arguments, e.g. "
                "[sys.executable, 'train.py', '--epochs', '3'] (shlex.split does it for a "
                "string).")
    cmd = [os.fspath(a) for a in cmd]
    if not cmd:
        raise errors.invalid_argument(
            "command", [], what="No command to run", cls=UsageError,
            fix="Put the command after the options, e.g. "
                "'tfdp launch --workers 2 -- python train.py'.")
    _check_int(cpu_replicas, name("cpu_replicas"), 1, optional=True)
    _check_int(gpus_per_worker, name("gpus_per_worker"), 0, optional=True)
    _check_int(max_restarts, name("max_restarts"), 0)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise errors.invalid_argument(name("timeout"), timeout, cls=UsageError,
                                      fix="Give a positive number of seconds, or no timeout.")
    if loopback_only:
        _check_host(host, name("host"))
    if output not in OUTPUT_MODES:
        raise errors.invalid_argument("output", output, valid=OUTPUT_MODES, cls=UsageError)
    if log_dir is not None:
        _check_log_dir(log_dir, name("log_dir"))
    if gpus_per_worker and "CUDA_VISIBLE_DEVICES" in env:
        visible = _visible_gpus(env)
        if workers * gpus_per_worker > len(visible):
            raise errors.invalid_argument(
                name("gpus_per_worker"), gpus_per_worker, cls=UsageError,
                what=f"More GPUs requested than visible ({workers} workers x {gpus_per_worker} "
                     f"= {workers * gpus_per_worker}, but CUDA_VISIBLE_DEVICES="
                     f"{env['CUDA_VISIBLE_DEVICES']!r} lists {len(visible)})",
                fix="Use fewer workers or GPUs per worker, or widen CUDA_VISIBLE_DEVICES.")
    program = cmd[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        found = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath)) is not None
    if not found:
        raise errors.invalid_argument(
            "command", program, what="Program not found or not executable", cls=UsageError,
            fix="Check the spelling and PATH, or give the path to an executable file.")
    script = _python_script(cmd)
    if script is not None and not os.path.exists(script):
        raise errors.invalid_argument(
            "script", script, what="The Python script to run does not exist", cls=UsageError,
            fix=f"Check the path (relative paths are from the current directory, "
                f"{os.getcwd()!r}).")


def launch(cmd: Sequence[str], workers: int, *, cpu_replicas: int | None = None,
           gpus_per_worker: int | None = None, max_restarts: int = 0,
           timeout: float | None = None, env: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None,
           host: str = "127.0.0.1", output: str = "all", log_dir: str | None = None,
           verbose: bool = False, announce: bool | None = None) -> int:
    """Run ``cmd`` in ``workers`` local worker processes and return the job's exit code.

    Args:
      cmd: the command and its arguments, e.g. ``[sys.executable, "train.py"]``.
      workers: number of worker processes (>= 1). With 1, ``TF_CONFIG`` is not set.
      cpu_replicas: if given, sets ``TFDP_CPU_REPLICAS`` for the workers.
      gpus_per_worker: if given, worker ``i`` gets GPUs ``i*G .. i*G+G-1`` of the visible list
        (``CUDA_VISIBLE_DEVICES`` of ``env`` if set, else ``0 .. workers*G-1``) as its
        ``CUDA_VISIBLE_DEVICES``; 0 hides all GPUs.
      max_restarts: after a failure, restart all workers (new ports) up to this many times.
      timeout: whole-job wall-clock limit in seconds (across restarts); on expiry returns 124.
      env: the workers' base environment (default: ``os.environ``); the launcher's variables
        are added to it, and an inherited ``TF_CONFIG`` is dropped when ``workers == 1``.
      stdout, stderr: where prefixed worker output goes (default: ``sys.stdout`` /
        ``sys.stderr`` at call time); launcher messages go to ``stderr``.
      host: the loopback address the workers advertise in ``TF_CONFIG`` (only loopback is
        allowed).
      output: ``"all"`` (the default here; ``tfdp launch --output all``): every worker's output
        line by line with its ``[worker i] `` prefix; ``"worker0"`` (the ``tfdp launch``
        default): worker 0's output live (partial lines and ``\r`` progress updates as they
        come), every worker's output in ``log_dir/worker-<i>.log``, and a failed worker's last
        lines with its log's path when it fails.
      log_dir: where the per-worker log files go (default with ``"worker0"``: a new
        ``tfdp-launch-*`` directory under the temporary directory; with ``"all"``: none).
      verbose: keep TensorFlow's C++ INFO/WARNING logs; by default they are hidden
        (``TF_CPP_MIN_LOG_LEVEL=2`` in the workers, see :func:`tfdp.logs.quiet_tensorflow`)
        unless ``env`` sets ``TF_CPP_MIN_LOG_LEVEL``.
      announce: print one line at the start (what is shown, where the logs are, what is
        hidden); default: with ``"worker0"``.

    Returns:
      0 if every worker succeeded; the failed worker's exit code if it is 1..125, else 1;
      124 on timeout; 130 / 143 when stopped by SIGINT / SIGTERM.

    Raises:
      tfdp.errors.UsageError: invalid arguments (checked before anything starts).
      tfdp.errors.TfdpError: the command could not be started.
    """
    validate(cmd, workers, cpu_replicas=cpu_replicas, gpus_per_worker=gpus_per_worker,
             max_restarts=max_restarts, timeout=timeout, host=host, env=env, output=output,
             log_dir=log_dir)
    job = _Job(list(cmd), workers, cpu_replicas, gpus_per_worker,
               dict(os.environ if env is None else env),
               sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr,
               output=output, log_dir=log_dir, verbose=verbose)
    if announce or (announce is None and output == "worker0"):
        job.announce()
    deadline = None if timeout is None else time.monotonic() + timeout
    with _ForwardedSignals() as received:
        try:
            return _supervise(job, max_restarts, timeout, deadline, received,
                              lambda restart: make_tf_configs(workers, host)
                              if workers > 1 else None)
        finally:
            job.close()


def _check_workers(workers, name) -> None:
    _check_int(workers, name, 1)


def _check_int(value, name, minimum, optional=False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise errors.invalid_argument(name, value, cls=UsageError,
                                      fix=f"Use an integer >= {minimum}.")


def _check_log_dir(log_dir, name) -> None:
    if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
        raise errors.invalid_argument(name, log_dir, cls=UsageError,
                                      fix="Give a directory path (it is created if needed).")
    path = os.fspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise errors.invalid_argument(name, path, what="Not a directory", cls=UsageError,
                                      fix="Give a directory (it is created if needed).")
    parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent or ".", os.W_OK):
        raise errors.invalid_argument(name, path, what="Cannot write there", cls=UsageError,
                                      fix="Give a directory you may write to.")


def _check_host(host, name) -> None:
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise errors.invalid_argument(
            name, host, what="Only loopback hosts are allowed", cls=UsageError,
            fix="Use 127.0.0.1 (the default): the TensorFlow gRPC server the workers start "
                "is unauthenticated, so it must not be reachable from other machines.")


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?$")
_PYTHON_OPTS_WITH_VALUE = ("-W", "-X")


def _python_script(cmd: Sequence[str]) -> str | None:
    """The script a ``python [options] SCRIPT ...`` command runs, or None (not a Python
    interpreter, or ``-c`` / ``-m`` / ``-`` / ``--help``-like: no script file)."""
    if not _PYTHON.match(os.path.basename(cmd[0])):
        return None
    args = iter(cmd[1:])
    for arg in args:
        if arg == "-" or arg.startswith(("-c", "-m", "--")):
            return None  # -c CODE, -m MODULE, stdin, --help / --version
        if arg in _PYTHON_OPTS_WITH_VALUE:
            next(args, None)
            continue
        if arg.startswith("-"):
            if arg[1:2] in ("W", "X"):  # -Wdefault, -Xdev: the value is attached
                continue
            if any(c in "cm" for c in arg[1:]):  # e.g. -uc CODE: a combined -c / -m
                return None
            continue
        return arg
    return None
