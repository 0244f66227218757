"""DataParallelStrategy: a tf.distribute.Strategy with mirrored variables and tfdp's reduction.

Used exactly like ``tf.distribute.MirroredStrategy``::

    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(...)
    model.fit(dataset)

On top of MirroredStrategy's variable mirroring and input pipeline it changes four things:

1. Reduction is tfdp's own (``tfdp.reduce``): fused buckets, NCCL/ring/tree, compression.
2. The step is the global-batch step, for the Keras code users write (``tfdp.keras.gradient_path``):
   each replica's Keras loss gradient carries its share of what one device divides by (examples,
   valid elements under a mask, the sum of sample weights: ``tfdp.keras.losses``), not 1/N, so
   every gradient all-reduce is a plain sum and uneven or empty replica batches are exact;
   each optimizer reduces its gradients when ``apply`` starts, so clipping, loss-scale checks and
   updates see the global gradient, as on one device. Built-in or custom ``train_step``, several
   optimizers, any variable order, ``steps_per_execution``, ``LossScaleOptimizer``.
3. Keras's own ``gradient_accumulation_steps=k`` works (MirroredStrategy crashes on it): the
   optimizer's all-reduce sits in a ``tf.cond``, so there tfdp reduces from the replica contexts
   (``tfdp.reduce.collective``), one all-reduce per k micro-steps.
4. Mirrored means mirrored. Floating non-trainable variables with aggregation NONE (BatchNorm
   moving statistics) are averaged across replicas (weighted by batch share) at the end of every
   training step (a step in which an optimizer applied gradients, Keras's or a custom loop's), so
   the copies never drift apart (MirroredStrategy lets them drift).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp.compat import names
from tfdp.errors import invalid_argument, unknown_arguments
from tfdp.keras import gradient_path
from tfdp.reduce.reducer import Reducer
from tfdp.strategy.announce import announce
from tfdp.strategy.extended import DataParallelExtendedBase
from tfdp.strategy.role import worker_role
from tfdp.strategy.settings import Settings
from tfdp.strategy.setup_order import CheckedScope, SetupOrderChecks

log = logging.getLogger("tfdp")
_logged_choices: set = set()
_log_lock = threading.Lock()


#: The extras of tfdp.compat.names every strategy uses (each off, with one warning, where the
#: installed TF / Keras lacks a name it needs); ``zero`` too when zero_stage is set.
_EXTRAS = ("symbolic_build", "sparse_reads", "fast_iterators", "pipeline_walk")


def _supported(settings):
    """``settings`` after checking the installed TF / Keras: refused (one line) when an
    essential feature lacks a name; zero_stage 0 when sharded state cannot be hooked (the
    warning says so)."""
    off = names.require(*names.ESSENTIAL, *_EXTRAS, *(("zero",) if settings.zero_stage else ()),
                        by="tfdp.DataParallelStrategy")
    if "zero" in off:
        settings = dataclasses.replace(settings, zero_stage=0)
    return settings


class DataParallelStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over local devices with tfdp's all-reduce.

    With a cluster of several workers (``TF_CONFIG``, SLURM, ``cluster_resolver`` or
    ``cluster``) the same call returns a ``tfdp.strategy.MultiWorkerDataParallelStrategy``
    (which is also a ``DataParallelStrategy``, and a ``tf.distribute.MultiWorkerMirroredStrategy``
    as Keras needs for cross-worker outputs), so a script runs unchanged on one or many workers.

    Args:
      devices: device names (``["GPU:0", "GPU:1"]``, ``["CPU:0", "CPU:1"]``); None means all
        local GPUs, else the logical CPU replicas (``tfdp.configure_cpu_replicas(n)`` or
        ``TFDP_CPU_REPLICAS=n``), else ``CPU:0``.
      all_reduce: "auto" | "fused" | "ring" | "one_device" | "nccl". "auto" picks NCCL when every
        device is a physical GPU and TF's NCCL kernel is registered, else "fused", and logs the
        choice once. An explicit choice that cannot run here raises, never falls back.
      bucket_bytes: fused-bucket capacity in bytes (0 disables fusion; None: measured default).
      compression: None | "fp16" | "bf16": gradients travel in that dtype.
      sparse: None | "auto" | "gather" | "densify": how IndexedSlices (Embedding gradients) are
        reduced (``tfdp.reduce.sparse``); None reads ``TFDP_SPARSE``, default "auto" (the
        measured rule; it densifies only for optimizers linear in the gradient, plain/momentum
        SGD without clipping).
      collective_timeout, heartbeat_timeout, startup_timeout: failure detection across workers
        (see ``MultiWorkerDataParallelStrategy``); validated, and unused, in a single process.
      zero_stage: 0 | 1 | 2: sharded optimizer state (``tfdp.zero``). 0 (default): every
        replica keeps the whole optimizer state. 1: each trainable variable has one owner
        replica that keeps its optimizer slots and applies its update, then copies the new
        value to every replica (bitwise the same weights as 0). 2: also each gradient is summed
        onto its owner only. None reads ``TFDP_ZERO_STAGE`` (default 0).
      micro_batches: k >= 1: each replica runs its part of every training step's batch in k
        micro-batches (Keras's own ``train_step``), their gradients summed and applied once:
        the same step, with a k-th of the examples in memory at a time
        (``tfdp.strategy.micro_batches``). None (default): the elastic policy decides.
      elastic_policy: "batch" | "accumulate": after an elastic job lost nodes (``tfdp launch
        --nnodes MIN:MAX``), fewer replicas take larger shares of the same global batch
        ("batch"), or run them in micro-batches no larger than a replica's share at the job's
        full size ("accumulate"). None reads ``TFDP_ELASTIC_POLICY`` (``tfdp launch
        --elastic-policy``; default "batch").
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver`` describing the
        cluster (TF_CONFIG / SLURM are read when it is None).
      cluster: a ``tfdp.cluster.ClusterInfo`` instead of a resolver.
    """

    def __new__(cls, devices=None, *, cluster_resolver=None, cluster=None, **kwargs):
        # Same script, no code change: a cluster of several workers gives the multi-worker
        # strategy. Python then runs *its* __init__ with these same arguments.
        # (The multi-worker class registers itself here when tfdp.strategy.multiworker is
        # imported, which every public path to this class does: tfdp.strategy.api.)
        del devices
        unknown = {k: v for k, v in kwargs.items() if k not in _ARGUMENTS}
        if unknown:   # (Python's own TypeError would name neither the valid ones nor the intent)
            raise unknown_arguments(cls.__name__, unknown, _ARGUMENTS, hints=_INTENT)
        if cls is DataParallelStrategy:
            info = cluster if cluster is not None else _resolve_cluster(cluster_resolver)
            if getattr(info, "num_workers", 1) > 1:
                multi_worker = DataParallelStrategy.__dict__.get("_multi_worker_class")
                if multi_worker is None:
                    raise ImportError("tfdp.strategy.multiworker is not imported: use "
                                      "tfdp.DataParallelStrategy (tfdp.strategy.api).")
                return super().__new__(multi_worker)
        return super().__new__(cls)

    def __init__(self, devices=None, *, all_reduce: str = "auto", bucket_bytes: int | None = None,
                 compression: str | None = None, sparse: str | None = None,
                 collective_timeout: float | None = None,
                 heartbeat_timeout: float | None = None, startup_timeout: float | None = None,
                 zero_stage: int | None = None, micro_batches: int | None = None,
                 elastic_policy: str | None = None,
                 cluster_resolver=None, cluster=None):
        settings = Settings.from_arguments(
            all_reduce=all_reduce, bucket_bytes=bucket_bytes, compression=compression,
            sparse=sparse, collective_timeout=collective_timeout,
            heartbeat_timeout=heartbeat_timeout, startup_timeout=startup_timeout,
            zero_stage=zero_stage, micro_batches=micro_batches, elastic_policy=elastic_policy)
        settings = _supported(settings)
        self._cluster = self._resolve(cluster_resolver, cluster, devices, settings)
        extended = self._extended_class(self, settings, devices, self._cluster)
        # (MirroredStrategy.__init__ / MultiWorkerMirroredStrategy.__init__ minus their extended)
        tf.distribute.Strategy.__init__(self, extended)
        self._started(devices)

    # --- what the multi-worker strategy overrides --------------------------------------------

    def _resolve(self, cluster_resolver, cluster, devices, settings):
        """The job's ``ClusterInfo`` (a single worker here), checked before anything starts."""
        del devices, settings
        return cluster if cluster is not None else _resolve_cluster(cluster_resolver)

    @property
    def _extended_class(self):
        return LocalExtended

    def _started(self, devices):
        """After the extended exists: log the choice (once per configuration) and say what
        the program runs on (``tfdp.strategy.announce``)."""
        del devices
        _log_choice_once(self.extended.tfdp_settings.all_reduce, self.extended.tfdp_choice,
                         self.extended.worker_devices, self.extended.tfdp_reduce)
        announce(self)

    def scope(self):
        """``tf.distribute.Strategy.scope``; entering it while another strategy is current is
        one ``SetupOrderError`` naming the fix (TF's "Mixing different tf.distribute.Strategy
        objects" otherwise)."""
        return CheckedScope(super().scope(), self)

    # --- tfdp's additions ---------------------------------------------------------------------

    @property
    def all_reduce(self) -> str:
        """The algorithm in use ("fused", "ring", "one_device" or "nccl")."""
        return self.extended.tfdp_choice.algorithm

    @property
    def bucket_bytes(self) -> int:
        return self.extended.tfdp_reduce.bucket_bytes

    @property
    def compression(self):
        return self.extended.tfdp_reduce.compression

    @property
    def cross_device_ops(self):
        """tfdp's reducer (``tfdp.reduce.Reducer``, in one process or across workers)."""
        return self.extended.tfdp_reduce

    @property
    def collective_timeout(self):
        return self.extended.tfdp_settings.collective_timeout

    @property
    def heartbeat_timeout(self):
        return self.extended.tfdp_settings.heartbeat_timeout

    @property
    def startup_timeout(self):
        return self.extended.tfdp_settings.startup_timeout

    @property
    def zero_stage(self) -> int:
        """0, 1 or 2: how optimizer state is sharded (``tfdp.zero``)."""
        return self.extended.tfdp_settings.zero_stage

    @property
    def cluster(self):
        """The resolved cluster (a ``tfdp.cluster.ClusterInfo``)."""
        return self._cluster

    @property
    def num_workers(self) -> int:
        """Worker processes in the job (1 here)."""
        return worker_role(self).count

    @property
    def worker_index(self) -> int:
        """This worker's rank (0 here)."""
        return worker_role(self).index

    @property
    def is_chief(self) -> bool:
        """Whether this worker writes shared files (checkpoints, backups)."""
        return worker_role(self).is_chief

    def reduce(self, reduce_op, value, axis):
        """``tf.distribute.Strategy.reduce``, also for nested structures.

        Nested lists/tuples/dicts are reduced leaf by leaf; ``axis=0`` on a scalar means
        ``axis=None``. ``SUM`` sums and ``MEAN`` averages, as in TF; per-replica tensors of
        different shapes (an uneven batch) can only be reduced along an axis, e.g. ``axis=0``.
        (Keras's symbolic build reduces the first distributed batch with ``axis=None`` only to
        learn its shapes; there alone tfdp returns the batch itself.)
        """
        if not tfp.is_distributed_values(value) and isinstance(value, (list, tuple, dict)):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if tfp.is_distributed_values(value):
            comps = self.experimental_local_results(value)
            if axis is not None and all(isinstance(c, tf.Tensor) and c.shape.rank == 0
                                        for c in comps):
                axis = None
            if (axis is None and tf.executing_eagerly() and len(comps) > 1
                    and all(isinstance(c, tf.Tensor) and c.shape.rank for c in comps)
                    and len({tuple(c.shape) for c in comps}) > 1):
                if (gradient_path.in_keras_symbolic_build()
                        and len({tuple(c.shape[1:]) for c in comps}) == 1):
                    return tf.concat([tf.identity(c) for c in comps], axis=0)
                raise uneven_reduce_error(reduce_op, [c.shape for c in comps])
        return super().reduce(reduce_op, value, axis)

    def __repr__(self):
        devs = [devices_lib.short_name(d) for d in self.extended.worker_devices]
        zero = f", zero_stage={self.zero_stage}" if self.zero_stage else ""
        k = self.extended.tfdp_micro_batches
        zero += f", micro_batches={k}" if k > 1 else ""
        return (f"DataParallelStrategy(devices={devs}, all_reduce={self.all_reduce!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}{zero})")


#: The keyword arguments of DataParallelStrategy (both forms), in its docstring's order.
_ARGUMENTS = ("devices", "all_reduce", "bucket_bytes", "compression", "sparse",
              "collective_timeout", "heartbeat_timeout", "startup_timeout", "zero_stage",
              "micro_batches", "elastic_policy", "cluster_resolver", "cluster")
_REPLICAS = ("The replica count comes from the devices: devices=['GPU:0', 'GPU:1'] (or "
             "['CPU:0', 'CPU:1']); on a host without a GPU, set TFDP_CPU_REPLICAS={value} in the "
             "environment (or call tfdp.configure_cpu_replicas({value}) first thing in the "
             "program) and pass no devices.")
_WORKERS = ("The workers come from the cluster: TF_CONFIG, SLURM or cluster_resolver= (`tfdp "
            "launch --workers {value} -- python train.py` sets TF_CONFIG for you).")
#: Unknown names whose intent is clear: what to write instead.
_INTENT = {name: _REPLICAS for name in (
    "num_replicas", "replicas", "n_replicas", "replica_count", "num_replicas_in_sync",
    "num_devices", "n_devices", "num_gpus", "gpus", "n_gpus", "cpu_replicas", "num_cpus",
    "cpus", "n")}
_INTENT.update({name: _WORKERS for name in ("num_workers", "workers", "n_workers", "world_size",
                                            "nnodes", "num_nodes")})
_INTENT["device"] = "Did you mean devices={value!r}? (a list of device names)"


class LocalExtended(SetupOrderChecks, DataParallelExtendedBase, tfp.MirroredExtended):
    """MirroredExtended over this process's devices with tfdp's reduction and step path."""

    def _init_tf_extended(self, container_strategy, cluster):
        del cluster
        settings = self.tfdp_settings
        devices = devices_lib.resolve_devices(self._tfdp_requested_devices)
        choice = self._choose(devices)
        reduce = Reducer(devices, 1, choice.algorithm, settings.bucket_bytes,
                         settings.compression, settings.sparse)
        tfp.MirroredExtended.__init__(self, container_strategy, devices=devices,
                                      cross_device_ops=reduce)
        return reduce

    def _num_workers_in_job(self) -> int:
        return 1


def uneven_reduce_error(reduce_op, shapes):
    from tfdp.errors import TfdpError, message
    op = getattr(reduce_op, "name", reduce_op)
    return TfdpError(message(
        f"strategy.reduce({op!r}, axis=None) needs the same shape on every replica",
        f"per-replica shapes {[tuple(s) for s in shapes]}",
        "Reduce along the batch axis instead (axis=0), or gather the values with "
        "strategy.gather(value, axis=0)."))


def _log_choice_once(requested, choice, devs, reduce):
    key = (requested, choice.algorithm, tuple(devs))
    with _log_lock:
        if key in _logged_choices:
            return
        _logged_choices.add(key)
    log.info("tfdp: %d replica(s) %s; all_reduce=%r -> %r (%s); bucket_bytes=%d; compression=%s",
             len(devs), [devices_lib.short_name(d) for d in devs], requested, choice.algorithm,
             choice.reason, reduce.bucket_bytes, reduce.compression)


def _resolve_cluster(cluster_resolver):
    if cluster_resolver is not None and not isinstance(
            cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise invalid_argument(
            "cluster_resolver", cluster_resolver,
            fix="Pass a tf.distribute.cluster_resolver.ClusterResolver (e.g. "
                "TFConfigClusterResolver or SlurmClusterResolver), or None to read TF_CONFIG / "
                "SLURM from the environment.")
    try:
        from tfdp.cluster import resolve_cluster
    except ImportError:  # pragma: no cover - cluster module not installed
        return None
    return resolve_cluster(cluster_resolver)


__all__ = ["DataParallelStrategy", "LocalExtended", "uneven_reduce_error"]
