#!/usr/bin/env bash
# AdaFisher under FSDP2 on one GPU, in about a minute: the recipe's smoke mode launched as a
# one-process FSDP2 run (recipes/fsdp2_config.yaml), once through the Accelerate helper
# (prepare_triaccel) and once through TriAccelTrainer. Each trains ViT-B/16 for 6 steps
# with a Fisher refresh every 2, saves at step 3 and checks that loading restores
# AdaFisher's state; each stage runs under `timeout` and passes with exit status 0 and two
# "OK:" lines. Logs and a summary go to $OUT (default outputs/fsdp2_gpu_check).
#
#   bash recipes/fsdp2_gpu_check.sh                # from anywhere
# An installed package is used as it is; an uninstalled checkout is assembled in a scratch
# folder, with `datasets` installed from wheels in .whl/ where it is missing.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/fsdp2_gpu_check}"
mkdir -p "$OUT"
if command -v accelerate >/dev/null; then LAUNCH=(accelerate launch); else
    LAUNCH=(python -m accelerate.commands.launch); fi
LAUNCH+=(--config_file recipes/fsdp2_config.yaml --num_processes 1)
status=0

# An uninstalled checkout: the package assembled as pyproject.toml installs it (kernels/ and
# model_card_templates/ inside hf_triaccel/) and `datasets` from the wheels in .whl/, both
# first on the path.
if ! python -c "import hf_triaccel.kernels" 2>/dev/null; then
    scratch=$(mktemp -d)
    cp -r hf_triaccel "$scratch/" && cp -r kernels "$scratch/hf_triaccel/kernels"
    cp -r model_card_templates "$scratch/hf_triaccel/model_card_templates"
    if ! python -c "import datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        python -m pip install -q --no-index --no-deps --target "$scratch" .whl/*.whl
    fi
    export PYTHONPATH="$scratch${PYTHONPATH:+:$PYTHONPATH}"
fi

stage() {  # stage NAME SECONDS ARGS...: one launch of the recipe
    local name=$1 limit=$2
    shift 2
    echo "== $name: ${LAUNCH[*]} recipes/fsdp2_vit.py $*" | tee -a "$OUT/summary.txt"
    local start=$SECONDS
    timeout "$limit" "${LAUNCH[@]}" recipes/fsdp2_vit.py "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} ok
    ok=$(grep -c '^OK: ' "$OUT/$name.log")
    echo "== $name: exit $rc, $ok OK lines, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ] || [ "$ok" -lt 2 ]; then status=1; fi
}

python -c "import torch, transformers, accelerate, timm; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'timm', \
timm.__version__)" 2>&1 | tee -a "$OUT/summary.txt"
stage accelerate 45 --smoke --output_dir "$OUT/accelerate_run"
stage trainer 45 --smoke --trainer --output_dir "$OUT/trainer_run"
rm -rf "$OUT/accelerate_run" "$OUT/trainer_run"  # the checkpoints: gigabytes, not evidence
echo "== $([ $status -eq 0 ] && echo PASSED || echo FAILED)" | tee -a "$OUT/summary.txt"
exit $status
