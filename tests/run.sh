#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs: .ci/run calls this):
# the venv, headless Chromium for the MLflow UI test and a real single-node SLURM for the
# `submit cluster=slurm` tests (started here, stopped on exit). The Ray head of the
# `submit cluster=ray` tests is started and stopped by the tests themselves.
set -uo pipefail
cd "$(dirname "$0")/.."
bash cluster/setup_env.sh || exit 1

# -- headless Chromium for the MLflow UI test (tests/test_tracking_report.py, marker `browser`) --
# Debian packages, installed only when missing (~40 s); without them that test skips with a reason.
if ! command -v chromium >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    if command -v apt-get >/dev/null 2>&1; then
        echo "tests/run.sh: installing chromium chromium-driver (apt-get)" >&2
        { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
            chromium chromium-driver; } >/dev/null 2>&1 \
            || echo "tests/run.sh: could not install chromium; the browser test will be skipped" >&2
    fi
fi
# -- end of the Chromium block -------------------------------------------------------------------

# a real single-node SLURM for the `submit cluster=slurm` tests. Once it is up those tests must
# run, not skip (STAPOCTL_REQUIRE_SLURM=1 turns a lost daemon into a failure); where it cannot be
# started at all (no root, no apt) they skip and say why.
started_slurm=0
if sinfo -h >/dev/null 2>&1; then
    echo "tests/run.sh: a SLURM is already up here; using it and leaving it running"
    export STAPOCTL_REQUIRE_SLURM=1
elif bash cluster/local-slurm/start.sh; then
    started_slurm=1
    export STAPOCTL_REQUIRE_SLURM=1
else
    echo "tests/run.sh: cluster/local-slurm/start.sh could not start a SLURM here; the SLURM tests will skip" >&2
fi
stop_slurm() { [ "$started_slurm" = 1 ] && bash cluster/local-slurm/stop.sh; started_slurm=0; }
trap stop_slurm EXIT INT TERM

# No test calls the Hugging Face hub: this workplace reaches no hub, and the hub check's probe
# (stapoctl/preflight/hub.py) is tested against servers on 127.0.0.1 (tests/test_preflight_hub.py).
export HF_HUB_OFFLINE=1
.venv/bin/python -m pytest tests "$@"
rc=$?
if [ $rc -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests: the suite is missing or its selection is empty" >&2
    exit 1
fi
exit $rc
