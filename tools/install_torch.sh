#!/usr/bin/env bash
# Create the virtualenv of `make serve` / `make test` with a torch this host can run, and write the constraints
# file that keeps it: every later `pip install -c $VENV/torch-constraint.txt` fails instead of replacing torch.
#
#   PYTHON=python3 VENV=.venv tools/install_torch.sh       # what the Makefile runs
#
# Which torch:
#   TORCH_SPEC set          that build (on a Jetson: from TORCH_INDEX_URL, never PyPI's generic aarch64 wheel)
#   x86-64 (and the rest)   torch==2.13.0 (this project's CPU build; an unpinned torch pulls the CUDA wheels)
#   Jetson, L4T r36         the torch of $PYTHON when it is a CUDA build >= 2.6.0 (NVIDIA's wheel or the
#                           Jetson AI Lab one), seen through a --system-site-packages venv; otherwise the JetPack 6
#                           build the L4T image installs: torch==TORCH_VERSION from TORCH_INDEX_URL and
#                           numpy==NUMPY_VERSION (the defaults are Dockerfile.l4t's ARGs, so both agree)
#   other aarch64           stops: PyPI's aarch64 torch is a CUDA 13 server-ARM build; say which torch with TORCH_SPEC
# Environment: PYTHON (default python3), VENV (default .venv), TORCH_SPEC, TORCH_INDEX_URL, TORCH_VERSION,
# NUMPY_VERSION, OVAL_ROOT (prefix for /etc/nv_tegra_release, default /; tests point it at recorded files),
# OVAL_MACHINE (the machine `uname -m` names; tests set it).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# pyproject.toml's torch>=2.6: transformers 5 turns torch off below 2.6.0.
floor_major=2
floor_minor=6
python="${PYTHON:-python3}"
venv="${VENV:-.venv}"
root="${OVAL_ROOT:-/}"
root="${root%/}"
machine="${OVAL_MACHINE:-$(uname -m)}"
torch_spec="${TORCH_SPEC:-}"
constraint="$venv/torch-constraint.txt"

fail() {
  echo "install_torch.sh: $*" >&2
  exit 1
}

# The default of `ARG NAME=value` in Dockerfile.l4t: the board install and the image use the same torch.
dockerfile_arg() {
  local value
  value="$(sed -n "s/^ARG $1=//p" "$repo/Dockerfile.l4t" 2> /dev/null | head -n 1)"
  [ -n "$value" ] || fail "Dockerfile.l4t has no default for ARG $1; set $1 in the environment"
  printf '%s' "$value"
}

# "<version> <cuda or none>" of the torch a Python imports; fails when it has none.
torch_of() {
  "$1" -c 'import importlib.metadata as m, torch; print(m.version("torch"), torch.version.cuda or "none")' \
    2> /dev/null
}

# 0 when VERSION is at least 2.6.0 as PEP 440 (pip, transformers) orders it: 2.8.0, 2.13.0+cpu and NVIDIA's
# 2.7.0a0+79aa17489c.nv25.04 are; 2.6.0a0+ecf3bae40a.nv25.01 is a pre-release of 2.6.0 and is not.
meets_floor() {
  local major minor patch rest digits
  IFS=. read -r major minor patch rest <<< "${1%%+*}"
  digits="${patch%%[!0-9]*}"
  case "$major$minor" in ''|*[!0-9]*) return 1 ;; esac
  [ "$major" = "$floor_major" ] || { [ "$major" -gt "$floor_major" ]; return; }
  [ "$minor" = "$floor_minor" ] || { [ "$minor" -gt "$floor_minor" ]; return; }
  [ "${digits:-0}" -gt 0 ] && return 0
  # x.y.0 itself: no pre-release (a0, rc1) or dev part; a post-release (2.6.0.post1) is above the floor
  [ "$patch" = "$digits" ] && case "$rest" in ''|post*) true ;; *) false ;; esac
}

pip() { "$venv/bin/python" -m pip "$@"; }

# torch from the Jetson index alone (--no-deps: PyPI serves a torch of the same version whose manylinux tag pip
# prefers), then its pure-Python dependencies from PyPI with torch already satisfied, as Dockerfile.l4t does.
install_from_jetson_index() {
  local spec="$1" index numpy
  index="${TORCH_INDEX_URL:-$(dockerfile_arg TORCH_INDEX_URL)}"
  numpy="numpy==${NUMPY_VERSION:-$(dockerfile_arg NUMPY_VERSION)}"
  echo "install_torch.sh: $spec from $index (the JetPack 6 build), $numpy"
  pip install -q --no-deps --index-url "$index" "$spec"
  pip install -q "$spec" "$numpy"
  numpy_pin="$numpy"
}

l4t_release=""
if [ "$machine" = aarch64 ] && [ -r "$root/etc/nv_tegra_release" ]; then
  l4t_release="$(head -n 1 "$root/etc/nv_tegra_release")"
fi

system_site=()
source=""
numpy_pin=""
if [ -n "$l4t_release" ]; then
  case "$l4t_release" in
    "# R36 "*) ;;
    *) fail "this Jetson runs '$l4t_release'; oval-edge needs JetPack 6 (L4T R36: CUDA 12.6, Python 3.10).
Upgrade the board to JetPack 6, or set TORCH_SPEC to a torch >= 2.6 built for its CUDA." ;;
  esac
  if [ -z "$torch_spec" ]; then
    if found="$(torch_of "$python")"; then
      read -r version cuda <<< "$found"
      if [ "$cuda" != none ] && meets_floor "$version"; then
        system_site=(--system-site-packages)
        source="$python's torch $version (CUDA $cuda)"
      else
        echo "install_torch.sh: $python has torch $version (CUDA $cuda): oval-edge needs a CUDA build >= \
$floor_major.$floor_minor.0 (transformers 5 turns torch off below it), so $venv gets the JetPack 6 build instead" >&2
      fi
    fi
  fi
elif [ "$machine" = aarch64 ] || [ "$machine" = arm64 ]; then
  [ -n "$torch_spec" ] || fail "aarch64 without /etc/nv_tegra_release: not a Jetson with JetPack 6, and PyPI's \
aarch64 torch is a CUDA 13 build for server ARM. Set TORCH_SPEC to the torch for this machine (make serve \
TORCH_SPEC=...). On a Jetson, check that $root/etc/nv_tegra_release is readable, or serve from the L4T image: \
jetson/run-container.sh (README, On a Jetson)."
fi

"$python" -m venv "${system_site[@]}" "$venv"
pip install -q --upgrade pip
if [ -n "$source" ]; then
  echo "install_torch.sh: $venv uses $source"
elif [ -n "$l4t_release" ]; then
  install_from_jetson_index "${torch_spec:-torch==${TORCH_VERSION:-$(dockerfile_arg TORCH_VERSION)}}"
else
  pip install -q "${torch_spec:-torch==2.13.0}"
fi

found="$(torch_of "$venv/bin/python")" || fail "$venv/bin/python cannot import torch"
read -r version cuda <<< "$found"
meets_floor "$version" || fail "torch $version in $venv is below $floor_major.$floor_minor.0 (transformers 5 \
turns torch off below it); set TORCH_SPEC to a newer build"
if [ -n "$l4t_release" ] && [ "${cuda%%.*}" != 12 ]; then
  fail "torch $version in $venv is built for CUDA $cuda, not JetPack 6's CUDA 12: it cannot use the Orin's GPU. \
Check TORCH_INDEX_URL, or serve from the L4T image (jetson/run-container.sh)."
fi
# torch's version exactly as installed (a local tag such as +cpu or +nv24.08 included): pip keeps it or fails.
# numpy too where it was pinned with the JetPack build (a numpy 2 could break a torch compiled against 1.x).
{
  printf 'torch==%s\n' "$version"
  [ -z "$numpy_pin" ] || printf '%s\n' "$numpy_pin"
} > "$constraint"
echo "install_torch.sh: torch $version (CUDA $cuda) in $venv; constraints in $constraint"
