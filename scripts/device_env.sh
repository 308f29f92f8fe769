# Sourced by the device-side scripts (gpu_check, ab_bench, ncu_ab, ncu_peer, tune_schedule):
# run from the repository root, logs under $OUT, and `import fa4` from the working tree
# without installing it (the GPU machine has no DSL and no compiler: torch_ops is linked in as
# the fa4 package, next to the prebuilt torch_ops/_native).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/fa4_out}
mkdir -p "$OUT" /tmp/fa4_pkgs
ln -sfn "$PWD/torch_ops" /tmp/fa4_pkgs/fa4
export PYTHONPATH=/tmp/fa4_pkgs:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
