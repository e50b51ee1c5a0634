#!/usr/bin/env bash
# Fails when the committed stubs differ from what the .proto files generate.
set -euo pipefail
cd "$(dirname "$0")/.."
# default: the project venv when there is one (make setup), else python on PATH
if [ -z "${PYTHON:-}" ]; then if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi; fi
# the protoc plugins (protoc-gen-mypy, ...) live next to the interpreter that has grpc_tools
PATH="$(dirname "$(command -v "$PYTHON")"):$PATH"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m grpc_tools.protoc -Iprotos \
  --python_out="$tmp" --grpc_python_out="$tmp" --mypy_out="$tmp" --mypy_grpc_out="$tmp" \
  protos/geodiloco/v1/*.proto
status=0
for f in "$tmp"/geodiloco/v1/*; do
  name=$(basename "$f")
  if ! cmp -s "$f" "protos/geodiloco/v1/$name"; then
    echo "stale generated stub: protos/geodiloco/v1/$name (run scripts/gen_protos.sh)" >&2
    status=1
  fi
done
for f in protos/geodiloco/v1/*_pb2*.py*; do
  [ -e "$tmp/geodiloco/v1/$(basename "$f")" ] || { echo "orphan stub: $f" >&2; status=1; }
done
exit $status
