#!/usr/bin/env bash
# Build the lingjun.rdma collection the ordinary way -- a plain `ansible-galaxy collection build`
# of the repository root (galaxy.yml) -- into out/collection/. With --check, then:
#  1. the tarball holds the collection's files only (no repository tooling, tests or plugin
#     sources), no symlinks, and the node package as real files equal to the repository's;
#  2. install it from the tarball into a scratch collections path and, from a scratch working
#     directory outside the repository with an inventory of one fixture node, run its playbooks by
#     FQCN against a real cluster (scripts/kube_cluster.py: the components `make kube` builds; the
#     node runs the kubelet's device manager and this checkout's plugin as the chart's image):
#     lingjun.rdma.validate (the node read, the report, the validation label), lingjun.rdma.deploy
#     (helm upgrade --install of the installed collection's chart with the Helm v4 built there)
#     and lingjun.rdma.verify (the node advertises rdma/hca), with no repository path configured;
#  3. everything they wrote is under the working directory (out/<inventory>/), nothing in the
#     installed collection.
# KEEP_SCRATCH=1 keeps the scratch directory and its cluster, to look into a failure (then stop it:
# .venv/bin/python scripts/kube_cluster.py down --dir <scratch>/c).
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
# Short: the node's device-plugin sockets live below it (unix socket paths are limited).
scratch=$(mktemp -d /tmp/rc-XXXXXX)
cleanup() {
  [ -n "${KEEP_SCRATCH:-}" ] || "$root/.venv/bin/python" "$root/scripts/kube_cluster.py" down --dir "$scratch/c" > /dev/null 2>&1 || true
  [ -n "${KEEP_SCRATCH:-}" ] || rm -rf "$scratch"
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
"$root/.venv/bin/python" "$root/scripts/kube_cluster.py" up --no-build --dir "$scratch/c" > /dev/null
"$root/.venv/bin/python" "$root/scripts/kube_cluster.py" join gpu-1 --dir "$scratch/c" --root "$scratch/n" \
  --label feature.node.kubernetes.io/pci-15b3.present=true --fixture --plugin > /dev/null
kube_bin=$("$root/.venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["bin"])' "$scratch/c/state.json")
cat > "$work/inventories/fleet/hosts.yml" <<YML
all:
  vars:
    rdma_kubeconfig: $scratch/c/kubeconfig
    # hostNetwork pods (the chart's default): the node runs the plugin as a host process without a
    # network namespace, so a non-hostNetwork plugin would read this machine's /proc/net, not the
    # fixture node's, and refuse its NICs (no compute IPv6 address).
    plugin_deploy_helm_binary: $kube_bin/helm
    rdma_plugin_image_repository: 127.0.0.1:5000/rdma/rdma-device-plugin
    plugin_verify_timeout: 120
    plugin_verify_poll_interval: 1
  children:
    rdma_nodes:
      hosts:
        gpu-1:
          ansible_connection: local
          ansible_python_interpreter: $root/.venv/bin/python
          rdma_sysfs_root: $scratch/n/sys
          rdma_procfs_root: $scratch/n/proc
          rdma_dev_root: $scratch/n/dev
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
"$kube_bin/helm" --kubeconfig "$scratch/c/kubeconfig" history rdma -n kube-system > /dev/null \
  || fail "deploy did not install release rdma"
grep -q '"passed": 1' "$work/out/fleet/validation/rdma-validation.json" || fail "the fixture node did not pass validation"
grep -q 'required: true' "$work/out/fleet/deploy/rdma-values.yaml" || fail "the values do not require validated nodes"
find "$installed" -type f | sort | diff "$scratch/installed-before" - || fail "the playbooks wrote into the installed collection"
echo "collection: a plain ansible-galaxy build of $root, installed from $tarball, ran validate, deploy (Helm)"
echo "and verify by FQCN from $work against a real cluster, writing only under it"
