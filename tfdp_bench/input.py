"""Input benchmark: examples/s of the sharded TFRecord pipeline per worker vs what training eats.

``tfdp bench input`` (or :func:`run_input_bench`) writes recommender-style interaction
records (``tfdp.data.write_interactions_tfrecords``), then for each simulated worker of
``workers`` builds the worker's pipeline exactly as ``tfdp.data.distribute`` would on that worker
(``tf.distribute.InputContext(workers, rank, workers)``: one replica per worker, parsing with
``INTERACTION_FEATURES``, shuffled) and times full epochs of it, with file sharding and with data
sharding. Workers run one after the other, each with the whole host, so the figure is what one
worker's input pipeline can deliver. It then times Keras training steps of a small recommender
model (user/item/history embeddings + MLP) on the same per-worker batch held in memory: the rate
at which training consumes examples. Input rate / training rate > 1 means input keeps up.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, check_positive, check_writable, write_json
from tfdp.errors import invalid_argument


def _check_int(name, v, minimum=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise invalid_argument(name, v, fix=f"Pass an int >= {minimum}.")


def _files_in(files_dir, num_files, per_file, seed):
    import tensorflow as tf

    from tfdp.data.synthetic import write_interactions_tfrecords
    prefix = f"interactions-s{seed}-n{per_file}"
    pattern = os.path.join(files_dir, f"{prefix}-*-of-{num_files:05d}.tfrecord")
    existing = sorted(tf.io.gfile.glob(pattern))
    if len(existing) == num_files:
        return existing, 0.0
    t0 = time.perf_counter()
    files = write_interactions_tfrecords(files_dir, num_files, per_file, seed, prefix=prefix)
    return files, time.perf_counter() - t0


def _epoch(ds):
    """(seconds, examples) of one full pass over a worker dataset."""
    import tensorflow as tf
    t0 = time.perf_counter()
    n = 0
    for batch in ds:
        n += int(tf.shape(batch["id"])[0])
    return time.perf_counter() - t0, n


def _time_contenders(datasets, repeats):
    """Median seconds of a full pass for each dataset, and its examples per pass.

    One warm-up pass each, then ``repeats`` rounds in which every dataset runs once, in
    alternating order (forward, then reversed), so slow drifts of a shared host hit all alike.
    """
    counts = [_epoch(ds)[1] for ds in datasets]
    times = [[] for _ in datasets]
    for r in range(repeats):
        for i in _common.round_order(len(datasets), r):
            times[i].append(_epoch(datasets[i])[0])
    return [statistics.median(t) for t in times], counts


def _recommender_model(num_users, num_items):
    import keras
    from tfdp.data.synthetic import DENSE_DIM, HISTORY_LEN
    keras.utils.set_random_seed(0)
    user = keras.Input((), dtype="int64", name="user_id")
    item = keras.Input((), dtype="int64", name="item_id")
    hist = keras.Input((HISTORY_LEN,), dtype="int64", name="history")
    dense = keras.Input((DENSE_DIM,), name="dense")
    item_emb = keras.layers.Embedding(num_items, 16)
    u = keras.layers.Embedding(num_users, 16)(user)
    i = item_emb(item)
    h = keras.layers.GlobalAveragePooling1D()(item_emb(hist))
    x = keras.layers.Concatenate()([u, i, h, dense])
    x = keras.layers.Dense(64, activation="relu", name="mlp_64")(x)
    x = keras.layers.Dense(32, activation="relu", name="mlp_32")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    model = keras.Model({"user_id": user, "item_id": item, "history": hist, "dense": dense}, out)
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    return model


def _train_rate(files, batch, steps, num_users, num_items):
    """Examples/s of Keras training steps on in-memory batches of ``batch`` examples."""
    import tensorflow as tf
    from tfdp.data.synthetic import INTERACTION_FEATURES
    ds = (tf.data.TFRecordDataset(files[:1]).batch(batch, drop_remainder=True).take(1)
          .map(lambda r: tf.io.parse_example(r, INTERACTION_FEATURES)).cache())
    ds = ds.map(lambda f: ({k: f[k] for k in ("user_id", "item_id", "history", "dense")},
                           f["label"]))
    ds = ds.apply(tf.data.experimental.assert_cardinality(1))
    model = _recommender_model(num_users, num_items)
    model.fit(ds.repeat(3), verbose=0, shuffle=False)  # trace + warm up
    t0 = time.perf_counter()
    model.fit(ds.repeat(steps), verbose=0, shuffle=False)
    dt = time.perf_counter() - t0
    return steps * batch / dt, dt


def run_input_bench(files_dir=None, num_files: int = 8, examples: int = 200_000,
                    global_batch_size: int = 1024, workers: int = 2, *, repeats: int = 3,
                    train_steps: int = 50, seed: int = 0, verbose: bool = True) -> dict:
    """Measure per-worker input examples/s (file and data sharding) against training's rate.

    Args:
      files_dir: where the TFRecord files are written (reused when already there); None: a
        temporary directory, removed afterwards.
      num_files, examples: the synthetic data (``examples // num_files`` per file).
      global_batch_size: examples per step across the ``workers`` simulated workers.
      workers: simulated workers (one replica each).
      repeats: timed epochs per worker and mode, in alternating order after one warm-up epoch
        each; the median is kept.
      train_steps: timed Keras training steps for the consumption rate.
      verbose: print the table.

    Returns:
      A dict: the settings, ``rows`` (one per mode and worker: examples, seconds, examples_per_s),
      ``train_examples_per_s`` and ``headroom`` (per mode: slowest worker's input rate over the
      training rate).
    """
    for name, v in (("num_files", num_files), ("examples", examples),
                    ("global_batch_size", global_batch_size), ("workers", workers),
                    ("repeats", repeats), ("train_steps", train_steps)):
        _check_int(name, v)
    import tensorflow as tf

    from tfdp.data import pipeline
    from tfdp.data.synthetic import INTERACTION_FEATURES
    per_file = max(1, examples // num_files)
    num_users, num_items = 10_000, 50_000
    tmp = None
    if files_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tfdp-input-bench-")
        files_dir = tmp.name
    try:
        files, write_s = _files_in(os.fspath(files_dir), num_files, per_file, seed)
        rows, datasets = [], []
        modes = ["files", "data"] if num_files >= workers else ["data"]
        for mode in modes:
            for rank in range(workers):
                ctx = tf.distribute.InputContext(workers, rank, workers)
                datasets.append(pipeline.worker_dataset(
                    files, ctx, global_batch_size=global_batch_size, shard=mode,
                    parse_fn=INTERACTION_FEATURES, shuffle_seed=seed))
                rows.append({"shard": mode, "worker": rank})
        seconds, counts = _time_contenders(datasets, repeats)
        for row, secs, n in zip(rows, seconds, counts):
            row.update(examples=n, seconds=secs, examples_per_s=n / secs)
        worker_batch = max(1, global_batch_size // workers)
        train_rate, train_s = _train_rate(files, worker_batch, train_steps, num_users, num_items)
        headroom = {m: min(r["examples_per_s"] for r in rows if r["shard"] == m) / train_rate
                    for m in modes}
        result = {"num_files": num_files, "examples": per_file * num_files,
                  "global_batch_size": global_batch_size, "workers": workers,
                  "worker_batch_size": worker_batch, "write_seconds": write_s, "rows": rows,
                  "train_examples_per_s": train_rate, "train_seconds": train_s,
                  "headroom": headroom}
    finally:
        if tmp is not None:
            tmp.cleanup()
    if verbose:
        print(format_input_bench(result))
    return result


def format_input_bench(result: dict) -> str:
    """The result of :func:`run_input_bench` as a short text table."""
    r = result
    head = (f"tfdp.data input benchmark: {r['examples']:,} interactions in {r['num_files']} "
            f"TFRecord files, global batch {r['global_batch_size']}, {r['workers']} simulated "
            f"workers (1 replica each, batch {r['worker_batch_size']}); medians of timed epochs")
    label = {"files": "files (own files)", "data": "data (reads all, keeps slice)"}
    rows = [[label[x["shard"]], x["worker"], f"{x['examples']:,}", f"{x['seconds']:.2f}",
             f"{x['examples_per_s']:,.0f}"] for x in r["rows"]]
    rows.append(None)
    rows.append(["training consumes", "-", "-", "-", f"{r['train_examples_per_s']:,.0f}"])
    table = _common.render_table(["input pipeline (shard)", "worker", "examples", "seconds",
                          "examples/s"], rows)
    tail = "headroom (slowest worker input / training): " + ", ".join(
        f"{m} {h:.1f}x" for m, h in r["headroom"].items())
    return "\n".join([head, table, tail])


# --- command line: tfdp bench input --------------------------------------------------------------

DEFAULTS = {"files": 8, "examples": 200_000, "batch": 1024, "workers": 2, "repeats": 3,
            "train_steps": 50}


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench input",
                    description="Examples/s of the sharded TFRecord input pipeline "
                                "(recommender-style records) per simulated worker, against what "
                                "training consumes.")
    p.add_argument("--files", type=int, default=DEFAULTS["files"], metavar="N",
                   help=f"TFRecord files written (default: {DEFAULTS['files']})")
    p.add_argument("--examples", type=int, default=DEFAULTS["examples"], metavar="N",
                   help=f"interactions in all files (default: {DEFAULTS['examples']:,})")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], metavar="B",
                   help=f"global batch size (default: {DEFAULTS['batch']})")
    p.add_argument("--workers", type=int, default=DEFAULTS["workers"], metavar="W",
                   help=f"simulated workers, one replica each (default: {DEFAULTS['workers']})")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], metavar="R",
                   help=f"timed epochs per worker and mode (default: {DEFAULTS['repeats']})")
    p.add_argument("--train-steps", type=int, default=DEFAULTS["train_steps"], metavar="S",
                   help="timed Keras training steps for the consumption rate "
                        f"(default: {DEFAULTS['train_steps']})")
    p.add_argument("--files-dir", metavar="DIR",
                   help="where the files are written, and reused when already there "
                        "(default: a temporary directory, removed afterwards)")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("files", "examples", "batch", "workers", "repeats", "train_steps"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.files_dir is not None and not os.path.isdir(args.files_dir):
        from tfdp.errors import UsageError
        raise UsageError(f"Invalid --files-dir. Received: --files-dir {args.files_dir!r}. Give "
                         "an existing directory.")
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_input_bench(args.files_dir, num_files=args.files, examples=args.examples,
                             global_batch_size=args.batch, workers=args.workers,
                             repeats=args.repeats, train_steps=args.train_steps, verbose=False)
    print(format_input_bench(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.input
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("input", parse_args, run))
