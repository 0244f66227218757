"""The fault trials' job (:mod:`tfdp_bench.faults`): what runs inside each worker.

A Keras ``model.fit`` of an MLP on a seeded, shuffled ``tf.data`` pipeline under
``tfdp.DataParallelStrategy`` with ``tfdp.callbacks.BackupAndRestore(dir, save_freq=1)`` and
``PreemptionCheckpoint``; every worker appends its step to a progress file and writes its PID at
start; the chief's backup write can be made to pause at a chosen phase (``kill-in-write``). Also
the scenarios' table and the job's constants, shared with the harness. Importing this module
does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
import time


# --- the trial job ------------------------------------------------------------------------------

SAMPLES, GLOBAL_BATCH, EPOCHS = 256, 32, 6       # 8 steps per epoch, 48 steps in all
TOTAL_STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
TOL = 1e-6                                       # resume tolerance (as tests/test_resume_dropin.py)
WORKER_MARK = "tfdp-bench-faults-worker"         # in every worker's command line (cleanup check)
WORKER_CODE = f"import tfdp_bench.fault_job as f; f.worker_main()  # {WORKER_MARK}"
SLOW_WRITE_PAUSE_S = 120.0                       # a paused backup write waits this long at most

# scenario -> (letter, bar in seconds or None, description)
SCENARIOS = {
    "kill-restart": ("a", None, ("SIGKILL a random worker at a random step; --max-restarts 1; "
                                 "final weights == clean run")),
    "kill-detect": ("b", 5.0, "SIGKILL a random worker; the job ends within 5 s, naming it"),
    "stop-detect": ("c", 10.0, "SIGSTOP a random worker; the job ends within 10 s, naming it"),
    "kill-in-write": ("d", None, ("SIGKILL the chief inside a backup write; previous backup "
                                  "intact, exact resume")),
    "preempt": ("e", None, ("SIGTERM a random worker at a random step; backup, exit 75, "
                            "exact resume")),
}
WRITE_PHASES = ("state-half-written", "state-not-renamed", "sidecar-not-renamed")
DEFAULTS = {"trials": 10, "seed": 0, "timeout": 300.0, "workers": 2, "cpu_replicas": 2}


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def worker_main() -> None:
    """The trial job, run by every worker (``python -c "import tfdp_bench.faults as f;
    f.worker_main()"`` under ``tfdp launch``). Configured by environment variables:

    ``FAULTS_DIR`` (the trial directory: PID and progress files, the backup, the final weights),
    ``FAULTS_LAUNCH`` (which launch of the trial), ``FAULTS_SLOW_WRITE`` = ``STEP:PHASE`` (first
    attempt, chief only: pause the backup write of global step STEP at PHASE, see
    ``WRITE_PHASES``, and write ``inwrite.json`` so the harness kills it there).
    """
    trial_dir = os.environ["FAULTS_DIR"]
    launch = int(os.environ.get("FAULTS_LAUNCH", "0"))
    restart = int(os.environ.get("TFDP_RESTART_COUNT", "0"))
    rank = int(os.environ.get("TFDP_WORKER_RANK", "0"))
    tag = f"{launch}-{restart}-{rank}"
    _write_atomic(os.path.join(trial_dir, f"pid-{tag}"), str(os.getpid()))

    import numpy as np

    import tfdp
    strategy = tfdp.DataParallelStrategy()   # TF_CONFIG + TFDP_CPU_REPLICAS from tfdp launch
    import keras
    import tensorflow as tf

    from tfdp.callbacks import BackupAndRestore, PreemptionCheckpoint
    from tfdp.testing import emit_result

    current = {"step": 0}
    progress_file = open(os.path.join(trial_dir, f"progress-{tag}"), "a")  # noqa: SIM115

    class Progress(keras.callbacks.Callback):
        """Counts this process's steps (placed before the backup: a step is reported before its
        backup is written) and appends each to the progress file."""

        def on_train_batch_end(self, batch, logs=None):
            current["step"] += 1
            progress_file.write(f"{current['step']} {time.time():.3f}\n")
            progress_file.flush()

    slow = os.environ.get("FAULTS_SLOW_WRITE", "")
    if slow and launch == 0 and restart == 0 and rank == 0:
        _install_slow_write(trial_dir, int(slow.split(":")[0]), slow.split(":")[1], current)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 8)).astype("float32")
    y = (np.sin(x[:, :4]).sum(axis=1, keepdims=True) + 0.1 * x[:, 4:5]).astype("float32")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=7)
            .batch(GLOBAL_BATCH))
    backup = BackupAndRestore(os.path.join(trial_dir, "backup"), save_freq=1)
    point = backup.restore_point
    preempt = PreemptionCheckpoint(backup)
    model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False,  # (tf.data shuffles)
              callbacks=[Progress(), backup, preempt])
    arrays = [np.asarray(v) for v in list(model.variables) + list(model.optimizer.variables)]
    out = os.path.join(trial_dir, f"weights-{launch}-{rank}.npz")
    with open(out + ".tmp", "wb") as f:
        np.savez(f, *arrays)
    os.replace(out + ".tmp", out)
    emit_result(rank=rank, launch=launch, restart=restart, restored=backup.restored,
                resumed_from=None if point is None else point.global_step,
                iterations=int(model.optimizer.iterations.numpy()))


def _install_slow_write(trial_dir: str, step: int, phase: str, current: dict) -> None:
    """Make the backup write of global step ``step`` pause at ``phase`` (this process only).

    ``BackupAndRestore`` writes the state with ``numpy.savez`` into a temporary file, renames it
    (``os.replace``), then writes and renames the sidecar the same way. Both public functions are
    wrapped here: at the chosen phase the wrapper writes ``inwrite.json`` (the harness then
    SIGKILLs this process) and sleeps.
    """
    import numpy as np
    savez, replace = np.savez, os.replace
    state = {"armed": True}

    def pause(where):
        state["armed"] = False
        _write_atomic(os.path.join(trial_dir, "inwrite.json"),
                      json.dumps({"phase": phase, "step": step, "where": where,
                                  "pid": os.getpid(), "time": time.time()}))
        time.sleep(SLOW_WRITE_PAUSE_S)

    def slow_savez(file, *args, **kwargs):
        if not (state["armed"] and phase == "state-half-written" and current["step"] == step
                and hasattr(file, "write")):
            return savez(file, *args, **kwargs)
        import io
        buf = io.BytesIO()
        savez(buf, *args, **kwargs)
        data = buf.getvalue()
        file.write(data[:len(data) // 2])
        file.flush()
        os.fsync(file.fileno())
        pause(f"{len(data) // 2} of {len(data)} bytes of the state written")
        file.write(data[len(data) // 2:])

    def slow_replace(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(dst))
        if state["armed"] and current["step"] == step and (
                (phase == "state-not-renamed" and name == f"state-{step}.npz")
                or (phase == "sidecar-not-renamed" and name == "backup.json")):
            pause(f"before renaming {os.path.basename(os.fspath(src))} to {name}")
        return replace(src, dst, *args, **kwargs)

    np.savez = slow_savez
    os.replace = slow_replace
