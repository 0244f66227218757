"""Both strategies take the same arguments, validated at construction, and tell the worker role."""

import inspect

import pytest
import tensorflow as tf

import tfdp
from tfdp.errors import TfdpError
from tfdp.strategy import worker_role
from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy


def test_both_strategies_accept_the_same_arguments():
    local = inspect.signature(tfdp.DataParallelStrategy.__init__).parameters
    multi = inspect.signature(MultiWorkerDataParallelStrategy.__init__).parameters
    assert list(local) == list(multi)
    for name in ("all_reduce", "bucket_bytes", "compression", "sparse", "collective_timeout",
                 "heartbeat_timeout", "cluster_resolver", "cluster"):
        assert name in local, name
    assert issubclass(MultiWorkerDataParallelStrategy, tfdp.DataParallelStrategy)
    assert issubclass(MultiWorkerDataParallelStrategy, tf.distribute.MultiWorkerMirroredStrategy)


def test_local_strategy_takes_the_failure_settings_and_reports_its_role():
    s = tfdp.DataParallelStrategy(["CPU:0"], heartbeat_timeout=3, collective_timeout=20)
    assert (s.heartbeat_timeout, s.collective_timeout) == (3.0, 20.0)
    assert (s.num_workers, s.worker_index, s.is_chief) == (1, 0, True)
    assert type(s) is tfdp.DataParallelStrategy


@pytest.mark.parametrize("kwargs, name", [
    ({"heartbeat_timeout": -1}, "heartbeat_timeout"),
    ({"collective_timeout": "soon"}, "collective_timeout"),
    ({"all_reduce": "magic"}, "all_reduce"),
    ({"bucket_bytes": -5}, "bucket_bytes"),
])
def test_bad_arguments_fail_at_construction_with_their_name(kwargs, name):
    with pytest.raises(TfdpError, match=name):
        tfdp.DataParallelStrategy(["CPU:0"], **kwargs)


def test_worker_role_of_tf_strategies():
    default = worker_role(tf.distribute.get_strategy())
    assert (default.index, default.count, default.is_chief) == (0, 1, True)
    ms = tf.distribute.MirroredStrategy(["CPU:0"],
                                        cross_device_ops=tf.distribute.ReductionToOneDevice())
    role = worker_role(ms)
    assert (role.index, role.count, role.is_chief) == (0, 1, True)
