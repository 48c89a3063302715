"""Reliability 1: ranks that disagree ([Note: communicators], core/contract.py).

A grid, not three hand-picked cases: every kind of disagreement (selection by globs or by module
class, a parameter's shape, dtype or frozen flag, a tie inside the selection, a tie crossing it,
the optimizer class, each hyperparameter, param groups, every contract field of the config, an
unknown hyperparameter on one rank, the world size of a loaded checkpoint, the membership of the
group itself) is applied on every pattern of deviating ranks at world 2 and 3 (rank 0 among them
or not, one rank or two), and pairs of different disagreements on two ranks. Every rank must
raise the same error (class and message, the ``[rank r/N]`` prefix aside) naming the first
group rank that differs from rank 0 (or, for a check that fails locally, the first rank that
failed) and the field, well within ``timeout_s``.

Group membership is the one case ranks cannot agree on through a collective: a rank that passes
a group the others did not build (``group=`` bound to the wrong variable) waits for them while
creating its communicator and raises ``CollectiveError`` naming the ranks within ``timeout_s``;
the others never hear of it (their own instance is consistent) and go on.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.checkpoint.tools import reshard

from .._state import capture, strip_rank_prefix
from ..dist_utils import all_values, run_ranks
from ..models import ToyMoE

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

E = 4
TIMEOUT_S = 8.0
CONTRACT = "ContractError"

# kind -> (argument choices, error class, needle builder); a needle names the field that differs
DEVIATIONS: dict[str, tuple[list[Any], str, Any]] = {
    "params": ([["experts.0.*", "experts.1.*"], ["experts.*.w1.*"]], CONTRACT,
               lambda a: ["'config.params'"]),
    "modules": ([["Expert"]], CONTRACT, lambda a: ["'config.modules'"]),
    "shape": ([14, 12], CONTRACT, lambda a: ['.shape (parameter "experts.0.w1.weight")',
                                            f"[{a}, 7]"]),
    "dtype": ([1, 3], CONTRACT, lambda a: [f'.dtype (parameter "experts.{a}.gain")',
                                           "torch.bfloat16"]),
    "frozen": ([(2, "gain"), (0, "w2.bias")], CONTRACT,
               lambda a: [f'.frozen (parameter "experts.{a[0]}.{a[1]}")']),
    "tie": ([(0, 2), (1, 3)], CONTRACT,
            lambda a: [f'.aliases (parameter "experts.{a[0]}.w2.bias")',
                       f"experts.{a[1]}.w2.bias"]),
    "optimizer_class": (["SGD", "Adam", "RAdam"], CONTRACT,
                        lambda a: ["'optimizer.class'", f".{a}"]),
    "hyper": ([("lr", 2e-3), ("weight_decay", 0.5), ("eps", 1e-6), ("betas", (0.8, 0.99)),
               ("amsgrad", True)], CONTRACT,
              lambda a: [f"hyperparameters.{a[0]}"]),
    "param_groups": ([[{"params": ["*.bias"], "weight_decay": 0.0}],
                      [{"params": ["*.bias"], "optimizer": "torch.optim.SGD", "lr": 0.1}]],
                     CONTRACT,
                     lambda a: ["'config.param_groups'"]),
    "config": ([("reduction", "weighted"), ("reduction", "sum"), ("bucket_mb", 1.0),
                ("normalize_over", "world"), ("missing_grad", "skip"), ("nonfinite", "skip"),
                ("expert_dim", 0), ("overlap", False), ("launch_modules", ["experts.*"]),
                ("name", "other"), ("partition", "tensors")], CONTRACT,
               lambda a: [f"'config.{a[0]}'"]),
    # local failures: the rank that fails tells every rank why
    "crossing_tie": ([2], "SelectionError", lambda a: ["inp.bias", f"experts.{a}.w2.bias"]),
    "unknown_hyper": (["weight_decey"], "ConfigError", lambda a: [a]),
}
LOCAL = {"crossing_tie", "unknown_hyper"}


def _instances() -> list[tuple[str, Any]]:
    return [(kind, arg) for kind, (args, _, _) in DEVIATIONS.items() for arg in args]


def _patterns(world: int) -> list[list[int]]:
    """Every set of deviating ranks but none and all (all deviating alike is no disagreement)."""
    return [[1], [0]] if world == 2 else [[1], [2], [0], [1, 2], [0, 2], [0, 1]]


def _pairs(world: int, rng: random.Random) -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    """Two different disagreements, on ranks 1 and 2 (world 3 only)."""
    if world < 3:
        return []
    contract = [i for i in _instances() if i[0] not in LOCAL]
    return [tuple(rng.sample(contract, 2)) for _ in range(12)]  # type: ignore[misc]


def cases(world: int) -> list[dict[str, Any]]:
    """The grid for ``world``: {"id", "deviations": {rank: (kind, arg)}, "named", "needles",
    "error"}."""
    out = []
    for kind, arg in _instances():
        _, error, needles = DEVIATIONS[kind]
        for ranks in _patterns(world):
            if kind in LOCAL:
                named = min(ranks)
            else:
                named = min(r for r in range(1, world) if (r in ranks) != (0 in ranks))
            out.append({"id": f"w{world}-{kind}-{arg}-ranks{ranks}",
                        "deviations": {r: (kind, arg) for r in ranks}, "named": named,
                        "needles": needles(arg), "error": error})
    for a, b in _pairs(world, random.Random(world)):
        out.append({"id": f"w{world}-pair-{a}-{b}", "deviations": {1: a, 2: b}, "named": 1,
                    "needles": DEVIATIONS[a[0]][2](a[1]), "error": CONTRACT})
    return out


def _build(deviation: tuple[str, Any] | None) -> tuple[ToyMoE, dict[str, Any], type, dict]:
    kind, arg = deviation or (None, None)
    torch.manual_seed(0)
    model = ToyMoE(E, h=arg if kind == "shape" else 13)
    config: dict[str, Any] = {"params": ["experts.*"], "timeout_s": TIMEOUT_S}
    opt: type = torch.optim.AdamW
    kwargs: dict[str, Any] = {"lr": 1e-3}
    if kind in ("params", "modules", "param_groups"):
        config[kind] = arg
    elif kind == "dtype":
        model.experts[arg].to(torch.bfloat16)
    elif kind == "frozen":
        model.experts[arg[0]].get_parameter(arg[1]).requires_grad_(False)
    elif kind == "tie":
        model.experts[arg[1]].w2.bias = model.experts[arg[0]].w2.bias
    elif kind == "crossing_tie":
        model.experts[arg].w2.bias = model.inp.bias
    elif kind == "optimizer_class":
        opt = getattr(torch.optim, arg)
        if arg == "SGD":
            kwargs = {"lr": 1e-3}
    elif kind == "hyper":
        kwargs[arg[0]] = arg[1]
    elif kind == "config":
        config[arg[0]] = arg[1]
    elif kind == "unknown_hyper":
        kwargs[arg] = 0.1
    return model, config, opt, kwargs


def _construct(deviation: tuple[str, Any] | None) -> dict[str, Any]:
    model, config, opt, kwargs = _build(deviation)
    start = time.monotonic()
    got = capture(lambda: SelectedZero2(model, SelZeroConfig(**config), opt, kwargs) and None)
    got["seconds"] = time.monotonic() - start
    got.pop("traceback", None)
    return got


def _checkpoint_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    """All ranks, or one rank, pointed at a checkpoint saved at another world size."""
    folder, other = Path(root) / f"saved-w{world}", Path(root) / f"resharded-w{world}"
    model, config, opt, kwargs = _build(None)
    sz = SelectedZero2(model, SelZeroConfig(**config), opt, kwargs)
    sz.save_checkpoint(folder)
    if rank == 0:
        reshard(folder, world + 1, other)
    sz.comm.all_reduce(torch.zeros(1))  # the resharded copy exists before anyone loads
    out = {}
    for name, deviants in (("all", list(range(world))), ("last", [world - 1])):
        start = time.monotonic()
        got = capture(lambda: sz.load_checkpoint(other if rank in deviants else folder))
        got["seconds"] = time.monotonic() - start
        got.pop("traceback", None)
        out[name] = got
    return out


def _membership(rank: int, world: int) -> dict[str, Any]:
    """World 3: every rank builds both groups; rank 2 passes the wrong one."""
    pair = dist.new_group([0, 1], use_local_synchronization=True) if rank < 2 else None
    everyone = dist.new_group([0, 1, 2])
    model, config, opt, kwargs = _build(None)
    config["timeout_s"] = 3.0
    group = pair if rank < 2 else everyone
    start = time.monotonic()
    got = capture(lambda: SelectedZero2(model, SelZeroConfig(**config), opt, kwargs,
                                        group=group).selected_names)
    got["seconds"] = time.monotonic() - start
    got.pop("traceback", None)
    return got


def grid_run(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {c["id"]: _construct(c["deviations"].get(rank)) for c in cases(world)}
    out["checkpoint"] = _checkpoint_cases(rank, world, root)
    if world == 3:
        out["membership"] = _membership(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def grid(request, tmp_path_factory):
    world = request.param
    root = tmp_path_factory.mktemp(f"disagree-w{world}")
    return world, all_values(run_ranks(grid_run, world, str(root), timeout=240))


def test_every_rank_raises_the_same_error_naming_the_first_differing_rank_and_field(grid):
    world, results = grid
    failures = []
    for case in cases(world):
        got = [results[r][case["id"]] for r in range(world)]
        messages = []
        for r, g in enumerate(got):
            if g.get("error") != case["error"]:
                failures.append(f"{case['id']} rank {r}: expected {case['error']}, got {g}")
                continue
            message = g["message"]
            if g["seconds"] >= TIMEOUT_S:
                failures.append(f"{case['id']} rank {r}: {g['seconds']:.1f} s")
            if not message.startswith(f"[rank {r}/{world}]"):
                failures.append(f"{case['id']} rank {r}: prefix of {message!r}")
            named = (f"failed on group rank {case['named']}" if case["error"] != CONTRACT
                     else f"group rank {case['named']} differs from group rank 0")
            for needle in [named, *case["needles"]]:
                if needle not in message:
                    failures.append(f"{case['id']} rank {r}: {needle!r} not in {message!r}")
            messages.append(strip_rank_prefix(message))
        if len(set(messages)) > 1:
            failures.append(f"{case['id']}: messages differ: {messages}")
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:20])
    assert len(cases(world)) >= (40 if world == 2 else 150)


def test_ranks_pointed_at_a_checkpoint_of_another_world_size_all_raise(grid):
    world, results = grid
    for name in ("all", "last"):
        messages = []
        for r in range(world):
            got = results[r]["checkpoint"][name]
            assert got.get("error") == "CheckpointError", (name, r, got)
            assert "selzero reshard" in got["message"] and got["seconds"] < TIMEOUT_S, got
            assert f"{world + 1}" in got["message"], got
            # each rank names the folder it was given, then the same verdict
            messages.append(got["message"].split(" failed on group rank ", 1)[1])
        assert len(set(messages)) == 1, messages
        if name == "last":
            assert messages[0].startswith(f"{world - 1}:"), messages[0]


def test_a_rank_that_passes_another_group_raises_within_its_timeout(grid):
    world, results = grid
    if world != 3:
        pytest.skip("needs three ranks")
    got = [results[r]["membership"] for r in range(3)]
    assert got[0].get("value") == got[1].get("value") and got[0].get("value"), got
    assert got[2].get("error") == "CollectiveError", got[2]
    assert "over global ranks [0, 1, 2]" in got[2]["message"], got[2]
    assert got[2]["seconds"] < 3.0 + 3.0, got[2]
