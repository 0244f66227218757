"""Train a Keras model with tfdp on a Ray cluster (Ray Train's TensorflowTrainer).

    pip install -e ".[ray]"
    python examples/ray_train.py                  # a local Ray cluster: 2 workers x 2 CPU replicas
    python examples/ray_train.py --address auto   # a running cluster (`ray start --head` ...)
    python examples/ray_train.py --workers 4 --cpu-replicas 1 --epochs 5

Ray starts the workers and sets TF_CONFIG for each; ``tfdp.DataParallelStrategy()`` reads it
(where Ray's guide says MultiWorkerMirroredStrategy, which fails with Keras 3) and trains
exactly like one device on the same global batches. The Ray Data shard goes through
``tfdp.ray.distribute`` (every example once per epoch, the uneven last batch exact;
``tfdp.ray.data_config()`` gives every worker the whole dataset in one order), and
``tfdp.ray.BackupAndRestore`` reports tfdp's exact-resume backup as Ray checkpoints: with
``FailureConfig(max_failures=1)`` a worker that dies makes Ray restart the group, which resumes
at the backed-up step.
"""

import argparse
import os
import tempfile

import numpy as np

import tfdp.logs
import tfdp.ray

# The driver imports TensorFlow too (ray.train.tensorflow, below): as quiet as the workers
# (TensorFlow's load-time lines filtered by the level, as tfdp launch does; errors still show).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tfdp.logs.filter_tensorflow_import()

import ray  # noqa: E402  (after the filter: ray.train.tensorflow imports TensorFlow)
import ray.train  # noqa: E402
from ray.train import (CheckpointConfig, FailureConfig, LoggingConfig, RunConfig,  # noqa: E402
                       ScalingConfig)
from ray.train.tensorflow import TensorflowTrainer  # noqa: E402


def train_loop_per_worker(config):
    import keras

    import tfdp
    import tfdp.data
    import tfdp.ray

    tfdp.configure_cpu_replicas(config["cpu_replicas"])  # CPU workers only: K replicas each
    strategy = tfdp.DataParallelStrategy()                # instead of MultiWorkerMirroredStrategy
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    shard = ray.train.get_dataset_shard("train")
    batch, rows = config["global_batch_size"], config["rows"]

    def make_dataset(epoch, start_step):   # this epoch's data from start_step on (exact resume)
        return tfdp.ray.distribute(strategy, shard, feature_columns="x", label_columns="y",
                                   global_batch_size=batch, shuffle_seed=0, epoch=epoch,
                                   start_step=start_step)

    backup = tfdp.ray.BackupAndRestore(save_freq=20)       # a Ray checkpoint every 20 steps
    history = backup.fit(model, make_dataset, epochs=config["epochs"],
                         steps_per_epoch=tfdp.data.steps_per_epoch(rows, batch))
    if strategy.is_chief:
        print(f"worker 0 of {strategy.num_workers}: {strategy.num_replicas_in_sync} replicas, "
              f"loss {history['loss'][-1]:.4f}, accuracy {history['accuracy'][-1]:.3f}")


def synthetic_dataset(rows: int, seed: int = 0):
    """A 10-class problem in 16 features (a fixed random linear teacher)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 16)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(16, 10)), axis=1).astype("int64")
    return ray.data.from_items([{"x": x[i], "y": y[i]} for i in range(rows)])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpu-replicas", type=int, default=2, help="CPU replicas per worker")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--storage", default=None, help="Ray's storage_path (checkpoints)")
    args = p.parse_args()

    # every process of the job: TensorFlow as quiet as under tfdp launch (errors still show)
    runtime_env = tfdp.ray.runtime_env()
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:  # a local cluster with enough (logical) CPUs for every worker's reservation
        # one host: no node to preempt, so no preemption watcher
        runtime_env["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        ray.init(num_cpus=max(os.cpu_count() or 1, args.workers * args.cpu_replicas + 1),
                 runtime_env=runtime_env)
    ray.data.DataContext.get_current().enable_progress_bars = False   # one line per epoch
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"cpu_replicas": args.cpu_replicas, "epochs": args.epochs,
                           "rows": args.rows, "global_batch_size": args.global_batch_size},
        scaling_config=ScalingConfig(num_workers=args.workers,
                                     resources_per_worker={"CPU": args.cpu_replicas}),
        datasets={"train": synthetic_dataset(args.rows)},
        dataset_config=tfdp.ray.data_config(),
        run_config=RunConfig(name="tfdp_ray_example",
                             storage_path=args.storage or tempfile.mkdtemp(prefix="tfdp-ray-"),
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             # Ray Train's warnings and errors, not a line per report
                             logging_config=LoggingConfig(log_level="WARNING")))
    result = trainer.fit()
    print(f"done: last checkpoint {result.checkpoint}")
    ray.shutdown()


if __name__ == "__main__":
    main()
