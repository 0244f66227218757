"""Collective keys: the one allocator of every group key and instance key tfdp uses.

Group keys. TF's own ``CollectiveKeys`` (initial-value broadcast, TF's CollectiveAllReduce used
for gather) hand out small group keys from 1; tfdp's groups live far above: the cross-worker
groups of ``tfdp.reduce.cross_worker`` at ``CROSS_WORKER_GROUP_BASE + local device index``, the
replica-context groups of ``tfdp.reduce.collective`` at ``REPLICA_GROUP_BASE + n`` (one per
reducer's replica-context collectives, drawn in construction order, which is the same on every worker: same program).

Instance keys are drawn at run time from one counter per replica device:

Every collective tfdp launches (``CollectiveReduceV2`` / ``CollectiveGatherV2``) names its
instance by a key that every member of the group must agree on. TF caches an instance's shape
under its key, so a key must not be reused by a later execution whose shapes differ (the uneven
last batch, a sparse gradient); keys fixed when a function is traced would be.

TF's own launcher draws keys at call time (``capture_call_time_value``). That breaks inside
nested functions called from control flow: Keras's ``one_step_on_data`` (a ``tf.function``)
runs inside ``multi_step_on_iterator``'s while loop and ``tf.cond`` when
``steps_per_execution > 1``, and the deferred capture is left as an unfed placeholder
("You must feed a value for placeholder tensor 'while/.../cond/Placeholder' with dtype int32";
measured with TF 2.21, also with TF's own closure pattern).

So tfdp counts at run time instead: device slot i has an int64 counter variable (on its host
CPU), and each collective built for slot i takes ``counter.assign_add(1)`` as its key. TF's
automatic control dependencies run the increments of one counter in program order, so the j-th
collective executed on slot i gets key j: the same on every local replica and every worker, as
they run the same collectives in the same order (which a collective needs anyway), inside
branches and loops alike, eagerly or in a function.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

CROSS_WORKER_GROUP_BASE = 1 << 24
REPLICA_GROUP_BASE = 1 << 26
_replica_groups = itertools.count(0)
_lock = threading.Lock()


def cross_worker_group_key(index: int) -> int:
    """The group of local device ``index`` of every worker (one member per worker)."""
    return CROSS_WORKER_GROUP_BASE + index


def new_replica_group_key() -> int:
    """A fresh group of every replica of the job (one per replica-context reducer)."""
    with _lock:
        return REPLICA_GROUP_BASE + next(_replica_groups)


def _host(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type or "CPU").upper() == "CPU":
        return device
    return spec.replace(device_type="CPU", device_index=0).to_string()


class InstanceKeys:
    """One run-time key counter per device slot (see the module docstring).

    Args:
      devices: the devices of the slots (a counter lives on each device's host CPU).
      name: variable name prefix (shows in graphs).
    Create it outside any strategy scope and outside functions (it creates plain variables).
    """

    def __init__(self, devices, name: str = "tfdp_instance_key"):
        self.devices = tuple(devices)
        with tf.init_scope():
            self._counters = []
            for d in self.devices:
                with tf.device(_host(d)):
                    self._counters.append(tf.Variable(0, dtype=tf.int64, trainable=False,
                                                      name=name))

    def next(self, slot: int = 0):
        """The key (an int32 scalar tensor) of the next collective on device slot ``slot``."""
        counter = self._counters[slot]
        with tf.device(counter.device):
            return tf.cast(counter.assign_add(1), tf.int32)


def ordering_tokens(devices, name: str):
    """One ordering token (a resource variable) per device, as TF's CollectiveReplicaLauncher
    keeps: each collective of a device takes its token, so TF's automatic control dependencies
    run a device's collectives in program order. Create outside any strategy scope."""
    with tf.init_scope():
        tokens = []
        for d in devices:
            with tf.device(d):
                tokens.append(tf.Variable(0.0, trainable=False, name=name))
    return tokens


__all__ = ["CROSS_WORKER_GROUP_BASE", "InstanceKeys", "REPLICA_GROUP_BASE",
           "cross_worker_group_key", "new_replica_group_key", "ordering_tokens"]
