# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The Kubernetes API as the lingjun.rdma modules use it on the controller (the ``kubernetes`` client).

One place for: the client from ``rdma_kubeconfig``/``rdma_kube_context`` with errors that name
those variables and the fix, including the transport's (connection refused, TLS, timeouts: urllib3
raises those as its own exceptions, MaxRetryError around NewConnectionError/SSLError/..., not as
OSError); a request timeout (``rdma_kube_request_timeout``) and no retries, so that a server
that accepts and never answers fails within it; paginated lists (``limit``/``continue``, restarted once on 410
Gone); JSON merge patches; the Eviction subresource. Objects are read as plain JSON
(``_preload_content=False``): the client's model classes cost milliseconds per Node, which
is seconds at fleet scale.
"""

from __future__ import annotations

import json
import os
import socket
import ssl

try:
    import urllib3
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

# Seconds one request may take, connect and answer together (urllib3 Timeout(total=...)); the roles
# pass rdma_kube_request_timeout (roles/rdma_node_facts/defaults/main.yml, the same number).
REQUEST_TIMEOUT = 30.0

# The module options every cluster module of the collection takes (argument_spec fragment).
CONNECTION_ARGS = {
    "kubeconfig": {"type": "str", "default": ""},
    "context": {"type": "str", "default": ""},
    "request_timeout": {"type": "float", "default": REQUEST_TIMEOUT},
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
    """An ApiClient for the cluster of ``kubeconfig`` (empty: $KUBECONFIG, ~/.kube/config, else in-cluster),
    without urllib3's retries: its default (3) repeats a read that timed out, so a server that never
    answers would hold a request for four timeouts; every failure is reported at once instead."""
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
        cfg = k8s_client.Configuration()
        cfg.retries = False  # urllib3: raise the first error as it is
        if not kubeconfig and not os.path.isfile(default) and os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=cfg)
        else:
            k8s_config.load_kube_config(
                config_file=os.path.expanduser(kubeconfig) if kubeconfig else None, context=context or None,
                client_configuration=cfg,
            )
        return k8s_client.ApiClient(cfg)
    except Exception as exc:  # ConfigException, yaml errors, missing keys: all mean a bad kubeconfig
        raise K8sError(
            "cannot use the kubeconfig: %s. Fix: set rdma_kubeconfig to the kubeconfig of your cluster and "
            "rdma_kube_context to one of its contexts (%s)."
            % (" ".join(str(exc).split()).rstrip(".") or type(exc).__name__, _where(kubeconfig, context))
        )


class Cluster(object):
    """Raw-JSON calls through one ApiClient; every failure is a K8sError naming the fix."""

    def __init__(self, kubeconfig="", context="", request_timeout=REQUEST_TIMEOUT):
        self.kubeconfig, self.context = kubeconfig, context
        self.timeout = float(request_timeout or REQUEST_TIMEOUT)
        self.api = api_client(kubeconfig, context)
        self.server = self.api.configuration.host
        self.requests = 0

    def call(self, method, path, query=None, body=None, content_type="application/json"):
        self.requests += 1
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            data = _request(self.api, method, path, list((query or {}).items()), headers, body, self.timeout)
        except ApiException as exc:
            if getattr(exc, "status", 0):
                raise self._error(exc, method, path)
            raise self._unreachable(exc)  # the client turns urllib3's SSLError into an ApiException with status 0
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            raise self._unreachable(exc)
        try:
            return json.loads(data) if data else {}
        except ValueError:
            raise K8sError(
                "%s %s at %s answered with something that is not JSON (%r...): is rdma_kubeconfig's server the "
                "Kubernetes API? (%s)" % (method, path, self.server, data[:80], _where(self.kubeconfig, self.context))
            )

    def _unreachable(self, exc):
        """The transport's failure as what happened and the fix, naming the variables to change."""
        kind, reason = transport_failure(exc)
        check = "kubectl %sget --raw /readyz" % "".join(
            "--%s %s " % (flag, value) for flag, value in (("kubeconfig", self.kubeconfig), ("context", self.context)) if value
        )
        where = _where(self.kubeconfig, self.context)
        if kind == "tls":
            return K8sError(
                "the Kubernetes API at %s failed the TLS check: %s. The kubeconfig's certificate-authority does not "
                "match the server's certificate (another cluster's kubeconfig, or an old one). Fix: set "
                "rdma_kubeconfig (and rdma_kube_context) to this cluster's own kubeconfig (%s); check with: %s"
                % (self.server, reason, where, check)
            )
        if kind == "timeout":
            return K8sError(
                "the Kubernetes API at %s did not answer within rdma_kube_request_timeout=%gs (%s). Fix: check that the "
                "API server is up and reachable from the controller (%s), or raise rdma_kube_request_timeout; "
                "rdma_kubeconfig picks the server (%s)." % (self.server, self.timeout, reason, check, where)
            )
        what = {"refused": "connection refused (nothing listens there)",
                "name": "its host name does not resolve"}.get(kind, reason)
        return K8sError(
            "cannot reach the Kubernetes API at %s: %s. Fix: start the cluster, or set rdma_kubeconfig (and "
            "rdma_kube_context) to the kubeconfig of a running cluster (%s); check with: %s"
            % (self.server, what, where, check)
        )

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


def _request(api, method, path, query, headers, body, timeout):
    """One request through the client's own auth, TLS and proxy settings; the raw body of a 2xx answer.
    kubernetes >= 32 (openapi-generator 7) splits serialization from the call; older clients do both."""
    if hasattr(api, "param_serialize"):
        method, url, headers, body, post = api.param_serialize(
            method=method, resource_path=path, query_params=query, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        resp = api.call_api(method, url, header_params=headers, body=body, post_params=post, _request_timeout=timeout)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return resp.data
    resp = api.call_api(
        path, method, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"],
        _preload_content=False, _return_http_data_only=True, _request_timeout=timeout,
    )
    return resp.data


def transport_failure(exc):
    """(kind, reason) of a failure below HTTP: kind is tls, timeout, refused, name or other; reason the
    innermost cause's words. urllib3 wraps the cause (MaxRetryError.reason; NewConnectionError from
    ConnectionRefusedError; SSLError from ssl.SSLCertVerificationError) and the kubernetes client
    turns an SSLError into ApiException(status=0) (kubernetes/client/rest.py)."""
    chain = []
    while exc is not None and exc not in chain and len(chain) < 10:
        chain.append(exc)
        reason = getattr(exc, "reason", None)
        exc = reason if isinstance(reason, BaseException) else (exc.__cause__ or exc.__context__)
    inner = chain[-1]
    if isinstance(inner, ssl.SSLCertVerificationError):
        text = "certificate verify failed: %s" % inner.verify_message
    else:
        text = " ".join(str(inner).split()) or type(inner).__name__
    kinds = (
        ("tls", (ssl.SSLError, ssl.CertificateError, urllib3.exceptions.SSLError)),
        ("refused", (ConnectionRefusedError,)),
        ("name", (socket.gaierror, urllib3.exceptions.NameResolutionError)),
        ("timeout", (urllib3.exceptions.TimeoutError, socket.timeout)),
    )
    for kind, types in kinds:
        # urllib3's NewConnectionError subclasses ConnectTimeoutError whatever the cause: not a timeout itself
        if any(isinstance(e, types) and not isinstance(e, urllib3.exceptions.NewConnectionError) for e in chain):
            return kind, text
    return "other", text


def selector(labels):
    """A label selector string from a list of requirements or a mapping."""
    if isinstance(labels, dict):
        return ",".join("%s=%s" % kv for kv in sorted(labels.items()))
    return ",".join(labels or [])
