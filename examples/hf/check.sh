#!/usr/bin/env bash
# The example end to end, as CI runs it: each workload reported, the gate passes on the
# recorded torch and fails under each injected fault; the project's own pytest file (the
# plugin only) passes, and fails under a fault. Needs the hf extra (transformers, timm); about
# two minutes on 2 cores.
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

for w in GPT2 LLAMA_BF16 VIT; do
    expect 0 "checks hold$" hookbench report --workload hfstack.workloads:$w \
        --sections optimizer,capture,memory,zero2 --out "${TMPDIR:-/tmp}/hfstack-report-$w"
done
expect 0 "GATE PASSED" hookbench gate
for fault in fires_twice keeps_gradients_alive; do
    expect 1 "GATE FAILED in .*workloads" hookbench gate --fault $fault
    for w in gpt2 llama-bf16 vit; do  # each workload has a failed row of its own
        grep -q "^! $w/" check.log || { echo "check.sh: --fault $fault: no $w row failed" >&2; status=1; }
    done
done
expect 0 "8 passed" python -m pytest -q -p no:cacheprovider
expect 1 "[1-9] failed" python -m pytest -q -p no:cacheprovider --hookbench-fault fires_twice
rm -f check.log
if [ $status -eq 0 ]; then echo "check.sh: every step as expected (under a fault the gate and the tests fail, as they must)"; fi
exit $status
