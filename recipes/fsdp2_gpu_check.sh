#!/usr/bin/env bash
# AdaFisher under FSDP2 on one GPU, in a minute or two: the recipe's smoke mode launched as a
# one-process FSDP2 run (recipes/fsdp2_config.yaml), once through the Accelerate helper
# (prepare_triaccel) and once through TriAccelTrainer. Each trains ViT-B/16 for 6 steps
# with a Fisher refresh every 2, saves at step 3 and checks that loading restores
# AdaFisher's state; each stage runs under `timeout` (120 s: on a fresh machine the first
# stage also compiles the Triton kernels) and passes with exit status 0 and two
# "OK:" lines. Logs and a summary go to $OUT (default outputs/fsdp2_gpu_check).
#
#   bash recipes/fsdp2_gpu_check.sh                # from anywhere
#   bash recipes/fsdp2_gpu_check.sh --timing       # step times instead (a few minutes)
# An installed package is used as it is; an uninstalled checkout is assembled in a scratch
# folder, with `datasets` installed from wheels in .whl/ where it is missing.
#
# --timing runs, instead of the checks, the Accelerate loop for $TIME_STEPS steps of each
# model of $TIME_MODELS (name:FSDP unit class) and prints its mean step time after the
# warm-up steps: under one-GPU FSDP2 in each channels_last arrangement
# (HF_TRIACCEL_FSDP2_CHANNELS_LAST=inputs, weights), under FSDP2 without channels_last
# (--nchw), and on one GPU without FSDP (bf16 too). The "step time" lines go to the summary.
# Without a CUDA GPU it refuses at once (exit 2). An interrupt (Ctrl-C, SIGTERM) ends the
# running launch and every process it started: `timeout` puts its command in a process
# group of its own, which the terminal's interrupt does not reach, so the trap below ends
# that group.
set -u
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    2>/dev/null; then
    echo "fsdp2_gpu_check.sh: error: no CUDA GPU here (torch.cuda.is_available() is False);" \
        "on a CPU, python recipes/fsdp2_vit.py --smoke --cpu runs the recipe's code" >&2
    exit 2
fi
child=""
trap 'if [ -n "$child" ]; then kill -TERM -- "-$child" 2>/dev/null; fi; exit 130' INT TERM
TIMING=0
if [ "${1:-}" = "--timing" ]; then TIMING=1; fi
TIME_STEPS="${TIME_STEPS:-60}"
TIME_MODELS="${TIME_MODELS:-vit_base_patch16_224:Block resnet50:Bottleneck}"
OUT="${OUT:-outputs/fsdp2_gpu_check}"
mkdir -p "$OUT"
if command -v accelerate >/dev/null; then ACCELERATE=(accelerate launch); else
    ACCELERATE=(python -m accelerate.commands.launch); fi
LAUNCH=("${ACCELERATE[@]}" --config_file recipes/fsdp2_config.yaml --num_processes 1)
# the same process count and bf16 mixed precision, without FSDP
PLAIN=("${ACCELERATE[@]}" --num_processes 1 --num_machines 1 --mixed_precision bf16
    --dynamo_backend no)
status=0

# An uninstalled checkout: the package from the repository root and `datasets` from the
# wheels in .whl/, both first on the path.
if ! python -c "import hf_triaccel.kernels" 2>/dev/null; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! python -c "import datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        scratch=$(mktemp -d)
        python -m pip install -q --no-index --no-deps --target "$scratch" .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$scratch"
    fi
fi

logged() {  # logged LOG COMMAND...: COMMAND's output shown and written to LOG; its status
    local log=$1 logfd tee_pid rc
    shift
    exec {logfd}> >(tee "$log")
    tee_pid=$!
    "$@" >&"$logfd" 2>&1 &
    child=$!
    wait "$child"
    rc=$?
    child=""
    exec {logfd}>&-
    wait "$tee_pid" 2>/dev/null
    return $rc
}

stage() {  # stage NAME SECONDS ARGS...: one launch of the recipe
    local name=$1 limit=$2
    shift 2
    echo "== $name: ${LAUNCH[*]} recipes/fsdp2_vit.py $*" | tee -a "$OUT/summary.txt"
    local start=$SECONDS
    logged "$OUT/$name.log" timeout "$limit" "${LAUNCH[@]}" recipes/fsdp2_vit.py "$@"
    local rc=$? ok
    ok=$(grep -c '^OK: ' "$OUT/$name.log")
    echo "== $name: exit $rc, $ok OK lines, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ] || [ "$ok" -lt 2 ]; then status=1; fi
}

python -c "import torch, transformers, accelerate, timm; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'timm', \
timm.__version__)" 2>&1 | tee -a "$OUT/summary.txt"
timed() {  # timed NAME COMMAND...: one timing run, its "step time" line into the summary
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    logged "$OUT/$name.log" timeout 300 "$@" --max_steps "$TIME_STEPS" \
        --output_dir "$OUT/timing_run"
    local rc=$?
    grep '^step time: ' "$OUT/$name.log" | sed "s/^/== $name: /" | tee -a "$OUT/summary.txt"
    echo "== $name: exit $rc" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ]; then status=1; fi
}

if [ "$TIMING" -eq 0 ]; then
    stage accelerate 120 --smoke --output_dir "$OUT/accelerate_run"
    stage trainer 120 --smoke --trainer --output_dir "$OUT/trainer_run"
    rm -rf "$OUT/accelerate_run" "$OUT/trainer_run"  # the checkpoints: gigabytes, not evidence
fi
if [ "$TIMING" -eq 1 ]; then
    for entry in $TIME_MODELS; do
        model=${entry%%:*}
        sharded=("${LAUNCH[@]}" --fsdp_transformer_layer_cls_to_wrap "${entry#*:}")
        for layout in inputs weights; do
            timed "${model}_fsdp2_$layout" env HF_TRIACCEL_FSDP2_CHANNELS_LAST=$layout \
                "${sharded[@]}" recipes/fsdp2_vit.py --model "$model"
        done
        timed "${model}_fsdp2_nchw" "${sharded[@]}" recipes/fsdp2_vit.py --model "$model" --nchw
        timed "${model}_no_fsdp" "${PLAIN[@]}" recipes/fsdp2_vit.py --model "$model"
    done
    rm -rf "$OUT/timing_run"
fi
echo "== $([ $status -eq 0 ] && echo PASSED || echo FAILED)" | tee -a "$OUT/summary.txt"
exit $status
