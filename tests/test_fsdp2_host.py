"""selzero beside an FSDP2 host; Accelerate's FSDP2 plugin is handed the selected parameters."""

from __future__ import annotations

import types

import pytest
import torch

from ._fsdp2_host import fsdp2_reference, fsdp2_run
from .dist_utils import all_values, run_ranks

pytestmark = [pytest.mark.multiproc]


def test_fsdp2_host_parity_with_foreach_host_optimizer():
    runs = all_values(run_ranks(fsdp2_run, 2, 4, timeout=120))
    ref, ref_norms = fsdp2_reference(2, 4)
    for run in runs:
        assert run["dtensors"] > 0 and run["plain_selected"]
        for name, value in ref.items():
            assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), \
                (name, float((run["params"][name] - value).abs().max()))
        # the one global norm over FSDP2's sharded gradients and the subset
        assert max(abs(a - b) for a, b in zip(run["norms"], ref_norms)) < 1e-6


@pytest.mark.parametrize("existing", [None, r"out"])
def test_accelerate_fsdp2_plugin_gets_the_ignored_parameters(existing):
    pytest.importorskip("accelerate")
    from accelerate.utils.fsdp_utils import get_parameters_from_modules

    from selzero_plugin import SelectedZero2, SelZeroConfig
    from selzero_plugin.accelerate import _ignore_in_fsdp_plugin
    from ._blocks import BlockMoE

    model = BlockMoE(layers=2)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), torch.optim.AdamW)
    plugin = types.SimpleNamespace(ignored_modules=existing)
    _ignore_in_fsdp_plugin(plugin, model, [e.param for e in sz.entries])
    got = get_parameters_from_modules(plugin.ignored_modules, model, torch.device("cpu"))
    want = {e.param for e in sz.entries} | (set(model.out.parameters()) if existing else set())
    assert got == want
