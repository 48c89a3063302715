"""Parameters replaced, recast, moved or edited in place after SelectedZero2 was built: every
rank raises the same error naming them (before: the subset silently stopped training, a gather
rounded fp32 parameters to fp16, or a stale master reverted an in-place load)."""

from __future__ import annotations

import pytest
import torch

from selzero_plugin import SelectedZero2, UsageError

from .dist_utils import all_errors, all_values, run_ranks
from .models import ToyMoE, loss_fn, make_batch

SELECT = {"params": ["experts.*"]}


def _built(dtype: torch.dtype = torch.float32) -> tuple[ToyMoE, SelectedZero2]:
    torch.manual_seed(0)
    model = ToyMoE().to(dtype)
    return model, SelectedZero2(model, SELECT, torch.optim.SGD, {"lr": 1e-3})


def _train_step(model: ToyMoE, sz: SelectedZero2, rank: int = 0) -> None:
    x, y = make_batch(0, rank)
    loss_fn(model, x.to(model.inp.weight.dtype), y.to(model.inp.weight.dtype),
            torch.arange(6) % 4).backward()
    sz.step()


def test_load_state_dict_assign_is_refused_and_sync_cannot_follow():
    model, sz = _built()
    _train_step(model, sz)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new Parameter objects
    with pytest.raises(UsageError, match=r"no longer the model's parameter objects.*"
                                         r"experts\.0\.w1\.weight"):
        _train_step(model, sz)
    with pytest.raises(UsageError, match="selzero cannot follow them"):
        sz.sync_from_params()


def test_swap_tensors_is_refused():
    model, sz = _built()
    old = model.experts[0].w1.weight
    torch.utils.swap_tensors(old, torch.nn.Parameter(old.detach().clone()))
    with pytest.raises(UsageError, match="no longer the model's parameter objects"):
        _train_step(model, sz)


def test_a_dtype_cast_is_refused_at_the_step():
    model, sz = _built()
    model.experts[3].half()  # one expert only: a bucket would gather in fp16
    with pytest.raises(UsageError, match=r"changed dtype.*experts\.3\.w1\.weight"):
        x, y = make_batch(0, 0)
        out = model.out(torch.relu(model.inp(x)))  # dense only: experts untouched by autograd
        (out - y).pow(2).mean().backward()
        sz.step()


def test_new_storage_needs_sync_from_params_and_then_trains():
    model, sz = _built()
    w = model.experts[1].w1.weight
    w.data = w.data.clone() + 1.0  # new storage, as a device move does
    with pytest.raises(UsageError, match=r"have new storage.*sync_from_params"):
        _train_step(model, sz)
    sz.sync_from_params()
    before = w.detach().clone()
    _train_step(model, sz)
    assert not torch.equal(before, w.detach())  # trains on the new storage


def test_in_place_load_into_bf16_needs_sync_from_params():
    model, sz = _built(torch.bfloat16)
    _train_step(model, sz)
    with torch.no_grad():
        model.experts[0].w1.weight.fill_(0.5)  # an in-place load: the master is stale
    with pytest.raises(UsageError, match=r"changed in place.*FP32 masters"):
        _train_step(model, sz)
    sz.sync_from_params()
    _train_step(model, sz)
    assert (model.experts[0].w1.weight.float() - 0.5).abs().max() < 1e-2  # not reverted


def test_fp32_in_place_edits_are_fine():
    model, sz = _built()
    with torch.no_grad():
        model.experts[0].w1.weight.fill_(0.5)  # fp32: the parameter is its own master
    _train_step(model, sz)
    assert (model.experts[0].w1.weight - 0.5).abs().max() < 1e-2


def _assign_on_rank_1(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = ToyMoE()
    sz = SelectedZero2(model, SELECT, torch.optim.SGD, {"lr": 1e-3})
    if rank == 1:
        model.experts.load_state_dict(
            {k: v.clone() for k, v in model.experts.state_dict().items()}, assign=True)
    _train_step(model, sz, rank)


def test_a_replacement_on_one_rank_is_raised_on_every_rank():
    outcomes = run_ranks(_assign_on_rank_1, 2, timeout=120)
    errors = all_errors(outcomes, "UsageError")
    assert all("no longer the model's parameter objects" in e for e in errors), errors


def test_a_replaced_module_is_refused():
    import copy

    model, sz = _built()
    model.experts[0] = copy.deepcopy(model.experts[0])  # its parameters are new objects
    with pytest.raises(UsageError, match=r"no longer the model's parameter objects.*experts\.0"):
        _train_step(model, sz)


def _fsdp2_bf16_model(rank: int, world: int) -> tuple[str, bool]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from selzero_plugin.accelerate import prepare

    acc = Accelerator(mixed_precision="bf16")
    acc.state.distributed_type = DistributedType.FSDP  # Accelerate picks FSDP on GPUs only
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    torch.manual_seed(0)
    model = ToyMoE().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = prepare(acc, model, opt, config=SELECT)
    w = model.experts[0].w1.weight
    return str(w.dtype), acc.selzero.master_flat.numel() == 0  # fp32: no separate masters


def test_fsdp2_with_bf16_mixed_precision_upcasts_the_selected_parameters_first():
    """Accelerate's FSDP2 prepare upcasts trainable bf16 parameters to fp32; selzero is built
    after the same upcast of its own (before: refused as "changed dtype" inside prepare)."""
    pytest.importorskip("accelerate")
    (dtype, no_masters), = all_values(run_ranks(_fsdp2_bf16_model, 1, timeout=120))
    assert dtype == "torch.float32" and no_masters


@pytest.mark.parametrize("wrap, where", [("checkpoint_wrapper", "experts"),
                                         ("compile", "experts"),
                                         ("checkpoint_wrapper", "container")])
def test_forwarding_wrappers_added_after_setup_are_not_replacements(wrap, where):
    """An activation-checkpoint wrapper or torch.compile put around modules after selzero was
    built forwards attribute access to the same parameter objects: training goes on, equal to
    the unwrapped model (found by review: a walk over ``_modules`` refused them)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrapped(module):
        if wrap == "compile":
            return torch.compile(module, backend="eager")
        return checkpoint_wrapper(module)

    results = []
    for wrap_it in (False, True):
        model, sz = _built()
        if wrap_it and where == "experts":
            for i in range(len(model.experts)):
                model.experts[i] = wrapped(model.experts[i])
        elif wrap_it:
            model.experts = wrapped(model.experts)
        for _ in range(2):
            _train_step(model, sz)
        results.append([e.param.detach().clone() for e in sz.trainable])
    assert all(torch.equal(a, b) for a, b in zip(*results))
