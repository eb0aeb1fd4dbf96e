"""Parity checks that cannot pass vacuously.

Each check raises AssertionError with a message that says what failed and where
(which tensor, which rank, which grid), and the parity checks log evidence on
success. ``check_twin`` composes them for a module twin whose ranks return a
``TwinResult`` (see its docstring); the single checks serve custom harnesses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from twinshard.testing.evidence import Evidence, log


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    if actual.numel() == 0:
        return 0.0, 0.0
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    diff = (a - e).abs()
    rel = diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    return float(diff.max()), float(rel.max())


def _tol(dtype: torch.dtype, rtol: float | None, atol: float | None) -> str:
    if rtol is None and atol is None:
        return f"default tolerances ({str(dtype).replace('torch.', '')})"
    return f"rtol={rtol:g} atol={atol:g} (derived)"


def assert_parity(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    grid: str = "-",
    rtol: float | None = None,
    atol: float | None = None,
    checks: Sequence[str] = (),
) -> Evidence:
    """``assert_close(actual, expected)`` (default tolerances unless both are given, derived
    from an error budget); logs one evidence line on success."""
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol (a derived tolerance) or neither")
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(
            f"parity of {what} on grid {grid}: expected tensors, got "
            f"{type(actual).__name__} and {type(expected).__name__}"
        )
    if actual.shape != expected.shape:
        raise AssertionError(
            f"parity of {what} on grid {grid}: distributed result has shape "
            f"{tuple(actual.shape)}, serial has {tuple(expected.shape)}"
        )
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"parity of {what} on grid {grid} fails:\n{m}"
    )
    max_abs, max_rel = _errors(actual, expected)
    ev = Evidence(what, grid, max_abs, max_rel, _tol(expected.dtype, rtol, atol), tuple(checks))
    log(ev)
    return ev


def assert_replicated(per_rank: Sequence[Any], what: str) -> None:
    """Every rank holds a bitwise-identical value (tensors, or nested dicts/lists of them)."""
    ref = per_rank[0]
    for r, v in enumerate(per_rank[1:], start=1):
        _same(ref, v, what, r)


def _same(a: Any, b: Any, what: str, rank: int) -> None:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or not torch.equal(a, b):
            diff = (
                float((a.double() - b.double()).abs().max())
                if isinstance(b, torch.Tensor) and a.shape == b.shape
                else "shape/type differs"
            )
            raise AssertionError(
                f"{what} is not replicated: rank {rank} differs from rank 0 (max diff {diff}); a "
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


def assert_sharded(per_rank_local: Sequence[torch.Tensor], what: str, full_numel: int | None = None) -> bool:
    """The ranks hold different parts of ``what`` (sharding is active). Returns False (skipped)
    on a single rank, where there is nothing to shard."""
    if len(per_rank_local) < 2:
        return False
    first = per_rank_local[0]
    if all(t.shape == first.shape and torch.equal(t, first) for t in per_rank_local[1:]):
        raise AssertionError(
            f"{what} is not sharded: every one of the {len(per_rank_local)} ranks holds the same "
            f"tensor of shape {tuple(first.shape)}; a parity test on replicated data proves nothing "
            "about the distributed code"
        )
    if full_numel is not None:
        for r, t in enumerate(per_rank_local):
            if t.numel() >= full_numel:
                raise AssertionError(
                    f"{what} is not sharded: rank {r} holds {t.numel()} elements, as "
                    f"many as the full tensor ({full_numel})"
                )
    return True


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
    shards: this rank's local blocks of the sharded inputs/outputs, by name;
    params: the twin's (name, shape) parameter signature.
    """

    out: torch.Tensor
    grads_in: dict[str, torch.Tensor] = field(default_factory=dict)
    param_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: dict[str, torch.Tensor] = field(default_factory=dict)
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


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
    rtol: float | None = None,
    atol: float | None = None,
) -> list[Evidence]:
    """All the anti-vacuous checks and parity of a module twin against its serial run.

    Order: grad_output random; serial parameters non-zero; parameter names/order equal; outputs,
    input grads and parameter grads replicated across ranks; sharding active (skipped on one
    rank); gradients finite and non-zero; parity of output, each input grad and each parameter
    grad. Returns the evidence lines.
    """
    assert_random_grad_output(grad_output)
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
    for name in ranks[0].shards:
        if assert_sharded([r.shards[name] for r in ranks], f"{what}: {name}"):
            if "sharded" not in done:
                done.append("sharded")
    assert_grads_finite_nonzero(dict(serial_grads_in) | dict(serial_param_grads), f"{what} (serial)")
    assert_grads_finite_nonzero(ranks[0].grads_in | ranks[0].param_grads, f"{what} (distributed)")
    done.append("grads_finite_nonzero")
    if set(ranks[0].param_grads) != set(serial_param_grads):
        raise AssertionError(
            f"{what}: distributed parameter gradients {sorted(ranks[0].param_grads)} "
            f"!= serial {sorted(serial_param_grads)}"
        )
    evs = [
        assert_parity(
            ranks[0].out, serial_out, what=f"{what} output", grid=grid, rtol=rtol, atol=atol, checks=done
        )
    ]
    for name, g in serial_grads_in.items():
        evs.append(
            assert_parity(
                ranks[0].grads_in[name],
                g,
                what=f"{what} d/d{name}",
                grid=grid,
                rtol=rtol,
                atol=atol,
                checks=done,
            )
        )
    for name, g in serial_param_grads.items():
        evs.append(
            assert_parity(
                ranks[0].param_grads[name],
                g,
                what=f"{what} param grad {name}",
                grid=grid,
                rtol=rtol,
                atol=atol,
                checks=done,
            )
        )
    return evs


def adjoint_pair(f: Any, x: torch.Tensor, seed: int, group: Any = None) -> tuple[float, float]:
    """In-rank: (sum_r <dy_r, f(x)_r>, sum_r <f*(dy)_r, x_r>) for a random dy, summed over
    ``group`` in fp64. Equal up to round-off iff backward is the adjoint of forward (for an op
    linear in x). Every rank gets the same pair."""
    import torch.distributed as dist

    x = x.detach().clone().requires_grad_(True)
    y = f(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    (gx,) = torch.autograd.grad(y, x, dy)
    sums = torch.stack([(dy * y).sum(), (gx * x).sum()]).detach().to(torch.float64)
    dist.all_reduce(sums, group=group)
    return float(sums[0]), float(sums[1])


def serial_reference(
    module: nn.Module | None,
    forward: Any,
    inputs: Mapping[str, torch.Tensor],
    grad_seed: int = 1234,
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
        "serial_out": out.detach(),
        "serial_grads_in": {k: v.grad for k, v in leaves.items()},
        "serial_param_grads": params,
        "grad_output": g,
    }
