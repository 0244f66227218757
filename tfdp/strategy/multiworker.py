"""MultiWorkerDataParallelStrategy: DataParallelStrategy across several worker processes.

Each worker process runs K replicas on its own devices (its GPUs, else its logical CPU devices:
``TFDP_CPU_REPLICAS=K`` / ``tfdp.configure_cpu_replicas(K)``), so a job of W workers has
``num_replicas_in_sync == W * K``. Used exactly like ``tf.distribute.MultiWorkerMirroredStrategy``,
with the cluster from ``TF_CONFIG`` / SLURM (``tfdp.cluster.resolve_cluster``)::

    strategy = MultiWorkerDataParallelStrategy()      # before models and variables
    with strategy.scope():
        model = build_model()
        model.compile(...)
    model.fit(global_dataset)   # every worker passes the same global dataset

How it is built (TF 2.21):

* The strategy *is* a ``tf.distribute.MultiWorkerMirroredStrategy`` (subclass), so Keras 3
  reduces fit/evaluate outputs and concatenates predict outputs across workers, the input
  pipeline is sharded per worker (``InputContext``: every element of a global batch reaches
  exactly one replica of one worker), initial variable values are broadcast from worker 0, and the
  gRPC server / collective runtime are started as by TF.
* Its extended subclasses TF's ``CollectiveAllReduceExtended`` (which only ever uses CPU:0 or
  the GPUs of a worker) to use the worker's K local devices, and tfdp's ``_DataParallelExtended``
  (Keras train-step detection, uneven-batch gradient weights, BatchNorm-statistics sync).
* Reduction (:class:`MultiWorkerReduce`) is hierarchical: the K local values are summed first
  (packed into buckets, ``tfdp.reduce.packing``; weighted; optionally compressed), then summed
  across workers by one TF collective per bucket (``CollectiveReduceV2``, RING on CPU with
  ``max_subdivs_per_device=16``, NCCL on GPUs) on one device per worker, then copied to the local
  devices. With ``all_reduce="ring"`` the local stage is a reduce-scatter: device c of every
  worker all-reduces chunk c, i.e. K concurrent cross-worker collectives, then a local all-gather.
  ``tf.IndexedSlices`` (embedding gradients) are all-gathered: locally, then across workers
  (padded to the longest worker's slice count, then unpadded).
* Uneven batches stay exact across workers: replica r's gradient weight is ``n_r * N / sum(n)``
  with the sum over all N replicas of all workers (a cross-worker all-reduce of each worker's
  local example count, inside the train step).
* Never hang: a dead, killed, SIGSTOPped or unreachable worker is detected by TF's coordination
  service heartbeats (``heartbeat_timeout``, default 6 s, ``TFDP_HEARTBEAT_TIMEOUT``); the
  other workers' collectives then fail and each worker prints one line, after the traceback,
  naming the lost worker and its address (``tfdp: peer failure: worker 1 (127.0.0.1:40445) has
  stopped responding ...``) and exits non-zero; ``tfdp launch`` repeats that line and stops the
  rest. An optional collective timeout (``collective_timeout``, ``TFDP_COLLECTIVE_TIMEOUT``, off
  by default) also catches a worker that is alive but never reaches the next collective.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp import failures, gradient_path
from tfdp.strategy import local as strategy_lib
from tfdp.errors import TfdpError, invalid_argument
from tfdp.reduce import compression as codec
from tfdp.reduce import keys, packing, registry
from tfdp.reduce.local import _in_place, _op, _scale, tree_sum  # shared with the local one

CollectiveAllReduceExtended = tfp.CollectiveAllReduceExtended
late_collective_config = tfp.late_collective_config

log = logging.getLogger("tfdp")

# Collective keys. TF's own CollectiveKeys (initial-value broadcast, TF's CollectiveAllReduce
# used for gather) hand out small group keys from 1; tfdp's groups live far above. Instance keys
# come from tfdp.reduce.keys (run-time counters, one per local device slot).
_GROUP_KEY_BASE = 1 << 24

# dtypes CollectiveReduceV2 / CollectiveGatherV2 accept (others are cast for the trip).
_REDUCE_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64, tf.int32, tf.int64)
_GATHER_DTYPES = (tf.float32, tf.float16, tf.float64, tf.int32, tf.int64)
COMPRESSED_BUCKET_BYTES = 64 * 1024 * 1024  # bucket cap when gradients are compressed
_RING_SUBDIVS = 16  # measured: 2 workers, 64 MB float32 on loopback: 610 ms -> 267 ms (DESIGN.md)

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


def _copies(t, devices):
    """``t`` on every device of ``devices`` (t itself where it already is)."""
    out = []
    for d in devices:
        with tf.device(d):
            out.append(tf.identity(t))
    return out


# --- the cross-device ops ----------------------------------------------------------------------

class MultiWorkerReduce(tf.distribute.CrossDeviceOps):
    """Hierarchical all-reduce: local devices, then across workers with TF collectives.

    Args:
      devices: this worker's replica devices (canonical strings), in local replica order.
      num_workers: number of worker processes (each with ``len(devices)`` replicas).
      algorithm: local stage: "ring" (reduce-scatter, one cross-worker collective per local
        device and chunk, all-gather) or anything else (pairwise tree to the first device, one
        cross-worker collective there, copy back).
      bucket_bytes: fusion bucket capacity (``tfdp.reduce.packing``); None: packing's default.
      compression: None, "fp16" or "bf16": dense float buckets travel in that dtype.
      fallback: TF's ``CollectiveAllReduce`` over the same devices, used for ``gather``.
      timeout_seconds: collective timeout (0: none); an expired collective raises
        DeadlineExceededError instead of waiting for a peer forever.
      sparse: IndexedSlices: "auto", "gather" or "densify" (``tfdp.reduce.sparse``); None reads
        ``TFDP_SPARSE`` (default "auto").
    """

    def __init__(self, devices, num_workers: int, algorithm: str = "fused",
                 bucket_bytes: int | None = None, compression: str | None = None, *,
                 fallback=None, timeout_seconds: float = 0.0, sparse: str | None = None):
        super().__init__()
        from tfdp.reduce import sparse as sparse_lib
        self.sparse = sparse_lib.resolve_mode(sparse)
        self.densify_ok = False  # set per Keras train step (strategy._DataParallelExtended)
        self.devices = tuple(devices)
        self.num_workers = int(num_workers)
        self.algorithm = algorithm
        bucket_bytes = registry.validate_bucket_bytes(bucket_bytes)
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = registry.validate_compression(compression)
        self.timeout_seconds = float(timeout_seconds)
        self._fallback = fallback
        self.gpu = all(devices_lib.is_gpu(d) for d in self.devices)
        self.hint = "nccl" if self.gpu else "ring"
        # NCCL needs every worker to launch collectives in the same order: each collective on a
        # GPU takes its device's ordering token (a resource), so TF's automatic control
        # dependencies run them in program order (as TF's own CollectiveReplicaLauncher does).
        self._tokens = None
        if self.gpu:
            with tf.init_scope():
                self._tokens = []
                for d in self.devices:
                    with tf.device(d):
                        self._tokens.append(tf.Variable(0.0, trainable=False,
                                                        name="tfdp_collective_order"))
        self._keys = keys.InstanceKeys(self.devices, "tfdp_cross_worker_key")
        self.traced_batch_reductions = 0
        self.last_plan: list = []

    def __repr__(self):
        return (f"MultiWorkerReduce(workers={self.num_workers}, local_devices="
                f"{len(self.devices)}, algorithm={self.algorithm!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}, "
                f"cross_worker={self.hint!r})")

    @property
    def _num_between_graph_workers(self):
        return self.num_workers

    @property
    def num_replicas(self) -> int:
        return len(self.devices) * self.num_workers

    # --- cross-worker primitives (one device per worker; same call order on every worker) ----

    def _ordering_token(self, index):
        return [] if self._tokens is None else [self._tokens[index].handle]

    def cross_worker_sum(self, t, index: int = 0):
        """Sum ``t`` (on local device ``index``) over the workers: one collective."""
        dtype = t.dtype
        wire = t
        if dtype not in _REDUCE_DTYPES:
            wire = tf.cast(t, tf.int64 if dtype.is_integer or dtype == tf.bool else tf.float32)
        with tf.device(self.devices[index]):
            out = tf.raw_ops.CollectiveReduceV2(
                input=wire, group_size=self.num_workers, group_key=_GROUP_KEY_BASE + index,
                instance_key=self._keys.next(index), ordering_token=self._ordering_token(index),
                merge_op="Add", final_op="Id", communication_hint=self.hint,
                timeout_seconds=self.timeout_seconds,
                max_subdivs_per_device=-1 if self.gpu else _RING_SUBDIVS)
            return out if wire is t else tf.cast(out, dtype)

    def cross_worker_gather(self, t, index: int = 0):
        """Concatenate ``t`` (same shape on every worker) of all workers along axis 0."""
        dtype = t.dtype
        wire = t if dtype in _GATHER_DTYPES else tf.cast(
            t, tf.int64 if dtype.is_integer or dtype == tf.bool else tf.float32)
        with tf.device(self.devices[index]):
            out = tf.raw_ops.CollectiveGatherV2(
                input=wire, group_size=self.num_workers, group_key=_GROUP_KEY_BASE + index,
                instance_key=self._keys.next(index), ordering_token=self._ordering_token(index),
                communication_hint=self.hint, timeout_seconds=self.timeout_seconds)
            return out if wire is t else tf.cast(out, dtype)

    def cross_worker_gather_ragged(self, t, index: int = 0):
        """Concatenate along axis 0 tensors whose first dimension differs between workers."""
        with tf.device(self.devices[index]):
            n = tf.shape(t, out_type=tf.int32)[:1]
            lens = self.cross_worker_gather(n, index)
            longest = tf.reduce_max(lens)
            pad = [[0, longest - n[0]]] + [[0, 0]] * (t.shape.rank - 1)
            gathered = self.cross_worker_gather(tf.pad(t, pad), index)
            keep = tf.reshape(tf.range(longest)[tf.newaxis, :] < lens[:, tf.newaxis], [-1])
            return tf.boolean_mask(gathered, keep)

    # --- tf.distribute.CrossDeviceOps contract -------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        del options
        if len(per_replica_value.values) != len(self.devices):
            raise ValueError(
                f"tfdp MultiWorkerReduce expects one value per local replica "
                f"({len(self.devices)}); got {len(per_replica_value.values)}.")
        reduced = self.all_reduce(reduce_op, [per_replica_value])[0]
        if (not tfp.has_destinations(destinations)
                or tuple(tfp.devices_of(destinations)) == self.devices):
            return reduced
        first = tfp.select_replica(0, reduced) if tfp.is_distributed_values(reduced) else reduced
        return self.broadcast(first, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self.batch_reduce_weighted(reduce_op, value_destination_pairs, None)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        if self._fallback is None:
            raise NotImplementedError("gather needs the fallback CollectiveAllReduce")
        return self._fallback._gather_implementation(  # pylint: disable=protected-access
            per_replica_value, destinations, axis, options)

    # --- tfdp ----------------------------------------------------------------------------------

    def batch_reduce_weighted(self, reduce_op, value_destination_pairs, weights):
        """batch_reduce where replica r's values are multiplied by ``weights[r]`` first."""
        reduce_op = _op(reduce_op)
        pairs = list(value_destination_pairs)
        if all(_in_place(d, self.devices) for _, d in pairs):
            return self.all_reduce(reduce_op, [v for v, _ in pairs], weights)
        if weights is not None:
            raise NotImplementedError("weighted reduction to other destinations")
        return [self.reduce_implementation(reduce_op, v, d, None) for v, d in pairs]

    def all_reduce(self, reduce_op, values, weights=None):
        """All-reduce PerReplica values over every replica of every worker.

        Args:
          reduce_op: SUM or MEAN (MEAN divides by the global replica count).
          values: DistributedValues with one component per local device, in replica order.
          weights: optional per-local-replica scalar tensors multiplying float values first.
        Returns:
          Mirrored values (plain tensors with one local device), identical on every worker.
        """
        reduce_op = _op(reduce_op)
        self.traced_batch_reductions += 1
        devices = list(self.devices)
        k = len(devices)
        n_global = self.num_replicas
        results = [None] * len(values)
        comps_of = [list(v.values) if tfp.is_distributed_values(v) else [v] for v in values]
        dense = [i for i, c in enumerate(comps_of) if not isinstance(c[0], tf.IndexedSlices)]
        sparse = [i for i, c in enumerate(comps_of) if isinstance(c[0], tf.IndexedSlices)]

        for i in sparse:
            results[i] = self._all_gather_slices(comps_of[i], weights, reduce_op)

        specs = []
        for i in dense:
            t = comps_of[i][0]
            specs.append((t.dtype, t.shape.num_elements(), t.dtype.size))
        cap = self.bucket_bytes
        if self.compression is not None and cap > 0:
            # Compressed: every collective has a fixed cost (~5 ms on loopback) that casting does
            # not shrink, so pack even large tensors into few big collectives (measured, 2 workers,
            # 64 MB in 32 tensors: fp16 1.17-1.61x over uncompressed one per tensor, 1.31-1.69x
            # packed; README "Compression").
            cap = max(cap, COMPRESSED_BUCKET_BYTES)
        plan = packing.plan(specs, cap)
        self.last_plan = plan
        for bucket in plan:
            idx = [dense[j] for j in bucket.indices]
            dtype = bucket.dtype
            shapes = [comps_of[i][0].shape for i in idx]
            if not bucket.fused and not shapes[0].is_fully_defined():
                shapes = None
            floating = dtype.is_floating
            compress = self.compression if floating else None
            pre_mean = reduce_op == MEAN and compress is not None
            bufs = []
            for r, d in enumerate(devices):
                with tf.device(d):
                    comps = [comps_of[i][r] for i in idx]
                    factor = None
                    if weights is not None and floating:
                        factor = tf.cast(weights[r], dtype)
                    if pre_mean:
                        factor = (1.0 / n_global) if factor is None else factor / n_global
                    if factor is not None:  # 0 * NaN = 0: an empty replica adds nothing
                        comps = [tf.math.multiply_no_nan(c, tf.cast(factor, dtype))
                                 for c in comps]
                    if compress is not None:  # cast first: the packing copy moves half the bytes
                        comps = [codec.encode(c, compress) for c in comps]
                    buf = packing.pack(comps) if bucket.fused else tf.identity(comps[0])
                    bufs.append(buf)
            post = (1.0 / n_global) if (reduce_op == MEAN and not pre_mean) else None

            def finish(t, index, dtype=dtype, post=post):
                return _scale(codec.decode(self.cross_worker_sum(t, index), dtype), post)

            size = bufs[0].shape.num_elements()
            if self.algorithm == "ring" and k > 1 and size is not None and size >= k:
                reduced = self._ring(bufs, devices, finish)
            else:
                reduced = self._tree(bufs, devices, finish)
            per_value = [[None] * k for _ in idx]
            for r, d in enumerate(devices):
                with tf.device(d):
                    parts = (packing.unpack(reduced[r], bucket.sizes, shapes) if bucket.fused
                             else [reduced[r]])
                for j, p in enumerate(parts):
                    per_value[j][r] = p
            for j, i in enumerate(idx):
                results[i] = tfp.mirrored(per_value[j])
        return results

    # --- local stages ------------------------------------------------------------------------

    @staticmethod
    def _tree(bufs, devices, finish):
        """Pairwise tree of adds to devices[0], finish (cross-worker) there, copy to all."""
        total = tree_sum(bufs, devices)
        with tf.device(devices[0]):
            total = finish(total, 0)
        return _copies(total, devices)

    @staticmethod
    def _ring(bufs, devices, finish):
        """Reduce-scatter (device c sums chunk c), finish chunk c on device c, all-gather."""
        k = len(bufs)
        shape = bufs[0].shape
        size = shape.num_elements()
        base, rem = divmod(size, k)
        sizes = [base + (1 if c < rem else 0) for c in range(k)]
        chunks = []
        for b, d in zip(bufs, devices):
            with tf.device(d):
                chunks.append(tf.split(tf.reshape(b, [-1]), sizes))
        summed = []
        for c, d in enumerate(devices):
            with tf.device(d):
                summed.append(finish(tf.math.add_n([chunks[r][c] for r in range(k)]), c))
        out = []
        for d in devices:
            with tf.device(d):
                out.append(tf.reshape(tf.concat(summed, 0), shape))
        return out

    def _all_gather_slices(self, comps, weights, reduce_op):
        """IndexedSlices over every replica of every worker: all-gathered (local replicas, then
        workers, in rank order) or densified and summed, by ``tfdp.reduce.sparse``'s rule
        (``TFDP_SPARSE``: auto | gather | densify)."""
        from tfdp.reduce import sparse as sparse_lib
        per_dev = sparse_lib.reduce_across_workers(
            comps, weights, self.devices, self.num_workers,
            self.sparse,
            gather=lambda t: self.cross_worker_gather(t, 0),
            sum_dense=lambda t: self.cross_worker_sum(t, 0),
            scale=(1.0 / self.num_replicas) if reduce_op == MEAN else None,
            densify_ok=self.densify_ok)
        return tfp.mirrored(per_dev)


# --- the extended ------------------------------------------------------------------------------

class _MultiWorkerExtended(strategy_lib._DataParallelExtended, CollectiveAllReduceExtended):
    """CollectiveAllReduceExtended on every local device, with tfdp's reduction and weights.

    Method resolution: tfdp's ``_DataParallelExtended`` first (replica shares for the gradient
    path, layer-state sync, destination filling), then TF's
    ``CollectiveAllReduceExtended`` (cluster, server, broadcasts, input sharding), then
    ``MirroredExtended``.
    """

    def __init__(self, container_strategy, cluster_resolver, local_devices, algorithm,
                 bucket_bytes, compression, timeout_seconds, heartbeat_timeout=None,
                 sparse=None):
        self._tfdp_requested_devices = local_devices
        self.tfdp_step = None
        self._tfdp_state_vars = []
        self._tfdp_on_read_vars = []
        if heartbeat_timeout:
            # TF's Python health-check thread, used only where no coordination service runs:
            # a peer is declared down after about interval + retries * timeout.
            self._check_health_interval = max(1.0, heartbeat_timeout / 2)
            self._check_health_timeout = max(1, int(heartbeat_timeout / 4))
            self._check_health_retry_limit = 2
        with late_collective_config() as late, tfp.coordination_heartbeat_timeout(
                heartbeat_timeout or 10.0):  # (TF's default)
            CollectiveAllReduceExtended.__init__(
                self, container_strategy, cluster_resolver=cluster_resolver,
                communication_options=tf.distribute.experimental.CommunicationOptions())
        self.tfdp_late_start = late
        if late:
            # The runtime started before (a dataset, tensor or op came first): its local devices
            # were just renamed to this task's. Keep what was built before usable.
            tfp.alias_former_local_devices(self._task_type, self._task_id)
            _warn_variables_made_before()
        devs = list(self.worker_devices)
        choice = registry.choose(
            algorithm, devs, physical_gpus=len(tf.config.list_physical_devices("GPU")),
            nccl_kernel=tfp.nccl_kernel_registered())
        self.tfdp_choice = choice
        self._tf_collective_ops = self._cross_device_ops
        self._tfdp_reduce = MultiWorkerReduce(
            devs, self._num_workers, choice.algorithm, bucket_bytes, compression,
            fallback=self._tf_collective_ops, timeout_seconds=timeout_seconds, sparse=sparse)
        self._cross_device_ops = self._tfdp_reduce
        self._init_tfdp(self._tfdp_reduce)  # strategy._DataParallelExtended's tfdp state

    def _create_variable(self, next_creator, **kwargs):
        # Worker 0 broadcasts each initial value; a worker whose model differs (another shape
        # for the same variable) makes TF fail deep in a collective error: say what and where.
        try:
            return super()._create_variable(next_creator, **kwargs)
        except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:
            message = failures.model_mismatch_message(e, kwargs.get("name"), self._num_workers)
            if message is None:
                raise
            raise TfdpError(message) from None

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        """Initial values of a mirrored variable's copies; see ``_copy_primary_initial_value``."""
        base = super()._get_variable_creator_initial_value(
            replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)
        if not _creating_inside_function():
            return base  # eagerly (or in a TF1 graph) TF's way is right
        if replica_id == 0:
            self._tfdp_primary_initial_value = None  # set when the primary is initialised

            def primary_initial_value():
                value = base() if callable(base) else base
                value = tf.convert_to_tensor(getattr(value, "wrapped_value", value),
                                             dtype=kwargs.get("dtype"))
                self._tfdp_primary_initial_value = value
                return value
            return primary_initial_value
        return _copy_primary_initial_value(
            base, getattr(self, "_tfdp_primary_initial_value", None), primary_var, device)

    # local devices: every GPU, else every logical CPU device of this worker
    def _initialize_local_devices(self, cluster_resolver, worker_device):
        requested = self._tfdp_requested_devices
        if requested is not None:
            names = [devices_lib.short_name(devices_lib.canonical(str(d))) for d in requested]
            kinds = {n.split(":")[0] for n in names}
            if len(kinds) != 1 or len(set(names)) != len(names):
                raise invalid_argument("devices", requested, fix="List each device once, all "
                                       "of one type (['CPU:0', 'CPU:1'] or ['GPU:0', 'GPU:1']).")
            return tuple(f"{worker_device}/device:{n}" for n in names), kinds.pop()
        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            return tuple(f"{worker_device}/device:GPU:{i}" for i in range(len(gpus))), "GPU"
        return (tuple(f"{worker_device}/device:CPU:{i}" for i in range(_local_cpu_count())),
                "CPU")

    # tfdp's reduction needs all local values at once: go through merge_call, except in the
    # replica-context path of gradient accumulation (strategy._DataParallelExtended).
    def _use_merge_call(self):
        return not self._tfdp_no_merge

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        self._refuse_all_reduce_in_xla()
        if self._tfdp_no_merge and not tf.executing_eagerly():
            return strategy_lib._DataParallelExtended._replica_ctx_all_reduce(
                self, reduce_op, value, options)
        return tfp.MirroredExtended._replica_ctx_all_reduce(self, reduce_op, value, options)

    def _num_workers_in_job(self) -> int:
        return self._num_workers

    def _total_examples(self, local_total):
        """The job's example count this step: one cross-worker sum of the worker's count."""
        with tf.device(self.worker_devices[0]):
            return self._tfdp_reduce.cross_worker_sum(local_total, 0)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if len(self.worker_devices) == 1:  # plain tensors: wrap, so the weighted path sees them
            value_destination_pairs = [
                (tfp.PerReplica((v,)) if isinstance(v, (tf.Tensor, tf.IndexedSlices)) else v, d)
                for v, d in value_destination_pairs]
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)


def _local_cpu_count() -> int:
    cpus = tf.config.list_physical_devices("CPU")
    conf = tf.config.get_logical_device_configuration(cpus[0]) if cpus else None
    return len(conf) if conf else 1


def _prepare_cpu_replicas(devices) -> None:
    """Apply TFDP_CPU_REPLICAS without starting the TF runtime (collectives need that first),
    also for an explicit device list (its CPU devices come from it too)."""
    del devices
    devices_lib.apply_cpu_replicas_env()  # a clear one-line error when it came too late


def _warn_variables_made_before() -> None:
    """After a late start: name the variables made before the strategy (they stay on devices
    that are no longer local, and any use fails deep in TF), with the fix, in one line."""
    import gc
    stale = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, tf.Variable) and "/job:localhost/" in (obj.device or ""):
                stale.append(obj.name)
        except Exception:  # pylint: disable=broad-except  (half-built objects)
            continue
    if stale:
        shown = ", ".join(repr(n) for n in stale[:5]) + (", ..." if len(stale) > 5 else "")
        log.warning(
            "tfdp: %d variable(s) were created before the multi-worker strategy and cannot be "
            "used in this job (the collective runtime moved this worker's devices). Received: "
            "%s. Create variables, layers, models and optimizers after "
            "tfdp.DataParallelStrategy() (inside strategy.scope()); datasets and tensors may "
            "come first.", len(stale), shown)


def _creating_inside_function() -> bool:
    """Whether a variable is being created while a ``tf.function`` is traced from eager code
    (TF then makes it an ``UnliftedInitializerVariable`` and tries to lift its initial value
    out of the function)."""
    if not tf.inside_function():
        return False
    with tf.init_scope():
        return tf.executing_eagerly()


def _copy_primary_initial_value(base, primary_value, primary_var, device):
    """Initial value of copy r > 0 of a mirrored variable created inside a ``tf.function``.

    TF's (MirroredExtended) is a *read of the primary copy* (``primary_var.value()``). Inside a
    traced function that read depends on the primary's handle, a capture of the function, so
    ``tf.function`` cannot lift the initializers out of the function (``lift_to_graph``
    ``UnliftableError``) and falls back to initialising inside the call (``fn_with_cond``). That
    fallback re-captures the function's call-time captures (the per-call collective instance
    keys of the cross-worker reduction) inside a ``tf.cond`` branch, where nothing feeds them:
    "You must feed a value for placeholder tensor 'cond/else/.../Placeholder' with dtype int32".
    That is what happened to optimizer slots created lazily by the first ``apply_gradients``
    inside a ``tf.function`` custom-loop step with several replicas per worker.

    Instead every copy takes the primary's initial value *tensor* (worker 0's broadcast value),
    so every initializer lifts: the same value on every copy of every worker, as before.
    """
    if (primary_value is None or primary_value.graph is not tf.compat.v1.get_default_graph()
            or primary_value.dtype != primary_var.dtype
            or not primary_value.shape.is_compatible_with(primary_var.shape)):
        return base  # (not this primary's value: TF's way)

    def copy_initial_value():
        with tf.device(device):
            return tf.identity(primary_value)
    return copy_initial_value


def _check_cluster(cluster):
    from tfdp.cluster import ClusterInfo, check_port_free, resolve_cluster
    from tfdp.cluster.spec import split_address
    if cluster is None:
        cluster = resolve_cluster()
    if not isinstance(cluster, ClusterInfo):
        raise invalid_argument("cluster", cluster,
                               fix="Pass a tfdp.cluster.ClusterInfo (tfdp.cluster.resolve_cluster()"
                                   "), or None to read TF_CONFIG / SLURM.")
    if cluster.num_workers < 2:
        raise invalid_argument(
            "cluster", cluster, what="MultiWorkerDataParallelStrategy needs a cluster of 2 or "
            "more workers", fix="Use tfdp.DataParallelStrategy for one process, or start the "
            "workers with `tfdp launch --workers N` (which sets TF_CONFIG).")
    if not tfp.collective_server_started():
        # TF's gRPC server binds every interface on this task's port: fail clearly if it is
        # taken rather than with gRPC's "could not start server" (also when the runtime
        # started before the strategy: a dataset or op came first). Once this process's own
        # server runs, it holds the port itself.
        _, port = split_address(cluster.address, "address")
        check_port_free("", port)
    return cluster


class MultiWorkerDataParallelStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism over every local device of every worker process.

    Datasets, tensors and seeds may come before it (tfdp starts TF's collective runtime late
    when needed and keeps earlier datasets working); create models and variables after it
    (earlier variables stay on devices that are no longer local: one warning names them).
    ``TFDP_CPU_REPLICAS`` is applied when tfdp is imported, so import tfdp before TF code runs.

    Args:
      cluster: a ``tfdp.cluster.ClusterInfo`` with 2 or more workers; None reads TF_CONFIG /
        SLURM (``tfdp.cluster.resolve_cluster()``).
      devices: this worker's replica devices (``["CPU:0", "CPU:1"]``, ``["GPU:0"]``); None
        means every local GPU, else the logical CPU devices (``TFDP_CPU_REPLICAS`` /
        ``tfdp.configure_cpu_replicas``), else CPU:0. Every worker must have as many.
      all_reduce, bucket_bytes, compression, sparse: as for ``tfdp.DataParallelStrategy``; the
        algorithm names the local stage ("ring": reduce-scatter + one cross-worker collective
        per device; others: tree to one device + one cross-worker collective).
      collective_timeout: seconds after which a cross-worker collective that is still waiting
        for a peer fails (DeadlineExceededError): catches a worker that is alive but never
        reaches the collective. None: ``TFDP_COLLECTIVE_TIMEOUT`` if set (0 / "none": off),
        else off (dead or frozen workers are still caught by the heartbeats). Set it above the
        slowest legitimate wait between workers (checkpoint saving, evaluation, first step).
      heartbeat_timeout: seconds without a heartbeat after which a worker counts as dead
        (TF's coordination service; dead, killed, SIGSTOPped or unreachable workers); the
        other workers' collectives then fail and each prints one line naming the lost worker
        and its address. None: ``TFDP_HEARTBEAT_TIMEOUT`` if set, else 6 s. Heartbeats run
        in TF's C++ threads, so slow steps do not trigger it.
    """

    def __init__(self, cluster=None, devices=None, *, all_reduce: str = "auto",
                 bucket_bytes: int | None = None, compression: str | None = None,
                 collective_timeout: float | None = None,
                 heartbeat_timeout: float | None = None, sparse: str | None = None):
        from tfdp.reduce import sparse as sparse_lib
        sparse = sparse_lib.resolve_mode(sparse)
        algorithm = registry.validate_algorithm(all_reduce)
        compression = registry.validate_compression(compression)
        bucket_bytes = registry.validate_bucket_bytes(bucket_bytes)
        collective_timeout = failures.seconds_setting(collective_timeout, "collective_timeout",
                                              failures.COLLECTIVE_TIMEOUT_ENV, None)
        heartbeat_timeout = failures.seconds_setting(heartbeat_timeout, "heartbeat_timeout",
                                             failures.HEARTBEAT_TIMEOUT_ENV, failures.DEFAULT_HEARTBEAT_TIMEOUT,
                                             off_ok=False)
        if devices is not None:
            if isinstance(devices, str) or not hasattr(devices, "__iter__") or not list(devices):
                raise invalid_argument("devices", devices, fix="Pass a list of local device "
                                       "names such as ['CPU:0', 'CPU:1'], or None for all local "
                                       "devices.")
            devices = list(devices)
            for d in devices:
                try:
                    devices_lib.canonical(str(d))
                except ValueError:
                    raise invalid_argument("devices", devices, what=f"Invalid device {d!r}",
                                           fix="Use names like 'CPU:0' or 'GPU:1'.") from None
        cluster = _check_cluster(cluster)
        _prepare_cpu_replicas(devices)
        self._cluster = cluster
        self._requested_all_reduce = algorithm
        self.collective_timeout = collective_timeout
        self.heartbeat_timeout = heartbeat_timeout
        failures.PeerFailureHook.install(cluster, heartbeat_timeout, collective_timeout)
        extended = _MultiWorkerExtended(self, cluster.to_resolver(), devices, algorithm,
                                        bucket_bytes, compression, collective_timeout or 0.0,
                                        heartbeat_timeout, sparse)
        tf.distribute.Strategy.__init__(self, extended)  # MWMS.__init__ minus its extended
        _check_local_devices(extended.worker_devices, devices)
        self._check_same_replica_count()
        log.info("tfdp: worker %d of %d, %d replica(s) each %s; all_reduce=%r -> %r (%s), "
                 "across workers %s; bucket_bytes=%d; compression=%s%s", cluster.rank,
                 cluster.num_workers, len(extended.worker_devices),
                 [devices_lib.short_name(d) for d in extended.worker_devices], algorithm,
                 extended.tfdp_choice.algorithm, extended.tfdp_choice.reason,
                 extended._tfdp_reduce.hint, extended._tfdp_reduce.bucket_bytes,
                 extended._tfdp_reduce.compression,
                 " (collective runtime started late)" if extended.tfdp_late_start else "")
        from tfdp.callbacks import shared_files  # Keras's own callbacks: only the chief writes
        shared_files.install(self)

    # --- tfdp's additions ---------------------------------------------------------------------

    @property
    def all_reduce(self) -> str:
        return self.extended.tfdp_choice.algorithm

    @property
    def bucket_bytes(self) -> int:
        return self.extended._tfdp_reduce.bucket_bytes

    @property
    def compression(self):
        return self.extended._tfdp_reduce.compression

    @property
    def cross_device_ops(self) -> MultiWorkerReduce:
        return self.extended._tfdp_reduce

    @property
    def cluster(self):
        """The resolved cluster (a ``tfdp.cluster.ClusterInfo``)."""
        return self._cluster

    def reduce(self, reduce_op, value, axis=None):
        """``tf.distribute.Strategy.reduce`` across all workers, also for nested structures.

        As ``DataParallelStrategy.reduce``: nested lists/tuples/dicts are reduced leaf by leaf and
        ``axis=0`` on a scalar means ``axis=None``. Eagerly reducing (``axis=None``) per-replica
        tensors whose shapes differ between replicas of any worker (an uneven batch) is an error
        (the shapes are compared across workers first, so every worker takes the same branch and
        no collective is left waiting); inside Keras's symbolic build, which does it only to
        learn the batch's shapes, the result is the concatenation of this worker's components.
        """
        if not tfp.is_distributed_values(value) and isinstance(value, (list, tuple, dict)):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        comps = self.experimental_local_results(value)
        tensors = all(isinstance(c, tf.Tensor) for c in comps)
        if axis is not None and tensors and all(c.shape.rank == 0 for c in comps):
            axis = None  # (with one replica per worker Keras's values are plain scalars)
        if tfp.is_distributed_values(value):
            if (axis is None and tf.executing_eagerly() and tensors
                    and all(c.shape.rank for c in comps)
                    and not self._same_shapes_everywhere(comps)):
                if gradient_path.in_keras_symbolic_build():
                    return tf.concat([tf.identity(c) for c in comps], axis=0)
                raise strategy_lib.uneven_reduce_error(reduce_op, [c.shape for c in comps])
        return super().reduce(reduce_op, value, axis)

    def _check_same_replica_count(self):
        """Every worker must run as many replicas (one small collective at start-up)."""
        ops = self.extended._tfdp_reduce
        with tf.device(self.extended.worker_devices[0]):
            counts = ops.cross_worker_gather(tf.constant([len(ops.devices)], tf.int32), 0)
        counts = [int(c) for c in counts.numpy()]
        if len(set(counts)) > 1:
            raise TfdpError(
                "Every worker must run the same number of replicas. Received: replicas per "
                f"worker {counts} (this is worker {self._cluster.rank}). Give every worker the "
                "same devices: the same TFDP_CPU_REPLICAS / --cpu-replicas, or as many GPUs.")

    def _same_shapes_everywhere(self, comps) -> bool:
        rank = comps[0].shape.rank
        same_rank = all(c.shape.rank == rank for c in comps)
        local_same = same_rank and len({tuple(c.shape) for c in comps}) == 1
        ops = self.extended._tfdp_reduce
        with tf.device(self.extended.worker_devices[0]):
            shape = (tf.shape(comps[0], out_type=tf.int64) if same_rank
                     else tf.zeros([rank], tf.int64))
            mine = tf.concat([[tf.constant(int(local_same), tf.int64)], shape], 0)
            everyone = tf.reshape(ops.cross_worker_gather(mine, 0), [ops.num_workers, -1])
            return bool(tf.reduce_all(everyone == everyone[0]) and everyone[0, 0] == 1)

    def __repr__(self):
        devs = [devices_lib.short_name(d) for d in self.extended.worker_devices]
        return (f"MultiWorkerDataParallelStrategy(worker={self._cluster.rank}/"
                f"{self._cluster.num_workers}, devices={devs}, all_reduce={self.all_reduce!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r})")


def _check_local_devices(worker_devices, requested):
    """Every local replica device must exist in this process."""
    have = {devices_lib.short_name(d.name) for d in tf.config.list_logical_devices()}
    missing = [devices_lib.short_name(d) for d in worker_devices
               if devices_lib.short_name(d) not in have]
    if missing:
        raise invalid_argument(
            "devices", requested, what=f"Device(s) {missing} do not exist on this worker",
            valid=sorted(have), fix=devices_lib.more_cpu_devices_hint(
                devices_lib.cpu_replicas_from_env()))


__all__ = ["MultiWorkerDataParallelStrategy", "MultiWorkerReduce"]
