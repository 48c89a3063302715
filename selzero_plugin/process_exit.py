"""Ending a training process without gloo's teardown abort.

[Note: gloo teardown]
Even after ``dist.destroy_process_group()``, a gloo process sometimes aborts in C++ static
destructors at interpreter exit ("terminate called without an active exception"): measured here
in 1 of 24 runs of a plain 2-rank DDP script with no selzero in it, 0 of 30 when the process
ended with ``os._exit``. selzero's own programs (the demo worker, the integration scripts) end
through ``exit_after`` so their exit code is the program's verdict, not the teardown's.

``destroy_process_group()`` itself can hang on gloo: the main thread, holding the GIL, destroys a
process group (or DDP's reducer, which holds one) and joins its worker threads while one of them
waits for the GIL to release a finished work's tensors. Seen here three times in one day under
load, twice in scripts with no SelectedZero2 at all (stock Accelerate + DDP), once in the demo:
the process stays alive forever after its last collective. So those programs end with
``leave_now()`` right after their last (tiny) collective, while their models are still alive:
nothing is destroyed in-process, ``os._exit`` ends it.

A program that ends with ``destroy_process_group()`` and a normal interpreter exit still races
with gloo: a collective the program waited for last (the README example's
``dist.all_gather(copies, flat)``) is released by gloo's worker thread (``runLoop``) some time
after ``wait()`` returned; its tensors are Python objects, so that release takes the GIL, and
if the interpreter is already finalizing the thread dies in the work's destructor (a core
dump: ``AsyncAllgatherWork::~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit`` -> ``std::terminate``): the release checks that the interpreter is alive, then
asks for the GIL, and finalization can begin in between. selzero cannot hold a work the program
made itself, so in a process that built a communicator over a process group
(``core/comm.py``: ``grace_at_exit``) a hook registered with ``atexit`` when ``core/comm.py`` is
imported (so it runs after every hook registered later, a program's own final collective
included) sleeps ``EXIT_GRACE_S`` at interpreter exit, without the GIL and while the interpreter
is whole: a worker that is about to release a work gets the time to do it. Not in a process
without a process group, nor in a child forked from one (the process id is checked). It is a
time bound, not a guarantee: it narrows the window, and whether it removes the abort at ~1 in 50
launches has not been measured yet (``benchmarks/exit_stress.py --variant destroy`` against
``--variant destroy-nograce``, hundreds of launches each).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from .core.comm import EXIT_GRACE_S

__all__ = ["exit_after", "leave_now", "EXIT_GRACE_S"]


def exit_after(main: Callable[[], int | None]) -> None:
    """Run ``main``, then leave the process with its exit code, skipping C++ teardown."""
    try:
        code = main() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported, then the exit code says it failed
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_now() -> None:
    """End the process now, from the end of a program or a ``finally:`` after its last
    collective: exit code 1 (with the traceback) when an exception is on its way up, else 0.
    Nothing is torn down in-process (see [Note: gloo teardown])."""
    kind, value, tb = sys.exc_info()
    code = 0
    if kind is not None:
        if issubclass(kind, SystemExit):
            code = value.code if isinstance(value.code, int) else (0 if value.code is None else 1)
        else:
            traceback.print_exception(kind, value, tb)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
