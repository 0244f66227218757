"""Test set-up: split the host CPU into logical devices once per test process.

Must run before TensorFlow initialises its runtime, so it happens at import of this conftest
(pytest imports it before any test module). Tests that need a fresh runtime, or several workers,
run in subprocesses through tfdp's launcher / ``tfdp.testing``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # tests are CPU-only, also on GPU hosts

import pytest  # noqa: E402

import tfdp  # noqa: E402

tfdp.configure_cpu_replicas(4)  # before any test can start the TF runtime



def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: starts several processes (hard timeout)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s")


@pytest.fixture(scope="session")
def cpu_devices():
    """The test process's logical CPU devices (4 of them, configured at import)."""
    import tensorflow as tf
    return [d.name for d in tf.config.list_logical_devices("CPU")]
