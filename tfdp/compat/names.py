"""Every private TensorFlow / Keras name tfdp relies on, in one list, grouped by the feature that
needs it, and what tfdp does when a name is missing.

Each entry names where it lives, why tfdp needs it, and its kind: ``import`` (a module or class
from ``tensorflow.python`` / ``keras.src``), ``call`` (a function or method called, an attribute
read), ``override`` (a private method a tfdp subclass overrides: TF calls it), ``wrap`` (wrapped
by ``tfdp.compat.wrap`` while a hook set's user lives: ``tfdp.keras.adapter``) or ``state`` (an
attribute set in ``__init__``: looked for as ``self.<name>`` in the owner's source).

An entry's ``also`` lists the owner's other homes in other releases (Keras 3.16 calls
``TensorFlowTrainer`` ``Trainer`` and moved ``backend.tensorflow.numpy`` to
``backend.tensorflow.ops.numpy``): tfdp uses the first that has the name, keyed on what is
there, never on version strings. Owners are public classes (``keras.optimizers:Optimizer``)
wherever one holds the name, so a module that moves inside Keras moves nothing here.

**Features** (``FEATURES``): each entry belongs to one. An *essential* feature is one the exact
step cannot do without: when one of its names is missing, tfdp refuses when the strategy (or the
callback that needs it) is created, with one line naming the name, the installed versions, the
tested range and what to install (``UnsupportedVersionError``). An *extra* is turned off with one
warning saying what the user loses, and training stays exact without it (``require``; the hook
sets of ``tfdp.keras.adapter`` name their feature). ``hiding()`` hides names from this lookup
(tests check the refusal or the exact degraded run for every feature).

``PUBLIC`` lists the public TF / Keras methods tfdp wraps (not private names; checked too).
``missing()``: the entries the installed TF / Keras lack. The tested versions, and the warning
``import tfdp`` logs outside them: ``tfdp.compat.versions``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import threading
from dataclasses import dataclass

from tfdp.compat import versions
from tfdp.errors import TfdpError

log = logging.getLogger("tfdp")


@dataclass(frozen=True)
class Private:
    owner: str   # "package.module" or "package.module:Class"
    name: str    # the attribute (for kind "import": the name imported from owner)
    kind: str    # import | call | override | wrap | state
    why: str
    also: tuple[str, ...] = ()  # the owner's other homes (other releases), tried in order
    feature: str = ""           # set by the FEATURES section the entry is listed in


@dataclass(frozen=True)
class Feature:
    name: str
    essential: bool
    what: str      # what it does for the user
    without: str   # an extra's cost when it is off (one clause), "" for essential features


FEATURES = {f.name: f for f in (
    Feature("strategy", True, "the strategies' base classes, values and reductions", ""),
    Feature("gradient_path", True,
            "the exact gradient path (each replica's loss share, reduction on optimizer entry)",
            ""),
    Feature("multi_worker", True, "several workers (TF's collective runtime, started late)", ""),
    Feature("resume", True, "tfdp.callbacks.BackupAndRestore (fit starts at the backed-up "
            "epoch)", ""),
    Feature("symbolic_build", False, "building an unbuilt model from the dataset's element spec",
            "a model not built before fit is built by Keras from a first batch (a Python "
            "generator loses the batches read ahead for it)"),
    Feature("sparse_reads", False, "sparse embedding reads",
            "embedding lookups read the whole table (slower for tables a plain SGD updates)"),
    Feature("zero", False, "sharded optimizer state (zero_stage)",
            "zero_stage is ignored: every device holds the whole optimizer state"),
    Feature("fast_iterators", False, "distributed-dataset iterators traced once",
            "each fit / evaluate call makes TF's own multi-device iterator (slower to start)"),
    Feature("pipeline_walk", False, "looking inside tf.data pipelines",
            "tfdp assumes the worst of every pipeline: exact resume replays a restarted "
            "pipeline from its start, and iterators are made eagerly"),
    Feature("input_position", False, "drop-in exact resume of fit's input",
            "tfdp.callbacks.BackupAndRestore resumes at the start of the interrupted epoch, as "
            "Keras's own does"),
    Feature("shared_files", False, "Keras's file-writing callbacks on the chief only",
            "Keras's BackupAndRestore / ModelCheckpoint / CSVLogger write on every worker: "
            "give each worker its own path"),
)}


def _section(feature, *entries):
    return tuple(dataclasses.replace(e, feature=feature) for e in entries)


_MS = "tensorflow.python.distribute.mirrored_strategy:MirroredExtended"
_CARS = "tensorflow.python.distribute.collective_all_reduce_strategy:CollectiveAllReduceExtended"
_CDO = "tensorflow.python.distribute.cross_device_ops:CrossDeviceOps"
_CTX = "tensorflow.python.eager.context:Context"
_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"
_TRAINER_ALSO = ("keras.src.backend.tensorflow.trainer:Trainer",)  # (Keras 3.16)
_EPOCH_IT = "keras.src.backend.tensorflow.trainer:TFEpochIterator"
_OPTIMIZER = "keras.optimizers:Optimizer"
_IL = "tensorflow.python.distribute.input_lib"
_MDI = "tensorflow.python.data.ops.multi_device_iterator_ops"

NAMES: tuple[Private, ...] = (
    *_section(
        "strategy",
        Private("tensorflow.python.distribute.mirrored_strategy", "MirroredExtended", "import",
                "the local strategy's extended: mirrored variables, input pipeline, merge_call"),
        Private(_MS, "_call_for_each_replica", "override",
                "each strategy.run: replica shares, empty-replica padding, BatchNorm sync"),
        Private(_MS, "_create_variable", "override", "track layer state and metric variables"),
        Private(_MS, "_use_merge_call", "override",
                "no merge_call inside Keras's accumulation branch or a per-replica XLA step"),
        Private(_MS, "_get_cross_device_ops", "override",
                "tfdp's reducer in replica-context paths"),
        Private(_MS, "_replica_ctx_all_reduce", "override",
                "replica-context all-reduce without merge_call (accumulation), refused under "
                "XLA"),
        Private(_MS, "_experimental_distribute_dataset", "override",
                "wrap datasets so TF never writes into the user's numpy arrays"),
        Private(_MS, "_reduce_to", "override", "fill empty destinations (one-device all_reduce)"),
        Private(_MS, "_batch_reduce_to", "override",
                "empty replicas add nothing to replica-context sums (SyncBatchNorm)"),
        Private(_MS, "_get_variable_creator_initial_value", "override",
                "copies of a variable created inside a tf.function take the primary's value"),
        Private(_CDO, "_gather_implementation", "override",
                "strategy.gather through tfdp's reducers (and TF's CollectiveAllReduce's, "
                "called)"),
        Private(_CDO, "_num_between_graph_workers", "override",
                "Keras's cross-worker output reduction counts workers through it"),
        Private(_CDO, "_all_reduce", "override",
                "replica-context all-reduce without merge_call (Keras's accumulation branch): "
                "TF's MirroredExtended._replica_ctx_all_reduce calls it"),
        Private("tensorflow.python.distribute.values", "PerReplica", "import",
                "build per-replica values from components"),
        Private("tensorflow.python.distribute.values", "Mirrored", "import",
                "build reduced (mirrored) values from components"),
        Private("tensorflow.python.distribute.distribute_utils", "regroup", "call",
                "components -> Mirrored"),
        Private("tensorflow.python.distribute.cross_device_ops", "get_devices_from", "call",
                "destinations -> device strings"),
        Private("tensorflow.python.distribute.cross_device_ops", "check_destinations", "call",
                "whether destinations name devices"),
        Private("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext", "call",
                "is the step being traced compiled by XLA (collectives refused inside it)"),
        Private("tensorflow.python.eager.context", "context", "call", "the eager context"),
        Private(_CTX, "_context_handle", "state",
                "has the TF runtime started (CPU replicas, late collective start)"),
    ),
    *_section(
        "gradient_path",
        Private("keras.src.losses.loss", "scale_loss_for_distribution", "wrap",
                "replica r's loss carries its share of the global batch"),
        Private("keras.src.losses.loss", "unscale_loss_for_distribution", "wrap",
                "loss trackers read tfdp's unscaled values"),
        Private("keras.src.losses.loss", "reduce_weighted_values", "wrap",
                "masked / sample-weight means, sums and scalars: a divisor counted across "
                "replicas"),
        Private(_OPTIMIZER, "_clip_gradients", "wrap",
                "reduce inside Keras's gradient-accumulation update branch"),
        Private(_OPTIMIZER, "_all_reduce_sum_gradients", "wrap",
                "Keras's own all-reduce passes reduced gradients through"),
        Private(_TRAINER, "_make_function", "wrap",
                "mark Keras's steps (hand-written losses in them), per-replica XLA for "
                "jit_compile=True on CPUs", also=_TRAINER_ALSO),
    ),
    *_section(
        "multi_worker",
        Private("tensorflow.python.distribute.collective_all_reduce_strategy",
                "CollectiveAllReduceExtended", "import",
                "the multi-worker extended: cluster and server start-up, initial-value "
                "broadcast, per-worker input sharding"),
        Private(_CARS, "_initialize_local_devices", "override",
                "every local device of a worker (TF's uses CPU:0 or the GPUs only)"),
        Private(_CARS, "_cross_device_ops", "state",
                "swap in tfdp's reducer (tfdp.reduce.Reducer)"),
        # what Keras checks of a multi-worker strategy
        Private("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker",
                "call", "Keras orders predict's outputs across workers only for a TF "
                "MultiWorkerMirroredStrategy in multi-worker mode: why tfdp's inherits it"),
        Private(_CARS, "_in_multi_worker_mode", "call",
                "as above: Keras calls it on tfdp's multi-worker extended (TF's, inherited)"),
        # the eager context: collective runtime started late, coordination service
        Private(_CTX, "_collective_ops_server_def", "state", "has this process a gRPC server"),
        Private(_CTX, "_server_def", "state", "as above"),
        Private(_CTX, "configure_collective_ops", "call",
                "skipped when the runtime started before the strategy (late start)"),
        Private(_CTX, "configure_coordination_service", "call",
                "add the heartbeat timeout to the coordination service TF configures"),
        Private(_CTX, "device", "wrap",
                "(on the context instance, while the multi-worker strategy lives) former local "
                "device names keep working after a late start"),
    ),
    *_section(
        "resume",
        Private("keras:Model", "_initial_epoch", "state",
                "fit starts at the backed-up epoch (Keras's own BackupAndRestore sets it)"),
    ),
    *_section(
        "symbolic_build",
        Private(_TRAINER, "_maybe_symbolic_build", "wrap",
                "build from the dataset's element spec (no throw-away iterator)",
                also=_TRAINER_ALSO),
        Private(_EPOCH_IT, "_distributed_dataset", "state",
                "the distributed dataset of fit's epoch iterator"),
        Private("tensorflow.python.distribute.values:PerReplicaSpec", "_value_specs", "state",
                "one replica's element spec"),
    ),
    *_section(
        "sparse_reads",
        Private("keras.src.backend.tensorflow.numpy", "take", "wrap",
                "embedding lookups read rows (ResourceGather), not the whole table",
                also=("keras.src.backend.tensorflow.ops.numpy",)),  # (Keras 3.16)
    ),
    *_section(
        "zero",
        Private(_MS, "_update", "override",
                "an owned variable's update runs on its owner's copy, then is copied"),
        Private(_MS, "_replica_ctx_update", "override",
                "the owner's update inside Keras's accumulation branch, then broadcast"),
        Private("tensorflow.python.distribute.distribute_utils", "update_regroup", "call",
                "the result of an owner-only update"),
        Private("tensorflow.python.distribute.sharded_variable", "ShardedVariable", "import",
                "a slot split by rows among owners, whole for reads and checkpoints"),
        Private(_OPTIMIZER, "_var_key", "call",
                "(reads _distributed_container) a row block of a split variable is given its "
                "container's, so Keras finds the variable's slots"),
        Private(_OPTIMIZER, "_backend_apply_gradients", "wrap",
                "refuse what cannot be sharded exactly, after build, before any update"),
        Private(_OPTIMIZER, "_trainable_variables", "state",
                "the variables of apply(grads) without variables (zero_stage=2)"),
        Private("keras:Variable", "_value", "state", "a row-split slot's storage (tfdp.zero.rows)"),
    ),
    *_section(
        "fast_iterators",
        Private(f"{_IL}:_SingleWorkerOwnedDatasetIterator", "_create_owned_multi_device_iterator",
                "wrap", "tfdp's distributed datasets get iterators whose per-device functions "
                "are traced once (tfdp.compat.iterator_internals)"),
        Private(f"{_IL}:_SingleWorkerOwnedDatasetIterator", "_worker", "state",
                "as above: the host device"),
        Private(f"{_IL}:_SingleWorkerOwnedDatasetIterator", "_options", "state",
                "as above: the per-replica buffer size"),
        Private(_MDI, "OwnedMultiDeviceIterator", "import",
                "as above: subclassed (same components and type spec)"),
        Private(_MDI, "_PerDeviceGenerator", "import",
                "as above: traced once per (devices, element spec, shard)"),
        Private(f"{_MDI}:OwnedMultiDeviceIterator", "_device_iterators", "state", "as above"),
        Private(f"{_MDI}:OwnedMultiDeviceIterator", "_multi_device_iterator_resource", "state",
                "as above"),
        Private("tensorflow.python.data.ops.iterator_ops", "OwnedIterator", "import",
                "as above: each per-device iterator, made from its dataset ops (as iter() "
                "makes it)"),
        Private("tensorflow.core.framework.dataset_options_pb2", "Options", "import",
                "as above: the per-device and multi-device options, serialized once"),
        Private("tensorflow.core.framework.dataset_metadata_pb2", "Metadata", "import",
                "as above: the per-device prefetch's name, as TF names it"),
        Private("tensorflow.python.ops.gen_dataset_ops", "generator_dataset", "call",
                "as above: the per-device dataset over the cached functions"),
        Private(_IL, "DistributedDatasetsFromFunction", "import",
                "as above: which distributed datasets make multi-device iterators"),
        Private(f"{_IL}:DistributedDatasetsFromFunction", "_datasets", "state",
                "as above: the per-worker datasets it iterates"),
        Private(_MDI, "_create_device_dataset", "call",
                "as above: TF's own per-device dataset when the functions cannot be reused"),
        Private("tensorflow.python.distribute.device_util", "get_host_for_device", "call",
                "as above: the host device of the multi-device iterator (as TF computes it)"),
        Private("tensorflow.python.distribute.device_util", "canonicalize", "call", "as above"),
    ),
    *_section(
        "pipeline_walk",
        Private("tensorflow.python.data.ops.dataset_ops:DatasetV2", "_inputs", "call",
                "walk a pipeline to its sources (Python functions, shuffles, stateful ops)"),
        Private("tensorflow.python.data.ops.dataset_ops:DatasetV2", "_functions", "call",
                "as above"),
        Private("tensorflow.python.framework.op_def_registry", "get", "call",
                "which ops in a pipeline's functions are stateful"),
        Private("tensorflow.python.data.ops.shuffle_op:_ShuffleDataset", "_seed", "state",
                "whether a shuffle is seeded (exact resume)"),
        Private("tensorflow.python.data.ops.shuffle_op:_ShuffleDataset",
                "_reshuffle_each_iteration", "state", "as above"),
        Private(f"{_IL}:DistributedDataset", "_original_dataset", "state",
                "the dataset a distributed dataset was made from"),
    ),
    *_section(
        "input_position",
        Private(_EPOCH_IT, "__init__", "wrap",
                "fit's epoch iterator: resume at the backed-up step"),
        Private(_EPOCH_IT, "_get_iterator", "wrap", "as above: replay the consumed iterators"),
        Private("keras.src.trainers.epoch_iterator:EpochIterator", "_num_batches", "state",
                "shorten the resumed epoch"),
        Private("keras.src.trainers.epoch_iterator:EpochIterator", "_steps_seen", "state",
                "batches read in the epoch"),
        Private("keras.src.trainers.epoch_iterator:EpochIterator", "_interrupted_warning", "call",
                "silence 'ran out of data' for the shortened epoch"),
        Private("tensorflow.python.eager.context", "global_seed", "call",
                "whether a shuffle can be resumed exactly"),
    ),
    *_section(
        "shared_files",
        Private("keras.callbacks:BackupAndRestore", "_save_model", "wrap",
                "Keras's own BackupAndRestore writes on the chief only (the others into a "
                "private folder: saving reads sync-on-read variables, a collective)"),
        Private("keras.callbacks:BackupAndRestore", "_weights_path", "state",
                "as above: its files, pointed into the private folder"),
        Private("keras.callbacks:BackupAndRestore", "_training_metadata_path", "state",
                "as above"),
        Private("keras.callbacks:BackupAndRestore", "_prev_weights_path", "state", "as above"),
        Private("keras.callbacks:BackupAndRestore", "_prev_training_metadata_path", "state",
                "as above"),
        Private("keras.callbacks:ModelCheckpoint", "_save_model", "wrap",
                "Keras's ModelCheckpoint writes on the chief only"),
        Private("keras.callbacks:ModelCheckpoint", "_get_file_path", "call",
                "redirect a non-chief's checkpoint"),
    ),
)


@dataclass(frozen=True)
class Public:
    owner: str
    name: str
    why: str
    kind: str = "wrap"


# Public TF / Keras methods that tfdp wraps (while a hook set's user lives): no private name,
# but their owners must still have them (checked with the private ones).
PUBLIC: tuple[Public, ...] = (
    Public("tensorflow:GradientTape", "gradient",
           "a hand-written scalar loss in a Keras step is weighted by the replica's share"),
    Public("keras.metrics:Mean", "update_state",
           "a tracker of a scalar loss weighted by the replica's share of the batch"),
    Public(_OPTIMIZER, "apply", "reduce the gradients when an update starts"),
    Public("keras.optimizers:LossScaleOptimizer", "apply", "reduce before the finite check"),
    Public(_OPTIMIZER, "build", "make zero_stage's owner plan before the slots are created"),
    Public("keras.optimizers:SGD", "build", "which tables a plain SGD scatters into"),
    Public("keras:Model", "predict_on_batch", "one device's rows (Keras's: N copies of them)"),
    Public("keras:Model", "get_metrics_result", "each batch's values summed over the replicas"),
    Public("keras.callbacks:BackupAndRestore", "on_train_end",
           "Keras's own BackupAndRestore deletes its files on the chief only"),
    Public("keras.callbacks:CSVLogger", "on_train_begin", "it writes on the chief only"),
)


# --- lookup -------------------------------------------------------------------------------------

_hidden: set[tuple[str, str]] = set()   # (owner, name) hidden from the lookup (tests)
_present_cache: dict[Private, bool] = {}
_lock = threading.Lock()


def _import(owner: str):
    module, _, cls = owner.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


@functools.lru_cache(maxsize=None)
def _source_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _has(owner_obj, entry) -> bool:
    if entry.kind != "state" or hasattr(owner_obj, entry.name):
        return hasattr(owner_obj, entry.name)
    # set in a method: ``self.<name>`` in the source file of the owner or a base class (whole
    # files, read once: a class's own source would be parsed out of its module every time)
    classes = inspect.getmro(owner_obj) if inspect.isclass(owner_obj) else (owner_obj,)
    for c in classes:
        try:
            if f"self.{entry.name}" in _source_text(inspect.getsourcefile(c) or ""):
                return True
        except (OSError, TypeError):
            continue
    return False


def home(entry):
    """The object (module or class) that holds ``entry``'s name in the installed TF / Keras: its
    owner, else the first of its other homes (``also``) that has it; None when none has it or
    the entry is hidden."""
    if (entry.owner, entry.name) in _hidden:
        return None
    for owner in (entry.owner, *getattr(entry, "also", ())):
        try:
            obj = _import(owner)
        except (ImportError, AttributeError):
            continue
        if _has(obj, entry):
            return obj
    return None


def _present(entry) -> bool:
    if (entry.owner, entry.name) in _hidden:
        return False
    with _lock:
        known = _present_cache.get(entry)
    if known is None:
        known = home(entry) is not None
        with _lock:
            _present_cache[entry] = known
    return known


def point(owner: str, name: str):
    """``(home object, name)`` of the listed private or public name ``owner`` / ``name`` (the
    wrap points of ``tfdp.compat.keras_internals``): its first home that has it."""
    for entry in (*NAMES, *PUBLIC):
        if entry.owner == owner and entry.name == name:
            obj = home(entry)
            if obj is None:
                raise AttributeError(f"{owner}.{name} is not in the installed TensorFlow / Keras")
            return obj, name
    raise KeyError(f"{owner}.{name} is not listed in tfdp.compat.names")


def missing() -> list:
    """The entries (private and public) the installed TensorFlow / Keras no longer have
    (imports TensorFlow)."""
    return [e for e in (*NAMES, *PUBLIC) if not _present(e)]


def unavailable(feature: str) -> list[Private]:
    """The entries of ``feature`` that the installed TensorFlow / Keras lack (or are hidden)."""
    if feature not in FEATURES:
        raise KeyError(f"no feature {feature!r} (known: {sorted(FEATURES)})")
    return [e for e in NAMES if e.feature == feature and not _present(e)]


def available(feature: str) -> bool:
    return not unavailable(feature)


@contextlib.contextmanager
def hiding(*entries):
    """Hide ``entries`` (``Private`` entries or ``(owner, name)`` pairs) from the lookup for the
    duration (tests: what tfdp does on a TF / Keras without them)."""
    keys = {(e.owner, e.name) if isinstance(e, Private) else tuple(e) for e in entries}
    added = keys - _hidden
    _hidden.update(added)
    _warned_features.difference_update(FEATURES)
    try:
        yield
    finally:
        _hidden.difference_update(added)
        _warned_features.difference_update(FEATURES)


class UnsupportedVersionError(TfdpError):
    """The installed TensorFlow / Keras lacks a name an essential feature of tfdp needs."""


def _where(entry) -> str:
    return f"{entry.owner.replace(':', '.')}.{entry.name}"


_warned_features: set[str] = set()


ESSENTIAL = tuple(n for n, f in FEATURES.items() if f.essential and n != "resume")
"""What tfdp's strategies (and tfdp's TF internals, ``tfdp.compat``) cannot do without."""


def require(*features: str, by: str = "tfdp") -> set[str]:
    """Check ``features`` against the installed TensorFlow / Keras for ``by`` (what is being
    created). An essential feature with a missing name raises ``UnsupportedVersionError`` (one
    line: what is missing, the versions, the tested range, what to install); an extra is turned
    off with one warning (once per process) saying what the user loses. Returns the extras that
    are off."""
    off = set()
    for name in features:
        feature = FEATURES[name]
        lacking = unavailable(name)
        if not lacking:
            continue
        listed = ", ".join(_where(e) for e in lacking[:3]) + (
            f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        if feature.essential:
            raise UnsupportedVersionError(
                f"{by} cannot run on this TensorFlow / Keras: {feature.what} needs {listed}, "
                f"which the installed version lacks. Received: {versions.installed()} "
                f"({versions.tested()}). Install a tested pair: {versions.install_hint()}")
        off.add(name)
        if name not in _warned_features:
            _warned_features.add(name)
            log.warning("tfdp: %s is off on this TensorFlow / Keras (%s; it lacks %s): %s; "
                        "training stays exact.", feature.what, versions.installed(), listed,
                        feature.without)
    return off


__all__ = ["ESSENTIAL", "FEATURES", "NAMES", "PUBLIC", "Feature", "Private", "Public",
           "UnsupportedVersionError", "available", "hiding", "home", "missing", "point",
           "require", "unavailable"]
