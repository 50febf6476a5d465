#!/usr/bin/env bash
# Everything that needs a GPU, in one command, in priority order, inside a time budget.
#
#   benchmarks/gpu_session.sh [--budget SECONDS] [--stages NAME[:SECONDS],...] [STAGE[:SECONDS] ...]
#   benchmarks/gpu_session.sh --list
#   benchmarks/gpu_session.sh --dry-run [STAGE ...]
#
# With no stages named it runs DEFAULT_STAGES (below) in order: correctness of the CUDA-only paths first, then the
# headline goals, then the rest. Each stage runs under its own time limit (the table's, or NAME:SECONDS), cut to
# what is left of --budget (default 480 s: a first call of about 8 minutes, wheel installs included); a stage
# that no longer fits is skipped, not started. After every stage $OUT (default /tmp/moegate-gpu) gets:
#   stages.tsv        one row per stage: status (ok, failed, timeout, skipped), exit code, seconds, estimate, limit
#   gpu_session.tgz   every stage's log and JSON (and tuned launch configs), so a run killed at its limit still
#                     returns what finished
# and the end of the output names the command for a second call that runs what did not finish (its budget:
# NEXT_BUDGET, default 240 s, what a 15-minute lease leaves after a machine start and a first call of 8 minutes;
# make that call at once, while the machine is still warm, since a fresh start needs 4 minutes left).
#
# Wheels: where .whl/ holds wheels (benchmarks/device_wheels.sh writes them: msgspec, llguidance, openai-harmony
# and the gateway's packages, which the GPU image lacks), they are installed first into a folder of their own
# on PYTHONPATH; the time counts against the budget.
#
# --dry-run checks the stages on any machine in seconds: each `$PY -m MODULE ARGS` a stage would run is recorded
# instead (benchmarks/dry_run.py), then every module is imported and its arguments parsed by its own parser, and
# every test path a pytest stage names must exist; exit 1 names a command that would fail (the test suite runs
# this for every stage). No budget applies in a dry run.
set -u

# name  estimate_s  limit_s. Estimates: seconds measured on an H100 (2026-11-27) or an H200 (2026-11-29 and 11-30: the
# test stages, tune-gpt-oss, the goals but goal-hf, bench-mxfp4, -image-itl, -sparse-*, -spec, -structured, -overlap,
# -piecewise), a little added, where the stage
# ran (env through bench-mla), guesses elsewhere (model build, Triton compiles and transformers' generate counted in).
# tune-gpt-oss: 150 s measured before the MXFP4 search took the swapped-operand grouped GEMMs (about 40% more MXFP4
# candidates up to 64 tokens, twice as many from 128 to 512), so 210 is a guess; bench-swap: bench-planes' 110 s for
# four layers timed at four token counts, a guess.
STAGE_TABLE="
env 15 60
tests-cuda 220 300
tests-paths 55 210
tests-families 90 240
goal-engine 40 270
goal-moe 20 150
goal-hf 90 420
bench-piecewise 45 300
bench-overlap 35 200
bench-quant 300 540
bench-mxfp4 120 240
bench-mla 40 300
bench-sparse-decode 25 240
bench-sparse-prefill 45 300
bench-engine-deepseek 300 540
bench-engine-families 420 590
tune 580 590
tune-gpt-oss 210 420
tests-planes 70 180
bench-planes 110 240
bench-swap 110 240
bench-moe 200 400
bench-dense-gemv 90 200
bench-engine 300 540
bench-engine-hf 420 590
bench-engine-unfused 240 400
bench-engine-gemv-off 200 400
lora-tests 120 240
bench-lora 200 400
bench-lora-realistic 240 480
batch-three-ways 300 540
batch-goals 300 540
bench-structured 35 240
bench-spec 30 300
bench-image-itl 220 360
"
# The first call's order: the CUDA tests first (the 2026 families' FP8-cache cases left transformers' tokens on the
# last run), then MXFP4 experts against bf16 (this card's tuned files ship; tune-gpt-oss again after a kernel change:
# the 4-bit matrix-vector decode as nibble planes, PLANES, is new and in the tuner's space; tests-planes, tune-gpt-oss,
# bench-mxfp4, bench-planes in one call measure it; the swapped-operand grouped GEMMs, SWAP and SPLIT_K, are new too
# and in the search: bench-swap times them forced: docs/decisions/mxfp4-decode.md),
# then what has never run on a GPU (end to end against transformers on the H200, 8-bit experts in the engine,
# DeepSeek-V2-Lite and the newer families at real size), then the goals and the rest.
DEFAULT_STAGES="env tests-cuda tests-paths tests-families tune-gpt-oss bench-mxfp4 bench-swap bench-planes goal-hf bench-quant bench-engine-deepseek
bench-engine-families bench-image-itl goal-engine goal-moe bench-structured bench-spec bench-piecewise bench-overlap bench-mla"

usage() { echo "usage: benchmarks/gpu_session.sh [--dry-run] [--list] [--budget SECONDS] [--stages A,B:SECONDS,...] [STAGE[:SECONDS] ...]" >&2; exit 2; }
table_field() {  # stage column(2: estimate, 3: limit); empty for an unknown stage
    echo "$STAGE_TABLE" | awk -v s="$1" -v c="$2" '$1 == s { print $c }'
}

DRY_RUN= BUDGET=480 SPECS=
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=$(mktemp -d) ;;
        --list) echo "stage estimate_s limit_s (estimates: H100 seconds where measured, guesses elsewhere)"; echo "$STAGE_TABLE" | sed '/^$/d'
                echo "default order: $DEFAULT_STAGES" | tr '\n' ' '; echo; exit 0 ;;
        --budget) [ $# -ge 2 ] || usage; BUDGET=$2; shift ;;
        --budget=*) BUDGET=${1#--budget=} ;;
        --stages) [ $# -ge 2 ] || usage; SPECS="$SPECS ${2//,/ }"; shift ;;
        --stages=*) v=${1#--stages=}; SPECS="$SPECS ${v//,/ }" ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
        -*) echo "gpu_session.sh: unknown option $1" >&2; usage ;;
        *) SPECS="$SPECS $1" ;;
    esac
    shift
done
case $BUDGET in ''|*[!0-9]*) echo "gpu_session.sh: --budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
[ -n "${SPECS// /}" ] || SPECS=$DEFAULT_STAGES
for spec in $SPECS; do  # refuse an unknown stage or a bad limit before anything runs
    name=${spec%%:*}
    [ -n "$(table_field "$name" 3)" ] || { echo "gpu_session.sh: unknown stage $name (see --list)" >&2; exit 2; }
    case $spec in *:*) case ${spec#*:} in ''|*[!0-9]*) echo "gpu_session.sh: bad limit in $spec" >&2; exit 2 ;; esac ;; esac
done

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
SUMMARY=$OUT/stages.tsv
START=$SECONDS
[ -n "$DRY_RUN" ] || printf 'stage\tstatus\trc\tseconds\testimate_s\tlimit_s\n' >"$SUMMARY"
NOT_DONE=

summarize() {  # stage status rc seconds estimate limit: one row in stages.tsv, then the archive
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$SUMMARY"
    cp "$SUMMARY" "$WORK/stages.tsv"
    tar czf "$OUT/gpu_session.tgz" -C "$WORK" .
}

run_stage() {  # name limit command...
    local name=$1 limit=$2 began rc status
    shift 2
    if [ -n "$DRY_RUN" ]; then  # record the stage's python commands; nothing else runs
        [ "$name" = env ] || "$@" >/dev/null 2>&1
        return
    fi
    echo "=== $name (limit ${limit}s, estimate $(table_field "$name" 2)s) $(date +%T)"
    began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    [ $status = ok ] || NOT_DONE="$NOT_DONE $name"
    echo "=== $name $status rc=$rc $((SECONDS - began))s $(date +%T)" | tee -a "$WORK/$name.log"
    tail -n "${TAIL:-25}" "$WORK/$name.log"
    summarize "$name" "$status" "$rc" "$((SECONDS - began))" "$(table_field "$name" 2)" "$limit"
}

WHEELS=${WHEELS:-.whl}  # another folder (or an empty one) for a test of the script
if [ -z "$DRY_RUN" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    began=$SECONDS
    # --no-deps: the wheels are the complete list; a folder of their own keeps the image's packages as they are.
    # Beside $WORK, not in it: the archive of $WORK must stay under the 16 MiB a returned file may have.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK-site" "$WHEELS"/*.whl
    rc=$?
    export PYTHONPATH=$PYTHONPATH:$WORK-site  # after the image's own: torch's dependencies stay the image's
    echo "=== wheels rc=$rc $((SECONDS - began))s"
    summarize wheels "$([ $rc = 0 ] && echo ok || echo failed)" "$rc" "$((SECONDS - began))" 20 -
fi

# The three benchmark shapes (bench.MODELS), then gpt-oss-20b's MXFP4 experts (their own files: E=32,N=5760,K=2880,
# dtype=bfloat16,quantization=mxfp4,...); TUNE_TOKENS=1,2,4 re-tunes only those (merged). Each shape runs even if
# one before it failed (the stage still fails), so a bf16 shape's failure does not cost the MXFP4 files.
# The table's 580 s is a guess: 420 guessed for the three shapes, a third more for a fourth whose search compiles
# about 15% more kernels (286 against 247 over the full token ladder). Past the 590 s limit, TUNE_TOKENS cuts it.
tune_all() {
    local tokens=${TUNE_TOKENS:+--tokens $TUNE_TOKENS} rc=0
    cp moe_kernels/configs/E=*.json "$MOEGATE_MOE_CONFIG_DIR"/ 2>/dev/null
    $PY -m benchmarks.tune_moe --E 8 --topk 2 --H 4096 --I 14336 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    $PY -m benchmarks.tune_moe --E 128 --topk 8 --H 2048 --I 768 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    $PY -m benchmarks.tune_moe --E 64 --topk 8 --H 2048 --I 1024 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    $PY -m benchmarks.tune_moe --E 32 --topk 4 --H 2880 --I 2880 --quantization mxfp4 $tokens \
        --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    return $rc
}
export -f tune_all
# gpt-oss-20b's expert shape alone, bf16 and MXFP4, so bench-mxfp4 sets a tuned 4-bit layer beside a tuned bf16 one
# (the token ladder up to 512 unless TUNE_TOKENS says otherwise: the sizes bench-mxfp4 measures and those between).
tune_gpt_oss() {
    local tokens="--tokens ${TUNE_TOKENS:-1,2,4,8,16,32,64,128,256,512}" rc=0
    $PY -m benchmarks.tune_moe --E 32 --topk 4 --H 2880 --I 2880 --quantization mxfp4 $tokens \
        --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    $PY -m benchmarks.tune_moe --E 32 --topk 4 --H 2880 --I 2880 $tokens --out "$MOEGATE_MOE_CONFIG_DIR" || rc=1
    return $rc
}
export -f tune_gpt_oss

# Four test processes: most of a test stage's time is Triton compiling kernels on the host, one at a time per
# process, and the GPU machine has 16 cores.
PYTEST="$PY -m pytest -q -ra -p no:cacheprovider --durations=15 -n ${TEST_WORKERS:-4} --dist loadfile"
for spec in $SPECS; do
    name=${spec%%:*}
    limit=${spec#*:}
    [ "$limit" = "$spec" ] && limit=$(table_field "$name" 3)
    if [ -z "$DRY_RUN" ]; then
        left=$((BUDGET - (SECONDS - START)))
        estimate=$(table_field "$name" 2)
        # Start a stage only where what is left covers half its estimate (and 30 s): a stage cut short early
        # returns nothing, and the time is better left to the next call.
        if [ "$left" -lt 30 ] || [ "$((2 * left))" -lt "$estimate" ]; then
            echo "=== $name skipped: ${left}s of the budget left, estimate ${estimate}s"
            NOT_DONE="$NOT_DONE $name"
            summarize "$name" skipped - 0 "$estimate" "$limit"
            continue
        fi
        [ "$limit" -le "$left" ] || limit=$left
    fi
    case $name in
        env) run_stage env "$limit" bash -c 'nvidia-smi; '"$PY"' -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
        # The Triton kernels compiled (not interpreted), decode and piecewise CUDA graphs, overlap, quantized
        # experts, the prefix-cache tiers' pinned copies and side stream.
        tests-cuda) run_stage tests-cuda "$limit" $PYTEST tests/moe_kernels \
            tests/engine/kernels/test_triton_elementwise.py tests/engine/kernels/test_dense_gemv.py \
            tests/engine/worker/test_cuda_graphs.py tests/engine/worker/test_piecewise_graphs.py tests/engine/kernels/test_triton_attention.py tests/engine/kernels/test_triton_attention_engine.py \
            tests/engine/kernels/test_triton_mla_attention.py tests/engine/kernels/test_sparse_mla_kernel.py \
            tests/engine/kernels/test_delta_rule_kernels.py tests/engine/kernels/test_delta_rule_engine.py \
            tests/engine/kernels/test_sparse_mla_prefill_kernel.py \
            tests/engine/kernels/test_triton_backend_engine.py tests/engine/worker/test_host_syncs.py tests/engine/loading/test_random_weights.py \
            tests/engine/loading/test_quantized_experts.py tests/engine/eplb/test_expert_load.py tests/engine/worker/test_overlap.py \
            tests/engine/kv_tiers/test_prefix_tiers.py::test_tiers_on_equals_off_cuda \
            --deselect tests/engine/loading/test_random_weights.py::test_command_lines_take_random_weights ;;
        # The other never-run device paths, each test's CUDA case (tests/devices.py): grammar masks on the device,
        # the sampler's device path, speculative verification through the decode graphs, MXFP4 experts and gpt-oss's
        # attention sinks against transformers, and the LoRA expert-delta kernel.
        tests-paths) run_stage tests-paths "$limit" bash -c "$PYTEST -k cuda \
            tests/engine/structured_output/test_structured_output.py tests/engine/sampling/test_sampling.py \
            tests/engine/core/test_speculative.py::test_greedy_matches_transformers tests/engine/loading/test_mxfp4.py; \
            a=\$?; $PYTEST tests/engine/kernels/test_lora_experts_kernel.py && exit \$a" ;;
        # The 2026 families (DeepSeek-V3.2, GLM-5 and their FP8 cache, DeepSeek-V4, Qwen3-Next, Qwen3.5-MoE,
        # Kimi-Linear, MiniMax-M3, MiMo-V2-Flash, Step-3.7, Hy3) served on CUDA with its defaults against transformers,
        # chunked and with a prefix-cache pass. One file: its cases spread over the workers (--dist load).
        tests-families) run_stage tests-families "$limit" $PYTEST --dist load \
            tests/engine/models/test_2026_families_cuda.py ;;
        # Goals: decode at batch 1 (and 128) and prefill 512 (and 8192) against their memory/compute floors.
        goal-engine) run_stage goal-engine "$limit" $PY -m benchmarks.engine_gpu --skip-hf --concurrency 1,128 \
            --json "$WORK/goal_engine.json" ;;
        # Goals: the fused MoE's share of HBM bandwidth at 1-64 tokens on Qwen3-30B-A3B's expert shape, and its
        # speed against torch._grouped_mm at >= 4k tokens on Mixtral's.
        goal-moe) run_stage goal-moe "$limit" bash -c "$PY -m benchmarks.moe_backends --models qwen3-30b-a3b \
            --tokens 1,2,4,8,16,32,64 --out $WORK/goal_moe_qwen3.json && $PY -m benchmarks.moe_backends \
            --models mixtral-8x7b --tokens 4096,8192,16384 --out $WORK/goal_moe_mixtral.json" ;;
        # Goal: end to end against transformers (generate and generate_batch) with 128 concurrent requests.
        goal-hf) run_stage goal-hf "$limit" $PY -m benchmarks.engine_gpu --concurrency 128 --json "$WORK/goal_hf.json" ;;
        tune) run_stage tune "$limit" bash -c tune_all ;;
        tune-gpt-oss) run_stage tune-gpt-oss "$limit" bash -c tune_gpt_oss ;;
        # The 4-bit kernels on CUDA alone (the nibble-plane decode and the swapped-operand GEMMs new): tile and plane
        # decode against the float64 decoders, plane dots, the swapped w13 and w2 with K split and not, the MXFP4 and
        # INT4 MoE paths; the same files run in tests-cuda.
        tests-planes) run_stage tests-planes "$limit" $PYTEST tests/moe_kernels/test_planes.py \
            tests/moe_kernels/test_swapped.py tests/moe_kernels/test_mxfp4.py tests/moe_kernels/test_int4.py \
            tests/moe_kernels/test_tune_mxfp4.py ;;
        # The A/B of the 4-bit decode in one process: mxfp4 and int4 with their looked-up launch configs, the decode
        # forced to tiles and to nibble planes, beside bf16, at the token counts the matrix-vector path serves.
        bench-planes) run_stage bench-planes "$limit" $PY -m benchmarks.mxfp4_experts kernel --tokens 1,2,4,8 \
            --rounds 5 --planes ;;
        # The A/B of the MXFP4 grouped GEMMs in one process: bf16 and mxfp4 with their looked-up launch configs
        # beside mxfp4 forced onto the swapped-operand kernels, K whole and split in four, at the goal token counts.
        bench-swap) run_stage bench-swap "$limit" $PY -m benchmarks.mxfp4_experts kernel --tokens 1,8,64,512 \
            --rounds 5 --modes bf16,mxfp4 --swap 1,4 ;;
        # Text streams' ITL p99 while image requests arrive: no images, the default layer-chunked budget, whole
        # images, and a quarter block of an image a step (split over rows), each with the images prepared on the
        # step loop and off it (7 arms of 12 s measured).
        bench-image-itl) run_stage bench-image-itl "$limit" $PY -m benchmarks.image_itl --device cuda --dtype bfloat16 \
            --streams 32 --every 0.25 --images 4 --side 448 --max-batched-tokens 512 --text-layers 16 --vision-depth 8 \
            --token-blocks 196 --seconds 12 ;;
        bench-moe) run_stage bench-moe "$limit" $PY -m benchmarks.moe_backends --out "$WORK/bench_moe.json" ;;
        # The dense projections: Triton gemv vs F.linear per shape at 1/4/8 rows (the engine-start selection).
        bench-dense-gemv) run_stage bench-dense-gemv "$limit" $PY -m benchmarks.dense_gemv --json "$WORK/bench_dense_gemv.json" ;;
        # Decode with every projection on cuBLAS, to set beside bench-engine's default (measured gemv choice).
        bench-engine-gemv-off) run_stage bench-engine-gemv-off "$limit" $PY -m benchmarks.engine_gpu --skip-hf --dense-gemv off \
            --concurrency 1,8 --json "$WORK/bench_engine_gemv_off.json" ;;
        # The MLA decode kernel alone: h = 16 and 128 heads, batch 1/32/128, context 1k/4k/16k, GB/s against the
        # copy peak and the datasheet, each shape checked against float64; the sweep times the launch alternatives.
        bench-mla) run_stage bench-mla "$limit" $PY -m benchmarks.mla_decode --sweep --json "$WORK/bench_mla.json" ;;
        # DeepSeek Sparse Attention vs dense MLA, one decode step at 2k and 16k context (torch path, bf16): the
        # sparse step's 16k/2k ratio stays small where dense MLA's grows with the context.
        bench-sparse-decode) run_stage bench-sparse-decode "$limit" $PY -m benchmarks.sparse_decode --device cuda \
            --rounds 20 ;;
        # DeepSeek Sparse Attention vs dense MLA, a 2,048-token prompt chunk at 4k and 16k context (bf16, V3's 128
        # heads at one rank): the sparse prefill through the Triton kernel, then its torch path (gathered rows).
        bench-sparse-prefill) run_stage bench-sparse-prefill "$limit" bash -c "\
            $PY -m benchmarks.sparse_prefill --device cuda --heads 128 --chunk 2048 --contexts 4096,16384 \
                --kernel triton --rounds 10 && \
            $PY -m benchmarks.sparse_prefill --device cuda --heads 128 --chunk 2048 --contexts 4096,16384 --rounds 10" ;;
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
        # preset (QUANT_PRESET, default olmoe-1b-7b), one process each; then the weight memory of every preset.
        bench-quant) run_stage bench-quant "$limit" bash -c "for q in none int8 fp8 fp8-block; do \
            args=\$([ \$q = none ] || echo --quantization \$q); \
            $PY -m benchmarks.engine_gpu --skip-hf --preset ${QUANT_PRESET:-olmoe-1b-7b} --concurrency 1,8,64 \$args \
                --json $WORK/bench_quant_\$q.json || echo bench-quant: \$q failed; done; \
            $PY -m benchmarks.quantized_experts memory" ;;
        # gpt-oss's experts in MXFP4: the fused MoE kernel's tokens/s at gpt-oss-20b's expert shape, bf16 vs int8 vs
        # fp8 vs mxfp4 vs int4 (Kimi-K2.5's compressed-tensors format) side by side, then the expert weight memory per
        # mode. The INT4 kernels' correctness on the device: tests/moe_kernels/test_int4.py in tests-cuda.
        bench-mxfp4) run_stage bench-mxfp4 "$limit" bash -c "$PY -m benchmarks.mxfp4_experts kernel --tokens 1,8,64,512 \
            --rounds 5; $PY -m benchmarks.mxfp4_experts memory" ;;
        # Prefill 512 against its floor and mixed prefill+decode steps, piecewise CUDA graphs off vs on, and the
        # start-up time capturing them costs.
        bench-piecewise) run_stage bench-piecewise "$limit" $PY -m benchmarks.piecewise_graphs --json "$WORK/bench_piecewise.json" ;;
        # Host time per step on the critical path, synchronous vs overlapped, with one tenant asking for logprobs
        # or a penalty in each batch (such a request keeps the batch overlapped).
        bench-overlap) run_stage bench-overlap "$limit" $PY -m benchmarks.step_overlap --device cuda --asks none,logprobs,penalty ;;
        # LoRA: the experts' delta kernel and the mixed-batch tests (transformers + PEFT) on CUDA, then 8 adapters
        # against the base model on a small Qwen3-MoE in bfloat16.
        lora-tests) run_stage lora-tests "$limit" $PYTEST tests/engine/kernels/test_lora_experts_kernel.py tests/engine/lora ;;
        bench-lora) run_stage bench-lora "$limit" $PY -m benchmarks.lora_throughput --device cuda --dtype bfloat16 \
            --requests 256 --rounds 3 ;;
        # The same at Qwen3-30B-A3B's hidden and expert widths (adapter factors 17% of the experts' bytes).
        bench-lora-realistic) run_stage bench-lora-realistic "$limit" $PY -m benchmarks.lora_throughput --device cuda \
            --dtype bfloat16 --shape realistic --requests 256 --rounds 3 ;;
        # Structured output: 64 requests constrained by a schema against free, the token bitmask on the device.
        bench-structured) run_stage bench-structured "$limit" $PY -m benchmarks.structured_output_throughput \
            --device cuda --dtype bfloat16 --requests 64 --rounds 3 ;;
        # Speculative decoding (n-gram) at batch 1 and 8 on repeating and sampled text, verification through graphs.
        bench-spec) run_stage bench-spec "$limit" $PY -m benchmarks.speculative_decoding --device cuda \
            --dtype bfloat16 --batches 1,8 --rounds 3 ;;
        bench-engine-hf) run_stage bench-engine-hf "$limit" $PY -m benchmarks.engine_gpu --json "$WORK/bench_engine_hf.json" ;;
        # Batch API goal 2 (with no live traffic, a batch's output tokens/s at 90% or more of the offline engine's on
        # the same requests) where the gateway has cores of its own and the engine a GPU (the demo model).
        # Needs the gateway's packages as wheels in .whl/ (benchmarks/device_wheels.sh).
        batch-three-ways) run_stage batch-three-ways "$limit" $PY -m benchmarks.batch_three_ways --chunks 6 --lines 2000 ;;
        batch-goals) run_stage batch-goals "$limit" $PY -m benchmarks.batch_goals --skip-live --rounds 4 --cpu ;;
    esac
done
if [ -n "$DRY_RUN" ]; then
    $CHECK_PY benchmarks/dry_run.py --check "$DRY_RUN/commands.jsonl"
    rc=$?
    rm -rf "$DRY_RUN"
    exit $rc
fi
echo "=== summary ($((SECONDS - START))s of a ${BUDGET}s budget; put these seconds in STAGE_TABLE)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
if [ -n "$NOT_DONE" ]; then
    echo "=== not done (failed, timed out or skipped): run them in the next call with"
    echo "benchmarks/gpu_session.sh --budget ${NEXT_BUDGET:-240} --stages $(echo $NOT_DONE | tr ' ' ',')"
fi
