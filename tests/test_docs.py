"""The pages run as written: every ```python block of README.md and docs/*.md, and every link resolves.

Each page's python blocks run in order in one namespace (later blocks build on earlier ones), in a fresh
process with 8 simulated CPU devices (as the examples do), with warnings as errors, in a temporary
working directory. The process is forked from one that has imported the libraries and nothing more
(``tests/jobs/forks.py``). A block the reader does not need to see (a fragment's data, say) goes in a hidden
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

import os
import pathlib
import re
import time

import pytest
from jobs.forks import TENSORFLOW_IF_INSTALLED, ForkServer
from jobs.procs import suite_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

# page -> (python blocks skipped with a reason, shell blocks): what a page shows but this test does not run.
NOT_RUN = {
    "README.md": (0, 1),
    "docs/checkpoints.md": (0, 1),
    "docs/elastic.md": (1, 1),
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


def test_no_merge_conflict_is_left_in_the_tree():
    """A merge resolved in code but not in prose once shipped its markers in three pages: every tracked text
    file is read, none may hold a line git writes for a conflict."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
    found = []
    for name in files:
        path = ROOT / name
        text_kinds = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".json", ""}
        if path.suffix not in text_kinds or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert not found, f"merge conflict markers left at {found}"


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
               # the tree under test, and the repository root for `benchmarks` (docs/plan.md)
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
               XLA_FLAGS=suite_xla_flags(env.get("XLA_FLAGS", "")))  # as every process of the suite
    return env


WARNINGS_AS_ERRORS = ["-W", "error", "-W", "ignore::DeprecationWarning", "-W", "ignore::PendingDeprecationWarning",
                      "-W", "ignore::ResourceWarning"]


@pytest.fixture(scope="module")
def page_server():
    """One process imports what the pages import (about 9 s of CPU: Keras, JAX, optax, mirrorax) and forks
    a fresh child per page (``tests/jobs/forks.py``): no page sees another's state or pays the imports."""
    server = ForkServer(["jax", "keras", "numpy", "optax", "mirrorax", TENSORFLOW_IF_INSTALLED], _environment(),
                        WARNINGS_AS_ERRORS)
    yield server
    server.close()


def run_page(server: ForkServer, page: str, cwd: pathlib.Path, timeout: float) -> tuple[int, str]:
    """Runs ``page``'s python blocks in order in one namespace, in a fresh child; returns (exit, log)."""
    log = cwd / "page.log"
    blocks = [(f"{page}, python block {i + 1}", b["code"]) for i, b in enumerate(python_to_run(page))]
    status = server.run(blocks, cwd, log, timeout, name="__doc_sample__")
    if status is None:
        raise RuntimeError(f"{page} ran past {timeout:.0f} s:\n{log.read_text()[-6000:]}")
    return status, log.read_text()


RUNNABLE = [page for page in PAGES if python_to_run(page)]


@pytest.mark.slow  # each page compiles its own small models: 5-30 s of CPU a page
@pytest.mark.multi_device
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", RUNNABLE)
def test_page_runs(page, tmp_path, page_server):
    start = time.perf_counter()
    status, log = run_page(page_server, page, tmp_path, timeout=360)
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
