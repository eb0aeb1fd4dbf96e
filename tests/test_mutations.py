"""The mutation sweep (tools/mutations.py) still matches the code: every planted bug's fragment
occurs exactly once in its file, so a refactor cannot silently turn the sweep into a no-op."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sweep():
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "tools" / "mutations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutations"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_mutation_applies_exactly_once():
    sweep = _sweep()
    assert len(sweep.MUTATIONS) >= 20 and len({m.id for m in sweep.MUTATIONS}) == len(sweep.MUTATIONS)
    for m in sweep.MUTATIONS:
        text = (ROOT / "src" / "twinshard" / m.file).read_text()
        assert text.count(m.find) == 1, (
            f"mutation {m.id}: fragment found {text.count(m.find)} times in {m.file}"
        )
        assert m.find != m.replace
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).exists(), f"mutation {m.id}: test {t} does not exist"
