"""Cluster resolution and validation: where is every worker, and which one is this process?

Sources, first match wins (see :func:`resolve_cluster`): an explicit cluster resolver,
``TF_CONFIG``, SLURM (``srun``), else local single-process. Every source is validated by the same
rules and fails fast with a :class:`tfdp.errors.TfdpError` naming the variable, the received value
and the fix. Nothing here starts the TensorFlow runtime or opens a connection.
"""

from tfdp.cluster.resolve import check_port_free, resolve_cluster
from tfdp.cluster.slurm import expand_nodelist, expand_tasks_per_node, parse_slurm
from tfdp.cluster.spec import ClusterInfo, parse_tf_config

__all__ = ["ClusterInfo", "check_port_free", "expand_nodelist", "expand_tasks_per_node",
           "parse_slurm", "parse_tf_config", "resolve_cluster"]
