"""Exit codes under stress: the README's plain-DDP example under ``torchrun --nproc-per-node 2``,
``--parallel`` launches at a time for ``--rounds`` rounds; counts the launches that did not exit
0 and those that printed gloo's ``terminate called without an active exception`` (SIGABRT at
interpreter shutdown, issue 20 item 1). A launch that fails to start (a port already taken) is
counted apart.

    .venv/bin/python benchmarks/exit_stress.py --rounds 30 --parallel 4 [--variant V]

Variants: ``leave_now`` (the README as written), ``destroy`` (the same program ending with
``dist.destroy_process_group()``), ``destroy-nograce`` (the same without selzero's 0.2 s pause at
interpreter exit: the pause's control), ``ddp-destroy`` (plain DDP over the whole model, no
selzero, ending with ``destroy_process_group()``: the baseline).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selzero_plugin.ports import free_port as _free_port  # noqa: E402


def _plain_ddp(example: str) -> str:
    lines = example.replace("leave_now()", "dist.destroy_process_group()").splitlines()
    out = []
    for line in lines:
        if line.startswith("sz = SelectedZero2"):
            continue
        if line.startswith("ddp = wrap_ddp"):
            line = ("ddp = torch.nn.parallel.DistributedDataParallel(model, "
                    "find_unused_parameters=True)")
        if "result = sz.step()" in line:
            continue
        out.append(line.replace("{result.updated}", "all"))
    return "\n".join(out) + "\n"


def _destroy(example: str) -> str:
    # the line that was leave_now() (selzero's end of a gloo program): the plain torch ending
    return example.replace("leave_now()", "dist.destroy_process_group()")


def _destroy_no_grace(example: str) -> str:
    # the same without selzero's pause at exit ([Note: gloo teardown]): the pause's control
    return "import selzero_plugin.core.comm as _comm\n_comm.EXIT_GRACE_S = 0\n" + \
        _destroy(example)


VARIANTS = {"leave_now": lambda example: example, "destroy": _destroy,
            "destroy-nograce": _destroy_no_grace, "ddp-destroy": _plain_ddp}


def main() -> int:
    from tests.test_exit_codes import _readme_example

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--variant", default="leave_now", choices=list(VARIANTS))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="selzero-exit-"))
    script = work / "readme_example.py"
    script.write_text(VARIANTS[args.variant](_readme_example()))
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    total = bad = aborts = unstarted = 0
    for _ in range(args.rounds):
        procs = [subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "--master-port",
                                   str(_free_port()), str(script)], cwd=work, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(args.parallel)]
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            total += 1
            if "EADDRINUSE" in out:
                unstarted += 1
                continue
            bad += proc.returncode != 0
            aborts += "terminate called" in out
    started = total - unstarted
    print(f"{args.variant}: launches {total} (started {started}): not exit 0 {bad}, aborted {aborts}; "
          f"ratio {bad / max(started, 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
