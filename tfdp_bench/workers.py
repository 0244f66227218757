"""``tfdp bench allreduce --workers N``: cross-worker all-reduce over loopback, tfdp vs MWMS.

Contenders run in jobs of N local worker processes started through ``tfdp.launch`` (127.0.0.1,
free ports, a hard timeout per job): one job per multi-worker strategy, because TF's collective
runtime is configured once per process (a second multi-worker strategy in one process hangs).
tfdp's contenders that differ only in ``--compression`` share one job: the reducer's compression
is read when each one's step is traced, and their samples alternate in the same processes, so
the drift between jobs stays out of their ratios (``jobs_of``). In each job every worker times a
replica-context ``all_reduce(SUM)`` of the same float32 tensors for every size (``--repeats``
samples per size and contender, each sample repeating the step for about 20 ms), checks each
result once against the float32 sum, and worker 0 prints one JSON line per contender. Contenders:

* ``tfdp ALG [fp16|bf16]``: ``tfdp.MultiWorkerDataParallelStrategy(all_reduce=ALG,
  compression=...)``, one per ``--algorithms`` x ``--bucket-bytes`` x ``--compression``;
* ``MWMS ...``: ``tf.distribute.MultiWorkerMirroredStrategy()`` with its defaults (its own
  ``CollectiveAllReduce``), through the same custom step (its Keras ``fit`` path is broken with
  Keras 3); the baseline of the ratios.

References, measured by the parent in the same run (before each round's jobs, so on an idle
host): ``memory``, one ``np.add(a, b, out=c)`` over buffers of each size (one thread), and
``TCP loopback``, one Python TCP stream over 127.0.0.1 sending each size and waiting for a one-byte
acknowledgement.

Rounds (``--rounds``) run every job once, in alternating order; figures are medians over all
samples of all rounds. algbw = bytes per worker / time; busbw = algbw * 2(n-1)/n for n workers
(the references use the same formula on their own time).

``tfdp bench workers`` (the older command) is an alias of this with its own option names.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, check_writable, run_standalone, write_json
from tfdp.errors import TfdpError, UsageError, invalid_argument
from tfdp_bench.references import (  # noqa: F401
    TcpReference, loopback_tcp_bandwidth, measure_references)

RESULT_MARK = "BENCH_RESULT "
PROGRESS_MARK = "BENCH_PROGRESS "
MWMS_KIND = "mwms"
TCP_NAME = "TCP loopback (1 stream)"
DEFAULT_ROUNDS = 1
DEFAULT_REPEATS = 5
DEFAULT_TIMEOUT = 600.0
DEFAULT_ALGORITHMS = ("fused",)
# Iterations per timed sample are computed from the size (every worker must run the same number
# of collectives); this guess of the step time aims each sample at about TARGET_SAMPLE_S.
TARGET_SAMPLE_S = 0.02
MAX_ITERS = 20


def _iters(nbytes: int) -> int:
    return _common.iters_for(1e-3 + nbytes / 0.3e9, TARGET_SAMPLE_S, MAX_ITERS)


def _split_counts(nbytes: int, tensors: int) -> list[int]:
    total = max(1, nbytes // 4)
    t = max(1, min(tensors, total))
    counts = [total // t] * t
    counts[-1] += total - sum(counts)
    return counts


# --- the worker side -----------------------------------------------------------------------------

# --- the parent side: jobs -----------------------------------------------------------------------

class _Capture(io.TextIOBase):
    """The launcher's stdout/stderr: keeps every line; shows worker 0's progress lines live."""

    def __init__(self, on_progress=None):
        self.lines: list[str] = []
        self._on_progress = on_progress

    def write(self, text):
        for line in text.splitlines():
            self.lines.append(line)
            if self._on_progress and line.startswith("[worker 0] " + PROGRESS_MARK):
                self._on_progress(line.split(PROGRESS_MARK, 1)[1])
        return len(text)


def _run_job(spec: dict, workers: int, timeout: float, cpu_replicas=None,
             on_progress=None) -> list:
    from tfdp.launch import launch
    import tempfile
    out, err = _Capture(), _Capture(on_progress)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.pop("TFDP_CPU_REPLICAS", None)
    with tempfile.TemporaryDirectory(prefix="tfdp-bench-") as done_dir:
        spec = dict(spec, done_dir=done_dir, workers=workers)
        cmd = [sys.executable, "-m", "tfdp_bench.workers_child", json.dumps(spec)]
        rc = launch(cmd, workers, cpu_replicas=cpu_replicas, timeout=timeout, env=env,
                    stdout=out, stderr=err)
    lines = [ln.split(RESULT_MARK, 1)[1] for ln in out.lines
             if ln.startswith("[worker 0] " + RESULT_MARK)]
    if rc != 0 or len(lines) != len(spec["variants"]):
        text = [ln for ln in out.lines + err.lines
                if PROGRESS_MARK not in ln and "I0000 " not in ln and "absl::" not in ln]
        tails = []
        for i in range(workers):  # every worker's last lines, then the launcher's verdict
            prefix = f"[worker {i}] "
            mine = [ln for ln in text if ln.startswith(prefix) and ln[len(prefix):].strip()]
            tails.append("\n".join(mine[-12:])[-2500:])
        tails += [ln for ln in text if ln.startswith("tfdp launch")]
        what = "timed out" if rc == 124 else f"failed (exit code {rc})"
        raise TfdpError(f"The benchmark job {spec['name']!r} {what} on {workers} workers. "
                        "The end of its output:\n" + "\n".join(tails))
    return [json.loads(ln) for ln in lines]


def jobs_of(specs) -> list[dict]:
    """The jobs that run ``specs``: tfdp's contenders that differ only in compression share one
    job (their samples alternate in the same processes: the drift between jobs stays out of
    their ratios); MultiWorkerMirroredStrategy has its own (one multi-worker strategy per
    process)."""
    jobs = {}
    for s in specs:
        key = (s["kind"], s["algorithm"], s["bucket_bytes"])
        if key not in jobs:
            jobs[key] = {k: v for k, v in s.items() if k not in ("name", "compression")}
            jobs[key]["variants"] = []
        jobs[key]["variants"].append({"name": s["name"], "compression": s["compression"]})
    for job in jobs.values():
        job["name"] = " + ".join(v["name"] for v in job["variants"])
    return list(jobs.values())


def job_specs(algorithms, bucket_bytes, compressions, include_mwms=True) -> list[dict]:
    show_bucket = len(bucket_bytes) > 1 or bucket_bytes[0] is not None
    specs = [{"name": _common.tfdp_name(a, b, c, show_bucket), "kind": "tfdp", "algorithm": a,
              "bucket_bytes": b, "compression": c}
             for a in algorithms for b in bucket_bytes for c in compressions]
    if include_mwms:
        specs.append({"name": "MultiWorkerMirroredStrategy", "kind": MWMS_KIND,
                      "algorithm": None, "bucket_bytes": None, "compression": None})
    return specs


def run_allreduce_workers(workers: int = 2, sizes=("1M", "16M", "64M"),
                          algorithms=DEFAULT_ALGORITHMS, bucket_bytes=(None,),
                          compression=(None,), repeats: int = DEFAULT_REPEATS,
                          rounds: int = DEFAULT_ROUNDS, tensors: int = 1,
                          timeout: float = DEFAULT_TIMEOUT, include_mwms: bool = True,
                          tfdp_cpu_replicas: int | None = None,
                          progress: bool = False) -> dict:
    """Cross-worker all-reduce, every contender as its own job of ``workers`` local processes.

    Args:
      workers: N >= 2 worker processes on 127.0.0.1 per job.
      sizes: bytes of float32 per worker (ints or "64K"-style strings), each split into
        ``tensors`` tensors.
      algorithms, bucket_bytes, compression: tfdp contenders (every combination).
      repeats: timed samples per size in each job.
      rounds: every job runs once per round, in alternating order.
      timeout: seconds per job (the launcher stops all its workers after that).
      include_mwms: run MultiWorkerMirroredStrategy (the baseline of the ratios).
      tfdp_cpu_replicas: logical CPU devices per worker for tfdp's jobs (default one; MWMS
        always uses one device per worker).
      progress: progress lines (per round, job and size, with elapsed time) on stderr.

    Returns:
      A dict like :func:`tfdp_bench.allreduce.run_allreduce`'s, with ``"mode": "workers"``,
      ``"workers"``, ``"rounds"``, ``"baseline"`` and per result ``"ratio_mwms_over_this"``.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise invalid_argument("workers", workers, fix="A cross-worker benchmark needs at least "
                               "2 workers.")
    for name, value in (("repeats", repeats), ("rounds", rounds), ("tensors", tensors)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_argument(name, value, fix="Pass an int >= 1.")
    algorithms = [algorithms] if isinstance(algorithms, str) else list(algorithms)
    bad = [a for a in algorithms if a not in _common.BENCH_ALGORITHMS]
    if bad or not algorithms:
        raise invalid_argument("algorithms", algorithms, valid=_common.BENCH_ALGORITHMS)
    bucket_bytes = [bucket_bytes] if bucket_bytes is None or isinstance(bucket_bytes, int) \
        else list(bucket_bytes)
    compressions = ([] if isinstance(compression, (list, tuple)) and not compression
                    else _common.normalize_compressions(compression))
    if not compressions and not include_mwms:
        raise invalid_argument("compression", compression, fix="Nothing to measure: give a "
                               "compression or include MultiWorkerMirroredStrategy.")
    sizes = [_common.parse_size(s) if isinstance(s, str) else int(s) for s in sizes]
    specs = job_specs(algorithms, bucket_bytes, compressions, include_mwms)
    for s in specs:
        s.update(sizes=sizes, tensors=tensors, repeats=repeats)
    jobs = jobs_of(specs)

    start = time.monotonic()

    def say(text):
        _common.progress(f"[{time.monotonic() - start:6.1f} s] {text}", progress)

    samples = {s["name"]: [[] for _ in sizes] for s in specs}
    round_medians = {s["name"]: [[] for _ in sizes] for s in specs}
    refs = {"memory": [[] for _ in sizes], "tcp": [[] for _ in sizes]}
    meta, iters, failures = {}, {}, []
    for r in range(rounds):
        say(f"round {r + 1}/{rounds}: references (memory, loopback TCP)")
        ref = measure_references(sizes, repeats)
        for key in refs:
            for i in range(len(sizes)):
                refs[key][i] += ref[key][i]
        iters["memory"], iters["tcp"] = ref["memory_iters"], ref["tcp_iters"]
        for j in _common.round_order(len(jobs), r):
            spec = jobs[j]
            say(f"round {r + 1}/{rounds}: {spec['name']} ({workers} workers) starting")
            kw = dict(cpu_replicas=tfdp_cpu_replicas if spec["kind"] == "tfdp" else None,
                      on_progress=lambda t: say(f"  {t}"))
            try:
                res = _run_job(spec, workers, timeout, **kw)
            except TfdpError as e:  # one retry: a busy shared host can lose a worker
                if "Wrong all-reduce result" in str(e) or "timed out" in str(e):
                    raise
                say(f"round {r + 1}/{rounds}: {spec['name']} failed; retrying once. "
                    f"{str(e).splitlines()[-1]}")
                failures.append({"round": r + 1, "contender": spec["name"], "error": str(e)})
                res = _run_job(spec, workers, timeout, **kw)
            for variant in res:
                name = variant["name"]
                for i, row in enumerate(variant["results"]):
                    samples[name][i] += row["times_s"]
                    round_medians[name][i].append(statistics.median(row["times_s"]))
                meta[name] = variant
    say("done")

    mwms_name = next((s["name"] for s in specs if s["kind"] == MWMS_KIND), None)
    if mwms_name is not None:  # name it after the cross-device ops it used
        desc = meta[mwms_name]["info"].get("cross_device_ops", "")
        new = f"MWMS {desc}".strip()
        for d in (samples, round_medians, meta):
            d[new] = d.pop(mwms_name)
        for s in specs:
            if s["name"] == mwms_name:
                s["name"] = new
        mwms_name = new
    factor = _common.busbw_factor(workers)
    contenders = []
    for s in specs:
        m = meta[s["name"]]
        contenders.append({"name": s["name"], "kind": s["kind"], "replicas": m["replicas"],
                           "local_devices": m["local_devices"], **m["info"]})
    contenders.append({"name": _common.MEMORY_NAME, "kind": "memory",
                       "note": "np.add(a, b, out=c) over float32 buffers of each size, in the "
                               "parent process"})
    contenders.append({"name": TCP_NAME, "kind": "tcp",
                       "note": "one Python TCP stream over 127.0.0.1 sending each size, then a "
                               "1-byte acknowledgement"})
    workloads = []
    for i, size in enumerate(sizes):
        rows = []
        for c in contenders:
            if c["kind"] in ("memory", "tcp"):
                times = refs[c["kind"]][i]
                n_iter, per_round = iters[c["kind"]][i], None
                nbytes = size
            else:
                times = samples[c["name"]][i]
                row0 = meta[c["name"]]["results"][i]
                n_iter, per_round, nbytes = row0["iters_per_sample"], round_medians[c["name"]][i], \
                    row0["bytes"]
            st = _common.summarize(times)
            algbw = nbytes / st["median"] / 1e9
            row = {"contender": c["name"], "kind": c["kind"], "times_s": times,
                   "iters_per_sample": n_iter, "median_s": st["median"], "min_s": st["min"],
                   "max_s": st["max"], "mean_s": st["mean"], "algbw_gbps": algbw,
                   "busbw_gbps": algbw * factor}
            if per_round is not None:
                row["round_medians_s"] = per_round
            if c["kind"] == "memory":
                row["memory_traffic_gbps"] = 3 * nbytes / st["median"] / 1e9
            rows.append(row)
        base = next((r for r in rows if r["contender"] == mwms_name), None)
        for row in rows:
            row["ratio_mwms_over_this"] = base["median_s"] / row["median_s"] if base else None
        nbytes = meta[specs[0]["name"]]["results"][i]["bytes"]
        workloads.append({"name": _common.fmt_bytes(size), "size_arg": size, "bytes": nbytes,
                          "tensors": meta[specs[0]["name"]]["results"][i]["tensors"],
                          "results": rows})
    return {
        "benchmark": "allreduce", "mode": "workers", "workers": workers, "model": "sizes",
        "repeats": repeats, "rounds": rounds, "tensors_per_size": tensors,
        "algorithms": algorithms, "compression": [c or "none" for c in compressions],
        "baseline": mwms_name, "contenders": contenders, "workloads": workloads,
        "loopback_tcp_stream_gbps": max((r["algbw_gbps"] for w in workloads
                                         for r in w["results"] if r["kind"] == "tcp"),
                                        default=None),
        "environment": meta[specs[0]["name"]]["environment"],
        "elapsed_s": time.monotonic() - start, "retried_jobs": failures,
        "notes": {"time": "seconds per all-reduce: median over all samples of all rounds",
                  "algbw_gbps": "bytes per worker / median time, 1e9 B/s",
                  "busbw_gbps": "algbw * 2 (n-1) / n, n = workers (nccl-tests); the reference "
                                "rows use the same formula on their own time",
                  "ratio_mwms_over_this": "MultiWorkerMirroredStrategy median / this median: "
                                          "> 1 means faster than MWMS",
                  "memory": "np.add(a, b, out=c) over buffers of the size, one thread "
                            "(memory_traffic_gbps counts the 3x bytes moved)",
                  "tcp": "one Python TCP stream over 127.0.0.1: send the size, wait for a "
                         "1-byte acknowledgement"},
    }


def format_workers(result: dict) -> str:
    n = result["workers"]
    env = result["environment"]
    reps = {c["replicas"] for c in result["contenders"] if "replicas" in c}
    lines = [f"tfdp bench allreduce: {n} workers over loopback (127.0.0.1), "
             f"{result['rounds']} round(s) x {result['repeats']} samples per size, "
             f"{result['tensors_per_size']} float32 tensor(s) per size, TF {env['tensorflow']}, "
             f"{env['cpu_cores']} cores; replicas in sync: {', '.join(map(str, sorted(reps)))}"]
    has_base = result.get("baseline") is not None
    headers = ["size", "contender", "time ms", "min ms", "algbw GB/s", "busbw GB/s"]
    if has_base:
        headers.append("MWMS/this")
    rows = []
    for w in result["workloads"]:
        if rows:
            rows.append(None)
        for i, r in enumerate(w["results"]):
            row = [w["name"] if i == 0 else "", r["contender"], f"{r['median_s'] * 1e3:.3f}",
                   f"{r['min_s'] * 1e3:.3f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"]
            if has_base:
                row.append("" if r["kind"] in ("memory", "tcp")
                           else f"{r['ratio_mwms_over_this']:.2f}")
            rows.append(row)
    lines += ["", _common.render_table(headers, rows, right=set(range(2, len(headers)))), "",
              f"busbw = algbw * 2(n-1)/n with n = {n} workers (nccl-tests)."
              + (" MWMS/this = MultiWorkerMirroredStrategy's median / this median; > 1: faster "
                 "than MWMS." if has_base else ""),
              "References (measured by the parent in the same run): " + _common.memory_note(result)
              + " TCP loopback: one Python stream sends the size and waits for a 1-byte "
              "acknowledgement (the transport's single-stream ceiling)."]
    return "\n".join(lines)


# --- `tfdp bench workers`: the older command line, kept as an alias ------------------------------

CONTENDERS = ("tfdp", "tfdp-fp16", "mwms")


def build_parser():
    p = BenchParser("tfdp bench workers",
                    description="Cross-worker all-reduce over loopback: tfdp, tfdp fp16 and "
                            "MultiWorkerMirroredStrategy, plus memory and loopback TCP "
                            "references. An alias of 'tfdp bench allreduce --workers 2 --sizes "
                            "64M --compression none,fp16 --tensors 32 --rounds 3'.")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--cpu-replicas", type=int, default=1,
                   help="tfdp CPU replicas per worker (default 1: MWMS uses one device per worker)")
    p.add_argument("--size", default="64M", help="bytes of float32 per worker (default 64M)")
    p.add_argument("--tensors", type=int, default=32, help="split into this many tensors")
    p.add_argument("--steps", type=int, default=DEFAULT_REPEATS,
                   help=f"timed samples per job (default {DEFAULT_REPEATS})")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)}")
    p.add_argument("--json", metavar="FILE", help="write all figures to FILE")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds per job (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("workers", "steps", "rounds", "tensors", "cpu_replicas"):
        if getattr(args, name) < 1:
            raise invalid_argument("--" + name.replace("_", "-"), getattr(args, name),
                                   cls=UsageError, fix="Pass a positive integer.")
    if args.workers < 2:
        raise invalid_argument("--workers", args.workers, cls=UsageError,
                               fix="A cross-worker benchmark needs at least 2 workers.")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if not contenders or any(c not in CONTENDERS for c in contenders):
        raise invalid_argument("--contenders", args.contenders, valid=CONTENDERS, cls=UsageError)
    args.contenders = contenders
    args.size = _common.parse_size(args.size, name="--size", cls=UsageError)
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    contenders, size = args.contenders, args.size
    compressions = [c for c, name in ((None, "tfdp"), ("fp16", "tfdp-fp16")) if name in contenders]
    result = run_allreduce_workers(
        workers=args.workers, sizes=[size], algorithms=["fused"], compression=compressions,
        repeats=args.steps, rounds=args.rounds, tensors=args.tensors, timeout=args.timeout,
        include_mwms="mwms" in contenders,
        tfdp_cpu_replicas=args.cpu_replicas if args.cpu_replicas > 1 else None,
        progress=not args.quiet)
    print(format_workers(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


def main(argv=None) -> int:
    """``tfdp bench workers`` in process (usage errors raise UsageError)."""
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(run_standalone("workers", parse_args, run))
