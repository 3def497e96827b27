# shellcheck shell=bash
# Shell functions shared by jetson/run-container.sh, jetson/setup-board.sh and tools/check_container_steps.sh
# (sourced, not run). Each reads files under a root folder so tests can point it at recorded files; "" is the live
# system. None of them pipes into a reader that stops early (grep -q, head): under pipefail that fails at random.

# The default of `ARG NAME=value` in a Dockerfile (the first one), empty when there is none.
dockerfile_arg() {  # FILE NAME
  awk -v name="$2" 'index($0, "ARG " name "=") == 1 { print substr($0, length(name) + 6); exit }' "$1"
}

# Who ran the script: under sudo the user who called sudo (sudo sets HOME and USER to root's), else the current one.
invoking_user() {
  if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
    printf '%s' "$SUDO_USER"
  else
    printf '%s' "${USER:-$(id -un)}"
  fi
}

# NAME's home folder from the password database (ROOT/etc/passwd when ROOT is set); when the database does not
# know NAME, $HOME unless under sudo (where HOME is root's); else empty.
user_home() {  # ROOT NAME
  local home=""
  if [ -z "$1" ] && command -v getent > /dev/null 2>&1; then
    home="$(getent passwd "$2" | cut -d: -f6 || true)"
  elif [ -r "$1/etc/passwd" ]; then
    home="$(awk -F: -v name="$2" '$1 == name { print $6; exit }' "$1/etc/passwd")"
  fi
  if [ -z "$home" ] && [ -z "${SUDO_USER:-}" ]; then
    home="${HOME:-}"
  fi
  printf '%s' "$home"
}

# The host folder mounted at /models: $OVAL_MODELS_DIR, else ~/oval-edge/models of the invoking user; empty when
# that user's home is unknown.
models_folder() {  # ROOT
  local home
  if [ -n "${OVAL_MODELS_DIR:-}" ]; then
    printf '%s' "$OVAL_MODELS_DIR"
    return 0
  fi
  home="$(user_home "$1" "$(invoking_user)")"
  printf '%s' "${home:+$home/oval-edge/models}"
}

# The jetson-stats version installed on the host (`sudo pip3 install` puts it under /usr/local on Ubuntu 22.04,
# apt under /usr/lib/python3), read from its jtop/__init__.py; empty when none is installed.
host_jetson_stats_version() {  # ROOT
  local init
  for init in "$1"/usr/local/lib/python3*/dist-packages/jtop/__init__.py "$1"/usr/lib/python3/dist-packages/jtop/__init__.py; do
    if [ -r "$init" ]; then
      sed -n "s/^__version__ = [\"']\([^\"']*\)[\"'].*/\1/p" "$init"
      return 0
    fi
  done
}

# "7.2" for "7.2.2": the jtop client refuses a service whose major.minor differs from its own.
major_minor() {  # VERSION
  printf '%s' "$1" | cut -d. -f1-2
}
