"""Cheaper iterators over tfdp's distributed datasets: what each epoch of ``fit`` starts with.

Keras calls ``iter()`` on the distributed dataset at the top of every epoch of ``fit`` (and of
every ``evaluate``, so of ``fit(validation_data=...)`` every epoch), and drops the previous
iterator there. With TF 2.21 both cost (measured on 4 CPU replicas, ``tfdp bench fitcalls``;
MirroredStrategy pays the same):

* making it: a ``MultiDeviceIterator`` whose per-device part re-traces six ``tf.function`` s
  per replica every time (~115 ms of the ~115-150 ms an iterator took);
* dropping it: destroying an autotuned tf.data iterator can block until the autotuner's
  current period ends, and that period doubles over the iterator's life up to 60 s (a plain
  ``iter()`` blocked 2.1 s after 3 s of life, 4.2 s after 6 s); a multi-device iterator holds
  one autotuned iterator per replica besides the host's, destroyed one after the other (15.5 s
  once after 5 s of life on 4 replicas). These are the multi-second stalls before an epoch's
  first batch and at the end of ``fit``.

:func:`fast_iterators` marks a distributed dataset so that its eager iterators are built by
``tfdp.compat.iterator_internals.CachedMultiDeviceIterator``: the same multi-device iterator
(same ops, same element order, same components), with the per-device functions traced once per
(devices, element spec) and, on CPU replicas, instantiated without a grappler pass per
iterator, no autotuning in the per-device prefetch (a fixed size of 1: nothing to
tune), and, for pipelines that run no Python, destroyed in a background thread (TF releases the
GIL while it waits). A pipeline that runs Python (``from_generator``, ``py_function``: Keras's
generator and PyDataset inputs) keeps TF's synchronous destruction: a dying iterator must not
read ahead from a Python source while the next epoch's starts.

Nothing about the data changes: the host iterator over the user's (rebatched) dataset is TF's,
with the user's options.
"""

from __future__ import annotations

import re

from tfdp import compat
from tfdp.compat import names
from tfdp.data._no_alias import _PY_FUNC_OPS, _function_ops

_SUBCLASSES = {}

# Stateful ops that change nothing outside the iterator running them: random kernels (their
# generator state is per instantiation, i.e. per iterator: a seeded tf.random.shuffle or
# tf.random.uniform in a map gives every new iterator the same values, measured), copies,
# variable reads, nested calls (their bodies are checked too) and datasets made in a function.
_LOCAL_STATEFUL_OPS = frozenset({
    "RandomShuffle", "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "Multinomial", "DeepCopy", "ReadVariableOp", "StatefulPartitionedCall",
})
_DATASET_OP = re.compile(r"Dataset(V\d+)?$")


def pipeline_facts(dataset) -> dict:
    """``{"python": ..., "independent": ...}`` for ``dataset`` and everything upstream:
    ``python``: a transformation runs a Python function; ``independent``: making an iterator
    (and dropping it unread) changes nothing for other iterators (no seed generator draws:
    reshuffling ``shuffle``, ``Dataset.random``; no Python; no op that writes shared state).
    Unknown (no dataset, a walk that fails) means ``python`` and not ``independent``."""
    unknown = {"python": True, "independent": False}
    if dataset is None:
        return unknown
    python, independent = False, True
    seen, stack = set(), [dataset]
    try:
        while stack:
            ds = stack.pop()
            if id(ds) in seen:
                continue
            seen.add(id(ds))
            seeds = compat.shuffle_dataset_seeds(ds)
            if (seeds is not None and seeds[2]) or type(ds).__name__ == "_RandomDataset":
                independent = False
            for wrapper in compat.dataset_functions(ds):
                ops = _function_ops(wrapper)
                if ops & _PY_FUNC_OPS:
                    python = True
                if any(compat.op_is_stateful(op) and op not in _LOCAL_STATEFUL_OPS
                       and not _DATASET_OP.search(op) for op in ops):
                    independent = False
            stack.extend(compat.dataset_inputs(ds))
    except Exception:  # noqa: BLE001 - a private-structure walk: unknown means the worst
        return unknown
    return {"python": python, "independent": independent and not python}


def _subclass(cls):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        def __iter__(self):
            facts = self.__dict__.get("_tfdp_pipeline", {"python": True, "independent": False})
            with compat.cached_multi_device_iterators(
                    release_in_background=not facts["python"], lazy=facts["independent"]):
                return cls.__iter__(self)

        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "__module__": cls.__module__,
            "__doc__": cls.__doc__, "tfdp_fast_iterators": True})
    return sub


def fast_iterators(distributed):
    """``distributed`` (a ``tf.distribute`` distributed dataset, changed in place) whose eager
    iterators are cheap to make and to destroy; anything else is returned unchanged."""
    cls = type(distributed)
    if not names.available("fast_iterators"):  # (TF's own iterators: the strategy warned)
        return distributed
    if getattr(cls, "tfdp_fast_iterators", False) or not compat.is_multi_device_dataset(
            distributed):
        return distributed
    sources = compat.distributed_dataset_sources(distributed) or [None]
    facts = [pipeline_facts(ds) for ds in sources]
    distributed._tfdp_pipeline = {  # pylint: disable=protected-access
        "python": any(f["python"] for f in facts),
        "independent": all(f["independent"] for f in facts)}
    distributed.__class__ = _subclass(cls)
    return distributed


def for_strategy(strategy, distributed):
    """:func:`fast_iterators` when ``strategy`` is one of tfdp's, else ``distributed`` as is
    (``tfdp.data.distribute`` also serves other strategies)."""
    if getattr(getattr(strategy, "extended", None), "tfdp_settings", None) is None:
        return distributed
    return fast_iterators(distributed)


__all__ = ["fast_iterators", "for_strategy", "pipeline_facts"]
