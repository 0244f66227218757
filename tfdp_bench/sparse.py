"""``tfdp bench sparse``: reducing an embedding gradient (IndexedSlices), tfdp vs MirroredStrategy.

A recommender shape: a large table (``--vocab`` x ``--dim`` float32) of which each replica touches
``--ids-per-batch`` rows per step (batch 256 x 8 ids by default). Each replica holds one
``tf.IndexedSlices`` (random rows, random ids) created once on its device; every contender runs, in
one ``tf.function``::

    strategy.run(lambda g: tf.distribute.get_replica_context().all_reduce("SUM", g), (slices,))

(tfdp: ``strategy.extended.all_reduce_gradients([g], densify_ok=True)``, the call Keras's
gradient path makes for an optimizer linear in the gradient, so that "auto" may densify).

Contenders, over the same K logical CPU devices: tfdp ``DataParallelStrategy`` with ``sparse``
forced to "gather" and to "densify" and left on "auto" (the rule of ``tfdp.reduce.sparse``), and
``tf.distribute.MirroredStrategy`` with its default cross-device ops (on CPUs TF 2.21 picks
``CollectiveAllReduce``) and with ``ReductionToOneDevice``.

Two figures per contender: ``reduce``, the all-reduce alone (what the rule decides on), and
``+dense``, the all-reduce followed by the dense gradient every replica's optimizer builds from it
(``tf.convert_to_tensor`` on each replica: what Keras 3 Adam, Adagrad, RMSprop or SGD with momentum
do with an IndexedSlices gradient; plain SGD applies it sparsely instead).

``--sweep IDS,...`` repeats the tfdp gather / densify / MirroredStrategy comparison for several
ids-per-batch values and reports the gathered-bytes / table-bytes ratio at which densifying
becomes cheaper (the crossover behind ``tfdp.reduce.sparse``'s threshold).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, check_writable, run_standalone, write_json
from tfdp.errors import TfdpError, UsageError

DEFAULTS = {"vocab": 1_000_000, "dim": 64, "ids_per_batch": 256 * 8, "cpu_replicas": 4,
            "repeats": 5}
TARGET_SAMPLE_S = 0.02
MAX_ITERS = 20


def build_parser():
    p = BenchParser("tfdp bench sparse", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], metavar="V",
                   help=f"embedding table rows (default: {DEFAULTS['vocab']:,})")
    p.add_argument("--dim", type=int, default=DEFAULTS["dim"], metavar="D",
                   help=f"embedding dimension (default: {DEFAULTS['dim']})")
    p.add_argument("--ids-per-batch", type=int, default=DEFAULTS["ids_per_batch"], metavar="N",
                   help="gradient rows (looked-up ids) per replica per step "
                        f"(default: {DEFAULTS['ids_per_batch']} = batch 256 x 8 ids)")
    p.add_argument("--cpu-replicas", type=int, default=DEFAULTS["cpu_replicas"], metavar="K",
                   help=f"logical CPU devices, one replica each (default: "
                        f"{DEFAULTS['cpu_replicas']})")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], metavar="R",
                   help=f"rounds, contenders alternating (default: {DEFAULTS['repeats']})")
    p.add_argument("--sweep", metavar="N,...",
                   help="also sweep these ids-per-batch values (tfdp gather vs densify vs "
                        "MirroredStrategy) to locate the crossover")
    p.add_argument("--json", metavar="FILE", help="write every raw figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("vocab", "dim", "ids_per_batch", "cpu_replicas", "repeats"):
        v = getattr(args, name)
        if v < 1:
            raise UsageError(f"Invalid --{name.replace('_', '-')}. Received: "
                             f"--{name.replace('_', '-')} {v}. Give an integer >= 1.")
    sweep = []
    if args.sweep is not None:
        try:
            sweep = [int(s) for s in args.sweep.split(",") if s.strip()]
        except ValueError:
            sweep = []
        if not sweep or min(sweep) < 1:
            raise UsageError(f"Invalid --sweep. Received: --sweep {args.sweep}. Give "
                             "comma-separated ids-per-batch values >= 1, e.g. 1000,10000,100000.")
    args.sweep = sweep
    check_writable("--json", args.json)
    return args


# --- contenders ----------------------------------------------------------------------------------

def build_contenders(devices):
    """[(name, strategy, info)]: tfdp gather/densify/auto, MirroredStrategy default/one device."""
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    out = []
    for mode in ("gather", "densify", "auto"):
        s = DataParallelStrategy(devices, sparse=mode)
        out.append((f"tfdp {mode}", s, {"kind": "tfdp", "sparse": mode}))
    ms = tf.distribute.MirroredStrategy(devices)
    desc = _common.describe_cross_device_ops(ms)
    out.append((f"MS {desc}", ms, {"kind": "mirrored", "default": True,
                                   "cross_device_ops": desc}))
    ms1 = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    out.append(("MS ReductionToOneDevice", ms1, {"kind": "mirrored", "default": False,
                                                 "cross_device_ops": "ReductionToOneDevice"}))
    return out, desc


def _make_slices(devices, vocab, dim, rows, seed=0):
    import tensorflow as tf
    out = []
    for r, d in enumerate(devices):
        with tf.device(d):
            vals = tf.random.stateless_uniform([rows, dim], seed=(seed, r), minval=-1.0,
                                               maxval=1.0)
            idx = tf.random.stateless_uniform([rows], seed=(seed + 1, r), minval=0,
                                              maxval=vocab, dtype=tf.int32)
            out.append(tf.IndexedSlices(vals, idx, tf.constant([vocab, dim], tf.int32)))
    return out


def _make_step(strategy, slices, dense):
    import tensorflow as tf
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: slices[ctx.replica_id_in_sync_group])

    from tfdp.strategy import DataParallelStrategy
    tfdp_reduce = isinstance(strategy, DataParallelStrategy)

    def replica_fn(g):
        if tfdp_reduce:
            # what the gradient path does for a consumer linear in the gradient (SGD with
            # momentum...), so that "auto" may apply its rule and densify (a bare replica-context
            # all_reduce does not say what consumes the result): the one tfdp internal this
            # benchmark needs (tfdp_bench's docstring)
            out = strategy.extended.all_reduce_gradients([g], densify_ok=True)[0]
        else:
            out = tf.distribute.get_replica_context().all_reduce("SUM", g)
        if dense:
            return tf.convert_to_tensor(out)
        if isinstance(out, tf.IndexedSlices):  # return something cheap, computed from all of it
            return out.values, out.indices
        return out

    @tf.function
    def step():
        return strategy.run(replica_fn, args=(values,))

    return step


def _dense_result(strategy, out):
    """The (dense) reduced gradient on the last replica, as a numpy array."""
    return strategy.experimental_local_results(out)[-1].numpy()


def _time(steps, repeats, label, progress):
    """Warm up, then ``repeats`` alternating rounds; seconds per call for each step."""
    iters, warm = [], []
    for step in steps:
        step()
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
        iters.append(max(1, min(MAX_ITERS, math.ceil(TARGET_SAMPLE_S / max(warm[-1], 1e-9)))))
    samples = [[] for _ in steps]
    for r in range(repeats):
        _common.progress(f"sparse {label}: round {r + 1}/{repeats}", progress)
        gc.collect()
        for i in _common.round_order(len(steps), r):
            t0 = time.perf_counter()
            for _ in range(iters[i]):
                steps[i]()
            samples[i].append((time.perf_counter() - t0) / iters[i])
    return samples


def measure(devices, contenders, vocab, dim, rows, repeats, progress, check=True):
    """Time every contender's reduce and reduce+dense at one shape; figures in a dict."""
    import numpy as np

    from tfdp.reduce import sparse as sparse_lib
    k = len(devices)
    slices = _make_slices(devices, vocab, dim, rows)
    with _quiet_tf():
        steps, names = [], []
        for name, strategy, _ in contenders:
            for dense in (False, True):
                steps.append(_make_step(strategy, slices, dense))
                names.append((name, dense))
        if check:  # every contender's result against numpy, once
            want = np.zeros([vocab, dim], np.float32)
            for s in slices:
                np.add.at(want, s.indices.numpy(), s.values.numpy())
            for (name, strategy, _) in contenders:
                step = steps[names.index((name, True))]
                got = _dense_result(strategy, step())
                err = float(np.max(np.abs(got - want)))
                if err > 1e-4:
                    raise TfdpError(f"Wrong sparse all-reduce result. Received: contender "
                                    f"{name!r}, max error {err:.3g}. This is a bug: please report "
                                    "it with this command line.")
            del want
        samples = _time(steps, repeats, f"ids {rows}", progress)
    table_bytes = vocab * dim * 4
    row_bytes = dim * 4 + 4
    gathered_rows = k * rows
    res = {"vocab": vocab, "dim": dim, "ids_per_batch": rows, "gathered_rows": gathered_rows,
           "table_bytes": table_bytes, "gathered_bytes": gathered_rows * row_bytes,
           "ratio": gathered_rows * row_bytes / table_bytes,
           "rule": sparse_lib.choose(gathered_rows, dim, vocab, 4, 4, workers=1),
           "rule_workers": sparse_lib.choose(gathered_rows, dim, vocab, 4, 4, workers=2),
           "contenders": []}
    for (name, strategy, info) in contenders:
        entry = {"contender": name, **info}
        for dense in (False, True):
            t = samples[names.index((name, dense))]
            key = "dense" if dense else "reduce"
            entry[key] = {"times_s": t, "median_s": statistics.median(t), "min_s": min(t)}
        res["contenders"].append(entry)
    ms = next(c for c in res["contenders"] if c.get("default") is True)
    for c in res["contenders"]:
        for key in ("reduce", "dense"):
            c[key]["ms_over_this"] = ms[key]["median_s"] / c[key]["median_s"]
    return res


class _quiet_tf:
    def __enter__(self):
        import tensorflow as tf
        self.logger = tf.get_logger()
        self.level = self.logger.level
        self.logger.setLevel("ERROR")

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def run_sparse(vocab=DEFAULTS["vocab"], dim=DEFAULTS["dim"], ids_per_batch=DEFAULTS["ids_per_batch"],
               cpu_replicas=DEFAULTS["cpu_replicas"], repeats=DEFAULTS["repeats"], sweep=(),
               progress=False) -> dict:
    """Run the benchmark (and the optional sweep); every figure in a dict (times in seconds)."""
    from tfdp.reduce import sparse as sparse_lib
    devices = _common.configure_replicas(cpu_replicas)
    contenders, desc = build_contenders(devices)
    _common.progress(f"MirroredStrategy default cross_device_ops: {desc}", progress)
    main_res = measure(devices, contenders, vocab, dim, ids_per_batch, repeats, progress)
    sweep_res = []
    if sweep:
        # the same strategy objects: a second MirroredStrategy would restart TF's collective
        # instance keys and collide with the first one's (cached shapes)
        sc = [c for c in contenders if c[2].get("sparse") in ("gather", "densify")
              or c[2].get("default") is True]
        for rows in sweep:
            sweep_res.append(measure(devices, sc, vocab, dim, rows, repeats, progress,
                                     check=False))
    return {"benchmark": "sparse", "cpu_replicas": cpu_replicas, "devices": devices,
            "repeats": repeats, "mirrored_cross_device_ops": desc, "main": main_res,
            "sweep": sweep_res, "crossover": _crossover(sweep_res),
            "thresholds": {"local_gather_max_ratio": sparse_lib.LOCAL_GATHER_MAX_RATIO,
                           "workers_gather_max_ratio": sparse_lib.WORKERS_GATHER_MAX_RATIO},
            "environment": _common.environment(),
            "notes": {"reduce": "all_reduce('SUM') of the IndexedSlices alone (median s)",
                      "dense": "all_reduce then tf.convert_to_tensor on every replica",
                      "ratio": "gathered (indices, values) bytes / dense table bytes",
                      "ms_over_this": "MirroredStrategy (default) median / this median"}}


def _crossover(sweep_res):
    """The smallest swept ratio at which tfdp densify beats tfdp gather (None: never)."""
    out = {}
    for key in ("reduce", "dense"):
        hit = None
        for r in sorted(sweep_res, key=lambda r: r["ratio"]):
            g = next(c for c in r["contenders"] if c.get("sparse") == "gather")[key]["median_s"]
            d = next(c for c in r["contenders"] if c.get("sparse") == "densify")[key]["median_s"]
            if d < g:
                hit = r["ratio"]
                break
        out[key] = hit
    return out


# --- output --------------------------------------------------------------------------------------

def _ms(x):
    return f"{x * 1e3:.2f}"


def format_sparse(result: dict) -> str:
    m = result["main"]
    env = result["environment"]
    k = result["cpu_replicas"]
    lines = [f"tfdp bench sparse: table {m['vocab']:,} x {m['dim']} float32 "
             f"({m['table_bytes'] / 1e6:.1f} MB), {m['ids_per_batch']} ids per replica per step, "
             f"{k} CPU replicas ({env['cpu_cores']} cores), {result['repeats']} rounds, "
             f"TF {env['tensorflow']}",
             f"gathered: {m['gathered_rows']:,} rows, {m['gathered_bytes'] / 1e6:.2f} MB = "
             f"{m['ratio']:.4f} x the table; rule ('auto'): {m['rule']} within one process, "
             f"{m['rule_workers']} across workers",
             f"MirroredStrategy default cross_device_ops: {result['mirrored_cross_device_ops']}",
             ""]
    headers = ["contender", "reduce ms", "MS/this", "+dense ms", "MS/this"]
    rows = [[c["contender"], _ms(c["reduce"]["median_s"]), f"{c['reduce']['ms_over_this']:.2f}",
             _ms(c["dense"]["median_s"]), f"{c['dense']['ms_over_this']:.2f}"]
            for c in m["contenders"]]
    lines.append(_common.render_table(headers, rows))
    lines += ["", "reduce: the all-reduce of the IndexedSlices alone; +dense: then the dense "
              "gradient on every replica (what Keras Adam/Adagrad/RMSprop/momentum SGD build).",
              "MS/this = MirroredStrategy (default) median / this median; > 1: faster than "
              "MirroredStrategy."]
    if result["sweep"]:
        s0 = result["sweep"][0]
        lines += ["", f"sweep: table {s0['vocab']:,} x {s0['dim']} ({s0['table_bytes'] / 1e6:.1f}"
                  " MB), ids per replica per step varied", ""]
        headers = ["ids/replica", "gathered/table", "gather ms", "densify ms", "MS ms",
                   "dens/gath", "+dense: gather", "densify", "MS", "dens/gath"]
        rows = []
        for r in result["sweep"]:
            by = {c.get("sparse", "ms"): c for c in r["contenders"]}
            g, d, ms = by["gather"], by["densify"], by["ms"]
            rows.append([f"{r['ids_per_batch']:,}", f"{r['ratio']:.3f}",
                         _ms(g["reduce"]["median_s"]), _ms(d["reduce"]["median_s"]),
                         _ms(ms["reduce"]["median_s"]),
                         f"{d['reduce']['median_s'] / g['reduce']['median_s']:.2f}",
                         _ms(g["dense"]["median_s"]), _ms(d["dense"]["median_s"]),
                         _ms(ms["dense"]["median_s"]),
                         f"{d['dense']['median_s'] / g['dense']['median_s']:.2f}"])
        lines.append(_common.render_table(headers, rows))
        co = result["crossover"]

        def fmt(x):
            return "none in the swept range (gather always cheaper)" if x is None else \
                f"at gathered/table = {x:.3f}"
        lines += ["", f"densify beats gather: reduce {fmt(co['reduce'])}; +dense "
                  f"{fmt(co['dense'])}."]
    th = result["thresholds"]
    lines.append(f"tfdp.reduce.sparse thresholds (gather while gathered/table <= ratio): within "
                 f"one process {th['local_gather_max_ratio']} (None: always gather), across "
                 f"workers {th['workers_gather_max_ratio']}.")
    return "\n".join(lines)


def run(args) -> int:
    result = run_sparse(vocab=args.vocab, dim=args.dim, ids_per_batch=args.ids_per_batch,
                        cpu_replicas=args.cpu_replicas, repeats=args.repeats, sweep=args.sweep,
                        progress=not args.quiet)
    print(format_sparse(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


def main(argv=None) -> int:
    """``tfdp bench sparse`` in process: usage errors print one line and return 2."""
    return run_standalone("sparse", parse_args, run, argv)


if __name__ == "__main__":  # python -m tfdp_bench.sparse
    sys.exit(main())
