"""Parity: selzero on the experts + DDP on the rest == one process on the mean of the losses."""

import pytest

from .dist_utils import all_values, run_ranks
from .parity import max_diff, reference_run, selzero_run

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt", ["AdamW", "SGD"])
def test_parity_mean_matches_single_process_reference(world, opt):
    results = all_values(run_ranks(selzero_run, world, 5, opt))
    ref = reference_run(world, 5, opt)
    for r, state in enumerate(results):
        assert max_diff(state, ref) <= 1e-6, f"rank {r}"
    assert max_diff(results[0], results[-1]) == 0.0
