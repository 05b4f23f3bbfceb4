"""The GPU's SM and memory clocks, power, temperature and clock-event reasons, once a second (nvidia-smi), logged
beside a device call's timings: processes have run the same program at speeds 3-5% apart (sessions 26-31; the clocks
were the same each time so far), so timings are read against these. Reasons: 0x4 software power cap, 0x20 / 0x40
thermal, 0x8 hardware slowdown. One home for the query: the device scripts run it in the background,
gpu_sustained.py imports watch().

    python3 benchmarks/gpu_clocks.py FILE &     # until killed; nothing happens where nvidia-smi is missing
"""

import os
import shutil
import subprocess
import sys

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


def command() -> list[str] | None:
    """nvidia-smi's command line for one line a second, no header; None where there is no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    return [smi, f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "1000"] if smi else None


def watch(out) -> subprocess.Popen | None:
    """The logger as a child process writing to the open file `out` (terminate() it); None without nvidia-smi."""
    cmd = command()
    return subprocess.Popen(cmd, stdout=out) if cmd else None


if __name__ == "__main__":
    cmd = command()
    if cmd:
        with open(sys.argv[1], "w") as f:
            os.dup2(f.fileno(), 1)
        os.execv(cmd[0], cmd)  # this process becomes nvidia-smi: killing its pid stops the log
