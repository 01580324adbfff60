"""The code samples of the entry-point pages run as written: docs/keras_fit.md and docs/trainer.md.

A page's ```python blocks run in order in one namespace (later blocks build on the first), in this
process, on the 8 simulated CPU devices of ``conftest.py``; the samples' own ``assert``s and the
warnings-as-errors setting of the test suite apply.
"""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def test_python_blocks_are_found():
    blocks = python_blocks("text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n")
    assert blocks == ["a = 1\n", "b = a\n"]


@pytest.mark.slow  # each page trains several small models: 85-190 s on 2 busy shared cores
@pytest.mark.timeout(900)
@pytest.mark.multi_device
@pytest.mark.parametrize("page", ["keras_fit.md", "trainer.md"])
def test_page_samples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a sample writes lands here
    blocks = python_blocks((DOCS / page).read_text())
    assert len(blocks) >= 3, f"{page}: expected its python samples, found {len(blocks)}"
    namespace: dict = {"__name__": "__doc_sample__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page}, python block {i + 1}", "exec"), namespace)
