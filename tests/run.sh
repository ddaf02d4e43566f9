#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs: .ci/run calls this).
set -uo pipefail
cd "$(dirname "$0")/.."
bash cluster/setup_env.sh || exit 1
.venv/bin/python -m pytest tests "$@"
rc=$?
if [ $rc -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests: the suite is missing or its selection is empty" >&2
    exit 1
fi
exit $rc
