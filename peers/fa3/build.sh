#!/usr/bin/env bash
# Build FlashAttention-3's Hopper forward (bf16, head dims 64/128/256, sm_90a) as
# build/peers/fa3/libfa3_peer.so: a benchmark peer for `python -m fa4.bench --fa3-lib ...`,
# never part of the fa4 package. Sources come from git mirrors of Dao-AILab/flash-attention and
# of NVIDIA/cutlass at the flash-attention commit's csrc/cutlass pin (the library's `fetch`
# tool puts them under /work/.mirror). Needs nvcc (CUDA >= 12.3); ~4 min on 2 cores.
#   peers/fa3/build.sh                 incremental (objects kept in build/peers/fa3/obj)
#   JOBS=1 FA_REPO=... CUTLASS_REPO=... FA_COMMIT=<sha> peers/fa3/build.sh
# The launcher (fa3_peer.cu) fills Flash_fwd_params as upstream's mha_fwd does for dense
# inputs and links cudart statically with every symbol but fa3_peer_* kept local.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT_DIR:-$HERE/../../build/peers/fa3}
FA_REPO=${FA_REPO:-/work/.mirror/Dao-AILab+flash-attention/repo}
CUTLASS_REPO=${CUTLASS_REPO:-/work/.mirror/NVIDIA+cutlass/repo}
FA_COMMIT=${FA_COMMIT:-$(git -C "$FA_REPO" rev-parse HEAD)}
CUTLASS_COMMIT=${CUTLASS_COMMIT:-$(git -C "$FA_REPO" ls-tree "$FA_COMMIT" csrc/cutlass | awk '{print $3}')}
mkdir -p "$OUT"
cd "$OUT"
stamp="$FA_COMMIT $CUTLASS_COMMIT"
if [[ ! -f src/.stamp || "$(cat src/.stamp)" != "$stamp" ]]; then
    echo "extracting flash-attention $FA_COMMIT hopper/ and cutlass $CUTLASS_COMMIT include/"
    rm -rf src obj libfa3_peer.so
    mkdir -p src/cutlass
    git -C "$FA_REPO" archive "$FA_COMMIT" hopper | tar -x -C src
    git -C "$CUTLASS_REPO" archive "$CUTLASS_COMMIT" include | tar -x -C src/cutlass
    echo "$stamp" > src/.stamp
fi
cp "$HERE"/fa3_peer.cu "$HERE"/fa3_peer_check.h "$HERE"/fa3_peer.map "$HERE"/Makefile .
make -j"${JOBS:-2}" all
nm -D --defined-only libfa3_peer.so | grep fa3_peer
if ldd libfa3_peer.so | grep -q "libcudart\|libtorch"; then echo "unexpected runtime dependency" >&2; exit 1; fi
ls -l "$OUT/libfa3_peer.so"
