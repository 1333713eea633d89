"""`make run`: ``python -m router stack`` end to end, with the bundled model (a redis-server, an
engine and a router, each a process of its own), stopped as a user stops it, by Ctrl-C."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from router.stack import DEMO_CHAT, DEMO_PROMPTS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _as_in_a_terminal() -> None:
    # A command a terminal runs in the foreground gets Ctrl-C's default action, which Python turns
    # into KeyboardInterrupt; a shell running the test suite in the background (`make test &`, or
    # nohup) hands its children SIGINT ignored, and the stack would then never see the Ctrl-C below.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_stack_answers_its_demo_and_stops_everything_on_ctrl_c(bundled_dir, tmp_path):
    """The demo's prompts all come back through the router; a Ctrl-C in the terminal (SIGINT to the
    whole process group) stops the router, the engine and Redis, in that order, with no error logged
    on the way out (an engine that cannot deregister from Redis logs one), and frees their ports."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "router", "stack", "--max-tokens", "4", "--keep-running"],
                                stdout=out, stderr=err, start_new_session=True, preexec_fn=_as_in_a_terminal)
        try:
            deadline = time.monotonic() + 300
            while "serving on" not in out_path.read_text():
                assert proc.poll() is None, f"the stack exited with {proc.returncode}: {err_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "the stack did not serve within 300 s"
                time.sleep(0.5)
            stdout = out_path.read_text()
            ports = [int(p) for p in re.findall(r"^(?:redis-server|engine \(.*\)|router) on 127\.0\.0\.1:(\d+)$", stdout, re.M)]
            assert len(ports) == 3 and all(listening(p) for p in ports), stdout
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    for prompt in DEMO_PROMPTS + [f"[chat] {DEMO_CHAT[0]['content']}"]:
        assert f"--- {prompt!r}\n" in stdout
    finishes = re.findall(r"\[finish_reason=(\w+), (\d+) tokens", stdout)
    assert len(finishes) == len(DEMO_PROMPTS) + 1
    assert all(reason in ("length", "stop") and 1 <= int(n) <= 4 for reason, n in finishes), finishes
    assert stdout.rstrip().endswith("stack stopped")
    assert not re.search(r'"level": "(warning|error|critical)"|Traceback', stderr), stderr[-3000:]
    assert not any(listening(p) for p in ports)
