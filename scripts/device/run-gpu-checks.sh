#!/bin/bash
# One GPU call (scripts/device/): the Hugging Face goldens with transformers on the GPU, the GPU tests,
# the tokenizer.json fixture, and the TinyLlama-shaped context extension (configs/extend-tinyllama-64k-*).
# Run in the repository root on the GPU machine, with .device (devroot + bin.tar.xz) and data-cache/
# (janeausten, austen-shards, austen-4k.model) carried; everything comes back in $OUT/all.tar.gz.
set -u
source scripts/device/session.sh
python3 -c "import transformers,torch,tokenizers,safetensors;print(transformers.__version__,torch.__version__,tokenizers.__version__,safetensors.__version__)" > $W/versions.txt 2>&1
stamp start; cat $W/versions.txt
TV=$(python3 -c "import transformers;print(transformers.__version__)")
GOLDENS_REPORT=$W/goldens.json TRANSFORMERS_COMMIT="v$TV (PyPI wheel, no git checkout)" timeout 240 python3 tests/fixtures/hf_parity/make_goldens.py > $W/goldens.log 2>&1
stamp "goldens rc $?"; tail -20 $W/goldens.log
for d in tests/fixtures/hf_parity/*/; do n=$(basename $d); mkdir -p $W/goldens/$n; cp $d/golden.safetensors $W/goldens/$n/ 2>/dev/null; done
timeout 300 build-carry/tests/gpu/gpu_test --gtest_print_time=1 --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
stamp "gpu_test rc $?"; grep -E "FAILED|PASSED|SKIPPED \]" $W/gpu_test.log | tail -25
grep HF_PARITY_GPU $W/gpu_test.log > $W/hf_parity_gpu.txt
timeout 120 build-carry/tests/gpu/distributed_attention_gpu_test > $W/dist_gpu.log 2>&1
stamp "distributed_attention_gpu_test rc $?"; tail -5 $W/dist_gpu.log
tokfix_script=${TOKENIZER_FIXTURE_SCRIPT:-tests/fixtures/hf_tokenizer/make_fixture.py}
[ -f "$tokfix_script" ] && timeout 150 python3 "$tokfix_script" data-cache/janeausten $W/tokfix --reuse tests/fixtures/hf_tokenizer > $W/tokfix.log 2>&1
stamp "tokenizer fixture rc $?"; tail -3 $W/tokfix.log
timeout 150 python3 scripts/gpu/make_random_hf_llama.py runs/tinyllama-random --vocab-size 4096 > $W/tinyllama.log 2>&1
stamp "tinyllama rc $?"; tail -2 $W/tinyllama.log; cp runs/tinyllama-random/config.json $W/tinyllama-config.json
LT=build-carry/tools/longtrain/longtrain
timeout 60 $LT eval --checkpoint runs/tinyllama-random --data data-cache/austen-shards --device cuda --seq-len 65536 --batches 1 > $W/eval-before-64k.log 2>&1
stamp "eval before rc $?"; tail -4 $W/eval-before-64k.log
for t in llama3 yarn; do
  timeout 170 $LT train configs/extend-tinyllama-64k-$t.yaml > $W/extend-$t.log 2>&1
  stamp "extend $t rc $?"; grep -E "step|loss" $W/extend-$t.log | tail -12
  ck=$(ls -d runs/extend-tinyllama-64k-$t/checkpoints/step_* 2>/dev/null | tail -1)
  [ -n "$ck" ] && timeout 60 $LT eval --checkpoint $ck --data data-cache/austen-shards --device cuda --seq-len 65536 --batches 1 > $W/eval-after-$t.log 2>&1
  stamp "eval after $t rc $?"; tail -4 $W/eval-after-$t.log
  if [ $t = llama3 ] && [ -n "$ck" ]; then
    timeout 90 $LT eval --checkpoint $ck --passkey --lengths 4096,65536 --depths 0,0.5,1 --trials 1 --device cuda --out $W/passkey-$t > $W/passkey-$t.log 2>&1
    stamp "passkey $t rc $?"; tail -6 $W/passkey-$t.log
  fi
  rm -rf runs/extend-tinyllama-64k-$t/checkpoints
done
stamp end
