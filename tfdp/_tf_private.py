"""The ONLY module of tfdp that imports TensorFlow private APIs (``tensorflow.python...``).

Checked against TensorFlow 2.21.0 (tensorflow-cpu 2.21.0, Keras 3.15.1). Everything else in tfdp
uses public APIs or goes through the names re-exported here, so a TF upgrade has one place to
look at. Each import below says what it is used for.
"""

from __future__ import annotations

import tensorflow as tf

# MirroredExtended: the per-device variable mirroring and input pipeline we build on
# (DataParallelStrategy subclasses it to fix BN aggregation and uneven batches).
from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
# Helpers of the public tf.distribute.CrossDeviceOps contract: destinations -> devices, broadcast.
from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
# Build Mirrored / PerReplica containers from per-device components; select one replica's values.
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values
# Which kernels are registered (is the NCCL all-reduce kernel built into this TF?).
from tensorflow.python.framework import kernels as _kernels

TF_VERSION_CHECKED = "2.21.0"

MirroredExtended = _mirrored_strategy.MirroredExtended
PerReplica = _values.PerReplica
Mirrored = _values.Mirrored


def devices_of(destinations) -> tuple[str, ...]:
    """The canonical device strings of ``destinations`` (a DistributedValues, variable or device)."""
    return tuple(_cross_device_ops.get_devices_from(destinations))


def has_destinations(destinations) -> bool:
    return _cross_device_ops.check_destinations(destinations)


def mirrored(components):
    """A Mirrored value from per-device components (a plain tensor when there is one)."""
    return _distribute_utils.regroup(tuple(components), wrap_class=Mirrored)


def select_replica(replica_id: int, structure):
    """The components of replica ``replica_id`` in a structure of PerReplica values."""
    return _distribute_utils.select_replica(replica_id, structure)


def nccl_kernel_registered() -> bool:
    """Whether this TensorFlow build has the NCCL all-reduce GPU kernel."""
    try:
        kernels = _kernels.get_registered_kernels_for_op("NcclAllReduce")
    except Exception:  # the op itself may be unknown in CPU-only builds
        return False
    return any(k.device_type == "GPU" for k in kernels.kernel)


def nccl_all_sum(tensors):
    """TF's own NCCL all-sum over tensors on distinct GPUs (one output per input device)."""
    from tensorflow.python.ops import nccl_ops
    return nccl_ops.all_sum(tensors)


def is_distributed_values(x) -> bool:
    return isinstance(x, tf.distribute.DistributedValues)
