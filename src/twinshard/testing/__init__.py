"""The parity harness: run on every rank, compare with the serial twin, prove it is not vacuous.

Use from tests (the pytest plugin adds the ``grids`` marker and the evidence summary) or from
any script. See README's "Porting your own module" for a walk-through.
"""

from twinshard.testing.checks import (
    TwinResult,
    assert_grads_finite_nonzero,
    assert_nonzero_parameters,
    assert_parity,
    assert_random_grad_output,
    assert_replicated,
    assert_same_parameters,
    assert_shards_cover,
    by_id,
    check_twin,
    parameter_signature,
    parity_tolerance,
    rows_of,
    serial_reference,
    tolerance,
)
from twinshard.testing.inputs import (
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    randomize_parameters,
    synthetic,
)
from twinshard.testing.run import grid_id, run_on_grid, run_on_world

__all__ = [
    "TwinResult",
    "assert_grads_finite_nonzero",
    "assert_nonzero_parameters",
    "assert_parity",
    "assert_random_grad_output",
    "assert_replicated",
    "assert_same_parameters",
    "assert_shards_cover",
    "by_id",
    "check_twin",
    "parity_tolerance",
    "grid_id",
    "parameter_signature",
    "perturb_zero_parameters",
    "random_grad_output",
    "random_mask",
    "randomize_parameters",
    "run_on_grid",
    "run_on_world",
    "rows_of",
    "serial_reference",
    "synthetic",
    "tolerance",
]
