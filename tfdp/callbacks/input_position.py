"""The input position of a plain ``model.fit``, and putting it back after a restart.

``model.fit(data, epochs=E, callbacks=[tfdp.callbacks.BackupAndRestore(dir, save_freq=N)])``
resumes at the exact step because tfdp sees where fit's input stands. Keras's TF trainer makes
one epoch iterator per ``fit`` (``TFEpochIterator``: the data distributed once by the strategy),
and calls ``iter()`` on the distributed data at the top of every epoch (and once more after the
last step of a dataset of known length). Two counts give the position:

* ``created``: iterators made so far over the data. A ``Dataset.shuffle(seed=s)`` reshuffles
  on every new iterator from a seed generator owned by the dataset, so epoch e's order is the
  e-th draw; the replay makes (and drops) as many iterators as the interrupted run had made.
* ``consumed``: batches read from the latest iterator; the replay reads them again (input only,
  no training step) before fit's next step.

tf.distribute's distributed iterators cannot be checkpointed (TF 2.21: ``tf.train.Checkpoint``
refuses a ``DistributedIterator``), so the position is replayed, which is exact whenever the data
is a function of the program: arrays (Keras shuffles them with ``tf.random.shuffle`` seeded by
the global seed: ``keras.utils.set_random_seed``), any deterministic ``tf.data`` pipeline,
seeded shuffles included. What cannot be replayed exactly (an unseeded shuffle, numpy input
shuffled without a global seed, Python generators and ``PyDataset``, whose batches tfdp cannot
check) is named in one warning at restore time. Every worker replays its own part: positions
are global (the same step on every worker).

The resumed epoch is shortened to its remaining steps through the epoch iterator's own
counters (Keras's batch indices in that epoch then start at 0; ``BackupAndRestore`` adds the
offset). The Keras internals involved are listed in ``tfdp/compat/``.

The two epoch-iterator hooks are the adapter's ``input_position`` set (``tfdp.keras.adapter``):
in Keras while a ``tfdp.callbacks.BackupAndRestore`` lives (``install(callback)``, from its
``__init__``: fit makes its epoch iterator before any callback runs), out once the last is gone.
"""

from __future__ import annotations

import logging
import threading
import weakref

from tfdp import compat
from tfdp.keras import adapter

log = logging.getLogger("tfdp")

_local = threading.local()
_UNSET = object()


class InputTracker:
    """The position of one ``fit``'s input (attached to its Keras epoch iterator)."""

    def __init__(self, epoch_iterator, global_seed, input_kind="dataset", shuffles=False):
        self._epoch_iterator = weakref.ref(epoch_iterator)
        self.global_seed = global_seed   # the global seed when fit made its input (None: unset)
        self.input_kind = input_kind     # what fit reads (compat.keras_input_kind)
        self.shuffles = shuffles         # fit shuffles array input (compat.keras_input_shuffles)
        self.created = 0                 # iterators made over the data (replayed ones included)
        self.consumed = 0                # batches read from the latest iterator
        self.pending = None              # (iterator index, batches to skip, steps done in epoch)
        self.replayed = None             # what the last replay did (a dict; None: none yet)
        self._restore_num_batches = _UNSET
        self._reuse = None               # the iterator to hand out again (steps_per_epoch case)

    @property
    def epoch_iterator(self):
        """A ``compat.KerasEpochIterator`` view of fit's epoch iterator (None once it is gone)."""
        ei = self._epoch_iterator()
        return None if ei is None else compat.KerasEpochIterator(ei)

    # --- what BackupAndRestore records -----------------------------------------------------

    def count_steps(self, steps: int) -> None:
        self.consumed += steps

    def next_read(self, epoch_done: bool, after_loop: bool = False) -> dict:
        """Where fit reads its next batch: ``{"iterator": index, "consumed": batches}``.

        ``epoch_done``: the step just counted ended the epoch; ``after_loop``: called from
        ``on_epoch_end`` (Keras's end-of-data iterator, if any, is already made)."""
        ei = self.epoch_iterator
        index, consumed = self.created - 1, self.consumed
        if epoch_done and ei is not None:
            if (not after_loop and self._reuse is None and ei.num_batches
                    and ei.steps_seen >= ei.num_batches):
                index, consumed = index + 1, 0   # Keras makes one after the data's last step
            if ei.steps_per_epoch is None:
                index, consumed = index + 1, 0   # and one at the top of every epoch
        return {"iterator": max(0, index), "consumed": consumed}

    # --- what fit's epoch iterator calls ---------------------------------------------------

    def make_iterator(self, source):
        ei = self.epoch_iterator
        if self._restore_num_batches is not _UNSET:   # the resumed epoch is over
            ei.num_batches = self._restore_num_batches
            self._restore_num_batches = _UNSET
            ei.silence_interrupted_warning(False)
        if self._reuse is not None:  # the shortened epoch ended: fit goes on with the same one
            it, self._reuse = self._reuse, None
            return it
        pending, self.pending = self.pending, None
        if pending is None:
            it = iter(source)
            self.created += 1
            self.consumed = 0
            return it
        index, skip, step_in_epoch = pending
        replay = needs_iterator_replay(compat.distributed_dataset_source(source))
        dropped = 0
        while self.created < index:
            if replay:
                iter(source)   # advances the dataset's seed generators as the first run did
                dropped += 1
            self.created += 1
        it = iter(source)
        self.created += 1
        read = 0
        try:
            for _ in range(skip):
                next(it)
                read += 1
        except (StopIteration, EOFError, compat.tf.errors.OutOfRangeError):
            log.warning("tfdp BackupAndRestore: the input ended after %d of the %d batches the "
                        "interrupted run had read; the resumed run is not exact (does the "
                        "data differ from the first run's?)", read, skip)
        self.consumed = read
        self.replayed = {"iterators_dropped": dropped, "batches_skipped": read}
        if step_in_epoch:
            self._shorten_epoch(ei, step_in_epoch, it)
        return it

    def _shorten_epoch(self, ei, step_in_epoch, it):
        """Let the resumed epoch run only its remaining steps (Keras counts from 0)."""
        if ei.steps_per_epoch is None:
            if ei.num_batches:
                self._restore_num_batches = ei.num_batches
                ei.num_batches = max(1, ei.num_batches - step_in_epoch)
            return  # unknown length: the data ends the epoch
        # steps_per_epoch over endless data: stop after the remaining steps, quietly, and hand
        # the same iterator out again when Keras asks for a fresh one at the end of the loop
        self._restore_num_batches = ei.num_batches
        ei.num_batches = max(1, ei.steps_per_epoch - step_in_epoch)
        ei.silence_interrupted_warning(True)
        self._reuse = it


class _Positioned:
    """What fit's epoch iterator iterates over: the distributed data, through the tracker."""

    def __init__(self, tracker, source):
        self._tracker, self._source = tracker, source

    def __iter__(self):
        return self._tracker.make_iterator(self._source)


# --- what cannot be replayed exactly ------------------------------------------------------------

_PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _walk(dataset):
    """Every dataset upstream of ``dataset`` (itself included); raises if the walk fails."""
    seen, stack, out = set(), [dataset], []
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        out.append(ds)
        stack.extend(compat.dataset_inputs(ds))
    return out


def _function_ops(dataset) -> set:
    ops = set()
    for wrapper in compat.dataset_functions(dataset):
        fn = getattr(wrapper, "function", wrapper)
        graph_def = fn.graph.as_graph_def()
        ops.update(n.op for n in graph_def.node)
        for f in graph_def.library.function:
            ops.update(n.op for n in f.node_def)
    return ops


def needs_iterator_replay(dataset) -> bool:
    """Whether a new iterator over ``dataset`` draws from a seed generator (a reshuffling
    ``shuffle``, ``Dataset.random``): only then are the first run's iterators made again.
    Unknown means True."""
    if dataset is None:
        return True
    try:
        for ds in _walk(dataset):
            seeds = compat.shuffle_dataset_seeds(ds)
            if (seeds is not None and seeds[2]) or type(ds).__name__ == "_RandomDataset":
                return True
        return False
    except Exception:  # noqa: BLE001 - a private-structure walk: unknown means "replay"
        return True


def not_exact_reasons(tracker) -> list[str]:
    """Why this fit's input cannot be put back exactly (empty: it can)."""
    ei = tracker.epoch_iterator
    if ei is None:
        return ["the input is gone"]
    reasons = []
    if tracker.shuffles and tracker.global_seed is None:
        reasons.append("numpy input shuffled (fit's default shuffle=True) without a global "
                       "seed draws a new order in every run: call keras.utils.set_random_seed(s)"
                       " at the start of the script, or pass shuffle=False")
    kind = tracker.input_kind if tracker.input_kind in ("generator", "PyDataset") else None
    if kind is not None:
        reasons.append(f"a {kind} is replayed by drawing the consumed batches again, which is "
                       "exact only if it yields the same batches in the same order after a "
                       "restart (tfdp cannot check this)")
    if ei.steps_per_epoch is not None and ei.num_batches:
        reasons.append("steps_per_epoch over data of known length is not positioned (the "
                       "epoch's data restarts from its beginning): repeat the data "
                       "(dataset.repeat()) or leave steps_per_epoch out")
    if kind is None:
        dataset = compat.distributed_dataset_source(ei.distributed_dataset)
        try:
            nodes = _walk(dataset) if dataset is not None else []
            for ds in nodes:
                seeds = compat.shuffle_dataset_seeds(ds)
                if seeds is not None and seeds[0] is None:
                    reasons.append("the dataset has an unseeded shuffle (a new order in every "
                                   "run): pass shuffle(..., seed=s) or set a global seed")
                    break
            if any(_function_ops(ds) & _PY_FUNC_OPS for ds in nodes):
                reasons.append("the dataset runs Python (from_generator, py_function, "
                               "numpy_function): exact only if it yields the same elements "
                               "after a restart")
        except Exception:  # noqa: BLE001
            reasons.append("the dataset's structure could not be inspected")
    return reasons


def positionable(tracker) -> bool:
    """Whether the input can be positioned at all (else the epoch's data restarts)."""
    ei = tracker.epoch_iterator
    return ei is not None and not (ei.steps_per_epoch is not None and ei.num_batches)


# --- hooks ----------------------------------------------------------------------------------------

def _init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if compat.keras_is_fit_epoch_iterator(kwargs):
            self._tfdp_input = InputTracker(
                self, compat.tf_global_seed(), compat.keras_input_kind(kwargs),
                compat.keras_input_shuffles(kwargs))
            _local.last = weakref.ref(self)
    return __init__


def _get_iterator(original):
    def _get_iterator(self):
        source = original(self)
        tracker = self.__dict__.get("_tfdp_input")
        if tracker is None:
            return source
        return _Positioned(tracker, source)
    return _get_iterator


HOOKS = {"epoch_iterator_init": _init, "epoch_iterator_get_iterator": _get_iterator}
adapter.provide("input_position", HOOKS)


def install(callback) -> None:
    """Put the epoch-iterator hooks into Keras for as long as ``callback`` lives (inert until a
    tfdp BackupAndRestore claims a fit's input)."""
    adapter.use(callback, "input_position")


def claim(model):
    """The tracker of the ``fit`` that is starting in this thread for ``model`` (called from
    ``on_train_begin``), or None. Claimed once: a later fit has its own."""
    ref = getattr(_local, "last", None)
    ei = ref() if ref is not None else None
    if ei is None:
        return None
    tracker = ei.__dict__.get("_tfdp_input")
    if tracker is None or compat.KerasEpochIterator(ei).strategy is not getattr(
            model, "distribute_strategy", None):
        return None
    _local.last = None
    return tracker


__all__ = ["HOOKS", "InputTracker", "claim", "install", "needs_iterator_replay", "not_exact_reasons",
           "positionable"]
