"""`group_alive` sees a process group's live members, not its zombies, and `wait_group_gone`
returns once a killed group has exited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvpush.launch.engine import group_alive, wait_group_gone

# A leader that starts a child in its group, then sleeps; killed, the child becomes an orphan
# that init reaps.
SCRIPT = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


def test_a_killed_group_is_gone_and_a_running_one_is_not():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], start_new_session=True)
    try:
        assert group_alive(proc.pid)
        assert not wait_group_gone(proc.pid, 0.3)  # still running: times out
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_group_gone(proc.pid, 10)
        assert not group_alive(proc.pid)
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_zombie_leader_does_not_count_as_running():
    proc = subprocess.Popen(["true"], start_new_session=True)
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # exited, not yet reaped: Popen waits only when asked
    assert not group_alive(proc.pid)
    proc.wait()
