"""Every command in README.md runs as written and does what the text says.

The commands are extracted from README.md's fenced shell blocks (```bash, ```sh, ```shell,
```console) and run in a fresh process each, from the repository root, with hard timeouts:

* ``tfdp train CONFIG ...`` (also under ``tfdp launch ... --``, and ``python -m tfdp train``)
  runs in ``--tiny`` form, except the two the README quotes figures for, which run as written
  (FULL below: they must meet their targets, exit 0);
* ``python examples/X.py``: a wrapper of a config gets ``--tiny``, a script ``--epochs 1``;
* ``pip install -e ".[extra]"``: not run (the test runs inside that install); the extra must exist
  in setup.py. ``pytest``: not run (this is it). ``mkdocs serve`` / ``mkdocs build``: not run
  here; tests/test_docs.py builds the site with --strict and opens it in a browser;
* a block right after an ``<!-- readme-test: skip (reason) -->`` line is not run (two real hosts,
  SLURM, a GPU install): the reason must be given.

The README's other code blocks (the two-line change) run in tests/test_docs.py with the docs'
blocks, which reuses this module's extraction and command plans. ``TFDP_README=path`` points the
test at another copy of the README.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.environ.get("TFDP_README") or os.path.join(ROOT, "README.md")
SHELL_FENCES = ("bash", "sh", "shell", "console")
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")

# Run as written (the docs quote their results and times); every other tfdp train: --tiny.
FULL = {
    "tfdp train configs/quickstart.toml",
    "tfdp train configs/resnet_cifar10.toml --set train.epochs=1 --baseline",
}


def code_blocks(text, skip=SKIP):
    """``[(first line number, language, block text, skip reason or None)]`` of every fenced
    block; the skip reason comes from a ``skip`` marker on the last non-blank line before it."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        why = skip.search(before)
        out.append((start + 1, lang, "\n".join(lines[start:j]), why.group("why") if why else None))
        i = j + 1
    return out


def _blocks(text):
    """``[(first line number, block text, skip reason or None)]`` of the shell blocks."""
    return [(line, block, why) for line, lang, block, why in code_blocks(text)
            if lang in SHELL_FENCES]


def shell_commands(block):
    """Shell words of each command of a block (comments dropped, ``\\`` continuations joined,
    ``&&`` chains split)."""
    text = re.sub(r"\\\n", " ", block)
    cmds, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:        # a quote that goes on on the next line
            continue
        pending = ""
        cur = []
        for w in words + ["&&"]:
            if w == "&&":
                if cur:
                    cmds.append(cur)
                cur = []
            else:
                cur.append(w)
    return cmds


_commands = shell_commands


def _readme_commands():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    out = []
    for line, block, skip in _blocks(text):
        if skip:
            out.append(pytest.param(None, skip, id=f"line{line}-skipped"))
            continue
        for words in _commands(block):
            out.append(pytest.param(words, None, id=f"line{line}:{shlex.join(words)[:60]}"))
    return out


def _split_env(words):
    env, i = {}, 0
    while i < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[i]):
        k, v = words[i].split("=", 1)
        env[k] = v
        i += 1
    return env, words[i:]


def _is_wrapper(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        text = f.read()
    return "run_config(" in text or "cli_main(" in text


def _check_extras(argv):
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        setup = f.read()
    for spec in argv[2:]:
        for extra in re.findall(r"\[([\w,]+)\]", spec):
            for e in extra.split(","):
                assert f'"{e}"' in setup, f"installs extra {e!r}, not in setup.py"


def runnable(words, full=FULL):
    """(argv to run, extra env, timeout) for a shell command; None: checked, not run."""
    env, argv = _split_env(list(words))
    if argv[:2] == ["pip", "install"]:
        _check_extras(argv)
        return None
    if argv == ["pytest"] or argv[:1] == ["pytest"]:
        return None
    if argv[:1] == ["mkdocs"]:   # tests/test_docs.py builds the site (--strict) and browses it
        assert argv[1:2] in (["serve"], ["build"]), f"unknown mkdocs command: {argv}"
        assert os.path.isfile(os.path.join(ROOT, "mkdocs.yml")), "mkdocs.yml is missing"
        return None
    text = shlex.join(argv)
    tiny = text not in full
    train_at = None
    for k in range(len(argv)):
        if argv[k:k + 2] == ["tfdp", "train"] or argv[k:k + 3] == ["python", "-m", "tfdp"] \
                and argv[k + 3:k + 4] == ["train"]:
            train_at = k
    if any(a in ("--help", "-h", "--keys") for a in argv):
        timeout = 120
    elif train_at is not None:
        if tiny and "--tiny" not in argv:
            argv = argv + ["--tiny"]
        timeout = 280 if "launch" in argv[:train_at] else (240 if not tiny else 180)
    elif argv[:1] == ["python"] and len(argv) > 1 and argv[1].endswith(".py"):
        assert os.path.isfile(os.path.join(ROOT, argv[1])), \
            f"runs {argv[1]}, which does not exist: {text}"
        argv = argv + (["--tiny"] if _is_wrapper(argv[1]) else ["--epochs", "1"])
        timeout = 240
    elif argv[:2] == ["tfdp", "launch"]:
        i = argv.index("--")
        script = argv[i + 2] if argv[i + 1:i + 2] == ["python"] else None
        assert script is None or os.path.isfile(os.path.join(ROOT, script)), \
            f"runs {script}, which does not exist: {text}"
        if script and "--epochs" in argv:
            argv[argv.index("--epochs") + 1] = "1"
        timeout = 280
    else:
        timeout = 120
    out = []
    for a in argv:        # the venv's tfdp and python, whatever PATH says
        out.extend([sys.executable, "-m", "tfdp"] if a == "tfdp" else
                   [sys.executable] if a == "python" else [a])
    argv = out
    return argv, env, timeout


_runnable = runnable


def run_as_written(words, full=FULL):
    """Run one shell command (its plan from :func:`runnable`) and check it did its job."""
    plan = runnable(words, full)
    if plan is None:
        return
    argv, extra_env, timeout = plan
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_CPU_REPLICAS", "TF_CONFIG")}
    env.update(CUDA_VISIBLE_DEVICES="", **extra_env)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)      # as a user runs it: tfdp's own default
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (shlex.join(words), p.stdout[-3000:], p.stderr[-3000:])
    quick = any(a in ("--help", "-h", "--keys") for a in words)
    if words and "train" in words and "launch" not in words and not quick:
        assert "tfdp train:" in p.stdout and "final metrics" in p.stdout, p.stdout[-3000:]
        assert "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("words,skip", _readme_commands())
def test_readme_command_runs_as_written(run_process, words, skip):
    if skip is not None:
        assert len(skip.strip()) > 5, "a skipped README block says why"
        pytest.skip(f"README block not run here: {skip}")
    run_as_written(words)


def test_readme_has_commands_and_every_skip_says_why():
    cmds = _readme_commands()
    assert len(cmds) >= 5
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert "tfdp train configs/quickstart.toml" in text
    for m in re.finditer(r"<!--\s*readme-test:[^>]*-->", text):
        assert SKIP.match(m.group(0)), f"malformed marker {m.group(0)!r}"


def test_readme_starts_with_the_two_commands_and_states_the_suite_time_by_them():
    """A newcomer reads the two commands first, each with its install step, and the test
    suite's duration right after them (not hundreds of lines further): in the two paragraphs
    that follow, after the one that says what the commands do (issue 33)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    first = code_blocks(text)[0]
    assert first[1] == "bash", first
    cmds = shell_commands(first[2])
    assert cmds == [["pip", "install", "-e", ".[examples]"],
                    ["tfdp", "train", "configs/quickstart.toml"],
                    ["pip", "install", "-e", ".[test]"], ["pytest"]], cmds
    after = text[text.index("```", text.index("```") + 3) + 3:]
    after = "\n\n".join(after.strip().split("\n\n")[:2])
    assert re.search(r"\d+ minutes", after), f"no suite duration by the test command: {after!r}"
    assert len(text.splitlines()) < 250, "the README is for a five-minute read: move it to docs/"
