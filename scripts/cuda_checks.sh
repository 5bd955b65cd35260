#!/usr/bin/env bash
# cuda_checks.sh [OUTDIR]
#
# Every CUDA figure of the project in one run, sized for one GPU machine and about 7.5 minutes of wall
# time (CUDA_CHECKS_BUDGET_S, default 450), so that a rerun still fits the device time of a session. On a
# machine whose torch sees no CUDA device it stops within seconds, before writing anything: exit 2 and one
# line on stderr.
#
#   scripts/cuda_checks.sh                  # writes to ${OUT:-out/cuda}
#   scripts/cuda_checks.sh /tmp/cuda-run
#
# Steps, in this order, and the 8 files they write under OUTDIR (the device tool brings back 8 at most):
#   a. torch must see a CUDA device, else exit 2: "no CUDA device visible to torch X.Y ...; nothing was run".
#   b. set up, and record the machine (env.txt: torch, torch.version.cuda, device, missing test packages,
#      nvidia-smi, then the set-up log).
#   c. the device suite: ROPE_DEDUP_TEST_DEVICE=cuda pytest -m device (every test that takes the device
#      fixture: recognition, keys, store, share/sharing, the backend on toy decoders, the audit, moves, the
#      property suite's pinned sequences; and the CUDA-only ones), in parallel (pytest.txt).
#   d. benchmarks (benchmarks.txt): the step time of rope_dedup against inductor alone, interleaved, with
#      CUDA events (examples/bench_step_time.py; step-time-cuda.json), the peak of .to("cuda") after
#      share() against the unshared model (examples/bench_move_peak.py), and recomputed tables against the
#      shared one at decode and prefill, titan-128k (examples/bench_recompute.py).
#   e. rope-dedup profile --preset titan-128k --device cuda, modes compile, rope_dedup, regional, share,
#      sharing and recompute, and their step times in turns (profile-titan-128k-cuda.{txt,json,png}).
#   f. scripts/cuda_graphs_check.py: CUDA graphs (mode reduce-overhead) with and without rope_dedup, whole
#      model and per block, then the same with tables="recompute", in the time left (appended to
#      benchmarks.txt).
#   g. a summary of exit codes (also summary.txt); exit 1 if any step failed, else 0.
#
# Python: $PYTHON if set, else .venv/bin/python if .venv exists, else python3. When .venv is missing,
# step b creates it from python3:
#   - if python3's torch sees CUDA (the GPU machine's image: its torch, whatever its version, and
#     nothing can be downloaded there), the venv sees python3's packages (--system-site-packages plus
#     a .pth naming python3's own site-packages, since python3 may itself be a venv; pip comes from
#     there too) and the project is installed with --no-deps: that torch is kept, never replaced;
#   - if python3 has no torch at all, `pip install -e '.[test]'` (torch not pinned: pip's default
#     build, the CUDA one).
# A folder .whl/ of wheels (packages the image lacks, e.g. expecttest) is installed offline first.
# If .venv exists but its torch has no CUDA, step a stops: remove .venv or set PYTHON.
# The GPU image's torch may be older than pyproject's range (torch 2.11 was seen there): env.txt says
# which torch the figures are for.
#
# Each step runs under `timeout` with what is left of the budget, minus what the later steps are
# guaranteed (RESERVE_* below), SIGINT first. PYTEST_WORKERS (default 8, 0: serial) is pytest-xdist's -n
# in step c when xdist is installed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
outdir=${1:-${OUT:-out/cuda}}
case $outdir in /*) ;; *) outdir=$PWD/$outdir ;; esac
cd "$repo"

budget=${CUDA_CHECKS_BUDGET_S:-450}
started=$SECONDS
# Seconds kept back for the later steps, so that the steps before them cannot starve them.
RESERVE_BENCH=150
RESERVE_PROFILE=150

say() { echo "cuda_checks: $*" >&2; }

# -- a. fail fast without CUDA ---------------------------------------------------------------------
if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
# "<torch version> <1 if CUDA is available, else 0>", or nothing if torch does not import.
probe=$(timeout 60 "$py" -c 'import torch; print(torch.__version__, int(torch.cuda.is_available()))' 2>/dev/null || true)
if [ -z "$probe" ]; then
    if ! timeout 20 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        say "no CUDA device: torch does not import with $py and nvidia-smi lists no GPU; nothing was run"
        exit 2
    fi
    # A GPU but no torch: step b installs one (when .venv is to be created).
elif [ "${probe#* }" != 1 ]; then
    say "no CUDA device visible to torch ${probe% *} ($py); nothing was run"
    exit 2
fi

mkdir -p "$outdir"
rm -f "$outdir"/{env,pytest,summary,benchmarks}.txt "$outdir"/step-time-cuda.json "$outdir"/profile-titan-128k-cuda.*
names=() codes=() secs=() files=()

# run_step NAME CAP RESERVE OUTFILE COMMAND...: run COMMAND, stdout and stderr appended to OUTFILE after a
# header line, with a limit of min(CAP, what is left of the budget minus RESERVE); records its exit code
# (124: out of time).
run_step() {
    local name=$1 cap=$2 reserve=$3 file=$4
    shift 4
    local left=$((budget - (SECONDS - started) - reserve))
    local limit=$((cap < left ? cap : left))
    local t0=$SECONDS code=0
    echo "### $name (up to ${limit}s): $*" >>"$file"
    if [ "$limit" -lt 20 ]; then
        echo "skipped: out of time (${left}s left of the budget for this step)" >>"$file"
        code=124
    else
        say "$name (up to ${limit}s) -> $file"
        timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$file" 2>&1 || code=$?
    fi
    names+=("$name")
    codes+=("$code")
    secs+=($((SECONDS - t0)))
    files+=("${file#"$outdir"/}")
}

# -- b. set up --------------------------------------------------------------------------------------
setup() {
    set -x
    if [ -z "${PYTHON:-}" ] && [ ! -x .venv/bin/python ]; then
        if [ -n "$probe" ]; then
            # Keep the image's CUDA torch: a venv over python3's packages, the project without deps.
            # If no venv can be made, the project goes into python3 itself.
            if python3 -m venv --system-site-packages --without-pip .venv; then
                purelib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
                python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$purelib/_base_python.pth"
                py=.venv/bin/python
            else
                rm -rf .venv
            fi
            "$py" -m pip install -q --no-deps --no-build-isolation -e .
        else
            python3 -m venv .venv
            .venv/bin/python -m pip install -q -e '.[test]'
            py=.venv/bin/python
        fi
    fi
    if [ -d .whl ] && compgen -G '.whl/*.whl' >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps .whl/*.whl
    fi
    if ! "$py" -c 'import rope_dedup' 2>/dev/null; then
        "$py" -m pip install -q --no-deps --no-build-isolation -e .
    fi
    "$py" - "$outdir/env.txt" <<'PY'
import importlib.util, sys, torch
assert torch.cuda.is_available(), f"torch {torch.__version__} no longer sees CUDA after the install"
wanted = ("pytest", "expecttest", "hypothesis", "rich", "matplotlib", "safetensors", "transformers", "esm",
          "rotary_embedding_torch", "xdist")
missing = [m for m in wanted if importlib.util.find_spec(m) is None]
with open(sys.argv[1], "w") as env:
    print("python:", sys.executable, sys.version.split()[0], file=env)
    print("torch:", torch.__version__, file=env)
    print("torch.version.cuda:", torch.version.cuda, file=env)
    print("device:", torch.cuda.get_device_name(), file=env)
    print("device count:", torch.cuda.device_count(), file=env)
    print("test packages missing:", ", ".join(missing) or "none", file=env)
PY
    set +x
    echo "$py" >"$chosen"
}
chosen=$(mktemp)
setup_log=$(mktemp)
trap 'rm -f "$chosen" "$setup_log"' EXIT
code=0
(setup) >"$setup_log" 2>&1 || code=$?
if [ "$code" -ne 0 ]; then
    cp "$setup_log" "$outdir/env.txt"
    say "setup failed (exit $code), see $outdir/env.txt; nothing else was run"
    tail -n 5 "$setup_log" >&2
    exit 2
fi
py=$(cat "$chosen")
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo none)$(git diff --quiet HEAD 2>/dev/null || echo ' (plus uncommitted changes)')"
    echo "cpus: $(nproc)"
    echo
    timeout 30 nvidia-smi || echo "nvidia-smi failed"
    echo
    echo "### set-up log"
    cat "$setup_log"
} >>"$outdir/env.txt" 2>&1
say "setup done: $py, $(sed -n 's/^torch: //p' "$outdir/env.txt"), $(sed -n 's/^device: //p' "$outdir/env.txt")"
export PYTHONUNBUFFERED=1

# -- c. the device suite -----------------------------------------------------------------------------
# --continue-on-collection-errors: a test module whose package the image lacks must not hide the rest.
pytest_args=(-q -p no:cacheprovider -rs --continue-on-collection-errors -m device)
workers=${PYTEST_WORKERS:-8}
if [ "$workers" != 0 ] && "$py" -c 'import xdist' 2>/dev/null; then
    pytest_args+=(-n "$workers")
fi
run_step device-suite 130 $((RESERVE_BENCH + RESERVE_PROFILE)) "$outdir/pytest.txt" \
    env ROPE_DEDUP_TEST_DEVICE=cuda "$py" -m pytest "${pytest_args[@]}" tests

# -- d. benchmarks ------------------------------------------------------------------------------------
# 40 layers whole (the 1.48 of the first GPU run, launch-bound: 1 token) and per block at 40 and 126. One
# process per case (--processes 1): three would triple the compiles, which the budget cannot hold; a single
# process's layout bias (a percent or two on CPU) stays in these figures.
bench=$outdir/benchmarks.txt
run_step step-time 100 "$RESERVE_PROFILE" "$bench" \
    "$py" examples/bench_step_time.py --device cuda --layers 40 --modes whole regional --rounds 60 \
    --processes 1 --json "$outdir/step-time-cuda.json"
run_step step-time-126 60 "$RESERVE_PROFILE" "$bench" \
    "$py" examples/bench_step_time.py --device cuda --layers 126 --modes regional --rounds 40 --processes 1
run_step move-peak 40 "$RESERVE_PROFILE" "$bench" \
    "$py" examples/bench_move_peak.py --device cuda --layers 32 --context 131072
run_step recompute 60 "$RESERVE_PROFILE" "$bench" \
    "$py" examples/bench_recompute.py --device cuda --preset titan-128k --rounds 20

# -- e. memory profile, titan-128k on CUDA ----------------------------------------------------------
# Six modes, each in a fresh process, then the step-time process (models in turns); --timeout per process is a
# seventh of the step's limit less a margin, so a process that hangs cannot take the others' time.
left=$((budget - (SECONDS - started)))
limit=$((left < RESERVE_PROFILE + 60 ? left : RESERVE_PROFILE + 60))
per_mode=$(((limit - 20) / 7))
if [ "$per_mode" -lt 10 ]; then per_mode=10; fi
p=$outdir/profile-titan-128k-cuda
run_step profile "$limit" 0 "$p.txt" \
    "$py" -m rope_dedup profile --preset titan-128k --device cuda --timeout "$per_mode" \
    --modes compile,rope_dedup,regional,share,sharing,recompute --json "$p.json" --plot "$p.png"

# -- f. CUDA graphs with and without rope_dedup, in the time left --------------------------------------
run_step cuda_graphs "$budget" 30 "$bench" "$py" scripts/cuda_graphs_check.py
run_step cuda_graphs_rc "$budget" 0 "$bench" "$py" scripts/cuda_graphs_check.py --tables recompute

# -- g. summary -------------------------------------------------------------------------------------
failed=0
for c in "${codes[@]}"; do
    if [ "$c" -ne 0 ]; then failed=1; fi
done
{
    printf '%-12s %5s %6s  %s\n' step exit secs output
    for i in "${!names[@]}"; do
        printf '%-12s %5s %6s  %s\n' "${names[$i]}" "${codes[$i]}" "${secs[$i]}" "${files[$i]}"
    done
    echo "exit 124: cut off at the step's time limit. Total $((SECONDS - started))s of a ${budget}s budget;" \
         "profile --timeout ${per_mode}s per mode; files in $outdir"
    # pytest's summary lines ("3 failed, 120 passed in 80.1s"), one per pass
    grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran|^skipped: out of time' \
        "$outdir/pytest.txt" | sed -E 's/^=+ //; s/ =+$//; s/^/pytest: /' || true
    grep -E '^(OK|FAILED|[0-9]+ check)' "$bench" | sed 's/^/cuda_graphs: /' || true
    grep -E '^(worst median|  peak of the move|  shared / unshared)' "$bench" | sed 's/^ */bench: /' || true
} | tee "$outdir/summary.txt"
exit "$failed"
