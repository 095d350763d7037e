#!/usr/bin/env bash
# Stream a completion over HTTP with Triton's generate extension (server-sent events), nothing but curl.
#   examples/http_generate_stream.sh [HOST:PORT] [PROMPT]
# Each `data:` event carries one text delta in `text_output` plus the running DFlash statistics
# (num_output_tokens, total_draft_tokens, total_accepted_draft_tokens, acceptance_length, finish_reason).
# Without streaming, POST the same body (with "stream": false) to /v2/models/ensemble/generate.
set -euo pipefail
URL=${1:-127.0.0.1:8000}
PROMPT=${2:-Write a haiku about GPUs.}
BODY=$(python3 -c 'import json,sys; print(json.dumps({"text_input": sys.argv[1], "max_tokens": 64, "stream": True}))' "$PROMPT")
curl -sS -N -X POST "http://$URL/v2/models/ensemble/generate_stream" -H 'Content-Type: application/json' -d "$BODY"
