"""``tfdp bench scaling``: predicted data-parallel scaling efficiency for 1..1024 devices.

The model is the alpha-beta cost of a ring all-reduce of the gradients (S bytes per device,
n devices, link bandwidth B bytes/s, per-message latency alpha s)::

    t_comm(n) = 2(n-1)/n * S/B + 2(n-1) * alpha

(2(n-1) steps, reduce-scatter then all-gather, each sending S/n bytes and paying alpha once).
With weak scaling (a fixed per-device batch, so the compute time per step stays t_compute)::

    t_step(n)   = t_compute + (1 - overlap) * t_comm(n)
    efficiency  = t_compute / t_step(n)
    speed-up    = n * efficiency          (throughput relative to one device)

``overlap`` is the fraction of the communication hidden behind the backward pass (0: none).
As n grows the bandwidth term tends to 2 S/B and the latency term grows linearly in n.

With figures given on the command line (``--step-ms``, ``--grad-mb``, ``--bandwidth-gbps``,
``--alpha-us``) the command only prints the table. With ``--measure`` it first measures tfdp's
cross-worker all_reduce here (N local workers through ``tfdp.launch`` over loopback, one CPU
replica each, a few sizes), least-squares fits alpha and B to those times, prints the measured
vs predicted time of every point, then the 1..1024 table with the fitted figures.

Units: MB = 10^6 bytes, Gbit/s = 10^9 bits/s (so 10 Gbit/s = 1.25 GB/s); --measure sizes take
K/M/G suffixes in powers of 1024, as elsewhere in ``tfdp bench``.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import sys
import time

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, check_writable, run_standalone, write_json
from tfdp.errors import TfdpError, UsageError

FORMULA = ("t_comm(n) = 2(n-1)/n * S/B + 2(n-1)*alpha;  "
           "t_step(n) = t_compute + (1-overlap)*t_comm(n);  "
           "efficiency = t_compute/t_step(n);  speed-up = n*efficiency")
DEFAULT_DEVICES = tuple(2 ** i for i in range(11))  # 1, 2, 4, ..., 1024
DEFAULT_STEP_MS = 100.0   # used with --measure when --step-ms is not given
DEFAULT_GRAD_MB = 100.0   # about ResNet-50's float32 gradients (25.6 M parameters)
MEASURE_WORKERS = "2,3"
MEASURE_SIZES = "256K,1M,4M,16M"
MEASURE_STEPS = 10
RESULT_MARK = "SCALING_RESULT "


# --- the model -----------------------------------------------------------------------------------

def ring_allreduce_time(n: int, size_bytes: float, bandwidth_Bps: float, alpha_s: float) -> float:
    """Seconds for a ring all-reduce of ``size_bytes`` over ``n`` devices (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"Invalid n. Received: n={n!r}. Give at least 1 device.")
    if bandwidth_Bps <= 0:
        raise ValueError(f"Invalid bandwidth_Bps. Received: bandwidth_Bps={bandwidth_Bps!r}. "
                         "Give a positive number of bytes per second.")
    return 2 * (n - 1) / n * size_bytes / bandwidth_Bps + 2 * (n - 1) * alpha_s


def predict(step_compute_s: float, grad_bytes: float, bandwidth_Bps: float, alpha_s: float,
            devices=DEFAULT_DEVICES, overlap: float = 0.0) -> list[dict]:
    """One row per device count: n, t_comm, t_step (seconds), efficiency, speedup.

    Weak scaling: every device keeps its batch, so t_compute is the same for every n.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"Invalid overlap. Received: overlap={overlap!r}. Give a fraction in "
                         "[0, 1].")
    if step_compute_s <= 0:
        raise ValueError(f"Invalid step_compute_s. Received: step_compute_s={step_compute_s!r}. "
                         "Give a positive number of seconds.")
    rows = []
    for n in devices:
        t_comm = ring_allreduce_time(n, grad_bytes, bandwidth_Bps, alpha_s)
        t_step = step_compute_s + (1.0 - overlap) * t_comm
        eff = step_compute_s / t_step
        rows.append({"n": int(n), "t_comm": t_comm, "t_step": t_step, "efficiency": eff,
                     "speedup": n * eff})
    return rows


def fit_alpha_beta(measurements, relative: bool = True) -> tuple[float, float]:
    """Least-squares fit of (alpha_s, bandwidth_Bps) to measured ``(n, size_bytes, seconds)``.

    The model is linear in alpha and 1/B: t = alpha * 2(n-1) + (1/B) * 2(n-1)/n * S. With
    ``relative`` (default) the squared *relative* errors are minimised, so small and large
    messages count alike. alpha is constrained to >= 0 (refit with alpha = 0 if the free fit
    gives a negative one). Points with n < 2 carry no communication and are ignored.
    """
    rows = []
    for n, size, t in measurements:
        if n < 2:
            continue
        if not (t > 0 and math.isfinite(t)) or size < 0:
            raise TfdpError(f"Invalid measurement. Received: (n={n}, size={size}, "
                            f"seconds={t}). Times must be positive and sizes >= 0.")
        w = 1.0 / t if relative else 1.0
        rows.append((2 * (n - 1) * w, 2 * (n - 1) / n * size * w, t * w))
    if len(rows) < 2:
        raise TfdpError(f"Too few measurements to fit alpha and B. Received: {len(rows)} "
                        "point(s) with n >= 2. Give at least two, at different sizes.")
    s11 = sum(a * a for a, _, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    r1 = sum(a * y for a, _, y in rows)
    r2 = sum(b * y for _, b, y in rows)
    det = s11 * s22 - s12 * s12
    if det <= 1e-12 * s11 * s22:
        raise TfdpError("Cannot separate alpha from B: the measurements are collinear. "
                        "Received: points that all have the same size per step. Measure at "
                        "least two different sizes.")
    alpha = (r1 * s22 - r2 * s12) / det
    inv_b = (s11 * r2 - s12 * r1) / det
    if alpha < 0:
        alpha, inv_b = 0.0, r2 / s22
    if inv_b <= 0:
        raise TfdpError("Cannot fit a bandwidth: the measured time does not grow with the size. "
                        f"Received: {len(rows)} points. Measure larger sizes (e.g. 4M,16M,64M).")
    return alpha, 1.0 / inv_b


# --- formatting ----------------------------------------------------------------------------------

def _devices(max_devices: int) -> list[int]:
    out = [d for d in DEFAULT_DEVICES if d <= max_devices]
    n = out[-1] * 2 if out else 1
    while n <= max_devices:
        out.append(n)
        n *= 2
    if out[-1] != max_devices:
        out.append(max_devices)
    return out


def format_prediction(rows, *, step_s, grad_bytes, bandwidth_Bps, alpha_s, overlap) -> str:
    table = _common.render_table(
        ["devices", "comm ms", "step ms", "efficiency %", "speed-up"],
        [[r["n"], f"{r['t_comm'] * 1e3:.2f}", f"{r['t_step'] * 1e3:.2f}",
          f"{r['efficiency'] * 100:.1f}", f"{r['speedup']:.1f}"] for r in rows])
    lines = [
        "alpha-beta ring all-reduce model, weak scaling (fixed per-device batch):",
        "  t_comm(n)  = 2(n-1)/n * S/B + 2(n-1)*alpha",
        "  t_step(n)  = t_compute + (1 - overlap) * t_comm(n)",
        "  efficiency = t_compute / t_step(n);  speed-up = n * efficiency",
        f"  t_compute = {step_s * 1e3:g} ms, S = {grad_bytes / 1e6:g} MB, "
        f"B = {bandwidth_Bps * 8 / 1e9:.4g} Gbit/s ({bandwidth_Bps / 1e9:.4g} GB/s), "
        f"alpha = {alpha_s * 1e6:.4g} us, overlap = {overlap:g}",
        f"  bandwidth floor 2S/B = {2 * grad_bytes / bandwidth_Bps * 1e3:.2f} ms; "
        f"latency term 2(n-1)*alpha grows linearly in n",
        "",
        table,
    ]
    return "\n".join(lines)


# --- measuring here ------------------------------------------------------------------------------

def _child(sizes: list[int], steps: int) -> int:
    """In each launched worker: time all_reduce(SUM) of each size; print a result line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdp
    strategy = tfdp.DataParallelStrategy()
    import tensorflow as tf

    results = []
    for size in sizes:
        count = max(1, size // 4)
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, count=count: tf.random.stateless_uniform(
                [count], seed=[count % 9973, ctx.replica_id_in_sync_group]))

        @tf.function
        def step(v):
            def fn(x):
                return tf.distribute.get_replica_context().all_reduce("SUM", x)[0]
            return strategy.run(fn, args=(v,))

        def sync(x):
            return float(strategy.experimental_local_results(x)[0])

        for _ in range(2):
            sync(step(values))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            sync(step(values))
            times.append(time.perf_counter() - t0)
        results.append({"bytes": count * 4, "seconds": times})
    print(RESULT_MARK + json.dumps({"replicas": strategy.num_replicas_in_sync,
                                    "results": results}), flush=True)
    return 0


def _run_measure_job(workers: int, sizes: list[int], steps: int, timeout: float) -> dict:
    from tfdp.launch import launch
    cmd = [sys.executable, "-m", "tfdp_bench.scaling", "--child",
           "--measure-sizes", ",".join(str(s) for s in sizes), "--steps", str(steps)]
    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    rc = launch(cmd, workers, cpu_replicas=1, timeout=timeout, env=env, stdout=out, stderr=err)
    lines = [ln.split(RESULT_MARK, 1)[1] for ln in out.getvalue().splitlines()
             if ln.startswith("[worker 0]") and RESULT_MARK in ln]
    if rc != 0 or not lines:
        text = out.getvalue().splitlines() + err.getvalue().splitlines()
        tail = "\n".join(ln for ln in text if "Error" in ln or "failed" in ln)[-2000:]
        raise TfdpError(f"The measuring job failed. Received: exit code {rc} from {workers} "
                        f"workers. Its error lines:\n{tail}")
    return json.loads(lines[-1])


def measure(workers_list, sizes, steps, timeout=300.0, progress=True) -> list[dict]:
    """Median seconds of tfdp's cross-worker all_reduce for each (workers, size), one job per N."""
    points = []
    for w in workers_list:
        if progress:
            print(f"measuring: {w} workers, sizes {','.join(_common.fmt_bytes(s) for s in sizes)}, "
                  f"{steps} steps each ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = _run_measure_job(w, sizes, steps, timeout)
        for r in res["results"]:
            points.append({"n": res["replicas"], "workers": w, "bytes": r["bytes"],
                           "seconds": statistics.median(r["seconds"]),
                           "samples_s": r["seconds"]})
        if progress:
            print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return points


def format_comparison(points, alpha_s, bandwidth_Bps) -> str:
    rows = []
    for p in points:
        pred = ring_allreduce_time(p["n"], p["bytes"], bandwidth_Bps, alpha_s)
        rows.append([p["n"], _common.fmt_bytes(p["bytes"]), f"{p['seconds'] * 1e3:.2f}",
                     f"{pred * 1e3:.2f}", f"{(pred - p['seconds']) / p['seconds'] * 100:+.1f}"])
    return _common.render_table(["devices", "size", "measured ms", "predicted ms", "error %"], rows)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --- command line --------------------------------------------------------------------------------

def build_parser():
    import argparse
    p = BenchParser("tfdp bench scaling",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description=__doc__.split("\n\n", 1)[0] + "\n\n" + FORMULA.replace(";  ", "\n"),
                epilog="examples:\n"
                       "  tfdp bench scaling --step-ms 100 --grad-mb 100 --bandwidth-gbps 10 "
                       "--alpha-us 5\n"
                       "  tfdp bench scaling --measure --step-ms 250 --grad-mb 98")
    p.add_argument("--step-ms", type=float, metavar="X",
                   help="measured compute time of one training step on one device, in ms "
                        f"(default with --measure: {DEFAULT_STEP_MS:g})")
    p.add_argument("--grad-mb", type=float, metavar="S",
                   help="gradient bytes all-reduced per step, in MB = 10^6 bytes "
                        f"(default with --measure: {DEFAULT_GRAD_MB:g}, about ResNet-50 float32)")
    p.add_argument("--bandwidth-gbps", type=float, metavar="B",
                   help="per-link bandwidth in Gbit/s (10 Gbit/s = 1.25 GB/s)")
    p.add_argument("--alpha-us", type=float, metavar="A",
                   help="per-message latency in microseconds (>= 0)")
    p.add_argument("--overlap", type=float, default=0.0, metavar="F",
                   help="fraction of the communication hidden behind compute, 0..1 (default 0)")
    p.add_argument("--max-devices", type=int, default=1024, metavar="N",
                   help="largest device count in the table (powers of 2 up to it; default 1024)")
    p.add_argument("--measure", action="store_true",
                   help="fit B and alpha to tfdp all-reduce times measured here over loopback")
    p.add_argument("--measure-workers", default=MEASURE_WORKERS, metavar="N,...",
                   help=f"worker counts to measure, >= 2 (default {MEASURE_WORKERS})")
    p.add_argument("--measure-sizes", default=MEASURE_SIZES, metavar="S,...",
                   help=f"bytes per all-reduce, K/M/G suffixes (default {MEASURE_SIZES})")
    p.add_argument("--steps", type=int, default=MEASURE_STEPS, metavar="K",
                   help=f"timed all-reduces per size and job (default {MEASURE_STEPS})")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_number(name, value, *, allow_zero=False, upper=None):
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if ok and upper is not None:
        ok = value <= upper
    if not ok:
        valid = ("a number in [0, 1]" if upper is not None else
                 "a number >= 0" if allow_zero else "a positive number")
        raise UsageError(f"Invalid {name}. Received: {name} {value:g}. Give {valid}.")


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.sizes = [_common.parse_size(s, name="--measure-sizes", cls=UsageError)
                  for s in args.measure_sizes.split(",") if s.strip()]
    if args.steps < 1:
        raise UsageError(f"Invalid --steps. Received: --steps {args.steps}. Give an integer >= 1.")
    if args.child:
        return args
    _check_number("--step-ms", args.step_ms)
    _check_number("--grad-mb", args.grad_mb)
    _check_number("--bandwidth-gbps", args.bandwidth_gbps)
    _check_number("--alpha-us", args.alpha_us, allow_zero=True)
    _check_number("--overlap", args.overlap, allow_zero=True, upper=1.0)
    if args.max_devices < 1:
        raise UsageError(f"Invalid --max-devices. Received: --max-devices {args.max_devices}. "
                         "Give an integer >= 1.")
    if args.measure:
        given = [o for o, v in (("--bandwidth-gbps", args.bandwidth_gbps),
                                ("--alpha-us", args.alpha_us)) if v is not None]
        if given:
            raise UsageError(f"--measure fits B and alpha itself. Received: --measure with "
                             f"{' and '.join(given)}. Drop one or the other.")
        try:
            args.workers = sorted({int(w) for w in args.measure_workers.split(",") if w.strip()})
        except ValueError:
            args.workers = []
        if not args.workers or args.workers[0] < 2:
            raise UsageError(f"Invalid --measure-workers. Received: --measure-workers "
                             f"{args.measure_workers}. Give worker counts >= 2, e.g. 2,3,4.")
        if len(set(args.sizes)) < 2 or min(args.sizes) < 4:
            raise UsageError(f"Invalid --measure-sizes. Received: --measure-sizes "
                             f"{args.measure_sizes}. Give at least two different sizes of at "
                             "least 4 bytes, e.g. 256K,4M,16M.")
        args.step_ms = DEFAULT_STEP_MS if args.step_ms is None else args.step_ms
        args.grad_mb = DEFAULT_GRAD_MB if args.grad_mb is None else args.grad_mb
    else:
        missing = [o for o, v in (("--step-ms", args.step_ms), ("--grad-mb", args.grad_mb),
                                  ("--bandwidth-gbps", args.bandwidth_gbps),
                                  ("--alpha-us", args.alpha_us)) if v is None]
        if missing:
            raise UsageError(f"Missing {', '.join(missing)}. Received: {' '.join(argv) or '(none)'}"
                             ". Give --step-ms, --grad-mb, --bandwidth-gbps and --alpha-us, or "
                             "--measure to fit B and alpha here.")
    check_writable("--json", args.json)
    return args


def main(argv=None) -> int:
    """``tfdp bench scaling`` in process (usage errors raise UsageError)."""
    return run(parse_args(list(sys.argv[1:] if argv is None else argv)))


def uses_tensorflow(args) -> bool:
    """Only ``--measure`` runs TensorFlow (the model alone is arithmetic): ``tfdp bench`` imports
    it, its load-time lines filtered, only then."""
    return bool(args.measure)


def run(args) -> int:
    if args.child:
        return _child(args.sizes, args.steps)
    step_s, grad_bytes = args.step_ms / 1e3, args.grad_mb * 1e6
    result = {"benchmark": "scaling", "formula": FORMULA, "step_compute_s": step_s,
              "grad_bytes": grad_bytes, "overlap": args.overlap}
    if args.measure:
        from tfdp_bench.references import loopback_tcp_bandwidth
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        t0 = time.perf_counter()
        tcp = loopback_tcp_bandwidth(256 << 20)
        points = measure(args.workers, sorted(set(args.sizes)), args.steps,
                         progress=not args.quiet)
        alpha_s, bandwidth = fit_alpha_beta([(p["n"], p["bytes"], p["seconds"]) for p in points])
        errors = [abs(ring_allreduce_time(p["n"], p["bytes"], bandwidth, alpha_s) - p["seconds"])
                  / p["seconds"] for p in points]
        print(f"measured here: tfdp all_reduce(SUM) across N workers over loopback, 1 CPU "
              f"replica each, median of {args.steps} steps ({time.perf_counter() - t0:.0f} s)")
        print(format_comparison(points, alpha_s, bandwidth))
        print(f"fit (least squares, relative errors): alpha = {alpha_s * 1e6:.1f} us, "
              f"B = {bandwidth / 1e9:.3f} GB/s ({bandwidth * 8 / 1e9:.2f} Gbit/s); mean |error| "
              f"{statistics.fmean(errors) * 100:.1f}%, max {max(errors) * 100:.1f}%; raw loopback "
              f"TCP, one Python stream: {tcp / 1e9:.2f} GB/s", flush=True)
        cores = _cores()
        if max(args.workers) > cores:
            print(f"note: {max(args.workers)} workers share {cores} CPU cores here, so the "
                  "reduction and copies compete for CPU and B falls with n (the model assumes "
                  "it does not)", flush=True)
        print(flush=True)
        result.update(measured=points, loopback_tcp_Bps=tcp,
                      fit={"alpha_s": alpha_s, "bandwidth_Bps": bandwidth,
                           "mean_abs_rel_error": statistics.fmean(errors),
                           "max_abs_rel_error": max(errors)})
    else:
        alpha_s, bandwidth = args.alpha_us / 1e6, args.bandwidth_gbps * 1e9 / 8
    rows = predict(step_s, grad_bytes, bandwidth, alpha_s, devices=_devices(args.max_devices),
                   overlap=args.overlap)
    print(format_prediction(rows, step_s=step_s, grad_bytes=grad_bytes, bandwidth_Bps=bandwidth,
                            alpha_s=alpha_s, overlap=args.overlap), flush=True)
    result.update(alpha_s=alpha_s, bandwidth_Bps=bandwidth, rows=rows)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.scaling (also each --measure worker)
    sys.exit(run_standalone("scaling", parse_args, run))
