"""What a benchmark records beside its figures: the CPU model (``lscpu``) and the load average
(``uptime``), since the machine may be shared.

Example:
    >>> sorted(machine())
    ['cpu', 'load']
"""

from __future__ import annotations

import subprocess

__all__ = ["machine"]


def machine() -> dict[str, str]:
    """``{"cpu": model name, "load": the three load averages}`` ("unknown"/"" where unreadable)."""

    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    model = next((line.split(":", 1)[1].strip() for line in run(["lscpu"]).splitlines()
                  if line.startswith("Model name")), "unknown")
    return {"cpu": model, "load": run(["uptime"]).strip().split("load average:")[-1].strip()}
