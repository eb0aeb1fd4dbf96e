"""Every Python block of README.md runs as written: a block with test functions runs them as
pytest would (on the grids of its ``grids`` marker, on the suite's worker pool), any other block
runs as the script it says it is (``__name__ == "__main__"``)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) >= 2
    assert all(re.search(r"^(import|from) ", b, flags=re.M) for b in BLOCKS)  # imports included


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index, tmp_path, monkeypatch, capsys):
    block = BLOCKS[index]
    monkeypatch.chdir(tmp_path)
    tests = re.findall(r"^def (test_\w+)\(", block, flags=re.M)
    namespace = {"__name__": "__main__" if not tests else f"readme_block_{index}"}
    exec(compile(block, f"README.md python block {index}", "exec"), namespace)
    for name in tests:
        fn = namespace[name]
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "grids"]
        grids = marks[0].args if marks else [None]
        for grid in grids:
            fn(grid) if grid is not None else fn()
    if not tests:
        assert capsys.readouterr().out.strip(), "the script printed nothing"
