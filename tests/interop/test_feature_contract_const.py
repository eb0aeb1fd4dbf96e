"""The class ids and counts written out in ``twinshard.pair.feature_contract`` equal boltz's own.

``feature_contract`` does not import boltz (it serves the main environment); this test, in
``.venv-boltz``, checks each constant against ``boltz.data.const`` (boltz 2.2.1) and the released
model's ``atom_feature_dim`` (388) against the atom features the contract's flags select.
"""

from __future__ import annotations

import pytest

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.data import const  # noqa: E402
from boltz2_model import _atom_feature_dim  # noqa: E402

from twinshard.pair import feature_contract as fc  # noqa: E402


def test_constants_equal_boltz_const():
    assert fc.NUM_TOKENS == const.num_tokens == len(const.tokens)
    assert fc.NUM_ELEMENTS == const.num_elements
    assert fc.NUM_METHOD_TYPES == const.num_method_types
    assert fc.NUM_MOL_TYPES == len(const.chain_type_ids)
    assert fc.MOL_TYPE_IDS == const.chain_type_ids
    assert fc.NUM_BOND_TYPES == len(const.bond_types)
    assert fc.BOND_TYPE_IDS == const.bond_type_ids
    assert fc.NUM_CONTACT_CLASSES == len(const.contact_conditioning_info)
    assert fc.CONTACT_IDS == const.contact_conditioning_info
    assert fc.NUM_BACKBONE_FEATS == 1 + len(const.protein_backbone_atom_index) + len(
        const.nucleic_backbone_atom_index
    )
    assert list(const.protein_backbone_atom_index) == ["N", "CA", "C", "O"]
    assert all(const.token_ids[k] == v for k, v in fc.TOKEN_IDS.items())
    assert [const.tokens[i] for i in fc.AMINO_ACID_IDS] == [t for t in const.canonical_tokens if t != "UNK"]
    assert all(const.method_types_ids[k] == v for k, v in fc.METHOD_IDS.items())
    assert fc.DELETION_VALUE_MAX > 0


def test_released_atom_feature_dim():
    flags = {
        k: fc.RELEASED_BOLTZ2[k]
        for k in ("use_no_atom_char", "use_atom_backbone_feat", "use_residue_feats_atoms")
    }
    assert _atom_feature_dim(**flags) == fc.RELEASED_BOLTZ2["atom_feature_dim"] == 388
