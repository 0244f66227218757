"""Helpers shared by the benchmarks: sizes, statistics, round ordering, tables, environment, and
the names and checks the all-reduce benchmarks (local and across workers) share.

Imports no other module of :mod:`tfdp_bench` (every benchmark may import it) and starts no
TensorFlow at import.
"""

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


# --- shared by the all-reduce benchmarks (tfdp_bench.allreduce, tfdp_bench.workers) -------------

# DataParallelStrategy algorithms the CPU benchmarks run (tfdp.reduce.registry.ALGORITHMS minus
# "auto", which is "fused" on CPUs, and "nccl", which needs GPUs).
BENCH_ALGORITHMS = ("fused", "ring", "one_device")
COMPRESSIONS = ("none", "fp16", "bf16")
# |result - float32 sum| allowed per element, per compression, times the number of replicas
# (inputs are uniform in [-1, 1]; fp16 keeps 11 significant bits, bf16 8).
CHECK_TOLERANCE = {None: 1e-4, "fp16": 4e-3, "bf16": 3e-2}
MEMORY_NAME = "memory (np.add, 1 thread)"


def normalize_compressions(compressions) -> list:
    """"none,fp16" / ["none", "fp16"] / [None] -> [None, "fp16"] (validated, deduplicated)."""
    from tfdp.errors import TfdpError
    if compressions is None or isinstance(compressions, str):
        compressions = [c.strip() for c in (compressions or "none").split(",") if c.strip()]
    out = []
    for c in compressions:
        name = None if c is None else str(c).lower()
        if name == "none":
            name = None
        if name is not None and name not in COMPRESSIONS:
            raise TfdpError(f"Invalid compression. Received: compression={c!r}. Valid: "
                            f"{', '.join(COMPRESSIONS)}.")
        if name not in out:
            out.append(name)
    if not out:
        raise TfdpError(f"Invalid compression. Received: compression={compressions!r}. Valid: "
                        f"{', '.join(COMPRESSIONS)}.")
    return out


def tfdp_name(algorithm, bucket_bytes=None, compression=None, show_bucket=True) -> str:
    """'tfdp fused b=1M', 'tfdp fused b=1M fp16', 'tfdp ring fp16' (show_bucket=False)."""
    name = f"tfdp {algorithm}"
    if show_bucket:
        name += f" b={fmt_bytes(bucket_bytes) if bucket_bytes else 0}"
    return name + (f" {compression}" if compression else "")


def describe_cross_device_ops(strategy) -> str:
    """'CollectiveAllReduce(RING)', 'ReductionToOneDevice', ... for a MirroredStrategy."""
    from tfdp_bench._internals import collective_implementation, mirrored_cross_device_ops
    cdo = mirrored_cross_device_ops(strategy)
    if cdo is None:
        return "unknown"
    name = type(cdo).__name__
    impl = collective_implementation(cdo)
    return f"{name}({impl.name})" if impl is not None and hasattr(impl, "name") else name


def memory_note(result) -> str:
    """The sentence under an all-reduce table about its memory-bandwidth reference row."""
    rows = [(w, r) for w in result["workloads"] for r in w["results"] if r["kind"] == "memory"]
    if not rows:
        return ""
    w, r = max(rows, key=lambda wr: wr[0]["bytes"])
    return (f"The memory row is one np.add(a, b, out=c) of buffers of the row's size (one thread): "
            f"at {fmt_bytes(w['bytes'])} {r['memory_traffic_gbps']:.2f} GB/s of memory "
            "traffic (3 bytes moved per byte reduced).")
