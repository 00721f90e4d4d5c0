"""Runs every python block of docs/integrations.md, in order, in one namespace: the docs cannot rot."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).parent.parent / "docs" / "integrations.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_integrations_doc_blocks_run():
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) == 8
    namespace: dict = {"__name__": "docs_integrations"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)


def test_readme_counts_the_classes_patch_knows():
    """The README's counts of Hugging Face norm classes and block classes are the tables' sizes."""
    from addnorm.patch import FAMILIES
    from addnorm.patch.hf_norms import HF_NORMS

    readme = " ".join((DOC.parent.parent / "README.md").read_text().split())
    assert int(re.search(r"(\d+) Hugging Face norm classes", readme).group(1)) == len(HF_NORMS)
    assert int(re.search(r"\((\d+) block classes", readme).group(1)) == len(FAMILIES)


def test_docs_state_the_inference_fusion_threshold():
    """The README and docs/integrations.md give the size below which inference calls run a fused
    block's own forward as the value the library ships (tests run with it set to 0: conftest)."""
    from conftest import INFERENCE_FUSE_MIN_ELEMENTS

    for path in (DOC, DOC.parent.parent / "README.md"):
        text = " ".join(path.read_text().split())
        assert [int(n) for n in re.findall(r"fewer than (\d+) elements", text)] == [INFERENCE_FUSE_MIN_ELEMENTS], path
