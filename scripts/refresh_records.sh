#!/usr/bin/env bash
# Re-run the records behind docs/results.md and the README, one after another, each through
# scripts/record_run.py with the command it was recorded with; then render the pages.
#   bash scripts/refresh_records.sh [--dry-run] [--stale-only] [NAME ...]
# --dry-run prints the plan (NAME<TAB>COMMAND a line) and runs nothing; --stale-only keeps the
# records that are not current; NAMEs keep only those records. Records that ran on more CPUs than
# this machine has are left out (scripts/render_results.py --refresh-plan decides). A record whose
# command fails keeps its old file; the others still run, and the exit status is 1.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || py=python3
dry=0 plan_args=() names=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    --stale-only) plan_args+=(--stale-only) ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "refresh_records.sh: unknown option $a" >&2; exit 2 ;;
    *) names+=("$a") ;;
  esac
done
plan=$("$py" scripts/render_results.py --refresh-plan "${plan_args[@]}")
if [ ${#names[@]} -gt 0 ]; then
  for n in "${names[@]}"; do
    grep -q "^$n	" <<<"$plan" || { echo "refresh_records.sh: no record $n to run" >&2; exit 2; }
  done
  plan=$(grep -E "^($(IFS='|'; echo "${names[*]}"))	" <<<"$plan")
fi
if [ "$dry" = 1 ]; then
  printf '%s\n' "$plan"
  exit 0
fi
failed=0
while IFS=$'\t' read -r name cmd; do
  [ -n "$name" ] || continue
  eval "argv=($cmd)"  # cmd is shlex-quoted by render_results.py
  echo "refresh_records.sh: $name: $cmd" >&2
  "$py" scripts/record_run.py "$name" -- "${argv[@]}" </dev/null || failed=1
done <<<"$plan"
"$py" scripts/render_results.py
exit "$failed"
