"""The layout a newcomer reads: no import cycles in tfdp/, and names-only imports stay light.

An import cycle is a chain of module-level imports (``import x`` / ``from x import y`` outside
functions) among tfdp's modules that leads back to where it started. Imports inside functions
(done when first needed, e.g. ``DataParallelStrategy()`` choosing the multi-worker strategy) are
not part of the module graph.
"""

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "tfdp")
# packages of this repository that build on tfdp and that tfdp must never import
EXTERNAL = ("tfdp_bench",)
MAX_LINES = 500


def _modules():
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
                mods[name] = path
    return mods


def _module_level_imports(path, name, mods, lazy=False):
    """The tfdp modules ``name`` imports at module level (``lazy``: also inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lazy:
                visit(node.body)
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        out.add(a.name)
                    elif a.name.split(".")[0] in EXTERNAL:
                        out.add(a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        out.add(sub)
                    elif base in mods:
                        out.add(base)
                    elif base.split(".")[0] in EXTERNAL:
                        out.add(base)
            if isinstance(node, ast.ClassDef):
                visit([n for n in node.body])
            elif hasattr(node, "body") and not isinstance(node, ast.ClassDef):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []) or [])
    visit(tree.body)
    out.discard(name)
    return out


def _graph(lazy=False, external=False):
    """{module: the modules of tfdp it imports} (``external``: also the tfdp_bench modules)."""
    mods = _modules()
    graph = {name: _module_level_imports(path, name, mods, lazy) for name, path in mods.items()}
    if not external:
        graph = {m: {d for d in deps if d in mods} for m, deps in graph.items()}
    return graph


def _cycles(graph):
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_tfdp():
    graph = _graph()
    assert "tfdp.strategy.multiworker" in graph and graph["tfdp.strategy.multiworker"]
    assert _cycles(graph) == []


def test_no_import_cycles_counting_lazy_imports():
    """Imports inside functions count too: the dependency between two modules goes one way."""
    graph = _graph(lazy=True)
    assert "tfdp.train.builders" in graph and "tfdp.train.data" in graph
    assert _cycles(graph) == []


def test_the_library_does_not_import_the_benchmarks():
    """tfdp_bench builds on tfdp; tfdp never imports it, not even inside a function (``tfdp
    bench`` reaches it through the tfdp.commands entry point)."""
    graph = _graph(lazy=True, external=True)
    bad = {m: sorted(d for d in deps if d.split(".")[0] in EXTERNAL)
           for m, deps in graph.items()}
    assert not {m: d for m, d in bad.items() if d}
    assert not os.path.exists(os.path.join(PKG, "bench"))
    # nor by name (importlib.import_module("tfdp_bench...")): no string names a bench module
    named = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.split(".")[0] in EXTERNAL):
                named.append((m, node.value))
    assert not named


def _long_modules(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                n = sum(1 for _ in open(path, encoding="utf-8"))
                if n > MAX_LINES:
                    out[os.path.relpath(path, ROOT)] = n
    return out


def test_no_benchmark_module_over_500_lines():
    assert _long_modules(os.path.join(ROOT, "tfdp_bench")) == {}


def test_no_module_over_500_lines():
    assert _long_modules(PKG) == {}


def test_the_core_does_not_import_the_launcher_or_commands():
    graph = _graph()
    core = [m for m in graph if m.startswith(("tfdp.strategy", "tfdp.reduce", "tfdp.keras",
                                              "tfdp.failures", "tfdp.compat", "tfdp.data"))]
    for m in core:
        bad = {d for d in graph[m] if d.startswith(("tfdp.launch", "tfdp_bench", "tfdp.train"))}
        assert not bad, f"{m} imports {bad}"


LIGHT_MODULES = ["tfdp", "tfdp.reduce", "tfdp.reduce.registry", "tfdp.failures",
                 "tfdp.launch.launcher", "tfdp.logs", "tfdp.strategy.role"]

# Each module in turn, in one fresh process: a module whose import pulls TensorFlow in puts it in
# sys.modules at its own step (imports are cumulative), so the first such module is the one
# named; the modules after it cannot be checked in that process, and their tests fail saying so.
_LIGHT_SCRIPT = """
import importlib, json, sys, traceback
for name in json.loads(sys.argv[1]):
    if "tensorflow" in sys.modules:
        verdict = "not checked: an earlier module of this process imported tensorflow"
    else:
        try:
            importlib.import_module(name)
        except BaseException:
            verdict = "import failed: " + traceback.format_exc()
        else:
            verdict = "tensorflow was imported" if "tensorflow" in sys.modules else "ok"
    print("CASE", json.dumps([name, verdict]), flush=True)
"""


@pytest.fixture(scope="module")
def light_imports(run_process):
    """One process imports every module of LIGHT_MODULES in turn: ({module: verdict}, the
    process's output)."""
    r = subprocess.run([sys.executable, "-c", _LIGHT_SCRIPT, json.dumps(LIGHT_MODULES)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    verdicts = dict(json.loads(line[5:]) for line in r.stdout.splitlines()
                    if line.startswith("CASE "))
    return verdicts, f"exit code {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_names_only_imports_do_not_start_tensorflow(light_imports, module):
    verdicts, output = light_imports
    assert verdicts.get(module) == "ok", f"{module}: {verdicts.get(module)}\n{output}"
