#!/usr/bin/env bash
# check_torch.sh VERSION [extra pytest args...]
#
# Runs the fast test suite against one torch release, in a venv of its own kept outside the
# repository, so that the claims in DESIGN-NOTES.md about which torch versions work (and the test
# pinning a version-dependent behaviour) can be re-checked with one command. It ignores this
# machine's pip constraint (which caps torch) and pyproject's torch range on purpose: the point is to
# try versions outside both. The requested torch is verified after every install.
#
#   scripts/check_torch.sh 2.14.1
#   scripts/check_torch.sh 2.12.1 tests/test_explain.py -x
#
# Venvs live under ${ROPE_DEDUP_TORCH_VENVS:-$HOME/.cache/rope-dedup-torch}/VERSION and are reused
# when they already hold that torch. PYTHON picks the interpreter for a new venv (default python3).
# Last line: "check_torch: torch VERSION: <pytest's summary line>"; exit status is pytest's
# (5, no tests collected, stays non-zero).
set -euo pipefail

if [ "$#" -lt 1 ] || [ -z "$1" ]; then
    echo "usage: $0 VERSION [extra pytest args...]" >&2
    exit 2
fi
version=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venvs=${ROPE_DEDUP_TORCH_VENVS:-$HOME/.cache/rope-dedup-torch}
venv=$venvs/$version
py=$venv/bin/python

# torch's version without the local label (2.13.0+cpu -> 2.13.0), or nothing if torch is absent.
torch_version() {
    "$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true
}

if [ ! -x "$py" ]; then
    echo "check_torch: creating venv $venv" >&2
    mkdir -p "$venvs"
    "${PYTHON:-python3}" -m venv "$venv"
fi

if [ "$(torch_version)" = "$version" ]; then
    echo "check_torch: reusing $venv (torch $version already installed)" >&2
else
    echo "check_torch: installing torch==$version into $venv" >&2
    PIP_CONSTRAINT=/dev/null "$py" -m pip install "torch==$version"
fi

# The project and its test extra, with torch held at the requested version. The pin lives in a
# constraint file inside the venv; if the project's own torch range excludes that version the resolver
# refuses, and we install the other requirements, then the project itself with --no-deps.
# A stamp of the checkout's path and pyproject.toml skips this step when neither changed since the
# last run (a venv shared by two checkouts is re-pointed at the one running now).
pin=$venv/torch-pin.txt
stamp=$venv/rope-dedup-install.stamp
echo "torch==$version" >"$pin"
want_stamp="$repo $(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] \
        && "$py" -c 'import rope_dedup' >/dev/null 2>&1 \
        && "$py" -m pip show rope-dedup >/dev/null 2>&1; then
    echo "check_torch: reusing the project install (same checkout, pyproject.toml unchanged)" >&2
else
    rm -f "$stamp"
    pip_log=$venv/pip-project.log
    pip_status=0
    PIP_CONSTRAINT="$pin" "$py" -m pip install -e "$repo[test]" 2>&1 | tee "$pip_log" || pip_status=${PIPESTATUS[0]}
    if [ "$pip_status" -ne 0 ]; then
        if ! grep -q ResolutionImpossible "$pip_log"; then
            echo "check_torch: pip could not install the project (see above)" >&2
            exit "$pip_status"
        fi
        echo "check_torch: torch $version does not satisfy the project's declared torch range;" \
             "installing its other requirements, then the project with --no-deps" >&2
        mapfile -t reqs < <("$py" - "$repo/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
for r in reqs:
    if re.match(r"\s*torch\s*([<>=!~;\[]|$)", r):
        continue
    print(r)
EOF
        )
        if [ "${#reqs[@]}" -gt 0 ]; then
            PIP_CONSTRAINT="$pin" "$py" -m pip install "${reqs[@]}"
        fi
        PIP_CONSTRAINT=/dev/null "$py" -m pip install --no-deps -e "$repo"
    fi
    echo "$want_stamp" >"$stamp"
fi

got=$(torch_version)
if [ "$got" != "$version" ]; then
    echo "check_torch: expected torch $version in $venv, found '${got:-none}'" >&2
    exit 3
fi
"$py" -c 'import torch; print("check_torch: using torch", torch.__version__, "from", torch.__file__)' >&2

cd "$repo"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"$py" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=${PIPESTATUS[0]}
# pytest's summary is its last line ending in " in 80.12s" or " in 80.12s (0:01:20)"; drop the "=" fences.
summary=$(grep -E ' in [0-9]+(\.[0-9]+)?s( \([0-9:]+\))?( =+)?$' "$log" | tail -n 1 \
    | sed -E 's/^=+ //; s/ =+$//' || true)
echo "check_torch: torch $version: ${summary:-<pytest ended without a summary line, exit status $status>}"
if [ "$status" -eq 5 ]; then
    echo "check_torch: pytest collected no tests" >&2
fi
exit "$status"
