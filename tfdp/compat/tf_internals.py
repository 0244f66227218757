"""TensorFlow's private names: tf.distribute internals, the eager context, kernels, tf.data.

Checked against TensorFlow 2.19, 2.20, 2.21 and the 2.22 / 2.23 nightlies (``tfdp.compat.names``
lists every name and a test checks them). Each import says what it is used for.
"""

from __future__ import annotations

import tensorflow as tf

# MirroredExtended: the per-device variable mirroring and input pipeline we build on
# (DataParallelStrategy subclasses it to fix BN aggregation and uneven batches).
from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
# Helpers of the public tf.distribute.CrossDeviceOps contract: destinations -> devices, broadcast.
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
# Build Mirrored / PerReplica containers from per-device components; select one replica's values.
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values
# Whether the function being traced is compiled by XLA (jit_compile=True).
from tensorflow.python.ops import control_flow_util as _control_flow_util

import contextlib

from tfdp.compat import names as _names

# CollectiveAllReduceExtended: MultiWorkerMirroredStrategy's extended (cluster/server start-up,
# collective runtime configuration, initial-value broadcast from worker 0, per-worker input
# sharding); subclassed to use every local device of a worker.
from tensorflow.python.distribute import collective_all_reduce_strategy as _cars
# The eager context: whether the TF runtime already started (collective ops must be configured
# before), and configure_collective_ops (tolerated late, see late_collective_config).
from tensorflow.python.eager import context as _context

CollectiveAllReduceExtended = _cars.CollectiveAllReduceExtended


def runtime_initialized() -> bool:
    """Whether the TF eager runtime has started (the first op, device listing, variable...)."""
    return _context.context()._context_handle is not None  # pylint: disable=protected-access


@contextlib.contextmanager
def late_collective_config():
    """Let ``CollectiveAllReduceExtended`` start the multi-worker runtime after TF started.

    ``context.configure_collective_ops`` refuses to run once the runtime has started ("must be
    configured at program startup"), e.g. after ``tfdp.configure_cpu_replicas`` listed the
    devices. What it configures (the collective group leader) also reaches the runtime through
    the server definition that ``enable_collective_ops`` applies to the running context
    (``CollectiveAllReduceExtended._update_config_proto`` puts it in
    ``default_session_config.experimental.collective_group_leader``), so it is skipped then.
    Yields True when the runtime had already started.
    """
    ctx = _context.context()
    if ctx._context_handle is None:  # pylint: disable=protected-access
        yield False
        return
    ctx.configure_collective_ops = lambda *args, **kwargs: None  # instance attr shadows method
    try:
        yield True
    finally:
        del ctx.configure_collective_ops


def collective_server_started() -> bool:
    """Whether this process already gave TF a server definition (its gRPC server, started by
    ``enable_collective_ops`` / ``set_server_def``, holds this task's port)."""
    ctx = _context.context()
    return (getattr(ctx, "_collective_ops_server_def", None) is not None
            or getattr(ctx, "_server_def", None) is not None)


def eager_context():
    """TensorFlow's eager context (the object whose ``device`` ``tf.device`` calls)."""
    return _context.context()


def former_local_device_alias(job: str, task: int):
    """After a late collective start: ``make(device) -> replacement`` for the eager context's
    ``device`` (installed on the context instance by ``tfdp.keras.adapter.use_device_alias``),
    making device names of the runtime's former local devices
    (``/job:localhost/replica:0/task:0/device:X:i``) mean this task's (``/job:<job>/replica:0/
    task:<task>/device:X:i``) in eager device scopes.

    Why: ``enable_collective_ops`` on a running context (``late_collective_config``) replaces its
    local devices by the server's, renamed to the task (TF's TODO b/129298253). Tensors and
    datasets made before keep working as op inputs, but tf.data places the ops it runs on a
    dataset with ``colocate_with(dataset._variant_tensor)``, i.e. ``tf.device(<its old device
    name>)``, which no longer exists: ``/job:localhost/replica:0/task:0/device:CPU:0 unknown
    device [Op:DatasetCardinality]`` / ``[Op:AnonymousIteratorV3]`` when a dataset built before
    the strategy is distributed or iterated. ``Context.device`` (what ``tf.device`` and eager
    ``colocate_with`` call) is shadowed by an instance attribute that renames such names (the
    devices are the same: same process, same index); any other name passes unchanged. Inside
    ``tf.function`` a stale name is only a placement request that soft placement relaxes.
    Variables made before stay on the old devices (no longer local): they cannot be used.
    """
    def make(method):  # (method: the context's bound ``device``)
        def device(name):
            if isinstance(name, tf.config.LogicalDevice):
                name = name.name
            elif isinstance(name, tf.DeviceSpec):
                name = name.to_string()
            if isinstance(name, str) and "localhost" in name:
                try:
                    spec = tf.DeviceSpec.from_string(name)
                except (ValueError, TypeError):
                    spec = None
                if (spec is not None and spec.job == "localhost" and spec.replica in (None, 0)
                        and spec.task in (None, 0)):
                    name = spec.replace(job=job, replica=0, task=task).to_string()
            return method(name)
        return device
    return make


MirroredExtended = _mirrored_strategy.MirroredExtended
PerReplica = _values.PerReplica
Mirrored = _values.Mirrored


def devices_of(destinations) -> tuple[str, ...]:
    """The canonical device strings of ``destinations`` (DistributedValues, variable, device)."""
    return tuple(_cross_device_ops.get_devices_from(destinations))


def has_destinations(destinations) -> bool:
    return _cross_device_ops.check_destinations(destinations)


def mirrored(components):
    """A Mirrored value from per-device components (a plain tensor when there is one)."""
    return _distribute_utils.regroup(tuple(components), wrap_class=Mirrored)


def update_regroup(extended, updates, group):
    """``extended.update``'s result from per-device results (TF's ``update_regroup``)."""
    return _distribute_utils.update_regroup(extended, updates, group)


_row_sharded_class = None


def sharded_variable(variables, name: str):
    """TF's ``ShardedVariable`` of ``variables`` (row pieces): reads, ``assign`` and checkpoints
    see the whole (zero_stage's row-split slots, ``tfdp.zero.rows``); also readable as a numpy
    array and through ``read_value`` / ``value`` / ``device`` like a variable."""
    global _row_sharded_class
    if _row_sharded_class is None:
        from tensorflow.python.distribute import sharded_variable as _sharded_variable

        class RowShardedVariable(_sharded_variable.ShardedVariable):
            def read_value(self):
                return tf.concat([v.read_value() for v in self.variables], 0)

            def value(self):
                return self.read_value()

            @property
            def device(self):
                return self.variables[0].device

            def __array__(self, dtype=None, copy=None):
                del copy
                a = self.numpy()
                return a if dtype is None else a.astype(dtype)

        _row_sharded_class = RowShardedVariable
    return _row_sharded_class(list(variables), name=name)


def select_replica(replica_id: int, structure):
    """The components of replica ``replica_id`` in a structure of PerReplica values; distributed
    variables stay whole (as TF's ``distribute_utils.select_replica``, with public names)."""
    def one(x):
        if isinstance(x, tf.distribute.DistributedValues) and not isinstance(x, tf.Variable):
            return x.values[replica_id]
        return x
    return tf.nest.map_structure(one, structure)


def nccl_kernel_registered() -> bool:
    """Whether this TensorFlow build has NCCL (a CUDA or ROCm build: ``tf.sysconfig``)."""
    info = tf.sysconfig.get_build_info()
    return bool(info.get("is_cuda_build") or info.get("is_rocm_build"))


_nccl_calls = iter(range(1 << 62))


def nccl_all_sum(tensors):
    """NCCL all-sum over tensors on distinct GPUs (one output per input device): the public
    ``tf.raw_ops.NcclAllReduce``, as TF's own ``nccl_ops.all_sum`` calls it (one shared name
    per call; inside a function when eager)."""
    tensors = list(tensors)
    shared_name = f"tfdp_nccl_all_sum_{next(_nccl_calls)}"

    def all_sum():
        out = []
        for t in tensors:
            with tf.device(t.device):
                out.append(tf.raw_ops.NcclAllReduce(
                    input=t, reduction="sum", num_devices=len(tensors),
                    shared_name=shared_name))
        return out

    return tf.function(all_sum)() if tf.executing_eagerly() else all_sum()


def current_replica_id():
    """The local index (an int) of the calling replica: its ``replica_id_in_sync_group`` (public;
    a constant in TF's mirrored replica contexts) modulo the worker's replica count (every worker
    runs as many, tfdp checks at start-up). None outside a replica context."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return None
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        return None
    return int(replica) % len(ctx.strategy.extended.worker_devices)


def is_distributed_values(x) -> bool:
    return isinstance(x, tf.distribute.DistributedValues)


@contextlib.contextmanager
def coordination_heartbeat_timeout(seconds: float):
    """Give the coordination service that ``CollectiveAllReduceExtended`` configures this
    heartbeat timeout (TF's own default when not set: 10 s).

    MultiWorkerMirroredStrategy's ``_initialize_multi_worker`` calls
    ``context.configure_coordination_service(service_type="standalone", ...)`` (only when no
    coordination service is configured yet) without a heartbeat timeout; this wraps that call
    (an instance attribute shadowing the method, as ``late_collective_config`` does) to add
    ``heartbeat_timeout_in_ms``. Every task's agent then heartbeats the leader (task 0) and the
    service reports a task whose heartbeats stop as "unhealthy (stopped sending heartbeats)",
    which aborts the collectives on every other task (UnavailableError).
    """
    ctx = _context.context()
    original = ctx.configure_coordination_service

    def configure(*args, **kwargs):
        kwargs.setdefault("heartbeat_timeout_in_ms", max(1, int(round(seconds * 1000))))
        return original(*args, **kwargs)

    ctx.configure_coordination_service = configure
    try:
        yield
    finally:
        del ctx.configure_coordination_service


def in_xla_context() -> bool:
    """Whether the graph being built (or one enclosing it) is compiled with XLA."""
    return _control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# tf.data's pipeline structure (tfdp.callbacks.input_position and tfdp.data._iterators walk it:
# Python-function sources, shuffles, stateful ops). Both callers take any error as "unknown".

def _walkable():
    if not _names.available("pipeline_walk"):
        raise LookupError("tf.data's pipeline structure is not readable in this TensorFlow "
                          "(tfdp.compat.names: pipeline_walk)")


def dataset_inputs(dataset):
    """The datasets ``dataset`` reads from (``tf.data.Dataset._inputs``)."""
    _walkable()
    return dataset._inputs()  # pylint: disable=protected-access


def dataset_functions(dataset):
    """The traced functions of ``dataset``'s transformation (``tf.data.Dataset._functions``)."""
    _walkable()
    return dataset._functions()  # pylint: disable=protected-access
