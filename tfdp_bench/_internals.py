"""The private TensorFlow names only the benchmarks read, kept here so the library does not.

* ``MirroredExtended._cross_device_ops``: which reduction a ``MirroredStrategy`` uses (printed next
  to its figures);
* ``CollectiveAllReduce._options.implementation``: that reduction's communication implementation;
* ``tensorflow.tsl.profiler.protobuf.xplane_pb2.XSpace``: the profiler's trace files
  (``tfdp bench fit --trace``).

Each read degrades to None (or a clear error for the trace) when TensorFlow renames it.
"""

from __future__ import annotations


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
