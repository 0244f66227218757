"""Every module says what it holds, and no module describes a design that is gone."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tfdp", "tfdp_bench")

# Names of replaced designs: a docstring or comment still naming one describes code that no
# longer exists (the one reducer replaced the three reducer classes and the weighted side door;
# the StepContext replaced the step attributes on the extended).
GONE = ("DataParallelReduce", "MultiWorkerReduce", "ReplicaAllReduce", "batch_reduce_weighted",
        "_replica_reducer", "_DataParallelExtended", "tfdp_step", "_tfdp_no_merge",
        "tfdp_xla_refusal", "reduce.hierarchical", "reduce.local", "n_r*N/sum(n)",
        "count_executions", "cross_worker_bucket_bytes", "keras_table_reads", "tfdp.bench",
        "TFDP_ZERO_SPAN")


def _modules():
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


MODULES = sorted(_modules())


def test_the_modules_were_found():
    assert len(MODULES) > 50 and "tfdp/reduce/reducer.py" in MODULES


@pytest.mark.parametrize("path", MODULES)
def test_module_has_a_docstring_naming_its_concept(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    doc = ast.get_docstring(ast.parse(source))
    if path.endswith("__init__.py") and not source.strip():
        return  # an empty package marker
    assert doc and len(doc.split("\n", 1)[0].strip()) >= 10, (
        f"{path}: give the module a docstring whose first line says what it holds")
    stale = [name for name in GONE if name in source]
    assert not stale, f"{path} still names {stale}, which no longer exist: describe today's code"


def test_the_stale_name_check_can_fail(tmp_path):
    """The check above reads the source text: a module naming a replaced class is caught."""
    source = '"""Reduction across workers with MultiWorkerReduce."""\n'
    assert [name for name in GONE if name in source] == ["MultiWorkerReduce"]
