"""The ONLY module of tfdp that imports TensorFlow private APIs (``tensorflow.python...``).

Checked against TensorFlow 2.21.0 (tensorflow-cpu 2.21.0, Keras 3.15.1). Everything else in tfdp
uses public APIs or goes through the names re-exported here, so a TF upgrade has one place to
look at. Each import below says what it is used for.
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
# The calling replica's id as an int (replica-context collectives, gradient accumulation).
from tensorflow.python.distribute import values_util as _values_util
# Which kernels are registered (is the NCCL all-reduce kernel built into this TF?).
from tensorflow.python.framework import kernels as _kernels
# Whether the function being traced is compiled by XLA (jit_compile=True).
from tensorflow.python.ops import control_flow_util as _control_flow_util

import contextlib

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


def alias_former_local_devices(job: str, task: int) -> bool:
    """After a late collective start: make device names of the runtime's former local devices
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
    Idempotent; returns True when installed now.
    """
    ctx = _context.context()
    if "device" in vars(ctx):
        return False
    method = type(ctx).device

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
        return method(ctx, name)

    ctx.device = device
    return True


TF_VERSION_CHECKED = "2.21.0"

MirroredExtended = _mirrored_strategy.MirroredExtended
PerReplica = _values.PerReplica
Mirrored = _values.Mirrored


def devices_of(destinations) -> tuple[str, ...]:
    """The canonical device strings of ``destinations`` (a DistributedValues, variable or device)."""
    return tuple(_cross_device_ops.get_devices_from(destinations))


def has_destinations(destinations) -> bool:
    return _cross_device_ops.check_destinations(destinations)


def mirrored(components):
    """A Mirrored value from per-device components (a plain tensor when there is one)."""
    return _distribute_utils.regroup(tuple(components), wrap_class=Mirrored)


def select_replica(replica_id: int, structure):
    """The components of replica ``replica_id`` in a structure of PerReplica values."""
    return _distribute_utils.select_replica(replica_id, structure)


def nccl_kernel_registered() -> bool:
    """Whether this TensorFlow build has the NCCL all-reduce GPU kernel."""
    try:
        kernels = _kernels.get_registered_kernels_for_op("NcclAllReduce")
    except Exception:  # the op itself may be unknown in CPU-only builds
        return False
    return any(k.device_type == "GPU" for k in kernels.kernel)


def nccl_all_sum(tensors):
    """TF's own NCCL all-sum over tensors on distinct GPUs (one output per input device)."""
    from tensorflow.python.ops import nccl_ops
    return nccl_ops.all_sum(tensors)


def current_replica_id() -> int:
    """The replica id (an int) of the calling replica context (values_util)."""
    return _values_util.get_current_replica_id_as_int()


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


# --- Keras 3 internals (the TensorFlow backend) --------------------------------------------------
#
# tfdp's gradient path (``tfdp.gradient_path``) acts at four places inside Keras, each a private
# name listed here and checked by ``tests/test_private_names.py`` against the installed Keras:
#
#   keras.src.losses.loss.scale_loss_for_distribution / unscale_loss_for_distribution
#       every Keras loss passes through them (Loss.__call__'s mean reduction, compile()'s losses,
#       the model's regularization losses, the loss trackers): replica r's share of the batch.
#   BaseOptimizer.apply, LossScaleOptimizer.apply
#       the entry of every optimizer update (apply_gradients calls apply): reduce first.
#   BaseOptimizer._clip_gradients
#       the one call per update right before the update step, also inside Keras's
#       gradient-accumulation update branch: reduce there when accumulating.
#   TFOptimizer._all_reduce_sum_gradients
#       Keras's own all-reduce, which must not reduce gradients tfdp already reduced.
#   TensorFlowTrainer._make_function (and its _jit_compile attribute)
#       builds the train/test/predict function, XLA-compiled as a whole with jit_compile=True:
#       on several CPU replicas tfdp compiles each replica's step instead (XLA cannot compile
#       CPU collectives).
#   TensorFlowTrainer._maybe_symbolic_build
#       takes one batch from a first iterator over the distributed dataset and reduces it with
#       strategy.reduce("MEAN", axis=None), only for its shapes, then discards the iterator: a
#       one-shot Python generator loses what that iterator read ahead, and an uneven first batch
#       cannot be reduced. tfdp gives it the dataset's element spec instead
#       (``keras_epoch_iterator_element_spec``: TFEpochIterator._distributed_dataset, and the
#       per-replica components of TF's PerReplicaSpec).

def keras_hook_points():
    """{name: (owner, attribute)} for every Keras internal tfdp wraps (owner: class or module)."""
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.losses import loss as loss_module
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer
    return {
        "scale_loss": (loss_module, "scale_loss_for_distribution"),
        "unscale_loss": (loss_module, "unscale_loss_for_distribution"),
        "apply": (base_optimizer.BaseOptimizer, "apply"),
        "loss_scale_apply": (loss_scale_optimizer.LossScaleOptimizer, "apply"),
        "clip_gradients": (base_optimizer.BaseOptimizer, "_clip_gradients"),
        "all_reduce_sum_gradients": (tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients"),
        "symbolic_build": (tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build"),
        "make_function": (tf_trainer.TensorFlowTrainer, "_make_function"),
    }


def keras_builtin_train_step():
    """Keras's own ``TensorFlowTrainer.train_step`` (the function, to compare with)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    return tf_trainer.TensorFlowTrainer.train_step


_TFDP_ORIGINAL = "__tfdp_original__"


def wrap_keras(hooks) -> None:
    """Install ``hooks`` ({name: make(original) -> replacement}) at ``keras_hook_points()``.

    Idempotent: a point already wrapped keeps its wrapper. Each replacement keeps the original
    as ``__tfdp_original__`` and must call it whenever tfdp is not involved.
    """
    import functools
    points = keras_hook_points()
    for name, make in hooks.items():
        owner, attr = points[name]
        current = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if getattr(current, _TFDP_ORIGINAL, None) is not None:
            continue
        replacement = functools.wraps(current)(make(current))
        setattr(replacement, _TFDP_ORIGINAL, current)
        setattr(owner, attr, replacement)



def keras_epoch_iterator_element_spec(iterator):
    """One replica's element spec (a structure of TypeSpecs) of the distributed dataset behind a
    Keras ``TFEpochIterator``, or None when it has none."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def one_replica(s):
        if isinstance(s, _values.PerReplicaSpec):
            return s._value_specs[0]  # pylint: disable=protected-access
        return s

    return tf.nest.map_structure(one_replica, spec)


def in_xla_context() -> bool:
    """Whether the graph being built (or one enclosing it) is compiled with XLA."""
    return _control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# tf.data's pipeline structure (tfdp.data._no_alias walks it to find Python-function sources).

def dataset_inputs(dataset):
    """The datasets ``dataset`` reads from (``tf.data.Dataset._inputs``)."""
    return dataset._inputs()  # pylint: disable=protected-access


def dataset_functions(dataset):
    """The traced functions of ``dataset``'s transformation (``tf.data.Dataset._functions``)."""
    return dataset._functions()  # pylint: disable=protected-access


# --- task "bench": names tfdp.bench reads (MirroredStrategy's reduction, the profiler's trace) ----

def mirrored_cross_device_ops(strategy):
    """The ``tf.distribute.CrossDeviceOps`` a MirroredStrategy reduces with
    (``MirroredExtended._cross_device_ops``; None when it has not chosen one)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def collective_implementation(cross_device_ops):
    """``CollectiveAllReduce``'s communication implementation (``_options.implementation``, a
    ``tf.distribute.experimental.CommunicationImplementation``), or None for other ops."""
    return getattr(getattr(cross_device_ops, "_options", None), "implementation", None)


def read_xspace(path: str):
    """The ``XSpace`` protobuf of a profiler trace file (``*.xplane.pb``, what
    ``tf.profiler.experimental.stop()`` writes), parsed with the ``xplane_pb2`` module TF ships
    (``tensorflow.tsl.profiler.protobuf``)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


# --- callbacks: drop-in exact resume and Keras's file-writing callbacks across workers ------------
#
# tfdp.callbacks.input_position positions the input of a plain ``model.fit(data, callbacks=
# [tfdp.callbacks.BackupAndRestore(...)])`` at the backed-up step; tfdp.callbacks.shared_files
# makes Keras's own BackupAndRestore / ModelCheckpoint / CSVLogger write only on the chief. The
# Keras internals they wrap (Keras 3.15, TF backend):
#
#   TFEpochIterator.__init__ / _get_iterator (keras/src/backend/tensorflow/trainer.py)
#       fit's epoch iterator distributes the data once, then ``iter(self._get_iterator())`` at the
#       top of every epoch (and again after a finite dataset's last step): the place to replay
#       the iterators and batches the interrupted run had consumed.
#   EpochIterator._num_batches / _steps_seen / steps_per_epoch / _interrupted_warning
#       the counters its epoch loop reads (shortened for the resumed, partial epoch).
#   keras.callbacks.BackupAndRestore._save_model / on_train_end, ModelCheckpoint._save_model,
#   CSVLogger.on_train_begin: where Keras's callbacks write files.

def keras_callbacks_hook_points():
    """{name: (owner class, attribute)} for every Keras internal tfdp.callbacks wraps."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.callbacks import backup_and_restore, csv_logger, model_checkpoint
    return {
        "epoch_iterator_init": (tf_trainer.TFEpochIterator, "__init__"),
        "epoch_iterator_get_iterator": (tf_trainer.TFEpochIterator, "_get_iterator"),
        "backup_save": (backup_and_restore.BackupAndRestore, "_save_model"),
        "backup_train_end": (backup_and_restore.BackupAndRestore, "on_train_end"),
        "checkpoint_save": (model_checkpoint.ModelCheckpoint, "_save_model"),
        "csv_train_begin": (csv_logger.CSVLogger, "on_train_begin"),
    }


_TFDP_CALLBACKS_ORIGINAL = "__tfdp_callbacks_original__"


def wrap_keras_callbacks(hooks) -> None:
    """Install ``hooks`` ({name: make(original) -> replacement}) at
    ``keras_callbacks_hook_points()`` (as ``wrap_keras``, with its own marker so that the two
    never mistake each other's wrappers). Idempotent."""
    import functools
    points = keras_callbacks_hook_points()
    for name, make in hooks.items():
        owner, attr = points[name]
        current = owner.__dict__[attr]
        if getattr(current, _TFDP_CALLBACKS_ORIGINAL, None) is not None:
            continue
        replacement = functools.wraps(current)(make(current))
        setattr(replacement, _TFDP_CALLBACKS_ORIGINAL, current)
        setattr(owner, attr, replacement)


def keras_is_fit_epoch_iterator(init_kwargs) -> bool:
    """Whether a ``TFEpochIterator`` made with these keyword arguments is ``fit``'s training
    iterator: only ``fit`` passes ``class_weight`` (``evaluate``, ``predict`` and fit's
    validation iterator do not)."""
    return "class_weight" in init_kwargs


def keras_array_adapter_shuffles(data_adapter):
    """Whether ``data_adapter`` is Keras's numpy/array adapter with ``shuffle`` on (it then
    shuffles with ``tf.random.shuffle`` in its tf.data pipeline, seeded only by the global seed
    in force when the epoch iterator was made)."""
    from keras.src.trainers.data_adapters import array_data_adapter
    return (isinstance(data_adapter, array_data_adapter.ArrayDataAdapter)
            and bool(getattr(data_adapter, "_shuffle", False)))


def keras_python_data_adapter(data_adapter):
    """The kind of Keras adapter that runs Python to produce batches ("generator",
    "PyDataset"), or None for arrays and tf.data."""
    from keras.src.trainers.data_adapters import generator_data_adapter, py_dataset_adapter
    if isinstance(data_adapter, generator_data_adapter.GeneratorDataAdapter):
        return "generator"
    if isinstance(data_adapter, py_dataset_adapter.PyDatasetAdapter):
        return "PyDataset"
    return None


def tf_global_seed():
    """TensorFlow's global seed (``tf.random.set_seed`` / ``keras.utils.set_random_seed``), or
    None when none is set (read without drawing an operation seed)."""
    return _context.global_seed()


def distributed_dataset_source(distributed_dataset):
    """The ``tf.data.Dataset`` a ``tf.distribute`` DistributedDataset was made from, or None."""
    return getattr(distributed_dataset, "_original_dataset", None)


def shuffle_dataset_seeds(dataset):
    """``(seed, seed2, reshuffle_each_iteration)`` of a ``Dataset.shuffle`` node, or None for
    any other dataset (``seed`` is None for an unseeded shuffle without a global seed)."""
    if type(dataset).__name__ != "_ShuffleDataset":
        return None

    def as_int(seed):
        return None if seed is None else int(seed)  # (a scalar tensor; 0 and 0: unseeded)

    seed, seed2 = as_int(getattr(dataset, "_seed", None)), as_int(getattr(dataset, "_seed2", None))
    if not seed and not seed2:
        seed = seed2 = None
    return seed, seed2, bool(getattr(dataset, "_reshuffle_each_iteration", True))


class KerasEpochIterator:
    """The counters of a Keras ``EpochIterator`` that its epoch loop reads (a view; Keras 3.15
    ``keras/src/trainers/epoch_iterator.py``)."""

    def __init__(self, epoch_iterator):
        self.target = epoch_iterator

    @property
    def num_batches(self):
        """Batches in the data (None: unknown); the loop stops once ``steps_seen`` reaches it."""
        return self.target._num_batches  # pylint: disable=protected-access

    @num_batches.setter
    def num_batches(self, value):
        self.target._num_batches = value  # pylint: disable=protected-access

    @property
    def steps_seen(self) -> int:
        """Batches read from the current iterator (reset when Keras makes a new one)."""
        return self.target._steps_seen  # pylint: disable=protected-access

    @property
    def steps_per_epoch(self):
        return self.target.steps_per_epoch

    @property
    def data_adapter(self):
        return getattr(self.target, "data_adapter", None)

    @property
    def distributed_dataset(self):
        return getattr(self.target, "_distributed_dataset", None)

    @property
    def strategy(self):
        return getattr(self.target, "_distribute_strategy", None)

    def silence_interrupted_warning(self, silent: bool) -> None:
        """Keras warns "Your input ran out of data" when the loop stops at ``num_batches``
        with ``steps_per_epoch`` set; silence it (an instance attribute) or restore it."""
        if silent:
            self.target._interrupted_warning = lambda *a, **k: None
        else:
            self.target.__dict__.pop("_interrupted_warning", None)


_KERAS_BACKUP_PATHS = ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                       "_prev_training_metadata_path")


@contextlib.contextmanager
def keras_backup_and_restore_writing_to(callback, directory):
    """Point a ``keras.callbacks.BackupAndRestore``'s files (``backup_dir`` and the paths its
    ``__init__`` derived from it) into ``directory`` for the duration."""
    import os
    saved = {n: getattr(callback, n) for n in _KERAS_BACKUP_PATHS}
    saved_dir = callback.backup_dir
    try:
        callback.backup_dir = directory
        for name, path in saved.items():
            setattr(callback, name, os.path.join(directory, os.path.basename(path)))
        yield
    finally:
        callback.backup_dir = saved_dir
        for name, path in saved.items():
            setattr(callback, name, path)


@contextlib.contextmanager
def keras_model_checkpoint_writing_to(callback, directory):
    """Make a ``keras.callbacks.ModelCheckpoint`` save into ``directory`` (same file names) for
    the duration (an instance attribute shadowing its ``_get_file_path``)."""
    import os
    original = type(callback)._get_file_path

    def get_file_path(epoch, batch, logs):
        return os.path.join(directory, os.path.basename(original(callback, epoch, batch, logs)))

    callback._get_file_path = get_file_path
    try:
        yield
    finally:
        callback.__dict__.pop("_get_file_path", None)


# --- perf: Keras internals of the fast paths (issue #14: sparse embedding reads) ---------------

def keras_perf_hook_points():
    """{name: (owner, attribute)} of the Keras internals the perf hooks wrap (owner: module)."""
    from keras.src.backend.tensorflow import numpy as tf_numpy
    return {"take": (tf_numpy, "take")}


def keras_variable_storage(x):
    """The ``tf.Variable`` (or tf.distribute variable) behind a Keras variable ``x`` as a read
    would see it, or None: not a Keras variable, or a read that would cast (autocast)."""
    from keras.src.backend.common import variables as keras_variables
    if not isinstance(x, keras_variables.Variable):
        return None
    value = x.value  # (the storage itself unless an autocast scope casts it)
    import tensorflow as tf
    return value if isinstance(value, tf.Variable) else None


def wrap_keras_perf(hooks) -> None:
    """As ``wrap_keras``, at ``keras_perf_hook_points()`` (same marker). Idempotent."""
    import functools
    points = keras_perf_hook_points()
    for name, make in hooks.items():
        owner, attr = points[name]
        current = getattr(owner, attr)
        if getattr(current, _TFDP_ORIGINAL, None) is not None:
            continue
        replacement = functools.wraps(current)(make(current))
        setattr(replacement, _TFDP_ORIGINAL, current)
        setattr(owner, attr, replacement)
