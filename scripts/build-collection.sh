#!/usr/bin/env bash
# Build the lingjun.rdma collection the ordinary way -- a plain `ansible-galaxy collection build`
# of the repository root (galaxy.yml) -- into out/collection/. With --check, then:
#  1. the tarball holds the collection's files only (no repository tooling, tests or plugin
#     sources), no symlinks, and the node package as real files equal to the repository's;
#  2. install it from the tarball into a scratch collections path and, from a scratch working
#     directory outside the repository with an inventory of one fixture node and the Kubernetes
#     API emulator as its cluster, run its playbooks by FQCN: lingjun.rdma.validate (the node
#     read, the report, the validation labels), lingjun.rdma.deploy (render only) and
#     lingjun.rdma.verify, with no repository path configured;
#  3. everything they wrote is under the working directory (out/<inventory>/), nothing in the
#     installed collection.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/out/collection
rm -rf "$out" && mkdir -p "$out"
ansible-galaxy collection build . --output-path "$out" --force
tarball=$(ls "$out"/lingjun-rdma-*.tar.gz)
echo "built $tarball"
[[ ${1:-} == --check ]] || exit 0

fail() { echo "collection check: $*" >&2; exit 1; }

# 1. What the tarball holds.
listing=$(tar tzvf "$tarball")
if grep -q '^l' <<<"$listing"; then fail "the tarball holds symlinks: $(grep '^l' <<<"$listing" | head -3)"; fi
names=$(tar tzf "$tarball")
for unwanted in plugin_src/ molecule/ tests/ bench/ docs/ inventories/ scripts/ collections/ .venv/ out/ \
  ansible.cfg Makefile requirements-dev.txt charts/rdma-device-plugin/tests/ plugins/module_utils/pyproject.toml; do
  if grep -q "^${unwanted}" <<<"$names"; then fail "the tarball holds repository-only $unwanted"; fi
done
for wanted in plugins/modules/rdma_node_info.py plugins/action/rdma_verify.py plugins/filter/rdma_typed.py \
  plugins/callback/rdma_short.py plugins/plugin_utils/rdma_hosts.py roles/plugin_deploy/tasks/main.yml \
  playbooks/site.yml charts/rdma-device-plugin/Chart.yaml meta/runtime.yml; do
  grep -qx "$wanted" <<<"$names" || fail "the tarball lacks $wanted"
done
scratch=$(mktemp -d /tmp/rdma-collection-XXXXXX)
cleanup() {
  python3 "$root/scripts/kube-emulator.py" stop --kubeconfig "$scratch/kubeconfig" > /dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT
mkdir "$scratch/unpacked" && tar xzf "$tarball" -C "$scratch/unpacked"
for f in plugins/module_utils/rdma_node/*.py; do
  cmp -s "$f" "$scratch/unpacked/$f" || fail "$f differs in the tarball (or is missing)"
done

# 2. Installed, used by FQCN from a directory outside the repository (whose ansible.cfg knows only it).
work=$scratch/work
mkdir -p "$work/inventories/fleet"
printf '[defaults]\ncollections_path = %s\n' "$scratch/collections" > "$work/ansible.cfg"
ANSIBLE_CONFIG=$work/ansible.cfg ansible-galaxy collection install "$tarball" -p "$scratch/collections" --no-deps --force
installed=$scratch/collections/ansible_collections/lingjun/rdma
find "$installed" -type f | sort > "$scratch/installed-before"
"$root/.venv/bin/rdma-device-plugin" fixture "$scratch/node" > /dev/null
"$root/.venv/bin/python" "$root/scripts/kube-emulator.py" start --port 0 --kubeconfig "$scratch/kubeconfig" > /dev/null
"$root/.venv/bin/python" - "$scratch/kubeconfig" <<'PY'
"""One Node advertising rdma/hca 1k and the release's DaemonSets, rolled out."""
import json, sys, urllib.request, yaml
server = yaml.safe_load(open(sys.argv[1]))["clusters"][0]["cluster"]["server"]
def call(method, path, body, ctype="application/json"):
    req = urllib.request.Request(server + path, json.dumps(body).encode(), {"Content-Type": ctype}, method=method)
    urllib.request.urlopen(req, timeout=30).close()
call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1"},
                               "status": {"capacity": {"rdma/hca": "1k"}, "allocatable": {"rdma/hca": "1k"}}})
ds = "/apis/apps/v1/namespaces/kube-system/daemonsets"
labels = {"app.kubernetes.io/instance": "rdma", "app.kubernetes.io/component": "device-plugin"}
call("POST", ds, {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "rdma-rdma-device-plugin-shared",
     "labels": labels}, "spec": {}})
ready = dict.fromkeys(["desiredNumberScheduled", "updatedNumberScheduled", "numberReady", "numberAvailable"], 1)
call("PATCH", ds + "/rdma-rdma-device-plugin-shared/status", {"status": {"observedGeneration": 1, **ready}},
     "application/merge-patch+json")
PY
cat > "$work/inventories/fleet/hosts.yml" <<YML
all:
  vars:
    rdma_kubeconfig: $scratch/kubeconfig
    rdma_non_host_network: true
    plugin_deploy_render_only: true
    plugin_verify_timeout: 10
    plugin_verify_poll_interval: 1
  children:
    rdma_nodes:
      hosts:
        gpu-1:
          ansible_connection: local
          ansible_python_interpreter: $root/.venv/bin/python
          rdma_sysfs_root: $scratch/node/sys
          rdma_procfs_root: $scratch/node/proc
          rdma_dev_root: $scratch/node/dev
YML
for playbook in validate deploy verify; do
  echo "=== ansible-playbook lingjun.rdma.$playbook (from $work)"
  (cd "$work" && env -u ANSIBLE_ROLES_PATH -u ANSIBLE_LIBRARY -u ANSIBLE_MODULE_UTILS -u ANSIBLE_FILTER_PLUGINS \
    -u ANSIBLE_ACTION_PLUGINS -u ANSIBLE_COLLECTIONS_PATH -u ANSIBLE_CALLBACK_PLUGINS ANSIBLE_CONFIG="$work/ansible.cfg" \
    "$root/.venv/bin/ansible-playbook" -i inventories/fleet "lingjun.rdma.$playbook")
done

# 3. Written under the working directory, nothing in the collection.
for written in out/fleet/validation/rdma-validation.json out/fleet/validation/rdma-validation.md \
  out/fleet/deploy/rdma-values.yaml; do
  [[ -s $work/$written ]] || fail "$written was not written under the working directory $work"
done
ls "$work"/out/fleet/manifests/*.yaml > /dev/null || fail "no manifests rendered under $work/out/fleet/manifests"
grep -q '"passed": 1' "$work/out/fleet/validation/rdma-validation.json" || fail "the fixture node did not pass validation"
grep -q 'required: true' "$work/out/fleet/deploy/rdma-values.yaml" || fail "the values do not require validated nodes"
find "$installed" -type f | sort | diff "$scratch/installed-before" - || fail "the playbooks wrote into the installed collection"
echo "collection: a plain ansible-galaxy build of $root, installed from $tarball, ran validate, deploy (render only)"
echo "and verify by FQCN from $work, writing only under it"
