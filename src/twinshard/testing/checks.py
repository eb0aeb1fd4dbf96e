"""Parity checks that cannot pass vacuously.

Each check raises AssertionError with a message that says what failed and where
(which tensor, which rank, which grid), and the parity checks log evidence on
success. ``check_twin`` composes them for a module twin whose ranks return a
``TwinResult`` (see its docstring); the single checks serve custom harnesses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from twinshard.comm.adjoint import adjoint_pair  # noqa: F401  (re-exported; it lives with the comm ops)
from twinshard.testing.evidence import Evidence, log
from twinshard.testing.inputs import GRAD_SEED

# Where a rank's shard sits in the full tensor: a block (one slice per leading dim) or the
# rows along dim 0 (e.g. atom global ids).
Index = Union[tuple[slice, ...], torch.Tensor]
Piece = tuple[torch.Tensor, Index]

DEFAULT_REDUCTION = 4096
"""Reduction length the default budget covers: the longest sum in this project's parity
tests (channels x tokens, neighbours x features) is below it; pass ``reduction=`` above it."""


@dataclass(frozen=True)
class Tolerance:
    """An ``assert_close`` budget and the sentence that derives it (goes into the evidence)."""

    rtol: float
    atol: float
    why: str

    def describe(self) -> str:
        return f"rtol={self.rtol:.2g} atol={self.atol:.3g} ({self.why})"


def tolerance(dtype: torch.dtype, scale: float, reduction: int | None = None) -> Tolerance:
    """The round-off budget for comparing a distributed result with its serial twin.

    Both runs compute the same sums in different orders. Summing n terms in a floating type of
    unit round-off eps leaves an error of about sqrt(n) * eps times the magnitude of the result
    for terms of mixed sign (the probabilistic bound of Higham, "Accuracy and Stability of
    Numerical Algorithms", 2nd ed., sec. 4.2); a factor 16 covers the two runs, the distribution
    tail and a few chained reductions. Sums accumulate in ``promote_types(dtype, float32)``
    (DESIGN rule 5) and each output element is rounded once to ``dtype`` in either run. So

        atol = scale * (2 * eps(dtype) + 16 * sqrt(n) * eps(accumulate)),  rtol = 0,

    with ``scale = max|expected|`` and ``n = reduction`` (default ``DEFAULT_REDUCTION``). For
    float64 and n = 4096 that is 2.3e-13 x scale: a float32 cast anywhere on the path (relative
    error ~6e-8) exceeds it by five orders of magnitude. float32: 1.2e-4 x scale; bfloat16:
    1.6e-2 x scale.
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        return Tolerance(0.0, 0.0, f"exact ({str(dtype).replace('torch.', '')})")
    n = DEFAULT_REDUCTION if reduction is None else int(reduction)
    if n < 1:
        raise ValueError(f"reduction length must be >= 1, got {n}")
    eps_out = torch.finfo(dtype).eps
    eps_acc = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    k = 2 * eps_out + 16 * math.sqrt(n) * eps_acc
    scale = max(float(scale), torch.finfo(torch.float64).tiny)
    why = f"round-off: {k:.2g} x max|ref| {scale:.3g} ({str(dtype).replace('torch.', '')}, n={n})"
    return Tolerance(0.0, k * scale, why)


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    if actual.numel() == 0:
        return 0.0, 0.0
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    diff = (a - e).abs()
    rel = diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    return float(diff.max()), float(rel.max())


def _scale(expected: torch.Tensor) -> float:
    return float(expected.detach().abs().max()) if expected.numel() else 0.0


def parity_tolerance(
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
    why: str | None = None,
    reduction: int | None = None,
) -> Tolerance:
    """The tolerance ``assert_parity`` applies: the round-off budget of ``tolerance`` unless the
    caller gives ``rtol`` and ``atol`` with ``why``, the sentence that derives them."""
    if rtol is None and atol is None:
        if why is not None:
            raise ValueError("why= explains a given rtol/atol; without them the round-off budget applies")
        return tolerance(expected.dtype, _scale(expected), reduction)
    if rtol is None or atol is None:
        raise ValueError("give both rtol and atol (a derived tolerance) or neither")
    if not why:
        raise ValueError(
            "a tolerance given to a parity check must say how it was derived: pass why='...' "
            "(it goes into the evidence line)"
        )
    return Tolerance(float(rtol), float(atol), why)


def assert_parity(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    grid: str = "-",
    rtol: float | None = None,
    atol: float | None = None,
    why: str | None = None,
    reduction: int | None = None,
    checks: Sequence[str] = (),
) -> Evidence:
    """``actual`` (distributed) equals ``expected`` (serial) within round-off; logs one evidence
    line on success.

    The default budget is ``tolerance(expected.dtype, max|expected|, reduction)`` (read its
    docstring for the derivation). A test that needs another budget passes ``rtol``, ``atol``
    and ``why``, the derivation, which the evidence line repeats.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(
            f"parity of {what} on grid {grid}: expected tensors, got "
            f"{type(actual).__name__} and {type(expected).__name__}"
        )
    tol = parity_tolerance(expected, rtol, atol, why, reduction)
    if actual.shape != expected.shape:
        raise AssertionError(
            f"parity of {what} on grid {grid}: distributed result has shape "
            f"{tuple(actual.shape)}, serial has {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(
            f"parity of {what} on grid {grid}: distributed result is {actual.dtype}, serial is "
            f"{expected.dtype} (a cast on the distributed path?)"
        )
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tol.rtol,
        atol=tol.atol,
        msg=lambda m: f"parity of {what} on grid {grid} fails against {tol.describe()}:\n{m}",
    )
    max_abs, max_rel = _errors(actual, expected)
    ev = Evidence(what, grid, max_abs, max_rel, tol.describe(), tuple(checks), tol.atol)
    log(ev)
    return ev


def assert_replicated(per_rank: Sequence[Any], what: str) -> None:
    """Every rank holds a bitwise-identical value (tensors, or nested dicts/lists of them)."""
    ref = per_rank[0]
    for r, v in enumerate(per_rank[1:], start=1):
        _same(ref, v, what, r)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values, NaN where the other has NaN: a NaN that a collective
    copied to every rank is replicated (``torch.equal`` calls it different, NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    a, b = a.detach(), b.detach()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _replication_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"rank 0 has {a.dtype} {tuple(a.shape)}, this rank {b.dtype} {tuple(b.shape)}"
    x, y = a.detach().double(), b.detach().double()
    nan_x, nan_y = x.isnan(), y.isnan()
    both = ~(nan_x | nan_y)
    finite = float((x[both] - y[both]).abs().max()) if bool(both.any()) else 0.0
    text = f"max diff {finite:.3g} where neither is NaN"
    if bool((nan_x != nan_y).any()):
        text += f"; NaN at {int((nan_x != nan_y).sum())} elements on one rank only"
    return text


def _same(a: Any, b: Any, what: str, rank: int) -> None:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or not _identical(a, b):
            diff = _replication_diff(a, b) if isinstance(b, torch.Tensor) else f"got {type(b).__name__}"
            raise AssertionError(
                f"{what} is not replicated: rank {rank} differs from rank 0 ({diff}); a "
                "replicated value must be identical on every rank (a missing all-reduce or broadcast?)"
            )
    elif isinstance(a, Mapping):
        if set(a) != set(b):
            raise AssertionError(f"{what}: rank {rank} has keys {sorted(b)}, rank 0 has {sorted(a)}")
        for k in a:
            _same(a[k], b[k], f"{what}[{k}]", rank)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{what}: rank {rank} has {len(b)} items, rank 0 has {len(a)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]", rank)
    elif a != b:
        raise AssertionError(f"{what} is not replicated: rank {rank} has {b!r}, rank 0 has {a!r}")


def _at(full: torch.Tensor, index: Index) -> torch.Tensor:
    if isinstance(index, torch.Tensor):
        if index.dtype != torch.int64 or index.dim() != 1:
            raise TypeError(f"a row index must be a 1-D int64 tensor, got {index.dtype} of dim {index.dim()}")
        return full.index_select(0, index.to(full.device))
    if not isinstance(index, tuple) or not all(isinstance(s, slice) for s in index):
        raise TypeError(f"an index is a tuple of slices or a 1-D int64 tensor of rows, got {index!r}")
    return full[index]


def rows_of(ids: torch.Tensor, full_ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``full_ids`` (unique global ids, any order) holding ``ids``: the row index of a
    rank's atoms in the serial system, for ``assert_shards_cover``. Unknown ids raise."""
    sorted_ids, perm = full_ids.sort()
    ids = ids.contiguous()
    pos = torch.searchsorted(sorted_ids, ids).clamp_max(max(len(sorted_ids) - 1, 0))
    if ids.numel() and not torch.equal(sorted_ids[pos], ids):
        raise AssertionError(f"ids {ids[sorted_ids[pos] != ids][:5].tolist()} are not in the serial system")
    return perm[pos]


def by_id(
    results: Sequence[Mapping[str, Any]], key: str, full_ids: torch.Tensor, ids: str = "ids"
) -> torch.Tensor:
    """Every rank's per-atom ``result[key]`` (rows named by ``result[ids]``) assembled in the order
    of ``full_ids`` (the serial system's ids). Raises unless every atom is owned by exactly one rank."""
    first = results[0][key]
    out = torch.full((len(full_ids),) + tuple(first.shape[1:]), float("nan"), dtype=first.dtype)
    seen = torch.zeros(len(full_ids), dtype=torch.int64)
    for r in results:
        rows = rows_of(r[ids], full_ids)
        out[rows] = r[key].to(out.device)
        seen[rows] += 1
    if not bool((seen == 1).all()):
        raise AssertionError(
            f"{key}: atoms {full_ids[seen != 1][:5].tolist()} are owned by {seen[seen != 1][:5].tolist()} "
            "ranks (each atom must be owned by exactly one)"
        )
    return out


def assert_shards_cover(
    pieces: Sequence[Piece | Sequence[Piece]],
    full: torch.Tensor,
    what: str,
    *,
    disjoint: bool = False,
    allow_empty: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    why: str | None = None,
) -> bool:
    """Sharding is active and honest: ``pieces[r]`` is rank r's ``(local, index)`` piece (or a
    list of them) of ``full``, where ``index`` is a tuple of slices (a block) or a 1-D int64
    tensor of rows along dim 0 (global ids).

    Checks, on more than one rank: every rank holds a non-empty piece (``allow_empty`` admits
    empty ranks when at least two are not) that is a strict part of ``full`` (fewer elements);
    every piece equals ``full`` at its index (parity budget of ``assert_parity``); together the
    pieces cover every element of ``full``; with ``disjoint``, no element is held twice (owned
    atoms). On one rank the piece must equal and cover ``full``. Returns True when sharding was
    proven (more than one rank).
    """
    per_rank = []
    for r, p in enumerate(pieces):
        rank_pieces = [p] if isinstance(p, tuple) else list(p)
        for q in rank_pieces:
            if not (isinstance(q, tuple) and len(q) == 2 and isinstance(q[0], torch.Tensor)):
                raise TypeError(
                    f"{what}: rank {r} gives {type(q).__name__}, not a (local, index) piece: say where "
                    "the local block sits in the full tensor (a tuple of slices, or int64 rows)"
                )
        per_rank.append(rank_pieces)
    tol = parity_tolerance(full, rtol, atol, why)
    multi = len(per_rank) > 1
    covered = torch.zeros(full.shape, dtype=torch.int32)
    nonempty = 0
    for r, rank_pieces in enumerate(per_rank):
        held = sum(int(local.numel()) for local, _ in rank_pieces)
        if held == 0 and not (multi and allow_empty):
            raise AssertionError(
                f"{what} is not sharded: rank {r} holds no element of it; every rank must hold a "
                "non-empty part (choose sizes that give each rank real data)"
            )
        nonempty += held > 0
        for local, index in rank_pieces:
            if multi and local.numel() >= full.numel():
                raise AssertionError(
                    f"{what} is not sharded: rank {r} holds {local.numel()} elements, as many as the "
                    f"full tensor ({full.numel()}); a parity test on replicated data proves nothing "
                    "about the distributed code"
                )
            ref = _at(full, index)
            if tuple(local.shape) != tuple(ref.shape):
                raise AssertionError(
                    f"{what}: rank {r}'s piece has shape {tuple(local.shape)} but its index selects "
                    f"{tuple(ref.shape)} of the full tensor"
                )
            torch.testing.assert_close(
                local.detach().cpu(),
                ref.detach().cpu(),
                rtol=tol.rtol,
                atol=tol.atol,
                msg=lambda m, r=r: (
                    f"{what}: rank {r}'s piece differs from the full tensor at its index ({tol.describe()}):\n{m}"
                ),
            )
            ones = torch.ones(ref.shape, dtype=torch.int32)
            if isinstance(index, torch.Tensor):
                covered.index_add_(0, index.cpu(), ones)
            else:
                covered[index] += ones
    if multi and nonempty < 2:
        raise AssertionError(f"{what} is not sharded: only {nonempty} rank holds any of it")
    missing = int((covered == 0).sum())
    if missing:
        first = tuple(int(i) for i in (covered == 0).nonzero()[0])
        raise AssertionError(
            f"{what}: the ranks' pieces do not cover the full tensor: {missing} of {full.numel()} "
            f"elements are held by no rank (first at {first}); a dropped row or tile?"
        )
    if disjoint and bool((covered > 1).any()):
        twice = int((covered > 1).sum())
        first = tuple(int(i) for i in (covered > 1).nonzero()[0])
        raise AssertionError(
            f"{what}: {twice} elements are held by more than one rank (first at {first}); each must "
            "have exactly one owner (a duplicated row?)"
        )
    return multi


def assert_grads_finite_nonzero(grads: Mapping[str, torch.Tensor | None], where: str) -> None:
    """Each gradient exists, is finite and is not all zeros (a zero gradient makes parity vacuous)."""
    for name, g in grads.items():
        if g is None:
            raise AssertionError(f"{where}: gradient of {name} is None (not connected to the output?)")
        if not bool(torch.isfinite(g).all()):
            raise AssertionError(f"{where}: gradient of {name} has NaN or inf entries")
        if not bool(g.any()):
            raise AssertionError(
                f"{where}: gradient of {name} is all zeros: parity through it would "
                "be vacuous (zero-initialised weights? call perturb_zero_parameters)"
            )


def assert_random_grad_output(grad_output: torch.Tensor) -> None:
    """The gradient fed to backward is not uniform (as ``.sum().backward()`` would make it)."""
    flat = grad_output.detach().reshape(-1)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        raise AssertionError(
            "grad_output is uniform (as from .sum().backward()): sign, permutation and "
            "transposition bugs in backward cancel out under it; use "
            "twinshard.testing.random_grad_output"
        )


def assert_nonzero_parameters(module: nn.Module, where: str) -> None:
    """No parameter is all zeros (its gradient parity would prove little)."""
    for name, p in module.named_parameters():
        if p.numel() and not bool(p.detach().any()):
            raise AssertionError(
                f"{where}: parameter {name} is all zeros; call "
                "twinshard.testing.perturb_zero_parameters(module) first"
            )


def assert_same_parameters(
    serial: nn.Module | Sequence[tuple[str, tuple[int, ...]]],
    twin: nn.Module | Sequence[tuple[str, tuple[int, ...]]],
) -> None:
    """The twin registers the serial module's parameters: same names, order and shapes."""

    def sig(m: Any) -> list[tuple[str, tuple[int, ...]]]:
        return (
            [(n, tuple(p.shape)) for n, p in m.named_parameters()]
            if isinstance(m, nn.Module)
            else [(n, tuple(s)) for n, s in m]
        )

    s, t = sig(serial), sig(twin)
    if s != t:
        raise AssertionError(
            f"twin parameters differ from the serial module's (names, order, "
            f"shapes):\n serial: {s}\n twin:   {t}"
        )


def parameter_signature(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter in order: what ranks return for assert_same_parameters."""
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


@dataclass
class TwinResult:
    """What each rank returns to ``check_twin``.

    out: the distributed output, collected to full size (tests may gather);
    grads_in: input gradients, collected to full size, by input name;
    param_grads: this rank's copy of each replicated parameter's gradient, by name;
    shards: this rank's ``(local, index)`` pieces of the sharded inputs and output, by name (an
        input's name, or ``"out"``): ``local`` holds only real (unpadded) entries and ``index`` is
        where they sit in the full tensor (a tuple of slices, or 1-D int64 rows along dim 0);
    params: the twin's (name, shape) parameter signature.
    """

    out: torch.Tensor
    grads_in: dict[str, torch.Tensor] = field(default_factory=dict)
    param_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: dict[str, Piece] = field(default_factory=dict)
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


def _check_shards(
    what: str,
    ranks: Sequence[TwinResult],
    full: Mapping[str, torch.Tensor],
    tol: Mapping[str, Any],
) -> bool:
    names = sorted(ranks[0].shards)
    for r, res in enumerate(ranks):
        if sorted(res.shards) != names:
            raise AssertionError(f"{what}: rank {r} returns shards {sorted(res.shards)}, rank 0 {names}")
    if len(ranks) > 1 and not names:
        raise AssertionError(
            f"{what}: no sharding evidence: on a grid of {len(ranks)} ranks each rank must return "
            "its (local, index) pieces of the sharded inputs or output in TwinResult.shards; a twin "
            "whose ranks all run the serial module would otherwise pass"
        )
    for name in names:
        if name not in full:
            raise AssertionError(
                f"{what}: shard {name!r} names no serial tensor (inputs {sorted(k for k in full if k != 'out')} "
                "or 'out')"
            )
        assert_shards_cover([res.shards[name] for res in ranks], full[name], f"{what}: {name}", **tol)
    return len(ranks) > 1


def check_twin(
    *,
    what: str,
    grid: str,
    serial_module: nn.Module | None,
    serial_out: torch.Tensor,
    serial_grads_in: Mapping[str, torch.Tensor],
    serial_param_grads: Mapping[str, torch.Tensor],
    ranks: Sequence[TwinResult],
    grad_output: torch.Tensor,
    serial_inputs: Mapping[str, torch.Tensor] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    why: str | None = None,
    reduction: int | None = None,
    zero_grads: Sequence[str] = (),
) -> list[Evidence]:
    """All the anti-vacuous checks and parity of a module twin against its serial run.

    ``zero_grads`` names parameters whose gradient is zero in exact arithmetic (a LayerNorm bias
    that shifts a whole softmax row, a conditioning that no input switches on, a norm of zeros in
    the first recycling cycle): they are taken out of the non-zero and relative-parity checks and
    checked, on both sides, against zero at the round-off budget of the largest gradient (exact
    zeros pass; a real gradient does not). Each must be in the serial parameter gradients.

    Order: grad_output random; serial parameters non-zero; parameter names/order equal; outputs,
    input grads and parameter grads replicated across ranks; sharding active and honest on more
    than one rank (``assert_shards_cover`` of each rank's pieces against the serial input of that
    name or the serial output); gradients finite and non-zero; parity of output, each input grad
    and each parameter grad (round-off budget unless ``rtol``/``atol`` come with ``why``).
    Returns the evidence lines.
    """
    tol = {"rtol": rtol, "atol": atol, "why": why}
    assert_random_grad_output(grad_output)
    missing = [k for k in zero_grads if k not in serial_param_grads]
    if missing:
        raise AssertionError(f"{what}: zero_grads {missing} are not parameters of the serial module")
    zero_serial = {k: serial_param_grads[k] for k in zero_grads}
    zero_twin = [{k: r.param_grads.get(k) for k in zero_grads} for r in ranks]
    serial_param_grads = {k: g for k, g in serial_param_grads.items() if k not in zero_serial}
    ranks = [
        dataclasses.replace(r, param_grads={k: g for k, g in r.param_grads.items() if k not in zero_serial})
        for r in ranks
    ]
    if serial_module is not None:
        assert_nonzero_parameters(serial_module, what)
        for r, res in enumerate(ranks):
            try:
                assert_same_parameters(serial_module, res.params)
            except AssertionError as e:
                raise AssertionError(f"{what}, rank {r}: {e}") from None
    done = ["random_grad_output", "nonzero_params", "param_names"]
    assert_replicated([r.out for r in ranks], f"{what}: collected output")
    assert_replicated([r.grads_in for r in ranks], f"{what}: collected input gradients")
    assert_replicated([r.param_grads for r in ranks], f"{what}: parameter gradients")
    done.append("replicated")
    full = dict(serial_inputs or {}) | {"out": serial_out}
    if _check_shards(what, ranks, full, tol):
        done.append("sharded")
    assert_grads_finite_nonzero(dict(serial_grads_in) | dict(serial_param_grads), f"{what} (serial)")
    assert_grads_finite_nonzero(ranks[0].grads_in | ranks[0].param_grads, f"{what} (distributed)")
    done.append("grads_finite_nonzero")
    if set(ranks[0].param_grads) != set(serial_param_grads):
        raise AssertionError(
            f"{what}: distributed parameter gradients {sorted(ranks[0].param_grads)} "
            f"!= serial {sorted(serial_param_grads)}"
        )
    if set(ranks[0].grads_in) != set(serial_grads_in):
        raise AssertionError(
            f"{what}: distributed input gradients {sorted(ranks[0].grads_in)} != serial {sorted(serial_grads_in)}"
        )
    kw = dict(grid=grid, reduction=reduction, checks=done, **tol)
    evs = [assert_parity(ranks[0].out, serial_out, what=f"{what} output", **kw)]
    for name, g in serial_grads_in.items():
        evs.append(assert_parity(ranks[0].grads_in[name], g, what=f"{what} d/d{name}", **kw))
    for name, g in serial_param_grads.items():
        evs.append(assert_parity(ranks[0].param_grads[name], g, what=f"{what} param grad {name}", **kw))
    if zero_serial:
        assert_replicated(zero_twin, f"{what}: analytically zero parameter gradients")
        scale = max(float(g.abs().max()) for g in serial_param_grads.values())
        for name, g in zero_serial.items():
            t = tolerance(torch.float64 if g is None else g.dtype, scale, reduction)
            zkw = dict(grid=grid, checks=done, rtol=0.0, atol=t.atol, why=f"analytically zero; {t.why}")
            for side, got in (("serial", g), ("distributed", zero_twin[0][name])):
                if got is None:  # the parameter took no part: its gradient is exactly zero
                    got = torch.zeros_like(g) if g is not None else torch.zeros(())
                evs.append(
                    assert_parity(got, torch.zeros_like(got), what=f"{what} {side} grad {name} (zero)", **zkw)
                )
    return evs


def serial_reference(
    module: nn.Module | None,
    forward: Any,
    inputs: Mapping[str, torch.Tensor],
    grad_seed: int = GRAD_SEED,
    grad_output: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Run the serial twin forward and backward (random grad_output) and return the keyword
    arguments ``check_twin`` takes for the serial side: ``check_twin(..., **serial_reference(...))``.

    ``forward(**leaves)`` computes the output from leaf copies of ``inputs`` (which get the input
    gradients); ``module`` supplies the parameter gradients (None for a parameter-free op).
    """
    from twinshard.testing.inputs import random_grad_output

    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    out = forward(**leaves)
    g = random_grad_output(out, seed=grad_seed) if grad_output is None else grad_output
    out.backward(g)
    params = {} if module is None else {k: p.grad for k, p in module.named_parameters()}
    return {
        "serial_module": module,
        "serial_inputs": {k: v.detach() for k, v in inputs.items()},
        "serial_out": out.detach(),
        "serial_grads_in": {k: v.grad for k, v in leaves.items()},
        "serial_param_grads": params,
        "grad_output": g,
    }
