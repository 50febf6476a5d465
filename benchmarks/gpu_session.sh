#!/usr/bin/env bash
# Everything that needs a GPU, in one command: check, tune, measure.
#
#   benchmarks/gpu_session.sh STAGE[:SECONDS] ...
#
# Stages: env, tests, tune, bench-moe, bench-dense-gemv, bench-engine, bench-engine-hf, bench-overlap, bench-mla,
# bench-engine-deepseek, bench-engine-families (gpt-oss-20b; GLM-4.5-Air fp8 on an H200),
# bench-piecewise (prefill and mixed steps, piecewise CUDA graphs off vs on),
# bench-quant (8-bit experts: bench-engine with bf16, int8, fp8, fp8-block experts), bench-mxfp4 (the MoE kernel
# with MXFP4 experts against bf16 and 8 bits at gpt-oss-20b's expert shape), bench-mla (the MLA decode
# kernel on DeepSeek-V3 shapes, with a sweep of its launch alternatives), bench-engine-deepseek (the engine on
# DeepSeek-V2-Lite's shape), lora-tests, bench-lora and bench-lora-realistic (LoRA adapters: the delta kernel, tests, throughput
# against the base model at the small and the realistic shape), batch-three-ways, batch-goals
# (plus any stage name below). Each runs under its own time limit, so one that fails or
# hangs still leaves the others' results; logs and JSON land in $OUT (default
# /tmp/moegate-gpu), re-archived after every stage as gpu_session.tgz so a
# session cut off at its limit still returns what it did.
#
#   benchmarks/gpu_session.sh --dry-run STAGE ...
#
# checks the stages on any machine in seconds: each `$PY -m MODULE ARGS` a stage would run is recorded instead
# (benchmarks/dry_run.py), then every module is imported and its arguments parsed by its own parser; exit 1 names
# a command that would fail (the test suite runs this for every stage).
set -u
DRY_RUN=
if [ "${1:-}" = --dry-run ]; then
    DRY_RUN=$(mktemp -d)
    shift
fi
OUT=${OUT:-${DRY_RUN:-/tmp}/moegate-gpu}
WORK=${DRY_RUN:-/tmp}/moegate-gpu-work
mkdir -p "$OUT" "$WORK/configs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Tuned launch configs go where launch_config looks first, and travel back in the archive.
export MOEGATE_MOE_CONFIG_DIR=$WORK/configs
export PY=${PY:-python3}
if [ -n "$DRY_RUN" ]; then
    CHECK_PY=$PY
    export PY="$PY benchmarks/dry_run.py --record $DRY_RUN/commands.jsonl"
fi

run_stage() {  # name seconds command...
    local name=$1 limit=$2
    shift 2
    if [ -n "$DRY_RUN" ]; then  # record the stage's python commands; nothing else runs
        [ "$name" = env ] || "$@" >/dev/null 2>&1
        return
    fi
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    echo "=== $name rc=$? $(date +%T)" | tee -a "$WORK/$name.log"
    tail -n "${TAIL:-25}" "$WORK/$name.log"
    tar czf "$OUT/gpu_session.tgz" -C "$WORK" .
}

tune_all() {  # the three benchmark shapes (bench.MODELS); TUNE_TOKENS=1,2,4 re-tunes only those (merged)
    local tokens=${TUNE_TOKENS:+--tokens $TUNE_TOKENS}
    cp moe_kernels/configs/E=*.json "$MOEGATE_MOE_CONFIG_DIR"/ 2>/dev/null
    $PY -m benchmarks.tune_moe --E 8 --topk 2 --H 4096 --I 14336 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" &&
    $PY -m benchmarks.tune_moe --E 128 --topk 8 --H 2048 --I 768 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" &&
    $PY -m benchmarks.tune_moe --E 64 --topk 8 --H 2048 --I 1024 $tokens --out "$MOEGATE_MOE_CONFIG_DIR"
}
export -f tune_all

for spec in "$@"; do
    name=${spec%%:*}
    limit=${spec#*:}
    [ "$limit" = "$spec" ] && limit=300
    case $name in
        env) run_stage env "$limit" bash -c 'nvidia-smi; '"$PY"' -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
        tests) run_stage tests "$limit" $PY -m pytest -q -ra -p no:cacheprovider --durations=15 tests/moe_kernels \
            tests/engine/kernels/test_triton_elementwise.py tests/engine/kernels/test_dense_gemv.py \
            tests/engine/worker/test_cuda_graphs.py tests/engine/worker/test_piecewise_graphs.py tests/engine/kernels/test_triton_attention.py tests/engine/kernels/test_triton_attention_engine.py \
            tests/engine/kernels/test_triton_mla_attention.py \
            tests/engine/kernels/test_triton_backend_engine.py tests/engine/worker/test_host_syncs.py tests/engine/loading/test_random_weights.py \
            tests/engine/loading/test_quantized_experts.py tests/engine/worker/test_expert_load.py tests/engine/worker/test_overlap.py \
            tests/engine/kv_tiers/test_prefix_tiers.py::test_tiers_on_equals_off_cuda \
            --deselect tests/engine/loading/test_random_weights.py::test_command_lines_take_random_weights ;;
        tune) run_stage tune "$limit" bash -c tune_all ;;
        bench-moe) run_stage bench-moe "$limit" bash -c "$PY -m benchmarks.moe_backends --json > $WORK/bench_moe.json && $PY -c 'import json, benchmarks.moe_backends as b; print(b.format_table(json.load(open(\"$WORK/bench_moe.json\"))))'" ;;
        # The dense projections: Triton gemv vs F.linear per shape at 1/4/8 rows (the engine-start selection).
        bench-dense-gemv) run_stage bench-dense-gemv "$limit" $PY -m benchmarks.dense_gemv --json "$WORK/bench_dense_gemv.json" ;;
        # Decode with every projection on cuBLAS, to set beside bench-engine's default (measured gemv choice).
        bench-engine-gemv-off) run_stage bench-engine-gemv-off "$limit" $PY -m benchmarks.engine_gpu --skip-hf --dense-gemv off \
            --concurrency 1,8 --json "$WORK/bench_engine_gemv_off.json" ;;
        # The MLA decode kernel alone: h = 16 and 128 heads, batch 1/32/128, context 1k/4k/16k, GB/s against the
        # copy peak and the datasheet, each shape checked against float64; the sweep times the launch alternatives.
        # About 18 shapes x 17 timings plus ~25 compiles: should fit 300 s (not yet run on a GPU).
        bench-mla) run_stage bench-mla "$limit" $PY -m benchmarks.mla_decode --sweep --json "$WORK/bench_mla.json" ;;
        # The engine on DeepSeek-V2-Lite's shape (MLA: latent cache, Triton MLA decode, decode CUDA graphs; 15.7B
        # parameters in bf16), against transformers too.
        bench-engine-deepseek) run_stage bench-engine-deepseek "$limit" $PY -m benchmarks.engine_gpu --preset deepseek-v2-lite \
            --json "$WORK/bench_engine_deepseek.json" ;;
        # The newer families at real size with random weights, one process each: gpt-oss-20b (bf16, ~39 GiB) and
        # GLM-4.5-Air with fp8 experts (~110 GB: only where the GPU has room, an H200).
        bench-engine-families) run_stage bench-engine-families "$limit" bash -c "\
            $PY -m benchmarks.engine_gpu --preset gpt-oss-20b --concurrency 1,32,128 --json $WORK/bench_engine_gpt_oss.json \
                || echo bench-engine-families: gpt-oss-20b failed; \
            if [ \$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 0) -gt 120000 ] \
                || [ -n '$DRY_RUN' ]; then \
                $PY -m benchmarks.engine_gpu --skip-hf --preset glm-4.5-air --quantization fp8 --concurrency 1,32,128 \
                    --json $WORK/bench_engine_glm45_air_fp8.json || echo bench-engine-families: glm-4.5-air failed; \
            else echo bench-engine-families: glm-4.5-air fp8 needs more than 120 GB of GPU memory, skipped; fi" ;;
        bench-engine) run_stage bench-engine "$limit" $PY -m benchmarks.engine_gpu --skip-hf ${ENGINE_ARGS:-} --json "$WORK/bench_engine.json" ;;
        bench-engine-unfused) run_stage bench-engine-unfused "$limit" $PY -m benchmarks.engine_gpu --skip-hf --elementwise torch \
            --concurrency 1,8,128 --json "$WORK/bench_engine_unfused.json" ;;
        # 8-bit routed experts: bench-engine with bf16 experts, then int8, fp8 and fp8-block (128x128) on the same
        # preset (QUANT_PRESET, default olmoe-1b-7b, small enough that the four runs should fit one 10-minute
        # command; not yet timed on a GPU), one process each; then the weight memory of every preset.
        bench-quant) run_stage bench-quant "$limit" bash -c "for q in none int8 fp8 fp8-block; do \
            args=\$([ \$q = none ] || echo --quantization \$q); \
            $PY -m benchmarks.engine_gpu --skip-hf --preset ${QUANT_PRESET:-olmoe-1b-7b} --concurrency 1,8,64 \$args \
                --json $WORK/bench_quant_\$q.json || echo bench-quant: \$q failed; done; \
            $PY -m benchmarks.quantized_experts memory" ;;
        # gpt-oss's experts in MXFP4: the fused MoE kernel's tokens/s at gpt-oss-20b's expert shape, bf16 vs int8 vs
        # fp8 vs mxfp4 side by side, then the expert weight memory per mode; then the MXFP4 tests on the GPU.
        bench-mxfp4) run_stage bench-mxfp4 "$limit" bash -c "$PY -m benchmarks.mxfp4_experts kernel --tokens 1,8,64,512 \
            --rounds 5; $PY -m benchmarks.mxfp4_experts memory; \
            $PY -m pytest -q -p no:cacheprovider tests/moe_kernels/test_mxfp4.py tests/engine/loading/test_mxfp4.py" ;;
        # Prefill 512 against its floor and mixed prefill+decode steps, piecewise CUDA graphs off vs on, and the
        # start-up time capturing them costs.
        bench-piecewise) run_stage bench-piecewise "$limit" $PY -m benchmarks.piecewise_graphs --json "$WORK/bench_piecewise.json" ;;
        # Host time per step on the critical path, synchronous vs overlapped, with one tenant asking for logprobs
        # or a penalty in each batch (such a request keeps the batch overlapped).
        # LoRA: the experts' delta kernel and the mixed-batch tests (transformers + PEFT) on CUDA, then 8 adapters
        # against the base model on a small Qwen3-MoE in bfloat16 (not yet run on a GPU).
        lora-tests) run_stage lora-tests "$limit" $PY -m pytest -q -ra -p no:cacheprovider \
            tests/engine/kernels/test_lora_experts_kernel.py tests/engine/lora ;;
        bench-lora) run_stage bench-lora "$limit" $PY -m benchmarks.lora_throughput --device cuda --dtype bfloat16 \
            --requests 256 --rounds 3 ;;
        # The same at Qwen3-30B-A3B's hidden and expert widths (adapter factors 17% of the experts' bytes).
        bench-lora-realistic) run_stage bench-lora-realistic "$limit" $PY -m benchmarks.lora_throughput --device cuda \
            --dtype bfloat16 --shape realistic --requests 256 --rounds 3 ;;
        bench-overlap) run_stage bench-overlap "$limit" $PY -m benchmarks.step_overlap --device cuda --asks none,logprobs,penalty ;;
        bench-engine-hf) run_stage bench-engine-hf "$limit" $PY -m benchmarks.engine_gpu --json "$WORK/bench_engine_hf.json" ;;
        # Batch API goal 2 (with no live traffic, a batch's output tokens/s at 90% or more of the offline engine's on
        # the same requests) where the gateway has cores of its own and the engine a GPU (the demo model).
        # Needs the gateway's packages, which a bare GPU machine may lack: benchmarks/device_wheels.sh writes them
        # as wheels into .whl/; copy that to the GPU machine and install them first (the script's comment has the command).
        batch-three-ways) run_stage batch-three-ways "$limit" $PY -m benchmarks.batch_three_ways --chunks 6 --lines 2000 ;;
        batch-goals) run_stage batch-goals "$limit" $PY -m benchmarks.batch_goals --skip-live --rounds 4 --cpu ;;
        *) echo "unknown stage $name" >&2; exit 2 ;;
    esac
done
if [ -n "$DRY_RUN" ]; then
    $CHECK_PY benchmarks/dry_run.py --check "$DRY_RUN/commands.jsonl"
    rc=$?
    rm -rf "$DRY_RUN"
    exit $rc
fi
