"""One line when a program's first tfdp strategy is created: replicas, devices, workers.

A two-line script (``import tfdp``; ``tfdp.set_default_strategy()``) should say what it runs on:
how many replicas, on which devices, across how many workers, and, on a single CPU device, how
to get more. The line goes through the ``tfdp`` logger at INFO. A program that configured
logging decides itself whether INFO shows (``logging.basicConfig(level=logging.INFO)`` shows it,
``logging.getLogger("tfdp").setLevel(logging.WARNING)`` or ``logging.disable`` turns it off);
a program that configured nothing gets it on stderr, once per process (the first strategy;
later ones only log). ``tfdp train`` and ``tfdp bench`` print their own headers instead. With
``zero_stage`` 1 or 2 the line names the stage, and the first training step shows one more line
the same way, the sharded state's effect (``tfdp.zero.state.ZeroState.effect_line``).
"""

from __future__ import annotations

import logging
import sys
import threading

from tfdp import devices as devices_lib

log = logging.getLogger("tfdp")
_shown = {"done": False}
_lock = threading.Lock()


def logging_configured(logger: logging.Logger = log) -> bool:
    """Whether the program configured Python logging in a way that decides over tfdp's INFO
    lines: handlers on the root or the tfdp logger, a level set on the tfdp logger, or
    ``logging.disable``."""
    return bool(logging.root.handlers or logger.handlers or logger.level != logging.NOTSET
                or logging.root.manager.disable >= logging.INFO
                or not logger.propagate)


def device_list(devices) -> str:
    """'CPU:0, CPU:1' or 'GPU:0..GPU:7' (a contiguous run of one kind)."""
    names = [devices_lib.short_name(d) for d in devices]
    kinds = {n.rsplit(":", 1)[0] for n in names}
    if len(names) > 3 and len(kinds) == 1:
        idx = [int(n.rsplit(":", 1)[1]) for n in names]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return f"{names[0]}..{names[-1]}"
    return ", ".join(names)


def _cpu_source(names) -> str:
    """Where the CPU replica count came from (empty for GPUs)."""
    if any("GPU" in n for n in names):
        return ""
    explicit = devices_lib._explicit["n"]   # pylint: disable=protected-access  (same package)
    if explicit is not None:
        return f"tfdp.configure_cpu_replicas({explicit})"
    env = devices_lib._env_count()   # pylint: disable=protected-access
    if env is not None:
        return f"{devices_lib.CPU_REPLICAS_ENV}={env}"
    return ""


def strategy_line(strategy) -> str:
    """The line for ``strategy`` (a tfdp strategy whose extended exists)."""
    ext = strategy.extended
    local = list(ext.worker_devices)
    names = [devices_lib.short_name(d) for d in local]
    total = strategy.num_replicas_in_sync
    cluster = getattr(strategy, "cluster", None)
    workers = getattr(cluster, "num_workers", 1) if cluster is not None else 1
    source = _cpu_source(names)
    if workers > 1:
        where = (f"{total} replicas = {workers} workers x {len(local)} ({device_list(local)} on "
                 f"each{'; ' + source if source else ''}); this is worker {cluster.rank} "
                 f"({cluster.address})")
    else:
        where = (f"{total} replica{'s' if total != 1 else ''} on {device_list(local)}"
                 f"{f' ({source})' if source else ''}, 1 worker")
    tail = f"; all_reduce {ext.tfdp_choice.algorithm!r}" if total > 1 else ""
    stage = ext.tfdp_settings.zero_stage
    if stage:
        tail += (f"; zero_stage={stage}: optimizer state sharded over the {len(local)} local "
                 f"replica{'s' if len(local) != 1 else ''}"
                 + (", gradients summed onto their owners" if stage == 2 else ""))
    k = ext.tfdp_micro_batches
    if k > 1:
        settings = ext.tfdp_settings
        tail += (f"; each replica's batch in {k} micro-batches per training step"
                 + (f" (elastic policy 'accumulate': {workers} of the job's "
                    f"{settings.elastic_max_workers} workers)"
                    if settings.micro_batches is None else ""))
    if total == 1 and names[0].startswith("CPU"):
        tail += (f"; for n CPU replicas set {devices_lib.CPU_REPLICAS_ENV}=n (or call "
                 "tfdp.configure_cpu_replicas(n) before TensorFlow starts)")
    return f"tfdp: {type(strategy).__name__}: {where}{tail}"


def announce(strategy) -> None:
    """Show :func:`strategy_line` (see the module docstring for where it goes)."""
    show(strategy_line(strategy), once=True)


def show(line: str, once: bool = False) -> None:
    """One line where the strategy's line goes: the ``tfdp`` logger at INFO when the program
    configured logging, else stderr (``once``: only the process's first such line; the sharded
    state's line at the first step is shown once per strategy by its caller)."""
    if logging_configured():
        log.info("%s", line)
        return
    if once:
        with _lock:
            if _shown["done"]:
                return
            _shown["done"] = True
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


__all__ = ["announce", "device_list", "logging_configured", "show", "strategy_line"]
