"""``tfdp launch``: start worker processes with ``TF_CONFIG`` (like torchrun), on one node or many.

Programmatic use::

    from tfdp.launch import launch, launch_nodes
    exit_code = launch([sys.executable, "train.py"], workers=2, cpu_replicas=2)
    # on each node, R = 0 .. N-1:
    exit_code = launch_nodes([sys.executable, "train.py"], nnodes=2, node_rank=R,
                             coordinator="10.0.0.1:29500", workers_per_node=1)

On one node only loopback addresses are advertised: the TensorFlow gRPC server the workers start
is unauthenticated (and listens on every interface of its port: firewall it on shared hosts).
Across nodes every node prints the addresses it will listen on: keep them on a private network.
Importing this package never imports TensorFlow.
"""

from tfdp.launch.launcher import launch, make_tf_configs, validate
from tfdp.launch.multinode import launch_nodes, validate_nodes

__all__ = ["launch", "launch_nodes", "make_tf_configs", "validate", "validate_nodes"]
