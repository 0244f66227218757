"""tfdp's gradient path: why N replicas train exactly like one device on the whole global batch.

Keras 3 on TensorFlow decides three things that tf.distribute strategies get wrong, and tfdp acts
at exactly those places (the Keras internals involved are listed, and checked against the
installed Keras, in ``tfdp.compat.keras_hook_points``):

1. **Each replica's loss contributes its part of the one-device gradient.** Keras multiplies
   every replica's mean loss by 1/N (``scale_loss_for_distribution``), which is the one-device
   gradient only when every replica has B/N examples and the loss divides by its example count.
   During a tfdp step each loss's gradient carries the replica's share of whatever one device
   divides by: its share of the global batch, ``n_r / sum(n)``, for means over elements, and a
   divisor counted across every replica of every worker for masked and sample-weight means
   (``tfdp.keras.losses``, which also makes the values users read equal one device's). The sum
   of the replicas' gradients is then the global-batch gradient for any split, so every gradient
   all-reduce is a plain SUM: any optimizer, several per step, any variable order or subset,
   accumulation, loss scaling.

2. **The optimizer sees the reduced gradient.** Keras clips (``_clip_gradients``) and
   ``LossScaleOptimizer`` checks for inf/NaN *before* Keras's own all-reduce
   (``_all_reduce_sum_gradients``, inside ``_backend_update_step``), so under tf.distribute every
   replica clips its own partial gradient. Under tfdp the outermost ``optimizer.apply`` of each
   replica (``apply_gradients`` calls it) all-reduces its gradients on entry, in one batched SUM
   through the strategy's reducer (fused buckets, compression, sparse rules); from there the
   optimizer works on the global gradient exactly as one device does (unscale, finite check,
   clip, weight decay, update), and its own ``_all_reduce_sum_gradients`` passes the reduced
   gradients through. With ``gradient_accumulation_steps`` the reduction waits for the update
   micro-step: it happens where Keras clips the accumulated gradient, inside Keras's update
   branch (a ``tf.cond``), through replica-context collectives, one reduction per k micro-steps
   (``tfdp.reduce.collective``). A ``LossScaleOptimizer`` always reduces on entry (its finite
   check must see the global gradient, or replicas could take different branches).

3. **XLA on CPU replicas** (``compile(jit_compile=True)``). Keras compiles the whole multi-replica
   step as one XLA function, which cannot hold ops of several CPU devices nor CPU collectives.
   ``_ReplicaXlaStep`` compiles each replica's step on its own device instead, with that
   replica's optimizer updates deferred until the compiled part returns its gradients (exact
   for Keras's own ``train_step``, whose metrics use the predictions made before the update);
   where a collective would have to sit inside the compiled step, one clear error.

A step is one ``strategy.run`` call (Keras's train/test/predict steps, or a custom loop's), with
one replica per local device; its ``StepContext`` (``tfdp.keras.step``) holds what the hooks need
while its replica functions are traced. Outside a tfdp step (no strategy, another strategy, one
replica) every hook calls Keras's own code unchanged. The hooks are in Keras only while a tfdp
strategy lives (``tfdp.keras.adapter``: sets ``gradient_path`` and ``perf``).
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.compat import names as tfp_names
from tfdp.keras import adapter, losses, reported
from tfdp.keras.step import StepContext, is_tfdp, running  # noqa: F401 (the strategy's names)
from tfdp.keras.step import current as _current

SUM = tf.distribute.ReduceOp.SUM


class _Apply:
    """One replica's outermost ``optimizer.apply`` while it is traced."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.reduced = False  # its gradients are reduced (Keras's own all-reduce passes them)


def accumulation_steps(optimizer):
    """``gradient_accumulation_steps`` of an optimizer (also behind a loss-scale wrapper)."""
    for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        steps = getattr(o, "gradient_accumulation_steps", None)
        if steps:
            return int(steps)
    return None


def linear_in_gradient(optimizer) -> bool:
    """Whether ``optimizer``'s update is linear in the gradient, so a densified IndexedSlices
    (duplicate ids summed first) gives the same update: plain or momentum SGD without clipping
    (Keras's Adam/Adagrad/RMSprop square sparse rows one by one; clipping takes norms)."""
    import keras
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(optimizer, keras.optimizers.SGD):
        return False
    return all(getattr(optimizer, a, None) is None
               for a in ("clipnorm", "clipvalue", "global_clipnorm"))


def _open_apply():
    cur = _current()
    return None if cur is None else cur[1].applies.get(cur[2])


def reduce_gradients(extended, grads, optimizer, trainable_variables=None):
    """All-reduce (SUM) this replica's gradients with every other replica's; None stays None.

    Gradients of variables that Keras overwrites with their gradient (``overwrite_with_gradient``)
    are left alone, as Keras's own all-reduce leaves them.
    """
    grads = list(grads)
    variables = list(trainable_variables) if trainable_variables is not None else None
    idx = [i for i, g in enumerate(grads) if g is not None and not (
        variables is not None and i < len(variables)
        and getattr(variables[i], "overwrite_with_gradient", False))]
    if not idx:
        return grads
    reduced = extended.all_reduce_gradients([grads[i] for i in idx],
                                            densify_ok=linear_in_gradient(optimizer))
    for i, r in zip(idx, reduced):
        grads[i] = r
    return grads


def zero_if_empty(grads, mask):
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            g = tf.IndexedSlices(tf.math.multiply_no_nan(g.values, tf.cast(mask, g.dtype)),
                                 g.indices, g.dense_shape)
        elif g is not None and g.dtype.is_floating:
            g = tf.math.multiply_no_nan(g, tf.cast(mask, g.dtype))
        out.append(g)
    return out


# --- the hooks (in Keras while a tfdp strategy lives: tfdp.keras.adapter) ---------------------

def updates_in_cond(optimizer) -> bool:
    """Whether Keras puts (part of) this optimizer's own update in a ``tf.cond`` branch, where
    no merge_call can run: gradient accumulation (the update micro-step) and an EMA that
    overwrites the model's variables every ``ema_overwrite_frequency`` steps. (A
    LossScaleOptimizer's finite-check cond is Keras's own cross-replica path: its inner
    optimizer is asked separately.)"""
    return accumulation_steps(optimizer) is not None or bool(
        getattr(optimizer, "use_ema", False) and getattr(optimizer, "ema_overwrite_frequency",
                                                         None))


def _apply(original):
    def apply(self, grads, trainable_variables=None):
        cur = _current()
        if cur is None or len(grads) == 0:
            return original(self, grads, trainable_variables)
        extended, step, replica = cur
        loss_scale = hasattr(self, "inner_optimizer")
        if replica in step.applies:
            # Nested: a LossScaleOptimizer's inner optimizer, its gradients reduced on entry,
            # in a replica of the loss-scale optimizer's cross-replica finite-check cond.
            if updates_in_cond(self) and not loss_scale:
                with step.replica_collectives():
                    return original(self, grads, trainable_variables)
            return original(self, grads, trainable_variables)
        if replica in step.deferred:  # inside this replica's XLA-compiled step: apply later
            step.deferred[replica].append((self, list(grads), trainable_variables))
            return None
        if step.micro is not None:
            # one micro-batch of a step (tfdp.strategy.micro_batches): its gradients join the
            # earlier micro-batches'; the last one applies the sum (an empty replica's part of a
            # micro-batch adds zero, its padded example's statistics may be anything)
            if step.masks is not None:
                grads = zero_if_empty(grads, step.masks[replica])
            grads = step.micro.add(replica, self, grads)
            if not step.micro.last:
                return None
        accumulate = accumulation_steps(self) is not None
        scope = _Apply(self)
        step.applies[replica] = scope
        if not any(o is self for o in step.optimizers):
            step.optimizers.append(self)
        try:
            if not accumulate or loss_scale:
                # A LossScaleOptimizer always reduces on entry: its finite check must see the
                # global gradient, or replicas could take different branches.
                grads = reduce_gradients(extended, grads, self, trainable_variables)
                scope.reduced = True
            if loss_scale or not updates_in_cond(self):
                # (a LossScaleOptimizer keeps Keras's cross-replica path: its finite-check cond
                # runs in a merge_call, its inner optimizer's apply in each replica, nested)
                return original(self, grads, trainable_variables)
            if not scope.reduced and step.masks is not None:
                # An empty replica's micro-batch adds zero to its accumulators (its batch
                # statistics may be NaN); masking later, at the update, would also drop what
                # the replica accumulated on earlier micro-steps.
                grads = zero_if_empty(grads, step.masks[replica])
            # Keras puts the update (merge_calls, its all-reduce) in a tf.cond: replica-context
            # collectives only, for the duration of this apply. (Accumulated gradients are
            # reduced in the update branch, by the _clip_gradients hook; every replica then
            # updates its own copy with the same values.)
            with step.replica_collectives():
                return original(self, grads, trainable_variables)
        finally:
            del step.applies[replica]
    return apply


def _clip_gradients(original):
    def clip(self, grads):
        scope = _open_apply()
        if scope is not None and not scope.reduced:  # the accumulation update branch
            cur = _current()
            grads = reduce_gradients(cur[0], grads, scope.optimizer)
            scope.reduced = True
        return original(self, grads)
    return clip


def _all_reduce_sum_gradients(original):
    def all_reduce_sum_gradients(self, grads_and_vars):
        scope = _open_apply()
        if scope is not None and scope.reduced:
            return list(grads_and_vars)  # tfdp reduced them already
        return original(self, grads_and_vars)
    return all_reduce_sum_gradients


_row_updated = weakref.WeakValueDictionary()  # id(Keras variable) -> it: updated by scatters


def scatters_sparse_gradients(optimizer) -> bool:
    """Whether Keras updates a variable from a sparse gradient with a scatter (plain SGD: no
    momentum, accumulation or EMA); other optimizers build a dense update."""
    import keras
    return (isinstance(optimizer, keras.optimizers.SGD) and not optimizer.momentum
            and not getattr(optimizer, "gradient_accumulation_steps", None)
            and not getattr(optimizer, "use_ema", False))


def _sgd_build(original):
    def build(self, variables):
        out = original(self, variables)
        if (tf.distribute.has_strategy() and is_tfdp(tf.distribute.get_strategy().extended)
                and scatters_sparse_gradients(self)):  # (built under a tfdp strategy only)
            for v in variables:
                _row_updated[id(v)] = v
        return out
    return build


def _take(original):
    """``ops.take(table, ids, axis=0)`` in a tfdp step, of a Keras variable that a plain SGD
    updates with scatters (``Embedding`` + SGD): a sparse read of the rows (``ResourceGather``)
    instead of a read of the whole table.

    Keras's TensorFlow ``take`` converts the variable to a tensor first. Once an optimizer has
    updated the table with a scatter (a sparse gradient), TF keeps the variable in copy-on-read
    mode, so that read copies the whole table, on every replica, every step: measured 75% of the
    step of a 200,000 x 64 embedding model on 4 CPU replicas (``tfdp bench embedding``). The rows
    are the same values (negative ids wrap, as Keras's ``take`` does), and the gradient is the
    same ``IndexedSlices``. Only for tables updated by scatters: a sparse read puts the table in
    copy-on-read mode too, and then every dense update (momentum, Adam: Keras builds a dense
    update) copies the table first (measured 0.6-0.7x), where Keras's dense read copies nothing.
    """
    def take(x, indices, axis=None):
        cur = _current()
        if (axis == 0 and cur is not None
                and _row_updated.get(id(x)) is x):
            table = tfp.keras_variable_storage(x)
            if (table is not None and table.shape.rank and table.shape[0] is not None
                    and not isinstance(indices, (tf.SparseTensor, tf.RaggedTensor))):
                ids = tf.convert_to_tensor(indices)
                if ids.dtype.is_integer:
                    ids = tf.where(ids < 0, ids + tf.cast(table.shape[0], ids.dtype), ids)
                    if tfp.is_distributed_values(table):  # this replica's copy
                        table = table.values[cur[2]]
                    return table.sparse_read(ids)
        return original(x, indices, axis=axis)
    return take


_symbolic = threading.local()


def in_keras_symbolic_build() -> bool:
    """Whether Keras's ``_maybe_symbolic_build`` is running in this thread (it reduces the first
    distributed batch with ``strategy.reduce("MEAN", axis=None)`` only to learn its shapes).

    Where the ``symbolic_build`` hook is off (a Keras without the names it needs), Keras's own
    build runs unhooked: then the caller is found on the stack instead, the first frame outside
    tfdp and TensorFlow being Keras's TensorFlow trainer (the only Keras code that reduces with
    ``axis=None``)."""
    if getattr(_symbolic, "depth", 0) > 0:
        return True
    if tfp_names.available("symbolic_build"):
        return False
    return tfp.called_from_keras_tf_backend()


def _symbolic_build(original):
    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = getattr(self, "_distribute_strategy", None)
        if (iterator is not None and data_batch is None
                and is_tfdp(getattr(strategy, "extended", None))):
            # Build from the element spec: no batch is taken (a one-shot generator would lose
            # what Keras's throw-away iterator read ahead) and no uneven batch is reduced.
            spec = tfp.keras_epoch_iterator_element_spec(iterator)
            if spec is not None:
                return original(self, data_batch=spec)
        _symbolic.depth = getattr(_symbolic, "depth", 0) + 1
        try:
            return original(self, iterator=iterator, data_batch=data_batch)
        finally:
            _symbolic.depth -= 1
    return maybe_symbolic_build


class _ReplicaXlaStep:
    """Keras's step with ``jit_compile=True`` on several CPU replicas: XLA compiles each
    replica's step on its own device (one compiled function per replica), while the gradient
    all-reduce and the optimizer update, which XLA cannot compile for CPU devices, run after the
    compiled part in the replica's context. Only for steps in which nothing after
    ``optimizer.apply`` depends on the update: Keras's own ``train_step`` (its metrics use the
    predictions made before the update), and test / predict steps."""

    def __init__(self, step_function):
        self.step_function = step_function
        self.compiled = {}  # local replica id -> tf.function(jit_compile=True)
        self.applies = {}   # local replica id -> [(optimizer, n_grads, variables)]

    def __call__(self, data):
        _, step, replica = _current()
        fn = self.compiled.get(replica)
        if fn is None:
            fn = self.compiled[replica] = tf.function(
                lambda d, r=replica: self._compiled_body(d, r), jit_compile=True,
                reduce_retracing=True)
        step.xla_refusal = None
        try:
            logs, grads = fn(data)
        except Exception:
            refusal = step.xla_refusal
            if refusal is not None:  # (autograph wrapped it in StagingError and annotated it)
                raise type(refusal)(*refusal.args) from None
            raise
        i = 0
        for optimizer, n, variables in self.applies[replica]:
            optimizer.apply(grads[i:i + n], variables)
            i += n
        return self._reported(logs)

    def _reported(self, logs):
        """Keras's own train / test step returns ``get_metrics_result()``, read locally inside
        the compiled part: read again here, where the collective can run, so every replica
        returns the job's values (``tfdp.keras.reported``)."""
        import keras
        step = getattr(self.step_function, "__wrapped__", None)
        if getattr(step, "__func__", None) in (tfp.keras_builtin_train_step(),
                                               keras.Model.test_step):
            return step.__self__.get_metrics_result()
        return logs

    def _compiled_body(self, data, replica):
        step = _current()[1]
        step.deferred[replica] = deferred = []
        try:
            logs = self.step_function(data)
        finally:
            del step.deferred[replica]
        self.applies[replica] = [(o, len(g), v) for o, g, v in deferred]
        return logs, [g for _, grads, _ in deferred for g in grads]


def _make_function(original):
    def make_function(self, step_function):
        strategy = self.distribute_strategy
        extended = getattr(strategy, "extended", None)
        if not is_tfdp(extended):
            return original(self, step_function)
        if not (self.jit_compile and not extended.whole_step_xla_possible()):
            return original(self, losses.keras_step(step_function))
        if (step_function == self.train_step
                and getattr(step_function, "__func__", None) is not tfp.keras_builtin_train_step()):
            extended.refuse_xla("a custom train_step (tfdp compiles each replica's step with "
                                "its optimizer updates outside XLA, which only Keras's own "
                                "train_step allows)")
        if step_function == self.train_step:
            extended.refuse_micro_batches_in_xla()
        self.jit_compile = False  # the outer step is not compiled: each replica's is
        try:
            return original(self, _ReplicaXlaStep(losses.keras_step(step_function)))
        finally:
            self.jit_compile = True
    return make_function


def _predict_on_batch(original):
    """``model.predict_on_batch(x)``: Keras runs its predict step with ``x`` itself as every
    replica's input and concatenates the replicas' outputs (N copies of the rows under any
    tf.distribute strategy). Under a tfdp strategy of several replicas the batch goes through
    ``predict`` instead, as one batch: split across the replicas like any other, one device's
    rows in one device's order."""
    def predict_on_batch(self, x):
        strategy = getattr(self, "distribute_strategy", None)
        extended = getattr(strategy, "extended", None)
        if not is_tfdp(extended) or strategy.num_replicas_in_sync == 1:
            return original(self, x)
        rows = [len(v) for v in tf.nest.flatten(x) if hasattr(v, "shape") and len(v.shape)]
        if not rows or not rows[0]:
            return original(self, x)
        return self.predict(x, batch_size=rows[0], verbose=0)
    return predict_on_batch


_HOOKS = {
    **losses.HOOKS,  # what a replica's loss is worth (tfdp.keras.losses)
    **reported.HOOKS,  # the metric values a step reports (tfdp.keras.reported)
    "predict_on_batch": _predict_on_batch,
    "apply": _apply,
    "loss_scale_apply": _apply,
    "clip_gradients": _clip_gradients,
    "all_reduce_sum_gradients": _all_reduce_sum_gradients,
    "make_function": _make_function,
}
_SYMBOLIC_BUILD_HOOKS = {"symbolic_build": _symbolic_build}  # (keras_symbolic_build_points)
_PERF_HOOKS = {"take": _take, "sgd_build": _sgd_build}  # (compat.keras_perf_hook_points)
_installed = False
_install_lock = threading.Lock()


def check_keras() -> None:
    """Refuse a Keras whose metric variables are sync-on-write (one clear error)."""
    if not tfp.keras_metric_variables_sync_on_read():
        import keras
        from tfdp.errors import TfdpError, message
        raise TfdpError(message(
            "This Keras creates metric variables sync-on-write (Keras before 3.10), "
            "which tfdp does not support: metrics and losses would differ from one device",
            f"keras=={keras.__version__}",
            'Install a supported Keras: pip install "keras>=3.12,<3.17".'))


def install() -> None:
    """Put the gradient path's hooks into Keras (idempotent). Called by the adapter
    (``tfdp.keras.adapter``, set ``gradient_path``) when the first tfdp strategy is created."""
    global _installed
    with _install_lock:
        if not _installed:
            check_keras()
            tfp.wrap(tfp.keras_hook_points(), _HOOKS)
            _installed = True


def remove() -> None:
    """Take the gradient path's hooks out of Keras (Keras's own functions back exactly). Called
    by the adapter when the last tfdp strategy is gone."""
    global _installed
    with _install_lock:
        tfp.unwrap(tfp.keras_hook_points(), list(_HOOKS))
        _installed = False


adapter.provide("gradient_path", _HOOKS, install=install, remove=remove)
adapter.provide("symbolic_build", _SYMBOLIC_BUILD_HOOKS)
adapter.provide("perf", _PERF_HOOKS)

__all__ = ["StepContext", "install", "remove", "running", "reduce_gradients",
           "in_keras_symbolic_build", "accumulation_steps", "linear_in_gradient",
           "check_keras"]
