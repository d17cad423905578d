#!/usr/bin/env bash
# The projection of benchmarks/results/simulate/README.md: Llama-7B on 1024 GPUs, then the
# same methods on the other cluster presets and with faster codecs. Model only: runs in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=benchmarks/results/simulate
METHODS=none,fp16,powersgd:approx_rank=4,onebit-adam,onebit-adam:fused=true

python -m gradzip simulate --model llama-7b --gpus 1024 --cluster h100-100gbe \
    --compressors "$METHODS" --price-per-gpu-hour 3.5 --out "$OUT/llama-7b_h100-100gbe"
for cluster in h100-400ib l40s-25gbe h100-xregion-1gbit; do
    python -m gradzip simulate --model llama-7b --gpus 1024 --cluster "$cluster" \
        --compressors "$METHODS" --no-plot --out "$OUT/llama-7b_$cluster"
done
python -m gradzip simulate --model llama-7b --gpus 1024 --cluster h100-100gbe --compressors "$METHODS" \
    --codec-gbps 1000 --no-plot --out "$OUT/llama-7b_h100-100gbe_codec1000"
python -m gradzip simulate --model llama-7b --gpus 1024 --cluster h100-100gbe --strategy fsdp \
    --compressors none,fp16,powersgd:approx_rank=4,topk:ratio=0.01 --no-plot --out "$OUT/llama-7b_h100-100gbe_fsdp"
