"""benchmarks/conv_workspaces.py's reading of one call's allocator trace (the recording needs a GPU) and the NHWC
engine's workspace as read off the H100 traces."""

from __future__ import annotations


def test_a_calls_workspaces_are_the_blocks_it_frees_again(bench_script):
    cw = bench_script("conv_workspaces")
    trace = [{"action": "alloc", "addr": 1, "size": 100},  # the output: kept
             {"action": "alloc", "addr": 2, "size": 50}, {"action": "alloc", "addr": 3, "size": 8},
             {"action": "free_requested", "addr": 3, "size": 8}, {"action": "free_completed", "addr": 3, "size": 8},
             {"action": "free_completed", "addr": 2, "size": 50},
             {"action": "alloc", "addr": 2, "size": 40}, {"action": "free_completed", "addr": 2, "size": 40},
             {"action": "free_completed", "addr": 9, "size": 7}]  # made before the call
    assert cw.transients(trace) == [50, 8, 40]
    assert cw.transients([]) == []


def test_the_nhwc_engines_workspace_is_the_one_vit_l_patch_embedding_took(bench_script):
    """ViT-L/16's patch embedding at batch 64 in bf16 took 77.5 MiB forward in the H100 trace: its input with 8
    channels (49 MiB), its output (24.5) and its weight (4)."""
    cw = bench_script("conv_workspaces")
    case = next(c for c in cw.TRACED if c[0].startswith("vit-l/16"))
    assert cw.nhwc_engine(case, 2) == {"forward": 77.5 * 2**20 + 16, "backward": 77.5 * 2**20 + 147}
    assert len({c[0] for c in cw.TRACED + cw.grid()}) == len(cw.TRACED + cw.grid())
