"""run_md and the calculator on local ranks from the places users call them: a script without an
``if __name__ == "__main__":`` guard, the same script on standard input, and ``python -c`` (a
``__main__`` without a file, as in a notebook), each with a potential class and a rank function
defined in that ``__main__`` (they reach the workers by value). The three run concurrently."""

import os
import subprocess
import sys
import time

SCRIPT = '''
import os

import ase.build
import torch

from twinshard.atoms import LennardJones, TwinshardCalculator, evaluate, fcc_argon, run_md
from twinshard.runtime import run_ranks


class HalfLJ(LennardJones):
    """Defined in __main__: the ranks get it by value."""

    def forward(self, graph):
        if not getattr(self, "said", False):
            self.said = True
            print("HalfLJ on worker", os.environ.get("TWINSHARD_WORKER"), flush=True)
        return 0.5 * super().forward(graph)


def calculator_energy(distributed):
    atoms = ase.build.bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    atoms.calc = TwinshardCalculator(HalfLJ(cutoff=6.0), distributed=distributed)
    return atoms.get_potential_energy()


out = run_md(fcc_argon(repeat=3), HalfLJ(cutoff=6.0), ranks=2, steps=3)
serial = float(evaluate(HalfLJ(cutoff=6.0), out.system).energy)
print("MD", out.system.n_atoms, out.ranks, abs(out.energy - serial) < 1e-9 * abs(serial), flush=True)
ranks = run_ranks(calculator_energy, 2, True)
print("CALC", [abs(e - calculator_energy(False)) < 1e-9 for e in ranks], flush=True)
'''


def test_run_md_and_calculator_from_script_stdin_and_c(tmp_path):
    script = tmp_path / "md_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ways = {
        "script": ([sys.executable, str(script)], None),
        "stdin": ([sys.executable, "-"], script),
        "-c": ([sys.executable, "-c", SCRIPT], None),
    }
    t = time.monotonic()
    procs = {}
    for name, (cmd, stdin) in ways.items():
        with open(stdin) if stdin else open(os.devnull) as f:
            procs[name] = subprocess.Popen(
                cmd,
                stdin=f,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
                env=env,
            )
    outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        out = outs[name]
        assert p.returncode == 0, (name, out[-3000:])
        assert "MD 108 2 True" in out and "CALC [True, True]" in out, (name, out[-3000:])
        # the __main__ class ran on both ranks (run_md, then the calculator)
        assert {ln for ln in out.splitlines() if ln.startswith("HalfLJ on worker")} >= {
            "HalfLJ on worker 0",
            "HalfLJ on worker 1",
        }, (name, out)
        assert out.count("MD 108") == 1, (name, out)  # no worker re-ran the script
        assert "Traceback" not in out, (name, out)
    assert time.monotonic() - t < 300
