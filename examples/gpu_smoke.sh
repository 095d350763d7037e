#!/usr/bin/env bash
# GPU smoke test for an operator (not run by CI, which has no GPU): build a small preset twice (DFlash, and the
# same deployment without a draft), serve each with Triton + TensorRT-LLM, send the same greedy prompts, and
# compare. Prints per prompt the acceptance length and tokens/s of both, then PASS/FAIL.
#
#   examples/gpu_smoke.sh [PRESET] [GPU]          default: qwen3-8b h100 (any `trtdflash build --target` preset)
#
# Run inside a container with tritonserver and TensorRT-LLM >= 1.3.0rc27 (README, "Targets"), from a clone of
# trtllm-dflash installed with `pip install --no-deps -e .` (the deployments themselves carry their code). Greedy bf16 outputs of a verify forward and a decode step can differ on a near-tie
# of two logits; a FAIL names the first differing prompt so you can look at it.
set -euo pipefail
preset=${1:-qwen3-8b}
gpu=${2:-h100}
work=$(mktemp -d /tmp/gpu-smoke.XXXXXX)
prompts=("What is 17 times 23? Answer with the number." "Write a Python function that reverses a string."
         "Name three primary colors." "Explain in one sentence why the sky is blue.")

serve_and_ask() {  # $1 build dir, $2 results file
  "$1/launch.sh" triton > "$1/server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do curl -sf localhost:8000/v2/health/ready > /dev/null && break; sleep 2; done
  curl -sf localhost:8000/v2/health/ready > /dev/null || { echo "server did not start; see $1/server.log"; kill $pid; exit 1; }
  for p in "${prompts[@]}"; do
    trtdflash client --url localhost:8001 --prompt "$p" --max-tokens 128 --json
  done > "$2"
  kill -TERM $pid; wait $pid || true
}

trtdflash build --target "$preset" --gpu "$gpu" --output "$work/dflash"
trtdflash build --target "$preset" --gpu "$gpu" --no-draft --output "$work/plain"
serve_and_ask "$work/dflash" "$work/dflash.jsonl"
serve_and_ask "$work/plain" "$work/plain.jsonl"

python3 - "$work/dflash.jsonl" "$work/plain.jsonl" <<'EOF'
import json, sys
dflash, plain = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
ok = True
for i, (d, p) in enumerate(zip(dflash, plain)):
    same = d["text"] == p["text"]
    ok &= same
    print(f"prompt {i}: {'same' if same else 'DIFFERENT'} text, tau {d['acceptance_length']:.2f}, "
          f"{d['tokens_per_second']:.1f} tok/s with DFlash vs {p['tokens_per_second']:.1f} without "
          f"({d['tokens_per_second'] / max(p['tokens_per_second'], 1e-9):.2f}x)")
print("PASS" if ok else "FAIL: greedy DFlash output differs from TensorRT-LLM without speculation")
sys.exit(0 if ok else 1)
EOF
