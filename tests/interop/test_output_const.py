"""The prediction writer's tables equal boltz's own (boltz 2.2.1, ``.venv-boltz``).

- ``RESIDUE_NAMES`` is ``boltz.data.const.tokens`` (the 33 ``res_type`` classes);
- the atom-name code is Boltz's featuriser's: ``convert_atom_name`` (``data/feature/featurizerv2.py``)
  gives the class ids :func:`encode_atom_name` gives, the featuriser one-hot encodes them over 64
  classes, and :func:`decode_atom_names` reads those one-hots back to the name;
- the confidence JSON keys are those ``BoltzWriter.write_on_batch_end`` writes, in its order.

``featurizerv2`` imports numba and ``data/write/writer.py`` imports modelcif (neither is installed
in ``.venv-boltz``), so the test reads those two functions from boltz's source files with ``ast``:
``convert_atom_name`` is compiled on its own and run; the writer's key list is read as a literal.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

import torch  # noqa: E402
from boltz.data import const  # noqa: E402

from twinshard.pair.output import (  # noqa: E402
    CONFIDENCE_KEYS,
    RESIDUE_NAMES,
    decode_atom_names,
    encode_atom_name,
)

BOLTZ = Path(importlib.util.find_spec("boltz").origin).parent
NAMES = ["N", "CA", "C", "O", "CB", "OXT", "NH1", "C1'", "O5'", "OP1", "CL12", "H5''", "1HG2", " CA "]


def _function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    if cls is not None:
        (tree,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{name} not found once in {path}"
    return found[0]


def test_residue_names_equal_boltz_tokens():
    assert list(RESIDUE_NAMES) == list(const.tokens)
    assert len(RESIDUE_NAMES) == const.num_tokens == 33


def test_atom_name_code_equals_boltz_featurizer():
    path = BOLTZ / "data" / "feature" / "featurizerv2.py"
    fn = _function(path, "convert_atom_name")
    scope: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    convert = scope["convert_atom_name"]
    assert "one_hot(ref_atom_name_chars, num_classes=64)" in path.read_text()
    for name in NAMES:
        assert list(convert(name)) == encode_atom_name(name), name
    chars = torch.nn.functional.one_hot(torch.tensor([convert(n) for n in NAMES]), 64)
    assert decode_atom_names(chars) == [n.strip() for n in NAMES]


def test_confidence_keys_equal_boltz_writer():
    fn = _function(BOLTZ / "data" / "write" / "writer.py", "write_on_batch_end", "BoltzWriter")
    lists = [
        ast.literal_eval(node.iter)
        for node in ast.walk(fn)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.List)
    ]
    assert list(CONFIDENCE_KEYS) in lists
    text = ast.unparse(fn)
    for key in ("chains_ptm", "pair_chains_iptm", "plddt_", "pae_", "pde_", "confidence_", "_model_"):
        assert key in text, key
