#!/usr/bin/env bash
# Apply megatron_ext's patches (patches/core_v0.16.1/) to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_DIR            apply (idempotent: "already applied")
#   scripts/apply_patches.sh --check MEGATRON_DIR    only report each patch's state; exit 1 if
#                                                    any is not applied
#   scripts/apply_patches.sh --reverse MEGATRON_DIR  take the patches out again
#
# The checkout must be Megatron-LM at tag core_v0.16.1 (megatron/core/package_info.py says
# 0.16.1). Each patch is first tried with --dry-run: a patch that reverses cleanly is already
# applied; one that applies cleanly is applied; anything else stops the script before any file
# is touched, with the rejected hunks and the likely reason. Exit status: 0 done, 1 not applied
# (--check) or a patch does not fit, 2 bad usage or not a core_v0.16.1 checkout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_dir="${MEGATRON_EXT_PATCHES:-$here/../patches/core_v0.16.1}"
want_version="0.16.1"
mode=apply

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) mode=check; shift ;;
    --reverse) mode=reverse; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "apply_patches.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -ne 1 ]]; then
  usage >&2
  exit 2
fi
dir="$1"

if [[ ! -d "$dir" ]]; then
  echo "apply_patches.sh: $dir is not a directory" >&2
  exit 2
fi
info="$dir/megatron/core/package_info.py"
if [[ ! -f "$info" || ! -f "$dir/pretrain_gpt.py" || ! -f "$dir/megatron/training/training.py" ]]; then
  echo "apply_patches.sh: $dir is not a Megatron-LM checkout (no pretrain_gpt.py, megatron/training/ and" \
       "megatron/core/package_info.py); clone NVIDIA/Megatron-LM and check out tag core_v$want_version" >&2
  exit 2
fi
version="$(sed -n 's/^MAJOR = \([0-9]*\)$/\1/p; s/^MINOR = \([0-9]*\)$/\1/p; s/^PATCH = \([0-9]*\)$/\1/p' "$info" | paste -sd. -)"
if [[ "$version" != "$want_version" ]]; then
  echo "apply_patches.sh: $dir is Megatron-LM core ${version:-of an unknown version}; these patches are for" \
       "core_v$want_version (git -C $dir checkout core_v$want_version)" >&2
  exit 2
fi
if ! command -v patch >/dev/null 2>&1; then
  echo "apply_patches.sh: needs the 'patch' program (apt-get install patch)" >&2
  exit 2
fi
if [[ ! -f "$patch_dir/series" ]]; then
  echo "apply_patches.sh: no patch series at $patch_dir/series" >&2
  exit 2
fi
mapfile -t series < <(grep -v '^[[:space:]]*\(#\|$\)' "$patch_dir/series")

# state PATCH -> applied | unapplied | conflict (dry runs only: nothing is written)
state() {
  if patch -d "$dir" -p1 -R --dry-run -s -f <"$patch_dir/$1" >/dev/null 2>&1; then
    echo applied
  elif patch -d "$dir" -p1 --dry-run -s -f <"$patch_dir/$1" >/dev/null 2>&1; then
    echo unapplied
  else
    echo conflict
  fi
}

explain_conflict() {
  local p="$1"
  echo "apply_patches.sh: $p does not apply to $dir, nor is it already applied. The dry run says:" >&2
  patch -d "$dir" -p1 --dry-run -f <"$patch_dir/$p" 2>&1 | sed 's/^/  /' >&2 || true
  local files
  files="$(sed -n 's#^+++ b/\([^[:space:]]*\).*#\1#p' "$patch_dir/$p" | paste -sd' ' -)"
  echo "The lines it changes were edited in this checkout (local changes or another tool's patch)." >&2
  if git -C "$dir" rev-parse --git-dir >/dev/null 2>&1; then
    echo "Local changes to those files: git -C $dir diff -- $files" >&2
    echo "To start from the pristine tag: git -C $dir checkout core_v$want_version -- $files" >&2
  else
    echo "Compare $files with a fresh core_v$want_version copy, or restore them from one." >&2
  fi
}

declare -A st
bad=0
for p in "${series[@]}"; do
  if [[ ! -f "$patch_dir/$p" ]]; then
    echo "apply_patches.sh: the series names $p, which is not in $patch_dir" >&2
    exit 2
  fi
  st[$p]="$(state "$p")"
  [[ "${st[$p]}" == conflict ]] && bad=1
done

case "$mode" in
  check)
    for p in "${series[@]}"; do
      case "${st[$p]}" in
        applied) echo "$p: applied" ;;
        unapplied) echo "$p: not applied" ;;
        conflict) echo "$p: does not apply (conflict)" ;;
      esac
    done
    for p in "${series[@]}"; do [[ "${st[$p]}" == applied ]] || exit 1; done
    exit 0
    ;;
  apply)
    if [[ $bad -ne 0 ]]; then
      for p in "${series[@]}"; do [[ "${st[$p]}" == conflict ]] && explain_conflict "$p"; done
      echo "apply_patches.sh: nothing was changed" >&2
      exit 1
    fi
    n=0
    for p in "${series[@]}"; do
      if [[ "${st[$p]}" == applied ]]; then
        echo "$p: already applied"
      else
        patch -d "$dir" -p1 -s -f --no-backup-if-mismatch <"$patch_dir/$p"
        echo "$p: applied"
        n=$((n + 1))
      fi
    done
    if [[ $n -eq 0 ]]; then
      echo "Megatron-LM at $dir: all ${#series[@]} patches already applied"
    else
      echo "Megatron-LM at $dir: applied $n of ${#series[@]} patches (core_v$want_version)"
    fi
    ;;
  reverse)
    if [[ $bad -ne 0 ]]; then
      for p in "${series[@]}"; do [[ "${st[$p]}" == conflict ]] && explain_conflict "$p"; done
      echo "apply_patches.sh: nothing was changed" >&2
      exit 1
    fi
    for ((i = ${#series[@]} - 1; i >= 0; i--)); do
      p="${series[$i]}"
      if [[ "${st[$p]}" == applied ]]; then
        patch -d "$dir" -p1 -R -s -f --no-backup-if-mismatch <"$patch_dir/$p"
        echo "$p: reversed"
      else
        echo "$p: not applied"
      fi
    done
    ;;
esac
