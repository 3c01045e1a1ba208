# Shared by scripts/run_local.sh and scripts/slurm/*.sbatch (sourced, not run).

# args_from_file FILE: the Megatron arguments of an argument file (configs/megatron/*.args), one
# per line on stdout: '#' starts a comment, words are split on blanks; no quoting, globbing or ${VAR} expansion.
args_from_file() {
  local file="$1" line words
  if [[ ! -f "$file" ]]; then
    echo "no argument file $file" >&2
    return 1
  fi
  while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"
    read -r -a words <<<"$line"
    [[ ${#words[@]} -gt 0 ]] && printf '%s\n' "${words[@]}"
  done <"$file"
  return 0
}

# read_args_file ARRAY FILE: args_from_file into ARRAY; status 1 (and its line) where FILE is not
# there (read apart: a process substitution's failure would not stop the script).
read_args_file() {
  local -n into="$1"
  local text
  text="$(args_from_file "$2")" || return 1
  mapfile -t into < <(printf '%s' "$text")
}

# has_flag FLAG ARGS...: whether FLAG (or FLAG=...) is among ARGS.
has_flag() {
  local flag="$1" a
  shift
  for a in "$@"; do
    [[ "$a" == "$flag" || "$a" == "$flag="* ]] && return 0
  done
  return 1
}

# flag_value FLAG DEFAULT ARGS...: the value given to FLAG in ARGS (last one wins), else DEFAULT.
flag_value() {
  local flag="$1" value="$2" prev=""
  shift 2
  for a in "$@"; do
    [[ "$prev" == "$flag" ]] && value="$a"
    [[ "$a" == "$flag="* ]] && value="${a#*=}"
    prev="$a"
  done
  printf '%s\n' "$value"
}

# without_flexsp_flags ARGS...: ARGS, one per line, without the FlexSP-only flags an argument file
# may carry (--flexsp, and --flexsp-planner, --flexsp-static-degree, --flexsp-max-sp-size,
# --flexsp-max-ring with their values): what --elastic-pp runs keep.
without_flexsp_flags() {
  local a skip=0
  for a in "$@"; do
    if [[ $skip -eq 1 ]]; then skip=0; continue; fi
    case "$a" in
      --flexsp|--flexsp-planner=*|--flexsp-static-degree=*|--flexsp-max-sp-size=*|--flexsp-max-ring=*) ;;
      --flexsp-planner|--flexsp-static-degree|--flexsp-max-sp-size|--flexsp-max-ring) skip=1 ;;
      *) printf '%s\n' "$a" ;;
    esac
  done
}

# show_cmd ARGS...: one shell-quoted command line, as --dry-run prints it.
show_cmd() {
  local out="" a
  for a in "$@"; do
    out+="$(printf '%q' "$a") "
  done
  printf '%s\n' "${out% }"
}

# megatron_python: the interpreter to run with (PYTHON, else megatron_ext's .venv, else python3).
megatron_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    printf '%s\n' "$PYTHON"
  elif [[ -x "$MEGATRON_EXT_DIR/.venv/bin/python" ]]; then
    printf '%s\n' "$MEGATRON_EXT_DIR/.venv/bin/python"
  else
    printf '%s\n' python3
  fi
}

# check_megatron_dir DIR: a patched Megatron-LM checkout at core_v0.16.1, or an explanation.
check_megatron_dir() {
  local dir="$1"
  if [[ -z "$dir" ]]; then
    echo "set MEGATRON_LM_DIR (run_local.sh: or --megatron DIR): a Megatron-LM checkout at tag core_v0.16.1" >&2
    return 2
  fi
  if [[ ! -f "$dir/pretrain_gpt.py" ]]; then
    echo "$dir has no pretrain_gpt.py: not a Megatron-LM checkout" >&2
    return 2
  fi
  if ! bash "$MEGATRON_EXT_DIR/scripts/apply_patches.sh" --check "$dir" >/dev/null; then
    echo "Megatron-LM at $dir is not patched: run scripts/apply_patches.sh $dir" >&2
    return 2
  fi
}
