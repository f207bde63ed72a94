#!/usr/bin/env bash
# Mutation testing (mutmut 3) of some modules, in a temporary copy of the tree.
#
#   scripts/mutation.sh [options] MODULE [MODULE...]
#   scripts/mutation.sh src/vlmserve/media/netguard.py
#   scripts/mutation.sh src/vlmserve/streaming/session.py src/vlmserve/streaming/store/memory.py
#   MUTATION_JOBS=1 scripts/mutation.sh --diff src/vlmserve/api/auth.py
#   scripts/mutation.sh --again /tmp/vlmserve-mutation.Ab12Cd src/vlmserve/api/auth.py
#
# Prints, per module, score = (killed + timed out) / mutants run, then each survivor (with
# --diff, its changed lines; `python -m mutmut show NAME` in a --keep copy shows the diff).
#
# How: copy the working tree (without .git, mutants/, caches) into a new temp directory, write
# its [tool.mutmut] with only_mutate = the modules and pytest_add_cli_args_test_selection = their
# tests (TESTS_BY_MODULE in scripts/mutation_helper.py; add your module there), run
# `mutmut run` there, report from its mutants/*.meta. The working tree is never written, so
# several runs may go at once. Never run `mutmut run` in the working tree itself.
#
# Options:  --keep       keep the temp copy (printed) for `mutmut show/results/browse` in it
#           --again DIR  reuse a kept copy: copy src/, tests/, scripts/ from the tree again,
#                        re-run the mutants of changed functions and the survivors only
#                        (mutants killed before stay killed: for iterating on new tests)
#           --diff       print each survivor's changed lines
#           -j N         mutmut --max-children N (default $MUTATION_JOBS or 2)
# Environment: MUTATION_TESTS="path ..."  override the test selection for every module
#              MUTATION_MIN_SCORE=90      exit 1 when a module scores below it
#              MUTATION_TIMEOUT=60        pytest-timeout per test, seconds (hung mutants die)
set -euo pipefail

usage() { sed -n '2,27p' "$0"; }
keep=0 diff="" again="" jobs="${MUTATION_JOBS:-2}"
modules=()
while (($#)); do
    case "$1" in
        --keep) keep=1 ;;
        --again) again="$2"; keep=1; shift ;;
        --diff) diff="--diff" ;;
        -j) jobs="$2"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "mutation.sh: unknown option $1" >&2; exit 2 ;;
        *) modules+=("$1") ;;
    esac
    shift
done
((${#modules[@]})) || { usage; exit 2; }

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for m in "${modules[@]}"; do
    [[ -f "$root/$m" && "$m" == *.py ]] || { echo "mutation.sh: no module $m (path from the repo root)" >&2; exit 2; }
done
python -m mutmut --version >/dev/null 2>&1 || { echo "mutation.sh: pip install 'mutmut>=3.8'" >&2; exit 2; }

excludes=(.git mutants __pycache__ '*.egg-info' .pytest_cache .ruff_cache .mypy_cache .hypothesis .venv)
copy() {  # copy directory $root/$1 into the empty $work/$1, keeping mtimes (mutmut
    # regenerates the mutants of a file only when its mtime is newer than theirs)
    mkdir -p "$work/$1"
    if command -v rsync >/dev/null; then
        rsync -a "${excludes[@]/#/--exclude=}" "$root/$1/" "$work/$1/"
    else
        tar -C "$root/$1" "${excludes[@]/#/--exclude=}" -cf - . | tar -C "$work/$1" -xf -
    fi
}

if [[ -n "$again" ]]; then
    work="$(cd "$again" && pwd)"
    [[ -d "$work/mutants" ]] || { echo "mutation.sh: $again is not a kept mutation copy" >&2; exit 2; }
    rm -rf "${work:?}/src" "${work:?}/tests" "${work:?}/scripts"
    copy src && copy tests && copy scripts
else
    work="$(mktemp -d "${TMPDIR:-/tmp}/vlmserve-mutation.XXXXXX")"
    copy .
fi
cleanup() { if ((keep)); then echo "mutation: kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
cd "$work"
export MUTATION_TIMEOUT="${MUTATION_TIMEOUT:-60}"
export PYTHONPATH="$work/scripts${PYTHONPATH:+:$PYTHONPATH}"  # pytest -p mutation_helper
[[ -n "$again" ]] || python scripts/mutation_helper.py configure "${modules[@]}"

run_mutmut() {  # python -m mutmut run [MUTANT...], output appended to mutmut.log; sets $status
    echo "mutation: mutmut run --max-children $jobs ($# mutants named) in $work"
    python -m mutmut run --max-children "$jobs" "$@" >> mutmut.log 2>&1 || status=$?
}
started=$SECONDS
status=0
run_mutmut  # every mutant without a result: all of them in a new copy
if [[ -n "$again" && $status == 0 ]]; then
    mapfile -t survivors < <(python scripts/mutation_helper.py survivors "${modules[@]}")
    ((${#survivors[@]} == 0)) || run_mutmut "${survivors[@]}"
fi
tr '\r' '\n' < mutmut.log | grep -v '^⠀*[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]' > mutmut.txt || true  # without the spinner
echo "mutation: mutmut took $((SECONDS - started)) s (exit $status); log: $work/mutmut.txt"
if ((status != 0)); then
    tail -n 40 mutmut.txt >&2
    keep=1
fi
python scripts/mutation_helper.py report $diff "${modules[@]}"
