# The body of scripts/slurm/flexsp.sbatch and elastic_pp.sbatch (sourced with MODE set).
#
#   sbatch [SBATCH OPTIONS] scripts/slurm/{mode}.sbatch [--dry-run] MODEL_ARGS CLUSTER [-- EXTRA...]
#
#   MODEL_ARGS  a Megatron argument file, e.g. configs/megatron/gpt-7b.args; its name (gpt-7b)
#               is the model preset of the cost model (megatron_ext/presets/models/gpt-7b.yaml)
#   CLUSTER     a cluster preset (megatron_ext/presets/clusters, e.g. h100-80g-8x4) or a cluster
#               YAML; it must describe the allocation: nodes x GPUs per node
#   EXTRA       more pretrain_gpt.py arguments (data, tokenizer, checkpoints, logging)
#   --dry-run   print the environment and the srun command instead of running them (works
#               outside Slurm too: the allocation is then taken from CLUSTER)
#
# One Slurm task per node; srun starts torchrun on each node, torchrun starts that node's GPU
# ranks (--nproc-per-node = GPUs per node) and they meet at a c10d rendezvous on the first node.
# Each rank runs megatron_ext.megatron.launch MEGATRON_LM_DIR/pretrain_gpt.py (a patched
# checkout: scripts/apply_patches.sh). Added unless given: --cost-model MODEL:CLUSTER:ZERO (ZERO
# 1 with --use-distributed-optimizer, else 0), --distributed-backend nccl, and the mode's flag.
#
# Environment: MEGATRON_LM_DIR (required), MEGATRON_EXT_DIR (default: the submit directory, which
# must be megatron_ext's checkout), PYTHON, MASTER_PORT (default 29500), NCCL_* to override the
# defaults below, GPUS_PER_NODE (default: from CLUSTER).

set -euo pipefail

# shellcheck source=common.sh
source "$MEGATRON_EXT_DIR/scripts/slurm/common.sh"

slurm_usage() {
  awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$MEGATRON_EXT_DIR/scripts/slurm/launch.sh" |
    sed "s/{mode}/$MODE/g"
}

dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
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
mapfile -t file_args < <(args_from_file "$model_args")
args=("${file_args[@]}" "${extra[@]}")
model_preset="$(basename "$model_args" .args)"

python="$(megatron_python)"
# The cluster: GPUs per node and nodes, from the preset or YAML (megatron_ext.spec).
read -r cluster_nodes cluster_gpus < <(
  cd "$MEGATRON_EXT_DIR" && "$python" -c 'import sys
from megatron_ext.spec import load_cluster
c = load_cluster(sys.argv[1]); print(c.num_nodes, c.gpus_per_node)' "$cluster"
) || { echo "$MODE.sbatch: cannot read cluster $cluster" >&2; exit 2; }
gpus_per_node="${GPUS_PER_NODE:-$cluster_gpus}"
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
cmd=(srun --nodes="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1
     "$python" -m torch.distributed.run
     --nnodes="$nodes" --nproc-per-node="$gpus_per_node"
     --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="$job_id"
     -m megatron_ext.megatron.launch "${megatron:-\$MEGATRON_LM_DIR}/pretrain_gpt.py" "${args[@]}")

if [[ $dry_run -eq 1 ]]; then
  echo "# $MODE: $model_preset on $cluster ($nodes nodes x $gpus_per_node GPUs), rendezvous $master_addr:$master_port"
  for name in "${env_names[@]}"; do
    echo "export $name=$(printf '%q' "${!name}")"
  done
  echo "cd $(printf '%q' "$MEGATRON_EXT_DIR")"
  show_cmd "${cmd[@]}"
  exit 0
fi
check_megatron_dir "$megatron" || exit $?
cd "$MEGATRON_EXT_DIR"
exec "${cmd[@]}"
