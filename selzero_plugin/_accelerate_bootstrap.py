"""Run an unmodified training script with selzero: ``selzero-accelerate launch`` starts this file
with the script's path first; it routes the script's first ``Accelerator.prepare`` that holds a
model through ``selzero_plugin.accelerate.prepare`` (config from ``SELZERO_CONFIG``), and, when
that call had no optimizer, the next one that has it; then runs the script as ``__main__``."""

from __future__ import annotations

import functools
import os
import runpy
import sys

# run as a file, this folder is sys.path[0]: `import accelerate` would find selzero's own module
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _patch() -> None:
    import torch
    from accelerate import Accelerator
    from torch import nn

    from selzero_plugin import accelerate as sz_accelerate

    original = Accelerator.prepare
    done = {"flag": False}
    inside = {"n": 0}  # Accelerator.prepare calls running (not routed)

    @functools.wraps(original)
    def prepare(self, *objects, **kwargs):
        completes = getattr(self, "_selzero_pending", None) is not None \
            and not getattr(self, "_selzero_preparing", False) \
            and any(isinstance(o, torch.optim.Optimizer) for o in objects)
        if completes:  # the model was prepared alone: its optimizer builds selzero
            Accelerator.prepare = original
            try:
                return sz_accelerate.prepare(self, *objects, **kwargs)
            finally:
                Accelerator.prepare = prepare
        if done["flag"] or getattr(self, "_selzero_preparing", False) \
                or getattr(self, "selzero", None) is not None \
                or not any(isinstance(o, nn.Module) for o in objects):
            inside["n"] += 1  # its own prepare_model/prepare_optimizer calls are not routed
            try:
                return original(self, *objects, **kwargs)
            finally:
                inside["n"] -= 1
        sz_accelerate.refuse_trainer_without_callback()
        done["flag"] = True
        Accelerator.prepare = original  # selzero's prepare calls the real one
        try:
            return sz_accelerate.prepare(self, *objects, **kwargs)
        finally:
            Accelerator.prepare = prepare

    # Accelerate's documented one-object calls: routed like prepare(model) / prepare(optimizer)
    # when the script calls them (not when Accelerate's own prepare does)
    original_model, original_optimizer = Accelerator.prepare_model, Accelerator.prepare_optimizer

    def routed(self) -> bool:
        return not inside["n"] and not getattr(self, "_selzero_preparing", False)

    @functools.wraps(original_model)
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if evaluation_mode or not routed(self) or done["flag"] \
                or getattr(self, "selzero", None) is not None:
            return original_model(self, model, device_placement=device_placement,
                                  evaluation_mode=evaluation_mode)
        return Accelerator.prepare(self, model, device_placement=[device_placement])

    @functools.wraps(original_optimizer)
    def prepare_optimizer(self, optimizer, device_placement=None):
        if routed(self) and getattr(self, "_selzero_pending", None) is not None:
            return Accelerator.prepare(self, optimizer, device_placement=[device_placement])
        return original_optimizer(self, optimizer, device_placement=device_placement)

    Accelerator.prepare_model = prepare_model
    Accelerator.prepare_optimizer = prepare_optimizer

    Accelerator.prepare = prepare


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _patch()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
