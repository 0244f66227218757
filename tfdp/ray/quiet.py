"""What tfdp sets for the processes of a Ray job: TensorFlow as quiet as in ``tfdp launch``.

Every process of a Ray Train job imports TensorFlow (the controller and each worker), and each
prints TensorFlow's load-time C++ lines and, since Ray's workers log Python INFO, TensorFlow's
Python INFO lines too (twice: TF's handler and Ray's). :func:`runtime_env` gives the job a
``runtime_env`` that applies tfdp's own rule (``tfdp.logs``) in every one of them:

* ``TF_CPP_MIN_LOG_LEVEL=2`` (no C++ INFO/WARNING; errors stay), unless the driver's
  environment sets the variable (then that value goes to the workers) or ``verbose=True``;
* a ``worker_process_setup_hook`` (:func:`setup_worker`) that filters TensorFlow's load-time
  lines whenever the process imports it (``tfdp.logs.filter_tensorflow_import``: no import of
  TensorFlow itself, so Ray Data's workers stay light) and, at that level, holds the
  ``tensorflow`` Python logger at WARNING unless something set its level.

    ray.init(runtime_env=tfdp.ray.runtime_env())

Errors, tracebacks and Python warnings always show.
"""

from __future__ import annotations

import logging
import os

from tfdp.errors import TfdpError

HOOK = "tfdp.ray.quiet.setup_worker"


def runtime_env(runtime_env: dict | None = None, *, verbose: bool = False) -> dict:
    """``runtime_env`` (Ray's dict; default empty) with tfdp's quiet TensorFlow added.

    Args:
      runtime_env: the job's own runtime environment; its ``env_vars`` are kept (a
        ``TF_CPP_MIN_LOG_LEVEL`` there wins).
      verbose: True: add nothing to the environment (TensorFlow logs as it does by default).

    Returns:
      a new dict for ``ray.init(runtime_env=...)`` (or ``RunConfig(worker_runtime_env=...)``).
    """
    from tfdp.logs import LEVEL_ENV, quiet_tensorflow
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise TfdpError(f"Invalid runtime_env. Received: {type(runtime_env).__name__} "
                        f"{runtime_env!r}. Pass Ray's runtime_env as a dict (or None).")
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, HOOK):
        raise TfdpError(f"runtime_env already has a worker_process_setup_hook. Received: "
                        f"{hook!r}. Call tfdp.ray.quiet.setup_worker() first in your hook "
                        "and pass the runtime_env to Ray yourself.")
    env_vars = dict(env.get("env_vars") or {})
    if LEVEL_ENV not in env_vars and os.environ.get(LEVEL_ENV, "").strip():
        env_vars[LEVEL_ENV] = os.environ[LEVEL_ENV]      # the user's level, for every process
    quiet_tensorflow(env_vars, verbose=verbose)
    if env_vars:
        env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = HOOK
    return env


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: run in each process of the job before its tasks."""
    from tfdp.logs import filter_tensorflow_import, level_in_effect
    filter_tensorflow_import()
    tf_logger = logging.getLogger("tensorflow")
    if level_in_effect() >= 1 and tf_logger.level == logging.NOTSET:
        tf_logger.setLevel(logging.WARNING)


__all__ = ["HOOK", "runtime_env", "setup_worker"]
