#!/usr/bin/env bash
# Upstream FlashAttention-4 (flash_attn.cute, CuTe DSL JIT) on the GPU machine, which has no network
# and no DSL: source this in each device call. The installed wheels (../shared/ANCHORS.md lists them;
# `pip install --no-deps --target up_site ...`, then `tar cJ up_site | split -b 16000000 -d -a 1 - part`)
# are 70 MB compressed, more than one call carries beside fa4's library, so they travel in parts
# (build/up/<dir>/partN plus build/up/<dir>/SHA256 of the whole archive), one carried dir per call,
# in calls made back to back while the machine stays warm: each call copies its parts to
# /tmp/up_stage, and once all have arrived (the archive's checksum matches) the archive is unpacked
# to /tmp/up_site and put on the path (a sitecustomize adds it as a site dir: the DSL finds its
# modules through a .pth file). FA4UP_READY=1 when flash_attn.cute can be imported.
mkdir -p /tmp/up_stage
cp build/up/*/part* /tmp/up_stage/ 2>/dev/null
want=$(cat build/up/*/SHA256 2>/dev/null | head -1)
FA4UP_READY=0
if [ ! -d /tmp/up_site ] && [ -n "$want" ]; then
  have=$(cat /tmp/up_stage/part* | sha256sum | cut -d' ' -f1)
  if [ "$have" = "$want" ]; then
    cat /tmp/up_stage/part* | xz -d | tar xf - -C /tmp
  else
    echo "upstream FA4: $(ls /tmp/up_stage | wc -l) parts staged, archive incomplete"
  fi
fi
if [ -d /tmp/up_site ]; then
  mkdir -p /tmp/up_sc
  echo "import site; site.addsitedir('/tmp/up_site')" > /tmp/up_sc/sitecustomize.py
  export PYTHONPATH="/tmp/up_sc${PYTHONPATH:+:$PYTHONPATH}"
  FA4UP_READY=1
fi
export FA4UP_READY
