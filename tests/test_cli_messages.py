"""Error messages a user reads: one line each, the whole exception message (not its last line),
the file named; no traceback for bad input; no notices of third-party libraries in MACE runs."""

import os
import subprocess
import sys

import pytest
import torch

from twinshard.cli import main
from twinshard.runtime.errors import RankFailure, exception_text
from twinshard.runtime.world import format_exception


def test_a_message_of_several_lines_stays_whole():
    def fail():
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise ValueError("first line names the file\nsecond line says the fix") from exc

    try:
        fail()
    except ValueError as exc:
        text = format_exception(exc)
    assert exception_text(text) == "ValueError: first line names the file\nsecond line says the fix"
    assert RankFailure({3: text}).message() == exception_text(text)
    assert exception_text("rank 2 stopped without reporting an error") == text.__class__(
        "rank 2 stopped without reporting an error"
    )


def test_a_checkpoint_of_random_bytes_names_the_file_and_the_cause(tmp_path, capsys):
    bad = tmp_path / "ck.pt"
    bad.write_bytes(os.urandom(3000))
    assert main(["md", "--restart", str(bad), "--steps", "2", "--atoms", "32"]) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("twinshard: error"))
    assert str(bad) in line and "cannot be read" in line and "--checkpoint" in line, err
    assert "Traceback" not in err and "Check the documentation of torch.load" not in err


def test_negative_atoms_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["md", "--atoms", "-5"])
    assert info.value.code == 2
    assert "argument --atoms: expected a positive integer, got -5" in capsys.readouterr().err


mace = pytest.importorskip("mace", reason="MACE checks need mace-torch")


@pytest.mark.parametrize("kind", ["garbage", "linear"])
def test_validate_refuses_a_file_that_is_no_mace_model_in_one_line(kind, tmp_path, capsys):
    path = tmp_path / "m.model"
    if kind == "garbage":
        path.write_bytes(b"hello" * 100)
    else:
        torch.save(torch.nn.Linear(2, 2), path)
    assert main(["validate", "--potential", "mace", "--model", str(path), "--ranks", "1"]) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("twinshard: error")]
    assert len(errors) == 1 and str(path) in errors[0] and "Traceback" not in err, err
    want = "cannot be read as a saved MACE model" if kind == "garbage" else "holds a torch.nn"
    assert want in errors[0], err


def test_building_and_loading_mace_prints_no_library_notices(tmp_path):
    code = (
        "import torch\n"
        "from twinshard.atoms.potentials.mace import build_mace, load_mace\n"
        f"torch.save(build_mace(), {str(tmp_path / 'm.model')!r})\n"
        f"load_mace({str(tmp_path / 'm.model')!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default filters
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "" and out.stderr == "", (out.stdout[-2000:], out.stderr[-2000:])
