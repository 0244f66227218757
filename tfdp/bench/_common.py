"""Helpers shared by the benchmarks: sizes, statistics, round ordering, tables, environment."""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys

from tfdp.errors import invalid_argument

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
          "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, *, name: str = "size", cls=ValueError) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '4096' -> 4096 (binary units; B/KB/KiB accepted)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise invalid_argument(name, text, cls=cls,
                               fix="Use a byte count with an optional K/M/G suffix (powers of "
                                   "1024), e.g. 1K, 64K, 1M, 64M or 4096.")
    return int(m.group(1)) * _UNITS[unit]


def fmt_bytes(n: float) -> str:
    """4096 -> '4K', 67108864 -> '64M', 1536 -> '1.5K' (binary units, like the --sizes input)."""
    for unit, scale in (("G", 1024 ** 3), ("M", 1024 ** 2), ("K", 1024)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{int(n)}B"


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "mean": statistics.fmean(samples), "n": len(samples)}


def round_order(n: int, round_index: int) -> list[int]:
    """Contender order in a round: forward on even rounds, reversed on odd ones."""
    order = list(range(n))
    return order if round_index % 2 == 0 else order[::-1]


def progress(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def render_table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A plain text table; columns in ``right`` (default: all but the first) right-aligned.

    A row that is None renders as an empty separator line.
    """
    right = set(range(1, len(headers))) if right is None else right
    cells = [[str(c) for c in r] for r in rows if r is not None]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    for r in rows:
        out.append("" if r is None else line([str(c) for c in r]))
    return "\n".join(out)


def environment() -> dict:
    """Versions and host facts recorded with every result."""
    import numpy as np
    import tensorflow as tf

    from tfdp._version import __version__
    try:
        import keras
        keras_version = keras.__version__
    except Exception:  # pragma: no cover
        keras_version = None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count()
    return {"tfdp": __version__, "tensorflow": tf.__version__, "keras": keras_version,
            "numpy": np.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_cores": cores}


def configure_replicas(cpu_replicas: int) -> list[str]:
    """Split the CPU into ``cpu_replicas`` logical devices; their canonical names."""
    from tfdp import devices as devices_lib
    from tfdp.devices import configure_cpu_replicas
    names = configure_cpu_replicas(cpu_replicas)
    return [devices_lib.canonical(n) for n in names]


def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor: busbw = algbw * 2(n-1)/n."""
    return 2 * (n - 1) / n


def iters_for(seconds: float, target: float = 0.02, max_iters: int = 50) -> int:
    """Repetitions per timed sample so that one sample lasts about ``target`` seconds."""
    import math
    return max(1, min(max_iters, math.ceil(target / max(seconds, 1e-9))))


class MemoryReference:
    """The memory-bandwidth reference: ``np.add(a, b, out=c)`` over float32 buffers of N bytes.

    One thread; it reads 2N and writes N bytes, the local work of a 2-way reduction with no
    transport at all. ``step()`` runs it once; ``traffic_bytes`` is 3N.
    """

    def __init__(self, nbytes: int):
        import numpy as np
        n = max(1, nbytes // 4)
        rng = np.random.default_rng(0)
        self.a = rng.random(n, dtype=np.float32)
        self.b = rng.random(n, dtype=np.float32)
        self.c = np.empty_like(self.a)
        self.nbytes = n * 4
        self.traffic_bytes = 3 * self.nbytes

    def step(self):
        import numpy as np
        np.add(self.a, self.b, out=self.c)
        return self.c


def time_samples(step, repeats: int, target: float = 0.02, max_iters: int = 50) -> tuple:
    """(seconds per call for each of ``repeats`` samples, iterations per sample); one warm call."""
    import time
    t0 = time.perf_counter()
    step()
    n = iters_for(time.perf_counter() - t0, target, max_iters)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        samples.append((time.perf_counter() - t0) / n)
    return samples, n
