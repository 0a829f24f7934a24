#!/usr/bin/env bash
# Build the lingjun.rdma collection tarball into out/collection/ (see galaxy.yml), then,
# with --check, install it from the tarball into a scratch collections path and run a
# playbook outside this repository that uses the roles by FQCN against a fixture node,
# with no repository path (roles, library, module_utils) configured.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/out/collection
stage=$out/src
rm -rf "$out" && mkdir -p "$stage/plugins/modules" "$stage/plugins/module_utils" "$stage/plugins/filter" "$stage/meta"
cp galaxy.yml "$stage/"
cat > "$stage/README.md" <<'MD'
# lingjun.rdma

Roles: `lingjun.rdma.rdma_nic_validate`, `lingjun.rdma.ipv6_compute_validate`, `lingjun.rdma.rdma_node_facts`,
`lingjun.rdma.plugin_deploy`, `lingjun.rdma.plugin_verify`, `lingjun.rdma.plugin_image`,
`lingjun.rdma.rdma_mode_switch`. Modules: `lingjun.rdma.rdma_node_info`, `lingjun.rdma.rdma_validation_report`, ...
Playbooks: `lingjun.rdma.validate`, `lingjun.rdma.deploy`, ... See the project's README and docs/.
MD
cp meta/runtime.yml "$stage/meta/"
cp -r roles playbooks "$stage/"
cp library/*.py "$stage/plugins/modules/"
cp -rL module_utils/rdma_node "$stage/plugins/module_utils/rdma_node"
find "$stage/plugins/module_utils" -name __pycache__ -prune -exec rm -rf {} +
cp filter_plugins/*.py "$stage/plugins/filter/"
mkdir -p "$stage/plugins/action" && cp action_plugins/*.py "$stage/plugins/action/"
# Inside a collection, roles find their collection's modules by short name but not its Jinja
# filters (ansible-core resolves those only by FQCN or from filter_plugins/ next to the play):
# qualify this repository's filters in the staged roles and playbooks.
filters=$(grep -h 'return {' filter_plugins/*.py | grep -o '"[a-z_0-9]*":' | tr -d '":' | sort -u | paste -sd'|')
[[ -n $filters ]] || { echo "no filters found in filter_plugins/" >&2; exit 1; }
find "$stage/roles" "$stage/playbooks" -name '*.yml' -o -name '*.j2' | xargs sed -i -E "s/\| *($filters)\b/| lingjun.rdma.\1/g"
ansible-galaxy collection build "$stage" --output-path "$out" --force
tarball=$(ls "$out"/lingjun-rdma-*.tar.gz)
echo "built $tarball"
[[ ${1:-} == --check ]] || exit 0

# Install from the tarball and use the roles by FQCN from a playbook outside the repository.
scratch=$(mktemp -d /tmp/rdma-collection-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
ansible-galaxy collection install "$tarball" -p "$scratch/collections" --no-deps
printf '[defaults]\ncollections_path = %s\n' "$scratch/collections" > "$scratch/ansible.cfg"
"$root/.venv/bin/rdma-device-plugin" fixture "$scratch/node" > /dev/null
cat > "$scratch/site.yml" <<YML
- name: Validate a fixture node with the collection's roles
  hosts: localhost
  gather_facts: false
  vars:
    rdma_sysfs_root: $scratch/node/sys
    rdma_procfs_root: $scratch/node/proc
    rdma_dev_root: $scratch/node/dev
    rdma_non_host_network: true
  roles:
    - role: lingjun.rdma.rdma_nic_validate
    - role: lingjun.rdma.ipv6_compute_validate
  post_tasks:
    - name: Check the findings
      ansible.builtin.assert:
        that:
          - rdma_validation.validated
          - rdma_validation.checks | rejectattr('passed') | list == []
          - rdma_validation.checks | selectattr('role', 'equalto', 'ipv6_compute_validate') | list | length > 0
          - rdma_node_read.node.nics | length == 4
YML
(cd "$scratch" && env -u ANSIBLE_ROLES_PATH -u ANSIBLE_LIBRARY -u ANSIBLE_MODULE_UTILS -u ANSIBLE_FILTER_PLUGINS -u ANSIBLE_ACTION_PLUGINS \
  ANSIBLE_CONFIG="$scratch/ansible.cfg" ansible-playbook -i localhost, -c local \
  -e ansible_python_interpreter="$root/.venv/bin/python" site.yml)
echo "collection: installed from $tarball and used by FQCN outside the repository"
