#!/usr/bin/env bash
# The example end to end, as CI runs it: the gate passes on the recorded torch and fails under
# an injected fault; the project's own pytest file (the plugin only) passes, and fails under
# the fault. Run from anywhere; about a minute on 2 cores.
set -uo pipefail
cd "$(dirname "$0")"
status=0

expect() {  # expect CODE PATTERN COMMAND...: fail unless it exits CODE and prints PATTERN
    local want=$1 pattern=$2; shift 2
    echo "+ $* (must exit $want and print '$pattern')"
    "$@" > check.log 2>&1
    local got=$?
    tail -n 3 check.log
    if [ "$got" -ne "$want" ] || ! grep -q -- "$pattern" check.log; then
        echo "check.sh: '$*' exited $got, expected $want and '$pattern'; its output:" >&2
        cat check.log >&2
        status=1
    fi
}

expect 0 "9 of 9 checks hold" hookbench report --workload charlm.workloads:CHARLM_BF16 --sections memory \
    --out "${TMPDIR:-/tmp}/charlm-report"
expect 0 "GATE PASSED" hookbench gate
expect 1 "GATE FAILED in .*workloads" hookbench gate --fault keeps_gradients_alive
expect 0 "6 passed" python -m pytest -q -p no:cacheprovider
expect 1 "5 failed, 1 passed" python -m pytest -q -p no:cacheprovider --hookbench-fault fires_twice
rm -f check.log
if [ $status -eq 0 ]; then echo "check.sh: every step as expected (under a fault the gate and the tests fail, as they must)"; fi
exit $status
