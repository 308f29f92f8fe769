#!/usr/bin/env bash
# Build outputs travel to the GPU machine compressed: the device tool carries at most 64 MiB, and
# cubins compress about 19:1 under xz (the 497-variant library: 51 MB -> 2.7 MB), so the full
# library, check builds and A/B builds fit one call together.
#   bash scripts/carry_pack.sh torch_ops/fa4/_native build/ab/s71/an2
# writes build/carry/<path with / as +>.tar.xz per path and prints the carry list; on the device,
# scripts/device_env.sh unpacks each archive over its path (replacing it) before anything runs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/carry
rm -f build/carry/*.tar.xz
for path in "$@"; do
  path=${path%/}
  [ -d "$path" ] || { echo "carry_pack: $path is not a directory" >&2; exit 1; }
  tar cJf "build/carry/${path//\//+}.tar.xz" "$path"
done
du -ch build/carry/*.tar.xz | tail -1
echo 'carry: ["build/carry"]'
