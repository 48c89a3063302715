"""HF Trainer runs with and without SelectedZero2Callback, several in one 2-process launch
(suite time): ``torchrun --nproc_per_node 2 tests/_trainer_runs.py OUT MODEL VARIANT...``.

A variant is ``fresh`` (see fresh()), ``ds`` / ``ds-sz0`` (DeepSpeed ZeRO-2 through
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


def config_of(variant: str) -> dict | None:
    if variant in ("plain", "ds"):
        return None
    return {"params": SELECT, "bucket_mb": 0.01,
            **({"expert_dim": 0} if variant.endswith("sz0") else {})}


def run(out: Path, model: str, variant: str) -> None:
    from safetensors.torch import save_file

    work = out / f"{model}-{variant}"
    routing: list = []
    extra = {"deepspeed": dict(DS_CONFIG), "use_cpu": False} if variant.startswith("ds") else {}
    if extra:  # TrainingArguments takes the DeepSpeed path only without use_cpu / the variable
        os.environ.pop("ACCELERATE_USE_CPU", None)
    trainer = hf_train.build_trainer(model, str(work), config_of(variant), steps=6,
                                     save_steps=2, save_total_limit=2, routing=routing, **extra)
    trainer.train()
    full = trainer.state.log_history
    rank = dist.get_rank()
    (out / f"{variant}.routing{rank}.json").write_text(json.dumps(routing))
    if rank == 0:
        save_file(hf_train.weights(trainer.model), str(out / f"{variant}.safetensors"))
    resumed = hf_train.build_trainer(model, str(work), config_of(variant), steps=6,
                                     save_steps=2, save_total_limit=2,
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
    trainer = hf_train.build_trainer(
        model, str(out / "fresh"), SelectedZero2Callback(config_of("sz0"), fresh_start=True),
        steps=6)
    trainer.train(resume_from_checkpoint=str(work / "checkpoint-4"))
    (out / f"fresh{dist.get_rank()}.json").write_text(json.dumps(
        {"error": error, "steps": trainer.state.global_step}))


def main() -> None:
    out, model, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    for variant in variants:
        if variant == "fresh":
            fresh(out, model)
        else:
            run(out, model, variant)
    hf_train.finish()


if __name__ == "__main__":
    main()
