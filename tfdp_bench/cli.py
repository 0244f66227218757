"""``tfdp bench COMMAND [options]``: the one command line of :mod:`tfdp_bench`.

``tfdp.cli`` finds this module through the ``tfdp.commands`` entry point ``bench`` (setup.py),
prints :data:`HELP` in ``tfdp --help`` and calls :func:`main` with the arguments after ``bench``. Each command is a module of
:mod:`tfdp_bench` with ``build_parser()``, ``parse_args(argv)`` and ``run(args)`` (see
:mod:`tfdp_bench.parser`); this module only lists them and dispatches. Arguments are validated
before TensorFlow starts; usage errors are :class:`~tfdp.errors.UsageError` (one line, exit
code 2, printed by ``tfdp.cli``). ``python -m tfdp_bench.COMMAND`` runs one command alone.
"""

from __future__ import annotations

import importlib

from tfdp_bench.parser import quiet_tensorflow
from tfdp.errors import UsageError
from tfdp.logs import import_tensorflow

# the line of 'tfdp --help'
HELP = "benchmarks: tfdp vs tf.distribute.MirroredStrategy, side by side"

# name -> (module, help lines for 'tfdp bench --help'); the order is the order errors list them in
COMMANDS = {
    "allreduce": ("tfdp_bench.allreduce",
                  "one replica-context all_reduce of a gradient set (ResNet50's, a deep narrow "
                  "MLP's,\nor single tensors of given sizes); median ms, algbw, busbw, "
                  "MirroredStrategy/tfdp;\n--workers N: across N local worker processes vs "
                  "MultiWorkerMirroredStrategy"),
    "fit": ("tfdp_bench.fit",
            "Keras model.fit throughput of a deep narrow MLP: tfdp vs MirroredStrategy vs one\n"
            "device; median examples/s and the ratio tfdp/MirroredStrategy; --trace DIR: a\n"
            "profiler step timeline (compute / all-reduce / idle, overlap)"),
    "patterns": ("tfdp_bench.patterns",
                 "the user-pattern matrix: each row (clipping, custom train_step, two "
                 "optimizers,\nBatchNorm, uneven batches, mixed precision...) trained without a "
                 "strategy, under\nMirroredStrategy and under tfdp; max |dw| vs one device, tfdp "
                 "replica identity"),
    "workers": ("tfdp_bench.workers",
                "alias of 'allreduce --workers 2 --sizes 64M --compression none,fp16' (older "
                "options)"),
    "input": ("tfdp_bench.input",
              "sharded TFRecord input pipeline examples/s per worker vs training consumption"),
    "sparse": ("tfdp_bench.sparse",
               "Embedding-gradient (IndexedSlices) reduction, recommender shape: tfdp gather /\n"
               "densify vs MirroredStrategy; --sweep locates the gather/densify crossover"),
    "scaling": ("tfdp_bench.scaling",
                "predicted scaling efficiency for 1..1024 devices (alpha-beta ring model);\n"
                "--measure fits it here"),
    "overhead": ("tfdp_bench.overhead",
                 "what one replica costs: tfdp on one device and MirroredStrategy on one device\n"
                 "vs plain Keras (wall and CPU time per step)"),
    "fitcalls": ("tfdp_bench.fitcalls",
                 "whole short model.fit calls (set-up, iterator starts, teardown): loops of\n"
                 "1/5/20 fits and fit(validation_data=...), tfdp vs MirroredStrategy vs none"),
    "embedding": ("tfdp_bench.embedding",
                  "Keras fit of a recommender-shaped model (Embedding + MLP): tfdp vs\n"
                  "MirroredStrategy, SGD / momentum / Adam"),
    "crossworker": ("tfdp_bench.crossworker",
                    "the cross-worker bucket cap, measured in one job of N local workers"),
    "faults": ("tfdp_bench.faults",
               "randomized fault trials on a 2-worker job (kill + restart, kill, SIGSTOP, kill\n"
               "inside a backup write, SIGTERM): trials passed, detection s, resume max |dw|"),
    "gpu": ("tfdp_bench.gpu",
            "one-shot GPU check (NCCL, 'auto', fit equivalence on 2 logical GPUs, ResNet-50\n"
            "images/s, zero_stage 0/1/2 images/s and memory per GPU, all-reduce GB/s); one\n"
            "line and exit 0 without a GPU; --cpu-dry-run"),
    "zero": ("tfdp_bench.zero", "zero_stage vs unsharded: optimizer bytes/device, memory, speed"),
    "syncbn": ("tfdp_bench.syncbn",
               "what BatchNormalization(synchronized=True) costs: ResNet-50 fit, plain vs\n"
               "synchronized batch statistics, under tfdp and under MirroredStrategy"),
}

USAGE = ("usage: tfdp bench {" + ",".join(COMMANDS) + "} [options]   "
         "(tfdp bench COMMAND --help for details)")

EXAMPLES = """examples:
  tfdp bench allreduce --model resnet50 --cpu-replicas 4
  tfdp bench allreduce --sizes 1K,1M,64M --json ar.json --plot busbw.png
  tfdp bench allreduce --model mlp --algorithms fused --bucket-bytes 0,262144,4194304
  tfdp bench allreduce --workers 2 --sizes 1M,16M,64M --compression none,fp16 --plot w.png
  tfdp bench fit --cpu-replicas 4 --steps 20
  tfdp bench fit --trace /tmp/fit-trace
  tfdp bench fitcalls --calls 1,5,20 --rounds 3
  tfdp bench patterns --rows clipnorm_uneven,two_optimizers
  tfdp bench syncbn --cpu-replicas 4
  tfdp bench gpu"""


def help_text() -> str:
    lines = [USAGE, "",
             "Benchmarks of tfdp's DataParallelStrategy against tf.distribute.MirroredStrategy, "
             "side by side in",
             "one process on K logical CPU replicas: every contender is warmed up, then rounds "
             "run each",
             "contender once in alternating order; figures are medians and ratios of medians.",
             "", "commands:"]
    width = max(len(n) for n in COMMANDS)
    for name, (_, text) in COMMANDS.items():
        first, *more = text.split("\n")
        lines.append(f"  {name:<{width}} {first}")
        lines += [f"  {'':<{width}} {m}" for m in more]
    return "\n".join(lines + ["", EXAMPLES])


def command_module(name: str):
    """The module implementing ``tfdp bench NAME`` (a UsageError for an unknown name)."""
    if name not in COMMANDS:
        raise UsageError(f"Unknown bench command. Received: {name!r}. Valid: "
                         f"{', '.join(COMMANDS)}. Run 'tfdp bench --help' for usage.")
    return importlib.import_module(COMMANDS[name][0])


def main(argv: list[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(help_text())
        return 0 if argv else 2
    quiet_tensorflow()   # before the command's module: importing it may start TensorFlow
    module = command_module(argv[0])
    args = module.parse_args(argv[1:])
    if getattr(module, "uses_tensorflow", lambda _args: True)(args):
        import_tensorflow()   # its load-time lines, printed before the level applies, filtered
    return int(module.run(args) or 0)
