#!/usr/bin/env python
"""Mutation sweep: plant realistic one-line bugs and check that the suite catches each one.

Each mutation replaces one exact line fragment in one source file (the fragment must occur
exactly once, so a sweep that no longer matches the code says so instead of passing) and names
the tests expected to catch it. The sweep runs in a private copy of ``src/`` and ``tests/``
(the working tree is never touched; ``--head`` sweeps the committed tree instead), one mutation
at a time, with ``PYTHONPATH`` pointing at the
copy so the pytest plugin and the rank workers import the mutated package.

    python tools/mutations.py              # every mutation; a table, then JSON on the last line
    python tools/mutations.py --list       # the mutations
    python tools/mutations.py --only ID    # one (repeatable)

Exit status 0 only if every mutation applied and was caught.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    id: str
    kind: str
    file: str  # relative to src/twinshard
    find: str
    replace: str
    tests: tuple[str, ...]


M = Mutation
MUTATIONS: list[Mutation] = [
    # -- the README's porting guide runs as written with the template
    M(
        "template_grad_seed_differs",
        "wrong seed",
        "testing/example.py",
        "gy = random_grad_output((n, n, c))  # the default seed, which serial_reference draws too",
        "gy = random_grad_output((n, n, c), seed=2)",
        ("tests/test_readme.py",),
    ),
    # -- runtime: commands on the launched world; the failing rank named on every rank; messages
    M(
        "error_message_last_line_only",
        "message lost",
        "runtime/errors.py",
        'return "\\n".join(ln for ln in lines[i:] if ln.strip())',
        "return lines[-1]",
        ("tests/test_cli_messages.py",),
    ),
    M(
        "mace_notices_not_silenced",
        "noise",
        "atoms/potentials/mace.py",
        'warnings.filterwarnings("ignore", message=message)',
        "pass",
        ("tests/test_cli_messages.py",),
    ),
    M(
        "command_ignores_torchrun_world",
        "wrong world",
        "runtime/pool.py",
        "world = init_world(backend=backend, timeout=timeout)",
        "world = None",
        ("tests/cli/test_commands_torchrun.py",),
    ),
    M(
        "silent_rank_process_not_checked",
        "wrong rank named",
        "runtime/watchdog.py",
        "gone = _gone(store, silent)",
        "gone: list[int] = []",
        ("tests/runtime/test_no_hang.py::test_sigkill_of_one_torchrun_rank_ends_every_rank_naming_it",),
    ),
    M(
        "job_pickled_by_reference",
        "user path",
        "runtime/pool.py",
        "call = cloudpickle.dumps((fn, args, kwargs))",
        "call = pickle.dumps((fn, args, kwargs))",
        (
            "tests/runtime/test_runtime.py::test_jobs_travel_by_value_where_pickle_cannot_import_them",
            "tests/atoms/test_user_scripts.py",
        ),
    ),
    M(
        "sigint_traceback_not_caught",
        "message lost",
        "cli/__init__.py",
        "except (KeyboardInterrupt, Stopped, ConnectionError, EOFError) as exc:",
        "except (Stopped, ConnectionError, EOFError) as exc:",
        (
            "tests/runtime/test_no_hang.py::test_signal_to_the_parent_of_a_local_launch_ends_in_one_line_and_no_orphans",
        ),
    ),
    # -- comm: adjoints, reductions, routing
    M(
        "all_reduce_bwd_dropped",
        "dropped reduction",
        "comm/ops.py",
        'return P.all_reduce(g, ctx.group, op="all_reduce:backward"), None',
        "return g.clone(), None",
        ("tests/comm/test_adjoint.py",),
    ),
    M(
        "sync_grad_bwd_dropped",
        "dropped reduction",
        "comm/ops.py",
        'return P.all_reduce(g, ctx.group, op="sync_grad:backward"), None',
        "return g, None",
        ("tests/comm/test_adjoint.py",),
    ),
    M(
        "sync_params_bwd_dropped",
        "dropped reduction",
        "comm/ops.py",
        'flat = P.all_reduce(flat, ctx.group, op="sync_grad:backward", donate=True)',
        "flat = flat.clone()",
        ("tests/comm/test_adjoint.py",),
    ),
    M(
        "sync_params_copies",
        "memory regression",
        "comm/ops.py",
        "return tuple(p.view_as(p) for p in params)",
        "return tuple(p.clone() for p in params)",
        ("tests/bench/test_bench_pair.py",),
    ),
    M(
        "contraction_grad_channel_last_kept",
        "memory regression",
        "pair/layers/contraction.py",
        "return _TileLayout.apply(z, spec.kernel, x.shape[0], x.shape[-1], y.shape[-1])",
        "return _channel_last(z, x.shape[0], z.dtype) if spec.kernel == 'bmm' else z",
        ("tests/bench/test_bench_pair.py",),
    ),
    M(
        "scatter_index_varying_ignored",
        "silent wrong input",
        "shard/sharded_handlers.py",
        "owner, s, r = _route(ids, offsets, x, nranks, not_constant=varying)",
        "owner, s, r = _route(ids, offsets, x, nranks, not_constant=False)",
        ("tests/shard/test_dispatch.py",),
    ),
    M(
        "all_to_all_bwd_splits",
        "wrong adjoint",
        "comm/ops.py",
        'return P.all_to_all(g, ctx.recv, ctx.send, ctx.group, op="all_to_all:backward")',
        'return P.all_to_all(g, ctx.send, ctx.recv, ctx.group, op="all_to_all:backward")',
        ("tests/comm/test_adjoint.py",),
    ),
    M(
        "reduce_dtype_fp32",
        "fp32 cast",
        "comm/primitives.py",
        "return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype",
        "return torch.float32 if dtype.is_floating_point else dtype",
        ("tests/comm/test_adjoint.py",),
    ),
    M(
        "ring_shift_direction",
        "wrong routing",
        "comm/ops.py",
        'return permute(x, ranks[(i + k) % n], ranks[(i - k) % n], recv_shape, op="ring_shift")',
        'return permute(x, ranks[(i - k) % n], ranks[(i + k) % n], recv_shape, op="ring_shift")',
        ("tests/comm/test_adjoint.py", "tests/pair/test_triangle.py"),
    ),
    M(
        "exchange_dtype_mismatch_unchecked",
        "missing validation",
        "comm/ops.py",
        "    if len(sent) > 1:",
        "    if False:",
        ("tests/comm/test_exchange_grad.py",),
    ),
    M(
        "exchange_mixed_sends_unchecked",
        "silent cast",
        "comm/ops.py",
        "    if _MIXED in ranks_of:",
        "    if False:",
        ("tests/comm/test_exchange_grad.py",),
    ),
    M(
        "exchange_uncarried_dtype_unchecked",
        "missing validation",
        "comm/ops.py",
        "    if _UNCARRIED in ranks_of:",
        "    if False:",
        ("tests/comm/test_exchange_grad.py",),
    ),
    # -- testing: the harness's own checks
    M(
        "replication_nan_unequal",
        "harness misreport",
        "testing/checks.py",
        "return bool(((a == b) | (a.isnan() & b.isnan())).all())",
        "return bool((a == b).all())",
        ("tests/testing/test_checks.py",),
    ),
    # -- runtime: world teardown
    M(
        "late_import_keeps_group_alive",
        "teardown order",
        "runtime/world.py",
        "import torch.distributed.nn.functional  # noqa: F401",
        "import torch.distributed  # noqa: F401",
        ("tests/runtime/test_runtime.py",),
    ),
    # -- atoms: halo exchange and neighbour contract
    M(
        "halo_reverse_dropped",
        "dropped halo sum",
        "atoms/parallel/halo.py",
        "out.index_add_(0, self.send_idx[q].to(y.device), g.to(acc))",
        "out.index_add_(0, self.send_idx[q].to(y.device), 0 * g.to(acc))",
        ("tests/atoms/test_halo.py", "tests/atoms/test_distributed.py"),
    ),
    M(
        "halo_reverse_fp32",
        "fp32 cast",
        "atoms/parallel/halo.py",
        "acc = prim.reduce_dtype(y.dtype)",
        "acc = torch.float32",
        ("tests/atoms/test_halo.py", "tests/atoms/test_distributed.py"),
    ),
    M(
        "halo_forward_misrouted_rows",
        "misrouted rows",
        "atoms/parallel/halo.py",
        "(self.global_peers[q], x[self.send_idx[q].to(x.device)])",
        "(self.global_peers[q], x[self.send_idx[q].roll(1).to(x.device)])",
        ("tests/atoms/test_halo.py", "tests/atoms/test_distributed.py"),
    ),
    M(
        "ghost_shell_thin",
        "dropped halo row",
        "atoms/parallel/halo.py",
        "margin = w / partition.heights()",
        "margin = 0.97 * w / partition.heights()",
        ("tests/atoms/test_halo.py",),
    ),
    M(
        "halo_receiver_off_by_one",
        "off-by-one",
        "atoms/parallel/sharded.py",
        "keep = edges.receivers < self.n_owned",
        "keep = edges.receivers <= self.n_owned",
        # hooks-mode potentials overwrite halo rows, so only the halo invariant sees the extra edges
        ("tests/atoms/test_halo.py", "tests/atoms/test_distributed.py"),
    ),
    # -- atoms: migration, rebuild, global sums, MD keys
    M(
        "migrate_rows_to_wrong_rank",
        "misrouted rows",
        "atoms/parallel/sharded.py",
        "order = torch.sort(dest, stable=True).indices.to(dev)",
        "order = torch.sort(dest, stable=True).indices.roll(1).to(dev)",
        ("tests/atoms/test_sharded.py",),
    ),
    M(
        "rebuild_threshold",
        "stale neighbour list",
        "atoms/parallel/sharded.py",
        "if 2.0 * disp + strain > self.skin or forced:",
        "if 0.25 * disp + strain > self.skin or forced:",
        ("tests/atoms/test_md_parity.py", "tests/atoms/test_sharded.py"),
    ),
    M(
        "potential_sum_dropped",
        "dropped reduction",
        "atoms/parallel/distributed.py",
        'total = prim.all_reduce(packed.to(prim.reduce_dtype(dtype)), sharded.group, op="potential").to(dtype)',
        "total = packed",
        ("tests/atoms/test_distributed.py",),
    ),
    M(
        "langevin_key_local_row",
        "wrong key",
        "atoms/dynamics/integrators.py",
        "xi = rng.normal(self.seed, LANGEVIN_STREAM, ida, int(step), comp, dtype=v.dtype, device=v.device)",
        "xi = rng.normal(self.seed, LANGEVIN_STREAM, ida - ida.min(), int(step), comp, dtype=v.dtype, device=v.device)",
        ("tests/atoms/test_md_parity.py", "tests/atoms/test_md.py"),
    ),
    M(
        "nhc_local_kinetic",
        "missing reduction",
        "atoms/dynamics/integrators.py",
        "return float(self._reduce_sum(2.0 * kinetic_energy(velocities, masses)))",
        "return float(2.0 * kinetic_energy(velocities, masses))",
        ("tests/atoms/test_nose_hoover.py",),
    ),
    M(
        "batch_thermostat_swapped",
        "state swapped",
        "atoms/dynamics/batch.py",
        "chain = self.integrators[s]",
        "chain = self.integrators[chained[(chained.index(s) + 1) % len(chained)]]",
        ("tests/atoms/test_batch_md.py",),
    ),
    M(
        "nhc_chain_not_in_checkpoint",
        "state dropped",
        "atoms/dynamics/integrators.py",
        '            "eta": list(self.eta),\n            "p_eta": list(self.p_eta),\n',
        "",
        ("tests/atoms/test_nose_hoover.py",),
    ),
    M(
        "npt_virial_not_reduced",
        "missing reduction",
        "atoms/parallel/distributed.py",
        "virial = total[1:].reshape(3, 3)",
        "virial = pair.virial.reshape(3, 3).to(dtype)",
        ("tests/atoms/test_npt.py",),
    ),
    M(
        "npt_cell_one_rank",
        "replicated value diverges",
        "atoms/dynamics/integrators.py",
        "self._engine.set_cell(self.cell().to(positions.dtype))  # every rank, the same cell",
        "_ = self._rank == 0 and self._engine.set_cell(self.cell().to(positions.dtype))",
        ("tests/atoms/test_npt.py",),
    ),
    # -- atoms: NPT with stochastic cell rescaling (replicated cell from agreed values, global noise)
    M(
        "scr_virial_not_reduced",
        "missing reduction",
        "atoms/parallel/distributed.py",
        "virial = total[1:].reshape(3, 3)",
        "virial = pair.virial.reshape(3, 3).to(dtype)",
        ("tests/atoms/test_scr.py::test_scr_equals_serial_at_round_off[2-langevin-tri]",),
    ),
    M(
        "scr_cell_one_rank",
        "replicated value diverges",
        "atoms/dynamics/scr.py",
        "self._engine.set_cell(self.cell().to(positions.dtype))  # every rank, the same cell",
        "_ = self._rank == 0 and self._engine.set_cell(self.cell().to(positions.dtype))",
        ("tests/atoms/test_scr.py::test_scr_equals_serial_at_round_off[2-langevin-tri]",),
    ),
    M(
        "scr_noise_keyed_by_rank",
        "random draw keyed by rank",
        "atoms/dynamics/scr.py",
        "xi = rng.normal(self.seed, SCR_STREAM, int(step), self._comps, dtype=torch.float64)",
        "xi = rng.normal(self.seed + self._rank, SCR_STREAM, int(step), self._comps, dtype=torch.float64)",
        ("tests/atoms/test_scr.py::test_scr_equals_serial_at_round_off[2-langevin-tri]",),
    ),
    M(
        "scr_aniso_isotropic_mean",
        "wrong coupling",
        "atoms/dynamics/scr.py",
        "return torch.diagonal(s).clone(), self.beta / (3.0 * vol * self.tau)",
        "return torch.diagonal(s).mean().expand(3).clone(), self.beta / (3.0 * vol * self.tau)",
        ("tests/atoms/test_scr.py::test_one_step_equals_the_published_increments[0.0-aniso]",),
    ),
    M(
        "npt_rebuild_skips_strain",
        "stale neighbour list",
        "atoms/parallel/sharded.py",
        "if 2.0 * disp + strain > self.skin or forced:",
        "if 2.0 * disp > self.skin or forced:",
        ("tests/atoms/test_npt_rebuild.py::test_strain_bound_rebuilds_exactly_when_needed",),
    ),
    # -- atoms: load balance (cut planes where the atoms are, from histograms summed over ranks)
    M(
        "balance_drops_plane_atom",
        "atom dropped at a cut plane",
        "atoms/parallel/balance.py",
        "return (f[:, None] >= inner[group]).sum(1).to(torch.int64)",
        "return (f[:, None] > inner[group]).sum(1).to(torch.int64)",
        ("tests/atoms/test_balance.py::test_atoms_on_cut_planes_belong_to_the_box_that_holds_them",),
    ),
    M(
        "balance_histogram_one_rank",
        "missing reduction",
        "atoms/parallel/sharded.py",
        'return prim.all_reduce(hist.to(dev), self.group, op="balance").cpu()',
        "return hist  # this rank's histogram only",
        ("tests/atoms/test_balance.py::test_balanced_md_equals_serial",),
    ),
    # -- atoms: the files of an MD run (torn tails of a killed run, unwritable paths)
    M(
        "torn_frame_left_in_place",
        "torn file kept",
        "atoms/dynamics/md_files.py",
        "if damage is None and len(keep) == len(frames):",
        "if len(keep) == len(frames):",
        ("tests/atoms/test_torn_files.py",),
    ),
    M(
        "torn_thermo_row_kept",
        "torn file kept",
        "atoms/dynamics/md_files.py",
        'torn = f"line {i + 1}: {text[:40]!r}"',
        "keep.append(raw)",
        ("tests/atoms/test_torn_files.py",),
    ),
    M(
        "mid_file_damage_cut_silently",
        "silent data loss",
        "atoms/dynamics/md_files.py",
        "if damage is not None and damage.more:",
        "if False:",
        ("tests/atoms/test_torn_files.py",),
    ),
    M(
        "writable_check_skipped",
        "late failure",
        "atoms/dynamics/md_files.py",
        "check_writable(dict(zip(names, (checkpoint, trajectory, thermo), strict=True)))",
        "pass",
        ("tests/atoms/test_torn_files.py",),
    ),
    M(
        "thermo_sum_fp32",
        "fp32 cast",
        "atoms/dynamics/run.py",
        "y = x.reshape(-1).to(prim.reduce_dtype(x.dtype)).contiguous()",
        "y = x.reshape(-1).to(torch.float32).contiguous()",
        ("tests/atoms/test_md_parity.py", "tests/atoms/test_driver.py"),
    ),
    # -- tensors: counter-based RNG
    M(
        "philox_key_schedule",
        "wrong key",
        "rng.py",
        "k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32",
        "k0, k1 = (k0 + _W0) & _MASK32, k1",
        ("tests/test_rng.py",),
    ),
    M(
        "rng_range_check_skipped",
        "missing validation",
        "rng.py",
        "            if bool(bad.any()):",
        "            if False:",
        ("tests/test_rng.py",),
    ),
    # -- pairs: padding, dropout keys, replicated gradients, fp32 casts
    M(
        "trimul_padding_mask_skipped",
        "skipped mask",
        "pair/layers/triangle.py",
        "mask_local = keep if mask_local is None else mask_local * keep",
        "mask_local = mask_local",
        ("tests/pair/test_twins_padded.py",),
    ),
    M(
        "dropout_offsets_swapped",
        "wrong key",
        "pair/layers/dropout.py",
        "row_offset=off[-3], col_offset=off[-2]",
        "row_offset=off[-2], col_offset=off[-3]",
        ("tests/pair/test_triangle_dropout.py", "tests/pair/test_layers_substrate.py"),
    ),
    M(
        "opm_padding_mask_skipped",
        "skipped mask",
        "pair/layers/outer_product.py",
        "mask_local = mask_local * keep.to(mask_local.dtype).expand(shape)",
        "mask_local = mask_local",
        ("tests/pair/test_twins_padded.py",),
    ),
    M(
        "layer_norm_fp32",
        "fp32 cast",
        "pair/reference/norm.py",
        "ct = compute_dtype(x.dtype)",
        "ct = torch.float32",
        ("tests/pair/test_reference_substrate.py",),
    ),
    M(
        "pair_params_unreduced",
        "dropped reduction",
        "pair/layers/tokenwise.py",
        "group = grad_group(like.device_mesh, like.placements)",
        "group = False",
        ("tests/pair/test_layers_substrate.py",),
    ),
    M(
        "bias_rows_axes_swapped",
        "wrong block size",
        "pair/layers/triangle_attention.py",
        "nI, nJ = n[0] // R, n[1] // C",
        "nI, nJ = n[1] // R, n[0] // C",
        ("tests/pair/test_triangle_attention.py",),
    ),
    M(
        "apb_key_rows_axes_swapped",
        "wrong block size",
        "pair/layers/moves.py",
        "nI, nJ = n[0] // R, n[1] // C",
        "nI, nJ = n[1] // R, n[0] // C",
        ("tests/pair/test_attention_pair_bias.py",),
    ),
    M(
        "stationary_dz_rows_from_operand",
        "wrong block size",
        "pair/layers/stationary.py",
        "Nr = N if zshape is None else zshape[0]",
        "Nr = N",
        ("tests/pair/test_outer_product.py",),
    ),
    M(
        "zero_padding_adjoint_unmasked",
        "wrong adjoint",
        "pair/layout.py",
        "if bool(g.masked_select(~keep).any()):  # NaN counts as non-zero",
        "if False:",
        ("tests/pair/test_features.py",),
    ),
    M(
        "summa_segment_edge",
        "off-by-one block",
        "pair/layers/contraction.py",
        "return list(zip(edges[:-1], edges[1:]))",
        "return [(a, b + (b < k)) for a, b in zip(edges[:-1], edges[1:])]",
        ("tests/pair/test_triangle.py",),
    ),
    M(
        "cannon_tile_not_transposed",
        "wrong transpose",
        "pair/layers/contraction.py",
        "return t.transpose(1, 2) if trans else t",
        "return t",
        ("tests/pair/test_triangle.py",),
    ),
    M(
        "triattn_lse_rescale_dropped",
        "wrong softmax merge",
        "pair/layers/triangle_attention.py",
        "alpha = torch.exp(m - m_new)  # rescale what was summed under the old max",
        "alpha = torch.ones_like(m)",
        ("tests/pair/test_triangle_attention.py",),
    ),
    M(
        "triattn_row_chunk_short",
        "off-by-one block",
        "pair/layers/triangle_attention.py",
        "return [(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]",
        "return [(a, min(a + step, n_rows - 1)) for a in range(0, n_rows, step)]",
        ("tests/pair/test_triangle_attention.py",),
    ),
    M(
        "triattn_bias_grad_chunk_dropped",
        "dropped reduction",
        "pair/layers/triangle_attention.py",
        "dblk = ds.sum(1) if dblk is None else dblk.add_(ds.sum(1))",
        "dblk = ds.sum(1)",
        ("tests/pair/test_triangle_attention.py",),
    ),
    # (the clamp of P's normaliser dropped in the CP forward is caught by test_train_step already:
    # padding has no target mass; what only real empty pairs show is the convention itself)
    M(
        "distogram_empty_pairs_left_out_of_mean",
        "wrong convention",
        "pair/layers/distogram.py",
        "w = pair_weight.to(ct)",
        "w = pair_weight.to(ct) * (target.sum(-1) > 0)",
        ("tests/pair/test_distogram.py",),
    ),
    M(
        "distogram_empty_target_grad_unmasked",
        "wrong adjoint",
        "pair/layers/distogram.py",
        "torch.softmax(logits, dim=-1) * p.sum(-1, keepdim=True) - p",
        "torch.softmax(logits, dim=-1) - p",
        ("tests/pair/test_distogram.py",),
    ),
    M(
        "distogram_ref_empty_target_clamp_dropped",
        "division by zero",
        "pair/reference/distogram.py",
        "p = target / target.sum(-1, keepdim=True).clamp(min=1)",
        "p = target / target.sum(-1, keepdim=True)",
        ("tests/pair/test_distogram.py",),
    ),
    M(
        "stack_training_not_agreed",
        "missing agreement",
        "pair/layers/pairformer.py",
        '        "training": stack.training,\n',
        "",
        ("tests/pair/test_pairformer_cp.py::test_control_scalars_must_agree",),
    ),
    M(
        "stack_dropout_p_not_agreed",
        "missing agreement",
        "pair/layers/pairformer.py",
        '        "dropout_p": tuple(m.p for m in sites),\n',
        "",
        ("tests/pair/test_pairformer_cp.py::test_control_scalars_must_agree",),
    ),
    M(
        "trunk_single_weight_not_agreed",
        "missing agreement",
        "pair/train.py",
        '{"single_weight": self.single_weight, "target_shape": tuple(target.shape)}',
        '{"target_shape": tuple(target.shape)}',
        ("tests/pair/test_train_step.py::test_trunk_control_scalars_must_agree",),
    ),
    M(
        "edge_shift_cache_ignores_cell",
        "stale cache",
        "atoms/parallel/sharded.py",
        "            and torch.equal(got[2], cell)\n",
        "",
        ("tests/atoms/test_wrap_axes.py",),
    ),
    M(
        "routing_kept_per_rank_key",
        "stale cache",
        "shard/sharded_handlers.py",
        "key = (tuple(v for k in keys for v in k), n, me)",
        "key = (tuple(mine), n, me)",
        ("tests/shard/test_dispatch.py",),
    ),
    M(
        "routing_ignores_index_version",
        "stale cache",
        "shard/sharded_handlers.py",
        "        index._version,\n",
        "",
        ("tests/shard/test_dispatch.py",),
    ),
    M(
        "per_system_reduce_dropped",
        "dropped reduction",
        "shard/reduce_handlers.py",
        'return prim.all_reduce(x, group, op="per_system_reduce")',
        "return x.clone()",
        ("tests/shard/test_dispatch.py",),
    ),
    M(
        "lazy_halo_reverse_skipped",
        "dropped halo sum",
        "shard/halo_handlers.py",
        "local = index.numel() > 0 and bool(index.max() >= n_owned)",
        "local = False",
        ("tests/shard/test_dispatch_lazy.py", "tests/atoms/test_mpnn_plain.py"),
    ),
    # an in-model allocation left plain (mace's ZBL energies, V_ZBL [n_local]): its per-system
    # sum kept per rank, or its halo rows (junk in the tests) taken for copies of their owners
    M(
        "plain_rows_reduce_unreduced",
        "dropped reduction",
        "shard/reduce_handlers.py",
        "total = partial_to_replicate(flat, index.group)",
        "total = flat.clone()",
        ("tests/shard/test_dispatch_plain_rows.py", "tests/atoms/test_mace_zbl.py"),
    ),
    M(
        "plain_rows_taken_fresh",
        "stale halo read",
        "shard/reduce_handlers.py",
        "return from_local(t, like._spec.with_state(HaloState.STALE))",
        "return from_local(t, like._spec)",
        ("tests/shard/test_dispatch_plain_rows.py",),
    ),
    M(
        "custom_op_halo_correct_unsummed",
        "dropped halo sum",
        "shard/custom_ops.py",
        "own = t[:n] + halo_reverse(t[n:], plan)",
        "own = t[:n] + 0 * halo_reverse(t[n:], plan)",
        ("tests/shard/test_custom_ops.py",),
    ),
    # -- atoms: the radius graph a plain (third-party) model sees
    M(
        "skin_edge_to_model",
        "wrong graph",
        "atoms/data/neighbors.py",
        "return ~ok | (d < float(cutoff))",
        "return ~ok | (d < float(cutoff) + 0.5)",
        ("tests/atoms/test_mace_oracle.py",),
    ),
    M(
        "radius_graph_stale_halo",
        "stale halo",
        "atoms/parallel/plain_inputs.py",
        'plan.forward_copy(x.detach(), op="halo_radius")',
        "x.new_zeros(nh, 3)",
        ("tests/atoms/test_mace_oracle.py",),
    ),
    M(
        "radius_graph_cache_ignores_crossings",
        "stale cache",
        "atoms/data/neighbors.py",
        "and torch.equal(last[4], keep)",
        "and last[4].shape == keep.shape",
        ("tests/atoms/test_mace_oracle.py",),
    ),
    M(
        "model_dtype_cast_dropped",
        "dtype",
        "atoms/potentials/mace.py",
        '"positions": data["positions"].to(dtype),',
        '"positions": data["positions"],',
        ("tests/atoms/test_mace_oracle.py",),
    ),
    M(
        "validate_traces_stack",
        "tracer",
        "atoms/parallel/validate.py",
        "        if _stacked(t):",
        "        if False:",
        ("tests/atoms/test_validate.py",),
    ),
    M(
        "batch_edges_first_cell",
        "wrong index",
        "atoms/potentials/mace.py",
        'inv = torch.linalg.pinv(cell3)[to_local(batch[data["receivers"]])]',
        'inv = torch.linalg.pinv(cell3)[0 * to_local(batch[data["receivers"]])]',
        ("tests/atoms/test_mace_oracle.py",),
    ),
    # -- atoms: the rebuild decision (both storages)
    M(
        "halo_rebuild_past_whole_skin",
        "off-by-factor",
        "atoms/parallel/sharded.py",
        "if 2.0 * disp + strain > self.skin or forced:",
        "if disp + strain > self.skin or forced:",
        ("tests/atoms/test_rebuild.py",),
    ),
    M(
        "graph_rebuild_past_whole_skin",
        "off-by-factor",
        "atoms/parallel/graph_storage.py",
        "need = disp > 0.5 * self.skin",
        "need = disp > self.skin",
        ("tests/atoms/test_rebuild.py",),
    ),
    M(
        "graph_replicate_local_flag",
        "unagreed control flow",
        "atoms/parallel/graph_storage.py",
        "        if stale:",
        "        if self._stale:",
        ("tests/atoms/test_rebuild.py",),
    ),
    M(
        "owner_rule_self_image_both_ends",
        "double count",
        "atoms/parallel/sharded.py",
        "(id_owned == id_halo) & lex_positive(rel_shift)",
        "(id_owned == id_halo)",
        ("tests/atoms/test_lj_fast.py",),
    ),
    M(
        "owner_rule_self_image_frames_dropped",
        "wrong shift",
        "atoms/parallel/sharded.py",
        "keep[cross] = owner_keeps(ids[io], ids[jh], shift[jh] - shift[io] + m[cross])",
        "keep[cross] = owner_keeps(ids[io], ids[jh], shift[jh] + m[cross])",
        ("tests/atoms/test_lj_fast.py",),
    ),
    # -- atoms: small blocks, errors inside TorchScript, slabs, results made outside the dispatch
    M(
        "one_atom_dot_refused",
        "missing case",
        "shard/shard_tensor.py",
        "if func in _small.ONE_ATOM_CONTRACTIONS:",
        "if False:",
        ("tests/atoms/test_small_ranks.py",),
    ),
    M(
        "torchscript_message_lost",
        "lost error",
        "shard/shard_tensor.py",
        "raised = _small.resurface(exc)",
        "raised = None",
        ("tests/atoms/test_small_ranks.py",),
    ),
    M(
        "empty_view_unresolved",
        "missing case",
        "shard/shard_tensor.py",
        "shape = _small.resolve_empty_view(args[0], largs[1])",
        "shape = None",
        ("tests/atoms/test_small_ranks.py",),
    ),
    M(
        "view_write_leaves_base_fresh",
        "stale halo",
        "shard/shard_tensor.py",
        "                _write_through(w)",
        "                pass",
        ("tests/shard/test_write_through.py",),
    ),
    M(
        "slab_normal_not_unit",
        "wrong convention",
        "atoms/data/cells.py",
        "        length, lo = 1.0, 0.0",
        "        length, lo = 2.0, 0.0",
        ("tests/atoms/test_slab.py",),
    ),
    M(
        "plain_outputs_unchecked",
        "silent wrong answer",
        "atoms/parallel/plain_inputs.py",
        "    _check_per_atom_outputs(dp.module, data, out)",
        "    pass",
        ("tests/atoms/test_plain_outputs.py",),
    ),
    # -- atoms: LJ kernels, graph-parallel storage
    M(
        "lj_kernel_j_force_dropped",
        "dropped term",
        "atoms/potentials/lj_kernels.py",
        "forces[k].index_add_(0, jc, f[k]).index_add_(0, ic, f[k], alpha=-1.0)",
        "forces[k].index_add_(0, ic, f[k], alpha=-1.0)",
        ("tests/atoms/test_lj_fast.py",),
    ),
    M(
        "lj_kernel_energy_one_side",
        "misrouted rows",
        "atoms/potentials/lj_kernels.py",
        "per_atom.index_add_(0, ic, phi).index_add_(0, jc, phi)",
        "per_atom.index_add_(0, ic, phi).index_add_(0, ic, phi)",
        ("tests/atoms/test_lj_fast.py",),
    ),
    M(
        "owner_rule_parity_not_flipped",
        "dropped term",
        "atoms/parallel/sharded.py",
        "return ((id_owned < id_halo) ^ odd) & (id_owned != id_halo) | (",
        "return ((id_owned < id_halo) | odd) & (id_owned != id_halo) | (",
        ("tests/atoms/test_lj_fast.py",),
    ),
    M(
        "graph_ids_wrong_offset",
        "off-by-one block",
        "atoms/parallel/graph_storage.py",
        "return torch.where(ok, (ids + off[rank]) % max(n, 1), ids)",
        "return torch.where(ok, (ids + off[max(rank - 1, 0)]) % max(n, 1), ids)",
        ("tests/atoms/test_graph_storage.py",),
    ),
    # -- tensors: dispatch situations (tests/shard/test_dispatch_situations.py)
    M(
        "lazy_halo_vote_needs_every_rank",
        "unagreed control flow",
        "shard/halo_handlers.py",
        'return bool(prim.all_reduce(flag, group, op="halo_correction_vote")[0] > 0)',
        'return bool(prim.all_reduce(flag, group, op="halo_correction_vote")[0] >= prim.group_size(group))',
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "refresh_cache_ignores_wrapper_writes",
        "stale cache",
        "shard/halo_handlers.py",
        "version = (x._version, x._local._version)",
        "version = (0, x._local._version)",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "refresh_cache_ignores_local_writes",
        "stale cache",
        "shard/halo_handlers.py",
        "version = (x._version, x._local._version)",
        "version = (x._version, 0)",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "refresh_cache_reused_without_graph",
        "dropped gradient",
        "shard/halo_handlers.py",
        "linked = torch.is_grad_enabled() and x.requires_grad",
        "linked = False",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "feature_dim_taken_as_atoms",
        "wrong dim",
        "shard/registry.py",
        'if c is None or c.dim != 0 or c.scatter != (kind == "scatter"):',
        'if c is None or c.scatter != (kind == "scatter"):',
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "routing_kept_across_placements",
        "stale cache",
        "shard/sharded_handlers.py",
        "if got is not None and got[1] == x._spec.placement:",
        "if got is not None:",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "scatter_alpha_kwarg_dropped",
        "ignored argument",
        "shard/registry.py",
        'return IndexCall(name, t, dim, index, src, kwargs.get("alpha", 1))',
        "return IndexCall(name, t, dim, index, src)",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "local_scatter_alpha_dropped",
        "ignored argument",
        "shard/registry.py",
        "return zeros.index_add(0, index, src, alpha=c.alpha)",
        "return zeros.index_add(0, index, src)",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "sharded_scatter_alpha_dropped",
        "ignored argument",
        "shard/sharded_handlers.py",
        "if c.alpha != 1:",
        "if False:",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "index_out_buffer_ignored",
        "ignored argument",
        "shard/registry.py",
        'if kwargs.get("out") is not None:',
        "if False:",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "partial_target_corrected_as_fresh",
        "double count",
        "shard/halo_handlers.py",
        "if base.state == HaloState.PARTIAL:",
        "if False:",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    M(
        "feature_dim_gather_state_from_index_only",
        "stale halo",
        "shard/shard_tensor.py",
        "            idx.append(args[0])  # another dim",
        "            pass  # another dim",
        ("tests/shard/test_dispatch_situations.py",),
    ),
    # -- sanity of a run (issue 23): divergence and explosion raise on every rank
    M(
        "sanity_halo_position_check_dropped",
        "dropped check",
        "atoms/parallel/sharded.py",
        "return sanity.check_positions(allstats[:, :-2], limit), bool(",
        "return float(allstats[:, 0].max()), bool(",
        ("tests/atoms/test_sanity.py",),
    ),
    M(
        "sanity_graph_position_check_dropped",
        "dropped check",
        "atoms/parallel/graph_storage.py",
        "if disp > limit:  # replicated: every rank takes this branch",
        "if disp != disp:",
        ("tests/atoms/test_sanity.py",),
    ),
    M(
        "sanity_temperature_bound_unchecked",
        "dropped check",
        "atoms/dynamics/sanity.py",
        'if row["temperature"] > max_temperature:',
        "if False:",
        ("tests/atoms/test_sanity.py",),
    ),
    M(
        "sanity_calculator_nan_passed_to_ase",
        "dropped check",
        "atoms/calculator.py",
        "check_finite(energy, per_atom, forces, res.stress)  # every rank holds the same values",
        "pass",
        ("tests/atoms/test_sanity.py",),
    ),
    # -- checkpoint provenance and checksum (issue 18): a changed potential or payload is refused
    M(
        "checkpoint_checksum_not_compared",
        "dropped check",
        "atoms/dynamics/provenance.py",
        'elif state.get("checksum") != payload_checksum(state):',
        "elif False:",
        ("tests/atoms/test_checkpoint_provenance.py",),
    ),
    M(
        "provenance_digest_ignores_values",
        "blind digest",
        "atoms/dynamics/provenance.py",
        "h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())",
        "pass",
        ("tests/atoms/test_checkpoint_provenance.py",),
    ),
    M(
        "restart_potential_compare_skipped",
        "dropped check",
        "atoms/dynamics/run.py",
        "if saved is not None:",
        "if False:",
        ("tests/atoms/test_checkpoint_provenance.py",),
    ),
    # -- pair: the Boltz-2 feature contract and the synthetic complex (issue 19)
    M(
        "contract_atom_order_unchecked",
        "dropped check",
        "pair/feature_contract.py",
        "drop = real[:, :-1] & (nxt[:, 1:] < token[:, :-1])",
        "drop = real[:, :-1] & (nxt[:, 1:] < token[:, :-1]) & False",
        ("tests/pair/test_feature_contract.py",),
    ),
    # -- bad input (issue 19): the contract's checks run by distribute on every rank; the trunk
    # names missing features
    M(
        "contract_atom_no_token_unchecked",
        "dropped check",
        "pair/feature_contract.py",
        "real & (count == 0),",
        "real & (count == 0) & False,",
        ("tests/pair/test_bad_input.py::test_bad_feature_fails_on_every_rank",),
    ),
    M(
        "contract_atom_beyond_n_unnamed",
        "message lost",
        "pair/feature_contract.py",
        "+ _beyond_hint(spec.name, t, axis, sym, size),",
        '+ "",',
        ("tests/pair/test_bad_input.py::test_bad_feature_fails_on_every_rank",),
    ),
    M(
        "trunk_missing_features_unchecked",
        "dropped check",
        "pair/layers/trunk.py",
        "missing = [k for k in need if not isinstance(feats.get(k), DTensor)]",
        "missing = []",
        ("tests/pair/test_bad_input.py::test_trunk_names_missing_features_on_every_rank",),
    ),
    M(
        "synthetic_profile_over_padded_rows",
        "wrong statistic",
        "pair/synthetic.py",
        'f["profile"][b, :m] = one_hot(msa, NUM_TOKENS).to(torch.float64).mean(0).to(dt)',
        'f["profile"][b, :m] = one_hot(msa, NUM_TOKENS).to(torch.float64).sum(0).div(f["msa"].shape[1]).to(dt)',
        ("tests/pair/test_feature_contract.py",),
    ),
    # -- the MSA module (issue 19): pair-weighted averaging's split softmax, s_proj's token block,
    # the MSA dropout's global keys
    M(
        "pwa_softmax_wrong_axis",
        "wrong axis",
        "pair/layers/pair_averaging.py",
        "total = p.sum(dim=2, keepdim=True)",
        "total = p.sum(dim=1, keepdim=True)",
        ("tests/pair/test_pair_averaging.py::test_cp_pwa_matches_serial",),
    ),
    M(
        "pwa_normaliser_not_reduced",
        "dropped all-reduce",
        "pair/layers/pair_averaging.py",
        "total = comm.all_reduce(total, grid.row_group)",
        "total = total",
        ("tests/pair/test_pair_averaging.py::test_cp_pwa_matches_serial",),
    ),
    M(
        "msa_s_proj_row_block",
        "wrong token block",
        "pair/layers/msa.py",
        's_cols = column_block(F.linear(e, w_s), grid, (nr, nc), "msa:s_proj")',
        "s_cols = F.linear(e, w_s)",
        ("tests/pair/test_msa_cp.py::test_cp_msa_module_matches_serial",),
    ),
    M(
        "msa_dropout_local_key",
        "local index",
        "pair/layers/dropout.py",
        "row_offset=off[-3]",
        "row_offset=0",
        ("tests/pair/test_msa_cp.py::test_cp_msa_module_matches_serial",),
    ),
    # -- pair initialisation (issue 19)
    M(
        "relpos_columns_from_row_block",
        "wrong block",
        "pair/layers/pair_init.py",
        "col = {k: col_ints[..., i].to(locs[i].dtype) for i, k in enumerate(RELPOS_KEYS)}",
        "col = {k: locs[i] for i, k in enumerate(RELPOS_KEYS)}",
        ("tests/pair/test_pair_init_cp.py",),
    ),
    M(
        "z_init_columns_adjoint_not_returned",
        "missing adjoint",
        "pair/layers/moves.py",
        "gx[:, rows] += piece",
        "gx[:, rows] += 0 * piece",
        ("tests/pair/test_pair_init_cp.py",),
    ),
    # -- template module (issue 19)
    M(
        "template_average_over_padded",
        "mask ignored",
        "pair/layers/template.py",
        'counted = here if t == 0 else P.all_reduce(here, grid.col_group, op="template:counted") > 0',
        "counted = torch.ones_like(here, dtype=torch.bool)",
        ("tests/pair/test_template_cp.py",),
    ),
    M(
        "template_frame_not_transposed",
        "wrong transpose",
        "pair/reference/template.py",
        'rot_t = col["template_frame_rot"].unsqueeze(2).transpose(-1, -2)',
        'rot_t = col["template_frame_rot"].unsqueeze(2)',
        ("tests/pair/test_template_cp.py",),
    ),
    # -- the input embedder's atoms: placement, window halo, its adjoint, its bytes (issue 19)
    M(
        "atom_window_halo_off_by_one",
        "halo one atom short",
        "pair/layers/atom_transformer.py",
        "return max(0, w * k_lo - m), min(layout.n_atoms, w * k_hi + w + m)",
        "return max(0, w * k_lo - m), min(layout.n_atoms, w * k_hi + w + m - 1)",
        ("tests/pair/test_input_embedder.py",),
    ),
    M(
        "atom_to_token_remap_off_by_one",
        "wrong token",
        "pair/atoms.py",
        "return _mask_rows(x[bi, idx][:, :, tokens], valid, 1).contiguous()",
        "return _mask_rows(x[bi, idx].roll(1, 2)[:, :, tokens], valid, 1).contiguous()",
        ("tests/pair/test_input_embedder.py",),
    ),
    M(
        "atom_halo_adjoint_not_summed",
        "gradient overwritten",
        "pair/layers/atom_transformer.py",
        "gl[b, lo:hi] += piece",
        "gl[b, lo:hi] = piece",
        ("tests/pair/test_input_embedder.py",),
    ),
    # -- the whole trunk (issue 19): only the last recycling cycle carries gradients, as in Boltz
    M(
        "recycling_grad_every_cycle",
        "gradient through every cycle",
        "pair/reference/trunk.py",
        "with torch.set_grad_enabled(grad and cycle == recycling_steps):",
        "with torch.set_grad_enabled(grad):",
        ("tests/pair/test_trunk_cp.py::test_only_the_last_cycle_keeps_activations",),
    ),
    # -- the structure module's conditioning and score model (issue 20)
    M(
        "z_band_one_column_short",
        "z band fetched one column short",
        "pair/layers/diffusion.py",
        "lo, hi = max(band[0], c * n_j), min(band[1], (c + 1) * n_j)",
        "lo, hi = max(band[0], c * n_j), min(band[1] - 1, (c + 1) * n_j)",
        ("tests/pair/test_diffusion_cp.py::test_cp_diffusion_matches_serial[2x2-W8-N11-m2]",),
    ),
    M(
        "multiplicity_samples_mispaired",
        "a sample's coordinates paired with another sample's conditioning",
        "pair/layers/diffusion.py",
        "(times, st.repeat_interleave(m, 0), si.repeat_interleave(m, 0))",
        "(times, st.repeat(m, 1, 1), si.repeat(m, 1, 1))",
        ("tests/pair/test_diffusion_cp.py::test_cp_diffusion_matches_serial[2x2-W8-N11-m2]",),
    ),
    # -- the sampler (issue 20 section 2)
    M(
        "sampler_noise_local_atom_index",
        "a sample's noise keyed by local atom index",
        "pair/layers/sampler.py",
        "atoms = torch.where(valid, starts[:, None] + slot[None, :], torch.zeros_like(slot)[None, :])",
        "atoms = torch.where(valid, slot[None, :], torch.zeros_like(slot)[None, :])",
        ("tests/pair/test_sampler_cp.py::test_cp_sample_matches_serial[2x2-N11-m3-mps2-align]",),
    ),
    M(
        "sampler_centring_partial_axis",
        "centring mean over a partial grid axis (my atom block only)",
        "pair/reference/sampler.py",
        "return self._atom_sum(x, frame)[:, None] / frame.n_atoms",
        "return AtomDiffusion._atom_sum(self, x, frame)[:, None] / frame.n_atoms",
        ("tests/pair/test_sampler_cp.py::test_cp_sample_matches_serial[2x2-N11-m3-mps2-align]",),
    ),
    M(
        "sampler_atom_sum_row_group",
        "atom sums gathered along the grid row (the same atoms C times) instead of the column",
        "pair/layers/sums.py",
        "return ordered_sum(part, grid.col_group, op)",
        "return ordered_sum(part, grid.row_group, op)",
        ("tests/pair/test_sampler_cp.py::test_cp_sample_matches_serial[2x2-N11-m3-mps2-align]",),
    ),
    # -- the confidence module (issue 20 section 3)
    M(
        "confidence_ptm_partial_axis",
        "pTM row sums reduced over the wrong grid axis (a partial sum of the PAE bins' tm terms)",
        "pair/layers/confidence.py",
        'sums = P.all_reduce(sums, grid.row_group, op="confidence:ptm_rows")',
        'sums = P.all_reduce(sums, grid.col_group, op="confidence:ptm_rows")',
        ("tests/pair/test_confidence_cp.py::test_cp_confidence_matches_serial[2x2-B2-N11-m1]",),
    ),
    M(
        "confidence_rep_cols_from_rows",
        "column side's representative-atom coordinates taken from the row block",
        "pair/layers/confidence.py",
        'x_cols = column_block(x_rows, grid, layout.padded, "confidence:rep_columns", differentiable=False)',
        "x_cols = x_rows",
        ("tests/pair/test_confidence_cp.py::test_cp_confidence_matches_serial[2x2-B2-N11-m1]",),
    ),
    # -- the confidence losses (issue 20 section 4)
    M(
        "closs_pae_partial_axis",
        "PAE/PDE per-sample sums reduced over a partial grid axis (the grid row) instead of the grid",
        "pair/layers/confidence_loss.py",
        'pair_sums = ordered_sum(torch.stack(pair), None, "confidence_loss:pair_sums")',
        'pair_sums = ordered_sum(torch.stack(pair), grid.row_group, "confidence_loss:pair_sums")',
        (
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B2-N11-m1-pae1.0]",
        ),
    ),
    M(
        "closs_nucleotide_cutoff_15",
        "lDDT inclusion radius 15 A for nucleotide R-set atoms (Boltz: 30 A)",
        "pair/layers/confidence_loss.py",
        "cutoff = 15 + 15 * nuc_c[:, None, :]",
        "cutoff = 15 + 0 * nuc_c[:, None, :]",
        (
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B2-N11-m1-pae1.0]",
        ),
    ),
    M(
        "closs_lddt_local_columns",
        "per-token lDDT sums over the local R-set columns only (no sum along the grid row)",
        "pair/layers/confidence_loss.py",
        "sums = _ordered_sum(",
        "sums = (lambda part, group, op: part)(",
        (
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B2-N11-m1-pae1.0]",
        ),
    ),
    M(
        "closs_pred_frame_mask_dropped",
        "PAE pair mask without the predicted frames' validity (collinear predicted frames counted)",
        "pair/layers/confidence_loss.py",
        "row_mask = frm * ok_t * ok_p * pad",
        "row_mask = frm * ok_t * pad",
        (
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B2-N11-m1-pae1.0]",
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B1-N20-m3-pae1.0]",
        ),
    ),
    M(
        "closs_resolved_pad_off",
        "resolved loss averaged over every token row, Boltz's padding tokens included",
        "pair/layers/confidence_loss.py",
        'w_res = t["pad"].to(ct)',
        'w_res = torch.ones_like(t["pad"]).to(ct)',
        (
            "tests/pair/test_confidence_loss_cp.py::test_cp_confidence_loss_matches_serial[2x2-B2-N11-m1-pae1.0]",
        ),
    ),
    # -- the whole Boltz-2 inference forward (issue 20)
    M(
        "model_confidence_sample_mispaired",
        "confidence module given another sample's coordinates (multiplicity mispairing)",
        "pair/reference/model.py",
        'self.detached(result["sample_atom_coords"]),',
        'self.detached(result["sample_atom_coords"]).roll(1, 0),',
        ("tests/pair/test_model_cp.py::test_model_is_its_parts",),
    ),
    M(
        "model_rel_pos_not_passed",
        "diffusion conditioning given zeros for the relative position encoding",
        "pair/reference/model.py",
        'rel = out["relative_position_encoding"]',
        'rel = torch.zeros_like(out["relative_position_encoding"])',
        ("tests/pair/test_model_cp.py::test_model_is_its_parts",),
    ),
    # -- the prediction writer (issue 20 section 5)
    M(
        "writer_bfactor_not_percent",
        "B-factors written as pLDDT in [0, 1] instead of x 100",
        "pair/output.py",
        "    return (100.0 * p).tolist()",
        "    return p.tolist()",
        ("tests/pair/test_output.py::test_structure_round_trip[0-cif]",),
    ),
    M(
        "writer_rank_by_sample_order",
        "models numbered in sample order instead of by confidence_score",
        "pair/output.py",
        "    rank = ranking(conf, samples)",
        "    rank = list(range(samples))",
        ("tests/pair/test_output.py::test_write_prediction_layout_and_confidence[cif]",),
    ),
    M(
        "writer_arrays_padded",
        "pLDDT/PAE/PDE arrays written with the padding tokens",
        "pair/output.py",
        "    real = torch.tensor(layout.real_token, dtype=torch.bool)",
        "    real = torch.ones(len(layout.real_token), dtype=torch.bool)",
        ("tests/pair/test_output.py::test_write_prediction_layout_and_confidence[cif]",),
    ),
    # -- fp32 parameter-gradient accuracy (issue 21 section 1): invisible to fp64 parity
    M(
        "layer_norm_fused_param_grads",
        "LayerNorm weight/bias gradients summed over the tokens in torch's sequential fp32 chain",
        "pair/reference/norm.py",
        "return layer_norm(x.to(ct), tuple(self.normalized_shape), w, b, self.eps).to(x.dtype)",
        "return F.layer_norm(x.to(ct), self.normalized_shape, w, b, self.eps).to(x.dtype)",
        ("tests/pair/test_fp32_param_grads.py",),
    ),
    M(
        "sync_grad_bf16_on_wire",
        "fp32 parameter gradients rounded to bf16 before their all-reduce (fp64 untouched)",
        "comm/ops.py",
        "flat = torch.cat([g.reshape(-1) for g in grads])  # unused parameters: zeros (materialised)",
        "flat = torch.cat([g.reshape(-1) for g in grads]); flat = flat.to(torch.bfloat16) if flat.dtype == torch.float32 else flat",
        ("tests/pair/test_fp32_param_grads.py",),
    ),
    # -- twinshard predict: the gathered samples written with their own confidence; boltz's loading
    M(
        "predict_samples_mispaired",
        "each sample's structure written under another sample's confidence",
        "cli/predict.py",
        'got["sample_atom_coords"][sl], part',
        'got["sample_atom_coords"][sl].flip(0), part',
        ("tests/cli/test_predict.py::test_predict_writes_the_serial_prediction[1x1-mmcif]",),
    ),
    M(
        "predict_checkpoint_sampler_kept",
        "the checkpoint's training sampler parameters kept (boltz predict replaces them)",
        "cli/predict.py",
        '    hp["diffusion_process_args"] = dict(BOLTZ2_DIFFUSION_PARAMS)',
        '    hp.setdefault("diffusion_process_args", dict(BOLTZ2_DIFFUSION_PARAMS))',
        ("tests/cli/test_predict.py::test_predict_checkpoint",),
    ),
    # -- the whole-model training step (issue 20 section 4)
    M(
        "train_noise_local_atom_index",
        "a sample's training noise keyed by the local atom index",
        "pair/reference/sampler.py",
        "atoms = frame.atoms  # global atom indices: the noise of an atom is the serial one on any grid",
        "atoms = torch.arange(frame.atoms.shape[1], device=dev).expand_as(frame.atoms)",
        ("tests/pair/test_train_boltz2.py::test_cp_step_matches_serial",),
    ),
    M(
        "train_sigma_not_synchronized",
        "noise level drawn per sample, not per element",
        "pair/reference/sampler.py",
        'eps = draw("sigma", (b,), global_rows(torch.arange(b, device=dev), 1)).repeat_interleave(m, 0)',
        'eps = draw("sigma", (rows_n,))',
        ("tests/pair/test_train_boltz2.py::test_sigmas_synchronized",),
    ),
    M(
        "train_ema_before_optimizer_step",
        "EMA averages the weights before the update",
        "pair/train_boltz2.py",
        "        self.optimizer.step()",
        "        self.ema.update(model, self.global_step + 1) if self.ema else None\n        self.optimizer.step()",
        ("tests/pair/test_train_boltz2.py::test_ema_follows_the_optimizer_step",),
    ),
    M(
        "train_last_cycle_grad_dropped",
        "the structure module's gradient into the trunk's last cycle dropped",
        "pair/reference/model.py",
        's_inputs, s, z = out["s_inputs"], out["s"], out["z"]  # the last cycle\'s, with gradients',
        's_inputs, s, z = out["s_inputs"], out["s"].detach(), out["z"].detach()',
        ("tests/pair/test_train_boltz2.py::test_structure_gradient_reaches_trunk",),
    ),
    M(
        "train_checkpoint_without_ema",
        "checkpoint missing the EMA state",
        "pair/train_boltz2.py",
        "if self.ema is not None and self.ema.ema_weights is not None:",
        "if False:",
        ("tests/pair/test_train_boltz2.py::test_resume_equals_uninterrupted",),
    ),
    M(
        "storage_factory_drops_balance",
        "an option lost in the one storage factory",
        "atoms/parallel/storage.py",
        "source, src, cutoff=cutoff, skin=skin, group=group, partition=partition, balance=balance, dtype=dtype",
        "source, src, cutoff=cutoff, skin=skin, group=group, partition=partition, balance=None, dtype=dtype",
        ("tests/atoms/test_balance.py::test_run_md_balance_equals_unbalanced_run",),
    ),
    M(
        "storage_graph_path_for_halo",
        "the evaluation path picked for the wrong storage type",
        "atoms/parallel/distributed.py",
        "        if isinstance(sharded, GraphSharded):  # per-system results",
        "        if not isinstance(sharded, GraphSharded):  # per-system results",
        ("tests/atoms/test_storage.py",),
    ),
    # -- precision modes: dtype paths audited per Function (issue 21, s. 1)
    M(
        "wire_in_autocast_dtype_on_one_rank",
        "a buffer sent in the autocast dtype on one rank only",
        "pair/layers/moves.py",
        "    wire = _wire(x.dtype)",
        '    wire = torch.get_autocast_dtype("cpu") if torch.distributed.get_rank() == 1 and x.is_floating_point() else _wire(x.dtype)',
        ("tests/pair/test_dtype_paths.py::test_dtype_paths[2x2-trunk-fp32-fp32-plain]",),
    ),
    M(
        "softmax_without_fp32_cast",
        "the triangle-attention operands not cast back to fp32 before the softmax",
        "pair/layers/triangle_attention.py",
        "q, k, v, bias, mb = (t.to(ct) for t in (q, k, v, bias, mb))",
        "q, k, v, bias, mb = (t for t in (q, k, v, bias, mb))",
        ("tests/pair/test_dtype_paths.py::test_compute_functions_do_math_in_fp32[1x1]",),
    ),
    M(
        "gradient_all_reduce_in_bf16",
        "sums over ranks carried in the payload's dtype (a bf16 gradient all-reduced in bf16)",
        "comm/primitives.py",
        'wire = _audit_collective(op, reduce_dtype(x.dtype), group, "all_reduce")',
        'wire = _audit_collective(op, x.dtype, group, "all_reduce")',
        ("tests/pair/test_dtype_paths.py::test_dtype_paths[2x2-trunk-bf16-fp32-plain]",),
    ),
    # -- attention backends (issue 21 s. 2)
    M(
        "apb_sdpa_mask_bias_dropped",
        "the SDPA path of attention with pair bias dropping the mask bias",
        "pair/layers/attention.py",
        "full = bias.to(ct) + mb.to(ct)[:, None, None, :]",
        "full = bias.to(ct)",
        ("tests/pair/test_attention_backends.py::test_cp_backend_matches_reference[2x2-N7-apb-sdpa]",),
    ),
    M(
        "apb_lse_merge_own_block_max",
        "the log-sum-exp merge shifting each key block by its own log-sum-exp, not the row's maximum",
        "pair/layers/attention.py",
        'm = _row_max(lse.unsqueeze(-1), grid, "apb:lse_max")  # the common shift, over the row\'s blocks',
        "m = lse.detach().unsqueeze(-1)",
        ("tests/pair/test_attention_backends.py::test_cp_backend_matches_reference[2x2-N7-apb-sdpa]",),
    ),
    M(
        "triattn_backend_not_agreed",
        "the attention backend not agreed across ranks (one rank on another backend goes unnoticed)",
        "pair/layers/triangle_attention.py",
        "agree_backend(backend, what)",
        "pass",
        ("tests/pair/test_attention_backends.py::test_backend_disagreement_raises[tri-start]",),
    ),
    # -- the diffusion loss (issue 20 section 4)
    M(
        "dloss_align_weights_dropped",
        "rigid alignment of the diffusion loss with weights of ones (no nucleotide / ligand weights)",
        "pair/layers/structure_loss.py",
        "weighted_rigid_align(true_aug, den.detach(), weights, mask_align,",
        "weighted_rigid_align(true_aug, den.detach(), torch.ones_like(weights), mask_align,",
        ("tests/pair/test_structure_loss_cp.py::test_cp_loss_matches_serial[2x2-N10-m3-s2]",),
    ),
    M(
        "dloss_lddt_cutoff_not_strict",
        "smooth lDDT scores pairs exactly at the 15 A cutoff (<= instead of <)",
        "pair/reference/structure_loss.py",
        "valid = valid + (1 - nuc) * (true_d < other_cutoff).to(true_d.dtype)",
        "valid = valid + (1 - nuc) * (true_d <= other_cutoff).to(true_d.dtype)",
        ("tests/pair/test_structure_loss_cp.py::test_smooth_lddt_cutoff_is_strict",),
    ),
    M(
        "dloss_lddt_nucleotide_cutoff_wrong_side",
        "smooth lDDT nucleotide cutoff on the wrong side (> instead of <)",
        "pair/reference/structure_loss.py",
        "valid = nuc * (true_d < nucleic_acid_cutoff).to(true_d.dtype)",
        "valid = nuc * (true_d > nucleic_acid_cutoff).to(true_d.dtype)",
        ("tests/pair/test_structure_loss_cp.py::test_smooth_lddt_cutoff_is_strict",),
    ),
    M(
        "dloss_pair_sums_partial_axis",
        "smooth lDDT pair sums reduced along the grid row only (a partial grid axis)",
        "pair/layers/sums.py",
        'return ordered_sum(ordered_sum(part, grid.row_group, f"{op}:row"), grid.col_group, f"{op}:col")',
        'return ordered_sum(part, grid.row_group, f"{op}:row")',
        ("tests/pair/test_structure_loss_cp.py::test_cp_loss_matches_serial[2x2-N10-m3-s2]",),
    ),
    M(
        "dloss_column_atoms_wrong_row",
        "the column side of a pair tile takes the atoms of its grid row's piece, not its column's",
        "pair/layers/structure_loss.py",
        "    return coords[1]",
        "    return coords[0]",
        ("tests/pair/test_structure_loss_cp.py::test_cp_loss_matches_serial[2x2-N10-m3-s2]",),
    ),
    M(
        "dloss_eye_dropped",
        "smooth lDDT scores the i == j pairs (the eye term dropped)",
        "pair/layers/structure_loss.py",
        "distinct = (gi[i][:, None] != gj[None, :]).to(ct)",
        "distinct = torch.ones(gi.shape[1], gj.shape[0], dtype=ct, device=gi.device)",
        ("tests/pair/test_structure_loss_cp.py::test_cp_loss_matches_serial[2x2-N10-m3-s2]",),
    ),
    M(
        "dloss_lddt_grad_not_synced",
        "the smooth lDDT's partial tile gradients not summed along the grid row",
        "pair/layers/structure_loss.py",
        "x = sync_grad(den, grid.row_group)",
        "x = den",
        ("tests/pair/test_structure_loss_cp.py::test_cp_loss_matches_serial[2x2-N10-m3-s2]",),
    ),
    # -- data x context parallel training and the sharded AdamW (issue 21, sections 3 and 4)
    M(
        "dp_grad_reduced_twice",
        "double reduction",
        "pair/data_parallel.py",
        'flat = P.all_reduce(flat, mesh.dp_group, op="dp:grad")',
        'flat = P.all_reduce(P.all_reduce(flat, mesh.dp_group, op="dp:grad"), mesh.dp_group, op="dp:grad")',
        ("tests/pair/test_dp_cp.py::test_dp_cp_step_matches_serial",),
    ),
    M(
        "dp_average_over_world_size",
        "wrong normaliser",
        "pair/data_parallel.py",
        "    return share / mesh.dp\n",
        "    return share / mesh.size\n",
        ("tests/pair/test_dp_cp.py::test_dp_cp_step_matches_serial",),
    ),
    M(
        "dp_dropout_local_batch_index",
        "wrong rng key",
        "pair/data_parallel.py",
        "with mesh.replica(), batch_offset(_offset(split, mesh.dp_index)):",
        "with mesh.replica(), batch_offset(0):",
        ("tests/pair/test_dp_cp.py::test_dp_cp_step_matches_serial",),
    ),
    M(
        "zero_shard_steps_other_grad",
        "wrong shard",
        "optim.py",
        "return [d * per + self.index % per for d in range(self.mesh.dp)]",
        "return [(d * per + self.index % per + 1) % self.mesh.size for d in range(self.mesh.dp)]",
        ("tests/pair/test_dp_cp.py::test_sharded_adamw_matches_serial",),
    ),
    M(
        "stack_backends_not_agreed",
        "a CP stack's attention backends left out of its agreed control scalars (its twins skip theirs)",
        "pair/layers/pairformer.py",
        '        "attention_backends": module_backends(stack),',
        '        "attention_backends": (),',
        ("tests/pair/test_attention_backends.py::test_backend_disagreement_in_a_stack_raises",),
    ),
    # -- atoms: NPT in graph storage (the cell replicated on every rank, the edges' shifts follow it)
    M(
        "graph_cell_one_rank",
        "replicated value diverges",
        "atoms/parallel/graph_storage.py",
        "self.cells = cells.clone()",
        "self.cells = cells.clone() if self.rank == 0 else self.cells",
        ("tests/atoms/test_graph_npt.py::test_graph_npt_equals_serial_at_round_off[mtk-2]",),
    ),
    M(
        "batch_barostat_swapped",
        "state swapped",
        "atoms/dynamics/batch.py",
        "baro = self.integrators[s]  # this system's own barostat (its state and cell)",
        "baro = self.integrators[[t for t in active if self.baro[t]][::-1][[t for t in active if self.baro[t]].index(s)]]",
        ("tests/atoms/test_batch_npt.py::test_batch_npt_equals_each_system_alone[2]",),
    ),
    M(
        "momentum_removed_one_rank",
        "partial update",
        "atoms/dynamics/md.py",
        "engine.set_state(engine.positions, v, moved=False)  # every rank's atoms",
        "engine.set_state(engine.positions, v if engine.rank == 0 else engine.velocities, moved=False)",
        ("tests/atoms/test_zero_momentum.py::test_zero_momentum_distributed_equals_serial[2]",),
    ),
    M(
        "graph_strain_margin_dropped",
        "stale neighbour list",
        "atoms/parallel/graph_storage.py",
        "need = need or 2.0 * ds + float(margin[s]) > self.skin",
        "need = need or 2.0 * ds > self.skin",
        ("tests/atoms/test_graph_npt.py::test_set_cell_shifts_and_strain_rule",),
    ),
    M(
        "mace_edge_index_restacked",
        "the routing rebuilt at every evaluation (a fresh edge_index tensor per call)",
        "atoms/potentials/mace.py",
        '            "edge_index": self.edge_index(data["senders"], data["receivers"]),',
        '            "edge_index": torch.stack([data["senders"], data["receivers"]]),',
        ("tests/atoms/test_graph_cost.py::test_mace_routes_once_per_neighbour_list",),
    ),
    # -- atoms: the one rank body (issue 18)
    M(
        "rows_by_id_unsorted",
        "wrong order",
        "atoms/parallel/evaluate.py",
        "return ids[order], rows[order]",
        "return ids, rows",
        ("tests/atoms/test_calculator.py", "tests/atoms/test_api.py"),
    ),
    M(
        "md_restart_chain_rank0_only",
        "unbroadcast state",
        "atoms/dynamics/run.py",
        "    load_dynamic_values(integ, dyn0)\n",
        "    load_dynamic_values(integ, dyn0) if rank == 0 else None\n",
        ("tests/atoms/test_nose_hoover.py",),
    ),
    M(
        "md_rank_start_step_not_broadcast",
        "unbroadcast state",
        "atoms/dynamics/run.py",
        '    resume = prim.broadcast(resume, 0, None, op="md_setup")\n',
        "    resume = resume if rank == 0 else resume * 0\n",
        ("tests/atoms/test_restart.py",),
    ),
    # -- gradients sharded during backward (ZeRO-2, issue 21 section 4)
    M(
        "zero2_hook_wrong_chunk",
        "wrong shard",
        "optim.py",
        "                d = slot_of.get(t % n)\n",
        "                d = slot_of.get((t + 1) % n)\n",
        ("tests/pair/test_dp_cp.py::test_zero2_backward_leaves_no_full_gradient",),
    ),
    M(
        "zero2_hook_assigns",
        "accumulation lost",
        "optim.py",
        "piece[at : at + e - a].add_(flat[a:e])",
        "piece[at : at + e - a].copy_(flat[a:e])",
        ("tests/pair/test_dp_cp.py::test_zero2_gradient_accumulation",),
    ),
    M(
        "zero2_dp_weight_twice",
        "double weighting",
        "optim.py",
        "            send.mul_(weight)\n",
        "            send.mul_(weight).mul_(weight)\n",
        ("tests/pair/test_dp_cp.py::test_sharded_adamw_matches_serial",),
    ),
    # -- the whole-model Boltz-2 training step under dp x cp (issue 21, section 3)
    M(
        "dp_model_sampler_rows_local",
        "wrong rng key",
        "pair/reference/sampler.py",
        "return rows + current_batch_offset() * int(per_element)",
        "return rows",
        ("tests/pair/test_train_boltz2_dp.py::test_dp_step_matches_serial[dp2x1x1-B2-N7-m2]",),
    ),
    M(
        "dp_model_grad_unweighted",
        "wrong normaliser",
        "pair/train_boltz2.py",
        "reduce_gradients([p for p, h in zip(params, held) if h > 0], weight, mesh)",
        "reduce_gradients([p for p, h in zip(params, held) if h > 0], 1.0, mesh)",
        ("tests/pair/test_train_boltz2_dp.py::test_dp_step_matches_serial[dp2x1x1-B2-N7-m2]",),
    ),
    M(
        "dp_model_loss_not_reduced",
        "missing reduction",
        "pair/train_boltz2.py",
        'total = P.all_reduce(torch.stack(parts) * weight, mesh.dp_group, op="dp:loss")',
        "total = torch.stack(parts)",
        ("tests/pair/test_train_boltz2_dp.py::test_dp_step_matches_serial[dp2x1x1-B2-N7-m2]",),
    ),
    M(
        "dp_model_dropout_local_batch_index",
        "wrong rng key",
        "pair/train_boltz2.py",
        "with mesh.replica(), batch_offset(sum(split[: mesh.dp_index])):",
        "with mesh.replica(), batch_offset(0):",
        ("tests/pair/test_train_boltz2_dp.py::test_dp_step_matches_serial[dp2x1x1-B2-N7-m2]",),
    ),
]


def _apply(copy: Path, m: Mutation) -> tuple[str | None, str]:
    """(error or None, the file's original text)."""
    path = copy / "src" / "twinshard" / m.file
    text = path.read_text()
    count = text.count(m.find)
    if count != 1:
        return f"fragment found {count} times in {m.file} (the sweep no longer matches the code)", text
    path.write_text(text.replace(m.find, m.replace))
    return None, text


def _restore(copy: Path, m: Mutation, text: str) -> None:
    (copy / "src" / "twinshard" / m.file).write_text(text)


def _first_failure(out: str) -> tuple[str, str]:
    test = next((ln.split(" ", 2)[1] for ln in out.splitlines() if ln.startswith("FAILED ")), "")
    msg = next((ln[2:].strip() for ln in out.splitlines() if ln.startswith("E  ")), "")
    return test, msg[:160]


def run(mutations: list[Mutation], timeout: float, head: bool = False) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="twinshard-mut-") as tmp:
        copy = Path(tmp)
        if head:  # the committed tree, whatever the working tree holds
            archive = subprocess.run(
                ["git", "archive", "HEAD", "src", "tests", "pyproject.toml", "README.md"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
        else:
            ignore = shutil.ignore_patterns("*.egg-info", "__pycache__")
            shutil.copytree(ROOT / "src", copy / "src", ignore=ignore)
            shutil.copytree(ROOT / "tests", copy / "tests", ignore=ignore)
            shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
            shutil.copy2(ROOT / "README.md", copy / "README.md")  # tests/test_readme.py runs its blocks
        env = dict(os.environ, PYTHONPATH=str(copy / "src"), TWINSHARD_EVIDENCE="", OMP_NUM_THREADS="1")
        for m in mutations:
            t0 = time.perf_counter()
            err, original = _apply(copy, m)
            row = {"id": m.id, "kind": m.kind, "file": m.file, "tests": list(m.tests)}
            if err:
                row.update(caught=False, error=err)
            else:
                try:
                    res = subprocess.run(
                        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                        cwd=copy,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                    out = res.stdout + res.stderr
                    test, msg = _first_failure(out)
                    row.update(caught=res.returncode == 1 and bool(test), by=test, message=msg)
                    if res.returncode not in (0, 1):
                        row["error"] = f"pytest exit {res.returncode}: {out.strip().splitlines()[-1:]}"
                except subprocess.TimeoutExpired:
                    row.update(caught=False, error=f"timed out after {timeout:.0f} s")
                finally:
                    _restore(copy, m, original)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(row)
            mark = "caught" if row["caught"] else "MISSED"
            print(f"{mark:7s} {m.id:28s} {row.get('by') or row.get('error', '')}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", action="append", default=[], help="run only this mutation id (repeatable)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation")
    ap.add_argument(
        "--head", action="store_true", help="sweep the committed tree (git HEAD), not the working tree"
    )
    a = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not a.only or m.id in a.only]
    if a.list:
        for m in chosen:
            print(f"{m.id:28s} {m.kind:22s} {m.file}: {m.find!r} -> {m.replace!r}")
        return 0
    unknown = set(a.only) - {m.id for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation ids {sorted(unknown)}")
    results = run(chosen, a.timeout, a.head)
    caught = sum(r["caught"] for r in results)
    print(json.dumps({"mutations": len(results), "caught": caught, "results": results}))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
