"""``twinshard.pair.interop.boltz`` without the ``boltz`` package (the main environment).

- importing twinshard and the interop module never imports ``boltz``;
- building a twin without ``boltz`` raises an ImportError that says how to install it.
(With ``boltz`` installed, tests/interop/test_boltz_cp.py tests the twins themselves.)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch


def test_import_does_not_need_boltz():
    code = (
        "import sys, twinshard, twinshard.pair.interop.boltz, twinshard.pair.layers; "
        "assert 'boltz' not in sys.modules, 'boltz was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("boltz") is not None, reason="boltz is installed here")
def test_clear_error_without_boltz():
    from twinshard.pair.interop.boltz import cp_twin_of

    with pytest.raises(ImportError, match=r"needs the boltz package.*tests/interop/README.md"):
        cp_twin_of(torch.nn.Linear(2, 2))
