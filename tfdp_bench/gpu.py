"""``tfdp bench gpu``: a one-shot GPU check, one table, in under 10 minutes on one GPU.

Sections, each in its own ``try`` (a failure is printed in its row; the other sections still run)
and with its own time budget (a run that would start after its section's budget is spent is
reported as skipped):

1. ``nccl``: whether this TensorFlow build has the NCCL all-reduce GPU kernel, and what
   ``DataParallelStrategy(all_reduce="auto")`` chooses on the first GPU alone, on the two
   logical GPUs, and on every physical GPU (with its reason).
2. ``equivalence``: Keras ``fit`` of a small model (conv + pooling + dense, SGD with momentum)
   for a few steps on one device without a strategy and under tfdp on 2 logical GPUs of one
   device (the first GPU split with ``tf.config.set_logical_device_configuration`` before the
   runtime starts): max |dw| over every variable (tfdp promises <= 1e-5 in float32).
3. ``resnet50``: Keras ``fit`` images/s of ResNet-50 (synthetic ImageNet shapes, 224x224x3,
   1000 classes, channels-last, ``mixed_float16``, SGD with momentum) on the first logical GPU:
   without a strategy, under MirroredStrategy and under tfdp, each with ``jit_compile=False``
   and ``True``; median steady step.
4. ``zero``: sharded optimizer state: ResNet-50 ``fit`` (Adam, ``mixed_float16``, a global
   batch of 256 over the 2 logical GPUs) under ``DataParallelStrategy(zero_stage=0 | 1 | 2)``:
   images/s, optimizer-state bytes on each GPU and each GPU's peak memory
   (``tf.config.experimental.get_memory_info``).
5. ``allreduce``: tfdp's fused all-reduce of float32 tensors in device memory across the 2
   logical GPUs (algbw and busbw = algbw * 2(n-1)/n) against a device-to-device copy of the same
   bytes between them (``tf.identity`` onto the other logical device) as the reference.

Without a GPU it prints one line saying so and exits 0. ``--cpu-dry-run`` runs the same sections
on 2 logical CPU devices with tiny sizes (a 2-block residual stand-in for ResNet-50, whose
XLA compilation takes minutes on CPU, on 32x32 images, batch 4; 64-256 KiB all-reduces): the
code paths, not the figures, which is what tests check here (the ``zero`` section there: batch 8
over the 2 CPU devices; per-device peak memory is not available for CPU devices).

The sections themselves are in :mod:`tfdp_bench.gpu_sections`.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
import traceback

from tfdp.errors import UsageError
from tfdp_bench import _common
# (the sections, looked up here when the check runs; Budget also re-exported for tests)
from tfdp_bench.gpu_sections import (Budget, _one_line, section_allreduce,
                                     section_equivalence, section_nccl, section_resnet50,
                                     section_zero)
from tfdp_bench.parser import BenchParser, check_writable, write_json

SECTIONS = ("nccl", "equivalence", "resnet50", "zero", "allreduce")
# seconds per section on a GPU (the whole check stays under 10 minutes; the runtime start and
# the table come on top)
BUDGETS_S = {"nccl": 20.0, "equivalence": 60.0, "resnet50": 270.0, "zero": 150.0,
             "allreduce": 60.0}
LOGICAL_MEMORY_MB = 0.45  # share of the first GPU's memory each of the 2 logical GPUs gets


# --- detection (before TensorFlow starts) --------------------------------------------------------

def nvidia_device_nodes() -> list[str]:
    """``/dev/nvidia0``-style device nodes: without any, no CUDA GPU is usable here."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def gpu_memory_mb() -> int | None:
    """The first GPU's total memory in MiB from ``nvidia-smi`` (None when unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20)
        return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def no_gpu_reason() -> str | None:
    """Why there is no GPU to check (None: TensorFlow sees at least one). May import TF."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every GPU"
    if not nvidia_device_nodes():
        return "no NVIDIA device (/dev/nvidia*) on this machine"
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU"):
        built = "built with CUDA" if tf.test.is_built_with_cuda() else "built without CUDA"
        return f"TensorFlow {tf.__version__} ({built}) sees no GPU"
    return None


def configure_devices(dry_run: bool) -> dict:
    """Split the first GPU (or, dry run, the CPU) into 2 logical devices; names and facts.

    Must run before TensorFlow's runtime starts.
    """
    import tensorflow as tf
    if dry_run:
        devices = _common.configure_replicas(2)
        return {"kind": "cpu", "logical": devices, "physical": 1, "memory_mb": None}
    gpus = tf.config.list_physical_devices("GPU")
    total = gpu_memory_mb()
    limit = int((total or 16384) * LOGICAL_MEMORY_MB)
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * 2)
    logical = [d.name for d in tf.config.list_logical_devices("GPU")]
    from tfdp import devices as devices_lib
    return {"kind": "gpu", "logical": [devices_lib.canonical(n) for n in logical[:2]],
            "all_logical": [devices_lib.canonical(n) for n in logical],
            "physical": len(gpus), "memory_mb": total, "logical_memory_mb": limit,
            "name": tf.config.experimental.get_device_details(gpus[0]).get("device_name")}
# --- the check -----------------------------------------------------------------------------------

def run_gpu_check(dry_run: bool = False, sections=SECTIONS, progress: bool = True,
                  budgets: dict | None = None) -> dict:
    """Run the sections (on the GPU, or on 2 logical CPU devices with ``dry_run``); a dict.

    Returns {"gpu": False, "reason"} when there is no GPU (and ``dry_run`` is off), else
    {"gpu", "dry_run", "environment", "devices", "rows": [[section, item, result, detail]],
    "sections": {name: {"seconds", "budget_s", "error"}}}.
    """
    if not dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            return {"gpu": False, "reason": reason}
    env = configure_devices(dry_run)
    budgets = dict(BUDGETS_S, **(budgets or {}))
    rows, info = [], {}
    for name in sections:
        _common.progress(f"gpu check: {name} (budget {budgets[name]:.0f} s)", progress)
        budget = Budget(budgets[name])
        t0 = time.monotonic()
        error = None
        try:
            fn = {"nccl": lambda: section_nccl(env, budget),
                  "equivalence": lambda: section_equivalence(env, budget),
                  "resnet50": lambda: section_resnet50(env, budget, dry_run),
                  "zero": lambda: section_zero(env, budget, dry_run),
                  "allreduce": lambda: section_allreduce(env, budget, dry_run)}[name]
            rows += fn()
        except Exception as e:  # the section's error goes in the table; the others still run
            error = _one_line(e)
            rows.append([name, "error", error, "see --json for the traceback"])
            info.setdefault("tracebacks", {})[name] = traceback.format_exc()
        info[name] = {"seconds": time.monotonic() - t0, "budget_s": budgets[name],
                      "error": error}
    return {"gpu": not dry_run, "dry_run": dry_run, "devices": env, "rows": rows,
            "sections": info, "environment": _common.environment()}


def format_gpu_check(result: dict) -> str:
    if not result.get("gpu") and not result.get("dry_run"):
        return f"tfdp bench gpu: no GPU here ({result['reason']}); nothing to check."
    env = result["devices"]
    head = ("tfdp bench gpu --cpu-dry-run: the GPU sections on 2 logical CPU devices, tiny "
            "sizes (code paths only, not figures)" if result["dry_run"] else
            f"tfdp bench gpu: {env.get('name') or 'GPU'} ({env['physical']} physical, "
            f"{env.get('memory_mb') or '?'} MiB; 2 logical GPUs of "
            f"{env.get('logical_memory_mb')} MiB on the first)")
    e = result["environment"]
    head += f"; TF {e['tensorflow']}, Keras {e['keras']}, tfdp {e['tfdp']}"
    rows = []
    last = None
    for r in result["rows"]:
        if last is not None and r[0] != last:
            rows.append(None)
        rows.append([r[0] if r[0] != last else "", *r[1:]])
        last = r[0]
    times = ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in result["sections"].items()
                      if isinstance(v, dict) and "seconds" in v)
    return "\n".join([head, "", _common.render_table(["section", "item", "result", "detail"],
                                                      rows, right=set()), "",
                      f"section times: {times}"])


# --- command line: tfdp bench gpu ----------------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench gpu", description=__doc__.split("\n\n")[0] + " Sections: "
                    "NCCL kernel and 'auto''s choice; Keras fit equivalence on 2 logical GPUs of "
                    "one device; ResNet-50 images/s (tfdp vs MirroredStrategy vs no strategy, "
                    "with and without jit_compile); zero_stage 0/1/2 images/s and memory per "
                    "GPU; fused all-reduce GB/s in device memory vs a "
                    "device-to-device copy. Without a GPU: one line, exit 0.")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run every section on 2 logical CPU devices with tiny sizes (exercises "
                        "the code paths here; the figures mean nothing)")
    p.add_argument("--sections", metavar="S,...", default=",".join(SECTIONS),
                   help=f"sections to run, from {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--json", metavar="FILE", help="write every row (and tracebacks) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv):
    from tfdp_bench.parser import split_list
    args = build_parser().parse_args(argv)
    names = split_list(args.sections)
    if not names or any(n not in SECTIONS for n in names):
        raise UsageError(f"Invalid --sections. Received: --sections {args.sections}. Valid: "
                         f"{', '.join(SECTIONS)} (comma-separated).")
    args.sections = [s for s in SECTIONS if s in names]
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_gpu_check(dry_run=args.cpu_dry_run, sections=args.sections,
                           progress=not args.quiet)
    print(format_gpu_check(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.gpu
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("gpu", parse_args, run))
