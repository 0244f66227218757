"""examples/: the two-line single-device -> data-parallel diff, the wrappers, one real run."""

import difflib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
import _launch  # noqa: E402

WRAPPERS = {"resnet_cifar10.py": "resnet_cifar10.toml", "bert_mlm.py": "bert_mlm.toml",
            "recommender.py": "recommender.toml"}


def _read(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read().splitlines()


def test_workstation_twins_differ_by_exactly_two_added_lines():
    """The data-parallel twin is the single-device script plus two lines: nothing removed,
    nothing re-indented (tests/test_two_line.py runs both)."""
    single, dp = _read("workstation_vision_single.py"), _read("workstation_vision_dp.py")
    diff = [ln for ln in difflib.unified_diff(single, dp, lineterm="", n=0)
            if not ln.startswith(("---", "+++", "@@"))]
    removed = [ln[1:] for ln in diff if ln.startswith("-")]
    added = [ln[1:] for ln in diff if ln.startswith("+")]
    assert removed == [], diff
    assert len(added) == 2 and len(dp) == len(single) + 2, diff
    assert added[0] == "import tfdp", diff
    assert added[1].startswith("tfdp.set_default_strategy()"), diff
    assert not any(ln.lstrip().startswith("with ") for ln in dp) and "scope()" not in "\n".join(dp)


@pytest.mark.parametrize("script,config", sorted(WRAPPERS.items()))
def test_wrappers_name_an_existing_config(script, config):
    text = "\n".join(_read(script))
    assert f'run_config("{config}"' in text
    assert os.path.isfile(os.path.join(ROOT, "configs", config))


def test_wrapper_commands():
    workers, argv = _launch.command("bert_mlm.toml", ["--tiny", "--set", "train.epochs=1"])
    assert workers == 1
    assert argv == [os.path.join(ROOT, "configs", "bert_mlm.toml"), "--tiny", "--set",
                    "train.epochs=1"]
    workers, cmd = _launch.command("bert_mlm.toml", ["--workers", "2", "--tiny"], cpu_replicas=2)
    assert workers == 2
    i = cmd.index("--")
    assert cmd[1:i] == ["-m", "tfdp", "launch", "--workers", "2", "--cpu-replicas", "2"]
    assert cmd[i + 1:] == [sys.executable, "-m", "tfdp.train",
                           os.path.join(ROOT, "configs", "bert_mlm.toml"), "--tiny"]
    with pytest.raises(SystemExit, match="--workers"):
        _launch.command("bert_mlm.toml", ["--workers", "two"])


def test_every_example_has_a_usage_docstring():
    for name in sorted(os.listdir(EXAMPLES)):
        if name.endswith(".py") and not name.startswith("_"):
            text = "\n".join(_read(name))
            assert text.startswith('"""') and re.search(r"python examples/\w+\.py", text), name


@pytest.mark.timeout(120)
def test_workstation_vision_dp_runs_on_cpu_replicas(run_process):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env["TFDP_CPU_REPLICAS"] = "4"            # as its docstring says for hosts without a GPU
    env.pop("TF_CONFIG", None)
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "workstation_vision_dp.py"),
                        "--epochs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=110,
                       env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "DataParallelStrategy: 4 replica(s)" in p.stdout
    acc = float(re.search(r"test accuracy (\d\.\d+)", p.stdout).group(1))
    assert acc > 0.5, p.stdout    # 2 epochs: learning, well above chance (0.1)
