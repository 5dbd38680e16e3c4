#!/usr/bin/env bash
# "Fast by default", measured in one call: AdaFisherW against the fastest AdamW(fused)
# baseline (channels_last, bf16; compiled where ours is compiled), each stage under its own
# time limit, every record teed into $OUT. About 4 minutes on one H200.
#
#   1. bench_train_step.py, CIFAR ResNet-18 (batch 512, 32 px): step time and peak memory of
#      AdaFisherW with and without a Fisher refresh, against AdamW(fused), each in
#      channels_last and NCHW; ratios against the fastest AdamW row.
#   2. the same for ViT-B/16 (timm, 224 px, batch 128).
#   3. bench_trainer.py: the recipe model (CIFAR ResNet-18, CIFAR-10 on the GPU, batch 512)
#      through TriAccelTrainer, AdamW(fused) and AdaFisherW, against a hand-written
#      channels-last AdamW(fused) loop: samples/s over 300 steps (three Fisher refreshes).
#   4. bench_trainer.py under torch.compile: TriAccelTrainer(torch_compile=True) with
#      AdaFisherW (compiled first, so that its compilation time is the cold one), a compiled
#      hand-written AdamW(fused) loop, and the eager TriAccelTrainer, in one process: steady
#      samples/s and compilation seconds.
#
# --long runs the acceptance stages instead, in one call of under 10 minutes:
#   1-3. recipe, loop, recipe_compile: `accelerate launch recipes/train.py --recipe
#      cifar10_resnet18` (30 epochs, its defaults) against a hand-written channels-last bf16
#      AdamW(fused) loop on the same data, epochs and batch, clipping the gradients' norm at
#      the Trainer's default 1.0 as the recipe does (train_cifar.py), then the
#      recipe with --torch_compile true: samples/s, wall time, accuracy, compile seconds.
#   4. elastic: TriAccelTrainer with the elastic batch against the micro-batch and
#      accumulation it settles on without elasticity (bench_elastic.py): samples/s.
#   5. time_to_accuracy: the 10-epoch budget of the time-to-accuracy grid, AdamW(fused)
#      and AdaFisher at their chosen learning rates, each alone on the GPU (a sanity
#      check of the grid's runs).
#   6. acceptance: every figure against its target (acceptance.py).
#
# --refresh runs the refresh-cost stages instead, in one call of under 10 minutes: for the
# CIFAR ResNet-18, ViT-B/16, the CIFAR EfficientNet-B0 and GPT-2 small, bench_train_step.py
# (channels_last; AdaFisherW refreshing on every step and on none against AdamW(fused): step
# time, peak memory, the bytes a refresh reads) and profile_refresh.py (where the refresh's
# time goes; the Chrome traces of the ResNet and GPT-2 gzipped beside the tables).
#
# Usage, from anywhere (the repository is this script's parent folder):
#   bash benchmarks/fast_defaults.sh [--long | --refresh]           # a GPU; records in $OUT
#   bash benchmarks/fast_defaults.sh [--long | --refresh] --smoke   # CPU, tiny models
# Environment: OUT (default .out/fast_defaults), PYTHON (default python3, else python),
# DATA (default .data/cifar10 when it holds train.parquet, else the embedded CIFAR-10
# slice), COMPILE_BACKEND (default inductor). Without the `datasets` package, the wheels in .whl/
# (see the device-wheels script) are installed into a scratch folder first.
# Exit status: the number of stages that failed or ran out of time.
set -uo pipefail

smoke=()
suite=fast_defaults
for arg in "$@"; do
    case "$arg" in
        --smoke) smoke=(--smoke) ;;
        --long) suite=fast_defaults_long ;;
        --refresh) suite=fast_defaults_refresh ;;
        *) echo "usage: $0 [--long | --refresh] [--smoke]" >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-$root/.out/fast_defaults}
mkdir -p "$OUT"
summary="$OUT/$suite.md"
: > "$summary"

# The package as this checkout holds it, first on the path.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import datasets" 2>/dev/null; then
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$scratch/site" .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$scratch/site"
    fi
    "$PY" -c "import datasets" 2>/dev/null ||
        echo "warning: no 'datasets' package (carry .whl/): the Trainer stages will fail" >&2
fi

data=${DATA:-}
if [[ -z "$data" ]]; then
    if [[ -f .data/cifar10/train.parquet ]]; then data=.data/cifar10; else data=embedded; fi
fi
backend=${COMPILE_BACKEND:-inductor}

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (or a modified copy)"
{
    echo "# fast_defaults.sh $* ($suite)"
    echo
    echo "commit $commit, $(date -u +%FT%TZ), data $data, compile backend $backend"
    "$PY" - << 'EOF'
import timm, torch, transformers

device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"timm {timm.__version__}, device {device}")
EOF
} | tee -a "$summary"

failed=0
# stage NAME LIMIT_SECONDS COMMAND...: runs COMMAND under `timeout`, its output teed into
# $OUT/NAME.log; the status and time go to the summary.
stage() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    printf '\n## %s\n\n`%s` (limit %s s)\n' "$name" "$*" "$limit" | tee -a "$summary"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        failed=$((failed + 1))
        [[ $rc -eq 124 || $rc -eq 137 ]] && rc="$rc (time limit)"
    fi
    printf '\nexit %s after %d s\n' "$rc" $((SECONDS - start)) | tee -a "$summary"
    # the tables the stage wrote (each under its command line)
    for table in "$OUT/$name"/*.md; do
        [[ -f "$table" ]] && { echo; cat "$table"; } >> "$summary"
    done
}

# a recipe run's records (not its model and card) kept from its scratch output folder
keep_records() {
    mkdir -p "$OUT/$1"
    cp "$scratch/$1"/{results,efficiency_report,history}.json "$OUT/$1/" 2>/dev/null
}

# --long: the acceptance stages
long_stages() {
    # the recipe as a user runs it: accelerate launch, one process
    launch=("$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1
        --mixed_precision no --dynamo_backend no)
    recipe=(recipes/train.py --recipe cifar10_resnet18 --dataset "$data" --disable_tqdm true)
    loop=(--epochs 30 --batch_size 512 --max_grad_norm 1.0)
    elastic=(--steps 60)
    tta=(--budgets 10)
    if [[ ${#smoke[@]} -gt 0 ]]; then
        recipe+=(--model test_resnet --use_cpu --max_steps 4 --per_device_train_batch_size 8
            --per_device_eval_batch_size 100 --logging_steps 1 --plot false)
        loop=(--batch_size 8 --max_steps 3 --max_grad_norm 1.0)
        elastic=()
        tta=(--budgets 1)
    fi
    stage recipe 130 "${launch[@]}" "${recipe[@]}" --output_dir "$scratch/recipe"
    keep_records recipe
    stage loop 100 "$PY" benchmarks/train_cifar.py "${smoke[@]}" --data "$data" \
        --optimizer adamw "${loop[@]}" --out "$OUT/loop/train_cifar.json"
    stage recipe_compile 205 "${launch[@]}" "${recipe[@]}" --torch_compile true \
        --torch_compile_backend "$backend" --output_dir "$scratch/recipe_compile"
    keep_records recipe_compile
    stage elastic 60 "$PY" benchmarks/bench_elastic.py "${smoke[@]}" "${elastic[@]}" \
        --parts elastic_batch,fixed_micro_batch --out "$OUT/elastic"
    stage time_to_accuracy 80 "$PY" benchmarks/time_to_accuracy.py "${smoke[@]}" \
        --data "$data" "${tta[@]}" --grid adamw:lr=2.4e-2:wd=0.1 adafisher:lr=1.2e-2 \
        --results "$OUT/time_to_accuracy/time_to_accuracy.jsonl" \
        --times "$OUT/time_to_accuracy/epoch_seconds.jsonl"
    stage acceptance 25 "$PY" benchmarks/acceptance.py "$OUT"
}

# the fast-defaults stages
short_stages() {
    # full sizes: the scripts' defaults, ViT-B/16 with fewer steps (each is longer); smoke: the
    # scripts' smoke sizes, AdaFisher's portable implementation (Triton would be interpreted)
    impls=triton
    vit=(--warmup 10 --steps 50)
    train=(--steps 300)
    if [[ ${#smoke[@]} -gt 0 ]]; then
        impls=foreach
        vit=()
        train=(--steps 3 --warmup 3)
    fi

    stage train_step_resnet18 100 \
        "$PY" benchmarks/bench_train_step.py "${smoke[@]}" --impls "$impls" \
        --out "$OUT/train_step_resnet18"
    stage train_step_vit_b16 120 \
        "$PY" benchmarks/bench_train_step.py "${smoke[@]}" --model vit_base_patch16_224 \
        --impls "$impls" "${vit[@]}" --out "$OUT/train_step_vit_b16"
    stage trainer 110 \
        "$PY" benchmarks/bench_trainer.py "${smoke[@]}" --data "$data" "${train[@]}" \
        --variants loop_adamw_fused,trainer_adamw_fused,trainer_adafisherw --out "$OUT/trainer"
    stage trainer_compile 230 \
        "$PY" benchmarks/bench_trainer.py "${smoke[@]}" --data "$data" "${train[@]}" \
        --compile-backend "$backend" \
        --variants trainer_adafisherw_compiled,loop_adamw_fused_compiled,trainer_adafisherw \
        --out "$OUT/trainer_compile"
}

# --refresh: the refresh-cost stages
refresh_stages() {
    impls=triton
    [[ ${#smoke[@]} -gt 0 ]] && impls=foreach
    local model limit steps
    for model in resnet18_cifar vit_base_patch16_224 efficientnet_b0_cifar gpt2; do
        steps=()
        limit=70
        if [[ $model == vit_base_patch16_224 && ${#smoke[@]} -eq 0 ]]; then
            steps=(--warmup 10 --steps 50)
            limit=90
        fi
        stage "train_step_$model" "$limit" \
            "$PY" benchmarks/bench_train_step.py "${smoke[@]}" --model "$model" \
            --layouts channels_last --impls "$impls" "${steps[@]}" --out "$OUT/train_step_$model"
        # On a CPU without native bf16, EfficientNet's bf16 convolutions fall back to loops
        # that emit some 430,000 profiler events a step (minutes to parse): the smoke run
        # profiles the other models, whose profiles take the same code path.
        [[ $model == efficientnet_b0_cifar && ${#smoke[@]} -gt 0 ]] && continue
        trace=()
        [[ $model == resnet18_cifar || $model == gpt2 ]] && trace=(--trace)
        stage "profile_$model" 60 \
            "$PY" benchmarks/profile_refresh.py "${smoke[@]}" --model "$model" \
            --impls "$impls" "${trace[@]}" --out "$OUT/profile_$model"
        # the traces run to tens of MB
        gzip -f "$OUT/profile_$model"/*.trace.json 2>/dev/null
    done
}

case $suite in
    fast_defaults_long) long_stages ;;
    fast_defaults_refresh) refresh_stages ;;
    *) short_stages ;;
esac

printf '\n%d stage(s) failed; records in %s\n' "$failed" "$OUT" | tee -a "$summary"
echo
cat "$summary"
exit "$failed"
