"""The documentation site (mkdocs.yml, docs/): it builds with --strict, it renders in a real
browser, and every code block on it runs as written.

* The site is built once per session with ``mkdocs build --strict`` into a temporary directory:
  a broken link or anchor, a page missing from the nav, or an API object mkdocstrings cannot find
  fails the build (mkdocs.yml's ``validation``).
* A real headless browser (Debian's ``chromium``) opens the home page and the API page, served by
  ``python -m http.server`` on 127.0.0.1: their navigation and content must be in the rendered
  DOM, and a screenshot must have been drawn. Site search is typed into, key by key, over the
  DevTools protocol (tests/browser.py), and must list the pages that hold the query. Without
  chromium these tests are skipped with the reason, except under CI (``CI`` set), where .ci/run
  installs it and a missing browser fails.
* Code blocks of every page (and the README's non-shell blocks: the two-line change):
  ``python`` blocks run as scripts, ``diff`` blocks as the script after the change, each in a
  fresh process in a temporary directory on 2 CPU replicas (``TFDP_CPU_REPLICAS=2``); shell
  blocks run as tests/test_readme.py runs the README's (``tfdp train`` in ``--tiny`` form but
  for the two commands whose figures the docs quote, ``python examples/X.py`` tiny, ``pip
  install`` checked against setup.py's extras); ``tfdp bench`` commands take minutes, so they are
  parsed by their own command-line parser (every option and value checked) and not run, except
  the instant ones (``--help``; ``scaling`` without ``--measure``); ``toml`` blocks must name the
  file they quote (``# path (excerpt)``) and match it. A command the README also shows runs once,
  in tests/test_readme.py. A block after ``<!-- docs-test: skip (reason) -->`` is not run. The
  runs are ``slow`` and, by their ``run_process`` fixture, ``e2e``.
* A time stated in a page's prose has the command that measured it in its section (or in the
  page's preamble, for a page of one command's results); the user-pattern tables name the
  ``tfdp bench patterns`` command that gives exactly their rows.
* Figures and tables stated in two places stay equal: the supported-versions table (README and
  docs/install.md, both checked against setup.py and .ci/run), the suite's duration (README and
  docs/development.md), and the ``tfdp bench`` commands (docs/reference/cli.md lists exactly
  the commands of tfdp_bench/cli.py).
"""

import contextlib
import glob
import http.client
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib

import pytest

from test_readme import FULL, README, ROOT, code_blocks, run_as_written, shell_commands

DOCS = os.path.join(ROOT, "docs")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
SHELL = ("bash", "sh", "shell", "console")
NOT_RUN = ("text", "yaml", "json")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    """Every markdown page of the site, relative to docs/."""
    paths = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    return sorted(os.path.relpath(p, DOCS) for p in paths)


def _readme_shell_commands():
    out = set()
    for _, lang, block, skip in code_blocks(_read(README)):
        if lang in SHELL and not skip:
            out.update(shlex.join(w) for w in shell_commands(block))
    return out


def _bench(words):
    """(bench command, its arguments) for ``tfdp bench X ...`` / ``python -m tfdp_bench.X``."""
    if words[:2] == ["tfdp", "bench"] and len(words) > 2 and not words[2].startswith("-"):
        return words[2], words[3:]
    if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith("tfdp_bench."):
        return words[2].rsplit(".", 1)[1], words[3:]
    return None


def _instant_bench(name, args):
    return "--help" in args or "-h" in args or (name == "scaling" and "--measure" not in args)


def _after_diff(block):
    """The script a ``diff`` block ends with (context and added lines)."""
    lines = []
    for line in block.splitlines():
        if line.startswith("-"):
            continue
        lines.append(line[1:] if line[:1] in ("+", " ") else line)
    return "\n".join(lines) + "\n"


def _collect():
    """(runs, bench commands, toml blocks): every code block of the docs and the README."""
    readme_cmds = _readme_shell_commands()
    runs, benches, tomls, seen = [], [], [], set()
    sources = [(p, os.path.join(DOCS, p)) for p in _pages()] + [("README.md", README)]
    for name, path in sources:
        for line, lang, block, skip in code_blocks(_read(path), SKIP):
            where = f"{name}:{line}"
            if skip or lang in NOT_RUN:
                continue
            if lang in ("python", "diff"):
                script = block + "\n" if lang == "python" else _after_diff(block)
                if script not in seen:
                    seen.add(script)
                    runs.append(pytest.param("script", script, id=f"{where}-{lang}"))
            elif lang == "toml":
                tomls.append(pytest.param(block, id=where))
            elif lang in SHELL and name != "README.md":
                for words in shell_commands(block):
                    text = shlex.join(words)
                    if text in readme_cmds or text in seen:
                        continue        # run once: tests/test_readme.py runs the README's
                    seen.add(text)
                    bench = _bench(words)
                    if bench and not _instant_bench(*bench):
                        benches.append(pytest.param(words, id=f"{where}:{text[:60]}"))
                    else:
                        runs.append(pytest.param("shell", words, id=f"{where}:{text[:60]}"))
            elif lang not in SHELL:
                raise AssertionError(f"{where}: a ```{lang} block: tests/test_docs.py does not "
                                     "know how to check it (add it to NOT_RUN or teach the test)")
    return runs, benches, tomls


RUNS, BENCHES, TOMLS = _collect()


# --- the site builds, strictly ---------------------------------------------------------------

def _mkdocs_env():
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"      # Material's end-of-life banner: not a build warning
    return env


@pytest.fixture(scope="session")
def site(run_process, tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs tools come with the test extra (setup.py)")
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_mkdocs_env(), stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return str(out)


def test_site_builds_strictly_with_every_page_and_the_api(site):
    for page in ("index.html", "reference/index.html", "reference/data/index.html",
                 "reference/callbacks/index.html", "reference/cluster/index.html",
                 "guide/strategy/index.html", "guide/troubleshooting/index.html",
                 "correctness/index.html", "benchmarks/index.html", "architecture/index.html"):
        assert os.path.isfile(os.path.join(site, page)), page
    api = _read(os.path.join(site, "reference", "index.html"))
    for name in ("DataParallelStrategy", "set_default_strategy", "configure_cpu_replicas",
                 "MultiWorkerDataParallelStrategy"):
        assert f'id="tfdp.' in api and name in api, name
    assert "BackupAndRestore" in _read(os.path.join(site, "reference", "callbacks", "index.html"))
    assert "distribute" in _read(os.path.join(site, "reference", "data", "index.html"))
    for png in ("allreduce_busbw.png", "allreduce_workers_busbw.png"):  # the plots are served
        assert os.path.isfile(os.path.join(site, png)), png
    assert 'src="../allreduce_busbw.png"' in _read(
        os.path.join(site, "benchmarks", "index.html")).replace("'", '"')


def test_api_signatures_are_formatted_one_parameter_a_line(site):
    """mkdocstrings formats a signature with black (the docs extra): a long one is one
    parameter a line, none wider than mkdocs.yml's line_length, not one clipped line."""
    import html
    signatures = []
    for page in glob.glob(os.path.join(site, "reference", "**", "index.html"), recursive=True):
        for block in re.findall(r'<div class="doc-signature highlight"><pre>(.*?)</pre>',
                                _read(page), re.S):
            signatures.append(html.unescape(re.sub(r"<[^>]+>", "", block)).strip("\n"))
    assert signatures, "no API signature found in the site"
    strategy = [s for s in signatures if s.startswith("DataParallelStrategy(")]
    assert strategy and "\n    all_reduce: str = " in strategy[0], strategy[:1]
    wide = [line for s in signatures for line in s.splitlines() if len(line) > 80]
    assert not wide, wide[:5]


def test_every_public_name_of_tfdp_is_in_the_api_reference(site):
    import tfdp
    api = _read(os.path.join(site, "reference", "index.html"))
    for name in tfdp.__all__:
        if name in ("data", "callbacks"):
            assert os.path.isfile(os.path.join(site, "reference", name, "index.html")), name
        elif name != "__version__":
            assert f"tfdp.{name}" in api, f"tfdp.{name} is public but not in the API reference"


def test_readme_links_point_at_existing_pages_and_anchors(site):
    text = _read(README)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links to the docs"
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        if not path:            # an anchor of the README itself
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", text, re.M)}
            assert anchor in slugs, f"README links to #{anchor}, which is not one of its headings"
            continue
        assert os.path.exists(os.path.join(ROOT, path)), f"README links to {path}: missing"
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            page = path[len("docs/"):-len(".md")]
            page = "index.html" if page == "index" else (
                page[:-len("/index")] if page.endswith("/index") else page) + "/index.html"
            html = _read(os.path.join(site, page.lstrip("/")))
            assert f'id="{anchor}"' in html, f"README links to {link}: no such anchor"


# --- the site renders in a real browser -----------------------------------------------------

def _browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("no headless browser: .ci/run installs Debian's chromium "
                    "(apt-get install -y chromium) before the tests")
    pytest.skip("chromium is not installed here (Debian: apt-get install -y chromium); "
                "CI installs it and runs this test")


def _wait_http(port, deadline):
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/")
            if c.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"http.server on 127.0.0.1:{port} did not answer")


def _chromium(browser, profile, *args):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
    return p.stdout


@contextlib.contextmanager
def _served(site):
    """The built site served by ``python -m http.server`` on 127.0.0.1: its base URL."""
    import portpicker
    port = portpicker.pick_unused_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", site],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL)
    try:
        _wait_http(port, time.monotonic() + 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


@pytest.mark.timeout(240)
def test_home_and_api_pages_render_with_their_navigation_in_a_real_browser(run_process, site,
                                                                            tmp_path):
    browser = _browser()
    with _served(site) as base:
        nav = ("User guide", "API reference", "Correctness record", "Benchmarks",
               "Troubleshooting", "Install and versions")
        pages = {
            "home": ("/", ("The two commands", "The two-line change",
                           "tfdp.DataParallelStrategy", "MirroredStrategy")),
            "api": ("/reference/", ("API reference", "tfdp.DataParallelStrategy",
                                    "tfdp.set_default_strategy", "tfdp.configure_cpu_replicas",
                                    "Parameters")),
        }
        for name, (path, content) in pages.items():
            dom = _chromium(browser, tmp_path / f"profile-{name}", "--dump-dom", base + path)
            assert 'class="md-nav' in dom, f"{name}: no navigation in the rendered page"
            for text in nav + content:
                assert text in dom, f"{name} page ({path}) as rendered lacks {text!r}"
            shot = tmp_path / f"{name}.png"
            _chromium(browser, tmp_path / f"shot-{name}", "--window-size=1280,1600",
                      f"--screenshot={shot}", base + path)
            with open(shot, "rb") as f:
                png = f.read()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000, \
                f"{name}: the screenshot is missing or blank ({len(png)} bytes)"
            keep = os.environ.get("TFDP_DOCS_SCREENSHOTS")   # a folder to look at them in
            if keep:
                shutil.copy(shot, os.path.join(keep, f"{name}.png"))


@pytest.mark.timeout(240)
def test_site_search_finds_what_a_user_types_in_a_real_browser(run_process, site, tmp_path):
    """A user types ``zero_stage`` into the search box of the home page (real input events, in
    headless Chromium over the DevTools protocol: tests/browser.py) and Material's search worker
    lists the pages that hold it: the sharded-optimizer guide and the API reference."""
    from browser import Browser
    with _served(site) as base, Browser(_browser(), tmp_path / "profile") as b:
        b.open(base + "/")
        b.type_into(".md-search__input", "zero_stage")
        found = b.wait_for("document.querySelectorAll('.md-search-result__item').length")
        meta = b.evaluate("(document.querySelector('.md-search-result__meta') || {}).textContent")
        assert found, f"no search result for 'zero_stage' (the result line reads {meta!r})"
        links = b.evaluate("[...document.querySelectorAll('.md-search-result__item a')]"
                           ".map(a => a.getAttribute('href'))")
        assert re.search(r"\d+ matching documents?", meta or ""), meta
        for page in ("guide/sharded-optimizer/", "reference/"):
            assert any(page in link for link in links), (page, links)
        b.type_into(".md-search__input", "qqxqqxnothing")
        meta = "(document.querySelector('.md-search-result__meta') || {}).textContent"
        assert b.wait_for(f"/^No matching/.test({meta})", timeout=20), \
            f"a query that matches nothing: {b.evaluate(meta)!r}"


# --- what the docs state twice stays equal ---------------------------------------------------

def _versions_table(text, where):
    m = re.search(r"<!-- versions-table:[^>]*-->\n((?:\|.*\n)+)", text)
    assert m, f"{where}: no table after a <!-- versions-table: ... --> marker"
    return m.group(1)


def test_supported_versions_table_is_the_same_in_readme_and_docs_and_true():
    readme = _versions_table(_read(README), "README.md")
    docs = _versions_table(_read(os.path.join(DOCS, "install.md")), "docs/install.md")
    assert readme == docs, "README.md and docs/install.md state different supported versions"
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    setup = _read(os.path.join(ROOT, "setup.py"))
    tf_range = SpecifierSet(re.search(r'TF_RANGE = "([^"]+)"', setup).group(1))
    keras_range = SpecifierSet(re.search(r'KERAS_RANGE = "([^"]+)"', setup).group(1))
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in readme.splitlines()[2:]]
    tfs = [r[0] for r in rows]
    assert tfs == sorted(tfs, key=Version, reverse=True)
    assert all(Version(t) in tf_range for t in tfs), (tfs, tf_range)
    assert not Version(f"{tfs[-1].split('.')[0]}.{int(tfs[-1].split('.')[1]) - 1}") in tf_range
    assert not Version(f"{tfs[0].split('.')[0]}.{int(tfs[0].split('.')[1]) + 1}") in tf_range
    for row in rows:
        lo, hi = row[1].split("-")
        assert Version(lo) in keras_range and Version(hi + ".99") in keras_range, row
        assert Version(f"3.{int(lo.split('.')[1]) - 1}.99") not in keras_range, row
        assert Version(f"3.{int(hi.split('.')[1]) + 1}") not in keras_range, row
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    stages = re.search(r'COMPAT_STAGES=\$\{TFDP_CI_COMPAT_STAGES-"([^"]*)"\}', ci).group(1).split()
    for pair in stages:
        tf, keras = pair.split(":")
        assert f"TF {tf} + Keras {keras}" in readme, f"CI stage {pair} is not in the table"


def _suite_duration(text):
    """The suite's size and duration, ``("1,380", "19")``, from ``(1,380 tests; 19 minutes``
    (the README states them in one short line, docs/development.md with the tiers' details)."""
    m = re.search(r"\((\d[\d,]*) tests; ([\d.]+) minutes", text)
    return m.groups() if m else None


def test_suite_duration_is_stated_once_and_the_same_in_readme_and_docs():
    readme = _suite_duration(_read(README))
    assert readme, "README.md states the suite's duration by its test command"
    docs = _suite_duration(_read(os.path.join(DOCS, "development.md")))
    assert docs == readme, (readme, docs)


# A stated time: "137 s", "19.5 minutes", "8.5 ms"; not inside code, not "5-second" (an adjective).
_TIME = re.compile(r"(?<![\w.-])\d+(?:[.,]\d+)?\s?(?:ms|s|min|minutes?|seconds?|hours?|h)\b(?![-\w])")
# A command that measures: an inline code span or a shell block that starts with one of these.
_MEASURING = r"(?:tfdp |pytest|python |\.ci/run|pip |srun |sbatch |mkdocs |time |TFDP_\w+=|CI=)"
_COMMAND = re.compile(rf"`{_MEASURING}[^`]*`|```(?:{'|'.join(SHELL)})\n")


def _sections(text):
    """(heading, text) of a page's sections; the first is the preamble (heading None)."""
    out, heading, lines, fence = [], None, [], False
    for line in text.splitlines():
        fence ^= line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            out.append((heading, "\n".join(lines)))
            heading, lines = line, []
        else:
            lines.append(line)
    out.append((heading, "\n".join(lines)))
    return out


def test_no_page_states_a_time_without_the_command_that_measured_it():
    """A time stated in a page's prose (a table's cell included; code blocks and spans are the
    commands and their output) has its command nearby: in the same section, or in the page's
    preamble when the whole page is one command's results (docs/benchmarks/embedding.md)."""
    missing = []
    for name, path in [(p, os.path.join(DOCS, p)) for p in _pages()] + [("README.md", README)]:
        sections = _sections(_read(path))
        top = [b for h, b in sections[:2] if h is None or h.startswith("# ")]  # before any ##
        preamble = any(_COMMAND.search(b) for b in top)
        for heading, body in sections:
            prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", body, flags=re.S))
            times = _TIME.findall(prose)
            if times and not (_COMMAND.search(body) or preamble):
                missing.append(f"{name} {heading or '(preamble)'}: {', '.join(times[:4])}")
    assert not missing, ("times stated without the command that measured them (name it: "
                         "`tfdp bench ...`, `pytest ...`, `python ...`):\n" + "\n".join(missing))


@pytest.mark.parametrize("page", ["patterns.md", "patterns_losses.md"])
def test_pattern_tables_name_the_command_that_gives_exactly_their_rows(page):
    """``tfdp bench patterns`` prints its command under its table (tfdp_bench/patterns.py); the
    pages that show a table show that command, and it selects the table's rows."""
    from tfdp_bench.patterns import command_line, parse_args
    text = _read(os.path.join(DOCS, "benchmarks", page))
    command = re.search(r"^Command: `(tfdp bench patterns[^`]*)`$", text, re.M)
    assert command, f"benchmarks/{page} does not name its tfdp bench patterns command"
    args = parse_args(shlex.split(command.group(1))[3:])
    rows = [r for r in re.findall(r"^\| (\w+)(?: \(per-replica semantics\))? \|", text, re.M)
            if r != "row"]
    assert args.rows == rows, (args.rows, rows)
    assert command_line(args) == command.group(1)


def test_cli_page_lists_every_bench_command():
    from tfdp_bench.cli import COMMANDS
    text = _read(os.path.join(DOCS, "reference", "cli.md"))
    table = re.search(r"<!-- bench-commands:[^>]*-->\n((?:\|.*\n)+)", text).group(1)
    listed = re.findall(r"^\| `([\w-]+)` \|", table, re.M)
    assert sorted(listed) == sorted(COMMANDS), (
        f"docs/reference/cli.md lists {sorted(listed)}; tfdp bench has {sorted(COMMANDS)}")


def test_every_docs_skip_marker_says_why():
    for page in _pages():
        text = _read(os.path.join(DOCS, page))
        for m in re.finditer(r"<!--\s*docs-test:[^>]*-->", text):
            assert SKIP.match(m.group(0)) and len(SKIP.match(m.group(0)).group("why")) > 5, \
                f"{page}: malformed marker {m.group(0)!r}"


def test_docs_have_code_blocks_to_run():
    assert len(RUNS) >= 10 and len(BENCHES) >= 5 and TOMLS, (len(RUNS), len(BENCHES), len(TOMLS))


# --- every code block runs -------------------------------------------------------------------

@pytest.mark.parametrize("words", BENCHES)
def test_docs_bench_command_parses(words, monkeypatch):
    """``tfdp bench`` commands take minutes: their arguments go through the command's own
    parser (every option and value validated, as before TensorFlow starts) instead."""
    from tfdp_bench.cli import command_module
    monkeypatch.chdir(ROOT)              # relative --plot / --json paths, as from the repo root
    name, args = _bench(words)
    command_module(name).parse_args(args)


@pytest.mark.parametrize("block", TOMLS)
def test_docs_toml_block_matches_the_file_it_quotes(block):
    first = block.splitlines()[0]
    m = re.match(r"^#\s*(\S+\.toml)(\s+\(excerpt\))?\s*$", first)
    assert m, f"a TOML block starts with '# <file>.toml (excerpt)': {first!r}"
    quoted, actual = tomllib.loads(block), tomllib.loads(_read(os.path.join(ROOT, m.group(1))))
    for section, keys in quoted.items():
        for key, value in keys.items():
            assert actual.get(section, {}).get(key) == value, \
                f"[{section}] {key} = {value!r} in the docs, {actual.get(section, {}).get(key)!r} in {m.group(1)}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,code", RUNS)
def test_docs_code_block_runs_as_written(run_process, kind, code, tmp_path):
    if kind == "shell":
        run_as_written(code, FULL)
        return
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_CPU_REPLICAS", "TF_CONFIG")}
    env.update(TFDP_CPU_REPLICAS="2", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (code, p.stdout[-3000:], p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


def test_the_two_line_change_is_two_added_lines():
    diffs = [b for _, lang, b, _ in code_blocks(_read(README)) if lang == "diff"]
    assert diffs, "the README shows the two-line change"
    for block in diffs:
        lines = block.splitlines()
        assert [ln[1:] for ln in lines if ln.startswith("+")] == [
            "import tfdp",
            "tfdp.set_default_strategy()    # a DataParallelStrategy() is this program's "
            "default strategy"], lines
        assert not [ln for ln in lines if ln.startswith("-")], lines


_QUOTES = re.compile(r"`(?P<path>[\w./-]+\.\w+)` in full|abridged from `(?P<abridged>[\w./-]+\.\w+)`")


def _quoted_blocks():
    """``[(page, line, path, block, whole)]``: every code block the text before it says is a
    file's full text (``whole``) or abridged from a file."""
    out = []
    for page in _pages() + ["../README.md"]:
        text = _read(os.path.join(DOCS, page))
        lines = text.splitlines()
        for line, _, block, _ in code_blocks(text):
            before = " ".join(lines[max(0, line - 6):line - 1])
            found = list(_QUOTES.finditer(before))
            if found:
                m = found[-1]
                out.append((page, line, m.group("path") or m.group("abridged"), block,
                            m.group("path") is not None))
    return out


def test_snippets_that_quote_a_file_match_it():
    """A snippet said to be a file "in full" is the file's text; one "abridged from" a file has
    only the file's lines (but lines with an ellipsis: what was left out)."""
    quoted = _quoted_blocks()
    assert quoted, "no page quotes a file (the check would check nothing)"
    for page, line, path, block, whole in quoted:
        actual = _read(os.path.join(ROOT, path))
        where = f"docs/{page}:{line} quotes {path}"
        if whole:
            assert block.strip() == actual.strip(), f"{where} 'in full', and it differs"
            continue
        lines = {ln.strip() for ln in actual.splitlines()}
        extra = [ln for ln in block.splitlines()
                 if ln.strip() and "..." not in ln and ln.strip() not in lines]
        assert not extra, f"{where} (abridged), but these lines are not the file's: {extra}"


def test_diff_output_shown_in_the_docs_is_the_files_diff(run_process):
    shown = [(page, block) for page in _pages() + ["../README.md"]
             for _, lang, block, _ in code_blocks(_read(os.path.join(DOCS, page)))
             if lang == "text" and block.startswith("$ diff ")]
    assert shown, "no page shows a diff's output (the check would check nothing)"
    for page, block in shown:
        command, _, output = block.partition("\n")
        actual = subprocess.run(shlex.split(command[2:]), cwd=ROOT, capture_output=True,
                                text=True, timeout=30).stdout
        assert output.strip() == actual.strip(), f"docs/{page}: `{command[2:]}` prints:\n{actual}"
