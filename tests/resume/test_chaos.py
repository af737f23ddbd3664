"""The short version of tools/chaos.py: runs SIGKILLed inside an accumulation window under FSDP and DeepSpeed
ZeRO-2 (which keep the window's partial gradients in their own buffers, so their checkpoints wait for the
window's end) resume with every loss and the final weights and optimizer state bit-equal to an uninterrupted
run. ``python tools/chaos.py --kills 100`` is the long version."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).parents[2] / "tools"


def test_killed_inside_accumulation_windows_nothing_is_lost(capsys):
    sys.path.insert(0, str(TOOLS))
    try:
        import chaos
    finally:
        sys.path.remove(str(TOOLS))
    status = chaos.main(["--trials", "fsdp:save:6,deepspeed_zero2:before:5"])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "2/2 resumes with nothing lost", out
    assert status == 0
    assert out.count("| bit-exact | nothing lost |") == 2 and "not killed" not in out, out
