"""fp16 through the HF Trainer and Accelerate is refused, naming bf16 (their loss scaling is not
tested with selzero; a plain loop's torch.amp.GradScaler is, tests/test_grad_scaler.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("_fp16_refusals.py")


def test_fp16_through_the_trainer_and_accelerate_is_refused_naming_bf16():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["trainer"] and seen["trainer"].startswith("ConfigError: "), seen
    assert "TrainingArguments(fp16=True)" in seen["trainer"] and "bf16=True" in seen["trainer"]
    assert seen["accelerate"] and seen["accelerate"].startswith("ConfigError: "), seen
    assert "fp16" in seen["accelerate"] and "--mixed_precision bf16" in seen["accelerate"]
