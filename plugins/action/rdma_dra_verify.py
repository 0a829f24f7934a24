# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Controller side of lingjun.rdma.rdma_dra_verify: the DRA path's verify. Polls the driver's
ResourceSlices (one paginated list per poll, field selector ``spec.driver``) until every node of the
inventory publishes a complete pool with untainted devices, or the deadline passes; then, with
``test_claim``, runs on every node that passed a pod asking the extended resource (``rdma/hca: 1``:
the DeviceClass with ``extendedResourceName`` turns it into a claim the scheduler allocates and the
kubelet prepares through the driver) and waits until it runs. Verdicts go to ``verdicts_dir/<host>.json``
in rdma_verify's format, so the node play (roles/plugin_verify/tasks/node.yml) reads them the same way.
"""

from __future__ import annotations

import hashlib
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible_collections.lingjun.rdma.plugins.action.rdma_verify import write_verdicts
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_dra import SLICES, nic_count_problem, pools, verdict
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_fleet import Verdict, rollout_seconds
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import K8sError
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_k8s import Cluster as Api
from ansible_collections.lingjun.rdma.plugins.plugin_utils.rdma_hosts import Hosts, nic_count, read_report, report_path

display = Display()
TEST_LABEL = "rdma.lingjun.io/dra-verify"


def test_pod(name, node, namespace, resource, image):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {TEST_LABEL: "true"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"operator": "Exists"}],
            # What the chart's admission policy asks of an RDMA pod (and all it needs): the host's network,
            # IPC_LOCK to pin memory, nothing else of the runtime's default capabilities.
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [
                {
                    "name": "rdma",
                    "image": image,
                    "command": ["sleep", "300"],
                    "resources": {"limits": {resource: "1"}},
                    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                }
            ],
        },
    }


def pod_state(pod):
    """(done, ok, detail) of a test pod: running means its claim was allocated and prepared."""
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    if phase in ("Running", "Succeeded"):
        return True, True, phase
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return False, False, "not scheduled: %s" % c.get("message", "")
    if phase == "Failed":
        return True, False, "failed: %s %s" % (status.get("reason", ""), status.get("message", ""))
    return False, False, phase or "Pending"


class ActionModule(ActionBase):
    _supports_check_mode = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        hosts = list(args.get("hosts") or [])
        verdicts_dir = args.get("verdicts_dir", "")
        if not hosts or not verdicts_dir:
            raise AnsibleActionFail("rdma_dra_verify: hosts and verdicts_dir are required")
        driver = args.get("driver", "rdma.lingjun.io")
        release = args.get("release", "rdma")
        deadline_s = rollout_seconds(
            len(hosts), args.get("max_unavailable", 1), float(args.get("timeout", 60)), float(args.get("timeout_per_wave", 30))
        )
        test_timeout = float(args.get("test_timeout", 600))
        interval = max(0.2, float(args.get("poll_interval", 5)))
        values = Hosts(task_vars)
        nodes = dict((h, values.node_name(h)) for h in hosts)
        try:
            api = Api(args.get("kubeconfig", ""), args.get("context", ""))
            start = time.monotonic()
            last = None
            while True:
                seen = pools(api.list(SLICES, field_selector="spec.driver=%s" % driver))
                verdicts = dict((h, verdict(n, seen.get(n), driver, release)) for h, n in nodes.items())
                good = sum(1 for v in verdicts.values() if v.ok)
                line = "%d of %d nodes publish their NICs through %s" % (good, len(hosts), driver)
                if line != last:
                    display.display(line, stderr=True)
                    last = line
                if good == len(hosts) or time.monotonic() - start >= deadline_s:
                    break
                time.sleep(interval)
            if args.get("test_claim"):
                report_dir = args.get("report_dir", "")
                counts = (values, read_report(report_path(report_dir)) if report_dir else {})
                self._test_claims(api, args, nodes, verdicts, test_timeout, seen, counts)
        except K8sError as exc:
            result.update(failed=True, msg=str(exc))
            return result
        write_verdicts(verdicts_dir, verdicts)
        failed = sorted(h for h, v in verdicts.items() if not v.ok)
        result.update(
            changed=False,
            failed_nodes=failed,
            failed_messages=[verdicts[h].msg for h in failed[:50]],
            passed=len(hosts) - len(failed),
            requests=api.requests,
            msg="%d of %d nodes publish their NICs through %s%s"
            % (len(hosts) - len(failed), len(hosts), driver, "; failed: %s" % ", ".join(failed[:20]) if failed else ""),
        )
        return result

    def _test_claims(self, api, args, nodes, verdicts, deadline_s, views, counts):
        """A pod asking the extended resource on every node that passed: allocated and prepared, with the
        NICs one unit gives (every NIC of the node in shared mode, one in exclusive), or why not."""
        values, report_nodes = counts
        image = args.get("test_image") or ""
        if not image:
            raise AnsibleActionFail("rdma_dra_verify: test_claim needs test_image (plugin_verify_test_job_image)")
        namespace = args.get("test_namespace", "default")
        resource = args.get("resource_name", "rdma/hca")
        pods = {}
        for host, node in nodes.items():
            if not verdicts[host].ok:
                continue
            name = "rdma-dra-verify-" + hashlib.sha256(node.encode()).hexdigest()[:10]
            path = "/api/v1/namespaces/%s/pods" % namespace
            try:
                api.call("DELETE", "%s/%s" % (path, name), {"gracePeriodSeconds": "0"})
            except K8sError as exc:
                if getattr(exc, "status", 0) != 404:
                    raise
            self._wait_gone(api, "%s/%s" % (path, name))
            api.call("POST", path, None, test_pod(name, node, namespace, resource, image))
            pods[host] = "%s/%s" % (path, name)
        state = {}
        start = time.monotonic()
        try:
            while pods and time.monotonic() - start < deadline_s:
                for host, path in pods.items():
                    if host not in state or not state[host][0]:
                        state[host] = pod_state(api.call("GET", path))
                if all(s[0] for s in state.values()):
                    break
                time.sleep(1)
            for host, path in pods.items():
                done, ok, detail = state.get(host, (False, False, "not read"))
                pod = api.call("GET", path)
                claim = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get("resourceClaimName", "")
                got, allocated = "", []
                if claim:
                    c = api.call("GET", "/apis/resource.k8s.io/v1/namespaces/%s/resourceclaims/%s" % (path.split("/")[4], claim))
                    results = ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
                    got = ", ".join("%s/%s" % (r["pool"], r["device"]) for r in results)
                    allocated = [r["device"] for r in results if r.get("pool") == nodes[host]]
                v = verdicts[host]
                view = views.get(nodes[host])
                want, source, _ = nic_count(values, host, report_nodes)
                count = nic_count_problem(nodes[host], view, resource, allocated, want, source) if ok and view else ""
                if ok and count:
                    verdicts[host] = Verdict(False, "%s; test claim: %s 1 allocated %s and prepared, but %s" % (v.msg, resource, got, count), True)
                elif ok:
                    nics = sum(view.nics.get(d, 0) for d in allocated) if view else 0
                    verdicts[host] = Verdict(
                        True, "%s; test claim: %s 1 allocated %s (%d NIC%s) and prepared (pod %s)"
                        % (v.msg, resource, got, nics, "" if nics == 1 else "s", detail), False)
                else:
                    verdicts[host] = Verdict(
                        False,
                        "%s; test claim: a pod asking %s: 1 did not run within %ds (%s%s). Next: kubectl describe "
                        "pod %s -n %s (events: allocation, FailedPrepareDynamicResources)"
                        % (v.msg, resource, deadline_s, detail, "; allocated " + got if got else "", path.rsplit("/", 1)[1], path.split("/")[4]),
                        done,
                    )
        finally:
            for path in pods.values():
                try:
                    api.call("DELETE", path)
                except K8sError:
                    pass

    @staticmethod
    def _wait_gone(api, path, deadline_s=120):
        """A test pod left by an earlier run is deleted before a new one of that name is created."""
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            try:
                api.call("GET", path)
            except K8sError as exc:
                if getattr(exc, "status", 0) == 404:
                    return
                raise
            time.sleep(1)
        raise K8sError(
            "the test pod %s of an earlier run is still there %ds after its deletion (a finalizer, or its node "
            "is down). Fix: kubectl delete pod %s -n %s --force, then run verify again"
            % (path, deadline_s, path.rsplit("/", 1)[1], path.split("/")[4])
        )
