"""The extended both tfdp strategies share (``DataParallelExtendedBase``): the Keras step path.

Everything a strategy does *inside* a step lives here, once, for the local and the multi-worker
strategy alike:

* ``all_reduce_gradients``: the one gradient reduction the gradient path
  (``tfdp.keras.gradient_path``) calls when an optimizer applies: one batched merge_call through
  tfdp's reducer, or replica-context collectives inside Keras's accumulation branch.
* ``_call_for_each_replica``: each ``strategy.run`` gets a ``StepContext`` with every
  replica's share of the global batch (``n_r / sum(n)``), empty replicas padded with one example
  of share 0 (``empty_replicas``), and after a training step the BatchNorm statistics averaged
  (mirrored stays mirrored).
* XLA: which steps can be compiled whole (GPUs, one replica) and the one error for the others.
* Input: datasets are wrapped so tfdp never writes into the user's numpy arrays.
"""

from __future__ import annotations

import inspect
import weakref

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp.keras import adapter, gradient_path
from tfdp.reduce import registry
from tfdp.reduce.options import ReduceOptions
from tfdp.strategy import empty_replicas, micro_batches
from tfdp.strategy.setup_order import step_model


class DataParallelExtendedBase:
    """tfdp's part of both strategies' extended: the Keras train-step path, replica shares,
    empty replicas, layer-state sync, replica-context collectives and input wrapping.

    A mixin placed before TF's extended in the method resolution order: the local strategy's
    ``LocalExtended(DataParallelExtendedBase, MirroredExtended)`` and the multi-worker
    ``MultiWorkerExtended(DataParallelExtendedBase, CollectiveAllReduceExtended)``. This
    ``__init__`` is the only one: it sets tfdp's state, then calls the subclass's
    ``_init_tf_extended``, which runs TF's own ``__init__`` and returns tfdp's cross-device ops.
    What differs between the two is ``_num_workers_in_job`` and ``_total_examples`` (a
    cross-worker count).
    """

    def __init__(self, container_strategy, settings, devices, cluster):
        self.tfdp_settings = settings          # a tfdp.strategy.settings.Settings
        self._tfdp_requested_devices = devices  # the user's device list (None: the default)
        self.tfdp_context = None  # the StepContext of the strategy.run being traced (keras.step)
        self._tfdp_state_vars = []  # weakrefs: float, non-trainable, aggregation NONE
        self._tfdp_on_read_vars = []  # weakrefs: ON_READ (Keras metrics, loss trackers)
        self._tfdp_optimizers = weakref.WeakSet()  # optimizers that applied in a step
        self.tfdp_choice = None  # the algorithm chosen (tfdp.reduce.registry.Choice)
        self._micro_policy = None  # a micro_batches.Policy while a step that may split is traced
        self._tfdp_reduce = self._init_tf_extended(container_strategy, cluster)
        # tfdp's hooks in Keras while this strategy lives (tfdp.keras.adapter)
        adapter.use(container_strategy, *adapter.STRATEGY_SETS)
        # the replica-context collectives now, outside any strategy scope (they make variables)
        self._tfdp_reduce.prepare_replica_context()

    def _init_tf_extended(self, container_strategy, cluster):
        """Run TF's extended ``__init__``; set ``tfdp_choice``; return tfdp's reducer
        (``tfdp.reduce.Reducer``)."""
        raise NotImplementedError

    def _choose(self, devices):
        self.tfdp_choice = registry.choose(
            self.tfdp_settings.all_reduce, list(devices),
            physical_gpus=len(tf.config.list_physical_devices("GPU")),
            nccl_kernel=tfp.nccl_kernel_registered())
        return self.tfdp_choice

    @property
    def tfdp_reduce(self):
        """tfdp's reducer for this strategy (``tfdp.reduce.Reducer``)."""
        return self._tfdp_reduce

    def all_reduce_values(self, reduce_op, values):
        """``values`` (a list of tensors) reduced over every replica of the job, from a replica
        context, with no gradient: TF's ``ReplicaContext.all_reduce`` wraps its reduction in a
        ``tf.custom_gradient`` whose gradient function (TF keeps it for the rest of the
        process) holds the replica context, and with it the strategy and its hooks."""
        return self._replica_ctx_all_reduce(reduce_op, list(values))

    def all_reduce_gradients(self, grads, densify_ok=False):
        """SUM of every replica's ``grads`` (a flat list), called from a replica context by the
        gradient path (``tfdp.keras.gradient_path``); an empty replica's gradients count as zero.

        One batched reduction through tfdp's reducer (``merge_call``), or, inside Keras's
        gradient-accumulation branch, replica-context collectives (the reducer's
        ``_all_reduce``). ``densify_ok``: every sparse gradient's consumer is linear in it.
        """
        step = self.tfdp_context
        masks = None if step is None else step.masks
        if self._replica_collectives_only() and not tf.executing_eagerly():
            # (accumulated gradients: the gradient path zeroed empty micro-batches on entry)
            return self._tfdp_reduce._all_reduce(  # pylint: disable=protected-access
                tf.distribute.ReduceOp.SUM, list(grads), tfp.current_replica_id(), None)
        if not self._use_merge_call():  # XLA on GPUs: TF's replica-context collectives
            if masks is not None:
                grads = gradient_path.zero_if_empty(grads, masks[tfp.current_replica_id()])
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, grads)

        def merge(strategy, *values):
            ops = strategy.extended._tfdp_reduce
            values = [v if tfp.is_distributed_values(v) else tfp.PerReplica((v,))
                      for v in values]
            options = ReduceOptions(weights=masks, densify_ok=densify_ok)
            zero = strategy.extended.tfdp_zero
            if zero is not None and zero.stage == 2:  # each gradient onto its owner only
                return zero.reduce_gradients(values, options)
            return ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(v, v) for v in values],
                                    options)

        return tf.distribute.get_replica_context().merge_call(merge, args=tuple(grads))

    # --- one strategy.run: replica shares for Keras's losses, then layer-state sync ----------

    def _call_for_each_replica(self, fn, args, kwargs):
        if self.tfdp_context is not None:
            # nested: a merge_call's call_for_each_replica (e.g. LossScaleOptimizer's)
            return self._run_replicas(fn, args, kwargs)
        replicas = len(self.worker_devices) * self._num_workers_in_job()
        if replicas > 1 and not tf.executing_eagerly() and tfp.in_xla_context():
            self._check_xla_possible()
        k = self._micro_batches(fn)
        if k > 1:
            sizes, total = self._replica_sizes(args)
            if sizes is not None:
                return self._run_micro_batches(fn, args, kwargs, k, replicas, sizes, total)
        # (one replica: Keras's 1/1 is exact and there is no copy to sync)
        shares = self._replica_shares(args) if replicas > 1 else None
        own = _model_variable_ids(fn) if replicas > 1 else None  # (None: every variable)
        result, step = self._run_step(fn, args, kwargs, shares, own)
        self._after_step(step, shares, replicas, own)
        return result

    def _run_step(self, fn, args, kwargs, shares, own, micro=None):
        """One run of the replicas' ``fn`` in a new ``StepContext`` with ``shares``: empty
        replicas padded, their metric updates undone and their outputs trimmed."""
        step = gradient_path.StepContext(shares)
        step.micro = micro
        step.micro_policy = self._micro_policy
        if shares is not None and not tf.executing_eagerly():  # (see empty_replicas.py)
            padding = empty_replicas.Padding(step.live, self.worker_devices)
            args, step.padded = padding.pad(args)
            if step.padded:
                saved = empty_replicas.read_on_read_state(self._tfdp_on_read_vars, own)
                step.on_read_before = {id(v): vals for v, vals in saved}
        with gradient_path.running(self, step):
            result = self._run_replicas(fn, args, kwargs)
        if step.padded:
            empty_replicas.restore_on_read_state(saved, step.live)
            result = padding.trim(result)
        return result, step

    def _after_step(self, step, shares, replicas, own):
        if step.optimizers and replicas > 1:  # a training step: keep BN statistics mirrored
            self._tfdp_optimizers.update(step.optimizers)
            self._sync_layer_state(shares, replicas, own)
        if step.optimizers and self.tfdp_settings.zero_stage:
            self.tfdp_zero.show_effect_once()   # sharded state: its effect, once, at the first
                                                # training step (the optimizers have built)

    # --- micro-batches (tfdp.strategy.micro_batches) -----------------------------------------

    @property
    def tfdp_micro_batches(self) -> int:
        """Micro-batches per replica in a training step (1: none; ``micro_batches``)."""
        return self.tfdp_settings.micro_batches_for(self._num_workers_in_job())

    def _micro_batches_asked(self) -> bool:
        """Whether micro-batches are asked for (k > 1 now, or the elastic policy
        "accumulate", also at the full size where k is 1): then what cannot be split is
        refused."""
        return (self.tfdp_micro_batches > 1
                or self.tfdp_settings.elastic_policy == "accumulate")

    def refuse_micro_batches_in_xla(self):
        """tfdp's per-replica XLA training step (``gradient_path``) cannot be split: refused
        while micro-batches are asked for."""
        if self._micro_batches_asked():
            micro_batches.Policy(self.tfdp_settings, self.tfdp_micro_batches).refuse_xla()

    def _micro_batches(self, fn) -> int:
        """k for this ``strategy.run``: > 1 only for a model's Keras ``train_step``, after
        ``micro_batches.Policy.check_step``. ``_micro_policy`` is set while micro-batches are
        asked for (the loss module refuses what cannot be split)."""
        self._micro_policy = None
        if not self._micro_batches_asked():
            return 1
        model = step_model(fn)
        if model is None or getattr(inspect.unwrap(fn), "__name__", "") != "train_step":
            return 1   # evaluation, prediction, a custom loop's function: not split
        k = self.tfdp_micro_batches
        policy = micro_batches.Policy(self.tfdp_settings, k)
        policy.check_step(model, tfp.keras_builtin_train_step())
        self._micro_policy = policy
        return k

    def _run_micro_batches(self, fn, args, kwargs, k, replicas, sizes, total):
        """One training step as ``k`` runs of ``fn``, one per micro-batch (see
        ``tfdp.strategy.micro_batches``): shares of the whole global batch (``sizes`` of the
        local replicas, ``total`` of the job), the gradients held by the ``Accumulator`` until
        the last micro-batch applies their sum."""
        devices = self.worker_devices
        own = _model_variable_ids(fn)
        acc = micro_batches.Accumulator(k, len(devices))
        result = step = None
        for c in range(k):
            acc.index = c
            chunk = micro_batches.split(args, devices, k, c, after=acc.waits())
            shares = []
            for n, d in zip(sizes, devices):
                with tf.device(d):
                    lo, hi = micro_batches.bounds(tf.cast(n, tf.int32), k, c)
                    shares.append(tf.math.divide_no_nan(tf.cast(hi - lo, tf.float32), total))
            result, step = self._run_step(fn, chunk, kwargs, shares, own, micro=acc)
        whole = [tf.math.divide_no_nan(n, total) for n in sizes]
        self._after_step(step, whole, replicas, own)
        return result

    def whole_step_xla_possible(self) -> bool:
        """Whether XLA can compile a whole step with its collectives: one replica, or GPUs."""
        replicas = len(self.worker_devices) * self._num_workers_in_job()
        return replicas == 1 or all(devices_lib.is_gpu(d) for d in self.worker_devices)

    def refuse_xla(self, what):
        from tfdp.errors import TfdpError, message
        devices = [devices_lib.short_name(d) for d in self.worker_devices]
        error = TfdpError(message(
            f"jit_compile=True cannot run here: XLA cannot compile collective ops for CPU "
            f"devices (TensorFlow: 'Collectives are not yet implemented for CPU devices when "
            f"compiling with XLA'), and {what} needs one inside the compiled step",
            f"jit_compile=True with {len(devices) * self._num_workers_in_job()} replicas on "
            f"{devices}",
            "Fix: compile with jit_compile=False, or leave Keras's default jit_compile='auto' "
            "(it resolves to False here); with Keras's own train_step, plain BatchNorm and no "
            "wrapping tf.function, tfdp compiles each replica's step."))
        if self.tfdp_context is not None:  # (autograph wraps it; the XLA step raises it as is)
            self.tfdp_context.xla_refusal = error
        raise error

    def _refuse_all_reduce_in_xla(self):
        if self.tfdp_context is not None and self.tfdp_context.deferred:
            self.refuse_xla("a replica-context all-reduce in the step (e.g. "
                            "BatchNormalization(synchronized=True))")

    def _check_xla_possible(self):
        """A whole strategy.run inside one XLA function: possible on GPUs only."""
        if not self.whole_step_xla_possible():
            self.refuse_xla("a tf.function(jit_compile=True) around strategy.run (tfdp "
                            "compiles each replica's step only for Keras's compile(jit_compile="
                            "True))")

    def _run_replicas(self, fn, args, kwargs):
        return tfp.MirroredExtended._call_for_each_replica(self, fn, args, kwargs)  # TF's

    def _num_workers_in_job(self) -> int:
        raise NotImplementedError

    def _replica_shares(self, args):
        """n_r / sum(n): replica r's share of the global batch (its first batched input; the
        sum over every replica of the job, ``_total_examples``)."""
        sizes, total = self._replica_sizes(args)
        if sizes is None:
            return None
        return [tf.math.divide_no_nan(s, total) for s in sizes]

    def _replica_sizes(self, args):
        """Each local replica's examples (float32 scalars, of its first batched input) and the
        job's total, or (None, None) when no input is batched."""
        for leaf in tf.nest.flatten(args):
            comps = empty_replicas.components(leaf, self.worker_devices, dynamic_only=False)
            if comps is None:
                continue
            sizes = []
            for c, d in zip(comps, self.worker_devices):
                with tf.device(d):
                    sizes.append(tf.cast(tf.shape(c)[0], tf.float32))
            return sizes, self._total_examples(tf.math.add_n(sizes))
        return None, None

    def _total_examples(self, local_total):
        return local_total

    # --- replica-context collectives (gradient accumulation) ---------------------------------

    def _replica_collectives_only(self) -> bool:
        """Inside Keras's accumulation branch (a tf.cond, where merge_call is refused: the
        step's ``replica_collectives()``): reduce from the replica contexts."""
        return self.tfdp_context is not None and self.tfdp_context.no_merge > 0

    def _use_merge_call(self):
        step = self.tfdp_context
        if step is not None and (step.no_merge or tfp.current_replica_id() in step.deferred):
            return False  # (inside an XLA-compiled replica step: no merge_call can run there)
        if self._num_workers_in_job() > 1:
            return True  # across workers tfdp's reduction always sees all local values at once
        return super()._use_merge_call()

    def _get_cross_device_ops(self, value):
        if self._replica_collectives_only():  # (MirroredExtended would switch to its XLA ones)
            return self._tfdp_reduce
        return super()._get_cross_device_ops(value)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # TF's template (MirroredExtended's, also for the multi-worker extended, a subclass):
        # merge_call while _use_merge_call(), else the reducer's _all_reduce from each replica.
        self._refuse_all_reduce_in_xla()
        return tfp.MirroredExtended._replica_ctx_all_reduce(self, reduce_op, value, options)

    # --- sharded optimizer state (zero_stage, tfdp.zero) --------------------------------------

    @property
    def tfdp_zero(self):
        """The ``tfdp.zero.state.ZeroState`` of a strategy with zero_stage 1 or 2, else None."""
        stage = self.tfdp_settings.zero_stage
        if not stage:
            return None
        zero = self.__dict__.get("_tfdp_zero_state")
        if zero is None:
            from tfdp.zero import hooks
            from tfdp.zero.state import ZeroState
            hooks.install(self._container_strategy())
            zero = self.__dict__["_tfdp_zero_state"] = ZeroState(self, stage)
        return zero

    def _update(self, var, fn, args, kwargs, group):
        zero = self.tfdp_zero
        if zero is None or not zero.handles(var):
            return super()._update(var, fn, args, kwargs, group)
        return zero.update(var, fn, args, kwargs, group)

    def _replica_ctx_update(self, var, fn, args=(), kwargs=None, group=True):
        zero = self.tfdp_zero
        if zero is None or not zero.handles(var) or self._use_merge_call():
            return super()._replica_ctx_update(var, fn, args, kwargs, group)
        return zero.replica_update(var, fn, args, kwargs or {})

    # --- mirrored means mirrored: layer state ------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        zero = self.tfdp_zero
        if zero is not None:
            slot = zero.create_slot(next_creator, kwargs)  # one copy, on its owner's device
            if slot is not None:
                return slot
        v = super()._create_variable(next_creator, **kwargs)
        if (tfp.is_distributed_values(v) and v.dtype.is_floating and not v.trainable
                and v.aggregation == tf.VariableAggregation.NONE):
            self._tfdp_state_vars.append(weakref.ref(v))
        if (tfp.is_distributed_values(v)
                and v.synchronization == tf.VariableSynchronization.ON_READ):
            self._tfdp_on_read_vars.append(weakref.ref(v))
        return v

    def _sync_layer_state(self, shares, replicas, only=None):
        """Average float non-trainable variables with aggregation NONE across replicas.

        Such variables (BatchNorm moving statistics) are updated by each replica with its own
        batch statistics, so MirroredStrategy lets their copies drift apart. After every
        training step (a step in which an optimizer applied gradients) tfdp replaces every copy
        by the batch-share-weighted mean of the copies (for a moving mean that is exactly the
        update with the global batch mean). Optimizer variables are left alone (every replica
        updates them identically). Ordered after the step's updates by TF's automatic control
        dependencies on the same resources. ``only``: the ids of the variables to consider (the
        stepped model's, ``_model_variable_ids``; None: every one made under the strategy).
        """
        skip = set()
        for opt in self._tfdp_optimizers:
            for o in (opt, getattr(opt, "inner_optimizer", None)):
                for v in getattr(o, "variables", None) or ():
                    skip.add(id(getattr(v, "value", v)))
        alive = [r() for r in self._tfdp_state_vars]
        self._tfdp_state_vars = [r for r, v in zip(self._tfdp_state_vars, alive) if v is not None]
        targets = [v for v in alive if v is not None and id(v) not in skip
                   and (only is None or id(v) in only)]
        if not targets:
            return
        pairs = []
        for tv in targets:
            comps = []
            for c in tv.values:
                with tf.device(c.device):
                    comps.append(c.read_value())
            pairs.append((tfp.PerReplica(tuple(comps)), tv))
        weights = None if shares is None else [s * float(replicas) for s in shares]
        means = self._tfdp_reduce.batch_reduce(tf.distribute.ReduceOp.MEAN, pairs,
                                               ReduceOptions(weights=weights))
        for tv, mean in zip(targets, means):
            for c, m in zip(tv.values,
                            self._container_strategy().experimental_local_results(mean)):
                with tf.device(c.device):
                    c.assign(m)

    # --- input: never write into the user's numpy arrays -------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        if (options is None and len(self.worker_devices) == 1
                and self._num_workers_in_job() == 1):
            # One replica: iterate the dataset as Keras does without a strategy (a
            # MultiDeviceIterator cost 5% of an MLP step, tfdp bench overhead); there is no
            # rebatch, so no slice of the user's memory either.
            return OneReplicaDataset(dataset)
        # A Python-function source (Keras's PyDataset / generator adapters) hands numpy memory
        # to TF zero-copy, and the per-replica rebatch makes it writable (tfdp.data._no_alias).
        # Every iter() (each epoch of fit) gets a cheaper MultiDeviceIterator (data._iterators)
        from tfdp.data._iterators import fast_iterators
        from tfdp.data._no_alias import no_numpy_alias
        return fast_iterators(
            super()._experimental_distribute_dataset(no_numpy_alias(dataset), options))

    # --- destinations ------------------------------------------------------------------------

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
        step = self.tfdp_context
        if (step is not None and step.padded and step.masks is not None
                and not step.whole_state and tf.distribute.ReduceOp(str(getattr(reduce_op, "value", reduce_op)).upper())
                == tf.distribute.ReduceOp.SUM):
            # a replica-context all-reduce (SyncBatchNorm's sums and counts) in a step with a
            # padded replica: that replica adds nothing
            pairs = [(v if tfp.is_distributed_values(v) else tfp.PerReplica((v,)), d)
                     for v, d in value_destination_pairs]
            return self._tfdp_reduce.batch_reduce(reduce_op, pairs,
                                                  ReduceOptions(weights=step.masks))
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)


def _model_variable_ids(fn):
    """The ids of the TF variables of the Keras model whose step ``fn`` is (its bound
    ``train_step`` / ``test_step`` / ``predict_step``, as Keras passes it to ``strategy.run``,
    maybe wrapped), or None when ``fn`` is not a model's step (a custom loop's function).

    A step's padded-replica restore and layer-state sync touch these only. The strategy's
    registries hold the variables of every model made under it, and a step that read another
    model's variables would keep them in its function: TF holds only weak references, so once
    that model is collected (even while the new step is being traced) the function fails with
    "Called a function referencing variables which have been deleted"."""
    model = step_model(fn)
    if model is None:
        return None
    return {id(getattr(v, "value", v))
            for v in list(model.variables) + list(model.metrics_variables)}


class OneReplicaDataset(tf.distribute.DistributedDataset):
    """``experimental_distribute_dataset`` of a strategy with one replica in one process: the
    dataset itself, iterated directly (what Keras iterates without a strategy), behind the
    ``tf.distribute.DistributedDataset`` interface that Keras and custom loops check for."""

    def __init__(self, dataset):
        self._original_dataset = dataset  # (tfdp.compat.distributed_dataset_source reads it)

    def __iter__(self):
        return iter(self._original_dataset)

    @property
    def element_spec(self):
        return self._original_dataset.element_spec

    def reduce(self, initial_state, reduce_func):
        return self._original_dataset.reduce(initial_state, reduce_func)

    def __repr__(self):
        return f"OneReplicaDataset({self._original_dataset!r})"


__all__ = ["DataParallelExtendedBase", "OneReplicaDataset"]
