#!/bin/bash
# One GPU call for [gpu-speed]: how torch builds and configures its cuDNN SDPA graph at head dim 64
# (TinyLlama's shape: 32 query heads, 4 KV heads, causal, bf16) against our graph, from cuDNN's own
# logs: the frontend log of a torch run (graph JSON, engine, knobs) and the backend API log of both
# (every descriptor attribute, the engine configuration and knobs of the plan that ran), plus the
# fwd+bwd times of both at 16K. Run with .device carried; everything comes back in $OUT/all.tar.gz.
set -u
W=$OUT/w; mkdir -p $W
trap 'cd $OUT && gzip -f w/*.log 2>/dev/null; tar -czf all.tar.gz -C w . && rm -rf w && ls -la all.tar.gz' EXIT
source scripts/device/env.sh
source scripts/device/unpack-build.sh || exit 1
S=${PROBE_S:-16384}
cat > $W/torch_probe.py <<PY
import torch, torch.nn.functional as F, sys
from torch.nn.attention import sdpa_kernel, SDPBackend
S = int(sys.argv[1]); H, KV, D = 32, 4, 64
q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
do = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
def fb():
    q.grad = k.grad = v.grad = None
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
fb(); torch.cuda.synchronize()
import time
ts = []
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fb(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
print("torch cudnn fwd+bwd ms", sorted(ts)[5])
PY
CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=$W/torch_frontend.log CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=$W/torch_backend.log \
  timeout 120 python3 $W/torch_probe.py $S > $W/torch_probe.out 2>&1
echo "torch rc $?"; tail -2 $W/torch_probe.out
CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=$W/ours_backend.log timeout 120 build-carry/bench/attention_bench --lengths $S \
  --kv-heads 4 --head-dim 64 --warmup 1 --reps 5 --layouts bhsd,bhsd+hstats,fused+hstats > $W/ours_probe.out 2>&1
echo "ours rc $?"; grep -E "S=" $W/ours_probe.out | tail -2
ls -la $W
