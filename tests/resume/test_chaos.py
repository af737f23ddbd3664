"""The short version of tools/chaos.py: a 2-rank FSDP run SIGKILLed inside an accumulation window (FSDP keeps
the window's partial gradients in its own buffers, so its checkpoint due inside the window waited for the
window's end) resumes with every loss and the final weights and optimizer state bit-equal to an uninterrupted
run. ``python tools/chaos.py --kills 100`` is the long version, over every strategy."""

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
    status = chaos.main(["--trials", "fsdp:before:5"])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "1/1 resumes with nothing lost", out
    assert status == 0
    assert out.count("| bit-exact | nothing lost |") == 1 and "not killed" not in out, out
