"""partition="tensors" in one process: what is admitted and refused (and how the refusals
read), param groups with an optimizer class of their own, the schedule factor, the combined
optimizer (state dict, LR schedulers), and parity with plain torch Muon / Adafactor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.errors import ConfigError, OptimizerNotSupportedError, UsageError

from .models import ToyMoE, loss_fn, make_batch
from .parity import routes_for

OWN_ADAMW = {"params": ["*.bias", "*.gain"], "optimizer": "torch.optim.AdamW", "lr": 3e-3}


def _model(seed: int = 0) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(4)


def _config(**kw) -> SelZeroConfig:
    return SelZeroConfig.from_dict({"params": ["experts.*"], "partition": "tensors", **kw})


def test_cannot_use_muon_with_chunks_and_the_error_says_partition_tensors():
    with pytest.raises(OptimizerNotSupportedError, match="Set partition='tensors'") as e:
        SelectedZero2(_model(), SelZeroConfig(params=["experts.*"]), torch.optim.Muon)
    assert "torch.optim.Muon" in str(e.value) and "Newton-Schulz" in str(e.value)


def test_cannot_give_muon_a_vector_and_the_error_names_the_parameter_and_the_fix():
    with pytest.raises(ConfigError) as e:
        SelectedZero2(_model(), _config(), torch.optim.Muon, {"lr": 0.02})
    message = str(e.value)
    assert "'experts.0.gain'" in message and "[1]" in message  # the first such parameter
    assert "Muon only supports 2D parameters" in message  # torch's own reason
    assert "'optimizer': 'torch.optim.AdamW'" in message  # the fix


def test_cannot_name_an_unknown_hyperparameter_for_a_group_of_its_own():
    bad = {"params": ["*.bias"], "optimizer": "torch.optim.AdamW", "momentum": 0.9}
    with pytest.raises(ConfigError, match=r"AdamW has no hyperparameter 'momentum'"):
        SelectedZero2(_model(), _config(param_groups=[bad]), torch.optim.Muon)


def test_cannot_name_a_group_optimizer_that_does_not_import():
    bad = {"params": ["*.bias"], "optimizer": "nowhere.Nothing"}
    with pytest.raises(ConfigError, match="cannot import"):
        SelectedZero2(_model(), _config(param_groups=[bad]), torch.optim.Muon)


def test_cannot_configure_an_unknown_partition_or_a_non_string_group_optimizer():
    with pytest.raises(ConfigError, match="partition='rows'.*'chunks', 'tensors'"):
        SelZeroConfig(params=["*"], partition="rows")
    with pytest.raises(ConfigError, match=r"param_groups\[0\].optimizer=3"):
        SelZeroConfig(params=["*"], param_groups=[{"params": ["*"], "optimizer": 3}])
    env = {"SELZERO_PARAMS": '["*"]', "SELZERO_PARTITION": "tensors",
           "SELZERO_EXTRA_MATRIX_OPTIMIZERS": '["a.B"]'}
    config = SelZeroConfig.from_env(env)
    assert config.partition == "tensors" and config.extra_matrix_optimizers == ["a.B"]


class Orthogonal(torch.optim.Optimizer):
    """A third-party matrix-wise optimizer: each update is the gradient's polar factor."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    u, _, vh = torch.linalg.svd(p.grad.reshape(p.shape[0], -1),
                                                full_matrices=False)
                    p.add_((u @ vh).view_as(p), alpha=-group["lr"])


def test_extra_matrix_optimizers_admit_a_third_party_class_under_tensors_only():
    name = f"{__name__}.Orthogonal"
    with pytest.raises(OptimizerNotSupportedError, match="extra_matrix_optimizers"):
        SelectedZero2(_model(), _config(), Orthogonal)  # not listed
    with pytest.raises(OptimizerNotSupportedError, match="partition='tensors'"):
        SelectedZero2(_model(), SelZeroConfig(params=["experts.*"],
                                              extra_matrix_optimizers=[name]), Orthogonal)
    model, ref = _model(), _model()
    sz = SelectedZero2(model, _config(extra_matrix_optimizers=[name]), Orthogonal)
    experts = [p for n, p in ref.named_parameters() if n.startswith("experts.")]
    opt = Orthogonal(experts)
    _train_both(model, sz, ref, [opt])
    _assert_experts_equal(model, ref)


def _train_both(model, sz, ref, opts, steps: int = 5, lr=None):
    for s in range(steps):
        x, y = make_batch(s, 0)
        r = routes_for(s, 0, 6, 4)
        loss_fn(model, x, y, r).backward()
        sz.step(lr=None if lr is None else lr(s))
        for p in model.parameters():
            p.grad = None
        loss_fn(ref, x, y, r).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


def _assert_experts_equal(model, ref):
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        if n.startswith("experts."):
            assert torch.equal(a, b), (n, (a - b).abs().max().item())


def test_muon_with_adamw_for_the_vectors_is_bit_identical_to_torch_in_one_process():
    model, ref = _model(), _model()
    sz = SelectedZero2(model, _config(param_groups=[OWN_ADAMW]), torch.optim.Muon,
                       {"lr": 0.02, "weight_decay": 0.1})
    named = [(n, p) for n, p in ref.named_parameters() if n.startswith("experts.")]
    muon = torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW([p for _, p in named if p.ndim != 2], lr=3e-3)
    _train_both(model, sz, ref, [muon, adamw])
    _assert_experts_equal(model, ref)
    # the segments of whole-tensor ownership are the tensors in their own shapes
    assert sorted({tuple(s.shape) for s in sz.segments}) == [(1,), (7,), (7, 13), (13,), (13, 7)]


def test_adafactor_is_bit_identical_to_torch_in_one_process():
    model, ref = _model(), _model()
    sz = SelectedZero2(model, _config(), torch.optim.Adafactor, {"lr": 1e-2})
    opt = torch.optim.Adafactor([p for n, p in ref.named_parameters()
                                 if n.startswith("experts.")], lr=1e-2)
    _train_both(model, sz, ref, [opt])
    _assert_experts_equal(model, ref)
    stepped = [sz.optimizer.state[s] for s in sz.segments
               if tuple(s.shape) == (13, 7) and s in sz.optimizer.state]
    assert stepped and all(st["row_var"].shape == (13, 1) and st["col_var"].shape == (1, 7)
                           for st in stepped)


def test_a_group_of_its_own_takes_its_own_hyperparameters_and_the_class_defaults():
    sz = SelectedZero2(_model(), _config(param_groups=[OWN_ADAMW]), torch.optim.Muon,
                       {"lr": 0.02, "weight_decay": 0.2, "eps": 1e-5})
    main, own = sz.optimizer.param_groups
    assert main["weight_decay"] == 0.2 and main["eps"] == 1e-5
    assert own["lr"] == 3e-3 and own["weight_decay"] == 0.01 and own["eps"] == 1e-8  # AdamW's
    assert type(sz.optimizer).__name__ == "MultiOptimizer"
    assert [type(o).__name__ for o in sz.optimizer.optimizers] == ["Muon", "AdamW"]


def test_step_lr_sets_the_main_groups_and_scales_groups_of_their_own_by_the_same_factor():
    model, ref = _model(), _model()
    sz = SelectedZero2(model, _config(param_groups=[OWN_ADAMW]), torch.optim.Muon,
                       {"lr": 0.02})
    named = [(n, p) for n, p in ref.named_parameters() if n.startswith("experts.")]
    muon = torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for _, p in named if p.ndim != 2], lr=3e-3)
    factors = [1.0, 0.5, 0.25, 0.5, 0.1]

    def lr(s):
        for o, base in ((muon, 0.02), (adamw, 3e-3)):
            o.param_groups[0]["lr"] = base * factors[s]
        return 0.02 * factors[s]

    _train_both(model, sz, ref, [muon, adamw], lr=lr)
    _assert_experts_equal(model, ref)
    assert sz.optimizer.param_groups[1]["lr"] == pytest.approx(3e-3 * 0.1)


def test_a_host_instance_may_sit_beside_groups_of_their_own_only():
    model = _model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mats = {"params": ["*.w1.weight", "*.w2.weight"], "optimizer": "torch.optim.Muon",
            "lr": 0.02}
    sz = SelectedZero2(model, _config(param_groups=[mats]), host)
    classes = [type(o).__name__ for o in sz.optimizer.optimizers]
    assert classes == ["AdamW", "Muon"]
    # the host's lr schedule drives the Muon group by the same factor
    sched = torch.optim.lr_scheduler.LambdaLR(host, lambda s: 0.5 ** s)
    x, y = make_batch(0, 0)
    loss_fn(model, x, y, routes_for(0, 0, 6, 4)).backward()
    host.step()
    sched.step()
    sz.step()
    assert sz.optimizer.param_groups[-1]["lr"] == pytest.approx(0.02 * 0.5)
    sz.remove_hooks()
    with pytest.raises(UsageError, match="name an optimizer class of their own"):
        SelectedZero2(_model(), _config(param_groups=[{"params": ["*.bias"], "lr": 1.0}]),
                      torch.optim.AdamW(_model().parameters()))


def test_the_combined_optimizer_round_trips_its_state_dict_and_takes_an_lr_scheduler():
    model = _model()
    sz = SelectedZero2(model, _config(param_groups=[OWN_ADAMW]), torch.optim.Muon,
                       {"lr": 0.02})
    sched = torch.optim.lr_scheduler.LambdaLR(sz.optimizer, lambda s: 1.0 / (1 + s))
    for s in range(2):
        x, y = make_batch(s, 0)
        loss_fn(model, x, y, routes_for(s, 0, 6, 4)).backward()
        sz.step()
        sched.step()
    assert sz.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 / 3)
    assert sz.optimizer.param_groups[1]["lr"] == pytest.approx(3e-3 / 3)
    saved = copy.deepcopy(sz.optimizer.state_dict())
    assert {k for st in saved["state"].values() for k in st} == \
        {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    for st in sz.optimizer.state.values():
        for v in st.values():
            v.zero_() if v.dim() else None
    sz.optimizer.load_state_dict(saved)
    again = sz.optimizer.state_dict()
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(again["state"][i][k], v)
    # the shared group dicts follow the loaded optimizers
    sz.optimizer.param_groups[1]["lr"] = 1.0
    assert sz.optimizer.optimizers[1].param_groups[0]["lr"] == 1.0
    assert len(sz.optimizer.state) == len(saved["state"])
    sz.optimizer.state.clear()
    assert len(sz.optimizer.state) == 0


def test_memory_report_counts_whole_tensors_once():
    model = _model()
    sz = SelectedZero2(model, _config(param_groups=[OWN_ADAMW]), torch.optim.Muon)
    for s in range(2):
        x, y = make_batch(s, 0)
        loss_fn(model, x, y, routes_for(s, 0, 6, 4, "same")).backward()
        sz.step()
    report = sz.memory_report()
    numel = sum(p.numel() for n, p in model.named_parameters() if n.startswith("experts."))
    vectors = sum(p.numel() for n, p in model.named_parameters()
                  if n.startswith("experts.") and p.ndim == 1)
    assert report.grad_shard == numel * 4
    # Muon: one momentum per matrix element; AdamW: two moments per vector element + steps
    assert report.optimizer_state == (numel - vectors) * 4 + vectors * 8 + 4 * 4 * 3
    assert report.total == report.ideal_total


def test_a_group_of_its_own_without_an_lr_keeps_its_class_default_under_step_lr():
    own = {"params": ["*.bias", "*.gain"], "optimizer": "torch.optim.AdamW"}  # lr: AdamW's 1e-3
    sz = SelectedZero2(_model(), _config(param_groups=[own]), torch.optim.Muon, {"lr": 0.02})
    assert sz.optimizer.param_groups[1]["lr"] == 1e-3
    sz.segment_optimizer.prepare(0.01)  # what step(lr=0.01) does first: half the main lr
    assert sz.optimizer.param_groups[0]["lr"] == 0.01
    assert sz.optimizer.param_groups[1]["lr"] == pytest.approx(5e-4)


class _OneExpert(nn.Module):
    """A fused experts module holding one (local) expert, as under expert parallelism with as
    many ranks as experts (review finding: its segment kept the (1, a, b) shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 1
        self.expert_offset = 3
        self.w = nn.Parameter(torch.randn(1, 6, 5) * 0.3)

    def forward(self, x: torch.Tensor, routed: bool) -> torch.Tensor:
        return x @ self.w[0] * (1.0 if routed else 0.0)  # no token: zero rows


class _OneExpertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = _OneExpert()

    def forward(self, x: torch.Tensor, routed: bool = True) -> torch.Tensor:
        return self.experts(x, routed)


def test_a_fused_tensor_of_one_expert_is_that_expert_whole(tmp_path):
    model = _OneExpertModel()
    sz = SelectedZero2(model, _config(params=["experts.*"], expert_dim=0), torch.optim.Muon,
                       {"lr": 0.02})
    assert [tuple(s.shape) for s in sz.segments] == [(6, 5)]
    assert sz.virtual_name(0) == "experts.w[expert 0]"
    ref = model.experts.w.detach()[0].clone().requires_grad_()
    muon = torch.optim.Muon([ref], lr=0.02)
    x = torch.randn(4, 6)
    model(x).pow(2).sum().backward()
    sz.step()
    (x @ ref).pow(2).sum().backward()
    muon.step()
    assert torch.equal(model.experts.w[0], ref)
    before = model.experts.w.detach().clone()
    model(x, routed=False).sum().backward()  # a zero gradient: the expert got no token
    result = sz.step()
    assert result.skipped_absent == 1 and torch.equal(model.experts.w, before)
    sz.save_checkpoint(tmp_path / "one")
    manifest = (tmp_path / "one" / "manifest.json").read_text()
    assert '"key": "experts.w[expert 3]"' in manifest  # keyed by its global expert


def test_beside_a_host_a_group_naming_the_hosts_class_is_still_a_group_of_its_own():
    """Review finding: it took the host's defaults (weight decay 0.3) and ignored the host's
    schedule; it takes its class's defaults and follows the schedule factor like any other."""
    model = _model()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.3)
    own = {"params": ["*.bias"], "optimizer": "torch.optim.AdamW", "lr": 1e-2}
    sz = SelectedZero2(model, _config(param_groups=[own]), host)
    assert sz.optimizer.param_groups[-1]["weight_decay"] == 0.01  # AdamW's default
    sched = torch.optim.lr_scheduler.LambdaLR(host, lambda s: 0.0)  # every lr 0 from the start
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for s in range(2):
        x, y = make_batch(s, 0)
        loss_fn(model, x, y, routes_for(s, 0, 6, 4, "same")).backward()
        host.step()
        sz.step()
        host.zero_grad()
        sched.step()
    for n, p in model.named_parameters():
        if n.startswith("experts."):
            assert torch.equal(p, before[n]), n


class Preconditioned(torch.optim.Optimizer):
    """Shampoo-like: full-matrix statistics L (m, m) and R (n, n) per matrix."""

    def __init__(self, params, lr: float = 1e-2, flat: bool = False) -> None:
        super().__init__(params, {"lr": lr, "flat": flat})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad.reshape(p.shape[0], -1), self.state[p]
                if not st:
                    st["L"] = torch.eye(g.shape[0]) * 1e-3
                    st["R"] = torch.eye(g.shape[1]) * 1e-3
                    if group["flat"]:  # a state no per-dim rule describes
                        st["flat"] = torch.zeros(p.numel() + 1)
                st["L"].add_(g @ g.T)
                st["R"].add_(g.T @ g)
                p.add_(torch.linalg.solve(st["L"], g).view_as(p), alpha=-group["lr"])


def test_matrix_state_of_other_shapes_round_trips_through_a_checkpoint(tmp_path):
    name = f"{__name__}.Preconditioned"
    weights = {"params": ["experts.*.weight"], "partition": "tensors",
               "extra_matrix_optimizers": [name]}
    model = _model()
    sz = SelectedZero2(model, SelZeroConfig.from_dict(weights), Preconditioned)
    x, y = make_batch(0, 0)
    loss_fn(model, x, y, routes_for(0, 0, 6, 4)).backward()
    sz.step()
    sz.save_checkpoint(tmp_path / "p")
    fresh_model = _model(1)
    fresh = SelectedZero2(fresh_model, SelZeroConfig.from_dict(weights), Preconditioned)
    fresh.load_checkpoint(tmp_path / "p")

    def states(s):
        return {s.virtual_name(slot.virtual): s.optimizer.state[seg]
                for slot, seg in zip(s.slots, s.segments) if seg in s.optimizer.state}

    before, after = states(sz), states(fresh)
    assert before.keys() == after.keys() and before
    for name, st in before.items():
        assert st["L"].shape[0] == st["L"].shape[1] != st["R"].shape[0]
        assert torch.equal(after[name]["L"], st["L"]) and torch.equal(after[name]["R"], st["R"])
    for (n, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters()):
        if n.startswith("experts.") and n.endswith(".weight"):
            assert torch.equal(a, b), n
    with pytest.raises(OptimizerNotSupportedError, match="'flat'.*cannot save it"):
        SelectedZero2(_model(), SelZeroConfig.from_dict(weights), Preconditioned, {"flat": True})


def test_beside_deepspeed_the_callback_and_the_entry_must_agree_on_every_field():
    """Review finding: only the selection was compared, so an entry without the callback's
    partition and Muon param group trained the experts with AdamW on chunks, silently."""
    from types import SimpleNamespace

    pytest.importorskip("deepspeed")
    from selzero_plugin.trainer import SelectedZero2Callback

    mine = {"params": ["*.experts.*"], "partition": "tensors",
            "param_groups": [{"params": ["*"], "optimizer": "torch.optim.Muon", "lr": 0.02}]}

    def trainer(entry):
        ds = {"selected_zero2": entry} if entry is not None else {}
        plugin = SimpleNamespace(deepspeed_config=ds)
        return SimpleNamespace(accelerator=SimpleNamespace(
            state=SimpleNamespace(deepspeed_plugin=plugin), prepare=lambda *a, **k: a)), ds

    callback = SelectedZero2Callback(mine)
    with pytest.raises(ConfigError, match="partition.*param_groups"):
        callback._via_deepspeed(trainer({"params": ["*.experts.*"]})[0])
    callback._via_deepspeed(trainer({**mine, "group": "world"})[0])  # the same: fine
    t, ds = trainer(None)
    callback._via_deepspeed(t)  # no entry: the callback's config becomes it
    assert ds["selected_zero2"]["partition"] == "tensors"


@pytest.mark.parametrize("partition", ["chunks", "tensors"])
def test_a_scheduler_on_sz_optimizer_resumes_where_it_was(tmp_path, partition):
    """Review finding: the load kept this run's lr, so a chainable scheduler (ExponentialLR)
    resumed with its own load_state_dict went on from the starting lr. A group a scheduler
    drives through sz.optimizer takes the saved lr, as torch's optimizer.load_state_dict does."""
    config = SelZeroConfig(params=["experts.*"], partition=partition)

    def build(seed):
        model = _model(seed)
        sz = SelectedZero2(model, config, torch.optim.AdamW, {"lr": 1e-2})
        return model, sz, torch.optim.lr_scheduler.ExponentialLR(sz.optimizer, gamma=0.5)

    def train(model, sz, sched, steps):
        for s in steps:
            x, y = make_batch(s, 0)
            loss_fn(model, x, y, routes_for(s, 0, 6, 4, "same")).backward()
            sz.step()
            sched.step()

    model, sz, sched = build(0)
    train(model, sz, sched, range(3))
    sz.save_checkpoint(tmp_path / "c")
    saved_sched = sched.state_dict()
    train(model, sz, sched, range(3, 6))
    model2, sz2, sched2 = build(0)  # the same host parameters (no host optimizer here)
    sz2.load_checkpoint(tmp_path / "c")
    sched2.load_state_dict(saved_sched)
    assert sz2.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    train(model2, sz2, sched2, range(3, 6))
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        if n.startswith("experts."):
            assert torch.equal(a, b), n


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))


def _lr_by_parameter(sz) -> dict[str, float]:
    group_of = {id(p): g["lr"] for g in sz.optimizer.param_groups for p in g["params"]}
    return {sz.trainable[sz.layout.virtuals[slot.virtual].entry].name: group_of[id(seg)]
            for slot, seg in zip(sz.slots, sz.segments)}


def test_the_saved_lr_follows_each_parameter_to_its_group_not_the_groups_position(tmp_path):
    """Review finding: restored by position, a loading run that numbers its groups otherwise
    gave a parameter another group's saved lr (100x too large here)."""
    m = _two_linears()
    sz = SelectedZero2(m, SelZeroConfig(params=["*"], param_groups=[
        {"params": ["1.weight"], "lr": 1e-1}]), torch.optim.AdamW, {"lr": 1e-3})
    sched = torch.optim.lr_scheduler.ExponentialLR(sz.optimizer, gamma=0.5)
    for _ in range(2):
        m(torch.ones(2, 4)).sum().backward()
        sz.step()
        sched.step()
    saved = _lr_by_parameter(sz)
    sz.save_checkpoint(tmp_path / "c")
    state = sched.state_dict()
    m2 = _two_linears()
    sz2 = SelectedZero2(m2, SelZeroConfig(params=["*"], param_groups=[
        {"params": ["0.weight"], "lr": 1e-3}, {"params": ["1.weight"], "lr": 1e-1}]),
        torch.optim.AdamW, {"lr": 1e-3})
    sched2 = torch.optim.lr_scheduler.ExponentialLR(sz2.optimizer, gamma=0.5)
    sz2.load_checkpoint(tmp_path / "c")
    sched2.load_state_dict(state)
    assert _lr_by_parameter(sz2) == saved == {"0.weight": 1e-3 / 4, "1.weight": 1e-1 / 4}


def test_a_scheduler_built_after_the_load_resumes_where_it_was(tmp_path):
    """Review finding: torch's other resume order (load, then build the scheduler with
    last_epoch=k) raised KeyError 'initial_lr' on sz.optimizer; the load restores
    initial_lr with the lr, as optimizer.load_state_dict does."""
    def build():
        m = _two_linears()
        return m, SelectedZero2(m, SelZeroConfig(params=["*"]), torch.optim.AdamW, {"lr": 1e-2})

    m, sz = build()
    sched = torch.optim.lr_scheduler.ExponentialLR(sz.optimizer, gamma=0.5)
    for _ in range(3):
        m(torch.ones(2, 4)).sum().backward()
        sz.step()
        sched.step()
    sz.save_checkpoint(tmp_path / "c")
    m2, sz2 = build()
    sz2.load_checkpoint(tmp_path / "c")
    assert sz2.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    sched2 = torch.optim.lr_scheduler.ExponentialLR(sz2.optimizer, gamma=0.5, last_epoch=2)
    for model, opt, scheduler in ((m, sz, sched), (m2, sz2, sched2)):  # one more step each
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        scheduler.step()
    assert sz2.optimizer.param_groups[0]["lr"] == pytest.approx(
        sz.optimizer.param_groups[0]["lr"])
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
