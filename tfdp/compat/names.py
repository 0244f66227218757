"""Every private TensorFlow / Keras name tfdp relies on, in one list, and the tested versions.

Each entry names where it lives, what kind of reliance it is, and why tfdp needs it:

* ``import``: a module or class imported from ``tensorflow.python`` / ``keras.src``;
* ``call``: a private function or method tfdp calls (or an attribute it reads);
* ``override``: a private method of a TF/Keras class that a tfdp subclass overrides (TF calls
  it; the signature must still match);
* ``wrap``: a function or method tfdp wraps (``tfdp.compat.wrap``; in place only while a hook
  set's user lives: ``tfdp.keras.adapter``);
* ``state``: an attribute TF/Keras sets in ``__init__`` (not on the class): checked by looking
  for ``self.<name>`` in the owner's source.

``missing()`` returns the entries that the installed TF / Keras no longer have (a test asserts
it is empty, and that every override in tfdp's own subclasses is listed).
``warn_if_untested()`` logs one warning when the installed versions are outside the tested
range; it reads package metadata only, so ``import tfdp`` stays free of TensorFlow.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass

log = logging.getLogger("tfdp")

# Tested: the whole suite on the newest, a compatibility subset on the others (.ci/run).
TESTED_TENSORFLOW = ("2.19", "2.21")   # inclusive, major.minor
TESTED_KERAS = ("3.12", "3.15")  # (the lower bound: .ci/run installs it with TF 2.19)


@dataclass(frozen=True)
class Private:
    owner: str   # "package.module" or "package.module:Class"
    name: str    # the attribute (for kind "import": the name imported from owner)
    kind: str    # import | call | override | wrap | state
    why: str


_MS = "tensorflow.python.distribute.mirrored_strategy:MirroredExtended"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:CollectiveAllReduceExtended"
_CDO = "tensorflow.python.distribute.cross_device_ops:CrossDeviceOps"
_CTX = "tensorflow.python.eager.context:Context"
_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"
_EPOCH_IT = "keras.src.backend.tensorflow.trainer:TFEpochIterator"

NAMES: tuple[Private, ...] = (
    # --- the strategies' base classes ---------------------------------------------------------
    Private("tensorflow.python.distribute.mirrored_strategy", "MirroredExtended", "import",
            "the local strategy's extended: mirrored variables, input pipeline, merge_call"),
    Private("tensorflow.python.distribute.collective_all_reduce_strategy",
            "CollectiveAllReduceExtended", "import",
            "the multi-worker extended: cluster and server start-up, initial-value broadcast, "
            "per-worker input sharding"),
    Private(_MS, "_call_for_each_replica", "override",
            "each strategy.run: replica shares, empty-replica padding, BatchNorm sync"),
    Private(_MS, "_create_variable", "override", "track layer state and metric variables"),
    Private(_MS, "_use_merge_call", "override",
            "no merge_call inside Keras's accumulation branch or a per-replica XLA step"),
    Private(_MS, "_get_cross_device_ops", "override", "tfdp's reducer in replica-context paths"),
    Private(_MS, "_replica_ctx_all_reduce", "override",
            "replica-context all-reduce without merge_call (accumulation), refused under XLA"),
    Private(_MS, "_experimental_distribute_dataset", "override",
            "wrap datasets so TF never writes into the user's numpy arrays"),
    Private(_MS, "_reduce_to", "override", "fill empty destinations (one-device all_reduce)"),
    Private(_MS, "_batch_reduce_to", "override",
            "empty replicas add nothing to replica-context sums (SyncBatchNorm)"),
    Private(_MS, "_update", "override",
            "zero_stage: an owned variable's update runs on its owner's copy, then is copied"),
    Private(_MS, "_replica_ctx_update", "override",
            "zero_stage: the owner's update inside Keras's accumulation branch, then broadcast"),
    Private(_MS, "_get_variable_creator_initial_value", "override",
            "copies of a variable created inside a tf.function take the primary's value"),
    Private(_CARS, "_initialize_local_devices", "override",
            "every local device of a worker (TF's uses CPU:0 or the GPUs only)"),
    Private(_CARS, "_cross_device_ops", "state", "swap in tfdp's reducer (tfdp.reduce.Reducer)"),
    Private(_CARS, "_num_workers", "state", "the job's worker count"),
    Private(_CARS, "_task_type", "state", "this task's job name (device aliasing)"),
    Private(_CARS, "_task_id", "state", "this task's index (device aliasing)"),
    Private(_CARS, "_check_health_interval", "state",
            "TF's health-check thread, scaled to heartbeat_timeout"),
    Private(_CARS, "_check_health_timeout", "state", "as above"),
    Private(_CARS, "_check_health_retry_limit", "state", "as above"),
    Private(_CDO, "_gather_implementation", "override",
            "strategy.gather through tfdp's reducers (and TF's CollectiveAllReduce's, called)"),
    Private(_CDO, "_num_between_graph_workers", "override",
            "Keras's cross-worker output reduction counts workers through it"),
    Private(_CDO, "_all_reduce", "override",
            "replica-context all-reduce without merge_call (Keras's accumulation branch): TF's "
            "MirroredExtended._replica_ctx_all_reduce calls it"),
    # --- what Keras checks of a multi-worker strategy -----------------------------------------
    Private("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker", "call",
            "Keras orders predict's outputs across workers (_multi_worker_concat) only when "
            "isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and strategy."
            "extended._in_multi_worker_mode(): why MultiWorkerDataParallelStrategy inherits "
            "TF's MultiWorkerMirroredStrategy (and its extended CollectiveAllReduceExtended)"),
    Private(_CARS, "_in_multi_worker_mode", "call",
            "as above: Keras calls it on tfdp's multi-worker extended (TF's, inherited)"),
    # --- values, devices, kernels ---------------------------------------------------------------
    Private("tensorflow.python.distribute.values", "PerReplica", "import",
            "build per-replica values from components"),
    Private("tensorflow.python.distribute.values", "Mirrored", "import",
            "build reduced (mirrored) values from components"),
    Private("tensorflow.python.distribute.values:PerReplicaSpec", "_value_specs", "state",
            "one replica's element spec (Keras's symbolic build)"),
    Private("tensorflow.python.distribute.distribute_utils", "regroup", "call",
            "components -> Mirrored"),
    Private("tensorflow.python.distribute.distribute_utils", "select_replica", "call",
            "one replica's values from PerReplica"),
    Private("tensorflow.python.distribute.distribute_utils", "update_regroup", "call",
            "the result of an owner-only update (zero_stage)"),
    Private("tensorflow.python.distribute.sharded_variable", "ShardedVariable", "import",
            "a slot split by rows among owners, whole for reads and checkpoints (zero_stage)"),
    Private("keras.src.backend.tensorflow.optimizer:TFOptimizer", "_var_key", "call",
            "(reads _distributed_container) a row block of a split variable is given its "
            "container's, so Keras finds the variable's slots (zero_stage)"),
    Private("tensorflow.python.distribute.cross_device_ops", "get_devices_from", "call",
            "destinations -> device strings"),
    Private("tensorflow.python.distribute.cross_device_ops", "check_destinations", "call",
            "whether destinations name devices"),
    Private("tensorflow.python.framework.kernels", "get_registered_kernels_for_op", "call",
            "is the NCCL all-reduce GPU kernel built into this TensorFlow"),
    Private("tensorflow.python.ops.nccl_ops", "all_sum", "call", "NCCL all-reduce on GPUs"),
    Private("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext", "call",
            "is the step being traced compiled by XLA"),
    # --- the eager context (collective runtime started late, coordination service) ------------
    Private("tensorflow.python.eager.context", "context", "call", "the eager context"),
    Private(_CTX, "_context_handle", "state", "has the TF runtime started"),
    Private(_CTX, "_collective_ops_server_def", "state", "has this process a gRPC server"),
    Private(_CTX, "_server_def", "state", "as above"),
    Private(_CTX, "configure_collective_ops", "call",
            "skipped when the runtime started before the strategy (late start)"),
    Private(_CTX, "configure_coordination_service", "call",
            "add the heartbeat timeout to the coordination service TF configures"),
    Private(_CTX, "device", "wrap",
            "(on the context instance, while the multi-worker strategy lives) former local "
            "device names keep working after a late start"),
    Private("tensorflow.python.eager.context", "global_seed", "call",
            "whether a shuffle can be resumed exactly (tfdp.callbacks)"),
    # --- tf.data ------------------------------------------------------------------------------
    Private("tensorflow.python.data.ops.dataset_ops:DatasetV2", "_inputs", "call",
            "walk a pipeline to its Python-function sources (tfdp.data._no_alias)"),
    Private("tensorflow.python.data.ops.dataset_ops:DatasetV2", "_functions", "call", "as above"),
    # --- tf.data: a distributed dataset's iterator (tfdp.compat.iterator_internals) ----------
    Private("tensorflow.python.distribute.input_lib:_SingleWorkerOwnedDatasetIterator",
            "_create_owned_multi_device_iterator", "wrap",
            "tfdp's distributed datasets get iterators whose per-device functions are traced once"),
    Private("tensorflow.python.distribute.input_lib:_SingleWorkerOwnedDatasetIterator",
            "_worker", "state", "as above: the host device"),
    Private("tensorflow.python.distribute.input_lib:_SingleWorkerOwnedDatasetIterator",
            "_options", "state", "as above: the per-replica buffer size"),
    Private("tensorflow.python.data.ops.multi_device_iterator_ops", "OwnedMultiDeviceIterator",
            "import", "as above: subclassed (same components and type spec)"),
    Private("tensorflow.python.data.ops.multi_device_iterator_ops", "_PerDeviceGenerator",
            "import", "as above: traced once per (devices, element spec, shard)"),
    Private("tensorflow.python.data.ops.multi_device_iterator_ops:OwnedMultiDeviceIterator",
            "_device_iterators", "state", "as above"),
    Private("tensorflow.python.data.ops.multi_device_iterator_ops:OwnedMultiDeviceIterator",
            "_multi_device_iterator_resource", "state", "as above"),
    Private("tensorflow.python.data.ops.iterator_ops", "OwnedIterator", "import",
            "as above: each per-device iterator, made from its dataset ops (as iter() makes it)"),
    Private("tensorflow.core.framework.dataset_options_pb2", "Options", "import",
            "as above: the per-device and multi-device options, serialized once"),
    Private("tensorflow.core.framework.dataset_metadata_pb2", "Metadata", "import",
            "as above: the per-device prefetch's name, as TF names it"),
    Private("tensorflow.python.ops.gen_dataset_ops", "generator_dataset", "call",
            "as above: the per-device dataset over the cached functions"),
    Private("tensorflow.python.distribute.input_lib", "DistributedDatasetsFromFunction",
            "import", "as above: which distributed datasets make multi-device iterators"),
    Private("tensorflow.python.distribute.input_lib:DistributedDatasetsFromFunction",
            "_datasets", "state", "as above: the per-worker datasets it iterates"),
    Private("tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset",
            "call", "as above: TF's own per-device dataset when the functions cannot be reused"),
    Private("tensorflow.python.framework.op_def_registry", "get", "call",
            "as above: which ops in a pipeline's functions are stateful"),
    Private("tensorflow.python.distribute.device_util", "get_host_for_device", "call",
            "as above: the host device of the multi-device iterator (as TF computes it)"),
    Private("tensorflow.python.distribute.device_util", "canonicalize", "call", "as above"),
    # --- Keras: the gradient path (tfdp.keras.gradient_path) ----------------------------------
    Private("keras.src.losses.loss", "scale_loss_for_distribution", "wrap",
            "replica r's loss carries its share of the global batch"),
    Private("keras.src.losses.loss", "unscale_loss_for_distribution", "wrap",
            "loss trackers read tfdp's unscaled values"),
    Private("keras.src.losses.loss", "reduce_weighted_values", "wrap",
            "masked / sample-weight means, sums and scalars: a divisor counted across replicas"),
    Private("keras.src.losses.loss", "standardize_reduction", "call", "as above"),
    Private("keras.src.losses.loss", "apply_mask", "call", "as above"),
    Private("keras.src.losses.loss", "squeeze_or_expand_to_same_rank", "call", "as above"),
    Private("keras.src.metrics.reduction_metrics:Mean", "update_state", "wrap",
            "a tracker of a scalar loss weighted by the replica's share of the batch"),
    Private("tensorflow.python.eager.backprop:GradientTape", "gradient", "wrap",
            "(public: tf.GradientTape.gradient) a hand-written scalar loss in a Keras step "
            "function is weighted by the replica's share"),
    Private("keras.src.optimizers.base_optimizer:BaseOptimizer", "apply", "wrap",
            "reduce the gradients when an update starts"),
    Private("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer", "apply", "wrap",
            "reduce before the finite check"),
    Private("keras.src.optimizers.base_optimizer:BaseOptimizer", "_clip_gradients", "wrap",
            "reduce inside Keras's gradient-accumulation update branch"),
    Private("keras.src.backend.tensorflow.optimizer:TFOptimizer", "_all_reduce_sum_gradients",
            "wrap", "Keras's own all-reduce passes reduced gradients through"),
    Private(_TRAINER, "_maybe_symbolic_build", "wrap",
            "build from the dataset's element spec (no throw-away iterator)"),
    Private(_TRAINER, "_make_function", "wrap", "per-replica XLA for jit_compile=True on CPUs"),
    Private(_TRAINER, "train_step", "call", "tell Keras's own train_step from a custom one"),
    Private("keras.src.trainers.trainer:Trainer", "_jit_compile", "state",
            "the model's jit_compile setting"),
    Private(_EPOCH_IT, "_distributed_dataset", "state",
            "the distributed dataset of fit's epoch iterator"),
    # --- Keras: callbacks (tfdp.callbacks) ------------------------------------------------------
    Private(_EPOCH_IT, "__init__", "wrap", "fit's epoch iterator: resume at the backed-up step"),
    Private(_EPOCH_IT, "_get_iterator", "wrap", "as above: replay the consumed iterators"),
    Private("keras.src.trainers.trainer:Trainer", "_initial_epoch", "state",
            "as above: fit starts at the backed-up epoch (Keras's own BackupAndRestore sets it)"),
    Private("keras.src.trainers.epoch_iterator:EpochIterator", "_num_batches", "state",
            "shorten the resumed epoch"),
    Private("keras.src.trainers.epoch_iterator:EpochIterator", "_steps_seen", "state",
            "batches read in the epoch"),
    Private("keras.src.trainers.epoch_iterator:EpochIterator", "_interrupted_warning", "call",
            "silence 'ran out of data' for the shortened epoch"),
    Private("keras.src.callbacks.backup_and_restore:BackupAndRestore", "_save_model", "wrap",
            "Keras's own BackupAndRestore writes on the chief only"),
    Private("keras.src.callbacks.backup_and_restore:BackupAndRestore", "on_train_end", "wrap",
            "as above"),
    Private("keras.src.callbacks.model_checkpoint:ModelCheckpoint", "_save_model", "wrap",
            "Keras's ModelCheckpoint writes on the chief only"),
    Private("keras.src.callbacks.model_checkpoint:ModelCheckpoint", "_get_file_path", "call",
            "redirect a non-chief's checkpoint"),
    Private("keras.src.callbacks.csv_logger:CSVLogger", "on_train_begin", "wrap",
            "Keras's CSVLogger writes on the chief only"),
    Private("keras.src.trainers.data_adapters.array_data_adapter:ArrayDataAdapter", "_shuffle",
            "state", "whether fit(numpy) shuffles (exact resume needs a seed)"),
    Private("keras.src.trainers.data_adapters.generator_data_adapter", "GeneratorDataAdapter",
            "import", "a generator cannot be resumed exactly: say so at restore"),
    Private("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDatasetAdapter", "import",
            "a PyDataset cannot be resumed exactly: say so at restore"),
    Private("tensorflow.python.data.ops.shuffle_op:_ShuffleDataset", "_seed", "state",
            "whether a shuffle is seeded (exact resume)"),
    Private("tensorflow.python.data.ops.shuffle_op:_ShuffleDataset", "_reshuffle_each_iteration",
            "state", "as above"),
    Private("tensorflow.python.distribute.input_lib:DistributedDataset", "_original_dataset",
            "state", "the dataset a distributed dataset was made from (exact resume)"),
    # --- Keras: fast paths (tfdp.keras) ---------------------------------------------------------
    Private("keras.src.backend.tensorflow.numpy", "take", "wrap",
            "embedding lookups read rows (ResourceGather), not the whole table"),
    Private("keras.src.backend.common.variables", "Variable", "import",
            "the storage behind a Keras variable (the fast embedding read)"),
    Private("keras.src.optimizers.sgd:SGD", "build", "wrap",
            "which tables a plain SGD updates with scatters (only those get row reads)"),
    # --- Keras: sharded optimizer state (tfdp.zero) --------------------------------------------
    Private("keras.src.optimizers.base_optimizer:BaseOptimizer", "build", "wrap",
            "make the owner plan before the slots are created"),
    Private("keras.src.optimizers.base_optimizer:BaseOptimizer", "_trainable_variables",
            "state", "the variables of apply(grads) without variables (zero_stage=2)"),
    Private("keras.src.backend.common.variables:Variable", "_value", "state",
            "a row-split slot's storage (zero_stage, tfdp.zero.rows)"),
    Private("keras.src.optimizers.base_optimizer:BaseOptimizer", "_backend_apply_gradients",
            "wrap", "refuse what cannot be sharded exactly, after build, before any update"),
)


def _resolve(owner: str):
    module, _, cls = owner.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def _present(entry: Private) -> bool:
    try:
        owner = _resolve(entry.owner)
    except (ImportError, AttributeError):
        return False
    if entry.kind != "state":
        return hasattr(owner, entry.name)
    if hasattr(owner, entry.name):
        return True
    classes = inspect.getmro(owner) if inspect.isclass(owner) else (owner,)
    for c in classes:
        try:
            if f"self.{entry.name}" in inspect.getsource(c):
                return True
        except (OSError, TypeError):
            continue
    return False


def missing() -> list[Private]:
    """The entries the installed TensorFlow / Keras no longer have (imports TensorFlow)."""
    return [e for e in NAMES if not _present(e)]


def _version(dist_names):
    from importlib import metadata
    for name in dist_names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def untested_versions() -> list[str]:
    """``["tensorflow 2.22.0 (tested: 2.19-2.21)", ...]`` for installed versions outside the
    tested range (package metadata only; nothing is imported)."""
    out = []
    for label, dists, (low, high) in (
            ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
             TESTED_TENSORFLOW),
            ("keras", ("keras", "keras-nightly"), TESTED_KERAS)):
        version = _version(dists)
        minor = version and _minor(version)
        if minor and not _minor(low) <= minor <= _minor(high):
            out.append(f"{label} {version} (tested: {low}-{high})")
    return out


_warned = False


def warn_if_untested() -> None:
    """Log one warning (once per process) naming installed versions outside the tested range."""
    global _warned
    if _warned:
        return
    _warned = True
    bad = untested_versions()
    if bad:
        log.warning("tfdp: untested version(s): %s. tfdp relies on %d private TensorFlow/Keras "
                    "names (tfdp/compat/names.py); run `python -m pytest tests/test_compat.py` "
                    "to check them, or install a tested version.", ", ".join(bad), len(NAMES))


__all__ = ["NAMES", "Private", "TESTED_KERAS", "TESTED_TENSORFLOW", "missing",
           "untested_versions", "warn_if_untested"]
