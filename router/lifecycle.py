"""Stopping and inspecting long-running asyncio services (the router and the engine service).

Kept free of torch and gRPC imports: both ``python -m router`` and ``python -m engine_service`` use it.
"""
from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Awaitable


async def bounded(awaitable: Awaitable, stage: str, *, log, prefix: str = "server", timeout_s: float = 5.0) -> None:
    """Await one shutdown stage for at most ``timeout_s``; a stage that fails is logged, not raised.

    Not ``asyncio.wait_for``: on its timeout it cancels the stage and then waits, unbounded, for the
    cancellation to finish, so a stage that does not react to it would hold the stop anyway. Logs
    ``<prefix>.shutdown_stage_timeout`` / ``<prefix>.shutdown_stage_failed`` with the stage's name on
    ``log`` (a structlog logger).
    """
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()  # not awaited, for the reason above
        log.warning(f"{prefix}.shutdown_stage_timeout", stage=stage, timeout_s=timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        log.warning(f"{prefix}.shutdown_stage_failed", stage=stage, error=repr(task.exception()))


def dump_tasks(file=None) -> None:
    """Write every pending asyncio task of the running loop, with the frames it is suspended in.

    The dump is one write, ending in an ``asyncio: end of task dump`` line, so log lines from other
    threads do not land inside it and a reader of the log knows when it is whole.
    """
    file = file or sys.stderr
    tasks = [t for t in asyncio.all_tasks() if not t.done()]
    lines = [f"asyncio: {len(tasks)} pending tasks (most recent call last)"]
    for task in tasks:
        lines.append(f"Task {task.get_name()}: {task.get_coro()!r}")
        # The whole await chain down to the leaf it waits on (Task.get_stack gives only the task's own
        # frame, and print_stack fails on frames without a line number, as gRPC's Cython coroutines have).
        awaited = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    lines.append("asyncio: end of task dump")
    file.write("\n".join(lines) + "\n")
    file.flush()


def install_stack_dumps() -> None:
    """``kill -USR1 <pid>`` writes every thread's stack, then every pending asyncio task's, to stderr,
    and the process goes on: for a service that is stuck, or slow to exit.

    Call from inside the running loop. The thread dump is faulthandler's (it works even when the
    loop is blocked); the task dump runs on the loop, so it shows which await a task waits on (what
    a thread stack parked in ``select`` cannot tell).
    """
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    # After asyncio's handler, and chained to it: faulthandler dumps at once, then asyncio's runs.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
