#!/usr/bin/env bash
# Run Megatron-LM's (patched) pretrain_gpt.py on CPU ranks with gloo, on this machine.
#
#   scripts/run_local.sh [--dry-run] [--nproc N] [--pp P] [--megatron DIR] [--args FILE] [--] [ARGS...]
#
#   --megatron DIR  the patched Megatron-LM checkout (default: $MEGATRON_LM_DIR)
#   --nproc N       CPU ranks (default 2)
#   --pp P          elastic pipelines instead of FlexSP: --elastic-pp --pipeline-model-parallel-size P
#                   (P >= 2 stages; the N / P ranks of a stage are its Ulysses group); the file's
#                   FlexSP-only flags are dropped
#   --args FILE     a Megatron argument file (default configs/megatron/tiny-cpu.args: the tiny
#                   model with --flexsp for 10 iterations); ARGS come after the file's, and
#                   argparse keeps the last value of a repeated option
#   --dry-run       print the commands, run nothing
#
# Without --data-path PREFIX (a Megatron indexed dataset) among the arguments, --mock-data is added;
# with --flexsp or --elastic-pp and no --cost-model, configs/megatron/cost/tiny-cpu<N>.yaml (N = 2
# or 4 ranks: with --flexsp the data-parallel size, ranks / tensor-parallel size, with --elastic-pp
# the whole job).
# The same script file as on GPUs; megatron_ext.megatron.launch applies the CPU patches (no
# CUDA: gloo, local transformer, fusions off) and runs it under torchrun --standalone, after
# checking the arguments once (launch --check-args: a conflict is one line, status 2). Ctrl-C
# stops the ranks with SIGTERM (they save first under --exit-signal-handler), in one line.
# Examples: MEGATRON_LM_DIR=~/Megatron-LM scripts/run_local.sh --nproc 4 -- --train-iters 20
#           MEGATRON_LM_DIR=~/Megatron-LM scripts/run_local.sh --nproc 4 --pp 2 -- --seq-length 2048
set -euo pipefail

MEGATRON_EXT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=slurm/common.sh
source "$MEGATRON_EXT_DIR/scripts/slurm/common.sh"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

dry_run=0
nproc=2
pp=
megatron="${MEGATRON_LM_DIR:-}"
args_file="$MEGATRON_EXT_DIR/configs/megatron/tiny-cpu.args"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc|--pp|--megatron|--args)
      [[ $# -ge 2 ]] || { echo "run_local.sh: $1 needs a value" >&2; exit 2; } ;;&
    --dry-run) dry_run=1; shift ;;
    --nproc) nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --pp) pp="$2"; shift 2 ;;
    --pp=*) pp="${1#*=}"; shift ;;
    --megatron) megatron="$2"; shift 2 ;;
    --megatron=*) megatron="${1#*=}"; shift ;;
    --args) args_file="$2"; shift 2 ;;
    --args=*) args_file="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_local.sh: --nproc must be a positive integer, got $nproc" >&2
  exit 2
fi

if [[ -n "$pp" ]] && ! [[ "$pp" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_local.sh: --pp must be a positive integer, got $pp" >&2
  exit 2
fi

read_args_file file_args "$args_file" || exit 2
all_args=("${file_args[@]}" "$@")
if [[ -n "$pp" ]]; then
  mapfile -t all_args < <(without_flexsp_flags "${all_args[@]}")
  all_args+=(--elastic-pp --pipeline-model-parallel-size "$pp")
fi
given_data=0
for flag in --data-path --data-args-path --train-data-path --valid-data-path --test-data-path \
            --per-split-data-args-path --mock-data; do
  has_flag "$flag" "${all_args[@]}" && given_data=1
done
if [[ $given_data -eq 0 ]]; then
  all_args+=(--mock-data)
fi
if { has_flag --flexsp "${all_args[@]}" || has_flag --elastic-pp "${all_args[@]}"; } &&
   ! has_flag --cost-model "${all_args[@]}"; then
  spans="$nproc"
  tp="$(flag_value --tensor-model-parallel-size 1 "${all_args[@]}")"
  if has_flag --flexsp "${all_args[@]}" && [[ "$tp" =~ ^[1-9][0-9]*$ ]] && ((nproc % tp == 0)); then  # (its groups: DP ranks)
    spans=$((nproc / tp))
  fi
  cost="configs/megatron/cost/tiny-cpu$spans.yaml"
  if [[ ! -f "$MEGATRON_EXT_DIR/$cost" ]]; then
    echo "run_local.sh: no cost model for $spans ranks ($cost); pass --cost-model PATH|MODEL:CLUSTER" >&2
    exit 2
  fi
  all_args+=(--cost-model "$cost")
fi
# --cost-model / --data-path paths under configs/ are taken from megatron_ext's root, so the run
# does not depend on the current directory.
for i in "${!all_args[@]}"; do
  prev="${all_args[$((i > 0 ? i - 1 : 0))]}"
  a="${all_args[$i]}"
  if [[ $i -gt 0 && ( "$prev" == --cost-model || "$prev" == --data-path ) && "$a" == configs/* ]]; then
    all_args[$i]="$MEGATRON_EXT_DIR/$a"
  elif [[ "$a" == --cost-model=configs/* || "$a" == --data-path=configs/* ]]; then
    all_args[$i]="${a%%=*}=$MEGATRON_EXT_DIR/${a#*=}"
  fi
done

python="$(megatron_python)"
# torchrun in a session of its own (megatron_ext.runtime.supervisor): Ctrl-C reaches the ranks once,
# as SIGTERM (Megatron's default --exit-signal: with --exit-signal-handler they save first), not as
# a KeyboardInterrupt traceback from every rank; a rank that fails is named in one line.
cmd=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$python" -m megatron_ext.runtime.supervisor --standalone
     "--nproc-per-node=$nproc" -m megatron_ext.megatron.launch "${megatron:-\$MEGATRON_LM_DIR}/pretrain_gpt.py"
     "${all_args[@]}")

if [[ $dry_run -eq 1 ]]; then
  show_cmd bash "$MEGATRON_EXT_DIR/scripts/apply_patches.sh" --check "${megatron:-\$MEGATRON_LM_DIR}"
  show_cmd "${cmd[@]}"
  exit 0
fi
check_megatron_dir "$megatron" || exit $?
# The arguments are checked once before torchrun starts ranks: a conflict ends here, its one line
# last and status 2 (from a rank, torchrun would report the failure after it, with status 1).
env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$python" -m megatron_ext.megatron.launch --check-args "$nproc" \
  "$megatron/pretrain_gpt.py" "${all_args[@]}" || exit $?
exec "${cmd[@]}"
