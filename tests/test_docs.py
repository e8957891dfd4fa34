import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_is_generated_from_the_current_docstrings():
    pytest.importorskip("trl")  # the reference covers treepack.trl
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_docs_link_to_files_that_exist():
    import re

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists() or (ROOT / target).exists(), (page, target)
