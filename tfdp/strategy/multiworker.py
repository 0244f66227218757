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
  the GPUs of a worker) to use the worker's K local devices, and tfdp's ``DataParallelExtendedBase``
  (the Keras step path: replica shares, empty replicas, BatchNorm-statistics sync).
* Reduction (tfdp's one reducer, ``tfdp.reduce.Reducer``, with its cross-worker stage) is
  hierarchical: the K local values are summed first (packed into buckets, ``tfdp.reduce.packing``; weighted; optionally compressed), then summed
  across workers by one TF collective per bucket (``CollectiveReduceV2``, RING on CPU with
  ``max_subdivs_per_device=16``, NCCL on GPUs) on one device per worker, then copied to the local
  devices. With ``all_reduce="ring"`` the local stage is a reduce-scatter: device c of every
  worker all-reduces chunk c, i.e. K concurrent cross-worker collectives, then a local all-gather.
  ``tf.IndexedSlices`` (embedding gradients) are all-gathered: locally, then across workers
  (padded to the longest worker's slice count, then unpadded).
* Uneven batches stay exact across workers: replica r's loss gradient carries its share of
  what one device divides by, counted over all N replicas of all workers (the global example
  count, or a masked / weighted-mean loss's divisor: ``tfdp.keras.losses``).
* Never hang: a dead, killed, SIGSTOPped or unreachable worker is detected by TF's coordination
  service heartbeats (``heartbeat_timeout``, default 6 s, ``TFDP_HEARTBEAT_TIMEOUT``); the
  other workers' collectives then fail and each worker prints one line, after the traceback,
  naming the lost worker and its address (``tfdp: peer failure: worker 1 (127.0.0.1:40445) has
  stopped responding ...``) and exits non-zero; ``tfdp launch`` repeats that line and stops the
  rest. An optional collective timeout (``collective_timeout``, ``TFDP_COLLECTIVE_TIMEOUT``, off
  by default) also catches a worker that is alive but never reaches the next collective.
* Never hang at start-up either: a worker named in the cluster that never connects (a stale
  TF_CONFIG, a host that is down, a firewall) ends the start-up after ``startup_timeout``
  (default 300 s, ``TFDP_STARTUP_TIMEOUT``) with one line naming it, and SIGINT / SIGTERM end the
  wait at once (``tfdp.cluster.startup``); afterwards SIGTERM ends the process again (TF's
  start-up had replaced the handler with one that ignores it).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp import failures
from tfdp.cluster import startup
from tfdp.errors import TfdpError, invalid_argument
from tfdp.keras import gradient_path
from tfdp.reduce.reducer import Reducer
from tfdp.strategy.extended import DataParallelExtendedBase
from tfdp.strategy.announce import announce
from tfdp.strategy.local import DataParallelStrategy, uneven_reduce_error
from tfdp.strategy.setup_order import SetupOrderChecks

CollectiveAllReduceExtended = tfp.CollectiveAllReduceExtended
late_collective_config = tfp.late_collective_config

log = logging.getLogger("tfdp")

# --- the extended ------------------------------------------------------------------------------

class MultiWorkerExtended(SetupOrderChecks, DataParallelExtendedBase,
                          CollectiveAllReduceExtended):
    """CollectiveAllReduceExtended on every local device, with tfdp's reduction and step path.

    Method resolution: tfdp's ``DataParallelExtendedBase`` first (replica shares for the
    gradient path, layer-state sync, destination filling), then TF's
    ``CollectiveAllReduceExtended`` (cluster, server, broadcasts, input sharding), then
    ``MirroredExtended``.
    """

    def _init_tf_extended(self, container_strategy, cluster):
        settings = self.tfdp_settings
        heartbeat_timeout = settings.heartbeat_timeout
        self._tfdp_cluster = cluster
        # TF's start-up waits (holding the GIL, deaf to signals) until every task has
        # connected: wait for the peers first, bounded and interruptible (tfdp.cluster.startup).
        deadline = startup.Deadline(settings.startup_timeout)
        if not tfp.collective_server_started():
            startup.wait_for_peers(cluster, deadline)
        with late_collective_config() as late, tfp.coordination_heartbeat_timeout(
                heartbeat_timeout), startup.guard(cluster, deadline):
            CollectiveAllReduceExtended.__init__(
                self, container_strategy, cluster_resolver=cluster.to_resolver(),
                communication_options=tf.distribute.experimental.CommunicationOptions())
        self.tfdp_late_start = late
        if late:
            # The runtime started before (a dataset, tensor or op came first): its local devices
            # were just renamed to this task's. Keep what was built before usable.
            from tfdp.keras import adapter  # (Context.device, while this strategy lives)
            adapter.use_device_alias(container_strategy, tfp.former_local_device_alias(
                cluster.task_type, cluster.task_id))
            _warn_variables_made_before()
        devs = list(self.worker_devices)
        choice = self._choose(devs)
        self._tf_collective_ops = self._cross_device_ops
        reduce = Reducer(
            devs, cluster.num_workers, choice.algorithm, settings.bucket_bytes,
            settings.compression, settings.sparse, fallback=self._tf_collective_ops,
            timeout_seconds=settings.collective_timeout or 0.0)
        self._cross_device_ops = reduce
        return reduce

    def _create_variable(self, next_creator, **kwargs):
        # Worker 0 broadcasts each initial value; a worker whose model differs (another shape
        # for the same variable) makes TF fail deep in a collective error: say what and where.
        try:
            return super()._create_variable(next_creator, **kwargs)
        except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:
            message = failures.model_mismatch_message(e, kwargs.get("name"),
                                                      self._num_workers_in_job())
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

    def _num_workers_in_job(self) -> int:
        return self._tfdp_cluster.num_workers

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
    if (primary_value is None
            or (tf.is_symbolic_tensor(primary_value)  # (Keras 3.16 initializes eagerly here)
                and primary_value.graph is not tf.compat.v1.get_default_graph())
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


class MultiWorkerDataParallelStrategy(DataParallelStrategy,
                                      tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism over every local device of every worker process.

    Datasets, tensors and seeds may come before it (tfdp starts TF's collective runtime late
    when needed and keeps earlier datasets working); create models and variables after it
    (earlier variables stay on devices that are no longer local: one warning names them).
    ``TFDP_CPU_REPLICAS`` is applied when tfdp is imported, so import tfdp before TF code runs.

    ``tfdp.DataParallelStrategy()`` returns this strategy by itself when TF_CONFIG / SLURM
    describe several workers; it is a ``DataParallelStrategy`` and takes the same arguments.

    Args:
      devices: this worker's replica devices (``["CPU:0", "CPU:1"]``, ``["GPU:0"]``); None
        means every local GPU, else the logical CPU devices (``TFDP_CPU_REPLICAS`` /
        ``tfdp.configure_cpu_replicas``), else CPU:0. Every worker must have as many.
      cluster: a ``tfdp.cluster.ClusterInfo`` with 2 or more workers; None reads
        ``cluster_resolver``, else TF_CONFIG / SLURM (``tfdp.cluster.resolve_cluster()``).
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver`` instead.
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
      startup_timeout: seconds to wait, when the strategy is created, for every worker of the
        cluster to connect; then this worker prints one line naming the workers that did not
        (and their addresses) and exits 1. None: ``TFDP_STARTUP_TIMEOUT`` if set, else 300 s.
        SIGINT / SIGTERM end the wait at once (exit 130 / 143).
    """

    # One __init__ (DataParallelStrategy's) with the same arguments; these are its steps.

    def _resolve(self, cluster_resolver, cluster, devices, settings):
        if devices is not None:
            if isinstance(devices, str) or not hasattr(devices, "__iter__") or not list(devices):
                raise invalid_argument("devices", devices, fix="Pass a list of local device "
                                       "names such as ['CPU:0', 'CPU:1'], or None for all local "
                                       "devices.")
            for d in list(devices):
                try:
                    devices_lib.canonical(str(d))
                except ValueError:
                    raise invalid_argument("devices", devices, what=f"Invalid device {d!r}",
                                           fix="Use names like 'CPU:0' or 'GPU:1'.") from None
        if cluster is None and cluster_resolver is not None:
            from tfdp.strategy.local import _resolve_cluster
            cluster = _resolve_cluster(cluster_resolver)
        cluster = _check_cluster(cluster)
        _prepare_cpu_replicas(devices)
        failures.PeerFailureHook.install(self, cluster, settings.heartbeat_timeout,
                                         settings.collective_timeout)
        return cluster

    @property
    def _extended_class(self):
        return MultiWorkerExtended

    def _started(self, devices):
        extended = self.extended
        _check_local_devices(extended.worker_devices, devices)
        self._check_same_replica_count()
        log.debug("tfdp: worker %d of %d, %d replica(s) each %s; all_reduce=%r -> %r (%s), "
                  "across workers %s; bucket_bytes=%d; compression=%s%s", self._cluster.rank,
                  self._cluster.num_workers, len(extended.worker_devices),
                  [devices_lib.short_name(d) for d in extended.worker_devices],
                  extended.tfdp_settings.all_reduce, extended.tfdp_choice.algorithm,
                  extended.tfdp_choice.reason, extended.tfdp_reduce.cross_worker.hint,
                  extended.tfdp_reduce.bucket_bytes, extended.tfdp_reduce.compression,
                  " (collective runtime started late)" if extended.tfdp_late_start else "")
        announce(self)
        from tfdp.callbacks import (
            shared_files,  # Keras's own callbacks: only the chief writes
        )
        shared_files.install(self)

    @property
    def num_workers(self) -> int:
        return self._cluster.num_workers

    @property
    def worker_index(self) -> int:
        return self._cluster.rank

    @property
    def is_chief(self) -> bool:
        return bool(self._cluster.is_chief)

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
                raise uneven_reduce_error(reduce_op, [c.shape for c in comps])
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
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}"
                + (f", zero_stage={self.zero_stage}" if self.zero_stage else "")
                + _micro_repr(self) + ")")


def _micro_repr(strategy) -> str:
    k = strategy.extended.tfdp_micro_batches
    return f", micro_batches={k}" if k > 1 else ""


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


# ``DataParallelStrategy()`` in a cluster of several workers returns this class (its __new__).
DataParallelStrategy._multi_worker_class = MultiWorkerDataParallelStrategy

__all__ = ["MultiWorkerDataParallelStrategy"]
