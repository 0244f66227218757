"""DataParallelStrategy: a tf.distribute.Strategy with mirrored variables and tfdp's reduction.

Used exactly like ``tf.distribute.MirroredStrategy``::

    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(...)
    model.fit(dataset)

On top of MirroredStrategy's variable mirroring and input pipeline it changes four things:

1. Reduction is tfdp's own (``tfdp.reduce``): fused buckets, NCCL/ring/tree, compression.
2. Uneven batches are exact. Keras scales each replica's mean loss by 1/num_replicas whatever the
   replica's share of the batch, so a global batch of 50 over 4 replicas (13,13,12,12) does not
   give the global-batch mean. During a Keras ``train_step`` tfdp weights replica r's gradients
   by ``n_r * N / sum(n)`` inside the gradient all-reduce, which makes the step exactly the
   global-batch mean (weights are exactly 1.0 for even splits).
3. Keras's own ``gradient_accumulation_steps=k`` works (MirroredStrategy crashes on it): the
   optimizer's all-reduce sits in a ``tf.cond``, so during such train steps tfdp reduces from
   the replica contexts (``tfdp.reduce.collective``), one all-reduce per k micro-steps.
4. Mirrored means mirrored. Floating non-trainable variables with aggregation NONE (BatchNorm
   moving statistics) are averaged across replicas (weighted by batch share) at the end of every
   Keras train step, so the copies never drift apart (MirroredStrategy lets them drift). In a
   custom loop with BatchNormalization, use ``SyncBatchNorm``-style layers or average them yourself.
"""

from __future__ import annotations

import logging
import threading

import tensorflow as tf

from tfdp import _tf_private as tfp
from tfdp import devices as devices_lib
from tfdp.errors import invalid_argument
from tfdp.reduce import registry
from tfdp.reduce.local import DataParallelReduce

log = logging.getLogger("tfdp")
_logged_choices: set = set()
_log_lock = threading.Lock()


class DataParallelStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over local devices with tfdp's all-reduce.

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
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver`` describing the
        cluster (TF_CONFIG / SLURM are read when it is None).
    """

    def __new__(cls, devices=None, *, cluster_resolver=None, **kwargs):
        # Same script, no code change: a cluster of several workers (TF_CONFIG, SLURM or an
        # explicit resolver) gives the multi-worker strategy. Python then skips __init__ below.
        if cls is DataParallelStrategy:
            info = _resolve_cluster(cluster_resolver)
            if info is not None and info.num_workers > 1:
                from tfdp.multiworker import MultiWorkerDataParallelStrategy
                return MultiWorkerDataParallelStrategy(info, devices, **kwargs)
        return super().__new__(cls)

    def __init__(self, devices=None, *, all_reduce: str = "auto", bucket_bytes: int | None = None,
                 compression: str | None = None, sparse: str | None = None,
                 cluster_resolver=None):
        from tfdp.reduce import sparse as sparse_lib
        sparse = sparse_lib.resolve_mode(sparse)
        algorithm = registry.validate_algorithm(all_reduce)
        compression = registry.validate_compression(compression)
        bucket_bytes = registry.validate_bucket_bytes(bucket_bytes)
        self._cluster = _resolve_cluster(cluster_resolver)
        devs = devices_lib.resolve_devices(devices)
        choice = registry.choose(
            algorithm, devs, physical_gpus=len(tf.config.list_physical_devices("GPU")),
            nccl_kernel=tfp.nccl_kernel_registered())
        self._requested_all_reduce = algorithm
        self._choice = choice
        self._reduce = DataParallelReduce(choice.algorithm, bucket_bytes, compression, sparse)
        _log_choice_once(algorithm, choice, devs, self._reduce)
        extended = _DataParallelExtended(self, devices=devs, cross_device_ops=self._reduce)
        tf.distribute.Strategy.__init__(self, extended)  # MirroredStrategy.__init__ minus its extended

    # --- tfdp's additions ---------------------------------------------------------------------

    @property
    def all_reduce(self) -> str:
        """The algorithm in use ("fused", "ring", "one_device" or "nccl")."""
        return self._choice.algorithm

    @property
    def bucket_bytes(self) -> int:
        return self._reduce.bucket_bytes

    @property
    def compression(self):
        return self._reduce.compression

    @property
    def cross_device_ops(self) -> DataParallelReduce:
        return self._reduce

    @property
    def cluster(self):
        """The resolved cluster (a ``tfdp.cluster.ClusterInfo``; single worker for now)."""
        return self._cluster

    def reduce(self, reduce_op, value, axis):
        """``tf.distribute.Strategy.reduce``, also for nested structures and uneven batches.

        Nested lists/tuples/dicts are reduced leaf by leaf; ``axis=0`` on a scalar means
        ``axis=None``. Eagerly reducing (``axis=None``) per-replica tensors whose leading
        dimensions differ (the uneven last batch, as Keras's symbolic build does) is undefined in
        TF; tfdp returns their concatenation along axis 0, i.e. the global batch.
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
                    and len({tuple(c.shape) for c in comps}) > 1
                    and len({tuple(c.shape[1:]) for c in comps}) == 1):
                return tf.concat([tf.identity(c) for c in comps], axis=0)
        return super().reduce(reduce_op, value, axis)

    def __repr__(self):
        devs = [devices_lib.short_name(d) for d in self.extended.worker_devices]
        return (f"DataParallelStrategy(devices={devs}, all_reduce={self.all_reduce!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r})")


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


# --- the extended: variable creation, uneven-batch weights --------------------------------------

class _GradientContext:
    """Set while a Keras train step runs: the model and each replica's gradient weight."""

    def __init__(self, model, weights):
        self.model = model
        self.weights = weights
        self.used = False


def _keras_train_step_model(fn):
    """The Keras model whose ``train_step`` ``fn`` is (through wrappers), else None."""
    import keras
    f, depth = fn, 0
    while f is not None and depth < 16:
        owner = getattr(f, "__self__", None)
        if getattr(f, "__name__", None) == "train_step" and isinstance(owner, keras.Model):
            return owner
        f = getattr(f, "__wrapped__", None)
        depth += 1
    return None


def _accumulation_steps(model):
    """The model optimizer's ``gradient_accumulation_steps`` (also behind a loss-scale wrapper)."""
    opt = getattr(model, "optimizer", None)
    for o in (opt, getattr(opt, "inner_optimizer", None)):
        steps = getattr(o, "gradient_accumulation_steps", None)
        if steps:
            return int(steps)
    return None


def _linear_in_gradient(optimizer) -> bool:
    """Whether ``optimizer``'s update is linear in the gradient, so a densified IndexedSlices
    (duplicate ids summed first) gives the same update: plain or momentum SGD without clipping
    (Keras's Adam/Adagrad/RMSprop square sparse rows one by one; clipping takes norms)."""
    import keras
    if not isinstance(optimizer, keras.optimizers.SGD):
        return False
    return all(getattr(optimizer, a, None) is None
               for a in ("clipnorm", "clipvalue", "global_clipnorm"))


def _assert_even_split(weights, steps):
    """With gradient accumulation every micro-batch must split evenly over the replicas."""
    w = tf.stack(weights)
    tf.debugging.assert_near(
        w, tf.ones_like(w), rtol=1e-6, atol=0.0, message=(
            "tfdp: with gradient_accumulation_steps="
            f"{steps} every micro-batch must split evenly over the replicas (an uneven split "
            "cannot be weighted exactly once gradients are accumulated). Received: an uneven "
            "batch (per-replica weights != 1). Fix: make the global batch size divisible by the "
            "number of replicas and drop the remainder (dataset.batch(..., drop_remainder=True) "
            "or tfdp.data with drop_remainder=True)."))


def _is_subsequence(short, long) -> bool:
    it = iter(long)
    return all(any(s == x for x in it) for s in short)


class _DataParallelExtended(tfp.MirroredExtended):

    def __init__(self, container_strategy, devices, cross_device_ops):
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)
        self._tfdp_reduce = cross_device_ops
        self._grad_ctx = None
        self._tfdp_no_merge = False
        self._tfdp_replica_reduce = None
        self._replica_reducer()  # now, outside any strategy scope (it creates variables)

    # --- Keras train steps: uneven-batch weights, BatchNorm sync, gradient accumulation --------

    def _call_for_each_replica(self, fn, args, kwargs):
        model = _keras_train_step_model(fn)
        if model is None:
            return self._run_replicas(fn, args, kwargs)
        self._tfdp_reduce.densify_ok = _linear_in_gradient(getattr(model, "optimizer", None))
        accumulate = (_accumulation_steps(model) is not None and not tf.executing_eagerly())
        many = len(self.worker_devices) > 1 or self._num_workers_in_job() > 1
        weights = self._replica_weights(args) if many else None
        if not accumulate and weights is None:
            return self._run_replicas(fn, args, kwargs)
        if accumulate and weights is not None:
            _assert_even_split(weights, _accumulation_steps(model))
        previous = self._grad_ctx, self._tfdp_no_merge
        # Gradient accumulation: Keras all-reduces inside a tf.cond, where merge_call is refused;
        # reduce from the replica contexts instead (tfdp.reduce.collective), one reduction per k
        # micro-steps. Weights are 1 there (asserted above), so the plain sum is exact.
        self._grad_ctx = None if accumulate else _GradientContext(model, weights)
        self._tfdp_no_merge = accumulate
        try:
            result = self._run_replicas(fn, args, kwargs)
        finally:
            self._grad_ctx, self._tfdp_no_merge = previous
        if weights is not None:
            self._sync_replica_local_state(model, weights)
        return result

    def _run_replicas(self, fn, args, kwargs):
        return tfp.MirroredExtended._call_for_each_replica(self, fn, args, kwargs)

    def _num_workers_in_job(self) -> int:
        return 1

    def _use_merge_call(self):
        if self._tfdp_no_merge:
            return False
        return super()._use_merge_call()

    def _get_cross_device_ops(self, value):
        if self._tfdp_no_merge:  # (MirroredExtended would switch to its XLA collectives here)
            return self._tfdp_reduce
        return super()._get_cross_device_ops(value)

    def _replica_reducer(self):
        if self._tfdp_replica_reduce is None:
            from tfdp.reduce.collective import ReplicaAllReduce
            ops = self._tfdp_reduce
            self._tfdp_replica_reduce = ReplicaAllReduce(
                self.worker_devices, self._num_workers_in_job(), ops.bucket_bytes,
                ops.compression, getattr(ops, "timeout_seconds", 0.0))
        return self._tfdp_replica_reduce

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if not self._tfdp_no_merge or tf.executing_eagerly():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        replica_id = tfp.current_replica_id()
        flat = tf.nest.flatten(value)
        reduced = self._replica_reducer().all_reduce(reduce_op, flat, replica_id)
        return tf.nest.pack_sequence_as(value, reduced)

    def _sync_replica_local_state(self, model, weights):
        """Average float non-trainable variables with aggregation NONE across replicas.

        Such variables (BatchNorm moving statistics) are updated by each replica with its own
        batch statistics, so MirroredStrategy lets their copies drift apart. After each train step
        tfdp replaces every copy by the batch-share-weighted mean of the copies (for a moving mean
        that is exactly the update with the global batch mean). Ordered after the step's updates
        by TF's automatic control dependencies on the same resources.
        """
        targets = []
        for v in model.non_trainable_variables:
            tv = getattr(v, "value", v)
            if (tfp.is_distributed_values(tv) and tv.dtype.is_floating
                    and tv.aggregation == tf.VariableAggregation.NONE):
                targets.append(tv)
        if not targets:
            return
        pairs = []
        for tv in targets:
            comps = []
            for c in tv.values:
                with tf.device(c.device):
                    comps.append(c.read_value())
            pairs.append((tfp.PerReplica(tuple(comps)), tv))
        means = self._tfdp_reduce.batch_reduce_weighted(tf.distribute.ReduceOp.MEAN, pairs, weights)
        for tv, mean in zip(targets, means):
            for c, m in zip(tv.values, self._local_results(mean)):
                with tf.device(c.device):
                    c.assign(m)

    def _replica_weights(self, args):
        """w_r = n_r * N / sum(n): replica r's share of the global batch, times N."""
        n = len(self.worker_devices)
        for leaf in tf.nest.flatten(args):
            if not tfp.is_distributed_values(leaf):
                continue
            comps = list(leaf.values)
            if len(comps) != n or not all(isinstance(c, tf.Tensor) and c.shape.rank
                                          for c in comps):
                continue
            sizes = [tf.cast(tf.shape(c)[0], tf.float32) for c in comps]
            total = tf.math.add_n(sizes)
            scale = tf.math.divide_no_nan(tf.constant(float(n)), total)
            return [s * scale for s in sizes]
        return None

    def _fill_destinations(self, value, destinations):
        # A one-device replica-context all_reduce passes a tensor whose device string is empty:
        # MirroredStrategy then fails with "destinations can not be empty". Use the value's
        # devices (or the single replica device) instead.
        if tfp.has_destinations(destinations):
            return destinations
        if tfp.is_distributed_values(value):
            return value
        if len(self.worker_devices) == 1:
            return self.worker_devices[0]
        return destinations

    def _reduce_to(self, reduce_op, value, destinations, options):
        return super()._reduce_to(reduce_op, value, self._fill_destinations(value, destinations),
                                  options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        value_destination_pairs = [(v, self._fill_destinations(v, d))
                                   for v, d in value_destination_pairs]
        ctx = self._grad_ctx
        if ctx is not None and not ctx.used and _op_is_sum(reduce_op):
            pairs = list(value_destination_pairs)
            shapes = [tuple(v.values[0].shape) if tfp.is_distributed_values(v) else None
                      for v, _ in pairs]
            var_shapes = [tuple(v.shape) for v in ctx.model.trainable_variables]
            if (None not in shapes and _is_subsequence(shapes, var_shapes)
                    and (len(shapes) > 1 or len(var_shapes) == 1)):
                ctx.used = True
                return self._tfdp_reduce.batch_reduce_weighted(reduce_op, pairs, ctx.weights)
            value_destination_pairs = pairs
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)


def _op_is_sum(reduce_op) -> bool:
    if isinstance(reduce_op, str):
        return reduce_op.upper() == "SUM"
    return reduce_op == tf.distribute.ReduceOp.SUM
