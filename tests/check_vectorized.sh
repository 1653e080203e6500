#!/usr/bin/env bash
# Static check that the CPU kernels were vectorised as intended: the AVX-512 variants of the
# tile kernels must contain 512-bit FMAs (zmm) and the AVX2 variants 256-bit FMAs (ymm).
# Auto-vectorisation can silently regress with a compiler or flag change; this catches it.
#   tests/check_vectorized.sh <path to libflashattn>
set -euo pipefail
lib=$1
asm=$(objdump -d -C --no-show-raw-insn "$lib")
status=0
check() {  # <function name> <instruction regex> <what>
  local n
  n=$(awk -v f="$1(" 'index($0, f) && /^[0-9a-f]+ <.*>:$/ {on=1; next} /^$/ {on=0} on' <<<"$asm" |
      grep -cE "$2" || true)
  if ((n > 0)); then
    echo "ok: $1 has $n $3"
  else
    echo "FAIL: $1 has no $3"
    status=1
  fi
}
for k in gemm_f32 gemm_tn_f32 gemm_f64; do
  check "${k}_avx512" 'vfmadd[0-9]+p[sd][[:space:]].*zmm' "512-bit FMA instructions"
  check "${k}_avx2" 'vfmadd[0-9]+p[sd][[:space:]].*ymm' "256-bit FMA instructions"
done
check exp2_columns_f32_avx512 'vfmadd[0-9]+ps[[:space:]].*zmm' "512-bit FMA instructions"
check column_max_f32_avx512 'vmaxps[[:space:]].*zmm' "512-bit max instructions"
exit $status
