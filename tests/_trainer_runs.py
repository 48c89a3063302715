"""HF Trainer runs with and without SelectedZero2Callback, several in one 2-process launch
(suite time): ``torchrun --nproc_per_node 2 tests/_trainer_runs.py OUT MODEL VARIANT...``.

A variant is ``fresh``, ``ds-fresh`` or ``refusals`` (see those functions), ``ds`` /
``ds-sz`` / ``ds-sz0``, ``sz-norms`` (experts and the no-decay norm weights) (DeepSpeed ZeRO-2 through
``TrainingArguments(deepspeed=...)``, without / with the callback), ``plain``, ``sz`` (experts fused, one parameter each) or ``sz0``
(``expert_dim=0``); each trains 6 steps (gradient accumulation 2, clipping) saving every 2
steps with ``save_total_limit=2``, then a fresh Trainer resumes from ``checkpoint-4``. Rank 0
writes ``OUT/<variant>.safetensors`` (weights), ``OUT/<variant>.resumed.safetensors`` and
``OUT/<variant>.json`` (log histories); every rank writes ``OUT/<variant>.routing<rank>.json``
(the experts that got no token on that rank, per forward of each experts module).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("selzero_hf_train",
                                               ROOT / "integrations" / "hf_trainer" / "train.py")
hf_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_train)

SELECT = ["*.mlp.experts.*"]


DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
             "bf16": {"enabled": False}, "steps_per_print": 10 ** 9}


class RankTokens(hf_train.Tokens):
    """Each rank reads other sequences: under DeepSpeed on CPU, Accelerate 1.15 reports one
    process and does not shard the Trainer's data, so ranks would otherwise route alike."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return super().__getitem__((i + 7 * dist.get_rank()) % len(self))


def config_of(variant: str) -> dict | None:
    if variant in ("plain", "ds"):
        return None
    if variant == "sz-norms":  # also the RMSNorm weights, in the Trainer's no-decay group
        return {"params": [*SELECT, "*layernorm.weight"], "bucket_mb": 0.01}
    if variant == "sz0-tensors":  # whole-tensor ownership: each expert whole on one rank
        return {"params": SELECT, "bucket_mb": 0.01, "expert_dim": 0, "partition": "tensors"}
    return {"params": SELECT, "bucket_mb": 0.01,
            **({"expert_dim": 0} if variant.endswith("sz0") else {})}


def run(out: Path, model: str, variant: str) -> None:
    from safetensors.torch import save_file

    work = out / f"{model}-{variant}"
    routing: list = []
    extra = {"deepspeed": dict(DS_CONFIG), "use_cpu": False,
             "train_dataset": RankTokens()} if variant.startswith("ds") else {}
    if extra:  # TrainingArguments takes the DeepSpeed path only without use_cpu / the variable
        os.environ.pop("ACCELERATE_USE_CPU", None)
    # Under DeepSpeed on CPU every rank is "process zero" to Accelerate (see RankTokens), so
    # both ranks would rotate checkpoints at once (one rmtree under the other's glob: seen in
    # CI); the DeepSpeed variants keep every checkpoint instead.
    limit = None if extra else 2
    trainer = hf_train.build_trainer(model, str(work), config_of(variant), steps=6,
                                     save_steps=2, save_total_limit=limit, routing=routing,
                                     **extra)
    trainer.train()
    full = trainer.state.log_history
    rank = dist.get_rank()
    (out / f"{variant}.routing{rank}.json").write_text(json.dumps(routing))
    if rank == 0:
        save_file(hf_train.weights(trainer.model), str(out / f"{variant}.safetensors"))
    resumed = hf_train.build_trainer(model, str(work), config_of(variant), steps=6,
                                     save_steps=2, save_total_limit=limit,
                                     weights_from=str(work / "checkpoint-4"), **extra)
    resumed.train(resume_from_checkpoint=str(work / "checkpoint-4"))
    if rank == 0:
        save_file(hf_train.weights(resumed.model), str(out / f"{variant}.resumed.safetensors"))
        (out / f"{variant}.json").write_text(json.dumps(
            {"full": full, "resumed": resumed.state.log_history, "work": str(work)}))


def fresh(out: Path, model: str) -> None:
    """Resume plain's checkpoint-4 (saved without selzero) with the callback: refused on every
    rank without fresh_start, trained with it."""
    from selzero_plugin.errors import CheckpointError
    from selzero_plugin.trainer import SelectedZero2Callback

    work = out / f"{model}-plain"
    error = None
    trainer = hf_train.build_trainer(model, str(out / "fresh"), config_of("sz0"), steps=6)
    try:
        trainer.train(resume_from_checkpoint=str(work / "checkpoint-4"))
    except CheckpointError as e:
        error = str(e)
    callback = SelectedZero2Callback(config_of("sz0"), fresh_start=True)
    trainer = hf_train.build_trainer(model, str(out / "fresh"), callback, steps=6)
    trainer.train(resume_from_checkpoint=str(work / "checkpoint-4"))
    host = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    stale = sum(e.param in host.state for e in callback.selzero.trainable)
    (out / f"fresh{dist.get_rank()}.json").write_text(json.dumps(
        {"error": error, "steps": trainer.state.global_step, "host_state_on_selected": stale}))


def ds_fresh(out: Path, model: str) -> None:
    """Resume stock DeepSpeed's checkpoint-4 with the callback: refused without fresh_start,
    trained with it (the Trainer's deepspeed_load_checkpoint cannot pass the flag itself)."""
    from selzero_plugin.errors import CheckpointError
    from selzero_plugin.trainer import SelectedZero2Callback

    work = out / f"{model}-ds" / "checkpoint-4"
    extra = {"deepspeed": dict(DS_CONFIG), "use_cpu": False, "train_dataset": RankTokens()}
    error = None
    trainer = hf_train.build_trainer(model, str(out / "ds-fresh"), config_of("sz0"), steps=6,
                                     weights_from=str(work), **extra)
    try:
        trainer.train(resume_from_checkpoint=str(work))
    except CheckpointError as e:
        error = str(e)
    trainer = hf_train.build_trainer(
        model, str(out / "ds-fresh"), SelectedZero2Callback(config_of("sz0"), fresh_start=True),
        steps=6, weights_from=str(work), **extra)
    trainer.train(resume_from_checkpoint=str(work))
    (out / f"ds-fresh{dist.get_rank()}.json").write_text(json.dumps(
        {"error": error, "steps": trainer.state.global_step}))


def refusals(out: Path, model: str) -> None:
    """Setups the callback refuses on every rank: an optimizer without the selected
    parameters, two callbacks, a second model (model_init)."""
    from transformers import Trainer

    from selzero_plugin.errors import SelZeroError
    from selzero_plugin.trainer import SelectedZero2Callback

    seen: dict[str, str | None] = {}

    def attempt(what: str, fn) -> None:
        try:
            fn()
            seen[what] = None
        except SelZeroError as e:
            seen[what] = f"{type(e).__name__}: {e}"

    def without_experts() -> None:
        net = hf_train.build_model(model)
        opt = torch.optim.AdamW([p for n, p in net.named_parameters() if ".experts." not in n])
        Trainer(model=net, args=hf_train.training_args(str(out / "r1"), steps=1),
                train_dataset=hf_train.Tokens(), optimizers=(opt, None),
                callbacks=[SelectedZero2Callback(config_of("sz0"))]).train()

    def two_callbacks() -> None:
        Trainer(model=hf_train.build_model(model),
                args=hf_train.training_args(str(out / "r2"), steps=1),
                train_dataset=hf_train.Tokens(),
                callbacks=[SelectedZero2Callback(config_of("sz0")),
                           SelectedZero2Callback({"params": ["*.gate.*"], "name": "g"})])

    def model_init_twice() -> None:
        trainer = Trainer(model_init=lambda: hf_train.build_model(model),
                          args=hf_train.training_args(str(out / "r3"), steps=1),
                          train_dataset=hf_train.Tokens(),
                          callbacks=[SelectedZero2Callback(config_of("sz0"))])
        trainer.train()
        trainer.train()

    attempt("optimizer without experts", without_experts)
    attempt("two callbacks", two_callbacks)
    attempt("model_init twice", model_init_twice)
    (out / f"refusals{dist.get_rank()}.json").write_text(json.dumps(seen))


def rotation(out: Path, model: str) -> None:
    """``save_total_limit=1``, saving every 2 steps; selzero's write into checkpoint-4 fails
    (a full disk: the same error on every rank). A complete checkpoint must remain."""
    from selzero_plugin.checkpoint import host
    from selzero_plugin.errors import CheckpointError

    original, calls = host.save_into, []

    def failing_second(folder, instances, **kwargs):
        calls.append(str(folder))
        if len(calls) == 2:
            raise CheckpointError(f"{folder}: no space left on device (simulated)")
        return original(folder, instances, **kwargs)

    host.save_into = failing_second
    work = out / "rotation"
    trainer = hf_train.build_trainer(model, str(work), config_of("sz0"), steps=6, save_steps=2,
                                     save_total_limit=1)
    error = None
    try:
        trainer.train()
    except CheckpointError as e:
        error = str(e)
    finally:
        host.save_into = original
    left = sorted(p.name for p in work.glob("checkpoint-*"))
    complete = [name for name in left
                if (work / name / host.FOLDER / "index.json").is_file()]
    (out / f"rotation{dist.get_rank()}.json").write_text(json.dumps(
        {"error": error, "left": left, "complete": complete, "calls": calls}))


def main() -> None:
    out, model, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    special = {"fresh": fresh, "ds-fresh": ds_fresh, "refusals": refusals, "rotation": rotation}
    for variant in variants:
        if variant in special:
            special[variant](out, model)
        else:
            run(out, model, variant)
    hf_train.finish()


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(main)  # ends with os._exit: see [Note: gloo teardown]
