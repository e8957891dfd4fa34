import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        scope = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, str(README), "exec"), scope)
        promised = re.search(r"^# (.+)$", code.split("print(")[-1], flags=re.M).group(1)
        assert printed.getvalue().strip() == promised  # the line the README says it prints
        pack, logps = scope["pack"], scope["logps"]
        assert pack.num_packed_rows == 7 and logps.shape == (3, 4)
        grads = [p.grad for p in scope["model"].parameters()]
        assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).splitlines()
    assert first_block[0].endswith("treepack bench --quick") and "torch==2.13.0" in first_block[0]
    assert first_block[1].endswith("python -m pytest") and "torch==2.13.0" in first_block[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert first_block[1] in ci
