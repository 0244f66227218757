"""Keras 3's private names (TensorFlow backend): the hook points of the gradient path, the
callbacks, the fast paths and sharded optimizer state, and the one mechanism that wraps them
(``wrap``, ``unwrap``: the adapter, ``tfdp.keras.adapter``, installs and removes every hook set
through them).

Checked against Keras 3.12 to 3.16 (``tfdp.compat.names`` lists every name, where other
releases keep it, and the feature that needs it; a test checks them).
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from tfdp.compat import names
from tfdp.compat.tf_internals import _context, _values

from tfdp.compat.names import _EPOCH_IT, _OPTIMIZER, _TRAINER  # (the owners names.py lists)

# --- Keras 3 internals (the TensorFlow backend) --------------------------------------------------
#
# tfdp's gradient path (``tfdp.keras.gradient_path``) acts at four places inside Keras, each a
# private name listed here (and in names.py), checked by ``tests/test_compat.py``:
#
#   keras.src.losses.loss.scale_loss_for_distribution / unscale_loss_for_distribution
#       every Keras loss passes through them (Loss.__call__'s mean reduction, compile()'s losses,
#       the model's regularization losses, the loss trackers): replica r's share of the batch.
#   keras.src.losses.loss.reduce_weighted_values
#       Loss.__call__ divides there: masked means, sample-weight means, sums and scalars get a
#       divisor counted across replicas (tfdp.keras.losses; the mask and weight helpers below
#       recompute Keras's with public keras.ops).
#   keras.metrics.Mean.update_state (public)
#       a user's tracker of a scalar loss is weighted by the replica's share of the batch.
#   keras.optimizers.Optimizer.apply, LossScaleOptimizer.apply (public)
#       the entry of every optimizer update (apply_gradients calls apply): reduce first.
#   Optimizer._clip_gradients
#       the one call per update right before the update step, also inside Keras's
#       gradient-accumulation update branch: reduce there when accumulating.
#   Optimizer._all_reduce_sum_gradients (TFOptimizer's)
#       Keras's own all-reduce, which must not reduce gradients tfdp already reduced.
#   TensorFlowTrainer._make_function (Keras 3.16: Trainer; with the public jit_compile)
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
    """{name: (owner, attribute)} for every Keras internal the gradient path wraps (owner: class
    or module; found where the installed Keras keeps it: ``tfdp.compat.names``)."""
    return {
        "scale_loss": names.point("keras.src.losses.loss", "scale_loss_for_distribution"),
        "unscale_loss": names.point("keras.src.losses.loss", "unscale_loss_for_distribution"),
        "reduce_weighted_values": names.point("keras.src.losses.loss", "reduce_weighted_values"),
        "mean_update_state": names.point("keras.metrics:Mean", "update_state"),
        # (TensorFlow's public GradientTape: a hand-written loss in a Keras step function)
        "tape_gradient": names.point("tensorflow:GradientTape", "gradient"),
        "apply": names.point(_OPTIMIZER, "apply"),
        "loss_scale_apply": names.point("keras.optimizers:LossScaleOptimizer", "apply"),
        "clip_gradients": names.point(_OPTIMIZER, "_clip_gradients"),
        "all_reduce_sum_gradients": names.point(_OPTIMIZER, "_all_reduce_sum_gradients"),
        "make_function": names.point(_TRAINER, "_make_function"),
        "predict_on_batch": names.point("keras:Model", "predict_on_batch"),
        "get_metrics_result": names.point("keras:Model", "get_metrics_result"),
    }


def keras_symbolic_build_points():
    """{name: (owner, attribute)}: Keras's symbolic build of an unbuilt model at ``fit``."""
    return {"symbolic_build": names.point(_TRAINER, "_maybe_symbolic_build")}


def keras_mask_weights(sample_weight, mask, dtype, ops):
    """Sample weights times a 0/1 ``mask`` (either may be None), brought to one rank, as
    Keras's ``apply_mask(..., reduction="sum")`` computes them (public ``keras.ops`` only)."""
    if mask is None:
        return sample_weight
    mask = ops.cast(mask, dtype=dtype)
    if sample_weight is None:
        return mask
    mask, sample_weight = keras_same_rank(mask, ops.cast(sample_weight, dtype=dtype), ops)
    return sample_weight * mask


def keras_same_rank(x1, x2, ops):
    """Squeeze or expand the last axis of one of two tensors whose ranks differ by one, as
    Keras's ``squeeze_or_expand_to_same_rank`` does for losses (public ``keras.ops`` only)."""
    r1, r2 = len(x1.shape), len(x2.shape)
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1:
            x2 = ops.expand_dims(x2, axis=-1)
        else:
            x1 = ops.squeeze(x1, axis=-1)
    elif r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1:
            x1 = ops.expand_dims(x1, axis=-1)
        else:
            x2 = ops.squeeze(x2, axis=-1)
    return x1, x2


def called_from_keras_tf_backend() -> bool:
    """Whether the first caller on this thread's stack outside tfdp and TensorFlow is Keras's
    TensorFlow backend (its trainer: e.g. its symbolic build reducing a first batch)."""
    import sys
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("tfdp.", "tensorflow.")):
            return module.startswith("keras.src.backend.tensorflow")
        frame = frame.f_back
    return False


def keras_builtin_train_step():
    """Keras's own ``train_step`` (the function, to compare with): ``keras.Model``'s."""
    import keras
    return keras.Model.train_step


_TFDP_ORIGINAL = "__tfdp_original__"
_LAYER = "__tfdp_layer__"          # the marker of the wrapper it is set on (wrappers stack)
_MAKE = "__tfdp_make__"            # the ``make`` that built it (to rebuild the layers above)
_INHERITED = "__tfdp_inherited__"  # the owner held no value of its own before (class, instance)


def _stored(owner, attr):
    """(the value as stored, whether ``owner``'s own namespace holds it): for a class, the raw
    entry of the first class in its MRO that defines it (no descriptor binding); for a module,
    its global; for an instance, its own attribute, else the bound method from its class."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return vars(klass)[attr], klass is owner
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    own = getattr(owner, "__dict__", None)
    if own is not None and attr in own:
        return own[attr], True
    return getattr(owner, attr), False


def _layer(current, make, marker, inherited):
    replacement = functools.wraps(current)(make(current))
    setattr(replacement, marker, current)
    setattr(replacement, _LAYER, marker)
    setattr(replacement, _MAKE, make)
    setattr(replacement, _INHERITED, inherited)
    return replacement


def wrap(points, hooks, marker=_TFDP_ORIGINAL) -> None:
    """Install ``hooks`` ({name: make(original) -> replacement}) at ``points`` ({name: (owner,
    attribute)}: a class, a module or an instance). The one wrapping mechanism of tfdp; ``unwrap``
    takes a hook out again.

    Idempotent: a point already wrapped (its current value carries ``marker``) keeps its wrapper.
    Each replacement keeps the original under ``marker`` and must call it whenever tfdp is not
    involved. Subsystems that may wrap the same point pass their own ``marker`` (their wrappers
    then stack, each removable on its own).
    """
    for name, make in hooks.items():
        owner, attr = points[name]
        current, own = _stored(owner, attr)
        if _find(current, marker) is not None:
            continue
        setattr(owner, attr, _layer(current, make, marker, inherited=not own))


def _find(value, marker):
    """The wrapper layer carrying ``marker`` in the stack of tfdp wrappers ``value`` tops, or
    None."""
    while True:
        layer = getattr(value, _LAYER, None)
        if not isinstance(layer, str):
            return None
        if layer == marker:
            return value
        value = getattr(value, layer)


def unwrap(points, names, marker=_TFDP_ORIGINAL) -> None:
    """Take the hooks ``names`` (wrapped with ``marker``) out of ``points`` again: the original
    goes back exactly (``setattr(owner, attr, original)``, or the owner's own entry is deleted
    when the original was inherited); wrappers of other markers stacked above are rebuilt on
    what remains. A point not wrapped with ``marker`` is left alone."""
    for name in names:
        owner, attr = points[name]
        try:
            current, own = _stored(owner, attr)
        except AttributeError:
            continue
        if not own or _find(current, marker) is None:
            continue
        above, value = [], current
        while getattr(value, _LAYER) != marker:
            above.append(value)
            value = getattr(value, getattr(value, _LAYER))
        restored, inherited = getattr(value, marker), getattr(value, _INHERITED, False)
        if not above and inherited:
            delattr(owner, attr)  # (the original is the class's again)
            continue
        for layer in reversed(above):  # rebuild the other subsystems' wrappers, innermost first
            restored = _layer(restored, getattr(layer, _MAKE), getattr(layer, _LAYER), inherited)
            inherited = False
        setattr(owner, attr, restored)


def wrapped(points, marker=_TFDP_ORIGINAL) -> list[str]:
    """The names of ``points`` that carry a wrapper with ``marker`` now."""
    out = []
    for name, (owner, attr) in points.items():
        try:
            current, _ = _stored(owner, attr)
        except AttributeError:
            continue
        if _find(current, marker) is not None:
            out.append(name)
    return out


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
    return {
        "epoch_iterator_init": names.point(_EPOCH_IT, "__init__"),
        "epoch_iterator_get_iterator": names.point(_EPOCH_IT, "_get_iterator"),
        "backup_save": names.point("keras.callbacks:BackupAndRestore", "_save_model"),
        "backup_train_end": names.point("keras.callbacks:BackupAndRestore", "on_train_end"),
        "checkpoint_save": names.point("keras.callbacks:ModelCheckpoint", "_save_model"),
        "csv_train_begin": names.point("keras.callbacks:CSVLogger", "on_train_begin"),
    }


def keras_is_fit_epoch_iterator(init_kwargs) -> bool:
    """Whether a ``TFEpochIterator`` made with these keyword arguments is ``fit``'s training
    iterator: only ``fit`` passes ``class_weight`` (``evaluate``, ``predict`` and fit's
    validation iterator do not)."""
    return "class_weight" in init_kwargs


def keras_input_kind(init_kwargs):
    """What a ``TFEpochIterator`` made with these keyword arguments reads, from the ``x`` that
    ``fit`` passed (public types only): "PyDataset", "generator" (Keras runs Python to produce
    each batch), "dataset" (tf.data or a distributed dataset), else "arrays"."""
    import collections.abc
    import keras
    x = init_kwargs.get("x")
    if isinstance(x, keras.utils.PyDataset):
        return "PyDataset"
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        return "dataset"
    if isinstance(x, collections.abc.Iterator) and not isinstance(x, tf.data.Iterator):
        return "generator"
    return "arrays"


def keras_input_shuffles(init_kwargs) -> bool:
    """Whether ``fit`` shuffles array input (``shuffle`` on: Keras's array adapter then
    shuffles with ``tf.random.shuffle`` in its tf.data pipeline, seeded only by the global seed
    in force when the epoch iterator was made)."""
    return keras_input_kind(init_kwargs) == "arrays" and bool(init_kwargs.get("shuffle"))


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
    return {"take": names.point("keras.src.backend.tensorflow.numpy", "take"),
            "sgd_build": names.point("keras.optimizers:SGD", "build")}


def keras_variable_storage(x):
    """The ``tf.Variable`` (or tf.distribute variable) behind a Keras variable ``x`` as a read
    would see it, or None: not a Keras variable, or a read that would cast (autocast)."""
    import keras
    if not isinstance(x, keras.Variable):
        return None
    value = x.value  # (the storage itself unless an autocast scope casts it)
    import tensorflow as tf
    return value if isinstance(value, tf.Variable) else None


# --- zero: Keras internals of sharded optimizer state (issue 20, tfdp.zero) ------------------
#
#   BaseOptimizer.build: every optimizer's build (subclasses call it first): the owner plan is
#       made there, before the slots exist.
#   BaseOptimizer._backend_apply_gradients: after build, before any update: refuse what cannot
#       be sharded exactly.
#   BaseOptimizer.apply, LossScaleOptimizer.apply: which variable each gradient belongs to
#       (zero_stage=2 reduces each gradient onto its variable's owner).

def keras_zero_hook_points():
    """{name: (owner, attribute)} of the Keras internals ``tfdp.zero`` wraps."""
    return {
        "build": names.point(_OPTIMIZER, "build"),
        "backend_apply_gradients": names.point(_OPTIMIZER, "_backend_apply_gradients"),
        "apply": names.point(_OPTIMIZER, "apply"),
        "loss_scale_apply": names.point("keras.optimizers:LossScaleOptimizer", "apply"),
    }


def keras_optimizer_built_variables(optimizer):
    """The variables ``optimizer`` was built with (what ``apply(grads)`` without variables
    updates), or None."""
    return getattr(optimizer, "_trainable_variables", None)


def keras_variable_value(variable):
    """The storage a Keras variable holds (``_value``: a tf.Variable, or zero_stage's
    ShardedVariable), or None."""
    return getattr(variable, "_value", None)


def set_keras_variable_value(variable, value) -> None:
    """Point a Keras variable at another storage (zero_stage's row-split update reads and
    writes one owner's piece of a slot while it traces that owner's update)."""
    variable._value = value  # pylint: disable=protected-access


# --- compat-versions (issue #12 item 5): TensorFlow 2.19-2.22, Keras 3.12-3.16 ---------------
#
# Every TensorFlow private name tfdp uses (names.py) is the same in TF 2.19.1, 2.20.0 and
# 2.21.0 (their tf.distribute, eager context and tf.data sources differ only in comments; the
# compatibility subset, .ci/compat_subset.txt, runs on each): nothing depends on the TF release.
# Keras differs, and setup.py requires keras>=3.12 (TF 2.21's own floor):
# * before Keras 3.10 a Keras variable has no ``synchronization`` and metric variables
#   (``Metric.add_variable``) are created sync-on-write, as MirroredVariables that all-reduce
#   every ``update_state`` through a merge_call. tfdp keeps metric state per replica
#   (sync-on-read, as Keras 3.10+ creates it): with such a Keras the loss history and metrics
#   differ from one device and accumulation fails ("Some replicas made a different number of
#   replica_context().merge_call() calls"). Checked below (one clear error at strategy creation).
# * with Keras 3.10 and 3.11, compile(jit_compile=True) on several CPU replicas fails: a replica's
#   XLA-compiled step reads another replica's variable ("Trying to access resource
#   .../replica_1/... located in device CPU:1 from device CPU:0"); fine from Keras 3.12.

def keras_metric_variables_sync_on_read() -> bool:
    """Whether this Keras creates metric variables sync-on-read (``keras.Variable`` has a
    ``synchronization``, Keras >= 3.10), which tfdp's metric handling needs."""
    import keras
    return hasattr(keras.Variable, "synchronization")
