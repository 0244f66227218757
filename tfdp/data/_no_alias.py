"""Keep a strategy's input pipeline from writing into the user's numpy arrays.

Why this exists (TF 2.21, measured). A Python function in a tf.data pipeline (``Dataset.
from_generator``, which Keras uses for ``fit(keras.utils.PyDataset)`` and ``fit(generator)``;
``tf.numpy_function``; ``tf.py_function``) hands its numpy results to TF *zero-copy* whenever the
array is 64-byte aligned: the tensor's buffer is the user's memory (for a generator yielding
``x[i:i + b]`` it is a view of the user's ``x``). TF marks such a buffer as not owned
(``NumpyTensorBuffer::OwnsMemory() == false``) so that no kernel forwards it (writes its output
in place). But a dim-0 slice of it is a ``SubBuffer``, which does not pass that flag on (its
``OwnsMemory()`` is the default ``true``), and ``Tensor::RefCountIsOne`` only asks the slice.

``strategy.experimental_distribute_dataset`` (MirroredStrategy, DataParallelStrategy,
MultiWorkerMirroredStrategy) rebatches each global batch into per-replica batches with
``Dataset.rebatch`` (RebatchDatasetV2), whose one-slice fast path returns ``Tensor::Slice``
when the slice is aligned: replica 0's part always is (offset 0), others when their byte offset
is a multiple of 64. Once the rebatch iterator has moved on to the next batch, that slice holds
the only reference to the user's memory, so the first element-wise op of the train step on it
forwards its input: Keras's loss ``y_true - y_pred`` (a cwise ``Sub``, then the backward pass's
cwise ops on the same buffer) writes ``dL/dy_pred`` into the user's ``y``; a first layer such as
``Rescaling`` writes into ``x``. The next epoch then trains on corrupted data. Logical CPU
replicas share host memory, so nothing in between copies; single-device training is safe (no
slice, so the buffer keeps ``OwnsMemory() == false``). ``tfdp.data``'s own split of a global
batch (``t[start:start + size]``, a StridedSlice that also returns an aligned ``Tensor::Slice``)
has the same hazard for a pre-batched generator source.

The fix: copy each element once, at the end of the pipeline, before the strategy rebatches it,
but only for pipelines whose elements may come straight from a Python function (the only way
numpy memory enters tf.data zero-copy). ``Dataset.from_tensor_slices``/``from_tensors`` of
numpy arrays, files, and Keras's numpy-array adapter (``tf.gather``) are never copied, nor are
pipelines where a batching transformation (which writes fresh buffers) sits between the Python
function and the output.

The walk over the pipeline uses two private methods of ``tf.data.Dataset`` (``_inputs`` and
``_functions``, checked with TF 2.21); if they fail, the answer is "may alias" (copy), never
"safe".
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp

# Ops that run Python and return its numpy results to TF (zero-copy when aligned).
_PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})

# Transformations whose output elements are freshly allocated buffers (batch_util copies every
# input element into the new batch), so no numpy memory from above them reaches the output.
# Matched by class name: a rename in TF only costs a redundant copy, never a missed one.
_FRESH_BUFFER_DATASETS = frozenset({
    "_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset", "_MapAndBatchDataset",
    "_DenseToSparseBatchDataset",
})

# Set on the dataset copy_elements returns.
_COPIED = "_tfdp_elements_copied"

# Never copied: their buffers are never numpy memory (only fixed-size dtypes convert zero-copy).
_UNCOPIED_DTYPES = frozenset({tf.string, tf.variant, tf.resource})


def _function_ops(wrapper) -> set:
    """Op types of a tf.data function, including the functions it calls (nested datasets)."""
    fn = getattr(wrapper, "function", wrapper)
    graph_def = fn.graph.as_graph_def()
    ops = {n.op for n in graph_def.node}
    for f in graph_def.library.function:
        ops.update(n.op for n in f.node_def)
    return ops


def may_alias_numpy(dataset) -> bool:
    """Whether ``dataset``'s elements may share memory with numpy arrays a Python function
    returned (``from_generator``, ``tf.numpy_function``, ``tf.py_function`` upstream with no
    batching transformation in between). Conservative: unknown means True."""
    seen = set()
    stack = [dataset]
    try:
        while stack:
            ds = stack.pop()
            if id(ds) in seen:
                continue
            seen.add(id(ds))
            if type(ds).__name__ in _FRESH_BUFFER_DATASETS or getattr(ds, _COPIED, False):
                continue  # fresh buffers, whatever is above
            for wrapper in tfp.dataset_functions(ds):
                if _function_ops(wrapper) & _PY_FUNC_OPS:
                    return True
            stack.extend(tfp.dataset_inputs(ds))
    except Exception:  # pylint: disable=broad-except  # private API changed: assume the worst
        return True
    return False


def _copy_leaf(t):
    if isinstance(t, tf.Tensor) and t.dtype not in _UNCOPIED_DTYPES:
        # DeepCopy always allocates its output (never forwards its input): the element no longer
        # shares memory with the Python function's numpy result.
        return tf.raw_ops.DeepCopy(x=t)
    return t


def copy_elements(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``dataset`` with every numeric tensor (composite tensors' components too) copied once."""
    def copy(*args):
        element = args[0] if len(args) == 1 else args
        return tf.nest.map_structure(_copy_leaf, element, expand_composites=True)
    # A sequential map: it adds no read-ahead from the Python source (a parallel map would pull
    # more elements early, which a discarded iterator then loses from a one-shot generator).
    copied = dataset.map(copy)
    setattr(copied, _COPIED, True)  # a second no_numpy_alias (the strategy's) copies no more
    return copied


def no_numpy_alias(dataset):
    """``dataset`` unchanged, or followed by one copy of each element when its elements may
    alias numpy memory (see :func:`may_alias_numpy`). Anything that is not a
    ``tf.data.Dataset`` is returned as is (the strategy reports its own errors).

    Call it on the dataset a strategy is about to rebatch or slice into per-replica batches
    (``experimental_distribute_dataset``, ``tfdp.data``'s split).
    """
    if not isinstance(dataset, tf.data.Dataset) or not may_alias_numpy(dataset):
        return dataset
    return copy_elements(dataset)
