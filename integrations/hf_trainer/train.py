"""A plain HF Trainer run on a tiny MoE built from a config; ``--selzero CONFIG`` adds one line,
``callbacks=[SelectedZero2Callback(CONFIG)]``, and the experts go to selzero.

    torchrun --nproc_per_node 2 integrations/hf_trainer/train.py --out with.safetensors \
        --selzero configs/selzero.yaml
    torchrun --nproc_per_node 2 integrations/hf_trainer/train.py --out without.safetensors

(On a machine without GPUs add ``ACCELERATE_USE_CPU=1``; the script sets ``use_cpu`` when no
GPU is present.) The model is a transformers Qwen3-MoE (``--model qwen3``) or Mixtral
(``--model mixtral``) from a config, no download, with fused experts (``expert_dim: 0`` treats
each expert as its own parameter). Each rank reads different sequences, so ranks route to
different experts. Gradient accumulation 2, clipping, a linear lr schedule with warmup, weight
decay on the experts, checkpoints with ``--save-steps``, ``--resume`` to resume.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 96
SEQ = 6
EXPERTS = 8
SAMPLES = 48


def build_model(kind: str = "qwen3", seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "qwen3":
        config = Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=8,
                                num_experts=EXPERTS, decoder_sparse_step=1, norm_topk_prob=True,
                                **common)
    elif kind == "mixtral":
        config = MixtralConfig(intermediate_size=8, num_local_experts=EXPERTS, **common)
    else:
        raise SystemExit(f"--model {kind!r}: expected qwen3 or mixtral")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the same for every run with the same seed)."""

    def __init__(self, n: int = SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(1000 + seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(output_dir: str, *, steps: int, accumulate: int = 2, clip: float = 0.05,
                  save_steps: int | None = None, save_total_limit: int | None = None,
                  seed: int = 0, **extra: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, learning_rate=1e-2, weight_decay=0.1,
        warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=clip, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        save_total_limit=save_total_limit, report_to="none", seed=seed, data_seed=seed,
        dataloader_num_workers=0, disable_tqdm=True,
        **{"use_cpu": not torch.cuda.is_available(), "ddp_find_unused_parameters": False, **extra})


def build_trainer(kind: str, output_dir: str, selzero: Any = None, *, steps: int = 6,
                  seed: int = 0, routing: list | None = None, weights_from: str | None = None,
                  train_dataset: Any = None, **args_kwargs: Any) -> Any:
    """A Trainer on a fresh model; ``selzero``: a config for SelectedZero2Callback, the
    callback itself, or None.
    ``routing``, when given, collects per forward of each experts module the experts that got
    no token on this rank. ``weights_from``: a checkpoint folder to build the model from (see
    resume_model)."""
    from transformers import Trainer

    model = build_model(kind, seed) if weights_from is None else resume_model(weights_from)
    if routing is not None:
        for name, module in model.named_modules():
            if type(module).__name__.endswith("Experts"):
                module.register_forward_pre_hook(_absent_recorder(name, routing))
    callbacks = []
    if selzero is not None:
        from selzero_plugin.trainer import SelectedZero2Callback

        callbacks.append(selzero if isinstance(selzero, SelectedZero2Callback)
                         else SelectedZero2Callback(selzero))
    return Trainer(model=model, args=training_args(output_dir, steps=steps, seed=seed,
                                                   **args_kwargs),
                   train_dataset=train_dataset if train_dataset is not None else Tokens(seed=seed),
                   callbacks=callbacks)


def resume_model(checkpoint: str) -> torch.nn.Module:
    """The model of ``checkpoint`` through ``from_pretrained``. transformers 5.24's Trainer
    resume (``_load_from_checkpoint``) loads ``model.safetensors`` with ``load_state_dict``,
    which does not map the per-expert keys ``save_pretrained`` writes back onto the fused
    tensors (it warns "missing keys"): the fused experts, and Mixtral's router, would keep
    the fresh model's values. ``from_pretrained`` converts them."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                dtype=torch.float32)


def _absent_recorder(name: str, routing: list) -> Any:
    def hook(module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            hit = torch.bincount(args[1].reshape(-1), minlength=module.num_experts)
            routing.append((name, [e for e in range(module.num_experts) if hit[e] == 0]))
    return hook


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3", choices=["qwen3", "mixtral"])
    p.add_argument("--selzero", default=None, help="selzero config file (YAML/JSON)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.05)
    p.add_argument("--output-dir", default="hf_trainer_out")
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--resume", default=None,
                   help="a checkpoint-N folder, or 'last' for the newest in --output-dir")
    p.add_argument("--out", default=None, help="safetensors file for the final weights")
    p.add_argument("--log-json", default=None, help="JSON file for trainer.state.log_history")
    args = p.parse_args()
    torch.set_num_threads(1)
    folder = args.resume
    if folder == "last":
        from transformers.trainer_utils import get_last_checkpoint

        folder = get_last_checkpoint(args.output_dir)
    trainer = build_trainer(args.model, args.output_dir, args.selzero, steps=args.steps,
                            accumulate=args.accumulate, clip=args.clip,
                            save_steps=args.save_steps, save_total_limit=args.save_total_limit,
                            weights_from=folder)
    trainer.train(resume_from_checkpoint=folder)
    if trainer.is_world_process_zero():
        sz = getattr(trainer.accelerator, "selzero", None)
        print(f"selzero: {len(sz.trainable_names)} parameters" if sz else "selzero: off",
              flush=True)
        if args.out:
            from safetensors.torch import save_file

            save_file(weights(trainer.model), args.out)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(trainer.state.log_history, f, indent=1)
    finish()


def finish() -> None:
    """End the process: a tiny last all-reduce (not a gloo barrier), then ``leave_now``."""
    if dist.is_initialized():
        done = torch.zeros(1)
        dist.all_reduce(done)
    from selzero_plugin.process_exit import leave_now

    leave_now()  # not destroy_process_group(): it can hang on gloo ([Note: gloo teardown])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from selzero_plugin.process_exit import exit_after

    exit_after(main)  # ends with os._exit: see [Note: gloo teardown] in that module
