"""TensorFlow's private names behind a distributed dataset's iterator (``tfdp.data._iterators``).

What TF 2.21 does on every ``iter()`` of a distributed dataset (each epoch of ``model.fit``,
each ``evaluate``): ``_SingleWorkerOwnedDatasetIterator._create_owned_multi_device_iterator``
makes an ``OwnedMultiDeviceIterator``: one host iterator over the rebatched dataset, and per
replica device a ``_PerDeviceGenerator`` dataset that pulls that replica's elements from it.
Each ``_PerDeviceGenerator`` traces six new ``tf.function`` s (init / next / finalize and their
``remote_call`` wrappers) and registers them in the eager context: about half of the ~115 ms an
iterator over 4 CPU replicas costs (measured, tfdp bench fitcalls), and the function library
grows with every epoch. Each per-device iterator also gets tf.data's autotuning (a model
thread) although its only transformation is a ``prefetch`` of a fixed size: destroying such an
iterator waited ~160 ms for that thread in one deletion out of three (measured).

``CachedMultiDeviceIterator`` is the same ``OwnedMultiDeviceIterator`` (same ops, same
round-robin order of elements, same type spec and components, so Keras's train function sees
no difference), with the per-device functions traced once per (devices, element spec, shard)
and called with each new iterator's own handle, incarnation id and resource (which is how TF's
own ``_ReincarnatedPerDeviceGenerator`` reuses them after a reset), and with autotuning off in
the per-device part only (the user's pipeline keeps its options). Whatever does not look as
expected falls back to TF's own construction.

What was left after that (~11 ms per replica for each new iterator on CPU) was tf.data running
grappler over the init and finalize functions of every per-device iterator it makes: they are
multi-device functions (a ``RemoteCall`` of the source device); TF's next function is not,
because TF marks it ``experimental_ints_on_device``, which makes tf.data instantiate it as a
single-device function. On CPU replicas init and finalize carry the same mark
(``_single_device_functions``): an iterator over 4 CPU replicas, made and read once, 83 -> 29 ms.

The per-device datasets (generator, prefetch, options) and their iterators are made from the
dataset ops themselves, not tf.data's Python classes, which merge every input's options in
Python at each step of the chain; the options ``OwnedMultiDeviceIterator`` sets on the host
dataset are set when the iterator is made, so an unread (lazy) iterator costs nothing at all:
made and read once, 17.5 -> 16.6 ms on 2 CPU replicas, 30.4 -> 27.8 ms on 4 (medians of 300).
What is left is TF's: every tf.data dataset op made eagerly costs ~0.3 ms (a ``range`` +
``prefetch`` alike), the generator op ~1.6 ms, and the multi-device iterator's init (the host
pipeline's graph rewrite) ~3-4 ms.
"""

# pylint: disable=protected-access  (this module is where tfdp touches these TF internals)
from __future__ import annotations

import contextlib
import threading

import tensorflow as tf
# The per-worker iterator of a distributed dataset (its MultiDeviceIterator factory is wrapped),
# and the host device it is made on.
from tensorflow.python.distribute import device_util as _device_util
from tensorflow.python.distribute import input_lib as _input_lib
# The multi-device iterator, its per-device generator dataset, the ops they are made of.
from tensorflow.core.framework import dataset_metadata_pb2 as _metadata_pb2
from tensorflow.core.framework import dataset_options_pb2 as _options_pb2
from tensorflow.python.data.ops import iterator_ops as _iterator_ops
from tensorflow.python.data.ops import multi_device_iterator_ops as _mdi_ops
from tensorflow.python.framework import ops as _ops
# Whether an op is stateful (which ops in a pipeline's functions may change shared state).
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.ops import gen_dataset_ops as _gen_dataset_ops

from tfdp import logs as _logs
from tfdp.compat.iterator_release import release_in_background, start_releaser

_local = threading.local()
_lock = threading.Lock()
_functions = {}  # (devices, source, element spec, shard) -> _DeviceFunctions, or None: unusable
_hook_lock = threading.Lock()
_users = 0  # threads inside cached_multi_device_iterators (TF's factory wrapped while > 0)


class _DeviceFunctions:
    """One replica device's traced generator functions and what each captured input is."""

    def __init__(self, proto, source_tensor, resource, incarnation, handle, single_device=None):
        def kinds(args):
            out = []
            for a in args:
                if a is source_tensor:
                    out.append("source")
                elif a is resource:
                    out.append("resource")
                elif a is incarnation:
                    out.append("incarnation")
                elif (getattr(a, "dtype", None) == tf.string and a.shape == ()
                      and a.numpy() == handle.numpy()):
                    out.append("handle")
                else:
                    raise ValueError("unexpected captured input of a per-device generator")
            return out

        self.source_tensor = source_tensor
        self.init_func, self.next_func = proto._init_func, proto._next_func
        self.finalize_func = proto._finalize_func
        init_args, finalize_args = proto._init_captured_args, proto._finalize_captured_args
        if single_device is not None:  # (init, finalize) rebuilt by _single_device_functions
            self.init_func, self.finalize_func = single_device
            init_args = self.init_func.captured_inputs
            finalize_args = self.finalize_func.captured_inputs
        self.init_kinds = kinds(init_args)
        self.next_kinds = kinds(proto._next_captured_args)
        self.finalize_kinds = kinds(finalize_args)
        if self.init_kinds.count("handle") != 1 or "resource" not in self.next_kinds:
            raise ValueError("unexpected per-device generator structure")


def _device_variant(fns, values, flat, prefetch_buffer_size, slack):
    """One replica's dataset of a multi-device iterator, as the variant of TF's
    ``_PerDeviceGenerator`` (with its functions already traced) + ``prefetch`` + the per-device
    options, made with the dataset ops themselves: tf.data's Python dataset classes merge every
    input's options in Python at each step of the chain (~1 ms per replica and iterator)."""
    def args(kinds):
        return [values[k] for k in kinds]

    variant = _gen_dataset_ops.generator_dataset(
        args(fns.init_kinds), args(fns.next_kinds), args(fns.finalize_kinds),
        init_func=fns.init_func, next_func=fns.next_func, finalize_func=fns.finalize_func,
        **flat)
    if prefetch_buffer_size > 0:  # (as .prefetch(n, name="device_prefetch"), or with slack)
        variant = tf.raw_ops.PrefetchDataset(
            input_dataset=variant, buffer_size=tf.constant(prefetch_buffer_size, tf.int64),
            slack_period=1 if slack else 0, legacy_autotune=False,
            metadata=b"" if slack else _PREFETCH_METADATA, **flat)
    return tf.raw_ops.OptionsDataset(input_dataset=variant,
                                     serialized_options=_DEVICE_OPTIONS, **flat)


def _owned_iterator(variant, flat, element_spec):
    """``iter()`` of a dataset whose variant is ``variant``: the same ``OwnedIterator``."""
    resource = tf.raw_ops.AnonymousIteratorV3(**flat)
    tf.raw_ops.MakeIterator(dataset=variant, iterator=resource)
    return _iterator_ops.OwnedIterator(components=[resource], element_spec=element_spec)


def _host_options(num_devices, prefetch_buffer_size) -> bytes:
    """What ``OwnedMultiDeviceIterator`` sets on the dataset it iterates, serialized (tf.data
    merges it with the dataset's own options in C++, this one taking precedence)."""
    options = _options_pb2.Options()
    options.distribute_options.num_devices = num_devices
    if prefetch_buffer_size == 0:
        options.optimization_options.inject_prefetch = False
    return options.SerializeToString()


def _host_variant(dataset, num_devices, prefetch_buffer_size):
    """The variant ``OwnedMultiDeviceIterator`` initializes its host iterator with: ``dataset``
    with its options (``with_options``) and tf.data's debug-mode options, if on."""
    dataset = dataset._apply_debug_options()
    return tf.raw_ops.OptionsDataset(
        input_dataset=dataset._variant_tensor,
        serialized_options=_host_options(num_devices, prefetch_buffer_size),
        **dataset._flat_structure)


def _device_options():
    """The options of every per-device dataset, serialized (``_python_device_options``: the
    same as ``tf.data.Options``, for TF's own per-device datasets)."""
    options = _options_pb2.Options()
    options.autotune_options.enabled = False  # a fixed-size prefetch: no model thread
    # No graph rewrites of a generator + prefetch: TF cannot serialize the generator and said so
    # in a C++ warning on every iterator ("Input of GeneratorDatasetOp::Dataset will not be
    # optimized"); the pipeline the user built is optimized on the host side as before.
    options.optimization_options.apply_default_optimizations = False
    options.optimization_options.inject_prefetch = False
    return options.SerializeToString()


def _python_device_options():
    """``_device_options()`` as ``tf.data.Options`` (tests check that they are equal)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    return options


_DEVICE_OPTIONS = _device_options()
_PREFETCH_METADATA = _metadata_pb2.Metadata(name=b"device_prefetch").SerializeToString()


class CachedMultiDeviceIterator(_mdi_ops.OwnedMultiDeviceIterator):
    """``OwnedMultiDeviceIterator`` whose per-device functions are traced once (see the module
    docstring). Made eagerly only; inside a ``tf.function`` TF's own class is used.

    ``lazy``: the iterator's resources are made when first used (its components read, as when
    Keras passes it to the train function, or ``get_next``): an iterator nobody reads, such as
    the one Keras makes after the last step of every epoch and of every ``evaluate`` and then
    drops, costs nothing. Only for pipelines where making an iterator has no effect on others
    (the caller decides: no seed generators, no Python, no state written).

    ``release_in_background``: dropping the iterator hands its resources to one background
    thread that destroys them there: destroying an autotuned tf.data iterator can block for as
    long as the autotuner's current period (it doubles over the iterator's life, up to 60 s;
    measured 2.1 s after 3 s, 4.2 s after 6 s for a plain ``iter()``), and TF releases the GIL
    while it waits, so the training thread goes on.
    """

    _tfdp_release_in_background = False
    _tfdp_built = None  # (resource, device iterators) once made

    def __init__(self, dataset, devices, max_buffer_size=1, prefetch_buffer_size=1,
                 source_device="/cpu:0", release_in_background=False, lazy=False):
        # (as OwnedMultiDeviceIterator.__init__ with a dataset, TF 2.19-2.21; the options it
        # sets on the dataset are set when the iterator is made, _host_variant)
        self._element_spec = dataset.element_spec
        self._devices = devices
        self._source_device = source_device
        self._tfdp_args = (dataset, max(max_buffer_size, prefetch_buffer_size),
                           prefetch_buffer_size)
        self._tfdp_lock = threading.Lock()
        self._tfdp_release_in_background = release_in_background
        if release_in_background:
            start_releaser()  # (here, not in __del__: a finalizer takes no lock)
        if not lazy:
            self._tfdp_build()

    @property
    def _multi_device_iterator_resource(self):  # (what TF's methods and type spec read)
        return self._tfdp_build()[0]

    @property
    def _device_iterators(self):
        return self._tfdp_build()[1]

    def _tfdp_build(self):
        built = self._tfdp_built
        if built is not None:
            return built
        with self._tfdp_lock:
            if self._tfdp_built is None:
                with _ops.init_scope():  # (first used inside a traced call: made eagerly)
                    self._tfdp_built = self._tfdp_make(*self._tfdp_args)
                self._tfdp_args = None
            return self._tfdp_built

    def _tfdp_make(self, dataset, max_buffer_size, prefetch_buffer_size):
        devices, source_device = self._devices, self._source_device
        flat = dataset._flat_structure
        with _ops.device(source_device):
            resource = _gen_dataset_ops.anonymous_multi_device_iterator_v3(
                devices=devices, **flat)
            incarnation = _gen_dataset_ops.multi_device_iterator_init(
                _host_variant(dataset, len(devices), prefetch_buffer_size), resource,
                max_buffer_size=max_buffer_size)
            handle = _gen_dataset_ops.multi_device_iterator_to_string_handle(resource)
        spec_key = (tuple(devices), str(source_device), repr(dataset.element_spec))
        args = (dataset, devices, source_device, resource, incarnation, handle, spec_key,
                prefetch_buffer_size)
        global _first_made
        if not _first_made:
            # The process's first generator dataset iterator: TF logs a one-time INFO line then
            # that plain Keras never causes (tfdp.logs.dropping_generator_notice says which). One
            # thread at a time: the process's stderr is redirected meanwhile.
            with _first_lock:
                if not _first_made:
                    with _logs.dropping_generator_notice():
                        iterators = self._tfdp_device_iterators(*args)
                    _first_made = True
                    return resource, iterators
        return resource, self._tfdp_device_iterators(*args)

    def _tfdp_device_iterators(self, dataset, devices, source_device, resource, incarnation,
                               handle, spec_key, prefetch_buffer_size):
        slack = dataset.options().experimental_slack
        spec, flat = dataset.element_spec, dataset._flat_structure
        iterators = []
        for i, device in enumerate(devices):
            with _ops.device(device):
                fns = _device_functions(spec_key + (i,), i, resource, incarnation, handle,
                                        source_device, spec)
                if fns is None:  # not reusable: TF's own per-device dataset
                    proto = _mdi_ops._PerDeviceGenerator(
                        i, resource, incarnation, _ops.convert_to_tensor(source_device),
                        spec, iterator_is_anonymous=True)
                    ds = _mdi_ops._create_device_dataset(
                        proto, incarnation, prefetch_buffer_size, slack)
                    iterators.append(iter(ds.with_options(_python_device_options())))
                else:
                    values = {"source": fns.source_tensor, "resource": resource,
                              "incarnation": incarnation, "handle": handle}
                    variant = _device_variant(fns, values, flat, prefetch_buffer_size, slack)
                    iterators.append(_owned_iterator(variant, flat, spec))
        return iterators

    def __del__(self):
        built = self.__dict__.pop("_tfdp_built", None)
        if built is not None and self._tfdp_release_in_background:
            try:
                release_in_background(built)
            except Exception:  # noqa: BLE001 - interpreter shutdown: released here instead
                pass


_first_made = False  # whether this process made a per-device iterator yet
_first_lock = threading.Lock()

_INTS_ON_DEVICE = {"experimental_ints_on_device": True}


def _single_device_functions(source_device, handle):
    """(init, finalize) as ``_PerDeviceGenerator`` makes them (a ``RemoteCall`` of the source
    device), marked ``experimental_ints_on_device`` as TF marks its next function.

    tf.data instantiates a generator function without that mark as a multi-device function and
    runs grappler over it (and the function it calls) in every new iterator: ~10 ms per replica
    and iterator on CPU, most of what a per-device iterator cost (measured, MakeIterator 11 ->
    0.7 ms per device). With it the function is instantiated on the iterator's device and the
    ``RemoteCall`` instantiates the inner function on the source device, as for next. The mark
    itself only says where int32 tensors live, and these functions have none (a string handle
    in, a string or an int64 out)."""
    @tf.function(autograph=False)
    def _init():
        return handle

    init = _init.get_concrete_function()

    @tf.function(autograph=False, experimental_attributes=_INTS_ON_DEVICE)
    def _remote_init():
        return tf.raw_ops.RemoteCall(target=source_device, args=init.captured_inputs,
                                     Tout=[tf.string], f=init)

    @tf.function(input_signature=[tf.TensorSpec([], tf.string)], autograph=False)
    def _finalize(unused_string_handle):
        return tf.constant(0, tf.int64)

    finalize = _finalize.get_concrete_function()

    @tf.function(input_signature=[tf.TensorSpec([], tf.string)], autograph=False,
                 experimental_attributes=_INTS_ON_DEVICE)
    def _remote_finalize(string_handle):
        return tf.raw_ops.RemoteCall(target=source_device,
                                     args=[string_handle] + finalize.captured_inputs,
                                     Tout=[tf.int64], f=finalize)

    return _remote_init.get_concrete_function(), _remote_finalize.get_concrete_function()


def _all_cpu(devices) -> bool:
    try:
        return all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)
    except (TypeError, ValueError):
        return False


def _device_functions(key, shard, resource, incarnation, handle, source_device, element_spec):
    """The cached functions for ``key`` (traced now from TF's own ``_PerDeviceGenerator`` the
    first time); None if they cannot be reused (then never tried again for ``key``).

    On CPU replicas (``key[0]``, the devices, all CPUs), init and finalize are TF's marked as
    single-device functions (``_single_device_functions``); on other devices they are TF's as
    they are (the mark is untested there)."""
    with _lock:
        if key not in _functions:
            source_tensor = _ops.convert_to_tensor(source_device)
            proto = _mdi_ops._PerDeviceGenerator(
                shard, resource, incarnation, source_tensor, element_spec,
                iterator_is_anonymous=True)
            try:
                single = (_single_device_functions(source_device, handle)
                          if _all_cpu(key[0] + (source_device,)) else None)
                _functions[key] = _DeviceFunctions(proto, source_tensor, resource, incarnation,
                                                   handle, single)
            except ValueError:
                _functions[key] = None
        return _functions[key]


def op_is_stateful(op_type: str) -> bool:
    """Whether TF registers ``op_type`` as stateful (an unknown op counts as stateful)."""
    op_def = _op_def_registry.get(op_type)
    return op_def is None or op_def.is_stateful


def is_multi_device_dataset(distributed) -> bool:
    """Whether ``distributed`` is one of TF's distributed datasets, whose eager iterators are
    multi-device iterators (``experimental_distribute_dataset``,
    ``distribute_datasets_from_function``)."""
    return isinstance(distributed, (_input_lib.DistributedDataset,
                                    _input_lib.DistributedDatasetsFromFunction))


def distributed_dataset_sources(distributed) -> list | None:
    """The per-worker ``tf.data.Dataset`` s a distributed dataset iterates (the one it was made
    from, or those ``distribute_datasets_from_function`` built), or None if unknown."""
    original = getattr(distributed, "_original_dataset", None)
    if original is not None:
        return [original]
    datasets = getattr(distributed, "_datasets", None)
    return list(datasets) if datasets else None


@contextlib.contextmanager
def cached_multi_device_iterators(release_in_background=False, lazy=False):
    """Inside: the iterators a distributed dataset makes eagerly in this thread are
    ``CachedMultiDeviceIterator`` s (made lazily, released in the background thread, if
    asked)."""
    saved = getattr(_local, "settings", None)
    _local.settings = {"release_in_background": bool(release_in_background), "lazy": bool(lazy)}
    try:
        with _installed_while_inside():
            yield
    finally:
        _local.settings = saved


def _iterator_hook(original):
    def _create_owned_multi_device_iterator(self):
        settings = getattr(_local, "settings", None)
        if settings is None or _ops.inside_function():
            return original(self)
        return _create_cached(self, **settings)
    return _create_owned_multi_device_iterator


_POINTS = {"iterator": (_input_lib._SingleWorkerOwnedDatasetIterator,
                        "_create_owned_multi_device_iterator")}
_MARKER = "__tfdp_iterator_original__"


@contextlib.contextmanager
def _installed_while_inside():
    """TF's factory wrapped while some thread is inside ``cached_multi_device_iterators``, and
    TF's own again after (``wrap`` / ``unwrap``)."""
    from tfdp.compat.keras_internals import unwrap, wrap
    global _users
    with _hook_lock:
        if not _users:
            wrap(_POINTS, {"iterator": _iterator_hook}, _MARKER)
        _users += 1
    try:
        yield
    finally:
        with _hook_lock:
            _users -= 1
            if not _users:
                unwrap(_POINTS, ["iterator"], _MARKER)


def _create_cached(worker_iterator, release_in_background, lazy):
    """(as _SingleWorkerOwnedDatasetIterator._create_owned_multi_device_iterator, eager)"""
    self = worker_iterator
    device_scope = _device_util.canonicalize(self._worker, _device_util.current())
    host_device = _device_util.get_host_for_device(device_scope)
    kwargs = {"release_in_background": release_in_background, "lazy": lazy}
    if self._options is not None:
        size = self._options.experimental_per_replica_buffer_size
        kwargs.update(max_buffer_size=size, prefetch_buffer_size=size)
    with _ops.device(device_scope):
        self._iterator = CachedMultiDeviceIterator(
            self._dataset, self._devices, source_device=host_device, **kwargs)


__all__ = ["CachedMultiDeviceIterator", "cached_multi_device_iterators",
           "distributed_dataset_sources", "is_multi_device_dataset", "op_is_stateful"]
