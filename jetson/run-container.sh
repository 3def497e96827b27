#!/usr/bin/env bash
# The documented `docker run` line for the oval-edge L4T image (Dockerfile.l4t).
#
#   jetson/run-container.sh --print                  print the serve command, run nothing
#   jetson/run-container.sh [-- SERVE_ARGS...]       run `oval-edge serve` (foreground, container removed on exit)
#   jetson/run-container.sh --plan [-- PLAN_ARGS...] run `oval-edge plan --device auto --write-config
#                                                    /config/oval-edge.toml` with the same mounts (add --print)
#   --model NAME                                     serve (or plan) the .gguf file or Hugging Face folder NAME of
#                                                    the models folder: passes --model /models/NAME
# Environment: OVAL_IMAGE (default oval-edge:l4t), OVAL_PORT (host port, default 8000), OVAL_BIND (host address,
# default 127.0.0.1 like `oval-edge serve`; 0.0.0.0 for the LAN), OVAL_CONFIG_DIR (host folder at /config),
# OVAL_MODELS_DIR (host folder at /models, read-only; default ~/oval-edge/models of the user running this, through
# sudo too), OVAL_CACHE_VOLUME (Docker volume or host folder at /var/cache/oval-edge; default oval-edge-cache),
# OVAL_ROOT (prefix for the host files read here, default /; tests point it at recorded files).
#
# What each part is for:
#   --runtime nvidia                      the L4T GPU (device nodes and JetPack's driver libraries) in the container
#   -v oval-edge-cache:/var/cache/oval-edge
#                                         what a start derives once (quantized weights, converted GGUF metadata,
#                                         compiled C kernels, Triton kernels): the next start memory-maps them
#                                         instead of converting again. --rm removes the container, not this volume
#   -v ~/oval-edge/models:/models:ro      your own models (mounted when the folder exists)
#   -v /run/jtop.sock + --group-add GID   the jtop service socket, owned by group jtop, so the device probe can read
#                                         power mode, clocks and memory as the image's unprivileged user
#   -v /etc/nv_tegra_release (read-only)  the host's L4T release for the probe (the image has its base's copy)
# Docker masks /sys/firmware, so /proc/device-tree is empty inside a container (and cannot be bind-mounted back):
# there the probe names the module from jtop, which reads the module's part number on the host.
# Not used: --ipc=host (one server process, no torch.multiprocessing shared memory) and --privileged.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=jetson/host-lib.sh
. "$script_dir/host-lib.sh"

print_only=0
mode=serve
model=""
extra_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --print) print_only=1 ;;
    --plan) mode=plan ;;
    --model)
      [ $# -ge 2 ] || { echo "run-container.sh: --model needs a file or folder name in the models folder" >&2; exit 2; }
      model="$2"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    --) shift; extra_args=("$@"); break ;;
    *) echo "run-container.sh: unknown option '$1' (arguments for oval-edge go after --)" >&2; exit 2 ;;
  esac
  shift
done

root="${OVAL_ROOT:-/}"
root="${root%/}"
image="${OVAL_IMAGE:-oval-edge:l4t}"
port="${OVAL_PORT:-8000}"
bind="${OVAL_BIND:-127.0.0.1}"
case "$port" in
  ''|*[!0-9]*) echo "run-container.sh: OVAL_PORT must be a port number, got '$port'" >&2; exit 2 ;;
esac
# The image's OVAL_EDGE_CACHE (Dockerfile.l4t); the volume keeps what is written there across containers.
cache_dir=/var/cache/oval-edge
cache_volume="${OVAL_CACHE_VOLUME:-oval-edge-cache}"
models_dir="$(models_folder "$root")"
case "$model" in
  /*|*..*) echo "run-container.sh: --model takes a name inside the models folder ($models_dir), got '$model'" >&2; exit 2 ;;
esac
if [ -n "$model" ] && [ ! -e "$models_dir/$model" ]; then
  echo "run-container.sh: $models_dir/$model does not exist: put the .gguf file or Hugging Face folder there (or set OVAL_MODELS_DIR)" >&2
  exit 2
fi

# The jtop group id from the host's group database (the recorded file when OVAL_ROOT is set).
jtop_gid=""
if [ -z "$root" ] && command -v getent > /dev/null 2>&1; then
  jtop_gid="$(getent group jtop | cut -d: -f3 || true)"
elif [ -r "$root/etc/group" ]; then
  jtop_gid="$(awk -F: '$1 == "jtop" { print $3 }' "$root/etc/group")"
fi

cmd=(docker run --rm --runtime nvidia)
if [ "$mode" = serve ]; then
  cmd+=(--name oval-edge -p "${bind}:${port}:8000")
else
  cmd+=(--entrypoint oval-edge)
fi
cmd+=(-v /etc/nv_tegra_release:/etc/nv_tegra_release:ro)
# Mount the socket only when it exists: Docker would otherwise create a directory at /run/jtop.sock on the host.
if [ -S "$root/run/jtop.sock" ] && [ -n "$jtop_gid" ]; then
  cmd+=(-v /run/jtop.sock:/run/jtop.sock --group-add "$jtop_gid")
else
  jtop_pin="$(dockerfile_arg "$script_dir/../Dockerfile.l4t" JETSON_STATS_VERSION)"
  echo "# note: no jtop socket or group on this host, so jtop is left out (on the host: sudo pip3 install jetson-stats==$jtop_pin && sudo jtop --install-service)" >&2
fi
cmd+=(-v "${cache_volume}:${cache_dir}" -e "OVAL_EDGE_CACHE=${cache_dir}")
if [ -n "$models_dir" ] && [ -d "$models_dir" ]; then
  cmd+=(-v "${models_dir}:/models:ro")
else
  echo "# note: no models folder ${models_dir:-(no home folder found)}, so only the bundled model can be served (mkdir -p it and put a .gguf file or Hugging Face folder there)" >&2
fi
if [ -n "${OVAL_CONFIG_DIR:-}" ]; then
  cmd+=(-v "${OVAL_CONFIG_DIR}:/config")
elif [ "$mode" = plan ]; then
  echo "run-container.sh: --plan writes /config/oval-edge.toml: set OVAL_CONFIG_DIR to a folder of yours" >&2
  exit 2
fi
cmd+=("$image")
if [ "$mode" = serve ]; then
  # Arguments after the image replace its CMD, so the in-container bind address is always passed first.
  cmd+=(--host 0.0.0.0 --port 8000)
else
  cmd+=(plan --device auto --write-config /config/oval-edge.toml)
fi
if [ -n "$model" ]; then
  cmd+=(--model "/models/$model")
fi
if [ "${#extra_args[@]}" -gt 0 ]; then
  cmd+=("${extra_args[@]}")
fi

if [ "$print_only" = 1 ]; then
  printf '%q' "${cmd[0]}"
  printf ' %q' "${cmd[@]:1}"
  printf '\n'
else
  exec "${cmd[@]}"
fi
