#!/usr/bin/env bash
# The package at its lower bounds: a fresh virtual environment with the releases of
# tools/lowest-constraints.txt, then a fast subset of the tests. Not part of the README's
# test command: it installs a second torch (several GB).
#
#   bash tools/check_lowest.sh            # venv in .venv-lowest/ (VENV=... to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-lowest}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -c tools/lowest-constraints.txt -e ".[test]"
"$VENV/bin/python" -m pip list 2>/dev/null |
    grep -iE '^(torch|triton|transformers|accelerate|timm|datasets|huggingface.hub|trl) '
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_import.py tests/test_contracts.py tests/integrations/test_private_api.py \
    tests/optim tests/kernels tests/integrations/test_trainer_lifecycle.py \
    tests/integrations/test_stock_trainers.py "$@"
