"""Helpers for tests of multi-worker code: run a script in N local workers, read their results.

Parent side (a test)::

    from tfdp.testing import run_workers, parse_results

    outputs = run_workers('''
        from tfdp.testing import emit_result
        from tfdp.strategy import multiworker as mw
        s = mw.MultiWorkerDataParallelStrategy()
        emit_result({"replicas": s.num_replicas_in_sync})
    ''', workers=2, cpu_replicas=2, timeout=120)
    assert [r["replicas"] for r in parse_results(outputs)] == [4, 4]

The script runs through ``python -m tfdp launch`` (127.0.0.1 only, free ports, fail-fast) in a
subprocess with a hard timeout; a failing, crashing or stuck job raises ``AssertionError`` with
every worker's full output (child tracebacks included). Importing this module does not import
TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

RESULT_MARK = "RESULT "
_PREFIX = re.compile(r"^\[worker (\d+)\] ?(.*)$")
_KILL_GRACE_S = 20.0  # the launcher gets this long past its own --timeout before it is killed


def _is_path(script) -> bool:
    if isinstance(script, os.PathLike):
        return True
    return (isinstance(script, str) and "\n" not in script and script.strip().endswith(".py")
            and os.path.isfile(script))


def run_workers(script, workers: int = 2, cpu_replicas: int | None = 2, timeout: float = 180,
                env: Mapping[str, str] | None = None, args: Sequence[str] = ()) -> list[str]:
    """Run a Python script in ``workers`` local worker processes; return each worker's output.

    Args:
      script: the script's text (dedented), or the path of a ``.py`` file.
      workers: number of worker processes (``tfdp launch --workers``).
      cpu_replicas: ``TFDP_CPU_REPLICAS`` for each worker (None: not set).
      timeout: seconds for the whole job (the launcher's ``--timeout``; the launcher itself is
        killed ``20`` s later if it is still running).
      env: extra environment variables for the workers (added to ``os.environ``).
      args: command-line arguments for the script.

    Returns:
      ``outputs[i]``: worker i's stdout and stderr lines (prefix removed), in arrival order.

    Raises:
      AssertionError: the job failed, timed out or was killed; the message holds the exit
        code, the launcher's messages and every worker's full output.
    """
    with tempfile.TemporaryDirectory(prefix="tfdp-workers-") as tmp:
        if _is_path(script):
            path = os.fspath(script)
        else:
            path = os.path.join(tmp, "worker_script.py")
            Path(path).write_text(textwrap.dedent(script))
        cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output", "--workers", str(workers),
               "--timeout", str(timeout)]
        if cpu_replicas is not None:
            cmd += ["--cpu-replicas", str(cpu_replicas)]
        cmd += ["--", sys.executable, path, *args]
        child_env = dict(os.environ)
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        child_env.update(env or {})
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=child_env, cwd=tmp,
                                start_new_session=True)
        killed = False
        try:
            out, _ = proc.communicate(timeout=timeout + _KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            killed = True
            _kill_group(proc)
            out, _ = proc.communicate()
        except BaseException:  # KeyboardInterrupt, pytest-timeout: never leave workers behind
            _kill_group(proc)
            proc.communicate()
            raise
    text = out.decode("utf-8", errors="replace")
    outputs, launcher = split_output(text, workers)
    code = proc.returncode
    if killed or code != 0:
        what = ("killed after the hard timeout" if killed else
                f"timed out after {timeout:g} s" if code == 124 else f"failed (exit code {code})")
        raise AssertionError(format_failure(f"multi-worker job {what}: {' '.join(cmd)}",
                                            outputs, launcher))
    return outputs


def _kill_group(proc) -> None:
    """Stop the launcher and its workers: SIGTERM (the launcher stops its workers), then SIGKILL.

    Workers run in their own sessions (the launcher starts them with start_new_session), so
    their process groups are found as the launcher's children (by pid) before it goes.
    """
    workers = _children(proc.pid)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pgid in [proc.pid] + workers:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                workers = [w for w in workers if _alive(w)]
                if not workers:
                    return
        except subprocess.TimeoutExpired:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def split_output(text: str, workers: int) -> tuple[list[str], str]:
    """Split the launcher's combined output into per-worker text and the launcher's own lines."""
    per_worker: list[list[str]] = [[] for _ in range(workers)]
    other: list[str] = []
    for line in text.splitlines():
        m = _PREFIX.match(line)
        if m and int(m.group(1)) < workers:
            per_worker[int(m.group(1))].append(m.group(2))
        else:
            other.append(line)
    return ["\n".join(lines) + ("\n" if lines else "") for lines in per_worker], "\n".join(other)


def format_failure(headline: str, outputs: Sequence[str], launcher: str = "") -> str:
    parts = [headline]
    if launcher.strip():
        parts.append("----- launcher -----\n" + launcher.rstrip())
    for i, out in enumerate(outputs):
        parts.append(f"----- worker {i} -----\n" + (out.rstrip() or "(no output)"))
    return "\n".join(parts)


# --- results: child prints one marked JSON line, parent parses it per worker --------------------

def _jsonable(obj):
    if hasattr(obj, "tolist"):  # numpy arrays and scalars, tf EagerTensors via numpy()
        return obj.tolist()
    if hasattr(obj, "numpy"):
        return obj.numpy().tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def emit_result(result=None, **fields) -> None:
    """In a worker script: print ``RESULT {json}`` (numpy values become lists/floats)."""
    payload = dict(result or {}, **fields)
    print(RESULT_MARK + json.dumps(payload, default=_jsonable), flush=True)


def parse_results(outputs: Sequence[str]) -> list[dict]:
    """The last ``RESULT`` line of each worker's output, decoded.

    Raises:
      AssertionError: a worker printed no result line (with every worker's output).
    """
    results = []
    for i, out in enumerate(outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_MARK)]
        if not lines:
            raise AssertionError(format_failure(f"worker {i} printed no {RESULT_MARK.strip()} "
                                                "line", outputs))
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    return results


__all__ = ["RESULT_MARK", "emit_result", "format_failure", "parse_results", "run_workers",
           "split_output"]
