"""``tfdp bench crossworker``: the cross-worker bucket cap, measured in one job.

Runs N local workers through ``tfdp launch`` (127.0.0.1, a hard timeout); inside them every
contender lives in the same worker processes and runs in alternating order, round after round
(separate jobs per contender, as ``tfdp bench allreduce --workers`` runs them, add the drift
between jobs to a comparison). Each contender is ``strategy.run`` of a replica-context
``all_reduce("SUM")`` of ``--tensors`` float32 tensors (``--mbytes`` MB in all, one replica per
worker) under ``MultiWorkerDataParallelStrategy``, traced with one bucket cap (the strategy's
``bucket_bytes``, which with one replica per worker is the cross-worker bucket) and compression
(its ``compression``), set on the strategy's reducer while the contender is traced:

* ``cap 1M``: one collective per tensor of 1 MiB or more (tfdp before the cap applied to
  uncompressed buckets);
* ``cap 4M`` ... ``cap 64M``: tensors packed into buckets of up to that many bytes;
* ``fp16 cap 64M``: compressed (the compressed default);
* ``raw f32``: one ``CollectiveReduceV2`` (ring, 16 subdivisions) of the packed buffer, the
  transport's own rate for reference.

Worker 0 prints the median ms per contender, algbw (MB reduced / time), the ratio against
``cap 1M`` with its spread over rounds, and writes ``--json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from tfdp_bench import _common
from tfdp_bench.parser import (BenchParser, check_positive, check_writable, split_list,
                               write_json)
from tfdp.errors import TfdpError, UsageError

DEFAULT_CAPS = ("1M", "4M", "16M", "32M", "64M")
RESULT_PREFIX = "TFDP_CROSSWORKER_RESULT "


def _worker_main(config):
    """Inside each worker (``tfdp launch``): time every contender, worker 0 prints the result."""
    import tfdp
    strategy = tfdp.DataParallelStrategy()
    import tensorflow as tf

    n_floats = config["mbytes"] * 1024 * 1024 // 4
    tensors = config["tensors"]
    dev = strategy.extended.worker_devices[0]
    rank = strategy.cluster.rank
    with tf.device(dev):
        xs = [tf.random.stateless_uniform([n_floats // tensors], seed=[rank, i], minval=-1.0,
                                          maxval=1.0) for i in range(tensors)]
    ops = strategy.cross_device_ops
    # One strategy for every contender: a second multi-worker strategy in the same processes
    # would reuse the cross-worker group and instance keys with other bucket shapes. The reducer
    # reads its bucket_bytes and compression (DataParallelStrategy's arguments of the same
    # names) when a function is traced, so each contender is traced with its own; with one
    # replica per worker, bucket_bytes is the cross-worker bucket (uncompressed; compressed
    # buckets are at least the compressed cap).
    defaults = (ops.bucket_bytes, ops.compression)

    def via_strategy(cap, compression):
        @tf.function
        def f():
            def fn():
                outs = tf.distribute.get_replica_context().all_reduce("SUM", xs)
                return tf.add_n([tf.reshape(o, [-1])[0] for o in outs])
            return strategy.run(fn)
        ops.bucket_bytes = defaults[0] if cap is None else cap
        ops.compression = compression
        try:
            f()  # traced here, with these settings
        finally:
            ops.bucket_bytes, ops.compression = defaults
        return f

    def raw():
        @tf.function
        def f():
            with tf.device(dev):
                buf = tf.concat([tf.reshape(x, [-1]) for x in xs], 0)
                out = tf.raw_ops.CollectiveReduceV2(
                    input=buf, group_size=strategy.cluster.num_workers, group_key=1 << 27,
                    instance_key=7, ordering_token=[], merge_op="Add", final_op="Id",
                    communication_hint="ring", timeout_seconds=0.0, max_subdivs_per_device=16)
                return tf.reduce_sum(out[:8])
        f()
        return f

    contenders = {}
    for cap in config["caps"]:
        contenders[f"cap {_common.fmt_bytes(cap)}"] = via_strategy(cap, None)
    contenders["fp16 cap 64M"] = via_strategy(64 * 1024 * 1024, "fp16")
    default_name = f"default (cap {_common.fmt_bytes(ops.packed_bucket_bytes())})"
    contenders[default_name] = via_strategy(None, None)
    contenders["raw f32 (one collective)"] = raw()
    times = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(config["rounds"]):
        for name in _common.round_order(len(names), r):
            name = names[name]
            t0 = time.perf_counter()
            float(contenders[name]())
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        print(RESULT_PREFIX + json.dumps({"times_s": times, "order": names}), flush=True)


def run_crossworker(workers: int = 2, mbytes: int = 64, tensors: int = 32, rounds: int = 11,
                    caps=DEFAULT_CAPS, timeout: float = 600, progress: bool = False) -> dict:
    caps = [_common.parse_size(c, name="caps", cls=TfdpError) if isinstance(c, str) else int(c)
            for c in caps]
    config = {"mbytes": mbytes, "tensors": tensors, "rounds": rounds, "caps": caps}
    cmd = [sys.executable, "-m", "tfdp", "launch", "--workers", str(workers), "--timeout",
           str(int(timeout)), "--", sys.executable, "-m", "tfdp_bench.crossworker",
           "--worker-config", json.dumps(config)]
    _common.progress(f"crossworker: {workers} workers, {mbytes} MB in {tensors} tensors, "
                     f"{rounds} rounds", progress)
    env = dict(os.environ, TFDP_CPU_REPLICAS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    line = next((ln for ln in proc.stdout.splitlines() if RESULT_PREFIX in ln), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise TfdpError(f"The cross-worker job failed. Received: exit code {proc.returncode}; "
                        f"last output:\n{tail}")
    raw = json.loads(line.split(RESULT_PREFIX, 1)[1])
    times = raw["times_s"]
    base = times[raw["order"][0]]
    results = []
    for name in raw["order"]:
        ts = times[name]
        med = statistics.median(ts)
        ratios = [b / t for b, t in zip(base, ts)]
        results.append({"contender": name, "times_s": ts, "median_ms": med * 1e3,
                        "algbw_gbps": mbytes * 1024 * 1024 / med / 1e9,
                        "ratio_over_first": statistics.median(base) / med,
                        "ratio_spread": [min(ratios), max(ratios)]})
    return {"benchmark": "crossworker", "workers": workers, "mbytes": mbytes, "tensors": tensors,
            "rounds": rounds, "results": results, "environment": _common.environment()}


def format_crossworker(result: dict) -> str:
    lines = [f"tfdp bench crossworker: {result['workers']} workers on 127.0.0.1, one replica "
             f"each; all_reduce(SUM) of {result['mbytes']} MB float32 in {result['tensors']} "
             f"tensors; {result['rounds']} alternating rounds in one job", ""]
    first = result["results"][0]["contender"]
    headers = ["contender", "median ms", "algbw GB/s", f"vs {first} (spread)"]
    rows = [[r["contender"], f"{r['median_ms']:.1f}", f"{r['algbw_gbps']:.3f}",
             f"{r['ratio_over_first']:.2f}x ({r['ratio_spread'][0]:.2f}-"
             f"{r['ratio_spread'][1]:.2f})"] for r in result["results"]]
    lines.append(_common.render_table(headers, rows))
    lines += ["", f"vs {first}: its median / this median (> 1: faster); spread: min-max of the "
                  "per-round ratios. algbw: bytes reduced / time."]
    return "\n".join(lines)


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench crossworker",
                    description="The cross-worker bucket cap of tfdp's multi-worker reduction, "
                                "measured in one job of N local workers (all contenders in the "
                                "same processes, alternating rounds).")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="default: 2")
    p.add_argument("--mbytes", type=int, default=64, metavar="MB", help="default: 64")
    p.add_argument("--tensors", type=int, default=32, metavar="T", help="default: 32")
    p.add_argument("--rounds", type=int, default=11, metavar="R", help="default: 11")
    p.add_argument("--caps", default=",".join(DEFAULT_CAPS), metavar="LIST",
                   help=f"bucket caps (K/M suffixes; default: {','.join(DEFAULT_CAPS)})")
    p.add_argument("--timeout", type=int, default=600, metavar="SECONDS", help="default: 600")
    p.add_argument("--json", metavar="FILE", help="write every raw figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--worker-config", help="(internal: run as one worker of the job)")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.worker_config:
        return args
    check_positive("--workers", args.workers, minimum=2)
    for name in ("mbytes", "tensors", "rounds", "timeout"):
        check_positive("--" + name, getattr(args, name))
    caps = []
    for c in split_list(args.caps):
        try:
            caps.append(_common.parse_size(c, name="--caps", cls=UsageError))
        except UsageError:
            raise
    if not caps or min(caps) < 1:
        raise UsageError(f"Invalid --caps. Received: --caps {args.caps!r}. Give sizes >= 1, "
                         "e.g. 1M,16M,64M.")
    args.caps = caps
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    if args.worker_config:
        _worker_main(json.loads(args.worker_config))
        return 0
    result = run_crossworker(workers=args.workers, mbytes=args.mbytes, tensors=args.tensors,
                             rounds=args.rounds, caps=args.caps, timeout=args.timeout,
                             progress=not args.quiet)
    print(format_crossworker(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.crossworker
    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("crossworker", parse_args, run))
