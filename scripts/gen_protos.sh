#!/usr/bin/env bash
# Regenerates the committed gRPC stubs (geodiloco.v1) from protos/geodiloco/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
# default: the project venv when there is one (make setup), else python on PATH
if [ -z "${PYTHON:-}" ]; then if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi; fi
# the protoc plugins (protoc-gen-mypy, ...) live next to the interpreter that has grpc_tools
PATH="$(dirname "$(command -v "$PYTHON")"):$PATH"
"$PYTHON" -m grpc_tools.protoc -Iprotos \
  --python_out=protos --grpc_python_out=protos --mypy_out=protos --mypy_grpc_out=protos \
  protos/geodiloco/v1/*.proto
touch protos/geodiloco/v1/py.typed
