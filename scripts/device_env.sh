# Sourced by the device-side scripts (gpu_check, ab_bench, ncu_ab, ncu_peer, tune_schedule):
# run from the repository root, logs under $OUT, and `import fa4` from the working tree without
# installing it (the GPU machine has no DSL and no compiler: torch_ops/fa4 is the package, with
# the carried build outputs in torch_ops/fa4/_native).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/fa4_out}
mkdir -p "$OUT"
# Archives from scripts/carry_pack.sh: each replaces its path, once per call (the archive is
# removed once unpacked, so scripts that source this again keep what the call has swapped in).
for archive in build/carry/*.tar.xz; do
  [ -f "$archive" ] || continue
  target=$(basename "$archive" .tar.xz); target=${target//+//}
  rm -rf "$target" && tar xJf "$archive" && rm -f "$archive" && echo "unpacked $target"
done
export PYTHONPATH=$PWD/torch_ops:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# profile_with_ncu REPORT KERNEL_REGEX "NCU_ARGS" PROFILE_ONE_ARGS...: the 4th launch of the
# kernels matching KERNEL_REGEX in `scripts/profile_one.py PROFILE_ONE_ARGS` under Nsight Compute
# with the clocks left as they run (--clock-control none); keeps REPORT.log and
# REPORT.details.txt, plus REPORT.sass.csv (per-instruction source page) when FA4_NCU_SASS=1.
profile_with_ncu() {
  local rep=$1 kernels=$2 ncu_args=$3; shift 3
  ncu --clock-control none --launch-skip 3 --launch-count 1 -k "$kernels" $ncu_args \
      -o "$rep" -f python3 scripts/profile_one.py "$@" > "$rep.log" 2>&1
  ncu --import "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1
  if [ "${FA4_NCU_SASS:-0}" = 1 ]; then
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
  fi
  rm -f "$rep.ncu-rep"
}
