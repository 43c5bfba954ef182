# Shared by the GPU scripts (sourced): a time budget, and each stage under a cap inside it.
#   TOTAL (seconds) and START (set here) bound the run; MARGIN: seconds kept back after each stage's cap;
#   MIN_STAGE: a stage with less time than this is skipped. gpu_report FILE: what the machine says it is.
START=$SECONDS
MARGIN=${MARGIN:-10}
MIN_STAGE=${MIN_STAGE:-15}

left() { echo $((TOTAL - (SECONDS - START))); }

run_capped() {  # run_capped NAME CAP CMD...: CMD under min(CAP, time left - MARGIN); skipped below MIN_STAGE s
  local name=$1 cap=$2 t
  shift 2
  t=$(($(left) - MARGIN))
  ((t > cap)) && t=$cap
  if ((t < MIN_STAGE)); then echo "== $name: skipped, $(left) s left"; return 1; fi
  echo "== $name: up to $t s (at $((SECONDS - START)) s)"
  timeout -k 5 "$t" "$@"
  local rc=$?
  echo "== $name: rc=$rc at $((SECONDS - START)) s"
  return $rc
}
