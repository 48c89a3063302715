"""The Trainer's and Accelerate's fp16 refusals, in a fresh process (both build Accelerate's
process-wide state with fp16): ``python tests/_fp16_refusals.py`` prints one JSON line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("selzero_hf_train",
                                               ROOT / "integrations" / "hf_trainer" / "train.py")
hf_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_train)
SELECT = {"params": ["*.mlp.experts.*"]}


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is compared
        return f"{type(e).__name__}: {e}"
    return None


def trainer(out: str) -> None:
    from transformers import Trainer

    from selzero_plugin.trainer import SelectedZero2Callback

    Trainer(model=hf_train.build_model("qwen3"),
            args=hf_train.training_args(out, steps=1, fp16=True),
            train_dataset=hf_train.Tokens(), callbacks=[SelectedZero2Callback(SELECT)])


def accelerate() -> None:
    from accelerate import Accelerator

    from selzero_plugin.accelerate import prepare

    model = hf_train.build_model("qwen3")
    prepare(Accelerator(mixed_precision="fp16", cpu=True), model,
            torch.optim.AdamW(model.parameters()), config=SELECT)


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        print(json.dumps({"trainer": _error(lambda: trainer(out)),
                          "accelerate": _error(accelerate)}))
    sys.exit(0)
