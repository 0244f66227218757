"""Shared by the example wrappers: run a config in this process, or across N local workers."""

import os
import shutil
import subprocess
import sys

CONFIGS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "configs"))


def command(config: str, argv, default_workers: int = 1, cpu_replicas: int = 2):
    """(workers, argv for tfdp train, or the full tfdp launch command when workers > 1)."""
    argv = list(argv)
    workers = default_workers
    if "--workers" in argv:
        i = argv.index("--workers")
        try:
            workers = int(argv[i + 1])
        except (IndexError, ValueError):
            raise SystemExit("--workers needs a positive integer, e.g. --workers 2") from None
        del argv[i:i + 2]
    if workers < 1:
        raise SystemExit("--workers needs a positive integer, e.g. --workers 2")
    train = [os.path.join(CONFIGS, config), *argv]
    if workers == 1:
        return workers, train
    devices = ["--cpu-replicas", str(cpu_replicas)]
    gpus = _count_gpus()
    if gpus:  # every worker its own GPUs, not all of them
        devices = ["--gpus-per-worker", str(max(1, gpus // workers))]
    return workers, [sys.executable, "-m", "tfdp", "launch", "--workers", str(workers),
                     *devices, "--", sys.executable, "-m", "tfdp.train", *train]


def _count_gpus() -> int:
    """NVIDIA GPUs visible here (nvidia-smi -L; 0 without it), without starting TensorFlow."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def run_config(config: str, argv, default_workers: int = 1, cpu_replicas: int = 2) -> int:
    """``tfdp train CONFIG ARGV`` here, or under ``tfdp launch`` with ``--workers N`` (N > 1;
    ``cpu_replicas`` CPU replicas per worker where there is no GPU)."""
    workers, cmd = command(config, argv, default_workers, cpu_replicas)
    if workers == 1:
        from tfdp.train.cli import cli_main
        return cli_main(cmd)
    return subprocess.call(cmd)
