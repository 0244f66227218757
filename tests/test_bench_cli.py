"""tfdp bench's command line: one CLI, one parser, no import cycles, --help and bad options.

Every command is reached through ``tfdp bench COMMAND`` and ``python -m tfdp_bench.COMMAND``;
its ``--help`` works without starting TensorFlow, and a bad option is one line on stderr with
exit code 2.
"""

import ast
import os
import subprocess
import sys

import pytest

from jobs import standalone_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "tfdp_bench")
PYTHON = sys.executable


def env():
    e = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    for var in ("TFDP_CPU_REPLICAS", "TF_CONFIG"):
        e.pop(var, None)
    return e


def run(*args, timeout=100):
    return subprocess.run([PYTHON, *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def commands():
    from tfdp_bench.cli import COMMANDS  # importing it starts no TensorFlow
    return list(COMMANDS)


# --- structure ----------------------------------------------------------------------------------

def _bench_imports(path, include_functions):
    """tfdp_bench modules imported by a file (outside ``if __name__ == "__main__"`` blocks)."""
    tree = ast.parse(open(path).read(), filename=path)
    found = set()

    def visit(nodes, top):
        for node in nodes:
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.left, ast.Name)
                    and node.test.left.id == "__name__"):
                continue  # the standalone entry point
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = []
            for n in names:
                if n.startswith("tfdp_bench."):
                    mod = n.split(".")[1]
                    if os.path.exists(os.path.join(BENCH_DIR, mod + ".py")):
                        found.add(mod)
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if not children:
                    continue
                is_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if is_def and not include_functions:
                    continue
                visit(children, top and not is_def)

    visit(tree.body, True)
    return found


def _cycle(graph):
    state = {}

    def dfs(n, stack):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack + [n, m]
            if m not in state:
                found = dfs(m, stack + [n])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = dfs(n, [])
            if found:
                return found
    return None


@pytest.mark.parametrize("include_functions", [False, True])
def test_no_import_cycles_in_bench(include_functions):
    mods = [f[:-3] for f in os.listdir(BENCH_DIR) if f.endswith(".py")]
    graph = {m: _bench_imports(os.path.join(BENCH_DIR, m + ".py"), include_functions) - {m}
             for m in mods}
    assert "cli" not in set().union(*graph.values()), graph  # nothing imports the dispatcher
    assert _cycle(graph) is None, _cycle(graph)
    # the cycles issue #12 named are gone, in both directions
    for a, b in (("allreduce", "workers"), ("cli", "scaling")):
        assert not (a in graph[b] and b in graph[a]), (a, b)


def test_one_argument_parser_class():
    subclasses = []
    for f in sorted(os.listdir(BENCH_DIR)):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(BENCH_DIR, f)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(
                        ast.unparse(b).endswith("ArgumentParser") for b in node.bases):
                    subclasses.append((f, node.name))
    assert subclasses == [("parser.py", "BenchParser")]


def test_every_command_module_has_the_protocol():
    import importlib
    for name in commands():
        from tfdp_bench.cli import COMMANDS
        module = importlib.import_module(COMMANDS[name][0])
        for fn in ("build_parser", "parse_args", "run"):
            assert callable(getattr(module, fn, None)), (name, fn)
        assert module.build_parser().prog == f"tfdp bench {name}"


def test_bench_is_a_plugin_of_the_tfdp_command(capsys):
    """tfdp's CLI finds ``bench`` through the ``tfdp.commands`` entry point (setup.py); the
    library has no bench package of its own."""
    import tfdp.cli
    eps = tfdp.cli.plugin_commands()
    assert "bench" in eps and eps["bench"].value == "tfdp_bench.cli", eps
    assert "bench" not in tfdp.cli.SUBCOMMANDS
    assert not os.path.exists(os.path.join(ROOT, "tfdp", "bench"))
    assert tfdp.cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  bench    benchmarks: " in out and "{train,launch,bench}" in out, out


def test_input_benchmark_lives_in_bench():
    from tfdp_bench import input as bench_input
    assert callable(bench_input.run_input_bench) and callable(bench_input.format_input_bench)
    assert not os.path.exists(os.path.join(ROOT, "tfdp", "data", "bench.py"))


def test_all_reduce_names_come_from_the_registry_without_tensorflow(run_process):
    code = ("import sys; from tfdp_bench.parser import all_reduce_names; "
            "names = all_reduce_names(); assert 'tensorflow' not in sys.modules, 'TF started'; "
            "print(','.join(names))")
    res = run("-c", code)
    assert res.returncode == 0, res.stderr
    from tfdp.reduce.registry import ALGORITHMS
    assert res.stdout.strip() == ",".join(ALGORITHMS)


# --- help and usage errors ----------------------------------------------------------------------

def test_every_help_works_without_tensorflow(run_process):
    code = """
import contextlib, io, sys
from tfdp_bench import cli
for name in cli.COMMANDS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([name, "--help"])
        except SystemExit as e:
            assert e.code in (0, None), (name, e.code)
        else:
            raise AssertionError(name + ": --help did not exit")
    text = out.getvalue()
    assert text.startswith("usage: tfdp bench " + name), (name, text[:200])
    assert "--help" in text, name
assert "tensorflow" not in sys.modules, "a --help started TensorFlow"
print("ok", len(cli.COMMANDS))
"""
    res = run("-c", code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["ok", str(len(commands()))]


def _has_main_guard(name):
    from tfdp_bench.cli import COMMANDS
    path = os.path.join(ROOT, *COMMANDS[name][0].split(".")) + ".py"
    return 'if __name__ == "__main__":' in open(path).read()


def _check_bad_option(name, bench, alone):
    """``bench``: (code, stdout, stderr) of ``tfdp bench NAME --bogus-option 1``; ``alone()``:
    those of ``python -m tfdp_bench.NAME --bogus-option`` (called for every module that offers
    it)."""
    code, out, err = bench
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("tfdp bench: error: Unrecognized arguments: --bogus-option 1. ")
    assert f"Run 'tfdp bench {name} --help' for usage." in lines[0]
    assert out == ""
    # the same command alone (python -m tfdp_bench.NAME), for every module that offers it
    if name not in ("allreduce", "fit", "patterns", "workers", "input", "sparse", "scaling",
                    "gpu") and not _has_main_guard(name):
        return
    code, out, err = alone()
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"tfdp bench {name}: error: "), err


@pytest.mark.timeout(200)
def test_bad_option_through_the_real_entry_points(run_process):
    """The first command through ``python -m tfdp bench`` and ``python -m tfdp_bench.NAME``
    themselves (processes, as a user runs them); the other commands run in this process
    (below), through the same code."""
    name = commands()[0]

    def proc(*args):
        res = run(*args)
        return res.returncode, res.stdout, res.stderr

    _check_bad_option(name, proc("-m", "tfdp", "bench", name, "--bogus-option", "1"),
                      lambda: proc("-m", f"tfdp_bench.{name}", "--bogus-option"))


@pytest.mark.parametrize("name", commands()[1:])
def test_bad_option_is_one_line_exit_2(tfdp_cli, monkeypatch, capsys, name):
    _check_bad_option(name, tfdp_cli(["bench", name, "--bogus-option", "1"]),
                      lambda: standalone_in_process(monkeypatch, capsys, f"tfdp_bench.{name}",
                                                    "--bogus-option"))


@pytest.mark.parametrize("args, needle", [
    (["fit", "--trace-steps", "0"], "--trace-steps"),
    (["fit", "--trace", "{file}/dir"], "--trace"),
    (["gpu", "--sections", "nccl,warp"], "--sections"),
    (["input", "--examples", "0"], "--examples"),
    (["input", "--files-dir", "/nonexistent-dir"], "--files-dir"),
    (["sparse", "--vocab", "0"], "--vocab"),
])
def test_new_usage_errors(tfdp_cli, args, needle, tmp_path):
    (tmp_path / "file").write_text("")  # a path below a regular file cannot be a directory
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    code, out, err = tfdp_cli(["bench", *args])
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tfdp bench: error: "), err
    assert needle in lines[0] and "Received:" in lines[0]


def test_unknown_command_lists_every_command(tfdp_cli):
    code, _, err = tfdp_cli(["bench", "frobnicate"])
    assert code == 2
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert "'frobnicate'" in line and ("Valid: " + ", ".join(commands())) in line


def test_top_level_help_lists_every_command(tfdp_cli):
    code, out, _ = tfdp_cli(["bench", "--help"])
    assert code == 0
    for name in commands():
        assert f"\n  {name} " in out, name
