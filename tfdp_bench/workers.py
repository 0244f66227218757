"""``tfdp bench allreduce --workers N``: cross-worker all-reduce over loopback, tfdp vs MWMS.

Every contender runs as its own job of N local worker processes started through
``tfdp.launch`` (127.0.0.1, free ports, a hard timeout per job), because TF's collective runtime
is configured once per process (a second multi-worker strategy in one process hangs). In each job
every worker times a replica-context ``all_reduce(SUM)`` of the same float32 tensors for every
size (``--repeats`` samples per size, each sample repeating the step for about 20 ms), checks the
result once against the float32 sum, and worker 0 prints its figures as one JSON line. Contenders:

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

def _child(spec: dict) -> int:
    """In each launched worker: time all_reduce(SUM) of every size; worker 0 prints the result."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    kind = spec["kind"]
    if kind == MWMS_KIND:
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        info = {"cross_device_ops": _common.describe_cross_device_ops(strategy)}
    else:
        from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
        strategy = MultiWorkerDataParallelStrategy(all_reduce=spec["algorithm"],
                                                   bucket_bytes=spec["bucket_bytes"],
                                                   compression=spec["compression"])
        import tensorflow as tf
        info = {"algorithm": strategy.all_reduce, "bucket_bytes": strategy.bucket_bytes,
                "compression": strategy.compression}
    import numpy as np

    rank = int(os.environ.get("TFDP_WORKER_RANK", "0"))
    replicas = strategy.num_replicas_in_sync
    tol = _common.CHECK_TOLERANCE[spec.get("compression")] * replicas

    def say(text):
        if rank == 0:
            print(PROGRESS_MARK + text, file=sys.stderr, flush=True)

    results = []
    for nbytes in spec["sizes"]:
        counts = _split_counts(nbytes, spec["tensors"])

        def make(i, count, replica):
            return tf.random.stateless_uniform([count], seed=[i, replica], minval=-1.0,
                                               maxval=1.0)

        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, counts=counts: [make(i, c, ctx.replica_id_in_sync_group)
                                        for i, c in enumerate(counts)])

        def reduce_fn(v):
            if kind == MWMS_KIND:  # its one-device all_reduce needs device-placed values
                with tf.device(strategy.extended.worker_devices[0]):
                    v = [tf.identity(x) for x in v]
            return tf.distribute.get_replica_context().all_reduce("SUM", v)

        @tf.function
        def full(vals):
            return strategy.run(reduce_fn, args=(vals,))

        @tf.function
        def step(vals):
            return strategy.run(lambda v: tf.add_n([o[0] for o in reduce_fn(v)]), args=(vals,))

        def run_once():
            return float(strategy.experimental_local_results(step(values))[0])

        out = full(values)  # traces; the result is checked once against the float32 sum
        for i, c in enumerate(counts):
            got = strategy.experimental_local_results(out[i])[0].numpy()
            want = np.sum([make(i, c, r).numpy() for r in range(replicas)], axis=0)
            err = float(np.max(np.abs(got - want)))
            if not err <= tol:
                raise TfdpError(f"Wrong all-reduce result. Received: {kind} {info} on "
                                f"{nbytes} bytes, tensor {i}: max error {err:.3g} (allowed "
                                f"{tol:.3g}). This is a bug: please report it.")
        del out, got, want
        t0 = time.perf_counter()
        run_once()  # traces
        trace_s = time.perf_counter() - t0
        run_once()
        n = _iters(nbytes)
        samples = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            for _ in range(n):
                run_once()
            samples.append((time.perf_counter() - t0) / n)
        results.append({"bytes": sum(counts) * 4, "tensors": len(counts), "times_s": samples,
                        "iters_per_sample": n, "trace_s": trace_s})
        say(f"{_common.fmt_bytes(nbytes)} {statistics.median(samples) * 1e3:.3f} ms")
    if rank == 0:
        print(RESULT_MARK + json.dumps({"kind": kind, "replicas": replicas,
                                        "local_devices": len(strategy.extended.worker_devices),
                                        "info": info, "results": results,
                                        "environment": _common.environment()}), flush=True)
    # TF's multi-worker teardown at interpreter exit adds seconds to every job: skip it, but
    # only once every worker has its last result (a collective's receiver pulls from the
    # sender, so a worker that exits at once can still be needed). The barrier is a file per
    # worker in the parent's directory (all workers are local); without it, exit normally.
    sys.stdout.flush()
    sys.stderr.flush()
    done_dir = spec.get("done_dir")
    if done_dir and os.path.isdir(done_dir):
        open(os.path.join(done_dir, f"done-{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(done_dir, f"done-{i}"))
                   for i in range(spec["workers"])):
                os._exit(0)
            time.sleep(0.05)
    return 0


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
             on_progress=None) -> dict:
    from tfdp.launch import launch
    import tempfile
    out, err = _Capture(), _Capture(on_progress)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.pop("TFDP_CPU_REPLICAS", None)
    with tempfile.TemporaryDirectory(prefix="tfdp-bench-") as done_dir:
        spec = dict(spec, done_dir=done_dir, workers=workers)
        cmd = [sys.executable, "-m", "tfdp_bench.workers", "--child-spec", json.dumps(spec)]
        rc = launch(cmd, workers, cpu_replicas=cpu_replicas, timeout=timeout, env=env,
                    stdout=out, stderr=err)
    lines = [ln.split(RESULT_MARK, 1)[1] for ln in out.lines
             if ln.startswith("[worker 0] " + RESULT_MARK)]
    if rc != 0 or not lines:
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
    return json.loads(lines[-1])


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
        for j in _common.round_order(len(specs), r):
            spec = specs[j]
            say(f"round {r + 1}/{rounds}: {spec['name']} ({workers} workers) starting")
            kw = dict(cpu_replicas=tfdp_cpu_replicas if spec["kind"] == "tfdp" else None,
                      on_progress=lambda t, n=spec["name"]: say(f"  {n}: {t}"))
            try:
                res = _run_job(spec, workers, timeout, **kw)
            except TfdpError as e:  # one retry: a busy shared host can lose a worker
                if "Wrong all-reduce result" in str(e) or "timed out" in str(e):
                    raise
                say(f"round {r + 1}/{rounds}: {spec['name']} failed; retrying once. "
                    f"{str(e).splitlines()[-1]}")
                failures.append({"round": r + 1, "contender": spec["name"], "error": str(e)})
                res = _run_job(spec, workers, timeout, **kw)
            for i, row in enumerate(res["results"]):
                samples[spec["name"]][i] += row["times_s"]
                round_medians[spec["name"]][i].append(statistics.median(row["times_s"]))
            meta[spec["name"]] = res
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
    if len(sys.argv) == 3 and sys.argv[1] == "--child-spec":
        sys.exit(_child(json.loads(sys.argv[2])))
    sys.exit(run_standalone("workers", parse_args, run))
