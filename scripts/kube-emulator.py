#!/usr/bin/env python3
"""A small Kubernetes API emulator on 127.0.0.1 for the role tests (no cluster exists here).

Built on kmock's stateful ``KubernetesEmulator`` with the fixes the ``kubernetes`` client and
kubernetes.core need (see docs/toolchain.md):

* discovery of the core group answers ``groupVersion: v1`` (kmock says ``/v1``);
* list responses carry ``kind: <Kind>List`` and ``apiVersion``;
* ``labelSelector`` and ``fieldSelector`` are honoured (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``;
  field paths like ``spec.nodeName`` and ``metadata.name``);
* ``POST .../pods/<name>/eviction`` deletes the pod (what the eviction API does without PDBs);
* ``?dryRun=All`` PATCHes answer without persisting (kubernetes.core's --check), other dry runs fail.

It is NOT a real cluster: no resourceVersion conflicts, no strategic merge (a strategic or merge
patch body is merged as a JSON merge patch), no PUT, no server-side apply, no controllers.

One optional controller stands in for the device plugin DaemonSets (``--plugin-delay``): when a
node's mode label (``rdma.lingjun.io/mode``) changes, it rewrites the node's
``status.capacity``/``allocatable`` for ``--resource`` after the delay, to the mode's shape:
shared = ``--shared-devices``; exclusive = the node's annotation
``emulator.rdma.lingjun.io/nics`` (default 0). A node annotated
``emulator.rdma.lingjun.io/plugin: broken`` never changes (to test the failure paths).

Usage:
  kube-emulator.py start --port 18080 --kubeconfig out/emulator/kubeconfig [--plugin-delay 2]
  kube-emulator.py stop --kubeconfig out/emulator/kubeconfig
  kube-emulator.py serve --port 18080 ...      (foreground; what ``start`` runs detached)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import yaml

MODE_LABEL = "rdma.lingjun.io/mode"
NICS_ANNOTATION = "emulator.rdma.lingjun.io/nics"
PLUGIN_ANNOTATION = "emulator.rdma.lingjun.io/plugin"

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
]
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def format_quantity(n: int) -> str:
    for suffix, factor in (("M", 10**6), ("k", 10**3)):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def _field(obj: dict[str, Any], path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return None if cur is None else str(cur)


def _requirements(selector: str) -> list[tuple[str, str, str | None]]:
    reqs: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (p.strip() for p in selector.split(","))):
        if "!=" in raw:
            k, v = raw.split("!=", 1)
            reqs.append((k.strip(), "!=", v.strip()))
        elif "==" in raw:
            k, v = raw.split("==", 1)
            reqs.append((k.strip(), "=", v.strip()))
        elif "=" in raw:
            k, v = raw.split("=", 1)
            reqs.append((k.strip(), "=", v.strip()))
        elif raw.startswith("!"):
            reqs.append((raw[1:].strip(), "absent", None))
        else:
            reqs.append((raw, "exists", None))
    return reqs


def _matches(value: str | None, op: str, want: str | None) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    if op == "exists":
        return value is not None
    return value is None


def selected(obj: dict[str, Any], label_selector: str, field_selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for key, op, want in _requirements(label_selector):
        if not _matches(labels.get(key), op, want):
            return False
    return all(_matches(_field(obj, key), op, want) for key, op, want in _requirements(field_selector))


def build_emulator(args: argparse.Namespace) -> Any:
    import kmock
    from kmock._internal import enums

    class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
        """kmock with the fixes listed in the module docstring."""

        async def _serve_version(self, request: Any) -> Any:
            payload = await super()._serve_version(request)
            if isinstance(payload, dict) and payload.get("groupVersion") == "/v1":
                payload["groupVersion"] = "v1"
            return payload

        async def _serve_list(self, request: Any) -> Any:
            payload = await super()._serve_list(request)
            res = request.resource
            info = self.resources[res]
            kind = info.kind or res.plural.capitalize()
            payload["kind"] = f"{kind}List"
            payload["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
            params = request.params or {}
            payload["items"] = [
                dict(item, kind=kind, apiVersion=payload["apiVersion"])
                for item in payload["items"]
                if selected(item, params.get("labelSelector", ""), params.get("fieldSelector", ""))
            ]
            return payload

        async def _handle(self, request: Any) -> Any:
            if (
                request.resource is not None
                and request.resource.plural == "pods"
                and request.subresource == "eviction"
                and request.method == enums.method.POST
            ):
                key = (request.resource, request.namespace, request.name)
                async with self._lock:
                    if key not in self.objects or self.objects[key].deleted:
                        raise kmock.KubernetesObjectNotFoundError()
                    raw = self.objects[key].raw
                    self.objects[key].delete()
                    await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                from aiohttp import web

                return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201})
            if (request.params or {}).get("dryRun") == "All" and request.method != enums.method.GET:
                return await self._dry_run(request)
            before = None
            if request.resource is not None and request.resource.plural == "nodes" and request.name:
                key = (request.resource, None, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    before = ((self.objects[key].raw.get("metadata") or {}).get("labels") or {}).get(MODE_LABEL)
            response = await super()._handle(request)
            if (
                args.plugin_delay is not None
                and request.resource is not None
                and request.resource.plural == "nodes"
                and request.name
                and request.action == enums.action.UPDATE
            ):
                key = (request.resource, None, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    meta = self.objects[key].raw.get("metadata") or {}
                    after = (meta.get("labels") or {}).get(MODE_LABEL)
                    if after != before and (meta.get("annotations") or {}).get(PLUGIN_ANNOTATION) != "broken":
                        asyncio.get_running_loop().create_task(self._plugin_restarts(request.resource, request.name))
            return response

        async def _dry_run(self, request: Any) -> Any:
            """``?dryRun=All`` (what kubernetes.core sends under --check): answer as the real apiserver
            does, without persisting (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go
            skips the storage write for dry runs). Only PATCH of an existing object is emulated;
            other dry runs are refused rather than silently applied."""
            key = (request.resource, request.namespace, request.name)
            if request.action != enums.action.UPDATE or key not in self.objects or self.objects[key].deleted:
                from aiohttp import web

                msg = "kube-emulator: dryRun=All is emulated only for PATCH of an existing object"
                return web.json_response({"kind": "Status", "status": "Failure", "message": msg, "code": 400}, status=400)
            history = self.objects[key].history
            kept = len(history)
            response = await super()._handle(request)
            del history[kept:]  # the patched version never becomes the stored one
            return response

        async def _plugin_restarts(self, resource: Any, name: str) -> None:
            """The other mode's DaemonSet pod starts on the node and re-advertises the resource."""
            await asyncio.sleep(args.plugin_delay)
            key = (resource, None, name)
            async with self._lock:
                if key not in self.objects or self.objects[key].deleted:
                    return
                meta = self.objects[key].raw.get("metadata") or {}
                mode = (meta.get("labels") or {}).get(MODE_LABEL, args.default_mode)
                nics = int((meta.get("annotations") or {}).get(NICS_ANNOTATION, "0"))
                count = args.shared_devices if mode == "shared" else nics
                qty = format_quantity(count)
                self.objects[key].patch(
                    {"status": {"capacity": {args.resource: qty}, "allocatable": {args.resource: qty}}}
                )
                await self._buses[resource].put({"type": "MODIFIED", "object": self.objects[key].raw})

    emulator = Emulator()
    for gvr, kind, namespaced, subresources in RESOURCES:
        emulator.resources[gvr] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources, singular=kind.lower()
        )
    return emulator


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


def _start(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args.kubeconfig)
    if os.path.exists(pid_file):
        with open(pid_file, encoding="utf-8") as fh:
            pid = int(fh.read().strip() or 0)
        if pid and _alive(pid):
            print(json.dumps({"changed": False, "pid": pid, "kubeconfig": args.kubeconfig}))
            return 0
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", args.port)) == 0:
            print(f"kube-emulator: port {args.port} on 127.0.0.1 is already in use", file=sys.stderr)
            return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.kubeconfig)), exist_ok=True)
    log = open(args.kubeconfig + ".log", "w", encoding="utf-8")  # noqa: SIM115 (handed to the child)
    cmd = [sys.executable, os.path.abspath(__file__), "serve", "--port", str(args.port)]
    cmd += ["--resource", args.resource, "--shared-devices", str(args.shared_devices)]
    cmd += ["--default-mode", args.default_mode]
    if args.plugin_delay is not None:
        cmd += ["--plugin-delay", str(args.plugin_delay)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    url = f"http://127.0.0.1:{args.port}/version"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"kube-emulator did not start; see {args.kubeconfig}.log", file=sys.stderr)
            return 1
        time.sleep(0.1)
    with open(args.kubeconfig, "w", encoding="utf-8") as fh:
        yaml.safe_dump(kubeconfig(args.port), fh)
    with open(pid_file, "w", encoding="utf-8") as fh:
        fh.write(str(proc.pid))
    print(json.dumps({"changed": True, "pid": proc.pid, "kubeconfig": args.kubeconfig}))
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
        p.add_argument("--port", type=int, default=18080)
        p.add_argument("--resource", default="rdma/hca")
        p.add_argument("--shared-devices", type=int, default=1000)
        p.add_argument("--default-mode", choices=["shared", "exclusive"], default="shared")
        p.add_argument("--plugin-delay", type=float, default=None, help="seconds; enables the plugin stand-in")
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
