"""bf16 parameters with FP32 masters: parity with the same reference run on FP32 masters.

selzero keeps an FP32 master of this rank's chunk of every bf16 parameter, steps the optimizer on
it and writes the bf16 cast back by all-gather. The reference (tests/_bf16.py) does the same in one
process on the mean of the ranks' bf16 gradients. The bf16 parameters must agree exactly or within
one bf16 ulp (a master that differs in its last FP32 bits may round to the neighbouring bf16
number), the masters within FP32 rounding. Host parameters are frozen bf16 so that nothing but
selzero's own arithmetic is compared (see tests/_bf16.py). Learning rates are small: most updates
are below one bf16 ulp, so an engine without masters diverges from the reference.
"""

from __future__ import annotations

import pytest
import torch

from ._bf16 import OPTIMIZERS, bf16_reference, bf16_selzero
from ._shard import assemble, within_one_bf16_ulp
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

STEPS = 8
PATTERN = "warm"  # every expert at step 0, then "uneven": some absent on some ranks, one on all


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def bf16(request):
    world = request.param
    runs = all_values(run_ranks(bf16_selzero, world, STEPS, PATTERN, timeout=90))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: same bf16 kernels, same rounding
    try:
        refs = {name: bf16_reference(world, STEPS, PATTERN, name) for name in OPTIMIZERS}
        no_masters = {name: bf16_reference(world, STEPS, PATTERN, name, keep_masters=False)
                      for name in OPTIMIZERS}
    finally:
        torch.set_num_threads(threads)
    return world, runs, refs, no_masters


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_bf16_params_match_fp32_master_reference_within_one_ulp(bf16, opt):
    world, runs, refs, _ = bf16
    for step in range(STEPS):
        for r, run in enumerate(runs):
            for name, p in run[opt]["snaps"][step]["params"].items():
                expected = refs[opt][step]["params"][name]
                assert p.dtype == torch.bfloat16
                close = within_one_bf16_ulp(p, expected)
                assert bool(close.all()), (
                    f"rank {r} step {step}: {name} differs from the reference by more than one "
                    f"bf16 ulp: {p[~close][:4].tolist()} vs {expected[~close][:4].tolist()}")


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_bf16_masters_and_state_match_reference_masters(bf16, opt):
    world, runs, refs, _ = bf16
    for step in range(STEPS):
        ref = refs[opt][step]
        full = assemble([run[opt]["snaps"][step]["shard"] for run in runs])
        assert {name for name, _ in full} == set(ref["masters"])
        for (name, _), item in full.items():
            master = item["value"]
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, ref["masters"][name].reshape(-1), atol=1e-6,
                                       rtol=1e-5, msg=f"step {step}: master of {name}")
            expected = ref["state"].get(name, {})
            assert set(item["state"]) == set(expected), (step, name)
            for k, v in expected.items():
                torch.testing.assert_close(torch.as_tensor(item["state"][k]).reshape(-1),
                                           v.reshape(-1), atol=1e-7, rtol=1e-4,
                                           msg=f"step {step}: {name} {k}")


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_bf16_masters_live_in_fp32_master_flat_and_hold_sub_ulp_updates(bf16, opt):
    """What makes the tests above able to fail: without masters the run ends elsewhere."""
    world, runs, refs, no_masters = bf16
    for run in runs:
        assert run[opt]["master_dtype"] == torch.float32
        assert run[opt]["segments_in_master_flat"]
    final = assemble([run[opt]["snaps"][-1]["shard"] for run in runs])
    sub_ulp = sum(int((item["value"] != item["value"].bfloat16().float()).sum())
                  for item in final.values())
    assert sub_ulp > 0, "the masters hold nothing beyond bf16: they are not FP32 masters"
    lost = [not bool(within_one_bf16_ulp(no_masters[opt][-1]["params"][n], p).all())
            for n, p in refs[opt][-1]["params"].items()]
    assert any(lost), "dropping the masters would not change the result: the test cannot fail"


def test_bf16_expert_absent_on_every_rank_keeps_weights_and_master(bf16):
    world, runs, _, _ = bf16
    for opt in OPTIMIZERS:
        first = assemble([run[opt]["snaps"][0]["shard"] for run in runs])
        for step in range(1, STEPS):
            later = assemble([run[opt]["snaps"][step]["shard"] for run in runs])
            for key, item in later.items():
                if key[0].startswith("experts.3."):
                    assert torch.equal(item["value"], first[key]["value"]), (opt, step, key)
                    assert set(item["state"]) == set(first[key]["state"])
                    for k, v in item["state"].items():
                        assert torch.equal(torch.as_tensor(v),
                                           torch.as_tensor(first[key]["state"][k])), (opt, key, k)
            for run in runs:
                params = run[opt]["snaps"][step]["params"]
                before = run[opt]["snaps"][0]["params"]
                assert all(torch.equal(p, before[n]) for n, p in params.items()
                           if n.startswith("experts.3."))
                assert not all(torch.equal(p, before[n]) for n, p in params.items()
                               if n.startswith("experts.0."))
