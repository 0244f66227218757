"""``tfdp train CONFIG [--set SECTION.KEY=VALUE ...] [--tiny] [--baseline] [--verbose]``.

Builds model, input pipeline and strategy from a TOML config, trains with Keras fit (a progress
bar on a terminal, one line per epoch otherwise), evaluates, prints a summary (replicas, global
and per-replica batch, examples/s, step-time percentiles, an estimate of the all-reduce share,
final metrics) and checks the config's [targets]. Runs unchanged on one CPU, on N local devices
and under 'tfdp launch'.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tfdp.cli import HELP_HELP, VERBOSE_HELP
from tfdp.errors import UsageError

EXIT_TARGET_MISSED = 3

EPILOG = """\
examples:
  tfdp train configs/quickstart.toml
  tfdp train configs/resnet_cifar10.toml --set train.epochs=1 --baseline
  tfdp train configs/bert_mlm.toml --tiny
  tfdp launch --workers 2 --cpu-replicas 2 -- tfdp train configs/bert_mlm.toml

CPU replicas (precedence: arguments > environment > config): --set strategy.cpu_replicas=N,
else TFDP_CPU_REPLICAS (tfdp launch --cpu-replicas sets it), else the config's [strategy]
cpu_replicas; the header says which. With GPUs every local GPU is a replica.

Your own model and data: [model] builder = "module:function" and [data] builder =
"module:function" (see examples/custom_model.toml and tfdp train --keys).

TensorFlow's C++ INFO/WARNING lines are hidden unless TF_CPP_MIN_LOG_LEVEL is set or --verbose
is given; errors and tfdp's own lines always show.

exit codes: 0 done and every target met; 1 error; 2 bad command line, config or environment
variable (e.g. TFDP_CPU_REPLICAS=abc); 3 a [targets] figure missed (the figure and the target
are printed)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message[:1].upper()}{message[1:]}. Run 'tfdp train --help' for usage.")


def build_parser():
    p = _Parser(prog="tfdp train", description=__doc__.split("\n\n")[1], epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                add_help=False)
    p.add_argument("-h", "--help", action="help", help=HELP_HELP)
    p.add_argument("config", nargs="?", help="a TOML config, e.g. configs/quickstart.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.epochs=3")
    p.add_argument("--tiny", action="store_true",
                   help="a few steps of a tiny model on tiny data (smoke test); the file's "
                        "[targets] are not checked, targets given with --set are")
    p.add_argument("--baseline", action="store_true",
                   help="also time 1 replica and print the scaling efficiency")
    p.add_argument("--keys", action="store_true", help="list every config key and exit")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from tfdp.train import config as config_lib
    if args.keys:
        print(config_lib.describe_schema())
        return 0
    if not args.config:
        raise UsageError("Missing CONFIG. Received: no config file. Pass one, e.g. "
                         "tfdp train configs/quickstart.toml (tfdp train --help for more).")
    overrides = list(args.overrides)
    if args.baseline:
        overrides.append("monitor.scaling_baseline=true")
    cfg = config_lib.load(args.config, overrides, tiny=args.tiny)   # no TensorFlow yet
    from tfdp.devices import cpu_replicas_from_env
    cpu_replicas_from_env()     # a bad TFDP_CPU_REPLICAS: a usage error (exit 2), before TF
    from tfdp.logs import import_tensorflow, load_lines_filtered, quiet_tensorflow
    quiet_tensorflow(os.environ, verbose=args.verbose)   # before TensorFlow is imported
    with load_lines_filtered():   # (a builder's module may import TensorFlow)
        from tfdp.train import builders
        builders.precheck(cfg)   # [model] / [data] builder mistakes: before TensorFlow starts
    import_tensorflow()      # its load-time lines too (printed before the level applies)
    logging.getLogger("tfdp").setLevel(logging.WARNING)   # the header below says what runs
    from tfdp.train.runner import run, summary
    result = run(cfg)
    if result.rank == 0:
        print(summary(result), flush=True)
    else:
        print(f"tfdp train: {result.name} finished on worker {result.rank} "
              "(summary on worker 0)", flush=True)
    if result.missed:
        for key, figure, target, _, label in result.missed:
            fig = "not measured" if figure is None else f"{figure:.4g}"
            print(f"tfdp train: target missed: {label} {fig}, target {key} = {target:g}",
                  file=sys.stderr, flush=True)
        return EXIT_TARGET_MISSED
    return 0


def cli_main(argv=None) -> int:
    """:func:`main` with tfdp's command-line error handling (one line; exit 2 usage, 1 error),
    for ``python -m tfdp.train`` and the example scripts."""
    from tfdp.errors import TfdpError
    try:
        return int(main(argv) or 0)
    except UsageError as e:
        print(f"tfdp train: error: {e}", file=sys.stderr)
        return 2
    except TfdpError as e:
        print(f"tfdp train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tfdp train: interrupted", file=sys.stderr)
        return 130
