"""The pages run as written: every ```python block of README.md and docs/*.md, and every link resolves.

Each page's python blocks run in order in one namespace (later blocks build on earlier ones), in a fresh
process with 8 simulated CPU devices (as the examples do), with warnings as errors, in a temporary
working directory. The process is forked from one that has imported the libraries and nothing more
(``SERVER`` below). A block the reader does not need to see (a fragment's data, say) goes in a hidden
setup, an HTML comment that GitHub and mkdocs do not show::

    <!-- docs-test: setup
    ```python
    x_train = ...
    ```
    -->

A python block that must not run here (a multi-host launch) is preceded by
``<!-- docs-test: skip: <reason> -->``. Shell blocks (```bash) never run. Both are counted in
``NOT_RUN`` below, so that a block is never left out silently; ```text blocks are output, not code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

# page -> (python blocks skipped with a reason, shell blocks): what a page shows but this test does not run.
NOT_RUN = {
    "README.md": (0, 1),
    "docs/checkpoints.md": (0, 1),
    "docs/multiprocess.md": (1, 4),
    "docs/plan.md": (1, 1),
}
LANGUAGES = {"python", "bash", "text"}

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[^\n`]*)\n(?P<code>.*?)^(?P=indent)```[ ]*$",
                   flags=re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!-- docs-test: skip: (?P<reason>\S.*?) -->$")
SETUP = "<!-- docs-test: setup"


def blocks(text: str) -> list[dict]:
    """The fenced blocks of a page, in order: language, code (dedented), and whether and why it runs."""
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        indent = len(m.group("indent"))
        code = "".join(line[indent:] for line in m.group("code").splitlines(keepends=True))
        lang = m.group("lang").strip()
        skip = SKIP.fullmatch(before)
        found.append({"lang": lang, "code": code, "hidden": before == SETUP,
                      "skip": skip.group("reason") if skip else None,
                      "line": text.count("\n", 0, m.start()) + 1})
    return found


def python_to_run(page: str) -> list[dict]:
    return [b for b in blocks((ROOT / page).read_text()) if b["lang"] == "python" and not b["skip"]]


def test_blocks_are_parsed():
    text = ("a\n```python\na = 1\n```\n<!-- docs-test: skip: needs 4 hosts -->\n```python\nb = 2\n```\n"
            "<!-- docs-test: setup\n```python\nc = 3\n```\n-->\n* item:\n\n  ```text\n  out\n  ```\n")
    found = blocks(text)
    assert [(b["lang"], b["code"], b["hidden"], b["skip"]) for b in found] == [
        ("python", "a = 1\n", False, None), ("python", "b = 2\n", False, "needs 4 hosts"),
        ("python", "c = 3\n", True, None), ("text", "out\n", False, None)]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_accounted_for(page):
    """Every fence has a known language; what does not run is counted in NOT_RUN, with a reason."""
    found = blocks((ROOT / page).read_text())
    untagged = [b["line"] for b in found if b["lang"] not in LANGUAGES]
    assert not untagged, (f"{page}: blocks at lines {untagged} have no language among {sorted(LANGUAGES)}; "
                          "tag them (```python runs here, ```bash and ```text do not)")
    skipped = sum(1 for b in found if b["lang"] == "python" and b["skip"])
    shell = sum(1 for b in found if b["lang"] == "bash")
    assert (skipped, shell) == NOT_RUN.get(page, (0, 0)), (
        f"{page}: {skipped} python block(s) skipped and {shell} shell block(s), but NOT_RUN says "
        f"{NOT_RUN.get(page, (0, 0))}: run the block, or update NOT_RUN with it")


# Files the README links to that other changes of this session write (the test tiers; the layout);
# their links are checked once they exist.
PENDING: set[pathlib.Path] = set()  # link targets another change is writing (none now)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's and mkdocs' anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("page", [*PAGES, "benchmarks/README.md"])
def test_relative_links_resolve(page):
    """mkdocs checks links between docs/ pages; this also checks those to README.md, examples/, ..."""
    path = ROOT / page
    broken = []
    for m in LINK.finditer(path.read_text()):
        target = m.group("target")
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            if resolved not in PENDING:
                broken.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", resolved.read_text(), flags=re.MULTILINE)
            if anchor not in {slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page}: links to missing files or headings: {broken}"


# One process imports what the pages import (about 9 s of CPU: Keras, JAX, optax, mirrorax), without
# starting JAX's backend, then forks a fresh child per page: each page still starts from a process in
# which nothing has run (no Keras names, no devices, no compiled programs, no global policy), and no page
# sees another's state, but none pays the imports again. JAX forbids a fork once its backend is up (it
# warns, and a warning is an error here): the server checks that it is not.
SERVER = r"""
import json, os, sys, time, traceback
import jax, keras, numpy, optax
import mirrorax
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "JAX's backend started before the fork"
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    page, blocks, cwd, log = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the page's own process
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.chdir(cwd)
            namespace = {"__name__": "__doc_sample__"}
            for i, code_text in blocks:
                start = time.perf_counter()
                exec(compile(code_text, f"{page}, python block {i}", "exec"), namespace)
                print(f"docs-test: {page} block {i}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        sys.exit(code)  # through the interpreter's exit: atexit handlers (Orbax, JAX) run as in a script
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
               # the tree under test, and the repository root for `benchmarks` (docs/plan.md)
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
               # as tests/conftest.py: skip LLVM's expensive passes (numerics unchanged), compile faster
               XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_llvm_disable_expensive_passes=true".strip())
    return env


WARNINGS_AS_ERRORS = ["-W", "error", "-W", "ignore::DeprecationWarning", "-W", "ignore::PendingDeprecationWarning",
                      "-W", "ignore::ResourceWarning"]


class PageServer:
    """The forking server: ``run(page, cwd, timeout)`` runs a page in a fresh child, returns (exit, log)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, *WARNINGS_AS_ERRORS, "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=_environment())
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._reply(timeout=300, want="ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # the server ended

    def _reply(self, timeout: float, want: str) -> int:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line:
            if line is not None:
                self.proc.wait()
            raise RuntimeError(f"the docs page server gave no {want!r} within {timeout:.0f} s "
                               f"(server exit status {self.proc.poll()})")
        return json.loads(line)[want]

    def run(self, page: str, cwd: pathlib.Path, timeout: float) -> tuple[int, str]:
        assert self.proc.stdin is not None
        log = cwd / "page.log"
        to_run = [(i + 1, b["code"]) for i, b in enumerate(python_to_run(page))]
        self.proc.stdin.write(json.dumps([page, to_run, str(cwd), str(log)]) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(timeout=60, want="pid")
        try:
            status = self._reply(timeout=timeout, want="exit")
        except RuntimeError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._reply(timeout=60, want="exit")  # the killed child's, so that the next page reads its own
            raise RuntimeError(f"{page} ran past {timeout:.0f} s:\n{log.read_text()[-6000:]}") from None
        return status, log.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def page_server():
    server = PageServer()
    yield server
    server.close()


RUNNABLE = [page for page in PAGES if python_to_run(page)]


@pytest.mark.slow  # each page compiles its own small models: 5-30 s of CPU a page
@pytest.mark.multi_device
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", RUNNABLE)
def test_page_runs(page, tmp_path, page_server):
    start = time.perf_counter()
    status, log = page_server.run(page, tmp_path, timeout=360)
    assert status == 0, f"{page} failed (exit {status}) after {time.perf_counter() - start:.0f} s:\n{log[-8000:]}"


def test_api_reference_covers_the_public_names():
    """docs/api/ renders each name of ``mirrorax.__all__`` once (``::: mirrorax.Name``), and nothing else."""
    import mirrorax

    shown = [m for p in sorted((ROOT / "docs" / "api").glob("*.md"))
             for m in re.findall(r"^::: mirrorax\.(\w+)$", p.read_text(), flags=re.MULTILINE)]
    assert sorted(shown) == sorted(set(shown)), f"shown twice: {sorted(n for n in set(shown) if shown.count(n) > 1)}"
    assert set(shown) == set(mirrorax.__all__), (
        f"docs/api/ misses {sorted(set(mirrorax.__all__) - set(shown))} and shows non-exported "
        f"{sorted(set(shown) - set(mirrorax.__all__))}: add a '::: mirrorax.Name' line to the page of its group")
