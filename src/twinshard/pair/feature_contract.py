"""The Boltz-2 trunk's feature contract, written down once, and its checker.

Every feature the Boltz-2 trunk (boltz 2.2.1, ``Boltz2.forward`` up to the distogram) reads, under
Boltz-2's own names, so a Boltz feature dict goes in unchanged: :data:`CONTRACT` maps each name to
a :class:`FeatureSpec` (kind from the agreed kinds, Boltz's dtype, symbolic shape, meaning, valid
range, the Boltz modules that read it). Sizes: ``B`` batch, ``N`` tokens, ``A`` atoms (padded to a
multiple of 32, ``atoms_per_window_queries``), ``S`` MSA sequences, ``T`` templates. All features
carry the batch dimension (Boltz's collate adds it).

Facts read from boltz 2.2.1 (models/boltz2.py, modules/trunkv2.py, modules/encodersv2.py,
data/feature/featurizerv2.py) that a port must reproduce:

- ``AtomEncoder`` concatenates ``ref_pos`` (3), ``ref_charge`` (1), ``ref_element`` (128) and,
  unless ``use_no_atom_char``, ``ref_atom_name_chars`` (4 x 64): ``atom_feature_dim`` = 388 for
  the released model. ``use_atom_backbone_feat`` appends ``atom_backbone_feat`` (17);
  ``use_residue_feats_atoms`` appends ``atom_to_token @ [res_type, modified, one_hot(mol_type, 4)]``
  (33 + 1 + 4). Window pairs count only when both atoms are real and share ``ref_space_uid``.
- ``AtomAttentionEncoder`` averages atoms into tokens with ``atom_to_token / (sum over atoms +
  1e-6)``: a token with no atoms gets 0, and a padding atom mapped to a token would pollute it.
- ``RelativePositionEncoder`` with ``cyclic_pos_enc`` wraps ``d_residue`` by
  ``cyclic_period`` only when ``any(cyclic_period > 0)`` over the WHOLE batch, using the period of
  the COLUMN token j (``period[1, N]`` broadcasts as ``[1, 1, N]`` against ``d[1, N, N]``) and 10000
  for non-cyclic tokens; the wrap with 10000 is the identity for ``|d_residue| < 5000``, so a CP
  port may apply it unconditionally. ``fix_sym_check`` keys the chain term on same ENTITY.
- ``type_bonds`` feeds ``nn.Embedding(len(bond_types) + 1 = 7)``: 0 = no bond, 1 + Boltz's bond
  type id otherwise.
- ``ContactConditioning`` reads classes 2.. of ``contact_conditioning`` through its encoder and
  uses classes 0 (UNSPECIFIED) / 1 (UNSELECTED) as learned constants; the featuriser gives either
  all UNSPECIFIED or UNSELECTED plus chosen pairs; padded pairs are all-zero one-hots.
- ``MSAModule`` reads ``msa_paired`` whatever ``use_paired_feature`` says (it is concatenated only
  when set); ``has_deletion`` is bool and ``msa_mask`` int64 in Boltz; ``deletion_value`` =
  pi/2 * arctan(d / 3) of the deletion count d (Boltz's formula), ``deletion_mean`` its mean over
  sequences and ``profile`` the mean one-hot of ``msa`` (both over the real sequences).
- Templates. Without templates Boltz's featuriser gives T = 1 dummy template (every mask 0,
  ``template_restype`` class 0). ``TemplateV2Module`` averages over templates with
  ``template_mask.any(dim=tokens)`` and divides by ``max(count, 1)``; its output goes through
  ``u_proj`` (no bias) after a ReLU, so with no real template (the dummy, or every template
  masked) it adds EXACTLY zero to z (and its parameters get zero gradients). T = 0 is a valid
  input of this contract with that same meaning ("no templates"); boltz 2.2.1 itself never sees
  it (its featuriser emits the dummy) and ``Boltz2(use_templates=True)`` RAISES on T = 0 (its
  template Pairformer's triangle attention cannot reshape an empty batch), so the oracle
  (tests/interop/boltz2_model.py) hands Boltz its own dummy template for T = 0. With
  ``use_templates=False`` the module does not exist and no template feature is read.
  ``TemplateV2Module`` (the released model, ``use_templates_v2``) masks template pair features
  by equal ``visibility_ids``; ``TemplateModule`` (v1) by equal ``asym_id``.
- ``cyclic_pos_enc`` in boltz 2.2.1 only works for B = 1 once any ``cyclic_period`` is non-zero
  (``period[B, N]`` does not broadcast against ``[B, N, N]`` for B > 1: Boltz raises); the
  meaning a port should give B > 1 is the B = 1 one per batch element (``period[:, None, :]``).
- ``token_to_rep_atom`` is not read by the trunk forward (the distogram loss and the confidence
  module read it); it is in the contract because the CP layout must place it.

:func:`check_features` validates a feature dict against this contract (a pure, serial function;
the CP ``distribute`` calls it on the rank holding the data and raises on every rank together).
:func:`trunk_feature_names` says which features a given Boltz2 configuration's trunk reads.

The class ids below equal ``boltz.data.const`` (tests/interop/test_feature_contract_const.py checks
it); this module does not import boltz.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TRAINING_FEATURES",
    "ATOM_NAME_CHARS",
    "ATOM_NAME_CLASSES",
    "CONTRACT",
    "NUM_BACKBONE_FEATS",
    "NUM_BOND_TYPES",
    "NUM_CONTACT_CLASSES",
    "NUM_ELEMENTS",
    "NUM_METHOD_TYPES",
    "NUM_MOL_TYPES",
    "NUM_TOKENS",
    "RELEASED_BOLTZ2",
    "WINDOW_KEYS",
    "WINDOW_QUERIES",
    "FeatureSpec",
    "check_features",
    "contract_kinds",
    "r_set_token_form",
    "trunk_feature_names",
]

# ---- class counts and ids of boltz.data.const (boltz 2.2.1), written out -------------------------
NUM_TOKENS = 33  # len(const.tokens): <pad>, -, 20 amino acids, UNK, A G C U N, DA DG DC DT DN
NUM_ELEMENTS = 128  # const.num_elements (one-hot by atomic number)
NUM_METHOD_TYPES = 12  # const.num_method_types
NUM_MOL_TYPES = 4  # len(const.chain_type_ids): PROTEIN 0, DNA 1, RNA 2, NONPOLYMER 3
NUM_BOND_TYPES = 6  # len(const.bond_types); type_bonds = 1 + bond type id, 0 = no bond
NUM_CONTACT_CLASSES = 5  # len(const.contact_conditioning_info)
NUM_BACKBONE_FEATS = 17  # 1 + len(protein_backbone_atom_index) (4) + len(nucleic_...) (12)
ATOM_NAME_CHARS, ATOM_NAME_CLASSES = 4, 64  # ref_atom_name_chars: 4 characters, ord(c) - 32
WINDOW_QUERIES, WINDOW_KEYS = 32, 128  # Boltz2 atoms_per_window_queries / _keys defaults
TOKEN_IDS = {"<pad>": 0, "-": 1, "UNK": 22}  # const.token_ids of the special tokens used here
AMINO_ACID_IDS = range(2, 22)  # the 20 canonical amino acids in const.tokens
MOL_TYPE_IDS = {"PROTEIN": 0, "DNA": 1, "RNA": 2, "NONPOLYMER": 3}
CONTACT_IDS = {"UNSPECIFIED": 0, "UNSELECTED": 1, "POCKET>BINDER": 2, "BINDER>POCKET": 3, "CONTACT": 4}
BOND_TYPE_IDS = {"OTHER": 0, "SINGLE": 1, "DOUBLE": 2, "TRIPLE": 3, "AROMATIC": 4, "COVALENT": 5}
METHOD_IDS = {"md": 0, "x-ray diffraction": 1, "electron microscopy": 2, "solution nmr": 3, "afdb": 5}
DELETION_VALUE_MAX = math.pi**2 / 4  # pi/2 * arctan(d/3) < pi/2 * pi/2

# The released Boltz-2 checkpoint's trunk flags (boltz2_conf.ckpt hyper_parameters). The boltz
# package does not ship them: they come from the published training config
# scripts/train/configs/structurev2.yaml of jwohlwend/boltz (atom_feature_dim 388,
# fix_sym_check, cyclic_pos_enc, bond_type_feature, the four embedder add_* flags, paired MSA
# feature, v2 pairformer) and, for the template module, from third-party ports that read the
# checkpoint (use_templates and use_templates_v2 True). The three atom flags stay at their
# default False (388 = 3 + 1 + 128 + 4 * 64).
RELEASED_BOLTZ2: dict[str, Any] = {
    "use_no_atom_char": False,
    "use_atom_backbone_feat": False,
    "use_residue_feats_atoms": False,
    "fix_sym_check": True,
    "cyclic_pos_enc": True,
    "bond_type_feature": True,
    "use_templates": True,
    "use_templates_v2": True,
    "atoms_per_window_queries": WINDOW_QUERIES,
    "atoms_per_window_keys": WINDOW_KEYS,
    "atom_feature_dim": 388,
    "embedder_args": {
        "add_method_conditioning": True,
        "add_modified_flag": True,
        "add_cyclic_flag": True,
        "add_mol_type_feat": True,
    },
    "msa_args": {"use_paired_feature": True},
}

# dtype classes: "int" any integer dtype (not bool); "float" any floating dtype; "binary" values
# in {0, 1} in any dtype (bool, int or float: masks and one-hot encodings).
_CLASSES = ("int", "float", "binary")

_EMB, _ATOM, _ATT = "InputEmbedder", "AtomEncoder", "AtomAttentionEncoder"
_REL, _B2, _CC = "RelativePositionEncoder", "Boltz2.forward", "ContactConditioning"
_TPL, _MSA = "TemplateV2Module", "MSAModule"


@dataclass(frozen=True)
class FeatureSpec:
    """One feature of the contract. ``dims``: symbols (B, N, A, S, T) or fixed sizes."""

    name: str
    kind: str  # single | pair | msa | sample | atom | atom_token | token_atom | template | r_set
    dtype: torch.dtype  # Boltz's own dtype
    dclass: str  # "int" | "float" | "binary" (what check_features accepts)
    dims: tuple[str | int, ...]
    meaning: str
    valid: str
    read_by: tuple[str, ...]
    onehot: bool = False  # last dim (last two for ref_atom_name_chars' chars) is a one-hot
    low: float | None = None  # inclusive
    high: float | None = None  # exclusive for "int", inclusive for "float"

    @property
    def shape(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + "]"


def _spec(name, kind, dtype, dclass, dims, meaning, valid, read_by, **kw) -> FeatureSpec:
    return FeatureSpec(name, kind, dtype, dclass, tuple(dims), meaning, valid, tuple(read_by), **kw)


_I64, _F32, _BOOL = torch.int64, torch.float32, torch.bool

# fmt: off
_SPECS: tuple[FeatureSpec, ...] = (
    _spec('token_pad_mask', 'single', _F32, 'binary', 'BN',
          '1 for a real token, 0 for padding',
          '{0, 1}', (_B2, _MSA)),
    _spec('res_type', 'single', _I64, 'binary', ('B', 'N', NUM_TOKENS),
          'residue type one-hot over const.tokens (non-polymer tokens: UNK)',
          'one-hot; real tokens exactly one class, padding all zero', (_EMB, _ATOM), onehot=True),
    _spec('token_index', 'single', _I64, 'int', 'BN',
          'token position in the complex (0..N-1)',
          '>= 0', (_REL,), low=0),
    _spec('residue_index', 'single', _I64, 'int', 'BN',
          'residue number within its chain (all tokens of a ligand share one)',
          '>= 0', (_REL,), low=0),
    _spec('asym_id', 'single', _I64, 'int', 'BN',
          'chain id',
          '>= 0', (_REL, 'TemplateModule (v1)'), low=0),
    _spec('entity_id', 'single', _I64, 'int', 'BN',
          'entity id (equal for copies of one molecule)',
          '>= 0', (_REL,), low=0),
    _spec('sym_id', 'single', _I64, 'int', 'BN',
          'copy number within an entity',
          '>= 0', (_REL,), low=0),
    _spec('mol_type', 'single', _I64, 'int', 'BN',
          'chain type: PROTEIN 0, DNA 1, RNA 2, NONPOLYMER 3',
          '[0, 4)', (_EMB, _ATOM), low=0, high=NUM_MOL_TYPES),
    _spec('method_feature', 'single', _I64, 'int', 'BN',
          'experimental method id (const.method_types_ids), the same for every token',
          '[0, 12)', (_EMB,), low=0, high=NUM_METHOD_TYPES),
    _spec('modified', 'single', _I64, 'int', 'BN',
          '1 for a modified residue',
          '{0, 1}', (_EMB, _ATOM), low=0, high=2),
    _spec('cyclic_period', 'single', _F32, 'float', 'BN',
          "0, or the length of the token's cyclic chain (integer-valued)",
          '>= 0', (_EMB, _REL), low=0.0),
    _spec('profile', 'single', _F32, 'float', ('B', 'N', NUM_TOKENS),
          'MSA profile: mean one-hot of msa over the real sequences',
          '[0, 1]', (_EMB,), low=0.0, high=1.0),
    _spec('deletion_mean', 'single', _F32, 'float', 'BN',
          'mean deletion_value over the real sequences',
          '[0, pi^2/4]', (_EMB,), low=0.0, high=DELETION_VALUE_MAX),
    _spec('token_bonds', 'pair', _F32, 'binary', ('B', 'N', 'N', 1),
          '1 where two tokens are bonded',
          '{0, 1}, symmetric', (_B2,)),
    _spec('type_bonds', 'pair', _I64, 'int', 'BNN',
          'bond type of a token bond: 0 none, 1 + const bond type id',
          '[0, 7)', (_B2,), low=0, high=NUM_BOND_TYPES + 1),
    _spec('contact_conditioning', 'pair', _I64, 'binary', ('B', 'N', 'N', NUM_CONTACT_CLASSES),
          'contact class one-hot: UNSPECIFIED, UNSELECTED, POCKET>BINDER, BINDER>POCKET, CONTACT',
          'one-hot or all zero (padding)', (_CC,), onehot=True),
    _spec('contact_threshold', 'pair', _F32, 'float', 'BNN',
          'distance threshold of a pocket/contact constraint (Angstrom), 0 elsewhere',
          'finite', (_CC,)),
    _spec('atom_pad_mask', 'atom', _F32, 'binary', 'BA',
          '1 for a real atom, 0 for padding',
          '{0, 1}, real atoms first', (_ATOM, _ATT)),
    _spec('ref_pos', 'atom', _F32, 'float', ('B', 'A', 3),
          'reference conformer position (per residue, centred, randomly rotated)',
          'finite', (_ATOM, _ATT)),
    _spec('ref_charge', 'atom', _F32, 'float', 'BA',
          'formal charge',
          'finite', (_ATOM,)),
    _spec('ref_element', 'atom', _I64, 'binary', ('B', 'A', NUM_ELEMENTS),
          'element one-hot by atomic number',
          'one-hot; padding all zero', (_ATOM,), onehot=True),
    _spec('ref_atom_name_chars', 'atom', _I64, 'binary', ('B', 'A', ATOM_NAME_CHARS, ATOM_NAME_CLASSES),
          'atom name: 4 characters, each one-hot of ord(c) - 32',
          'one-hot per character', ('AtomEncoder (unless use_no_atom_char)',), onehot=True),
    _spec('ref_space_uid', 'atom', _I64, 'int', 'BA',
          'conformer id: atoms of one residue share it',
          '>= 0', (_ATOM,), low=0),
    _spec('atom_backbone_feat', 'atom', _I64, 'binary', ('B', 'A', NUM_BACKBONE_FEATS),
          'backbone atom one-hot: 0 other, 1-4 protein N CA C O, 5-16 nucleic backbone',
          'one-hot; padding all zero', ('AtomEncoder (use_atom_backbone_feat)',), onehot=True),
    _spec('atom_to_token', 'atom_token', _I64, 'binary', 'BAN',
          'atom -> token one-hot',
          'real atoms exactly one real token, non-decreasing; padding atoms none',
          (_ATT, _ATOM), onehot=True),
    _spec('token_to_rep_atom', 'token_atom', _I64, 'binary', 'BNA',
          'token -> representative (distogram) atom one-hot',
          'real tokens one of their own atoms', ('distogram loss', 'ConfidenceModule'), onehot=True),
    _spec('token_to_center_atom', 'token_atom', _I64, 'binary', 'BNA',
          'token -> centre atom one-hot (CA; C1\' of a nucleotide; a ligand token\'s atom)',
          'real tokens one of their own atoms', ('the R set of the lDDT (featuriser)',), onehot=True),
    _spec('atom_resolved_mask', 'atom', _BOOL, 'binary', 'BA',
          '1 for an atom resolved in the true structure (training)',
          '{0, 1}; padding atoms 0', ('confidence_loss', 'diffusion loss', 'compute_frame_pred')),
    _spec('frame_resolved_mask', 'single', _BOOL, 'binary', 'BN',
          "1 where the token's true frame is resolved and not collinear (training; Boltz emits "
          '[B, K, N], its training step squeezes K = 1)',
          '{0, 1}; padding tokens 0', ('confidence_loss (PAE)',)),
    _spec('r_set_to_rep_atom', 'r_set', _I64, 'binary', 'BNA',
          "the lDDT R set: one row per resolved polymer token, its centre atom (one-hot), in token "
          'order, zero rows after them (N_R padded to N). Not token-aligned: distribute re-encodes '
          'it as r_set_token_to_atom',
          'rows one-hot or zero; each atom a real atom of a real token, tokens distinct (the centre '
          'atom where token_to_center_atom is given)', ('confidence_loss (pLDDT)',), onehot=True),
    _spec('r_set_token_to_atom', 'token_atom', _I64, 'binary', 'BNA',
          "r_set_to_rep_atom re-encoded token-aligned: row t holds token t's R-set atom (a zero row "
          'for a token outside the R set); derived by distribute, the form the CP losses read',
          'rows one-hot or zero, each its own token\'s atom', ('CP confidence_loss (pLDDT)',), onehot=True),
    _spec('msa', 'msa', _I64, 'int', 'BSN',
          'MSA residue classes over const.tokens (row 0: the query)',
          '[0, 33)', (_MSA,), low=0, high=NUM_TOKENS),
    _spec('has_deletion', 'msa', _BOOL, 'binary', 'BSN',
          'deletion before this position',
          '{0, 1}', (_MSA,)),
    _spec('deletion_value', 'msa', _F32, 'float', 'BSN',
          'pi/2 * arctan(deletions / 3)',
          '[0, pi^2/4]', (_MSA,), low=0.0, high=DELETION_VALUE_MAX),
    _spec('msa_paired', 'msa', _F32, 'binary', 'BSN',
          '1 where the sequence is paired across chains',
          '{0, 1}', (_MSA,)),
    _spec('msa_mask', 'msa', _I64, 'binary', 'BSN',
          '1 for a real MSA entry',
          '{0, 1}', (_MSA,)),
    _spec('template_restype', 'template', _I64, 'binary', ('B', 'T', 'N', NUM_TOKENS),
          'template residue one-hot (class 0 where the template has no residue)',
          'one-hot', (_TPL,), onehot=True),
    _spec('template_frame_rot', 'template', _F32, 'float', ('B', 'T', 'N', 3, 3),
          'template backbone frame rotation',
          'finite (a rotation where masked in)', (_TPL,)),
    _spec('template_frame_t', 'template', _F32, 'float', ('B', 'T', 'N', 3),
          'template frame origin (CA)',
          'finite', (_TPL,)),
    _spec('template_mask_frame', 'template', _F32, 'binary', 'BTN',
          '1 where the template frame exists',
          '{0, 1}', (_TPL,)),
    _spec('template_cb', 'template', _F32, 'float', ('B', 'T', 'N', 3),
          'template representative (CB; CA for GLY) position',
          'finite', (_TPL,)),
    _spec('template_ca', 'template', _F32, 'float', ('B', 'T', 'N', 3),
          'template centre (CA) position',
          'finite', (_TPL,)),
    _spec('template_mask_cb', 'template', _F32, 'binary', 'BTN',
          '1 where template_cb exists',
          '{0, 1}', (_TPL,)),
    _spec('template_mask', 'template', _F32, 'binary', 'BTN',
          '1 where the template covers the token; a template counts if any token is covered',
          '{0, 1}', (_TPL,)),
    _spec('visibility_ids', 'template', _F32, 'float', 'BTN',
          'template pair features are kept where ids are equal (template id for covered chains, '
          '-1 - asym_id for the others)',
          'finite', ('TemplateV2Module (v2 only)',)),
    # training features (issue 20 section 4: the whole-model training step)
    _spec('coords', 'atom_conf', _F32, 'float', ('B', 'K', 'A', 3),
          'true atom coordinates per conformer (training target)',
          'finite', ('AtomDiffusion.forward (training)', 'diffusion loss')),
    _spec('disto_target', 'pair', _F32, 'float', ('B', 'N', 'N', 'K', 'bins'),
          'true distogram: per conformer a one-hot of the representative-atom distance bin',
          'finite', ('distogram loss',)),
    _spec('token_disto_mask', 'single', _F32, 'binary', 'BN',
          '1 for a token whose representative atom is resolved (distogram loss mask)',
          '{0, 1}', ('distogram loss',)),
)
# fmt: on

CONTRACT: dict[str, FeatureSpec] = {s.name: s for s in _SPECS}

TEMPLATE_FEATURES = tuple(s.name for s in _SPECS if s.kind == "template")
# the training features (the whole-model training step's targets and masks: not inputs of the
# forward, not made by synthetic_complex; synthetic.synthetic_training_features draws them, K = 1
# squeezed where Boltz has a conformer axis) and the form distribute derives
TRAINING_FEATURES = (
    "coords",
    "disto_target",
    "token_disto_mask",
    "token_to_center_atom",
    "atom_resolved_mask",
    "frame_resolved_mask",
    "r_set_to_rep_atom",
    "r_set_token_to_atom",
)
MSA_FEATURES = ("msa", "has_deletion", "deletion_value", "msa_paired", "msa_mask")


def r_set_token_form(r_set: torch.Tensor, atom_to_token: torch.Tensor) -> torch.Tensor:
    """``r_set_to_rep_atom [B, N_R, A]`` (rows not token-aligned) -> ``[B, N, A]`` token-aligned:
    row t holds the R-set atom of token t (zero for tokens outside the R set). The lDDT sums
    over the R set, so its order does not matter. Validate with :func:`check_features` first."""
    b, _, a = r_set.shape
    n = atom_to_token.shape[2]
    out = torch.zeros(b, n, a, dtype=r_set.dtype, device=r_set.device)
    rows = (r_set != 0).any(-1)
    atom = (r_set != 0).to(torch.int64).argmax(-1)
    owner = (atom_to_token != 0).to(torch.int64).argmax(-1)  # [B, A]
    for i in range(b):
        for r in rows[i].nonzero()[:, 0].tolist():
            out[i, int(owner[i, atom[i, r]]), atom[i, r]] = 1
    return out


def contract_kinds() -> dict[str, str]:
    """Feature name -> kind, for every feature of the contract placed on the grid as it is
    (``r_set_to_rep_atom``, kind ``r_set``, is placed re-encoded as ``r_set_token_to_atom``)."""
    return {s.name: s.kind for s in _SPECS if s.kind != "r_set"}


# ---- which features a configuration reads ---------------------------------------------------------


def _flag(config: Any, name: str, default: Any, section: str | None = None) -> Any:
    if section is not None:
        sub = _flag(config, section, None) or {}
        return sub.get(name, default) if isinstance(sub, Mapping) else getattr(sub, name, default)
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def trunk_feature_names(config: Any = None) -> tuple[str, ...]:
    """The features a Boltz2 trunk (forward up to the distogram) reads, in contract order.

    ``config``: Boltz2's keyword arguments as a mapping (flat flags such as ``use_templates``,
    ``use_templates_v2``, ``bond_type_feature``, ``cyclic_pos_enc``, ``use_no_atom_char``,
    ``use_atom_backbone_feat``, ``use_residue_feats_atoms``, and the nested ``embedder_args``
    with the ``add_*`` flags), a Boltz2 model (its ``hparams`` are read) or ``None`` (Boltz2's
    class defaults). Missing keys take Boltz2's class defaults (all False). Use
    :data:`RELEASED_BOLTZ2` for the released checkpoint.
    """
    if config is not None and not isinstance(config, Mapping) and hasattr(config, "hparams"):
        config = config.hparams
    cfg = config if config is not None else {}
    need = {
        "token_pad_mask", "res_type", "profile", "deletion_mean",
        "ref_pos", "ref_charge", "ref_element", "ref_space_uid", "atom_pad_mask", "atom_to_token",
        "asym_id", "residue_index", "entity_id", "token_index", "sym_id",
        "token_bonds", "contact_conditioning", "contact_threshold",
        *MSA_FEATURES,
    }  # fmt: skip
    if not _flag(cfg, "use_no_atom_char", False):
        need.add("ref_atom_name_chars")
    if _flag(cfg, "use_atom_backbone_feat", False):
        need.add("atom_backbone_feat")
    if _flag(cfg, "use_residue_feats_atoms", False):
        need.update(("modified", "mol_type"))
    if _flag(cfg, "cyclic_pos_enc", False):
        need.add("cyclic_period")
    if _flag(cfg, "bond_type_feature", False):
        need.add("type_bonds")
    for flag, names in (
        ("add_method_conditioning", ("method_feature",)),
        ("add_modified_flag", ("modified",)),
        ("add_cyclic_flag", ("cyclic_period",)),
        ("add_mol_type_feat", ("mol_type",)),
    ):
        if _flag(cfg, flag, False, section="embedder_args"):
            need.update(names)
    if _flag(cfg, "use_templates", False):
        need.update(n for n in TEMPLATE_FEATURES if n != "visibility_ids")
        if _flag(cfg, "use_templates_v2", False):
            need.add("visibility_ids")
    return tuple(s.name for s in _SPECS if s.name in need)


# ---- the checker ---------------------------------------------------------------------------------


def _fail(name: str, what: str) -> None:
    raise ValueError(f"feature {name!r}: {what}")


def _is_class(t: torch.Tensor, dclass: str) -> bool:
    if dclass == "float":
        return t.is_floating_point()
    if dclass == "int":
        return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    return not t.is_complex()  # binary: any real dtype, values checked


def _first_bad(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_values(spec: FeatureSpec, t: torch.Tensor) -> None:
    name = spec.name
    if t.numel() == 0:
        return
    if spec.dclass == "float" and not bool(torch.isfinite(t).all()):
        _fail(name, f"non-finite value at index {_first_bad(~torch.isfinite(t))}")
    if spec.dclass == "binary":
        bad = (t != 0) & (t != 1)
        if bool(bad.any()):
            idx = _first_bad(bad)
            _fail(name, f"must hold only 0 and 1 ({spec.valid}); index {idx} holds {t[idx].item()}")
        if spec.onehot and name != "atom_to_token":  # atom_to_token: _check_atoms says which atom
            sums = t.to(torch.int64).sum(-1)
            if bool((sums > 1).any()):
                _fail(name, f"is not one-hot: index {_first_bad(sums > 1)} has {int(sums.max())} classes set")
    if spec.low is not None and bool((t < spec.low).any()):
        idx = _first_bad(t < spec.low)
        _fail(name, f"value {t[idx].item()} at index {idx} is below {spec.low} (valid: {spec.valid})")
    if spec.high is not None:
        over = (t >= spec.high) if spec.dclass == "int" else (t > spec.high)
        if bool(over.any()):
            idx = _first_bad(over)
            _fail(name, f"value {t[idx].item()} at index {idx} is out of range (valid: {spec.valid})")


def _bind_sizes(feats: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, str]]:
    sizes: dict[str, tuple[int, str]] = {}
    for spec in _SPECS:
        if spec.name not in feats:
            continue
        t = feats[spec.name]
        if not isinstance(t, torch.Tensor):
            _fail(spec.name, f"is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() != len(spec.dims):
            _fail(
                spec.name,
                f"expected shape {spec.shape} ({len(spec.dims)} dims), got {tuple(t.shape)}; features "
                "carry the batch dimension B first (Boltz's collate adds it)",
            )
        for axis, (sym, got) in enumerate(zip(spec.dims, t.shape)):
            if isinstance(sym, int):
                if got != sym:
                    _fail(spec.name, f"dim {axis} must be {sym} (shape {spec.shape}), got {tuple(t.shape)}")
                continue
            if sym in sizes and sizes[sym][0] != got:
                size, first = sizes[sym]
                _fail(
                    spec.name,
                    f"dim {axis} ({sym}) is {got} but {first!r} has {sym}={size}: inconsistent {sym} "
                    f"across features (shape {spec.shape}, got {tuple(t.shape)})"
                    + _beyond_hint(spec.name, t, axis, sym, size),
                )
            sizes.setdefault(sym, (int(got), spec.name))
        if not _is_class(t, spec.dclass):
            want = {"int": "an integer dtype", "float": "a floating dtype", "binary": "a real dtype"}
            _fail(
                spec.name,
                f"has dtype {t.dtype}; the contract needs {want[spec.dclass]} (Boltz: {spec.dtype})",
            )
    return sizes


def _beyond_hint(name: str, t: torch.Tensor, axis: int, sym: str, size: int) -> str:
    """For a token map with more token (or atom) columns than the other features: which entry
    points beyond them (the atom mapped to a token >= N, the token's atom >= A)."""
    if name not in ("atom_to_token", "token_to_rep_atom") or t.shape[axis] <= size or axis != 2:
        return ""
    beyond = t.narrow(axis, size, t.shape[axis] - size) != 0
    if not bool(beyond.any()):
        return f"; no entry lies beyond {sym} = {size}: cut the extra columns"
    b, i, j = _first_bad(beyond)
    if name == "atom_to_token":
        return (
            f"; atom {i} of batch element {b} is mapped to token {size + j} >= N = {size}: every atom "
            "must map to one of the N tokens of the token features"
        )
    return f"; token {i} of batch element {b} has representative atom {size + j} >= A = {size}"


def _check_atoms(feats: Mapping[str, torch.Tensor], sizes: dict, window: int | None) -> None:
    if window and "A" in sizes and sizes["A"][0] % window:
        a, first = sizes["A"]
        _fail(first, f"A = {a} atoms is not a multiple of {window} (Boltz's AtomEncoder windows; pad atoms)")
    if "atom_pad_mask" in feats:
        mask = feats["atom_pad_mask"] != 0
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            b, a = _first_bad(mask[:, 1:] & ~mask[:, :-1])
            _fail(
                "atom_pad_mask",
                f"padding atoms must come last: batch {b} has a real atom {a + 1} after padding",
            )
    if "atom_to_token" not in feats:
        return
    if "atom_pad_mask" not in feats:
        _fail("atom_to_token", "needs 'atom_pad_mask' to tell real atoms from padding")
    a2t = feats["atom_to_token"] != 0
    real = feats["atom_pad_mask"] != 0
    count = a2t.sum(-1)
    for cond, what in (
        (
            real & (count == 0),
            "real atom {a} of batch element {b} maps to no token (atom_pad_mask is 1): map it to "
            "its token, or mark it padding (atom_pad_mask 0, after the real atoms)",
        ),
        (
            real & (count > 1),
            "real atom {a} of batch element {b} maps to {k} tokens: each real atom belongs to exactly one",
        ),
        (
            ~real & (count > 0),
            "padding atom {a} of batch element {b} (atom_pad_mask 0) maps to a token: padding atoms map "
            "to none",
        ),
    ):
        if bool(cond.any()):
            b, a = _first_bad(cond)
            _fail("atom_to_token", what.format(a=a, b=b, k=int(count[b, a])))
    token = a2t.to(torch.int64).argmax(-1)  # [B, A]; real atoms only below
    big = torch.iinfo(torch.int64).max
    nxt = torch.where(real, token, big)
    drop = real[:, :-1] & (nxt[:, 1:] < token[:, :-1])
    if bool(drop.any()):
        b, a = _first_bad(drop)
        _fail(
            "atom_to_token",
            f"real atoms must be contiguous per token in token order: atom {a + 1} of batch element {b} maps "
            f"to token {int(token[b, a + 1])} after atom {a} mapped to token {int(token[b, a])}",
        )
    if "token_pad_mask" in feats:
        tok_real = feats["token_pad_mask"] != 0
        on_pad = real & ~torch.gather(tok_real, 1, token)
        if bool(on_pad.any()):
            b, a = _first_bad(on_pad)
            _fail(
                "atom_to_token",
                f"real atom {a} of batch element {b} maps to padding token {int(token[b, a])}",
            )
    if "token_to_rep_atom" in feats:
        t2a = feats["token_to_rep_atom"] != 0
        tok_real = feats["token_pad_mask"] != 0 if "token_pad_mask" in feats else torch.ones_like(t2a[..., 0])
        n_rep = t2a.sum(-1)
        for cond, what in (
            (
                tok_real & (n_rep != 1),
                "real token {t} of batch element {b} needs exactly one representative atom",
            ),
            (~tok_real & (n_rep > 0), "padding token {t} of batch element {b} has a representative atom"),
        ):
            if bool(cond.any()):
                b, t = _first_bad(cond)
                _fail("token_to_rep_atom", what.format(t=t, b=b))
        rep = t2a.to(torch.int64).argmax(-1)  # [B, N]
        owner = torch.gather(torch.where(real, token, -1), 1, rep)
        mine = torch.arange(t2a.shape[1]).expand_as(rep)
        wrong = tok_real & (owner != mine)
        if bool(wrong.any()):
            b, t = _first_bad(wrong)
            _fail(
                "token_to_rep_atom",
                f"token {t} of batch element {b} has representative atom {int(rep[b, t])}, which is not one "
                "of its own real atoms (atom_to_token)",
            )


def _r_set_atoms(name: str, x: torch.Tensor, feats: Mapping[str, torch.Tensor]) -> tuple:
    """``(rows, atoms, tokens)`` of the non-zero rows of an R-set map (one-hot rows checked
    before): each atom must be a real atom mapped to a real token."""
    rows = (x != 0).any(-1)  # [B, N]
    atom = x.to(torch.int64).argmax(-1)  # [B, N]
    if "atom_to_token" not in feats:
        _fail(name, "needs 'atom_to_token' to know the tokens of its atoms")
    a2t = feats["atom_to_token"] != 0
    owner = torch.where(a2t.any(-1), a2t.to(torch.int64).argmax(-1), -1)  # [B, A]
    tok = torch.gather(owner, 1, atom)  # [B, N]
    if "atom_pad_mask" in feats:
        pad = torch.gather(feats["atom_pad_mask"] == 0, 1, atom)
        if bool((rows & pad).any()):
            b, r = _first_bad(rows & pad)
            _fail(name, f"row {r} of batch element {b} holds padding atom {int(atom[b, r])}")
    if bool((rows & (tok < 0)).any()):
        b, r = _first_bad(rows & (tok < 0))
        _fail(name, f"row {r} of batch element {b} holds atom {int(atom[b, r])}, which maps to no token")
    if "token_pad_mask" in feats:
        on_pad = rows & ~torch.gather(feats["token_pad_mask"] != 0, 1, tok.clamp(min=0))
        if bool(on_pad.any()):
            b, r = _first_bad(on_pad)
            _fail(
                name,
                f"row {r} of batch element {b}: atom {int(atom[b, r])} belongs to padding token {int(tok[b, r])}",
            )
    return rows, atom, tok


def _check_r_set(feats: Mapping[str, torch.Tensor]) -> None:
    """The R set: each atom a real atom of a real token (its centre atom where
    ``token_to_center_atom`` is given), one row per token (``r_set_to_rep_atom``: tokens
    distinct; ``r_set_token_to_atom``: row t an atom of token t)."""
    centre = feats.get("token_to_center_atom")
    for name in ("r_set_to_rep_atom", "r_set_token_to_atom"):
        if name not in feats:
            continue
        rows, atom, tok = _r_set_atoms(name, feats[name], feats)
        for b in range(rows.shape[0]):
            ts = tok[b][rows[b]]
            if name == "r_set_to_rep_atom" and len(torch.unique(ts)) != len(ts):
                dup = [int(t) for t in torch.unique(ts) if int((ts == t).sum()) > 1][0]
                _fail(
                    name, f"batch element {b} has two rows on atoms of token {dup}: one R-set atom per token"
                )
            if name == "r_set_token_to_atom":
                mine = torch.arange(rows.shape[1])
                wrong = rows[b] & (tok[b] != mine)
                if bool(wrong.any()):
                    t = int(wrong.nonzero()[0, 0])
                    _fail(
                        name,
                        f"row {t} of batch element {b} holds atom {int(atom[b, t])} of token {int(tok[b, t])}, not its own",
                    )
            if centre is not None:
                c = (centre[b] != 0).to(torch.int64).argmax(-1)  # [N] centre atom per token
                off = rows[b] & (c.gather(0, tok[b].clamp(min=0)) != atom[b])
                if bool(off.any()):
                    r = int(off.nonzero()[0, 0])
                    _fail(
                        name,
                        f"row {r} of batch element {b} holds atom {int(atom[b, r])}, not the centre atom "
                        f"{int(c[tok[b, r]])} of its token {int(tok[b, r])} (token_to_center_atom)",
                    )


def _check_tokens(feats: Mapping[str, torch.Tensor]) -> None:
    if "res_type" in feats:
        rt = feats["res_type"]
        real = (
            feats["token_pad_mask"] != 0
            if "token_pad_mask" in feats
            else torch.ones(rt.shape[:2], dtype=torch.bool)
        )
        none = real & (rt.to(torch.int64).sum(-1) == 0)
        if bool(none.any()):
            b, n = _first_bad(none)
            _fail("res_type", f"real token {n} of batch element {b} has no residue class set (one-hot of 0)")


def check_features(
    feats: Mapping[str, torch.Tensor],
    need: Iterable[str] | None = None,
    *,
    window: int | None = WINDOW_QUERIES,
) -> None:
    """Raise ``ValueError`` naming the feature and what is wrong if ``feats`` breaks the contract.

    Checks every contract feature present (names outside the contract are ignored, as Boltz's
    dicts carry many): the shape (rank, fixed sizes, one B/N/A/S/T across all features), the dtype
    class (integer, floating, or 0/1-valued), values (finite floats, 0/1 masks and one-hots,
    id ranges: ``res_type``/``msa``/``profile`` against the 33 Boltz token classes, ``mol_type``,
    ``method_feature``, ``modified``, ``type_bonds``, ...), and the relations: A a multiple of
    ``window``; padding atoms last; each real atom mapped to exactly one real token, padding
    atoms to none, real atoms contiguous and in token order (``atom_to_token`` non-decreasing;
    an atom mapped to a token column beyond the token features' N is named);
    each real token's representative atom one of its own; each real token a residue class; an MSA
    of at least one sequence. Zero templates (T = 0) is valid. ``need``: names that must be
    present (e.g. :func:`trunk_feature_names` of the model's configuration); ``None`` requires
    none. ``window=None`` skips the A-multiple-of-window check (the atom encoder, which knows its
    window, checks it; ``distribute`` passes None). Pure and serial: no communication, ``feats``
    untouched.
    """
    missing = [n for n in (need or ()) if n not in feats]
    if missing:
        _fail(missing[0], f"is missing (the trunk reads it); all missing: {missing}")
    sizes = _bind_sizes(feats)
    for spec in _SPECS:
        if spec.name in feats:
            _check_values(spec, feats[spec.name])
    if "S" in sizes and sizes["S"][0] == 0:
        _fail(sizes["S"][1], "MSA depth S = 0: Boltz needs at least the query sequence (S >= 1)")
    if "N" in sizes and sizes["N"][0] == 0:
        _fail(sizes["N"][1], "N = 0 tokens")
    _check_tokens(feats)
    _check_atoms(feats, sizes, window)
    _check_r_set(feats)
