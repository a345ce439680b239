#!/usr/bin/env bash
# Install everything the tests need, type-check pd, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# The type check ([tool.mypy] in pyproject.toml) runs beside the tests (a minute of one core
# that the end-to-end tests' waits leave free); its verdict is read after them.
mypy_log=$(mktemp "${TMPDIR:-/tmp}/pd-mypy.XXXXXX")
"${PYTHON:-python3}" -m mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Two test processes (pytest-xdist): the end-to-end tests in one (tests/conftest.py groups
# them: their workers start once and two sets would not fit in memory), every other test in
# either; an end-to-end test spends most of its time waiting (a model load, a heartbeat, a
# deadline), which the other process fills. PD_TEST_PROCESSES=0: all in one.
# With no arguments, the tests marked `isolated` (they change the host's network: a lab's
# interfaces, which another test's NIXL pull may ride) run alone after the rest.
rc=0
apart=()
[ "$#" -eq 0 ] && apart=(-m "not isolated")
"${PYTHON:-python3}" -m pytest -q -n "${PD_TEST_PROCESSES:-2}" --dist loadgroup \
  --durations=30 ${apart[@]+"${apart[@]}"} "$@" || rc=$?  # the slowest, to budget CI time
if [ "$#" -eq 0 ]; then
  "${PYTHON:-python3}" -m pytest -q -p no:xdist -m isolated || rc=$((rc ? rc : $?))
fi
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "mypy:" && cat "$mypy_log" && rm -f "$mypy_log"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$mypy_rc"
