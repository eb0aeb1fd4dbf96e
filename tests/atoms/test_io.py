"""Structure files through ase.io, and clear errors for unreadable files."""

import pytest
import torch

from twinshard.atoms.data.io import StructureReadError, read, read_trajectory, write
from twinshard.atoms.data.structures import lj_mixture, triclinic_argon


@pytest.mark.parametrize(
    "fmt, name", [("extxyz", "s.extxyz"), ("cif", "s.cif"), ("vasp", "POSCAR"), ("xyz", "s.xyz")]
)
def test_round_trip(tmp_path, fmt, name):
    s = triclinic_argon(2, rattle=0.2) if fmt != "xyz" else lj_mixture(20)
    path = tmp_path / name
    write(path, s, format=fmt)
    back = read(path, format=fmt)
    assert torch.equal(back.numbers, s.numbers)
    if fmt == "cif":
        # CIF stores cell lengths/angles (ASE re-orients the cell) and 4-5 digit fractions.
        torch.testing.assert_close(back.to_ase().cell.cellpar(), s.to_ase().cell.cellpar())
        d = back.scaled_positions() - s.scaled_positions()  # CIF also wraps into the cell
        # derived, not loosened: CIF keeps 4-5 decimals of each fraction, so |d| <= 5e-5 < 1e-4
        torch.testing.assert_close(d - torch.round(d), torch.zeros_like(d), atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(back.positions, s.positions)
        if fmt != "xyz":
            torch.testing.assert_close(back.cell, s.cell)


def test_extxyz_keeps_ids_velocities_and_properties(tmp_path):
    s = lj_mixture(30, seed=1)
    s.ids = torch.arange(30) + 100
    s.velocities = torch.randn(30, 3, dtype=torch.float64)
    path = tmp_path / "t.extxyz"
    write(path, s, energy=-1.5, forces=torch.ones(30, 3))
    write(path, s, append=True)
    frames = read_trajectory(path)
    assert len(frames) == 2
    assert torch.equal(frames[0].ids, s.ids)
    torch.testing.assert_close(frames[0].velocities, s.velocities)


def test_unreadable_files(tmp_path):
    with pytest.raises(StructureReadError, match="does not exist"):
        read(tmp_path / "missing.xyz")
    bad = tmp_path / "broken.extxyz"
    bad.write_text('3\nLattice="1 0 0 0 1 0 0 0 1"\nAr 0 0\n')
    with pytest.raises(StructureReadError, match="cannot read structure file"):
        read(bad)
    weird = tmp_path / "thing.unknownext"
    weird.write_text("hello\n")
    with pytest.raises(StructureReadError, match="format"):
        read(weird)
    with pytest.raises(StructureReadError, match="directory"):
        read(tmp_path)


def test_as_system_is_the_one_input_path(tmp_path):
    """``as_system``: a System (cast on request), an ``ase.Atoms``, a file path all give the same
    System; ``None`` and other types raise naming what to give."""
    from twinshard.atoms.data import structures
    from twinshard.atoms.data.io import as_system, write

    s = structures.lj_mixture(12)
    path = tmp_path / "s.extxyz"
    write(path, s)
    from_file = read(path)  # the file holds the text's precision: compared with read's System
    for source, want in ((s, s), (s.to_ase(), s), (str(path), from_file), (path, from_file)):
        got = as_system(source)
        assert torch.equal(got.numbers, want.numbers)
        assert torch.equal(got.positions, want.positions) and torch.equal(got.cell, want.cell)
    assert as_system(s, torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="run_md's system: passed None; give a System"):
        as_system(None, what="run_md's system")
    with pytest.raises(TypeError, match="cannot use a int"):
        as_system(3)
