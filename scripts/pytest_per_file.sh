#!/usr/bin/env bash
# pytest over tests/gpu/test_*.py, one process per file (a kernel fault breaks the CUDA context of one
# process, not the rest of the suite), then one summary line with the counts of all files summed.
#     bash scripts/pytest_per_file.sh [pytest args...]      (e.g. --ignore=tests/gpu/test_sm90.py)
# Exit status: 0 if every file passed (or had nothing selected), else 1.
set -u
rc_all=0
summaries=()
for f in tests/gpu/test_*.py; do
    case " $* " in *" --ignore=$f "*) continue ;; esac
    echo "### $f"
    python3 -m pytest "$f" -q -p no:cacheprovider "$@" 2>&1 | tee /tmp/pytest_one.log
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || rc_all=1
    summaries+=("$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran' /tmp/pytest_one.log | tail -1)")
done
python3 - "${summaries[@]}" <<'PY'
import re, sys
total = {}
for line in sys.argv[1:]:
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)", line):
        word = {"error": "errors", "warning": "warnings"}.get(word, word)
        total[word] = total.get(word, 0) + int(n)
order = ["failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "errors", "warnings"]
print("all files: " + ", ".join(f"{total[w]} {w}" for w in order if w in total) + f" ({len(sys.argv) - 1} files)")
PY
exit "$rc_all"
