"""``tfdp bench workers``: cross-worker all-reduce over loopback, tfdp vs MultiWorkerMirroredStrategy.

One command runs everything side by side: the raw loopback TCP bandwidth of one Python stream
(the transport's ceiling), then rounds in which each contender is started as a job of N local
workers through ``tfdp.launch`` (so each gets a fresh TF runtime; collective ops are configured
once per process) and times a replica-context ``all_reduce(SUM)`` of the same tensors (default:
64 MiB of float32 in 32 tensors per worker). Contenders:

* ``tfdp``: ``tfdp.DataParallelStrategy()`` (multi-worker from the launcher's TF_CONFIG);
* ``tfdp-fp16``: the same with ``compression="fp16"``;
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy()`` with its defaults, through a custom
  step (its Keras ``fit`` path is broken with Keras 3).

Figures: median ms per all-reduce over rounds (each round's figure is the median of its steps),
algbw = bytes / time, busbw = algbw * 2(n-1)/n for n workers, and the ratio mwms / contender.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import threading
import time

from tfdp.errors import UsageError, invalid_argument

CONTENDERS = ("tfdp", "tfdp-fp16", "mwms")
RESULT_MARK = "BENCH_RESULT "


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message[:1].upper()}{message[1:]}. "
                         "Run 'tfdp bench workers --help' for usage.")


def build_parser():
    p = _Parser(prog="tfdp bench workers", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--cpu-replicas", type=int, default=1,
                   help="tfdp CPU replicas per worker (default 1: MWMS uses one device per worker)")
    p.add_argument("--size", default="64M", help="bytes of float32 per worker (default 64M)")
    p.add_argument("--tensors", type=int, default=32, help="split into this many tensors")
    p.add_argument("--steps", type=int, default=8, help="timed all-reduces per job (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)}")
    p.add_argument("--json", metavar="FILE", help="write all figures to FILE")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


# --- the worker side ---------------------------------------------------------------------------

def _child(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    mode = args.child
    if mode == "mwms":
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import tfdp
        strategy = tfdp.DataParallelStrategy(
            compression="fp16" if mode == "tfdp-fp16" else None)
        import tensorflow as tf
    from tfdp.bench._common import parse_size
    total = parse_size(args.size) // 4
    sizes = [total // args.tensors] * args.tensors
    sizes[-1] += total - sum(sizes)

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.random.stateless_uniform([n], seed=[i, ctx.replica_id_in_sync_group])
                     for i, n in enumerate(sizes)])

    @tf.function
    def step(vals):
        def fn(v):
            if mode == "mwms":  # its one-device all_reduce needs device-placed values
                with tf.device(strategy.extended.worker_devices[0]):
                    v = [tf.identity(x) for x in v]
            out = tf.distribute.get_replica_context().all_reduce("SUM", v)
            return tf.add_n([o[0] for o in out])
        return strategy.run(fn, args=(vals,))

    def sync(x):
        return float(strategy.experimental_local_results(x)[0])

    for _ in range(2):
        sync(step(values))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sync(step(values))
        times.append(time.perf_counter() - t0)
    print(RESULT_MARK + json.dumps({"mode": mode, "ms": [t * 1e3 for t in times],
                                    "replicas": strategy.num_replicas_in_sync,
                                    "bytes": total * 4}), flush=True)
    return 0


# --- the parent side ---------------------------------------------------------------------------

def loopback_tcp_bandwidth(total_bytes: int = 512 << 20, chunk: int = 4 << 20) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (a sender thread, a receiver thread)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def receive():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        with conn:
            while received[0] < total_bytes:
                n = conn.recv_into(view)
                if not n:
                    break
                received[0] += n

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    payload = b"\0" * chunk
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        t0 = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            c.sendall(payload)
            sent += chunk
        t.join(timeout=60)
        seconds = time.perf_counter() - t0
    server.close()
    return received[0] / seconds


def _run_job(mode, args) -> dict:
    from tfdp.launch import launch
    cmd = [sys.executable, "-m", "tfdp.bench.workers", "--child", mode, "--size", args.size,
           "--tensors", str(args.tensors), "--steps", str(args.steps)]
    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    rc = launch(cmd, args.workers, cpu_replicas=args.cpu_replicas if mode != "mwms" else None,
                timeout=args.timeout, env=env, stdout=out, stderr=err)
    lines = [ln.split(RESULT_MARK, 1)[1] for ln in out.getvalue().splitlines()
             if RESULT_MARK in ln and ln.startswith("[worker 0]")]
    if rc != 0 or not lines:
        text = out.getvalue().splitlines() + err.getvalue().splitlines()
        tail = "\n".join(ln for ln in text if "Traceback" in ln or "Error" in ln or
                         "failed" in ln)[-3000:]
        raise RuntimeError(f"benchmark job {mode!r} failed (exit code {rc}):\n{tail}")
    return json.loads(lines[-1])


def run_workers_bench(args) -> dict:
    from tfdp.bench._common import parse_size
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bw = loopback_tcp_bandwidth()
    print(f"raw loopback TCP, one Python stream: {bw / 1e9:.2f} GB/s", flush=True)
    per_mode = {c: [] for c in contenders}
    meta = {}
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            print(f"round {r + 1}/{args.rounds}: {c} ...", file=sys.stderr, flush=True)
            res = _run_job(c, args)
            per_mode[c].append(statistics.median(res["ms"]))
            meta[c] = res
    n = args.workers
    nbytes = parse_size(args.size)
    rows = {}
    for c in contenders:
        med = statistics.median(per_mode[c])
        algbw = nbytes / (med / 1e3)
        rows[c] = {"median_ms": med, "rounds_ms": per_mode[c], "algbw_GBps": algbw / 1e9,
                   "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9,
                   "replicas": meta[c]["replicas"]}
    base = rows.get("mwms", {}).get("median_ms")
    print(f"\n{n} workers over loopback, {args.size} float32 in {args.tensors} tensors per worker, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'contender':<11}{'replicas':>9}{'ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"
          f"{'mwms/this':>11}")
    for c, row in rows.items():
        ratio = f"{base / row['median_ms']:.2f}x" if base else "-"
        print(f"{c:<11}{row['replicas']:>9}{row['median_ms']:>10.1f}{row['algbw_GBps']:>12.2f}"
              f"{row['busbw_GBps']:>12.2f}{ratio:>11}")
    print(f"busbw / raw loopback TCP: " + ", ".join(
        f"{c} {row['busbw_GBps'] * 1e9 / bw:.0%}" for c, row in rows.items()))
    result = {"loopback_tcp_GBps": bw / 1e9, "workers": n, "bytes": nbytes,
              "tensors": args.tensors, "contenders": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _child(args)
    for name in ("workers", "steps", "rounds", "tensors"):
        if getattr(args, name) < 1:
            raise invalid_argument("--" + name, getattr(args, name), cls=UsageError,
                                   fix="Pass a positive integer.")
    if args.workers < 2:
        raise invalid_argument("--workers", args.workers, cls=UsageError,
                               fix="A cross-worker benchmark needs at least 2 workers.")
    if args.cpu_replicas < 1:
        raise invalid_argument("--cpu-replicas", args.cpu_replicas, cls=UsageError,
                               fix="Pass a positive integer.")
    bad = [c for c in args.contenders.split(",") if c.strip() not in CONTENDERS]
    if bad:
        raise invalid_argument("--contenders", args.contenders, valid=CONTENDERS, cls=UsageError)
    from tfdp.bench._common import parse_size
    parse_size(args.size, name="--size", cls=UsageError)
    run_workers_bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
