#!/usr/bin/env bash
# What to run first on a machine with NVIDIA GPUs (under 10 minutes): is the CUDA/NCCL path of
# megatron_ext sound here?
#
#   scripts/gpu_smoke.sh [--gpus N] [--python PY]
#
#   --gpus N     GPUs to use (default: all of this node's, rounded down to a power of two)
#   --python PY  the Python with megatron_ext installed (default: .venv/bin/python, else python3)
#
# Steps, each timed, then one table (non-zero exit if any step failed):
#   cuda       CUDA, the GPUs, torch / CUDA / NCCL versions
#   cluster    a cluster YAML of this node's GPUs (their memory), for the profile below
#   nccl       an all-reduce and a p2p ring over NCCL on every GPU (torchrun)
#   profile    `megatron-ext profile --device cuda` (bf16, CUDA events), a cost YAML
#   profile32  the same in fp32, the dtype `train` runs
#   flexsp     `megatron-ext train --device cuda` for 6 steps of FlexSP plans (N ranks; one GPU: world 1),
#              predicted with the fp32 cost YAML
#   elastic    6 steps of an elastic pipeline (2 stages on 2+ GPUs, else one stage)
#   backends   every installed attention backend (flash-attn, Transformer Engine) against SDPA at bf16,
#              and the ring's fused-kernel backward on a heads-first output
# Logs and the YAMLs go to a new directory, named at the end. Without a CUDA GPU: one line, exit 2.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=""
GPUS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) GPUS="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_smoke: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_smoke: no CUDA GPU here (torch.cuda.is_available() is False in $PY): run it on a machine with NVIDIA GPUs" >&2
  exit 2
fi
HAVE=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [[ -z "$GPUS" ]]; then
  GPUS=1
  while (( GPUS * 2 <= HAVE )); do GPUS=$((GPUS * 2)); done
fi
if ! [[ "$GPUS" =~ ^[0-9]+$ ]] || (( GPUS < 1 || GPUS > HAVE || (GPUS & (GPUS - 1)) != 0 )); then
  echo "gpu_smoke: --gpus $GPUS: need a power of two from 1 to the $HAVE GPU(s) here" >&2
  exit 2
fi
OUT="$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX")"
CLI=("$PY" -m megatron_ext.commands.cli)
PP=1
(( GPUS >= 2 )) && PP=2
ROWS=()
FAILED=0

step() {  # step NAME COMMAND...: run it with a 5-minute cap, log to $OUT/NAME.log, keep a table row
  local name="$1"; shift
  local t0=$SECONDS code
  timeout 300 "$@" >"$OUT/$name.log" 2>&1
  code=$?
  local secs=$((SECONDS - t0))
  local last
  last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-110)
  if (( code == 0 )); then
    ROWS+=("$(printf '%-9s %-5s %5ss  %s' "$name" ok "$secs" "$last")")
  else
    FAILED=1
    ROWS+=("$(printf '%-9s %-5s %5ss  exit %s: %s' "$name" FAIL "$secs" "$code" "$last")")
  fi
  echo "${ROWS[-1]}" >&2
}

cd "$ROOT" || exit 2
step cuda "$PY" scripts/gpu_smoke.py cuda
step cluster "$PY" scripts/gpu_smoke.py cluster "$GPUS" "$OUT/cluster.yaml"
step nccl "$PY" -m torch.distributed.run --standalone --nproc-per-node="$GPUS" scripts/gpu_smoke.py nccl
# lengths long enough for tiny's work to show past the launch constant on a fast GPU (at 256-4,096
# tokens an H100 timed the same 12 ms at every length, which profile refuses to fit)
step profile "${CLI[@]}" profile --device cuda --cluster "$OUT/cluster.yaml" --model tiny \
  --lengths 2048,8192,32768 --repeats 2 --out "$OUT/cost.yaml"
# train runs fp32: its steps are predicted by an fp32 cost model measured here (its error is this machine's)
step profile32 "${CLI[@]}" profile --device cuda --dtype fp32 --cluster "$OUT/cluster.yaml" --model tiny \
  --lengths 2048,8192,32768 --repeats 2 --out "$OUT/cost-fp32.yaml"
COST=(--cluster "$OUT/cluster.yaml")
[[ -f "$OUT/cost-fp32.yaml" ]] && COST=(--cost-model "$OUT/cost-fp32.yaml")
step flexsp "${CLI[@]}" train --device cuda "${COST[@]}" --steps 6 --planner flexsp
step elastic "${CLI[@]}" train --device cuda "${COST[@]}" --steps 6 --pp "$PP" --planner elastic_pp
step backends "$PY" scripts/gpu_smoke.py backends

echo
echo "gpu_smoke: $GPUS of $HAVE GPU(s), $(date -u +%Y-%m-%dT%H:%MZ), logs in $OUT"
printf '%-9s %-5s %6s  %s\n' step result time "last line"
printf '%s\n' "${ROWS[@]}"
exit $FAILED
