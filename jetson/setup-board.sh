#!/usr/bin/env bash
# Check what a Jetson Orin board needs for oval-edge's memory budget, and print what to change.
#
#   jetson/setup-board.sh            check and print; never writes anything
#   sudo jetson/setup-board.sh --apply
#                                    also make the safe, documented changes, each announced first:
#                                    boot headless, Docker's default runtime nvidia, the user in group jtop
#
# Swap, power mode and clocks are only reported: they need a choice (which disk, which mode) that a script
# should not make. Off a Jetson it says so, lists what it would check, and exits 0.
# OVAL_ROOT (default /) prefixes every file read, so tests can point it at recorded files; with OVAL_ROOT set,
# live commands (systemctl, nvpmodel, jetson_clocks, df, id) are skipped and --apply is refused.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=jetson/host-lib.sh
. "$script_dir/host-lib.sh"
apply=0
for arg in "$@"; do
  case "$arg" in
    --apply) apply=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "setup-board.sh: unknown option '$arg' (use --apply or --help)" >&2; exit 2 ;;
  esac
done

root="${OVAL_ROOT:-/}"
root="${root%/}"
live=1
[ -n "$root" ] && live=0
user_name="$(invoking_user)"
# The image's jtop client version: Dockerfile.l4t's ARG is the one place it is written.
jtop_pin="$(dockerfile_arg "$script_dir/../Dockerfile.l4t" JETSON_STATS_VERSION)"
jtop_install="sudo pip3 install jetson-stats==$jtop_pin && sudo jtop --install-service"
warnings=0

say() { printf '%s\n' "$*"; }
ok() { printf '  [ok]   %s\n' "$*"; }
warn() { printf '  [warn] %s\n' "$*"; warnings=$((warnings + 1)); }
info() { printf '  [info] %s\n' "$*"; }
todo() { printf '         -> %s\n' "$*"; }
# Run a live command only on the live system and only when it exists.
have() { [ "$live" = 1 ] && command -v "$1" > /dev/null 2>&1; }
meminfo_mib() { awk -v key="$1:" '$1 == key { printf "%d", $2 / 1024 }' "$root/proc/meminfo"; }

checks_list() {
  say "On a Jetson this script checks:"
  say "  - L4T release (/etc/nv_tegra_release) is r36 (JetPack 6), which Dockerfile.l4t is built for"
  say "  - module (/proc/device-tree/model) and memory (/proc/meminfo: MemTotal, MemAvailable, swap)"
  say "  - headless boot: 'systemctl get-default' is multi-user.target (the desktop holds ~0.3-0.8 GB)"
  say "  - swap (/proc/swaps and the device behind it): on NVMe, not eMMC/SD card, and not zram"
  say "  - power mode ('nvpmodel -q') and clocks ('jetson_clocks --show')"
  say "  - Docker's default runtime is nvidia in /etc/docker/daemon.json (GPU visible to 'docker build')"
  say "  - the jtop group and socket (/run/jtop.sock), and that you are in the group"
  say "and prints the 'docker run' line for the oval-edge image (jetson/run-container.sh --print)."
}

if [ ! -r "$root/etc/nv_tegra_release" ]; then
  say "Not on a Jetson: ${root:-}/etc/nv_tegra_release does not exist, so there is no L4T here to check."
  say "Nothing was checked or changed."
  say ""
  checks_list
  say ""
  say "The documented run line, for reference (README 'On a Jetson'):"
  say "  $("$script_dir/run-container.sh" --print 2> /dev/null)"
  if [ "$apply" = 1 ]; then
    say ""
    say "--apply ignored: there is no Jetson here to change."
    exit 1
  fi
  exit 0
fi

if [ "$apply" = 1 ]; then
  if [ "$live" != 1 ]; then
    echo "setup-board.sh: --apply refused with OVAL_ROOT set: it only changes the live system." >&2
    exit 2
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "setup-board.sh: --apply needs root: sudo $0 --apply" >&2
    exit 2
  fi
fi

say "oval-edge board check${root:+ (reading files under $root; live commands skipped)}"

# --- release and module -------------------------------------------------------------------------------------
say "L4T and module"
release_line="$(head -n 1 "$root/etc/nv_tegra_release")"
major="$(printf '%s' "$release_line" | sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1/p')"
revision="$(printf '%s' "$release_line" | sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\2/p')"
if [ "$major" = 36 ]; then
  ok "L4T R${major}.${revision} (JetPack 6): matches the r36 base of Dockerfile.l4t"
elif [ -n "$major" ]; then
  warn "L4T R${major}.${revision}: Dockerfile.l4t is built for r36 (JetPack 6); pass a matching --build-arg BASE_IMAGE"
else
  warn "could not read the release from: $release_line"
fi
if [ -r "$root/proc/device-tree/model" ]; then
  info "module: $(tr -d '\0' < "$root/proc/device-tree/model")"
else
  info "module: ${root:-}/proc/device-tree/model not readable"
fi

# --- memory -----------------------------------------------------------------------------------------------
say "Memory"
if [ -r "$root/proc/meminfo" ]; then
  info "MemTotal $(meminfo_mib MemTotal) MiB, MemAvailable $(meminfo_mib MemAvailable) MiB, SwapTotal $(meminfo_mib SwapTotal) MiB, SwapFree $(meminfo_mib SwapFree) MiB"
  info "CPU and GPU share this memory: the budget for 'oval-edge serve' comes out of MemAvailable"
else
  warn "${root:-}/proc/meminfo not readable"
fi

# --- headless boot ----------------------------------------------------------------------------------------
say "Boot target"
target=""
if have systemctl; then
  target="$(systemctl get-default 2> /dev/null || true)"
fi
if [ -z "$target" ]; then
  info "boot target unknown here; on the board: systemctl get-default (want multi-user.target)"
elif [ "$target" = multi-user.target ]; then
  ok "boots headless (multi-user.target)"
else
  warn "boots to $target: the desktop keeps ~0.3-0.8 GB of the shared memory"
  todo "sudo systemctl set-default multi-user.target   # takes effect at the next boot"
  if [ "$apply" = 1 ]; then
    say "  [apply] systemctl set-default multi-user.target"
    systemctl set-default multi-user.target
  fi
fi

# --- swap -------------------------------------------------------------------------------------------------
say "Swap"
swap_good=0
swap_count=0
zram=0
if [ -r "$root/proc/swaps" ]; then
  while read -r name type size _used _prio; do
    [ "$name" = Filename ] && continue
    swap_count=$((swap_count + 1))
    size_mib=$((size / 1024))
    device="$name"
    if [ "$type" = file ]; then
      device="unknown (file)"
      if have df; then
        device="$(df -P -- "$name" 2> /dev/null | awk 'NR == 2 { print $1 }')"
      fi
    fi
    case "$device" in
      /dev/zram*)
        warn "$name: zram, ${size_mib} MiB of compressed RAM; it takes memory from the model and GPU memory cannot swap"
        zram=1 ;;
      /dev/nvme*)
        ok "$name ($type, ${size_mib} MiB) on NVMe ($device)"; swap_good=1 ;;
      /dev/mmcblk*)
        warn "$name ($type, ${size_mib} MiB) on eMMC/SD ($device): slow, and wears the boot medium" ;;
      *)
        info "$name ($type, ${size_mib} MiB) on $device" ;;
    esac
  done < "$root/proc/swaps"
fi
if [ "$swap_count" = 0 ]; then
  warn "no swap: loading a model peaks above its final size, and without swap that peak is an OOM kill"
fi
if [ "$swap_good" = 0 ]; then
  todo "swap on NVMe (not changed by --apply: pick the disk and size yourself), e.g. with NVMe mounted at /ssd:"
  todo "sudo fallocate -l 16G /ssd/16GB.swap && sudo chmod 600 /ssd/16GB.swap && sudo mkswap /ssd/16GB.swap && sudo swapon /ssd/16GB.swap"
  todo "echo '/ssd/16GB.swap none swap sw 0 0' | sudo tee -a /etc/fstab"
fi
if [ "$zram" = 1 ]; then
  todo "sudo systemctl disable nvzramconfig   # zram off from the next boot, once swap on NVMe is in place"
fi

# --- power mode and clocks ----------------------------------------------------------------------------------
say "Power mode and clocks"
if have nvpmodel; then
  mode="$(nvpmodel -q 2> /dev/null | tr '\n' ' ' || true)"
  info "nvpmodel -q: ${mode:-no answer}"
  todo "the highest mode is usually 0 (MAXN; on an Orin Nano Super, MAXN SUPER): sudo nvpmodel -m <id> (may need a reboot)"
else
  info "nvpmodel not available here; on the board: sudo nvpmodel -q"
fi
if have jetson_clocks && [ "$(id -u)" = 0 ]; then
  info "jetson_clocks --show:"
  jetson_clocks --show 2> /dev/null | sed 's/^/           /' || true
else
  info "clocks: sudo jetson_clocks --show; 'sudo jetson_clocks' pins them at the mode's maximum until reboot (steadier decode speed)"
fi

# --- docker runtime -----------------------------------------------------------------------------------------
say "Docker"
daemon_json="$root/etc/docker/daemon.json"
runtime=""
if [ -r "$daemon_json" ] && command -v python3 > /dev/null 2>&1; then
  runtime="$(python3 -B -c 'import json, sys; print(json.load(open(sys.argv[1])).get("default-runtime", ""))' "$daemon_json" 2> /dev/null || echo unreadable)"
fi
if [ "$runtime" = nvidia ]; then
  ok "default-runtime is nvidia in /etc/docker/daemon.json (docker build sees the GPU: the bitsandbytes smoke test runs)"
else
  warn "default-runtime is '${runtime:-not set}' in /etc/docker/daemon.json: 'docker build' cannot see the GPU, so the build-time bitsandbytes test is skipped"
  todo "add \"default-runtime\": \"nvidia\" to /etc/docker/daemon.json, then: sudo systemctl restart docker"
  if [ "$apply" = 1 ]; then
    backup="/etc/docker/daemon.json.bak-$(date +%Y%m%d%H%M%S)"
    say "  [apply] set default-runtime nvidia in /etc/docker/daemon.json (previous file kept as $backup)"
    mkdir -p /etc/docker
    if [ -e /etc/docker/daemon.json ]; then
      cp -p /etc/docker/daemon.json "$backup"
    fi
    python3 - /etc/docker/daemon.json << 'EOF'
import json, os, sys
path = sys.argv[1]
config = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
config.setdefault("runtimes", {}).setdefault("nvidia", {"path": "nvidia-container-runtime", "runtimeArgs": []})
config["default-runtime"] = "nvidia"
with open(path, "w") as out:
    json.dump(config, out, indent=4)
    out.write("\n")
EOF
    say "  [apply] not restarting Docker (it would stop running containers): sudo systemctl restart docker"
  fi
fi

# --- jtop -----------------------------------------------------------------------------------------------------
say "jtop (jetson-stats)"
jtop_line=""
if [ "$live" = 1 ] && command -v getent > /dev/null 2>&1; then
  jtop_line="$(getent group jtop || true)"
elif [ -r "$root/etc/group" ]; then
  jtop_line="$(grep '^jtop:' "$root/etc/group" || true)"
fi
if [ -z "$jtop_line" ]; then
  warn "no jtop group: jetson-stats is not installed on the host"
  todo "$jtop_install   # the version of the image's client"
else
  info "jtop group id $(printf '%s' "$jtop_line" | cut -d: -f3) (the run line passes it with --group-add)"
  members=",$(printf '%s' "$jtop_line" | cut -d: -f4),"
  in_group=0
  case "$members" in *",$user_name,"*) in_group=1 ;; esac
  if [ "$in_group" = 0 ] && [ "$live" = 1 ]; then
    case " $(id -nG "$user_name" 2> /dev/null || true) " in *" jtop "*) in_group=1 ;; esac
  fi
  if [ "$in_group" = 1 ]; then
    ok "$user_name is in group jtop"
  else
    warn "$user_name is not in group jtop (jtop on the host needs it; the container gets the group from --group-add)"
    todo "sudo usermod -aG jtop $user_name   # then log out and in"
    if [ "$apply" = 1 ] && [ "$user_name" != root ]; then
      say "  [apply] usermod -aG jtop $user_name"
      usermod -aG jtop "$user_name"
    fi
  fi
  if [ -S "$root/run/jtop.sock" ]; then
    ok "/run/jtop.sock exists (jtop service running)"
  else
    warn "/run/jtop.sock missing: the jtop service is not running (sudo systemctl restart jtop.service)"
  fi
  # The client in the image refuses a service of another major.minor ("Mismatch version jtop service").
  jtop_version="$(host_jetson_stats_version "$root")"
  if [ -z "$jtop_version" ]; then
    info "host jetson-stats version not found under /usr/local/lib/python3*/dist-packages; the image's client is $jtop_pin"
  elif [ "$(major_minor "$jtop_version")" = "$(major_minor "$jtop_pin")" ]; then
    ok "host jetson-stats $jtop_version matches the image's client $jtop_pin (major.minor)"
  else
    warn "host jetson-stats $jtop_version, image's client $jtop_pin: the client refuses a service of another major.minor"
    todo "$jtop_install   # or keep the host's: docker build --build-arg JETSON_STATS_VERSION=$jtop_version ..."
  fi
fi

# --- the run line -----------------------------------------------------------------------------------------------
# The same lines as README "On a Jetson"; run-container.sh is their single source.
say ""
say "Next steps (README 'On a Jetson'):"
say "  build: docker build -f Dockerfile.l4t -t oval-edge:l4t ."
# The invoking user's home, not $HOME: under sudo that is /root, a folder the image's user cannot write to.
owner_home="$(user_home "$root" "$user_name")"
config_dir="${OVAL_CONFIG_DIR:-${owner_home:-~$user_name}/oval-edge}"
models_dir="$(models_folder "$root")"
say "  folders (yours: the image's user writes the config, reads the models): mkdir -p $config_dir ${models_dir:-~$user_name/oval-edge/models}"
say "  plan:  $(OVAL_CONFIG_DIR="$config_dir" "$script_dir/run-container.sh" --plan --print 2> /dev/null)"
say "  run:   $(OVAL_CONFIG_DIR="$config_dir" "$script_dir/run-container.sh" --print -- --config /config/oval-edge.toml 2> /dev/null)"
say ""
if [ "$warnings" = 0 ]; then
  say "No warnings."
else
  say "$warnings warning(s) above."
  [ "$apply" = 1 ] || say "Nothing was changed; 'sudo $0 --apply' makes the boot-target, Docker-runtime and jtop-group changes."
fi
