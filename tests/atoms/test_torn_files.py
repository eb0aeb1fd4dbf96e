"""The files a killed run leaves: a restart cuts the torn tail of the trajectory and thermo log and
says so, and the resumed files equal the uninterrupted run's; damage followed by more data raises
naming the file and line; stale temporaries of killed writers go (nothing else does); unwritable
output paths fail before step 1, with the same error on every rank.

The killed run is made exact: a run is deterministic, so what a run killed while writing the
frame of step 10 left is a byte prefix of the uninterrupted run's files, and its checkpoint at
step 6 is that of a 6-step run.
"""

import os
import re
import shutil

import ase.io
import numpy as np
import pytest
import torch

from twinshard.atoms.dynamics.driver import MDConfig, md_rank
from twinshard.atoms.dynamics.md_files import check_writable, repair_thermo, repair_trajectory
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, run_on_world

BASE = dict(
    structure="fcc_argon",
    atoms=108,
    cutoff=5.0,
    skin=0.5,
    thermostat="langevin",
    temperature=300.0,
    seed=2,
    thermo_every=2,
    trajectory_every=2,
)
STEPS, CUT, N = 12, 6, 108  # frames and rows every 2 steps; the checkpoint at step 6
SETUP = "md: load the structure and check the options"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run's trajectory and thermo log, and the checkpoint at step CUT."""
    d = tmp_path_factory.mktemp("runs")
    run_on_world(
        md_rank,
        2,
        MDConfig(steps=STEPS, trajectory=str(d / "full.extxyz"), thermo=str(d / "full.txt"), **BASE),
    )
    run_on_world(md_rank, 2, MDConfig(steps=CUT, checkpoint=str(d / "ck.pt"), **BASE))
    return d


def _frame_starts(data: bytes) -> list[int]:
    """Byte offset of each frame (N + 2 lines) and of the end."""
    lines = data.splitlines(keepends=True)
    assert len(lines) % (N + 2) == 0
    ends = [0]
    for k in range(len(lines) // (N + 2)):
        ends.append(ends[-1] + sum(len(ln) for ln in lines[k * (N + 2) : (k + 1) * (N + 2)]))
    return ends


def _frames(path):
    frames = ase.io.read(path, index=":", format="extxyz")
    pos = torch.from_numpy(np.stack([a.positions for a in frames]))
    return [a.info["step"] for a in frames], pos


def _rows(path):
    with open(path) as f:
        return torch.tensor(
            [[float(v) for v in ln.split()] for ln in f if not ln.startswith("#")], dtype=torch.float64
        )


# where the kill hit a frame: (the frame, bytes into it from its lines, the torn frame's message);
# the frame of step 8 is the first past the checkpoint, so only the torn frame is there to cut
KILLS = {
    "inside an atom line": (5, lambda lines: sum(map(len, lines[:42])) + 20, "40 of 108 atom lines"),
    "right after the count line": (4, lambda lines: len(lines[0]), "no complete comment line"),
    "inside the comment line": (5, lambda lines: len(lines[0]) + 30, "no complete comment line"),
}


@pytest.mark.parametrize("where", list(KILLS))
def test_restart_cuts_a_torn_tail_and_equals_the_uninterrupted_run(runs, tmp_path, where):
    frame, offset, reason = KILLS[where]
    late = frame - 4  # complete frames past the checkpoint's (frame 3, step 6)
    full = (runs / "full.extxyz").read_bytes()
    starts = _frame_starts(full)
    traj, thermo, ck = tmp_path / "t.extxyz", tmp_path / "th.txt", tmp_path / "ck.pt"
    traj.write_bytes(full[: starts[frame] + offset(full[starts[frame] :].splitlines(keepends=True))])
    # the thermo log torn alike (independently): rows up to the last complete frame, part of the next
    log = (runs / "full.txt").read_text().splitlines(keepends=True)  # header, steps 0, 2, ..., 12
    thermo.write_text("".join(log[: frame + 1]) + log[frame + 1][:15])
    shutil.copy(runs / "ck.pt", ck)

    # the repair alone keeps exactly the complete frames and rows up to the checkpoint's step
    shutil.copy(traj, tmp_path / "alone.extxyz")
    shutil.copy(thermo, tmp_path / "alone.txt")
    repair_trajectory(tmp_path / "alone.extxyz", CUT)
    assert (tmp_path / "alone.extxyz").read_bytes() == full[: starts[4]]  # frames 0, 2, 4, 6
    repair_thermo(tmp_path / "alone.txt", CUT)
    assert (tmp_path / "alone.txt").read_text() == "".join(log[:5])  # header, rows 0, 2, 4, 6

    res = run_on_world(
        md_rank, 2, MDConfig(steps=STEPS, restart=str(ck), trajectory=str(traj), thermo=str(thermo), **BASE)
    )[0]
    assert res["start_step"] == CUT
    notes = res["file_repairs"]
    assert len(notes) == 2, notes
    and_late = f" and {late} frame(s) written after step 6 (past the checkpoint)" if late else ""
    assert notes[0] == (
        f"trajectory {str(traj)!r}: cut a torn last frame ({reason}){and_late}; kept 4 frame(s) of steps <= 6"
    )
    torn_row = f"line {frame + 2}: {log[frame + 1][:15]!r}"
    and_late = f" and {late} row(s) written after step 6 (past the checkpoint)" if late else ""
    assert notes[1] == (
        f"thermo log {str(thermo)!r}: cut a torn last row ({torn_row}){and_late}; kept 4 row(s) of steps <= 6"
    )

    steps, pos = _frames(traj)
    ref_steps, ref_pos = _frames(runs / "full.extxyz")
    assert steps == ref_steps == list(range(0, STEPS + 1, 2))
    assert_parity(
        pos, ref_pos, what=f"resumed trajectory ({where})", grid="2->2", rtol=0.0, atol=1e-8,
        why="the file prints positions with 8 decimals",
    )  # fmt: skip
    rows, ref_rows = _rows(thermo), _rows(runs / "full.txt")
    assert torch.equal(rows[:, 0], ref_rows[:, 0])
    assert_parity(
        rows, ref_rows, what=f"resumed thermo log ({where})", grid="2->2", rtol=1e-11, atol=1e-12,
        why="the file prints 12 significant digits",
    )  # fmt: skip


def _damaged(full: bytes, how: str) -> bytes:
    """The trajectory with frame 2 (of steps 0, 2, ...) damaged and complete frames after it."""
    starts = _frame_starts(full)
    lines = full[starts[2] : starts[3]].splitlines(keepends=True)
    if how == "torn frame":  # a killed writer, then an append: fewer atom lines than the count says
        lines = lines[:50]
    else:  # a garbage row
        lines[10] = b"Ar garbage\n"
    return full[: starts[2]] + b"".join(lines) + full[starts[3] :]


def _restart_error(cfg):
    try:
        md_rank(cfg)
    except RankFailure as exc:
        return exc.step, str(exc).splitlines()[-1]
    return "no error"


@pytest.mark.parametrize("how", ["torn frame", "garbage row"])
def test_damage_followed_by_data_raises_naming_the_file(runs, tmp_path, how):
    full = (runs / "full.extxyz").read_bytes()
    traj = tmp_path / "t.extxyz"
    traj.write_bytes(_damaged(full, how))
    line = 2 * (N + 2) + (51 if how == "torn frame" else 11)  # the first line that does not fit
    with pytest.raises(
        ValueError, match=re.escape(f"trajectory '{traj}' is damaged at line {line} (frame 3")
    ):
        repair_trajectory(traj, CUT)
    assert traj.read_bytes() == _damaged(full, how)  # untouched
    thermo = tmp_path / "th.txt"
    thermo.write_text("# step\n0 0 1 2 3 4\n2 4 1 2 x 4\n4 8 1 2 3 4\n")
    with pytest.raises(
        ValueError, match=re.escape(f"thermo log '{thermo}' line 3 is not a row of 6 numbers")
    ):
        repair_thermo(thermo, CUT)
    if how == "torn frame":  # through the driver: every rank raises it before step 1
        shutil.copy(runs / "ck.pt", tmp_path / "ck.pt")
        cfg = MDConfig(steps=STEPS, restart=str(tmp_path / "ck.pt"), trajectory=str(traj), **BASE)
        errs = run_on_world(_restart_error, 2, cfg)
        assert errs[0] == errs[1] and errs[0][0] == SETUP, errs
        assert f"trajectory '{traj}' is damaged at line {line}" in errs[0][1], errs


def test_stale_temporaries_of_this_runs_files_are_removed(tmp_path):
    ours = ["ck.pt.ab_cd123.tmp", "t.extxyz.x1y2z3w4.tmp", "th.txt.00000000.tmp", "t.extxyz.tmp4242"]
    others = [
        "ck.pt.tmp",  # another writer's pattern
        "ck.pt.abcdefgh.tmp.bak",
        "other.pt.abcdefgh.tmp",
        "ck.pt.ABCDEFGH.tmp",  # not mkstemp's alphabet
        "ck.pt.abcdefghi.tmp",  # nine characters
        "notes.txt",
    ]
    for name in ours + others:
        (tmp_path / name).write_text("x")
    (tmp_path / "th.txt.zzzzzzzz.tmp").mkdir()  # a directory is no temporary of ours
    cfg = MDConfig(
        steps=1,
        checkpoint=str(tmp_path / "ck.pt"),
        trajectory=str(tmp_path / "t.extxyz"),
        thermo=str(tmp_path / "th.txt"),
        **BASE,
    )
    notes = run_on_world(md_rank, 2, cfg)[0]["file_repairs"]
    assert len(notes) == 1 and notes[0].startswith("removed 4 stale temporary file(s) of killed writers"), (
        notes
    )
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(others + ["th.txt.zzzzzzzz.tmp", "ck.pt", "t.extxyz", "th.txt"])
    assert all((tmp_path / name).read_text() == "x" for name in others)


def _bad_paths(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    return {
        "missing directory": (str(tmp_path / "no" / "such" / "out"), "which does not exist"),
        "a directory": (str(tmp_path / "a_dir"), "is a directory"),
        "under a file": (str(tmp_path / "a_file" / "out"), "which is a file, not a directory"),
    }


def test_unwritable_paths_are_named_with_the_fix(tmp_path):
    for option in ("--checkpoint", "--trajectory", "--thermo"):
        for path, why in _bad_paths(tmp_path).values():
            with pytest.raises(
                ValueError, match=re.escape(f"{option} '{path}' ") + f".*{why}.*existing, writable directory"
            ):
                check_writable({"--checkpoint": None, option: path})
    check_writable({"--thermo": str(tmp_path / "fine.txt"), "--checkpoint": None})


@pytest.mark.parametrize(
    ("option", "case"),
    [("checkpoint", "missing directory"), ("trajectory", "a directory"), ("thermo", "under a file")],
)
def test_unwritable_path_fails_before_step_1_on_every_rank(tmp_path, option, case):
    path, why = _bad_paths(tmp_path)[case]
    files = {k: str(tmp_path / f"{k}.out") for k in ("checkpoint", "trajectory", "thermo")}
    files[option] = path
    errs = run_on_world(_restart_error, 2, MDConfig(steps=20, **files, **BASE))
    assert errs[0] == errs[1] and errs[0][0] == SETUP, errs  # the same error on both ranks
    assert f"--{option} '{path}'" in errs[0][1] and why in errs[0][1], errs
    # nothing ran: the thermo row and frame of step 0 are written before step 1
    assert not any(os.path.exists(p) for k, p in files.items() if k != option)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]


def test_unwritable_path_from_the_command_line_and_run_md(tmp_path, capsys):
    from twinshard.atoms import LennardJones, fcc_argon, run_md
    from twinshard.cli import main

    path, why = _bad_paths(tmp_path)["missing directory"]
    assert main(["md", "--atoms", "32", "--steps", "1", "--ranks", "1", "--trajectory", path]) == 1
    err = capsys.readouterr().err
    assert f"--trajectory '{path}'" in err and why in err
    with pytest.raises(RankFailure, match=re.escape(f"checkpoint= '{path}' ") + f".*{why}"):
        run_md(fcc_argon(n_atoms=108), LennardJones(cutoff=5.0), ranks=1, steps=2, checkpoint=path)
