# The body of scripts/slurm/flexsp.sbatch and elastic_pp.sbatch (sourced with MODE set).
#
#   sbatch [SBATCH OPTIONS] scripts/slurm/{mode}.sbatch [--dry-run] [--container-image IMG]
#          MODEL_ARGS CLUSTER [-- EXTRA...]
#
#   MODEL_ARGS  a Megatron argument file, e.g. configs/megatron/gpt-7b.args; its name (gpt-7b)
#               is the model preset of the cost model (megatron_ext/presets/models/gpt-7b.yaml)
#   CLUSTER     a cluster preset (megatron_ext/presets/clusters, e.g. h100-80g-8x4) or a cluster
#               YAML; it must describe the allocation: nodes x GPUs per node
#   EXTRA       more pretrain_gpt.py arguments (data, tokenizer, checkpoints, logging)
#   --container-image IMG
#               run the ranks in a container (pyxis/enroot: srun --container-image), with the
#               submit directory, megatron_ext and Megatron-LM mounted at their own paths; the
#               image's python3 needs megatron_ext's requirements (default: $CONTAINER_IMAGE)
#   --dry-run   print the environment and the srun command instead of running them (works
#               outside Slurm too: the allocation is then taken from CLUSTER)
#
# One Slurm task per node; srun starts torchrun on each node, torchrun starts that node's GPU
# ranks (--nproc-per-node = GPUs per node) and they meet at a c10d rendezvous on the first node.
# Each rank runs megatron_ext.megatron.launch MEGATRON_LM_DIR/pretrain_gpt.py (a patched
# checkout: scripts/apply_patches.sh). Added unless given: --cost-model MODEL:CLUSTER:ZERO (ZERO
# 1 with --use-distributed-optimizer, else 0), --distributed-backend nccl, and the mode's flag.
#
# Time limits and requeueing: --save and --load default to checkpoints/JOB_NAME-JOB_ID in the
# job's directory (a requeued job keeps its id; another job resumes only from a --load it is given,
# and once requeued from its own --save where that holds a checkpoint; --load to --save's
# directory when only that is given; --save-interval 1000 unless given), and
# --exit-signal-handler --exit-signal SIGUSR1 are added (SIGUSR2 may replace it; torchrun handles
# SIGTERM and SIGINT itself, stopping the ranks before they save). Slurm sends the batch script
# SIGUSR1 300 s before the time limit (#SBATCH --signal=B:USR1@300; sbatch --signal=B:USR1@SECONDS
# for another lead time); it passes Megatron's exit signal to the ranks, which finish the
# iteration, save a checkpoint and exit, and then requeues the job (#SBATCH --requeue), which
# resumes from --load. torchrun ignores that signal. Megatron also saves after the last iteration.
#
# Everything runs in the job's directory (the submit directory, or sbatch --chdir's): #SBATCH
# --output, checkpoints, and relative paths in the arguments resolve there. srun passes on
# --cpus-per-task (SLURM_CPUS_PER_TASK: since Slurm 22.05 srun does not inherit it from sbatch).
# Environment: MEGATRON_LM_DIR (required), MEGATRON_EXT_DIR (default:
# the submit directory, which must then be megatron_ext's checkout), PYTHON, MASTER_PORT (default
# 29500), NCCL_* to override the defaults below, GPUS_PER_NODE (where Slurm's SLURM_GPUS_ON_NODE
# is not set; default: from CLUSTER), CONTAINER_IMAGE, CONTAINER_MOUNTS (more SRC:DST mounts,
# comma-separated), CHECK_ARGS=0 (skip checking the arguments on the batch host before srun).

set -euo pipefail

# shellcheck source=common.sh
source "$MEGATRON_EXT_DIR/scripts/slurm/common.sh"

slurm_usage() {
  awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$MEGATRON_EXT_DIR/scripts/slurm/launch.sh" |
    sed "s/{mode}/$MODE/g"
}

dry_run=0
image="${CONTAINER_IMAGE:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --container-image)
      [[ $# -ge 2 ]] || { echo "$MODE.sbatch: --container-image needs an image" >&2; exit 2; }
      image="$2"; shift 2 ;;
    --container-image=*) image="${1#*=}"; shift ;;
    -h|--help) slurm_usage; exit 0 ;;
    *) break ;;
  esac
done
if [[ $# -lt 2 ]]; then
  slurm_usage >&2
  exit 2
fi
model_args="$1"
cluster="$2"
shift 2
[[ "${1:-}" == "--" ]] && shift
extra=("$@")

[[ -f "$model_args" ]] || model_args="$MEGATRON_EXT_DIR/$model_args"
read_args_file file_args "$model_args" || exit 2
args=("${file_args[@]}" "${extra[@]}")
model_preset="$(basename "$model_args" .args)"

python="$(megatron_python)"
# megatron_ext is imported from its checkout wherever the processes run (here: the job's directory).
export PYTHONPATH="$MEGATRON_EXT_DIR${PYTHONPATH:+:$PYTHONPATH}"
# The cluster: GPUs per node and nodes, from the preset or YAML (megatron_ext.spec); in a container
# the batch host may lack the Python environment: a preset's name says them (...-GxN), the ranks
# check the rest.
if [[ -n "$image" && "$cluster" =~ -([0-9]+)x([0-9]+)$ ]]; then
  cluster_gpus="${BASH_REMATCH[1]}"
  cluster_nodes="${BASH_REMATCH[2]}"
else
read -r cluster_nodes cluster_gpus < <(
  "$python" -c 'import sys
from megatron_ext.errors import MegatronExtError
from megatron_ext.spec import load_cluster
try:
    c = load_cluster(sys.argv[1])
except MegatronExtError as e:
    sys.exit(f"{sys.argv[2]}.sbatch: {e}")
print(c.num_nodes, c.gpus_per_node)' "$cluster" "$MODE"
) || exit 2
fi
gpus_per_node="${SLURM_GPUS_ON_NODE:-${GPUS_PER_NODE:-$cluster_gpus}}"
nodes="${SLURM_NNODES:-$cluster_nodes}"
if [[ "$nodes" != "$cluster_nodes" || "$gpus_per_node" != "$cluster_gpus" ]]; then
  echo "$MODE.sbatch: the allocation ($nodes nodes x $gpus_per_node GPUs) is not the cluster $cluster" \
       "($cluster_nodes x $cluster_gpus): sbatch --nodes=$cluster_nodes --gpus-per-node=$cluster_gpus" >&2
  exit 2
fi

# Mode flags and the cost model.
case "$MODE" in
  flexsp) has_flag --flexsp "${args[@]}" || args+=(--flexsp) ;;
  elastic_pp)
    has_flag --elastic-pp "${args[@]}" || args+=(--elastic-pp)
    pp="$(flag_value --pipeline-model-parallel-size 1 "${args[@]}")"
    if [[ "$pp" -lt 2 ]]; then
      args+=(--pipeline-model-parallel-size "${PP:-4}")
    fi
    ;;
  *) echo "launch.sh: unknown MODE $MODE" >&2; exit 2 ;;
esac
if [[ "$MODE" == elastic_pp ]]; then
  mapfile -t args < <(without_flexsp_flags "${args[@]}")  # one argument file serves both modes
fi
if ! has_flag --cost-model "${args[@]}"; then
  zero=0
  has_flag --use-distributed-optimizer "${args[@]}" && zero=1
  args+=(--cost-model "$model_preset:$cluster:$zero")
fi
has_flag --distributed-backend "${args[@]}" || args+=(--distributed-backend nccl)

# Checkpoints in the job's directory, and the signal on which the ranks save one and exit.
submit_dir="$PWD"
job_name="${SLURM_JOB_NAME:-megatron-ext-${MODE//_/-}}${SLURM_JOB_ID:+-$SLURM_JOB_ID}"
save="$(flag_value --save "$submit_dir/checkpoints/$job_name" "${args[@]}")"
has_flag --save "${args[@]}" || args+=(--save "$save")
if ! has_flag --load "${args[@]}"; then
  args+=(--load "$save")
elif [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 && -f "$save/latest_checkpointed_iteration.txt" ]]; then
  args+=(--load "$save")  # requeued: go on from this job's own saves, not from the --load it began with
fi
has_flag --save-interval "${args[@]}" || args+=(--save-interval 1000)  # Megatron requires one with --save
has_flag --exit-signal-handler "${args[@]}" || args+=(--exit-signal-handler)
exit_signal="$(flag_value --exit-signal SIGUSR1 "${args[@]}")"
if [[ "$exit_signal" != SIGUSR1 && "$exit_signal" != SIGUSR2 ]]; then
  echo "$MODE.sbatch: --exit-signal $exit_signal: use SIGUSR1 or SIGUSR2 (torchrun handles $exit_signal itself and" \
       "would stop the ranks before they save)" >&2
  exit 2
fi
has_flag --exit-signal "${args[@]}" || args+=(--exit-signal "$exit_signal")

# Rendezvous on the first node of the allocation.
if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
  master_addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
else
  master_addr="$(hostname)"
fi
master_port="${MASTER_PORT:-29500}"
job_id="${SLURM_JOB_ID:-dry-run}"

# NCCL and process environment (each may be overridden from outside).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export NCCL_CROSS_NIC="${NCCL_CROSS_NIC:-0}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export PYTHONUNBUFFERED=1
env_names=(NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_IB_TIMEOUT NCCL_CROSS_NIC NCCL_NVLS_ENABLE
           CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS PYTHONUNBUFFERED)
for name in NCCL_SOCKET_IFNAME NCCL_IB_HCA GLOO_SOCKET_IFNAME; do
  [[ -n "${!name:-}" ]] && env_names+=("$name")
done

megatron="${MEGATRON_LM_DIR:-}"
mlm="${megatron:-\$MEGATRON_LM_DIR}"
container=()
rank_python="$python"
if [[ -n "$image" ]]; then
  mounts="$submit_dir:$submit_dir,$MEGATRON_EXT_DIR:$MEGATRON_EXT_DIR,$mlm:$mlm${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
  container=(--container-image="$image" --container-mounts="$mounts" --container-workdir="$submit_dir")
  rank_python=python3
fi
# Slurm signals every process of the job step: torchrun must outlive the exit signal (by default
# it would die of SIGUSR1, or stop the ranks on SIGTERM before they save), so it starts with the
# signal ignored; the ranks inherit that until Megatron's handler takes the signal.
cpus=()
[[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
cmd=(srun --nodes="$nodes" --ntasks-per-node=1 "${cpus[@]}" --kill-on-bad-exit=1 "${container[@]}"
     bash -c 'trap "" "$0" && exec "$@"' "$exit_signal"
     "$rank_python" -m torch.distributed.run
     --nnodes="$nodes" --nproc-per-node="$gpus_per_node"
     --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="$job_id"
     -m megatron_ext.megatron.launch "$mlm/pretrain_gpt.py" "${args[@]}")

if [[ $dry_run -eq 1 ]]; then
  echo "# $MODE: $model_preset on $cluster ($nodes nodes x $gpus_per_node GPUs), rendezvous $master_addr:$master_port"
  echo "# in $submit_dir: checkpoints $save; 300 s before the time limit (sbatch --signal=B:USR1@300) the" \
       "ranks get $exit_signal, save and exit, and the job is requeued (--requeue) to resume from --load"
  for name in "${env_names[@]}" PYTHONPATH; do
    echo "export $name=$(printf '%q' "${!name}")"
  done
  show_cmd "${cmd[@]}"
  exit 0
fi
check_megatron_dir "$megatron" || exit $?
# The arguments are checked once, here, before srun starts any rank: a conflict ends the job with
# its one line last and status 2 (from the ranks, torchrun would report it after, with status 1).
# In a container (or with CHECK_ARGS=0) the batch host may lack the Python environment: the ranks
# check them then.
if [[ -z "$image" && "${CHECK_ARGS:-1}" != 0 ]]; then
  "$python" -m megatron_ext.megatron.launch --check-args "$((nodes * gpus_per_node))" \
    "$megatron/pretrain_gpt.py" "${args[@]}" || exit $?
fi

stop_requested=0
# (a trap runs between commands: srun runs in the background so that one can run while it does)
trap 'stop_requested=1; scancel --signal="$exit_signal" "$SLURM_JOB_ID" ||
      echo "$MODE.sbatch: could not pass $exit_signal to the ranks" >&2' USR1
"${cmd[@]}" &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # the wait ended for the trap, not for srun
  status=0
  wait "$srun_pid" || status=$?
done
if [[ $stop_requested -eq 1 && $status -eq 0 ]]; then
  echo "$MODE.sbatch: the ranks saved a checkpoint in $save before the time limit; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
