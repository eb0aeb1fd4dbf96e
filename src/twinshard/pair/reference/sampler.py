"""The structure module's sampler, serial: Boltz-2's ``AtomDiffusion`` (``diffusionv2.py``;
AlphaFold3 supplement, Algorithms 18-19 and 28) at inference, ``sample``.

The EDM sampler (Karras et al. 2022) with AF3's schedule and stochastic step::

    sigma_i = sigma_data (s_max^(1/rho) + i / (T - 1) (s_min^(1/rho) - s_max^(1/rho)))^rho,  i < T;
    sigma_T = 0                                        # computed in fp32, as Boltz computes it
    gamma_i = gamma_0 if sigma_i > gamma_min else 0
    x <- sigma_0 eps_init                              # eps ~ N(0, 1), [B m, A, 3]
    for step s (sigma_tm = sigma_s, sigma_t = sigma_{s+1}, gamma = gamma_{s+1}):
        x <- (x - mean_atoms(x)) R_s + t_s             # random rotation (uniform quaternion) + N(0, 1) shift
        t_hat = sigma_tm (1 + gamma)
        x_noisy = x + noise_scale sqrt(t_hat^2 - sigma_tm^2) eps_s
        x_den = c_skip(t_hat) x_noisy + c_out(t_hat) F(c_in(t_hat) x_noisy, c_noise(t_hat))
        if alignment_reverse_diff: x_noisy <- weighted_rigid_align(x_noisy onto x_den, weights = atom mask)
        x <- x_noisy + step_scale (sigma_t - t_hat) (x_noisy - x_den) / t_hat

with ``c_skip = sd^2 / (sigma^2 + sd^2)``, ``c_out = sigma sd / sqrt(sd^2 + sigma^2)``, ``c_in = 1 /
sqrt(sigma^2 + sd^2)``, ``c_noise = log(sigma / sd) / 4`` and ``F`` the score model
(:class:`~twinshard.pair.reference.diffusion.DiffusionModule`). As in Boltz: the centring mean is
over all ``A`` atoms of the padded atom axis (Boltz's padding atoms carry noise too and count),
the alignment weights are the atom mask (real atoms only), the alignment's SVD runs in fp32
(``align_svd_dtype``; Boltz's ``weighted_rigid_align`` casts the 3 x 3 covariance to fp32) and its
result replaces ``x_noisy`` for all atoms; the samples are scored in ``m % max_parallel_samples + 1``
chunks (Boltz's formula, ``torch.chunk`` sizes; the score model is per sample, so chunks change
memory only). Steering (``fk_steering``, physical and contact guidance) is not implemented: a
``steering_args`` with any of them on raises (Boltz's ``boltz predict`` turns contact guidance on;
it is a no-op without contact constraints and template references, not verified here).

Random draws. Every draw goes through a *draw source* ``draws(kind, step, shape, rows, atoms,
dtype, device)``, which returns the entries ``rows`` (global sample rows ``b m + j``) and, for
per-atom draws, ``atoms`` (global atom indices ``[rows, K]``) of the serial draw of ``shape``:

- ``"init"`` (step 0) and ``"noise"`` (step s): ``[B m, A, 3]`` standard normals;
- ``"rotation"``: ``[B m, 4]`` standard normals, made a unit quaternion with a non-negative real part
  (uniform rotations), then the rotation matrix ``R`` (``x R``: row vectors);
- ``"translation"``: ``[B m, 1, 3]`` standard normals.

Two sources: :class:`CounterDraws` (the twinshard convention: ``twinshard.rng`` keyed by (seed,
sample row, step, global atom index x 3 + component), so a distributed sampler that draws only its
atoms gets the serial numbers on any grid) and :class:`GivenDraws` (the ``"boltz"`` convention: a
callback hands the full serial tensors, in the order and shapes Boltz's ``torch.randn`` calls draw
them, to both sides). Boltz itself samples ``B = 1`` only (its rotations are ``[m, 3, 3]``); here
any ``B``, the sample rows ``b m + j``.

Data parallelism. Under ``reference.dropout.batch_offset(k)`` (a dp replica holding elements
``[k, k + B_local)`` of the whole batch) the rows handed to the draw source are the whole batch's
(:func:`global_rows`: sample row ``(k + b) m + j``, the synchronized noise level's row ``k + b``),
so the replicas draw together exactly the serial step's numbers. :class:`GivenDraws` hands out
rows of the shape it is asked for (the replica's): it raises under a nonzero offset.

Training loss: ``loss_weight`` and ``compute_loss`` (Boltz-2's diffusion loss) are
:mod:`twinshard.pair.reference.structure_loss`'s.

Names: ``score_model.*`` (Boltz's ``structure_module.score_model.*``; a ``Boltz2`` state dict's
``structure_module.*`` loads strict) and the non-persistent buffer ``zero``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from twinshard.pair.reference import structure_loss
from twinshard.pair.reference.alignment import rotation_from_covariance, weighted_rigid_align
from twinshard.pair.reference.diffusion import DiffusionModule
from twinshard.pair.reference.dropout import current_batch_offset
from twinshard.rng import normal

__all__ = [
    "BOLTZ2_DIFFUSION_PARAMS",
    "DRAW_KINDS",
    "SAMPLER_STREAMS",
    "AtomDiffusion",
    "CounterDraws",
    "GivenDraws",
    "boltz_sample_chunks",
    "global_rows",
    "quaternion_rotation",
    "rotation_from_covariance",
    "weighted_rigid_align",
]

# ``boltz predict``'s diffusion parameters for Boltz-2 (boltz 2.2.1 main.py Boltz2DiffusionParams);
# AtomDiffusion's own defaults differ (e.g. alignment_reverse_diff False, sigma_min 4e-4).
BOLTZ2_DIFFUSION_PARAMS: dict[str, Any] = {
    "gamma_0": 0.8,
    "gamma_min": 1.0,
    "noise_scale": 1.003,
    "rho": 7,
    "step_scale": 1.5,
    "sigma_min": 0.0001,
    "sigma_max": 160.0,
    "sigma_data": 16.0,
    "P_mean": -1.2,
    "P_std": 1.5,
    "coordinate_augmentation": True,
    "alignment_reverse_diff": True,
    "synchronize_sigmas": True,
}

DRAW_KINDS = ("init", "rotation", "translation", "noise")
# twinshard.rng streams of the counter-based draws (ASCII "DIF0", "DIFR", "DIFT", "DIFN")
SAMPLER_STREAMS = {"init": 0x44494630, "rotation": 0x44494652, "translation": 0x44494654, "noise": 0x4449464E}
# the training forward's draws (AtomDiffusion.forward): the noise levels ``[B]`` (``[B m]`` without
# synchronize_sigmas), the augmentation's rotation ``[B m, 4]`` and translation ``[B m, 1, 3]``, the
# noise ``[B m, A, 3]`` (ASCII "TRNS", "TRNR", "TRNT", "TRNN"); step 0
TRAIN_DRAW_KINDS = ("sigma", "aug_rotation", "aug_translation", "train_noise")
SAMPLER_STREAMS.update(
    {
        "sigma": 0x54524E53,
        "aug_rotation": 0x54524E52,
        "aug_translation": 0x54524E54,
        "train_noise": 0x54524E4E,
    }
)
_ATOM_DRAWS = ("init", "noise", "train_noise")

DrawSource = Callable[..., torch.Tensor]


def global_rows(rows: torch.Tensor, per_element: int) -> torch.Tensor:
    """Draw rows of this process's elements -> the whole batch's: ``rows + k per_element`` with
    ``k`` the enclosing ``batch_offset`` (0 outside one); ``per_element`` is ``m`` for sample rows
    ``b m + j``, 1 for per-element rows (module docstring, data parallelism)."""
    return rows + current_batch_offset() * int(per_element)


class CounterDraws:
    """The twinshard convention: ``normal(seed, SAMPLER_STREAMS[kind], row, step, index)`` with
    ``index`` the global atom index x 3 + component for ``init``/``noise``/``train_noise``, the
    component (0-3, 0-2) for ``rotation``/``translation`` (and ``aug_*``), 0 for ``sigma`` (its
    row the element ``b`` with ``synchronize_sigmas``). A pure function of the global indices.
    ``global_step`` (training): the counter's block word, so each training step has its own draws
    (None: block 0, the inference draws)."""

    def __init__(self, seed: int, global_step: int | None = None):
        self.seed = int(seed)
        self.global_step = None if global_step is None else int(global_step)
        normal(self.seed, 0, 0)  # validates the seed (an integer in [0, 2**32)) now

    def __call__(self, kind, step, shape, rows, atoms, dtype, device) -> torch.Tensor:
        if self.global_step is not None:
            # a training step's draws: the step keys them too (the stream of each global step)
            return self._keyed(kind, step, rows, atoms, dtype, device, self.global_step)
        return self._keyed(kind, step, rows, atoms, dtype, device, 0)

    def _keyed(self, kind, step, rows, atoms, dtype, device, block) -> torch.Tensor:
        stream = SAMPLER_STREAMS[kind]
        rows = rows.to(device=device, dtype=torch.int64)
        if kind == "sigma":
            return normal(self.seed, stream, rows, int(step), 0, dtype=dtype, device=device, block=block)
        if kind in _ATOM_DRAWS:
            comp = torch.arange(3, device=device)
            idx = atoms.to(device=device, dtype=torch.int64)[..., None] * 3 + comp
            # the global atom index keys the draw (the serial numbers on any grid)
            return normal(
                self.seed,
                stream,
                rows[:, None, None],
                int(step),
                idx,
                dtype=dtype,
                device=device,
                block=block,
            )
        if kind in ("rotation", "aug_rotation"):
            return normal(
                self.seed,
                stream,
                rows[:, None],
                int(step),
                torch.arange(4, device=device),
                dtype=dtype,
                device=device,
                block=block,
            )
        comp = torch.arange(3, device=device)[None, None, :]
        return normal(
            self.seed, stream, rows[:, None, None], int(step), comp, dtype=dtype, device=device, block=block
        )


class GivenDraws:
    """The ``"boltz"`` convention: ``fn(kind, step, shape)`` returns the full serial draw of
    ``shape`` (the same tensor on every rank and for every caller); this source hands out the
    requested rows and atoms of it."""

    def __init__(self, fn: Callable[[str, int, tuple[int, ...]], torch.Tensor]):
        self.fn = fn

    def __call__(self, kind, step, shape, rows, atoms, dtype, device) -> torch.Tensor:
        if current_batch_offset():
            raise ValueError(
                f"GivenDraws hands out the {kind} draw of the shape it is asked for, not the whole "
                f"batch's: under a batch offset ({current_batch_offset()}, a dp replica) use CounterDraws"
            )
        full = self.fn(kind, int(step), tuple(shape))
        if tuple(full.shape) != tuple(shape):
            raise ValueError(
                f"the {kind} draw of step {step} has shape {tuple(full.shape)}, expected {shape}"
            )
        full = full.to(device=device, dtype=dtype)
        rows = rows.to(device=device, dtype=torch.int64)
        if kind in _ATOM_DRAWS:
            return full[rows[:, None], atoms.to(device=device, dtype=torch.int64)]
        return full[rows]


def quaternion_rotation(draw: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` normal draws -> ``[n, 3, 3]`` rotation matrices: the draw normalised to a unit
    quaternion ``(r, i, j, k)`` with ``r >= 0`` (uniform over rotations), then the rotation matrix."""
    norm = torch.sqrt((draw * draw).sum(1))
    q = draw / torch.where(draw[:, 0] < 0, -norm, norm)[:, None]
    r, i, j, k = q.unbind(-1)
    two_s = 2.0 / (q * q).sum(-1)
    rot = torch.stack(
        (
            1 - two_s * (j * j + k * k),
            two_s * (i * j - k * r),
            two_s * (i * k + j * r),
            two_s * (i * j + k * r),
            1 - two_s * (i * i + k * k),
            two_s * (j * k - i * r),
            two_s * (i * k - j * r),
            two_s * (j * k + i * r),
            1 - two_s * (i * i + j * j),
        ),
        -1,
    )
    return rot.reshape(q.shape[:-1] + (3, 3))


def boltz_sample_chunks(multiplicity: int, max_parallel_samples: int | None) -> list[list[int]]:
    """Boltz's chunks of sample ids: ``arange(m).chunk(m % max_parallel_samples + 1)``."""
    m = int(multiplicity)
    mps = m if max_parallel_samples is None else int(max_parallel_samples)
    return [c.tolist() for c in torch.arange(m).chunk(m % mps + 1)]


class SampleFrame:
    """Which entries of the serial ``[B m, A, 3]`` the caller holds: ``rows[B m]`` (global sample
    rows), ``atoms[B m, K]`` (global atom indices; padding slots hold 0), ``valid[B m, K]``."""

    def __init__(self, rows: torch.Tensor, atoms: torch.Tensor, valid: torch.Tensor | None, n_atoms: int):
        self.rows, self.atoms, self.valid, self.n_atoms = rows, atoms, valid, int(n_atoms)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.valid is None else x * self.valid[..., None].to(x.dtype)


class AtomDiffusion(nn.Module):
    """Boltz-2's ``AtomDiffusion`` (module docstring): ``sample(atom_mask, num_sampling_steps,
    multiplicity, max_parallel_samples, steering_args, *, draws=None, seed=0, s_inputs, s_trunk,
    feats, diffusion_conditioning)`` -> ``{"sample_atom_coords": [B m, A, 3], "diff_token_repr":
    None}``. Constructor arguments are Boltz's (``score_model_args`` -> the score model)."""

    _score_cls: type[DiffusionModule] = DiffusionModule

    def __init__(
        self,
        score_model_args: Mapping[str, Any],
        num_sampling_steps: int = 5,
        sigma_min: float = 0.0004,
        sigma_max: float = 160.0,
        sigma_data: float = 16.0,
        rho: float = 7,
        P_mean: float = -1.2,  # noqa: N803 - Boltz's name
        P_std: float = 1.5,  # noqa: N803
        gamma_0: float = 0.8,
        gamma_min: float = 1.0,
        noise_scale: float = 1.003,
        step_scale: float = 1.5,
        step_scale_random: list | None = None,
        coordinate_augmentation: bool = True,
        coordinate_augmentation_inference: bool | None = None,
        compile_score: bool = False,
        alignment_reverse_diff: bool = False,
        synchronize_sigmas: bool = False,
        align_svd_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if compile_score:
            raise ValueError("compile_score: torch.compile of the score model is not supported here")
        self.score_model = self._score_cls(**score_model_args)
        self.sigma_min, self.sigma_max, self.sigma_data, self.rho = sigma_min, sigma_max, sigma_data, rho
        self.P_mean, self.P_std = P_mean, P_std
        self.num_sampling_steps = num_sampling_steps
        self.gamma_0, self.gamma_min = gamma_0, gamma_min
        self.noise_scale, self.step_scale, self.step_scale_random = noise_scale, step_scale, step_scale_random
        self.coordinate_augmentation = coordinate_augmentation
        self.coordinate_augmentation_inference = (
            coordinate_augmentation
            if coordinate_augmentation_inference is None
            else coordinate_augmentation_inference
        )
        self.alignment_reverse_diff = alignment_reverse_diff
        self.synchronize_sigmas = synchronize_sigmas
        self.align_svd_dtype = align_svd_dtype
        self.token_s = score_model_args["token_s"]
        self.register_buffer("zero", torch.tensor(0.0), persistent=False)

    # -- preconditioning (EDM) ------------------------------------------------------------------
    def c_skip(self, sigma: torch.Tensor) -> torch.Tensor:
        return (self.sigma_data**2) / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma * self.sigma_data / torch.sqrt(self.sigma_data**2 + sigma**2)

    def c_in(self, sigma: torch.Tensor) -> torch.Tensor:
        return 1 / torch.sqrt(sigma**2 + self.sigma_data**2)

    def c_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        return torch.log((sigma / self.sigma_data).clamp(min=1e-20)) * 0.25

    def preconditioned_network_forward(
        self, noised_atom_coords: torch.Tensor, sigma: float | torch.Tensor, network_condition_kwargs: dict
    ) -> torch.Tensor:
        """``c_skip x + c_out F(c_in x, c_noise)`` for ``x[rows, A, 3]`` (a float ``sigma``: every row)."""
        x = noised_atom_coords
        if isinstance(sigma, float):
            sigma = torch.full((x.shape[0],), sigma, dtype=x.dtype, device=x.device)
        ps = sigma[:, None, None]
        r_update = self._score(self.c_in(ps) * x, self.c_noise(sigma), network_condition_kwargs)
        return self.c_skip(ps) * x + self.c_out(ps) * r_update

    def _score(self, r_noisy: torch.Tensor, times: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return self.score_model(r_noisy=r_noisy, times=times, **kwargs)

    def sample_schedule(self, num_sampling_steps: int | None = None) -> torch.Tensor:
        """``[T + 1]`` noise levels, in fp32 (Boltz's arithmetic), the last 0."""
        t = int(self.num_sampling_steps if num_sampling_steps is None else num_sampling_steps)
        if t < 2:
            raise ValueError(
                f"num_sampling_steps must be at least 2, got {t} (the schedule interpolates over T - 1 intervals)"
            )
        inv_rho = 1 / self.rho
        steps = torch.arange(t, dtype=torch.float32)
        lo, hi = self.sigma_min**inv_rho, self.sigma_max**inv_rho
        sigmas = (hi + steps / (t - 1) * (lo - hi)) ** self.rho * self.sigma_data
        return torch.nn.functional.pad(sigmas, (0, 1), value=0.0)

    def _schedule(self, t: int, dtype: torch.dtype) -> list[tuple[float, float, float]]:
        sigmas = self.sample_schedule(t)
        # gamma_0 rounded to the coordinates' dtype: Boltz's torch.where(sigmas > gamma_min, gamma_0,
        # 0.0) is in the default dtype, which is its coordinates' (fp32 in Boltz; fp64 in the
        # fp64 parity tests)
        g0 = torch.tensor(self.gamma_0, dtype=dtype)
        gammas = torch.where(sigmas > self.gamma_min, g0, torch.zeros((), dtype=dtype))
        return [(float(a), float(b), float(g)) for a, b, g in zip(sigmas[:-1], sigmas[1:], gammas[1:])]

    # -- the hooks a distributed sampler overrides ------------------------------------------------
    def _atom_sum(self, x: torch.Tensor, frame: SampleFrame) -> torch.Tensor:
        """Sum over the atom axis (dim 1) of every atom of the serial tensor."""
        if frame.valid is None:
            return x.sum(1)
        keep = frame.valid.view(frame.valid.shape + (1,) * (x.ndim - 2)).to(x.dtype)
        return (x * keep).sum(1)

    def _check_steering(self, steering_args: Mapping[str, Any] | None) -> None:
        on = sorted(
            k
            for k in ("fk_steering", "physical_guidance_update", "contact_guidance_update")
            if steering_args and steering_args.get(k)
        )
        if on:
            raise NotImplementedError(
                f"{type(self).__name__}.sample: steering is not implemented ({', '.join(on)} on); pass "
                "steering_args=None or all three flags False"
            )

    def _run(
        self,
        atom_mask: torch.Tensor,
        frame: SampleFrame,
        steps: int,
        m: int,
        chunks: list[list[int]],
        draws: DrawSource,
        kwargs: dict,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The sampling loop on the entries ``frame`` holds (``atom_mask[B m, K]`` of those)."""
        rows_n = frame.rows.shape[0]
        dev = atom_mask.device
        shape_a = (rows_n, frame.n_atoms, 3)
        rows = global_rows(frame.rows, m)  # the whole batch's rows (a dp replica's offset)

        def draw(kind, step, shape):
            return draws(kind, step, shape, rows, frame.atoms, dtype, dev)

        def mean(x):
            return self._atom_sum(x, frame)[:, None] / frame.n_atoms

        sched = self._schedule(steps, dtype)
        x = frame.mask(sched[0][0] * draw("init", 0, shape_a))
        step_scale = self.step_scale
        if self.training and self.step_scale_random is not None:
            raise ValueError("step_scale_random (training-time random step scale) is not supported in sample")
        b = rows_n // m
        for s, (sigma_tm, sigma_t, gamma) in enumerate(sched):
            rot = quaternion_rotation(draw("rotation", s, (rows_n, 4)))
            tr = draw("translation", s, (rows_n, 1, 3))
            x = x - mean(x)
            x = frame.mask(torch.einsum("bmd,bds->bms", x, rot) + tr)
            t_hat = sigma_tm * (1 + gamma)
            noise_var = self.noise_scale**2 * (t_hat**2 - sigma_tm**2)
            noisy = x + math.sqrt(noise_var) * frame.mask(draw("noise", s, shape_a))
            with torch.no_grad():
                den = torch.zeros_like(noisy)
                for ids in chunks:
                    idx = torch.tensor([bb * m + j for bb in range(b) for j in ids], device=dev)
                    sub = dict(kwargs, multiplicity=len(ids))
                    den[idx] = self.preconditioned_network_forward(noisy[idx], t_hat, sub)
                den = frame.mask(den)
            if self.alignment_reverse_diff:
                noisy = frame.mask(
                    weighted_rigid_align(
                        noisy,
                        den,
                        atom_mask,
                        atom_mask,
                        self.align_svd_dtype,
                        lambda v: self._atom_sum(v, frame),
                    )
                )
            x = noisy + step_scale * (sigma_t - t_hat) * ((noisy - den) / t_hat)
        return x

    # -- training (Boltz's AtomDiffusion.forward) ---------------------------------------------------
    def _train(
        self,
        coords: torch.Tensor,
        atom_mask: torch.Tensor,
        frame: SampleFrame,
        m: int,
        draws: DrawSource,
        kwargs: dict,
    ) -> dict[str, torch.Tensor]:
        """The training forward on the entries ``frame`` holds (``coords``, ``atom_mask`` of those)."""
        dtype, dev = coords.dtype, coords.device
        rows_n = frame.rows.shape[0]
        atoms = frame.atoms  # global atom indices: the noise of an atom is the serial one on any grid
        sample_rows = global_rows(frame.rows, m)  # and the whole batch's rows (a dp replica's offset)

        def draw(kind, shape, rows=None):
            return draws(kind, 0, shape, sample_rows if rows is None else rows, atoms, dtype, dev)

        if self.synchronize_sigmas:  # one noise level per element, shared by its m samples
            b = rows_n // m
            eps = draw("sigma", (b,), global_rows(torch.arange(b, device=dev), 1)).repeat_interleave(m, 0)
        else:
            eps = draw("sigma", (rows_n,))
        sigmas = self.sigma_data * (self.P_mean + self.P_std * eps).exp()
        with torch.no_grad():  # center_random_augmentation: the mean over the real atoms (atom mask)
            w = atom_mask[..., None]
            x = frame.mask(
                coords - self._atom_sum(coords * w, frame)[:, None] / self._atom_sum(w, frame)[:, None]
            )
            if self.coordinate_augmentation:
                rot = quaternion_rotation(draw("aug_rotation", (rows_n, 4)))
                x = frame.mask(torch.einsum("bmd,bds->bms", x, rot) + draw("aug_translation", (rows_n, 1, 3)))
            noised = x + sigmas[:, None, None] * frame.mask(draw("train_noise", (rows_n, frame.n_atoms, 3)))
        den = self.preconditioned_network_forward(noised, sigmas, dict(kwargs, multiplicity=m))
        return {"denoised_atom_coords": frame.mask(den), "sigmas": sigmas, "aligned_true_atom_coords": x}

    def forward(
        self,
        s_inputs: torch.Tensor,
        s_trunk: torch.Tensor,
        feats: Mapping[str, torch.Tensor],
        diffusion_conditioning: dict,
        multiplicity: int = 1,
        *,
        draws: DrawSource | None = None,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Boltz's training forward (``AtomDiffusion.forward``; AF3 Algorithm 19 and the EDM
        preconditioning): ``feats["coords"]`` the true coordinates ``[B m, A, 3]`` (each element's
        rows ``b m + j``), returns ``denoised_atom_coords [B m, A, 3]`` (with gradients),
        ``sigmas [B m]`` and ``aligned_true_atom_coords [B m, A, 3]``.

        ``sigma = sigma_data exp(P_mean + P_std eps)`` with ``eps`` the ``"sigma"`` draw (``[B]``
        repeated over the m samples with ``synchronize_sigmas``, else ``[B m]``); the true
        coordinates centred on the mean over the real atoms (``atom_pad_mask``; Boltz's padding
        atoms are shifted too), then, with ``coordinate_augmentation``, rotated by the
        ``"aug_rotation"`` quaternion and shifted by the ``"aug_translation"`` normal draw; noised
        with ``sigma x`` the ``"train_noise"`` draw; denoised by the preconditioned score model.
        ``draws``: a draw source (default :class:`CounterDraws` of ``seed``)."""
        coords = feats["coords"]
        m = int(multiplicity)
        if coords.dim() != 3 or coords.shape[0] % m:
            raise ValueError(
                f"{type(self).__name__}.forward: coords must be [B m, A, 3] with m = {m}, got {tuple(coords.shape)}"
            )
        rows_n, a = coords.shape[:2]
        mask = feats["atom_pad_mask"].repeat_interleave(m, 0).to(coords.dtype)
        frame = SampleFrame(
            torch.arange(rows_n, device=coords.device),
            torch.arange(a, device=coords.device).expand(rows_n, a),
            None,
            a,
        )
        draws = CounterDraws(seed) if draws is None else draws
        kwargs = {
            "s_inputs": s_inputs,
            "s_trunk": s_trunk,
            "feats": feats,
            "diffusion_conditioning": diffusion_conditioning,
        }
        return self._train(coords, mask, frame, m, draws, kwargs)

    @torch.no_grad()
    def sample(
        self,
        atom_mask: torch.Tensor,
        num_sampling_steps: int | None = None,
        multiplicity: int = 1,
        max_parallel_samples: int | None = None,
        steering_args: Mapping[str, Any] | None = None,
        *,
        draws: DrawSource | None = None,
        seed: int = 0,
        **network_condition_kwargs: Any,
    ) -> dict[str, Any]:
        """Sample ``multiplicity`` structures per element (module docstring). ``draws``: a draw
        source (default :class:`CounterDraws` of ``seed``); ``network_condition_kwargs``: the score
        model's ``s_inputs``, ``s_trunk``, ``feats``, ``diffusion_conditioning``."""
        self._check_steering(steering_args)
        m = int(multiplicity)
        steps = int(self.num_sampling_steps if num_sampling_steps is None else num_sampling_steps)
        draws = CounterDraws(seed) if draws is None else draws
        mask = atom_mask.repeat_interleave(m, 0)
        rows_n, a = mask.shape
        dtype = network_condition_kwargs["s_trunk"].dtype
        rows = torch.arange(rows_n, device=mask.device)
        frame = SampleFrame(rows, torch.arange(a, device=mask.device).expand(rows_n, a), None, a)
        chunks = boltz_sample_chunks(m, max_parallel_samples)
        x = self._run(mask.to(dtype), frame, steps, m, chunks, draws, network_condition_kwargs, dtype)
        return {"sample_atom_coords": x, "diff_token_repr": None}

    # -- the training loss (twinshard.pair.reference.structure_loss) ------------------------------
    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """EDM's loss weight ``(sigma^2 + sd^2) / (sigma sd)^2`` (Boltz's ``loss_weight``)."""
        return structure_loss.loss_weight(sigma, self.sigma_data)

    def compute_loss(
        self,
        feats: Mapping[str, Any],
        out_dict: Mapping[str, Any],
        add_smooth_lddt_loss: bool = True,
        nucleotide_loss_weight: float = 5.0,
        ligand_loss_weight: float = 10.0,
        multiplicity: int = 1,
        filter_by_plddt: float = 0.0,
    ) -> dict[str, Any]:
        """Boltz-2's diffusion loss: :func:`twinshard.pair.reference.structure_loss.compute_loss`."""
        return structure_loss.compute_loss(
            self,
            feats,
            out_dict,
            add_smooth_lddt_loss,
            nucleotide_loss_weight,
            ligand_loss_weight,
            multiplicity,
            filter_by_plddt,
        )
