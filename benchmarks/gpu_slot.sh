#!/usr/bin/env bash
# The planner's GPU checks in one call (about 5 min on an H100), run from the repository root on a machine whose
# python3 has torch, timm and scipy (memfit itself from this checkout, on PYTHONPATH):
#   OUT=DIR bash benchmarks/gpu_slot.sh [CASES]      # CASES: gpu_calibration.py case indices (default: ViT-L and more)
# Writes DIR/gpu_slot.tgz: the installed allocator's replay test, the deformable-attention kernel against
# grid_sample, gpu_calibration.py's measurements of CASES (and the allocator traces of its TRACED cases).
set -u
OUT=${OUT:-benchmarks/results/gpu_slot}
CASES=${1:-18,19,20,21,22,23,24,25,26,27}
W=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
trap 'tar czf "$OUT/gpu_slot.tgz" -C "$W" .' EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  date -u; } > "$W/env.txt" 2>&1
cat "$W/env.txt"
timeout 360 python3 benchmarks/gpu_calibration.py measure --trace --only "$CASES" --out "$W" 2>&1 | tee "$W/measure.txt"
timeout 110 python3 benchmarks/deform_attn.py --out "$W" > "$W/deform_attn.txt" 2>&1; tail -15 "$W/deform_attn.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/measure/test_allocator_traces.py -k installed \
  > "$W/allocator_test.txt" 2>&1; tail -3 "$W/allocator_test.txt"
