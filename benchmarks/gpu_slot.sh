#!/usr/bin/env bash
# The planner's GPU checks in one call, within SLOT_S seconds (default 480), run from the repository root on a
# machine whose python3 has torch, timm and scipy (memfit itself from this checkout, on PYTHONPATH):
#   OUT=DIR bash benchmarks/gpu_slot.sh [CASES [TRACES [LATER]]]
# Stages, in this order, each given what is left of SLOT_S (a stage that would get under 20 s is skipped):
#   calibrate: this GPU's step-time profile (memfit bench --calibrate; 26 s on an H100);
#   measure:   gpu_calibration.py's cases CASES (default: ViT-L's eight rows, Swin-L's eight, Swin-B under FSDP,
#              DeiT-B with its optimizer offloaded and under FSDP's CPU offload accumulating), 8 timed steps each, every step's time kept, one more step
#              profiled (host against device); the cases of one config in one process, each from an empty caching
#              allocator (GROUP=0: a process per case, 17-26 s each on an H100, about 380 s in all; DINO's rows
#              always alone, 27-67 s, the first with the Triton kernel's compilation);
#   trace:     the allocator traces of TRACES (default none; DINO's rows 5 and 6 took 48 s together); with FRAMES=1
#              each allocation of 1 MiB or more keeps its Python frames (which operator made a block);
#   later:     the cases LATER (default none; e.g. 12,13 for DINO's rows 1 and 2);
#   then whatever CHECKS adds: "deform" (benchmarks/deform_check.py), "temporaries" (benchmarks/cuda_temporaries.py),
#   "convs" (benchmarks/conv_workspaces.py: cuDNN's workspaces per convolution shape), "allocator" (the installed
#   allocator's replay test).
# DINO's cases need pycocotools and timm >= 1.0.31 (dynamic image sizes); where the GPU machine lacks them, put
# their wheels in .whl/ (pip download --no-deps --only-binary=:all: -d .whl pycocotools timm==1.0.31, for the
# machine's Python) and the script installs them first.
# Writes DIR/gpu_slot.tgz after every stage (a run cut short keeps what its finished stages wrote): env.txt,
# stages.txt (each stage's seconds), profile.json, measured.json, trace_<i>.json.gz, later/measured.json, logs.
set -u
OUT=${OUT:-benchmarks/results/gpu_slot}
CASES=${1:-18,19,20,21,22,23,24,25,0,1,2,3,4,5,6,7,26,27,28}
TRACES=${2-}
LATER=${3-}
CHECKS=${CHECKS:-}
SLOT_S=${SLOT_S:-480}
GROUP=${GROUP-1}
[ "$GROUP" = 0 ] && GROUP=
W=$(mktemp -d)
mkdir -p "$OUT"
SITE=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl \
    && SITE=$PWD:$W/site
fi
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 MEMFIT_CAL_STEPS=${MEMFIT_CAL_STEPS:-8} \
  MEMFIT_CAL_CASE_S=${MEMFIT_CAL_CASE_S:-90}
pack() { tar czf "$OUT/gpu_slot.tgz" -C "$W" --exclude=./site .; }
# stage NAME CAP COMMAND...: COMMAND within min(CAP, what is left of SLOT_S less 10 s), its seconds in stages.txt
stage() {
  local name=$1 cap=$2 left=$((SLOT_S - SECONDS - 10)) start=$SECONDS
  shift 2
  if [ "$left" -lt 20 ]; then echo "$name: skipped, ${left}s left" | tee -a "$W/stages.txt"; return; fi
  timeout "$((cap < left ? cap : left))" "$@" 2>&1 | tee "$W/$name.txt"
  echo "$name: rc=${PIPESTATUS[0]} $((SECONDS - start))s" | tee -a "$W/stages.txt"
  pkill -f benchmarks/gpu_calibration.py  # a case's process outlives a measure stopped at its limit
  pack
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  grep -m1 "model name" /proc/cpuinfo; nproc; date -u; } > "$W/env.txt" 2>&1
cat "$W/env.txt"
stage calibrate 60 python3 -m memfit bench --calibrate --out "$W/profile.json"
stage measure 400 python3 benchmarks/gpu_calibration.py measure --only "$CASES" --out "$W" ${GROUP:+--group}
for i in ${TRACES//,/ }; do
  stage "trace_$i" 90 python3 benchmarks/gpu_calibration.py trace "$i" --out "$W" ${FRAMES:+--frames}
done
[ -n "$LATER" ] && stage later 300 python3 benchmarks/gpu_calibration.py measure --only "$LATER" --out "$W/later"
case $CHECKS in *deform*) stage deform 120 python3 benchmarks/deform_check.py;; esac
case $CHECKS in *temporaries*) stage temporaries 60 python3 benchmarks/cuda_temporaries.py --out "$W";; esac
case $CHECKS in *convs*) stage convs 120 python3 benchmarks/conv_workspaces.py --out "$W";; esac
case $CHECKS in *allocator*)
  stage allocator 60 python3 -m pytest -q -p no:cacheprovider tests/measure/test_allocator_traces.py -k installed;;
esac
pack
