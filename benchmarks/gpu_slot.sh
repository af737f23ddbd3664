#!/usr/bin/env bash
# The planner's GPU checks in one call (about 5 min on an H100), run from the repository root on a machine whose
# python3 has torch, timm and scipy (memfit itself from this checkout, on PYTHONPATH):
#   OUT=DIR bash benchmarks/gpu_slot.sh [CASES]   # CASES: gpu_calibration.py case indices (default: DINO's rows
#                                                 # 1-6 with the Triton kernel, Swin-B under FSDP at one rank and
#                                                 # DeiT-B's optimizer offload)
# Writes DIR/gpu_slot.tgz: this GPU's step-time profile (memfit bench --calibrate), gpu_calibration.py's
# measurements of CASES (and the allocator traces of its TRACED cases), the deformable-attention kernel against
# grid_sample (benchmarks/deform_check.py), and the installed allocator's replay test.
set -u
OUT=${OUT:-benchmarks/results/gpu_slot}
CASES=${1:-12,13,14,15,16,17,26,27}
W=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
trap 'tar czf "$OUT/gpu_slot.tgz" -C "$W" .' EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  date -u; } > "$W/env.txt" 2>&1
cat "$W/env.txt"
timeout 60 python3 -m memfit bench --calibrate --out "$W/profile.json" 2>&1 | tee "$W/calibrate.txt"
timeout 300 python3 benchmarks/gpu_calibration.py measure --trace --only "$CASES" --out "$W" 2>&1 | tee "$W/measure.txt"
timeout 120 python3 benchmarks/deform_check.py > "$W/deform_check.txt" 2>&1; grep "^|" "$W/deform_check.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/measure/test_allocator_traces.py -k installed \
  > "$W/allocator_test.txt" 2>&1; tail -3 "$W/allocator_test.txt"
