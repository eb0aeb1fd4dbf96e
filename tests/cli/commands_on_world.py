"""Run by ``torchrun`` from ``tests/cli/test_torchrun.py``: every ``twinshard`` command, one after
the other, in the one world torchrun launched (joined once here, so the suite pays one launch).

Each rank writes one marker line per command to stderr: ``RAN <name> rank <r> code <c> pool <p>
children <k>`` (``pool``: whether a local worker pool was started; ``children``: live child
processes). The commands print their results on stdout as they would on their own (rank 0 only),
so no marker of another rank lands inside a result line.
"""

import multiprocessing
import os
import sys
import tempfile

import twinshard.runtime.pool as pool
from twinshard.cli import main
from twinshard.runtime import init_world

# the whole Boltz-2 trunk at small widths (twinshard trunk's default mode)
TRUNK_SMALL = [
    *("--single-channels", "8", "--pair-channels", "4", "--heads", "2", "--pair-head-width", "2"),
    *("--pair-heads", "2", "--atom-channels", "4", "--atom-pair-channels", "2", "--msa-channels", "4"),
    *("--template-channels", "4", "--bins", "8", "--msa-heads", "2", "--msa-head-width", "2"),
    *("--opm-hidden", "2", "--atoms-per-token", "4", "--msa", "3"),
]

# one output directory for every rank of this launch (their parent is the torchrun agent)
PREDICT_OUT = os.path.join(tempfile.gettempdir(), f"twinshard_predict_torchrun_{os.getppid()}")

COMMANDS = {
    "demo": ["demo"],
    "selftest": ["selftest", "--device", "cpu", "--json"],
    "md": ["md", "--atoms", "108", "--steps", "3", "--partition", "block", "--check-serial", "--json"],
    "trunk": ["trunk", "--tokens", "9", "--grid", "2x2", "--layers", "1", *TRUNK_SMALL, "--json"],
    "predict": [
        *("predict", "--tokens", "9", "--grid", "2x2", "--sampling-steps", "2", "--recycling-steps", "0"),
        *("--no-progress", "--check-serial", "--out", PREDICT_OUT, "--json"),
    ],
    "validate": ["validate", "--potential", "mpnn", "--json"],
    "bench-pair": ["bench", "pair", "--op", "trimul-out", "--grid", "2x2", "--tokens", "9", "--json"],
    "bench-harness": ["bench", "harness", "--ranks", "4", "--repeat", "2"],
    "bench-migrate": ["bench", "migrate", "--ranks", "4", "--migrations", "1", "--json"],
    "bench-atoms": [
        "bench",
        "atoms",
        "--mode",
        "md",
        "--ranks",
        "4",
        "--potential",
        "lj",
        "--atoms",
        "256",
        "--steps",
        "1",
        "--json",
    ],  # fmt: skip
    # a grid that does not match the world: the same clear error on every rank, no local ranks
    "trunk-wrong-grid": ["trunk", "--tokens", "9", "--grid", "1x2", "--layers", "1", "--json"],
}

if __name__ == "__main__":
    world = init_world()
    names = sys.argv[1:] or list(COMMANDS)
    for name in names:
        code = main(COMMANDS[name])
        sys.stdout.flush()
        children = len(multiprocessing.active_children())
        print(
            f"RAN {name} rank {world.rank} code {code} pool {pool._SHARED is not None} children {children}",
            file=sys.stderr,
            flush=True,
        )
