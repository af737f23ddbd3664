#!/usr/bin/env bash
# The planner's GPU checks in one call (about 8 min on an H100 with the defaults), run from the repository root on
# a machine whose python3 has torch, timm and scipy (memfit itself from this checkout, on PYTHONPATH):
#   OUT=DIR bash benchmarks/gpu_slot.sh [CASES [TRACES]]
# CASES: gpu_calibration.py case indices, measured in that order (default: DINO's rows 1-6 with the Triton kernel,
# then step-time cases: Swin-L fp32/fp16/bf16, ViT-L fp32/bf16, blocks, blocks at micro-batch 32 x 2);
# TRACES: the cases whose allocator traces are recorded first (default: DINO's rows 5 and 6, whose reserved memory
# the planner misses by -9.7% and +7.7%; '' for none).
# DINO's cases need pycocotools and timm >= 1.0.31 (dynamic image sizes); where the GPU machine lacks them, put
# their wheels in .whl/ (pip download --no-deps --only-binary=:all: -d .whl pycocotools timm==1.0.31, for the
# machine's Python) and the script installs them first.
# CHECKS (environment): which of "calibrate measure deform allocator temporaries" run (default: calibrate measure
# temporaries). Every measured case also profiles one step (host against device: gpu_calibration.py's "profile").
# temporaries: benchmarks/cuda_temporaries.py, the allocations of Swin-B's stage-3 block backward named by the C++
# function that made them (what the fake step misses under FSDP: docs/planner_accuracy.md).
# Writes DIR/gpu_slot.tgz: this GPU's step-time profile (memfit bench --calibrate), gpu_calibration.py's
# measurements of CASES (8 timed steps each, every step's time kept) and TRACES' allocator traces, the
# deformable-attention kernel against grid_sample (benchmarks/deform_check.py), and the installed allocator's
# replay test.
set -u
OUT=${OUT:-benchmarks/results/gpu_slot}
CASES=${1:-12,13,14,15,16,17,0,1,2,18,19,20,25}
TRACES=${2-16,17}
CHECKS=${CHECKS:-calibrate measure temporaries}
W=$(mktemp -d)
mkdir -p "$OUT"
SITE=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl \
    && SITE=$PWD:$W/site
fi
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 MEMFIT_CAL_STEPS=${MEMFIT_CAL_STEPS:-8}
trap 'tar czf "$OUT/gpu_slot.tgz" -C "$W" --exclude=./site .' EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  date -u; } > "$W/env.txt" 2>&1
cat "$W/env.txt"
case $CHECKS in *calibrate*)
  timeout 60 python3 -m memfit bench --calibrate --out "$W/profile.json" 2>&1 | tee "$W/calibrate.txt";; esac
case $CHECKS in *measure*)
  timeout "${MEASURE_S:-420}" python3 benchmarks/gpu_calibration.py measure ${TRACES:+--trace "$TRACES"} \
    --only "$CASES" --out "$W" 2>&1 | tee "$W/measure.txt";; esac
case $CHECKS in *deform*)
  timeout 120 python3 benchmarks/deform_check.py > "$W/deform_check.txt" 2>&1; grep "^|" "$W/deform_check.txt";; esac
case $CHECKS in *temporaries*)
  timeout 60 python3 benchmarks/cuda_temporaries.py --out "$W" > "$W/cuda_temporaries.txt" 2>&1
  head -40 "$W/cuda_temporaries.txt";; esac
case $CHECKS in *allocator*)
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/measure/test_allocator_traces.py -k installed \
    > "$W/allocator_test.txt" 2>&1; tail -3 "$W/allocator_test.txt";; esac
