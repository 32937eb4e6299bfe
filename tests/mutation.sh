#!/usr/bin/env bash
# Mutation testing of the core with mutmut 3 (not part of CI: CPU-heavy, tens of minutes).
#
#   bash tests/mutation.sh                 # the core: bank refresh checkpoint losses op reference
#   bash tests/mutation.sh bank            # one module
#   WORK=/tmp/mut bash tests/mutation.sh refresh   # MAX_CHILDREN=2 for two workers
#
# The working tree (nnkloss/, kernels/, tests/, setup.py) is copied to a scratch directory ($WORK,
# default a fresh mktemp -d), a setup.cfg [mutmut] section is written there naming the
# modules to mutate and the test files that cover them, and mutmut runs there with one
# worker under `nice -n 10` (the checkout itself gets no mutants/ folder). Results:
# `cd $WORK && python -m mutmut results` (survivors), `python -m mutmut show NAME` (a diff).
#
# Deselected under mutmut (they cannot pass with its trampolines in place, mutant or not): the
# source-checkout test starts a fresh interpreter that inherits MUTANT_UNDER_TEST without
# mutmut's configuration, and torch.compile(fullgraph=True) cannot trace the trampolines.
#
# kernels/neighbour_kernel.py is NOT mutated: under TRITON_INTERPRET=1 every mutant would
# re-run the interpreted kernel tests (minutes each), and mutmut's trampolines cannot wrap
# @triton.jit functions anyway. The kernel is covered by planted bugs instead
# (tests/MUTATION.md) and by tests/test_kernels_tiles.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODULES=("$@")
if [ ${#MODULES[@]} -eq 0 ]; then
    MODULES=(bank refresh checkpoint losses op reference)
fi

# Module -> the test files that exercise it (keep these fast: every mutant re-runs the
# covering tests among them; interpreter-heavy files are left out on purpose). Since issue 19
# the tests of the campaign files (test_mutation_kills.py, test_promises_*.py) and of the
# renamed or split files (test_module.py, test_errors.py, test_loss_op.py,
# test_compile_and_cuda.py) live in the files of the modules they test: each list names every
# file that now holds a test of the module's old list that runs the module's code
# (tests/MUTATION.md, "Where the tests named here live now").
# (cpu/build.py writes its library with atomic.py: the one test of test_cpu_build.py that the old
# checkpoint list ran, from test_mutation_kills.py, is named alone.)
tests_for() {
    case "$1" in
        bank)       echo "tests/test_centre_bank.py tests/test_losses.py tests/test_centroids.py tests/test_checkpoint.py tests/test_atomic.py tests/test_refresh.py tests/test_bad_input.py" ;;
        refresh)    echo "tests/test_refresh.py" ;;
        checkpoint) echo "tests/test_checkpoint.py tests/test_atomic.py tests/test_bad_input.py tests/test_cpu_build.py::test_cpu_library_is_built_once_per_process" ;;
        losses)     echo "tests/test_losses.py tests/test_centre_bank.py tests/test_validation.py tests/test_ccml.py tests/test_layout.py tests/test_bad_input.py tests/test_numerics.py" ;;
        op)         echo "tests/test_ops_neighbour_kernel.py tests/test_ops_reference.py tests/test_backends.py tests/test_validation.py tests/test_losses.py tests/test_numerics.py tests/test_compile.py tests/test_cpu_op.py tests/test_cpu_build.py tests/test_kernels_launch.py tests/test_bad_input.py" ;;
        reference)  echo "tests/test_ops_reference.py tests/test_ops_neighbour_kernel.py tests/test_losses.py tests/test_numerics.py" ;;
        *) echo "unknown module $1" >&2; exit 2 ;;
    esac
}

# Module -> its files under nnkloss/.
files_for() {
    case "$1" in
        bank)       echo "bank/centre_bank.py" ;;
        refresh)    echo "bank/refresh.py" ;;
        checkpoint) echo "bank/checkpoint.py atomic.py" ;;
        losses)     echo "losses/base.py losses/neighbour_kernel.py" ;;
        op)         echo "ops/neighbour_kernel.py ops/backends.py cpu/op.py cpu/build.py" ;;
        reference)  echo "ops/reference.py" ;;
    esac
}

WORK="${WORK:-$(mktemp -d /tmp/nnkloss-mutation.XXXXXX)}"
mkdir -p "$WORK"
rm -rf "$WORK/nnkloss" "$WORK/kernels" "$WORK/tests" "$WORK/mutants"
cp -r "$ROOT/nnkloss" "$ROOT/kernels" "$ROOT/tests" "$ROOT/setup.py" "$WORK/"  # test_layout reads setup.py
find "$WORK" -name __pycache__ -prune -exec rm -rf {} +

only=""
tests=""
for m in "${MODULES[@]}"; do
    for f in $(files_for "$m"); do only+="    nnkloss/$f"$'\n'; done
    for t in $(tests_for "$m"); do
        [ -f "$WORK/${t%%::*}" ] || continue  # a file, or one test of it (FILE::NAME)
        case " $tests " in *" $t "*) ;; *) tests+="$t " ;; esac
    done
done
test_lines=""
for t in $tests; do test_lines+="    $t"$'\n'; done

cat > "$WORK/setup.cfg" <<EOF
[mutmut]
source_paths =
    nnkloss/
only_mutate =
${only}also_copy =
    kernels/
    setup.py
pytest_add_cli_args =
    -q
    -p
    no:cacheprovider
    -m
    not slow and not interpreter
    --hypothesis-profile=mutation
    --deselect
    tests/test_backends.py::test_source_checkout_without_install_finds_the_kernels
    --deselect
    tests/test_compile.py::test_compile_fullgraph_no_graph_break
    --deselect
    tests/test_compile.py::test_functional_op_compiles_fullgraph
pytest_add_cli_args_test_selection =
${test_lines}process_isolation = forkserver
use_git_change_detection = false
EOF

echo "mutation work dir: $WORK"
echo "mutating: ${MODULES[*]}"
echo "tests: $tests"
cd "$WORK"
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
nice -n 10 python -m mutmut run --max-children "${MAX_CHILDREN:-1}"
python -m mutmut results || true
