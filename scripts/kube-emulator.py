#!/usr/bin/env python3
"""A Kubernetes API emulator on 127.0.0.1, kept for the fleet benchmark only.

Where it is still used, and why: ``bench/fleet.py`` serves its N-host fleet (up to 2000 Node
objects, written with their status, and the release's DaemonSets reported rolled out) from it by
default (``--api emulator``, the API of the figures in bench/RESULTS.md) and reads the request
counts of ``GET /kube-emulator/requests`` to check one node list per poll; ``--api real`` runs the
same against kube-apiserver. ``tests/test_kube_emulator.py`` tests the emulator itself, its
selector and patch cases against the real kube-apiserver too: the two must agree. The plays'
tests no longer use it: molecule/fleet, molecule/verify, molecule/mode-switch,
tests/test_uninstall.py and ``make collection`` run against the real control plane
(scripts/kube_cluster.py: kube-apiserver, controllers and scheduler v1.37.2, nodes running the
kubelet's own device manager), where the DaemonSet controller, the disruption controller and
the plugin itself do what this file's stand-ins did (its plugin stand-in, ``--plugin-delay``, is
gone with them).

Built on kmock's stateful ``KubernetesEmulator`` (its HTTP server, discovery, object store and
watch streams). Everything the plays of this repository send is answered as the apiserver
answers it, read from the apiserver's own code (kubernetes/kubernetes, cited where it matters):

* discovery of the core group answers ``groupVersion: v1`` (kmock says ``/v1``);
* lists carry ``kind: <Kind>List``, ``apiVersion`` and ``metadata.resourceVersion``; their
  items carry no ``kind``/``apiVersion`` (typed lists leave TypeMeta empty), sorted by
  namespace/name as etcd returns them;
* pagination: ``limit`` returns at most that many items, ``metadata.continue`` and (without a
  selector) ``remainingItemCount``; the pages of one list come from one snapshot, as etcd reads
  every page at the first page's revision; a token older than ``--continue-ttl`` seconds is
  refused with 410 Gone and the apiserver's message (etcd compaction), a foreign one with 400;
  ``resourceVersion`` beside ``continue`` is refused (400);
* ``labelSelector`` in the apiserver's grammar (k8s.io/apimachinery/pkg/labels/selector.go):
  ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``, ``k>1``, ``k<1``;
  a key or value that is no valid label key/value is a 400, like a parse error;
* ``fieldSelector`` (``=``, ``==``, ``!=``) only on the fields the apiserver supports for the
  resource (pods: ``spec.nodeName``, ``status.phase``, ...; nodes: ``spec.unschedulable``;
  all: ``metadata.name``/``metadata.namespace``); any other field is a 400 "field label not
  supported";
* writes: ``resourceVersion`` (one counter for the whole store), ``uid``,
  ``creationTimestamp``, ``generation`` (1 on create, +1 when ``spec`` changes) are the
  server's; labels and annotations are validated (422 Invalid with the apiserver's messages);
  ``status`` is the server's own for pods, DaemonSets, Jobs and PodDisruptionBudgets (reset on
  create) and for every resource with a status subresource it is ignored on the main resource
  (``PATCH .../nodes/x`` cannot change ``status``: only ``.../nodes/x/status`` can), nodes
  keep the status they are created with (the kubelet registers them that way);
* PATCH with ``application/merge-patch+json`` (RFC 7386), ``application/json-patch+json``
  (RFC 6902: add, remove, replace, test) and ``application/strategic-merge-patch+json`` (maps
  merge; the lists k8s.io/api marks ``patchStrategy: merge`` -- conditions, containers, env,
  volumes, ... -- merge by their ``patchMergeKey``, every other list is replaced; ``$patch``
  directives are refused with 415); server-side apply is refused (415); PUT replaces, with the
  apiserver's 409 when ``metadata.resourceVersion`` is stale;
* ``?dryRun=All`` on POST, PATCH, PUT, DELETE and evictions: validated and answered, nothing
  persisted (staging/src/k8s.io/apiserver/pkg/endpoints/handlers); other dryRun values are 422
  Invalid, naming the request's options kind (apimachinery's ValidateDryRun);
* ``POST .../pods/<name>/eviction`` (policy/v1 and v1beta1) as
  pkg/registry/core/pod/storage/eviction.go: the Eviction's name must match the URL (400);
  Pending, Succeeded and Failed pods are deleted without PDB checks; more than one matching
  PodDisruptionBudget is a 500; a budget whose status lags its generation, or with
  ``status.disruptionsAllowed == 0``, is a 429 "Cannot evict pod as it would violate the pod's
  disruption budget." with the DisruptionBudget cause naming the budget; otherwise the budget's
  ``disruptionsAllowed`` is decremented, the pod recorded in ``disruptedPods``, and the pod
  deleted; a pod that is not Ready is deleted without touching a budget that has enough
  healthy pods;
* deleting a pod that is bound to a node sets ``deletionTimestamp`` and the pod disappears
  ``--pod-termination`` seconds later (what the node's kubelet does), so callers must wait;
* ``GET /kube-emulator/requests`` returns how many requests of each verb and resource it
  served (``list nodes``, ``patch nodes`` ...), for tests and ``bench/fleet.py``.

Where it still differs from a real cluster: no controllers (no scheduler, no DaemonSet or PDB
controller: budgets and DaemonSet statuses are what the test writes through ``/status``), no
admission, no RBAC or authentication, watch streams (kmock's) ignore selectors and
``resourceVersion``, no ``resourceVersionMatch`` or ``sendInitialEvents``, no
``deleteOptions`` preconditions or propagation policies, no validation of fields other than
labels and annotations (a Node with a nonsense ``spec`` is stored as given), no protobuf.

Usage:
  kube-emulator.py start --port 18080 --kubeconfig out/emulator/kubeconfig
  kube-emulator.py stop --kubeconfig out/emulator/kubeconfig
  kube-emulator.py serve --port 18080 ...      (foreground; what ``start`` runs detached)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import yaml

STATS_PATH = "/kube-emulator/requests"

# (group/version/plural, kind, namespaced, subresources)
RESOURCES = [
    ("v1/nodes", "Node", False, ["status"]),
    ("v1/pods", "Pod", True, ["status", "eviction"]),
    ("v1/namespaces", "Namespace", False, ["status"]),
    ("v1/configmaps", "ConfigMap", True, []),
    ("v1/serviceaccounts", "ServiceAccount", True, []),
    ("v1/services", "Service", True, ["status"]),
    ("apps/v1/daemonsets", "DaemonSet", True, ["status"]),
    ("batch/v1/jobs", "Job", True, ["status"]),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ["status"]),
]
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
# Resources whose status the server resets on create (their strategies' PrepareForCreate).
STATUS_RESET_ON_CREATE = {"pods", "daemonsets", "jobs", "poddisruptionbudgets"}
# Fields each resource's field selector supports (pkg/apis/core/v1/conversion.go's field label
# conversions; generic for the rest), and the old names it converts (spec.host of old v1 clients).
FIELD_ALIASES = {"pods": {"spec.host": "spec.nodeName"}}
FIELDS = {
    "pods": {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.podIPs",
        "status.nominatedNodeName",
    },
    "nodes": {"metadata.name", "spec.unschedulable"},
}
GENERIC_FIELDS = {"metadata.name", "metadata.namespace"}

GONE_MESSAGE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)
PDB_MESSAGE = "Cannot evict pod as it would violate the pod's disruption budget."

# k8s.io/apimachinery/pkg/util/validation: qualified names (label and annotation keys) and label values.
_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation "
    "is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
TOTAL_ANNOTATION_SIZE = 256 * 1024


class ApiError(Exception):
    """A failure answered as a metav1.Status, as the apiserver does."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = self.details
        return out


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def budget_refusal(cause: str, retry_after: int = 0) -> ApiError:
    """The 429 of an eviction a PodDisruptionBudget refuses, with its DisruptionBudget cause."""
    details: dict[str, Any] = {"causes": [{"reason": "DisruptionBudget", "message": cause}]}
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    return ApiError(429, "TooManyRequests", PDB_MESSAGE, details)


# --- validation of keys and values (k8s.io/apimachinery/pkg/util/validation) -----------------------


def qualified_name_errors(key: str) -> list[str]:
    """IsQualifiedName: an optional DNS-1123 subdomain prefix (<= 253) and '/', then a name (<= 63)."""
    prefix, _, name = key.rpartition("/")
    errors = []
    if "/" in key and not prefix:
        errors.append("prefix part must be non-empty")
    elif prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        errors.append(
            "prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
            "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    elif not _NAME_RE.match(name):
        errors.append(NAME_MSG)
    return errors


def label_value_errors(value: str) -> list[str]:
    if len(value) > 63:
        return ["must be no more than 63 characters"]
    if value and not _NAME_RE.match(value):
        return [LABEL_VALUE_MSG]
    return []


def validate_meta(kind: str, name: str, meta: dict[str, Any]) -> None:
    """ValidateObjectMeta's label and annotation checks, as a 422 Invalid naming every cause."""
    causes: list[tuple[str, str, str]] = []
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    for field, mapping in (("labels", labels), ("annotations", annotations)):
        if not isinstance(mapping, dict):
            causes.append((f"metadata.{field}", json.dumps(mapping), "must be a map of string to string"))
            continue
        for key, value in mapping.items():
            for err in qualified_name_errors(key):
                causes.append((f"metadata.{field}", json.dumps(key), err))
            if not isinstance(value, str):
                causes.append((f"metadata.{field}", json.dumps(value), "must be a string"))
            elif field == "labels":
                for err in label_value_errors(value):
                    causes.append(("metadata.labels", json.dumps(value), err))
    if isinstance(annotations, dict):
        size = sum(len(k) + len(v) for k, v in annotations.items() if isinstance(v, str))
        if size > TOTAL_ANNOTATION_SIZE:
            causes.append(("metadata.annotations", "", f"Too long: must have at most {TOTAL_ANNOTATION_SIZE} bytes"))
    if causes:
        text = ", ".join(f"{f}: Invalid value: {v}: {m}" if v else f"{f}: {m}" for f, v, m in causes)
        raise ApiError(
            422,
            "Invalid",
            f'{kind} "{name}" is invalid: [{text}]' if len(causes) > 1 else f'{kind} "{name}" is invalid: {text}',
            {
                "name": name,
                "kind": kind.lower(),
                "causes": [
                    {"reason": "FieldValueInvalid", "message": f"Invalid value: {v}: {m}", "field": f}
                    for f, v, m in causes
                ],
            },
        )


# --- selectors (k8s.io/apimachinery/pkg/labels/selector.go, fields/selector.go) --------------------

_LABEL_TOKEN = re.compile(r"\s*(\(|\)|,|==|!=|=|>|<|!|[^\s(),=!<>]+)")


def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """Requirements (key, operator, values); raises a 400 ApiError as the apiserver does."""
    tokens = [t for t in _LABEL_TOKEN.findall(text)]
    if "".join(tokens).replace(" ", "") != re.sub(r"\s+", "", text):
        raise bad_request(f"unable to parse requirement: unexpected characters in label selector {text!r}")
    reqs: list[tuple[str, str, tuple[str, ...]]] = []
    i = 0

    def err(msg: str) -> ApiError:
        return bad_request(f"unable to parse requirement: {msg}")

    while i < len(tokens):
        if tokens[i] == "!":
            if i + 1 >= len(tokens):
                raise err("found '', expected: identifier")
            reqs.append((tokens[i + 1], "!", ()))
            i += 2
        else:
            key = tokens[i]
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ","
            if nxt == ",":
                reqs.append((key, "exists", ()))
                i += 1
            elif nxt in ("=", "==", "!=", ">", "<"):
                if i + 2 >= len(tokens) or tokens[i + 2] in (",", "(", ")"):
                    value = ""
                    i += 2
                else:
                    value = tokens[i + 2]
                    i += 3
                op = "=" if nxt == "==" else nxt
                if op in (">", "<") and not re.fullmatch(r"-?\d+", value):
                    raise err(f"for 'Gt', 'Lt' operators, the value must be an integer, found {value!r}")
                reqs.append((key, op, (value,)))
            elif nxt in ("in", "notin"):
                if i + 2 >= len(tokens) or tokens[i + 2] != "(":
                    raise err(f"found '{tokens[i + 2] if i + 2 < len(tokens) else ''}', expected: '('")
                j = i + 3
                values: list[str] = []
                while j < len(tokens) and tokens[j] != ")":
                    if tokens[j] != ",":
                        values.append(tokens[j])
                    j += 1
                if j >= len(tokens):
                    raise err("found '', expected: ')'")
                reqs.append((key, nxt, tuple(values)))
                i = j + 1
            else:
                raise err(f"found '{nxt}', expected: in, notin, =, ==, !=, gt, lt")
        if i < len(tokens):
            if tokens[i] != ",":  # selector.go parse(): not wrapped in "unable to parse requirement"
                raise bad_request(f"found '{tokens[i]}', expected: ',' or 'end of string'")
            i += 1
    for key, op, values in reqs:
        problems = qualified_name_errors(key)
        if problems:
            raise err(f"key: Invalid value: {json.dumps(key)}: {'; '.join(problems)}")
        for n, value in enumerate(values if op not in (">", "<") else ()):
            bad = label_value_errors(value)
            if bad:
                raise err(f"values[{n}][{key}]: Invalid value: {json.dumps(value)}: {'; '.join(bad)}")
    return reqs


def labels_match(labels: dict[str, str], reqs: list[tuple[str, str, tuple[str, ...]]]) -> bool:
    for key, op, values in reqs:
        present = key in labels
        value = labels.get(key)
        if op == "exists" and not present:
            return False
        if op == "!" and present:
            return False
        if op == "=" and value != values[0]:
            return False
        if op == "!=" and present and value == values[0]:
            return False
        if op == "in" and (not present or value not in values):
            return False
        if op == "notin" and present and value in values:
            return False
        if op in (">", "<"):
            try:
                number = int(value or "")
            except ValueError:
                return False
            if (op == ">" and not number > int(values[0])) or (op == "<" and not number < int(values[0])):
                return False
    return True


def parse_field_selector(text: str, plural: str) -> list[tuple[str, str, str]]:
    reqs = []
    allowed = FIELDS.get(plural, GENERIC_FIELDS)
    for raw in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([^=!]+?)\s*(==|!=|=)\s*(.*)", raw)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{raw}'")
        key, op, value = m.group(1), m.group(2), m.group(3)
        key = FIELD_ALIASES.get(plural, {}).get(key, key)
        if key not in allowed:
            raise bad_request(f"field label not supported: {key}")
        reqs.append((key, "!=" if op == "!=" else "=", value))
    return reqs


def _field(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


def fields_match(obj: dict[str, Any], reqs: list[tuple[str, str, str]]) -> bool:
    return all((_field(obj, k) == v) == (op == "=") for k, op, v in reqs)


# --- patches -----------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# Lists the apiserver merges in a strategic merge patch (patchStrategy "merge" in k8s.io/api), by
# field name -> patchMergeKey (None: a set of scalars). Every other list is replaced, as there.
STRATEGIC_LIST_KEYS: dict[str, str | None] = {
    "conditions": "type",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "ownerReferences": "uid",
    "finalizers": None,
}


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """k8s.io/apimachinery/pkg/util/strategicpatch for maps and the lists above; directives refused."""
    if isinstance(patch, dict):
        if any(str(k).startswith("$") for k in patch):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "kube-emulator: strategic merge directives ($patch, "
                "$setElementOrder, ...) are not emulated; send a merge patch",
            )
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out.get(key), value, key)
        return out
    if isinstance(patch, list) and field in STRATEGIC_LIST_KEYS and isinstance(target, list):
        merge_key = STRATEGIC_LIST_KEYS[field]
        out = list(target)
        for item in patch:
            if merge_key is None:
                if item not in out:
                    out.append(item)
                continue
            if not isinstance(item, dict) or merge_key not in item:
                raise ApiError(422, "Invalid", f"kube-emulator: an element of {field} lacks its merge key {merge_key}")
            for i, old in enumerate(out):
                if isinstance(old, dict) and old.get(merge_key) == item[merge_key]:
                    out[i] = strategic_merge(old, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _pointer(doc: Any, path: str) -> tuple[Any, str | int]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    if not parts:
        raise ApiError(422, "Invalid", "json patch: the root cannot be patched")
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, list):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise ApiError(500, "InternalError", f"doc is missing path: {path!r}")
    last: str | int = parts[-1]
    if isinstance(cur, list):
        last = len(cur) if last == "-" else int(last)
    return cur, last


def json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 (add, remove, replace, test), as k8s.io/apiserver applies it (evanphx/json-patch)."""
    if not isinstance(ops, list):
        raise bad_request("json patch: the body must be a list of operations")
    out = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        parent, key = _pointer(out, path)
        if kind == "add":
            if isinstance(parent, list):
                parent.insert(int(key), copy.deepcopy(op.get("value")))
            else:
                parent[key] = copy.deepcopy(op.get("value"))
        elif kind in ("remove", "replace"):
            try:
                if kind == "remove":
                    del parent[key]
                else:
                    parent[key]
                    parent[key] = copy.deepcopy(op.get("value"))
            except (KeyError, IndexError):
                raise ApiError(
                    422,
                    "Invalid",
                    f"the server rejected our request due to an error in our request: "
                    f"{kind} operation does not apply: doc is missing path: {path!r}",
                ) from None
        elif kind == "test":
            current = parent.get(key) if isinstance(parent, dict) else parent[key]
            if current != op.get("value"):
                raise ApiError(
                    422,
                    "Invalid",
                    f"the server rejected our request due to an error in our request: "
                    f"testing value {path!r} failed: test failed",
                )
        else:
            raise ApiError(415, "UnsupportedMediaType", f"kube-emulator: json patch operation {kind!r} is not emulated")
    return out


# --- the emulator --------------------------------------------------------------------------------------


def build_emulator(args: argparse.Namespace) -> Any:
    import kmock
    from aiohttp import web
    from kmock._internal import enums

    class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
        """kmock with the apiserver behaviour listed in the module docstring."""

        def __attrs_post_init__(self) -> None:
            super().__attrs_post_init__()
            self._rv = 1
            self._snapshots: dict[str, tuple[float, int, list[dict[str, Any]]]] = {}
            self._counts: Counter[str] = Counter()

        # -- discovery -------------------------------------------------------------------------------
        async def _serve_version(self, request: Any) -> Any:
            payload = await super()._serve_version(request)
            if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":
                payload["groupVersion"] = "v1"
            return payload

        # -- helpers ---------------------------------------------------------------------------------
        def _info(self, res: Any) -> Any:
            return self.resources[res]

        def _kind(self, res: Any) -> str:
            info = self._info(res)
            return str(info.kind or res.plural.capitalize())

        def _api_version(self, res: Any) -> str:
            return f"{res.group}/{res.version}" if res.group else str(res.version)

        def _live(self, key: Any) -> dict[str, Any] | None:
            if key in self.objects and not self.objects[key].deleted:
                return copy.deepcopy(dict(self.objects[key].raw))
            return None

        def _next_rv(self) -> str:
            self._rv += 1
            return str(self._rv)

        async def _store(self, res: Any, key: Any, new: dict[str, Any], event: str) -> dict[str, Any]:
            """Write ``new`` as the object's whole state (a merge patch from the old one)."""
            old = self._live(key)
            if old is None:
                if key in self.objects:
                    self.objects[key].create(new)
                else:
                    self.objects[key] = new
            else:
                diff = _replace_patch(old, new)
                self.objects[key].patch(diff)
            raw = dict(self.objects[key].raw)
            await self._buses[res].put({"type": event, "object": raw})
            return raw

        def _not_found(self, res: Any, name: str) -> ApiError:
            plural = res.plural
            group = f".{res.group}" if res.group else ""
            return ApiError(
                404,
                "NotFound",
                f'{plural}{group} "{name}" not found',
                {"name": name, "group": res.group, "kind": plural},
            )

        # -- dispatch --------------------------------------------------------------------------------
        async def _handle(self, request: Any) -> Any:
            if request.resource is None:
                if request.url.path == STATS_PATH:
                    return web.json_response(dict(self._counts))
                return await super()._handle(request)
            if request.resource not in list(self.resources):
                return await super()._handle(request)
            try:
                dry_run = self._dry_run(request)
                method = request.method
                sub = request.subresource
                if request.action == enums.action.WATCH:
                    return await super()._handle(request)
                self._counts[f"{_verb(request)} {request.resource.plural}{'/' + sub if sub else ''}"] += 1
                async with self._lock:
                    if method == enums.method.GET and request.name is None:
                        return web.json_response(self._list(request))
                    if method == enums.method.GET:
                        obj = self._live(self._key(request))
                        if obj is None:
                            raise self._not_found(request.resource, request.name)
                        return web.json_response(obj)
                    if method == enums.method.POST and sub == "eviction":
                        return web.json_response(await self._evict(request, dry_run), status=201)
                    if method == enums.method.POST and request.name is None:
                        return web.json_response(await self._create(request, dry_run), status=201)
                    if method in (enums.method.PATCH, enums.method.PUT) and request.name:
                        return web.json_response(await self._update(request, dry_run))
                    if method == enums.method.DELETE and request.name:
                        return web.json_response(await self._delete(request, dry_run))
                raise ApiError(405, "MethodNotAllowed", f"kube-emulator: {method} {request.url.path} is not emulated")
            except ApiError as exc:
                headers = {}
                retry = (exc.details or {}).get("retryAfterSeconds")
                if retry:
                    headers["Retry-After"] = str(retry)
                return web.json_response(exc.status(), status=exc.code, headers=headers)

        def _dry_run(self, request: Any) -> bool:
            values = request.url.query.getall("dryRun", [])
            if any(v != "All" for v in values):
                # handlers/{create,patch,update,delete}.go: errors.NewInvalid of the request's options
                kind = {"POST": "Create", "PATCH": "Patch", "PUT": "Update"}.get(request.method, "Delete") + "Options"
                shown = json.dumps(values, separators=(",", ":"))  # as Go's json.Marshal writes it
                cause = f'Unsupported value: {shown}: supported values: "All"'
                raise ApiError(
                    422,
                    "Invalid",
                    f'{kind}.meta.k8s.io "" is invalid: dryRun: {cause}',
                    {
                        "group": "meta.k8s.io",
                        "kind": kind,
                        "causes": [{"reason": "FieldValueNotSupported", "message": cause, "field": "dryRun"}],
                    },
                )
            return bool(values)

        def _key(self, request: Any) -> Any:
            return (request.resource, request.namespace, request.name)

        # -- list ------------------------------------------------------------------------------------
        def _list(self, request: Any) -> dict[str, Any]:
            res = request.resource
            q = request.url.query
            labels = parse_label_selector(q.get("labelSelector", ""))
            fields = parse_field_selector(q.get("fieldSelector", ""), res.plural)
            limit = int(q.get("limit", "0") or 0)
            token = q.get("continue", "")
            now = time.monotonic()
            for tid in [t for t, (born, _, _) in self._snapshots.items() if now - born > args.continue_ttl]:
                del self._snapshots[tid]
            if token:
                if q.get("resourceVersion"):
                    raise bad_request("specifying resource version is not allowed when using continue")
                try:
                    decoded = json.loads(base64.b64decode(token))
                    tid, start = decoded["id"], int(decoded["start"])
                except (ValueError, KeyError, TypeError):
                    raise bad_request(
                        "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
                    ) from None
                if tid not in self._snapshots:
                    raise ApiError(410, "Expired", GONE_MESSAGE)
                _, rv, items = self._snapshots[tid]
            else:
                tid, start, rv = uuid.uuid4().hex, 0, self._rv
                items = sorted(
                    (
                        copy.deepcopy(dict(obj.raw))
                        for (r, ns, _), obj in self.objects.items()
                        if r == res and not obj.deleted and (request.namespace is None or ns == request.namespace)
                    ),
                    key=lambda o: ((o.get("metadata") or {}).get("namespace") or "", o["metadata"]["name"]),
                )
            out: list[dict[str, Any]] = []
            i = start
            while i < len(items) and (not limit or len(out) < limit):
                item = items[i]
                i += 1
                if labels_match((item.get("metadata") or {}).get("labels") or {}, labels) and fields_match(
                    item, fields
                ):
                    item = dict(item)
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                    out.append(item)
            meta: dict[str, Any] = {"resourceVersion": str(rv)}
            if limit and i < len(items):
                self._snapshots.setdefault(tid, (now, rv, items))
                meta["continue"] = base64.b64encode(json.dumps({"id": tid, "start": i}).encode()).decode()
                if not labels and not fields:
                    meta["remainingItemCount"] = len(items) - i
            return {
                "kind": f"{self._kind(res)}List",
                "apiVersion": self._api_version(res),
                "metadata": meta,
                "items": out,
            }

        # -- create ----------------------------------------------------------------------------------
        async def _create(self, request: Any, dry_run: bool) -> dict[str, Any]:
            res = request.resource
            obj = request.data
            if not isinstance(obj, dict):
                raise bad_request("the body of the request was in an unknown format")
            meta = obj.setdefault("metadata", {})
            name = meta.get("name")
            if not name:
                raise ApiError(
                    422,
                    "Invalid",
                    f'{self._kind(res)} "" is invalid: metadata.name: Required value: name or generateName is required',
                )
            namespaced = bool(self._info(res).namespaced)
            if namespaced:
                ns = meta.get("namespace") or request.namespace
                if request.namespace and meta.get("namespace") and meta["namespace"] != request.namespace:
                    raise bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request"
                    )
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            validate_meta(self._kind(res), name, meta)
            key = (res, meta.get("namespace") if namespaced else None, name)
            if self._live(key) is not None:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{res.plural}{"." + res.group if res.group else ""} "{name}" already exists',
                    {"name": name, "group": res.group, "kind": res.plural},
                )
            obj["kind"], obj["apiVersion"] = self._kind(res), self._api_version(res)
            if res.plural in STATUS_RESET_ON_CREATE:
                obj["status"] = {"phase": "Pending"} if res.plural == "pods" else {}
            meta.update(
                uid=str(uuid.uuid4()),
                creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                generation=1,
            )
            for key_ in ("resourceVersion", "deletionTimestamp", "managedFields"):
                meta.pop(key_, None)
            if dry_run:
                return obj
            meta["resourceVersion"] = self._next_rv()
            return await self._store(res, key, obj, "ADDED")

        # -- update (PATCH, PUT; main resource and status) --------------------------------------------
        async def _update(self, request: Any, dry_run: bool) -> dict[str, Any]:
            res = request.resource
            key = self._key(request)
            old = self._live(key)
            if old is None:
                raise self._not_found(res, request.name)
            sub = request.subresource
            if sub not in (None, "status"):
                raise ApiError(405, "MethodNotAllowed", f"kube-emulator: {request.method} on {sub} is not emulated")
            if request.method.value == "PUT":
                new = request.data
                if not isinstance(new, dict):
                    raise bad_request("the body of the request was in an unknown format")
                sent_rv = (new.get("metadata") or {}).get("resourceVersion")
                if sent_rv and sent_rv != old["metadata"].get("resourceVersion"):
                    raise ApiError(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on {res.plural} "{request.name}": '
                        "the object has been modified; please apply your changes to the latest version and "
                        "try again",
                        {"name": request.name, "kind": res.plural},
                    )
            else:
                new = self._apply_patch(request, old)
            meta = new.setdefault("metadata", {})
            if meta.get("name", request.name) != request.name:
                raise bad_request(
                    f"the name of the object ({meta.get('name')}) does not match the name on the URL ({request.name})"
                )
            # What the server keeps: identity, and status or everything-but-status by endpoint.
            for field in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
                else:
                    meta.pop(field, None)
            new["kind"], new["apiVersion"] = self._kind(res), self._api_version(res)
            has_status = "status" in self._info(res).subresources
            if sub == "status":
                new = dict(old, status=new.get("status", old.get("status")))
            elif has_status:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            validate_meta(self._kind(res), request.name, new["metadata"])
            if sub is None and new.get("spec") != old.get("spec"):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            if dry_run:
                return new
            new["metadata"]["resourceVersion"] = self._next_rv()
            return await self._store(res, key, new, "MODIFIED")

        def _apply_patch(self, request: Any, old: dict[str, Any]) -> dict[str, Any]:
            ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            try:
                body = json.loads(request.body or b"null")
            except ValueError:
                raise bad_request("the body of the request was in an unknown format") from None
            if ctype == "application/json-patch+json":
                return json_patch(old, body)
            if ctype == "application/merge-patch+json":
                if not isinstance(body, dict):
                    raise bad_request("merge patch: the body must be a JSON object")
                return merge_patch(old, body)
            if ctype == "application/strategic-merge-patch+json":
                if not isinstance(body, dict):
                    raise bad_request("strategic merge patch: the body must be a JSON object")
                return strategic_merge(old, body)
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted "
                f"media types include: application/json-patch+json, application/merge-patch+json, "
                f"application/strategic-merge-patch+json (kube-emulator: not {ctype or 'none'})",
            )

        # -- delete ----------------------------------------------------------------------------------
        async def _delete(self, request: Any, dry_run: bool) -> dict[str, Any]:
            res = request.resource
            key = self._key(request)
            old = self._live(key)
            if old is None:
                raise self._not_found(res, request.name)
            if dry_run:
                return old
            return await self._remove(res, key, old)

        async def _remove(self, res: Any, key: Any, old: dict[str, Any]) -> dict[str, Any]:
            bound = res.plural == "pods" and (old.get("spec") or {}).get("nodeName")
            terminal = (old.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if bound and not terminal and args.pod_termination > 0:
                if not old["metadata"].get("deletionTimestamp"):
                    old["metadata"]["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime(
                        "%Y-%m-%dT%H:%M:%SZ"
                    )
                    old["metadata"]["deletionGracePeriodSeconds"] = 30
                    old["metadata"]["resourceVersion"] = self._next_rv()
                    raw = await self._store(res, key, old, "MODIFIED")
                    asyncio.get_running_loop().create_task(self._kubelet_removes(res, key))
                    return raw
                return old
            self.objects[key].delete()
            await self._buses[res].put({"type": "DELETED", "object": old})
            return old

        async def _kubelet_removes(self, res: Any, key: Any) -> None:
            await asyncio.sleep(args.pod_termination)
            async with self._lock:
                old = self._live(key)
                if old is not None:
                    self.objects[key].delete()
                    await self._buses[res].put({"type": "DELETED", "object": old})

        # -- eviction (pkg/registry/core/pod/storage/eviction.go) -------------------------------------
        async def _evict(self, request: Any, dry_run: bool) -> dict[str, Any]:
            res = request.resource
            eviction = request.data if isinstance(request.data, dict) else {}
            if eviction.get("kind") != "Eviction" or eviction.get("apiVersion") not in ("policy/v1", "policy/v1beta1"):
                raise bad_request(f"not a Eviction object: {eviction.get('apiVersion')}/{eviction.get('kind')}")
            if (eviction.get("metadata") or {}).get("name") != request.name:
                raise bad_request("name in URL does not match name in Eviction object")
            body_dry = (eviction.get("deleteOptions") or {}).get("dryRun") or []
            if body_dry and body_dry != ["All"]:
                raise bad_request(f"Invalid dryRun value: {body_dry}; only All is supported")
            dry_run = dry_run or bool(body_dry)
            key = self._key(request)
            pod = self._live(key)
            if pod is None:
                raise self._not_found(res, request.name)
            success = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Pending", "Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp"):
                if not dry_run:
                    await self._remove(res, key, pod)
                return success
            pdbs = self._budgets(pod)
            if len(pdbs) > 1:
                raise ApiError(
                    500,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                )
            if pdbs:
                pdb_key, pdb = pdbs[0]
                status = pdb.get("status") or {}
                ready = any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or []
                )
                enough = status.get("currentHealthy", 0) >= status.get("desiredHealthy", 0) > 0
                if ready or not enough:
                    self._check_and_decrement(pdb_key, pdb, request.name, dry_run)
            if not dry_run:
                await self._remove(res, key, pod)
            return success

        def _budgets(self, pod: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
            out = []
            labels = pod["metadata"].get("labels") or {}
            for (r, ns, _), obj in self.objects.items():
                if r.plural != "poddisruptionbudgets" or obj.deleted or ns != pod["metadata"].get("namespace"):
                    continue
                sel = (obj.raw.get("spec") or {}).get("selector") or {}
                if not sel.get("matchLabels") and not sel.get("matchExpressions"):
                    continue  # a nil or empty selector matches nothing
                if _selector_matches(sel, labels):
                    out.append(((r, ns, obj.raw["metadata"]["name"]), copy.deepcopy(dict(obj.raw))))
            return out

        def _check_and_decrement(self, key: Any, pdb: dict[str, Any], pod: str, dry_run: bool) -> None:
            status = pdb.get("status") or {}
            name = pdb["metadata"]["name"]
            if int(status.get("observedGeneration", 0)) < int(pdb["metadata"].get("generation", 1)):
                raise budget_refusal(f"The disruption budget {name} is still being processed by the server.", 10)
            allowed = int(status.get("disruptionsAllowed", 0))
            if allowed < 0:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'poddisruptionbudget.policy "{name}" is forbidden: pdb disruptions allowed is negative',
                )
            if allowed == 0:
                need, have = status.get("desiredHealthy", 0), status.get("currentHealthy", 0)
                raise budget_refusal(f"The disruption budget {name} needs {need} healthy pods and has {have} currently")
            if dry_run:
                return
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.objects[key].patch(
                {
                    "status": {"disruptionsAllowed": allowed - 1, "disruptedPods": {pod: stamp}},
                    "metadata": {"resourceVersion": self._next_rv()},
                }
            )

    emulator = Emulator()
    for gvr, kind, namespaced, subresources in RESOURCES:
        emulator.resources[gvr] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources, singular=kind.lower()
        )
    return emulator


def _verb(request: Any) -> str:
    method = request.method.value
    if method == "GET":
        return "list" if request.name is None else "get"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())


def _replace_patch(old: Any, new: Any) -> Any:
    """The merge patch that turns ``old`` into ``new`` (None deletes)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        if key not in old or old[key] != value:
            patch[key] = _replace_patch(old.get(key), value) if isinstance(value, dict) else copy.deepcopy(value)
    return patch


def _selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """metav1.LabelSelectorAsSelector(selector).Matches(labels)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    checks: dict[str, Callable[[str | None, list[str]], bool]] = {
        "In": lambda v, vs: v is not None and v in vs,
        "NotIn": lambda v, vs: v is None or v not in vs,
        "Exists": lambda v, vs: v is not None,
        "DoesNotExist": lambda v, vs: v is None,
    }
    for expr in selector.get("matchExpressions") or []:
        check = checks.get(expr.get("operator", ""))
        if check is None or not check(labels.get(expr.get("key", "")), list(expr.get("values") or [])):
            return False
    return True


async def _serve(args: argparse.Namespace) -> None:
    import kmock

    emulator = build_emulator(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with emulator, kmock.Server(emulator, host="127.0.0.1", port=args.port):
        print(f"kube-emulator listening on http://127.0.0.1:{args.port}", flush=True)
        await stop.wait()


def kubeconfig(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
        "current-context": "emulator",
    }


def _pid_file(kubeconfig_path: str) -> str:
    return kubeconfig_path + ".pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args.kubeconfig)
    if os.path.exists(pid_file):
        with open(pid_file, encoding="utf-8") as fh:
            pid = int(fh.read().strip() or 0)
        if pid and _alive(pid):
            print(json.dumps({"changed": False, "pid": pid, "kubeconfig": args.kubeconfig}))
            return 0
    port = args.port or _free_port()
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            print(f"kube-emulator: port {port} on 127.0.0.1 is already in use", file=sys.stderr)
            return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.kubeconfig)), exist_ok=True)
    log = open(args.kubeconfig + ".log", "w", encoding="utf-8")  # noqa: SIM115 (handed to the child)
    cmd = [sys.executable, os.path.abspath(__file__), "serve", "--port", str(port)]
    cmd += ["--continue-ttl", str(args.continue_ttl), "--pod-termination", str(args.pod_termination)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    # Recorded at once: a start that fails below still leaves a pid that stop can end.
    with open(pid_file, "w", encoding="utf-8") as fh:
        fh.write(str(proc.pid))
    deadline = time.monotonic() + 20
    url = f"http://127.0.0.1:{port}/version"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"kube-emulator did not start; see {args.kubeconfig}.log", file=sys.stderr)
            if proc.poll() is None:
                proc.terminate()
            return 1
        time.sleep(0.1)
    with open(args.kubeconfig, "w", encoding="utf-8") as fh:
        yaml.safe_dump(kubeconfig(port), fh)
    print(json.dumps({"changed": True, "pid": proc.pid, "kubeconfig": args.kubeconfig, "port": port}))
    return 0


def _stop(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args.kubeconfig)
    if not os.path.exists(pid_file):
        print(json.dumps({"changed": False}))
        return 0
    with open(pid_file, encoding="utf-8") as fh:
        pid = int(fh.read().strip() or 0)
    changed = False
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        changed = True
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)
    os.unlink(pid_file)
    print(json.dumps({"changed": changed, "pid": pid}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, default=18080, help="0 (start only): a free port")
        p.add_argument("--continue-ttl", type=float, default=300.0, help="seconds a continue token stays valid")
        p.add_argument(
            "--pod-termination",
            type=float,
            default=0.5,
            help="seconds a deleted pod bound to a node takes to disappear (0: at once)",
        )
        if name == "start":
            p.add_argument("--kubeconfig", required=True)
    stop = sub.add_parser("stop")
    stop.add_argument("--kubeconfig", required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        asyncio.run(_serve(args))
        return 0
    if args.command == "start":
        return _start(args)
    return _stop(args)


if __name__ == "__main__":
    raise SystemExit(main())
