#!/usr/bin/env bash
# Validates the Kubernetes manifests of deploy/k8s against the Kubernetes API schema (strict: an unknown or
# misspelled field fails), with kubernetes-validate from PyPI, which carries the schemas (no cluster, no network
# once installed). Installed into target/manifest-check on first use. kustomization.yaml is kustomize's file,
# not a Kubernetes resource, and is left out.
#
#   KUBERNETES_VERSION   the schema version to validate against (default 1.31.0: the oldest the manifests
#                        support, for unhealthyPodEvictionPolicy)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=target/manifest-check
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "installing kubernetes-validate (PyPI) into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate
fi
manifests=()
for f in deploy/k8s/*.yaml; do
  [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f")
done
"$venv/bin/kubernetes-validate" --strict --quiet -k "${KUBERNETES_VERSION:-1.31.0}" "${manifests[@]}"
echo "manifests: ${#manifests[@]} files valid against Kubernetes ${KUBERNETES_VERSION:-1.31.0}"
