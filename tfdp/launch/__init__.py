"""``tfdp launch``: start N local worker processes with ``TF_CONFIG`` on 127.0.0.1 (like torchrun).

Programmatic use::

    from tfdp.launch import launch
    exit_code = launch([sys.executable, "train.py"], workers=2, cpu_replicas=2)

Only loopback addresses are advertised: the TensorFlow gRPC server the workers start is
unauthenticated (and listens on every interface of its port: firewall it on shared hosts).
Importing this package never imports TensorFlow.
"""

from tfdp.launch.launcher import launch, make_tf_configs, validate

__all__ = ["launch", "make_tf_configs", "validate"]
