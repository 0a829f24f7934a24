# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The Kubernetes API as the lingjun.rdma modules use it on the controller (the ``kubernetes`` client).

One place for: the client from ``rdma_kubeconfig``/``rdma_kube_context`` with errors that name
those variables and the fix; paginated lists (``limit``/``continue``, restarted once on 410
Gone); JSON merge patches; the Eviction subresource. Objects are read as plain JSON
(``_preload_content=False``): the client's model classes cost milliseconds per Node, which
is seconds at fleet scale.
"""

from __future__ import annotations

import json
import os

try:
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config
    from kubernetes.client.rest import ApiException

    HAS_KUBERNETES = True
    IMPORT_ERROR = ""
except ImportError as exc:  # the module says what to install
    HAS_KUBERNETES = False
    IMPORT_ERROR = str(exc)

    class ApiException(Exception):  # type: ignore[no-redef]
        status = 0
        body = ""


MERGE_PATCH = "application/merge-patch+json"

# The module options every cluster module of the collection takes (argument_spec fragment).
CONNECTION_ARGS = {
    "kubeconfig": {"type": "str", "default": ""},
    "context": {"type": "str", "default": ""},
}


class K8sError(Exception):
    """A failure whose message says what to fix (the modules fail with it as is)."""


def _where(kubeconfig, context):
    if kubeconfig:
        config = "rdma_kubeconfig=%s" % kubeconfig
    else:
        config = 'rdma_kubeconfig="" (the client default: %s)' % (os.environ.get("KUBECONFIG") or "~/.kube/config")
    return "%s, rdma_kube_context=%s" % (config, context or '"" (the current context)')


def api_client(kubeconfig="", context=""):
    """An ApiClient for the cluster of ``kubeconfig`` (empty: $KUBECONFIG, ~/.kube/config, else in-cluster)."""
    if not HAS_KUBERNETES:
        raise K8sError(
            "the kubernetes Python package is not importable on the controller (%s). Fix: install it in the "
            "Python that runs Ansible (pip install kubernetes; make setup does)." % IMPORT_ERROR
        )
    if kubeconfig and not os.path.isfile(os.path.expanduser(kubeconfig)):
        raise K8sError(
            "the kubeconfig %s does not exist. Fix: set rdma_kubeconfig to the kubeconfig of your cluster "
            "(%s)." % (kubeconfig, _where(kubeconfig, context))
        )
    try:
        default = os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0])
        if not kubeconfig and not os.path.isfile(default) and os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = k8s_client.Configuration()
            k8s_config.load_incluster_config(client_configuration=cfg)
            return k8s_client.ApiClient(cfg)
        return k8s_config.new_client_from_config(
            config_file=os.path.expanduser(kubeconfig) if kubeconfig else None, context=context or None
        )
    except Exception as exc:  # ConfigException, yaml errors, missing keys: all mean a bad kubeconfig
        raise K8sError(
            "cannot use the kubeconfig: %s. Fix: set rdma_kubeconfig to the kubeconfig of your cluster and "
            "rdma_kube_context to one of its contexts (%s)." % (" ".join(str(exc).split()) or type(exc).__name__, _where(kubeconfig, context))
        )


class Cluster(object):
    """Raw-JSON calls through one ApiClient; every failure is a K8sError naming the fix."""

    def __init__(self, kubeconfig="", context=""):
        self.kubeconfig, self.context = kubeconfig, context
        self.api = api_client(kubeconfig, context)
        self.server = self.api.configuration.host
        self.requests = 0

    def call(self, method, path, query=None, body=None, content_type="application/json"):
        self.requests += 1
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            data = _request(self.api, method, path, list((query or {}).items()), headers, body)
        except ApiException as exc:
            raise self._error(exc, method, path)
        except (OSError, ValueError) as exc:  # urllib3 connection errors (OSError), timeouts, TLS
            raise K8sError(
                "cannot reach the Kubernetes API at %s: %s. Fix: check that the cluster is up and that "
                "rdma_kubeconfig points at it (%s)." % (self.server, _reason(exc), _where(self.kubeconfig, self.context))
            )
        return json.loads(data) if data else {}

    def _error(self, exc, method, path):
        status = getattr(exc, "status", 0)
        try:
            body = json.loads(exc.body or "{}")
        except (TypeError, ValueError):
            body = {}
        message = body.get("message") or getattr(exc, "reason", "") or str(exc)
        err = K8sError("%s %s: %s (HTTP %s)" % (method, path, message, status))
        err.status = status
        err.body = body
        if status in (401, 403):
            err.args = (
                "the Kubernetes API refused %s %s: %s (HTTP %s). Fix: use credentials that may do this "
                "(rdma_kubeconfig, %s)." % (method, path, message, status, _where(self.kubeconfig, self.context)),
            )
        return err

    def list(self, path, label_selector="", field_selector="", page_size=500):
        """Every item of a list, page by page; a list whose continue token expired (410) starts again once."""
        for attempt in (1, 2):
            token = ""
            items = []
            try:
                while True:
                    query = {"limit": str(page_size)}
                    if label_selector:
                        query["labelSelector"] = label_selector
                    if field_selector:
                        query["fieldSelector"] = field_selector
                    if token:
                        query["continue"] = token
                    page = self.call("GET", path, query)
                    items.extend(page.get("items") or [])
                    token = (page.get("metadata") or {}).get("continue") or ""
                    if not token:
                        return items
            except K8sError as err:
                if getattr(err, "status", 0) != 410 or attempt == 2:
                    raise
        return []

    def merge_patch(self, path, patch, dry_run=False):
        return self.call("PATCH", path, {"dryRun": "All"} if dry_run else None, patch, MERGE_PATCH)

    def evict(self, namespace, name, dry_run=False):
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        path = "/api/v1/namespaces/%s/pods/%s/eviction" % (namespace, name)
        return self.call("POST", path, {"dryRun": "All"} if dry_run else None, body)


def _request(api, method, path, query, headers, body):
    """One request through the client's own auth, TLS and proxy settings; the raw body of a 2xx answer.
    kubernetes >= 32 (openapi-generator 7) splits serialization from the call; older clients do both."""
    if hasattr(api, "param_serialize"):
        method, url, headers, body, post = api.param_serialize(
            method=method, resource_path=path, query_params=query, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        resp = api.call_api(method, url, header_params=headers, body=body, post_params=post)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return resp.data
    resp = api.call_api(
        path, method, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"],
        _preload_content=False, _return_http_data_only=True,
    )
    return resp.data


def _reason(exc):
    reason = getattr(exc, "reason", None)
    return str(reason or exc).strip() or type(exc).__name__


def selector(labels):
    """A label selector string from a list of requirements or a mapping."""
    if isinstance(labels, dict):
        return ",".join("%s=%s" % kv for kv in sorted(labels.items()))
    return ",".join(labels or [])
