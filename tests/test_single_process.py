"""Without torch.distributed, SelectedZero2 is a group of one: plain torch.optim, bit for bit."""

import torch
import torch.distributed as dist

from selzero_plugin import SelectedZero2, SelZeroConfig

from .models import ToyMoE, loss_fn, make_batch
from .parity import routes_for


def _train(use_selzero: bool, steps: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyMoE()
    if use_selzero:
        sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"]), torch.optim.AdamW,
                           {"lr": 1e-2, "weight_decay": 0.1})
        ids = {id(e.param) for e in sz.entries}
        host = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids],
                                 lr=1e-2, weight_decay=0.1)
    else:
        host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        loss_fn(model, *make_batch(step, 0), routes_for(step, 0, 6, 4)).backward()
        host.step()
        if use_selzero:
            result = sz.step()
            assert result.global_weight == 1
        host.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_without_a_process_group_selzero_equals_plain_torch_optim():
    assert not dist.is_initialized()
    ours, ref = _train(True), _train(False)
    start = ToyMoE()  # moved at all?
    assert any(not torch.equal(ref[k], v) for k, v in start.state_dict().items() if "experts.0" in k)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


def test_without_a_process_group_checkpoints_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ToyMoE()
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"]), torch.optim.SGD,
                       {"lr": 0.1, "momentum": 0.9})
    loss_fn(model, *make_batch(0, 0), routes_for(0, 0, 6, 4)).backward()
    sz.step()
    sz.save_checkpoint(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = ToyMoE()
    sz2 = SelectedZero2(fresh, SelZeroConfig(params=["experts.*"]), torch.optim.SGD,
                        {"lr": 0.1, "momentum": 0.9})
    sz2.load_checkpoint(tmp_path / "ckpt")
    for k, v in fresh.state_dict().items():
        if k.startswith("experts."):
            assert torch.equal(v, saved[k]), k


def _outside_the_group(rank: int, world: int) -> str | None:
    group = dist.new_group([0])  # every rank creates it; only rank 0 is a member
    if rank == 0:
        return None
    try:
        SelectedZero2(ToyMoE(), SelZeroConfig(params=["experts.*"]), group=group)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_cannot_build_on_a_rank_outside_the_group():
    from .dist_utils import all_values, run_ranks

    values = all_values(run_ranks(_outside_the_group, 2, timeout=60))
    assert values[0] is None
    assert values[1].startswith("UsageError") and "not a member" in values[1], values[1]
