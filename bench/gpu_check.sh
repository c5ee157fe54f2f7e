#!/usr/bin/env bash
# One command for a machine with a GPU: the probe's cost and exact counts in bf16 on CUDA, eager and
# with CUDA graphs (generate with a static cache and torch.compile). Without CUDA, or with --cpu, it
# runs the CPU part: a short eager overhead bench and the compiled (inductor) exactness check.
#
#   bench/gpu_check.sh          # CUDA when torch sees one, else the CPU part
#   bench/gpu_check.sh --cpu    # the CPU part only
#
# Prints the figures; exits non-zero when the compiled counts differ from the eager reference
# (or when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"

if [[ "${1:-}" != "--cpu" ]] && "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$python" -c 'import torch; print("gpu_check.sh:", torch.cuda.get_device_name(0))'
    echo "== eager: decode overhead, bf16 CUDA (probe vs no hooks vs naive hook)"
    "$python" -m bench.probe_overhead --device cuda --dtype bfloat16 --alternations 15 --tokens 48
    echo "== CUDA graphs: counts vs an eager reference, then compiled decode overhead"
    "$python" -m bench.gpu_check --device cuda --dtype bfloat16 --time
    echo "== CUDA graphs, float32 (exactness without bf16 ties)"
    "$python" -m bench.gpu_check --device cuda --dtype float32 --no-time
else
    echo "gpu_check.sh: no CUDA device (or --cpu): running the CPU part"
    echo "== eager: decode overhead on the bundled model (short run; the full one is bench/probe_overhead.py)"
    "$python" -m bench.probe_overhead --only bundled --alternations 5 --tokens 16
    echo "== torch.compile (inductor, CPU): counts vs an eager reference"
    "$python" -m bench.gpu_check --device cpu --tokens 12 --prompt 8 --no-time
fi
