"""Kubernetes manifests under k8s/: render, validate offline, check policies.

Every kustomization directory under k8s/ (found by walking the tree; kind
Component directories are only built through the overlays that use them) is
rendered with ``kubectl kustomize`` and each rendered object is validated
with kubernetes-validate against the Kubernetes 1.32 schemas in strict mode
(unknown fields are errors). Then the checks below run on the rendered
objects. Each check is exercised by a negative test that breaks one rendered
object and expects the check to name the fault.

kubernetes-validate only knows built-in kinds. Given a kind it has no schema
for, its CLI prints a WARN and exits 0 even with --strict, which would let a
misspelt apiVersion (``autoscaling/v3``) or any CRD content through. So this
module calls its Python API and treats SchemaNotFoundError as a failure,
except for the CRD kinds listed in CRD_SCHEMAS: those are validated against a
strict subset of their upstream CRD schema written here (unknown fields are
rejected), and their semantics are checked by hand (check_service_monitors).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

try:  # kubernetes-validate brings jsonschema and PyYAML along
    import jsonschema
    import kubernetes_validate as kv
    import yaml
except ImportError:  # reported by the kvmod fixture as a failure, not a skip
    jsonschema = kv = yaml = None

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl")
K8S_VERSION = "1.32.0"

pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not found on PATH or in $KUBECTL: it renders the k8s/ kustomizations "
    "(needs kubectl >= 1.27 / kustomize v5: the apt package `kubectl` of this machine image; "
    "Debian's own kubernetes-client is 1.20, too old)",
)

DRAFTER = {"app.kubernetes.io/name": "drafter", "app.kubernetes.io/component": "drafter"}
TARGET = {"app.kubernetes.io/component": "target"}
# Settings every drafter container must get (the `drafter serve` contract).
REQUIRED_DRAFTER_ENV = (
    "DRAFTER_METHOD", "DRAFTER_MODEL", "DRAFTER_TARGET_MODEL", "DRAFTER_DEVICE",
    "DRAFTER_HOST", "DRAFTER_GRPC_PORT", "DRAFTER_ZMQ_PORT", "DRAFTER_HEALTH_PORT",
    "DRAFTER_METRICS_PORT", "DRAFTER_MAX_SESSIONS", "DRAFTER_BATCH_WINDOW_US",
    "DRAFTER_DRAIN_TIMEOUT_S",
)
PORT_ENV = {"grpc": "DRAFTER_GRPC_PORT", "zmq": "DRAFTER_ZMQ_PORT",
            "health": "DRAFTER_HEALTH_PORT", "metrics": "DRAFTER_METRICS_PORT"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
# A strict subset of the prometheus-operator CRD's openAPIV3Schema: fields we
# do not use are absent (so rejected); selector and endpoints are required
# (upstream requires only selector; a ServiceMonitor without endpoints scrapes
# nothing, so we demand it).
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer", "minimum": 0},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": _DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                    }}},
            },
        },
    },
}
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA}


# ---------------------------------------------------------------- rendering

def kustomization_dirs() -> list[str]:
    dirs = []
    for f in sorted(K8S.rglob("*")):
        if f.name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
            if (yaml.safe_load(f.read_text()) or {}).get("kind") != "Component":
                dirs.append(str(f.parent.relative_to(REPO)))
    return dirs


@functools.lru_cache(maxsize=None)
def _render(rel: str) -> tuple:
    # KUBECONFIG=/dev/null: rendering is local, no cluster is ever contacted.
    env = {**os.environ, "KUBECONFIG": os.devnull}
    p = subprocess.run([KUBECTL, "kustomize", str(REPO / rel)], capture_output=True,
                       text=True, timeout=120, env=env)
    if p.returncode != 0:
        ver = subprocess.run([KUBECTL, "version", "--client"], capture_output=True, text=True,
                             timeout=60, env=env).stdout
        pytest.fail(f"kubectl kustomize {rel} failed:\n{p.stderr}\n{KUBECTL}: {ver}\n"
                    "k8s/ needs kustomize v5 (kubectl >= 1.27); Debian's kubernetes-client "
                    "(kubectl 1.20) is too old")
    return tuple(o for o in yaml.safe_load_all(p.stdout) if o)


def render(rel: str) -> list[dict]:
    return copy.deepcopy(list(_render(rel)))


def example_objects() -> list[dict]:
    """Placeholder manifests (*.example.yaml) kept out of every kustomization."""
    out = []
    for f in sorted(K8S.rglob("*.example.yaml")):
        out += [o for o in yaml.safe_load_all(f.read_text()) if o]
    return out


# ------------------------------------------------------------------ helpers

def ident(o: dict) -> str:
    return f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"


def ns_of(o: dict) -> str:
    return o.get("metadata", {}).get("namespace", "default")


def of_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def selector_matches(sel: dict | None, labels: dict) -> bool:
    """LabelSelector semantics (an empty selector matches everything)."""
    if sel is None:
        return False
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def pods(objs):
    """(workload, pod template) for each workload."""
    return [(o, o["spec"]["template"]) for o in objs if o.get("kind") in WORKLOAD_KINDS]


def pod_labels(tpl) -> dict:
    return tpl.get("metadata", {}).get("labels") or {}


def is_drafter(tpl) -> bool:
    return all(pod_labels(tpl).get(k) == v for k, v in DRAFTER.items())


def is_target(tpl) -> bool:
    return all(pod_labels(tpl).get(k) == v for k, v in TARGET.items())


def clients(objs):
    """Workloads that call the drafters: labelled as targets or given DRAFTER_ENDPOINTS.

    Found by their settings too, so that a target whose labels drift away
    from what the NetworkPolicy admits is still checked against it."""
    return [(w, t) for w, t in pods(objs) if not is_drafter(t) and (is_target(t) or any(
        "DRAFTER_ENDPOINTS" in container_env(c, objs, ns_of(w)) for c in t["spec"]["containers"]))]


def find(objs, kind, name, ns):
    for o in objs:
        if o.get("kind") == kind and o["metadata"]["name"] == name and ns_of(o) == ns:
            return o
    return None


def container_env(c: dict, objs, ns: str) -> dict:
    """Environment a container gets from envFrom ConfigMaps and literal env."""
    env = {}
    for ef in c.get("envFrom") or []:
        ref = ef.get("configMapRef")
        cm = ref and find(objs, "ConfigMap", ref["name"], ns)
        if cm:
            env.update({ef.get("prefix", "") + k: v for k, v in (cm.get("data") or {}).items()})
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif (e.get("valueFrom") or {}).get("configMapKeyRef"):
            ref = e["valueFrom"]["configMapKeyRef"]
            cm = find(objs, "ConfigMap", ref["name"], ns)
            if cm and ref["key"] in (cm.get("data") or {}):
                env[e["name"]] = cm["data"][ref["key"]]
    return env


def drafter_containers(objs):
    """(workload, pod spec, container, env) of each drafter container."""
    out = []
    for w, tpl in pods(objs):
        if is_drafter(tpl):
            for c in tpl["spec"]["containers"]:
                out.append((w, tpl["spec"], c, container_env(c, objs, ns_of(w))))
    return out


def container_port(c: dict, port) -> int | None:
    """Resolve a port given by name or number against a container's ports."""
    for p in c.get("ports") or []:
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def quantity(q) -> float:
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    if not m:
        return float("nan")
    mult = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * mult


# ------------------------------------------------------------------- checks

def check_schemas(objs) -> list[str]:
    errs = []
    for o in objs:
        try:
            kv.validate(o, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            errs.append(f"{ident(o)}: schema: {'.'.join(map(str, e.path))}: {e.message}")
        except kv.SchemaNotFoundError:
            schema = CRD_SCHEMAS.get((o.get("apiVersion"), o.get("kind")))
            if schema is None:
                errs.append(f"{ident(o)}: no schema for {o.get('apiVersion')} {o.get('kind')} "
                            "(unknown kind or apiVersion; add a CRD schema subset if intended)")
                continue
            for e in jsonschema.Draft202012Validator(schema).iter_errors(o):
                errs.append(f"{ident(o)}: CRD schema: {'.'.join(map(str, e.path))}: {e.message}")
    return errs


def check_images(objs) -> list[str]:
    errs = []
    for w, tpl in pods(objs):
        spec = tpl["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            img = c.get("image", "")
            if "@sha256:" in img:
                continue
            last = img.rsplit("/", 1)[-1]
            if ":" not in last:
                errs.append(f"{ident(w)}/{c['name']}: image {img!r} has no tag")
            elif last.rsplit(":", 1)[1] == "latest":
                errs.append(f"{ident(w)}/{c['name']}: image {img!r} uses the latest tag")
    return errs


def check_resources(objs) -> list[str]:
    errs = []
    for w, tpl in pods(objs):
        spec = tpl["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            r = c.get("resources") or {}
            for part in ("requests", "limits"):
                for res in ("cpu", "memory"):
                    if res not in (r.get(part) or {}):
                        errs.append(f"{ident(w)}/{c['name']}: no resources.{part}.{res}")
            for res in ("cpu", "memory"):
                req, lim = (r.get("requests") or {}).get(res), (r.get("limits") or {}).get(res)
                if req is not None and lim is not None and quantity(req) > quantity(lim):
                    errs.append(f"{ident(w)}/{c['name']}: requests.{res} {req} > limits.{res} {lim}")
        if is_drafter(tpl):
            for c in spec["containers"]:
                gpu = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
                if gpu is None or int(gpu) < 1:
                    errs.append(f"{ident(w)}/{c['name']}: drafter has no limits.nvidia.com/gpu >= 1")
    return errs


def check_security(objs) -> list[str]:
    errs = []
    for w, tpl in pods(objs):
        spec = tpl["spec"]
        psc = spec.get("securityContext") or {}
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            errs.append(f"{ident(w)}: uses host namespaces")
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc, n = c.get("securityContext") or {}, f"{ident(w)}/{c['name']}"
            if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
                errs.append(f"{n}: runAsNonRoot is not true")
            if sc.get("runAsUser", psc.get("runAsUser")) == 0:
                errs.append(f"{n}: runAsUser is 0")
            if sc.get("readOnlyRootFilesystem") is not True:
                errs.append(f"{n}: readOnlyRootFilesystem is not true")
            if sc.get("allowPrivilegeEscalation") is not False:
                errs.append(f"{n}: allowPrivilegeEscalation is not false")
            if sc.get("privileged"):
                errs.append(f"{n}: privileged")
            caps = sc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []):
                errs.append(f"{n}: capabilities do not drop ALL")
            if caps.get("add"):
                errs.append(f"{n}: adds capabilities {caps['add']}")
            seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                errs.append(f"{n}: seccompProfile is {seccomp!r}, not RuntimeDefault")
    return errs


def check_service_accounts(objs) -> list[str]:
    errs = []
    for w, tpl in pods(objs):
        spec = tpl["spec"]
        name = spec.get("serviceAccountName")
        sa = name and find(objs, "ServiceAccount", name, ns_of(w))
        if not sa:
            errs.append(f"{ident(w)}: serviceAccountName {name!r} is not a rendered ServiceAccount")
        automount = spec.get("automountServiceAccountToken",
                             sa.get("automountServiceAccountToken") if sa else None)
        if automount is not False:
            errs.append(f"{ident(w)}: automountServiceAccountToken is not false")
        if spec.get("enableServiceLinks") is not False:
            errs.append(f"{ident(w)}: enableServiceLinks is not false (Service env vars "
                        "would leak into the DRAFTER_* settings)")
    return errs


def check_probes(objs) -> list[str]:
    errs = []
    for w, tpl in pods(objs):
        for c in tpl["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    errs.append(f"{ident(w)}/{c['name']}: no {probe}")
    for w, _, c, env in drafter_containers(objs):
        n = f"{ident(w)}/{c['name']}"
        health, grpc = env.get("DRAFTER_HEALTH_PORT"), env.get("DRAFTER_GRPC_PORT")
        if health is None or health == grpc:
            errs.append(f"{n}: DRAFTER_HEALTH_PORT {health!r} must be set and differ from "
                        f"the main gRPC port {grpc!r} (which may require mTLS)")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            g = (c.get(probe) or {}).get("grpc")
            if probe in c and g is None:
                errs.append(f"{n}: {probe} is not a grpc health probe")
            elif g is not None and str(g.get("port")) != str(health):
                errs.append(f"{n}: {probe} probes port {g.get('port')}, not the health port {health}")
        if container_port(c, "health") != (int(health) if health else None):
            errs.append(f"{n}: no container port named health = DRAFTER_HEALTH_PORT {health}")
    return errs


def check_ports(objs) -> list[str]:
    """Drafter container ports exist, are named, and agree with the settings."""
    errs = []
    for w, _, c, env in drafter_containers(objs):
        for name, key in PORT_ENV.items():
            if key in env and container_port(c, name) != int(env[key]):
                errs.append(f"{ident(w)}/{c['name']}: container port {name!r} != {key}={env[key]}")
    return errs


def check_drain(objs) -> list[str]:
    errs = []
    for w, spec, c, env in drafter_containers(objs):
        n = f"{ident(w)}/{c['name']}"
        pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
        if "sleep" in pre:
            wait = int(pre["sleep"]["seconds"])
        elif (pre.get("exec") or {}).get("command", [None])[0] == "sleep":
            wait = int(pre["exec"]["command"][1])
        else:
            errs.append(f"{n}: no preStop sleep (clients need time to see the pod leave DNS)")
            wait = 0
        drain = env.get("DRAFTER_DRAIN_TIMEOUT_S")
        if drain is None:
            errs.append(f"{n}: DRAFTER_DRAIN_TIMEOUT_S is not set")
            continue
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if grace < wait + int(drain):
            errs.append(f"{n}: terminationGracePeriodSeconds {grace} < preStop {wait} s + "
                        f"drain {drain} s: the drain would be cut by SIGKILL")
    return errs


def check_config_refs(objs, examples=()) -> list[str]:
    """ConfigMaps/Secrets referenced by pods exist and hold the keys used."""
    errs = []
    secrets = list(of_kind(objs, "Secret")) + [o for o in examples if o.get("kind") == "Secret"]

    def data(kind, name, ns):
        pool = secrets if kind == "Secret" else objs
        for o in pool:
            if o.get("kind") == kind and o["metadata"]["name"] == name and ns_of(o) == ns:
                return {**(o.get("data") or {}), **(o.get("stringData") or {})}
        return None

    for w, tpl in pods(objs):
        spec, ns = tpl["spec"], ns_of(w)
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        for c in spec.get("initContainers", []) + spec["containers"]:
            n = f"{ident(w)}/{c['name']}"
            for ef in c.get("envFrom") or []:
                for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    ref = ef.get(key)
                    if ref and not ref.get("optional") and data(kind, ref["name"], ns) is None:
                        errs.append(f"{n}: envFrom {kind} {ref['name']!r} not found")
            for e in c.get("env") or []:
                for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    ref = (e.get("valueFrom") or {}).get(key)
                    if ref and not ref.get("optional"):
                        d = data(kind, ref["name"], ns)
                        if d is None or ref["key"] not in d:
                            errs.append(f"{n}: env {e['name']} needs {kind} {ref['name']!r} "
                                        f"key {ref['key']!r}, not found")
            for m in c.get("volumeMounts") or []:
                if m["name"] not in vols:
                    errs.append(f"{n}: volumeMount {m['name']!r} has no volume")
                elif "secret" in vols[m["name"]] and m.get("readOnly") is not True:
                    errs.append(f"{n}: secret volume {m['name']!r} is not mounted readOnly")
        for v in vols.values():
            for kind, key, name_key in (("ConfigMap", "configMap", "name"),
                                        ("Secret", "secret", "secretName")):
                src = v.get(key)
                if not src or src.get("optional"):
                    continue
                d = data(kind, src[name_key], ns)
                if d is None:
                    errs.append(f"{ident(w)}: volume {v['name']!r}: {kind} {src[name_key]!r} "
                                "not found (rendered or in a *.example.yaml)")
                    continue
                for item in src.get("items") or []:
                    if item["key"] not in d:
                        errs.append(f"{ident(w)}: volume {v['name']!r}: {kind} "
                                    f"{src[name_key]!r} has no key {item['key']!r}")
            pvc = v.get("persistentVolumeClaim")
            if pvc and not find(objs, "PersistentVolumeClaim", pvc["claimName"], ns):
                errs.append(f"{ident(w)}: volume {v['name']!r}: PVC {pvc['claimName']!r} not rendered")
    for w, spec, c, env in drafter_containers(objs):
        for key in REQUIRED_DRAFTER_ENV:
            if key not in env:
                errs.append(f"{ident(w)}/{c['name']}: setting {key} missing from its ConfigMap/env")
        # A path setting must lie in a mounted volume (the root filesystem is
        # read-only and holds no checkpoints); files read from a Secret mount
        # must be keys of that Secret; cache dirs must be writable.
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        for key, val in env.items():
            writable = key in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")
            if not (key.startswith("DRAFTER_") or writable) or not str(val).startswith("/"):
                continue
            mp = max((p for p in mounts if str(val) == p or str(val).startswith(p.rstrip("/") + "/")),
                     key=len, default=None)
            if mp is None:
                errs.append(f"{ident(w)}/{c['name']}: {key}={val} is under no volumeMount")
                continue
            if writable and mounts[mp].get("readOnly"):
                errs.append(f"{ident(w)}/{c['name']}: {key}={val} is on a read-only mount")
            sec = vols.get(mounts[mp]["name"], {}).get("secret")
            rel = str(val)[len(mp) + 1:]
            if sec and rel:
                items = sec.get("items")
                keys = {i["path"] for i in items} if items else set(data("Secret", sec["secretName"], ns_of(w)) or {})
                if rel not in keys:
                    errs.append(f"{ident(w)}/{c['name']}: {key}={val}: Secret "
                                f"{sec['secretName']!r} provides no {rel!r}")
    return errs


def check_services(objs) -> list[str]:
    errs = []
    workloads = pods(objs)
    for s in of_kind(objs, "Service"):
        sel = s["spec"].get("selector")
        selected = [(w, t) for w, t in workloads
                    if ns_of(w) == ns_of(s) and sel and selector_matches({"matchLabels": sel}, pod_labels(t))]
        if not selected:
            errs.append(f"{ident(s)}: selector {sel} matches no rendered pods")
        for p in s["spec"].get("ports") or []:
            if not p.get("name"):
                errs.append(f"{ident(s)}: port {p.get('port')} has no name")
            tp = p.get("targetPort", p.get("port"))
            for w, t in selected:
                if not any(container_port(c, tp) for c in t["spec"]["containers"]):
                    errs.append(f"{ident(s)}: targetPort {tp!r} is no container port of {ident(w)}")
    drafter_svcs = [s for s in of_kind(objs, "Service")
                    if s["spec"].get("selector") and any(
                        ns_of(w) == ns_of(s) and selector_matches({"matchLabels": s["spec"]["selector"]}, pod_labels(t))
                        for w, t in workloads if is_drafter(t))]
    client_svcs = [s for s in drafter_svcs
                   if {"grpc", "zmq"} <= {p.get("name") for p in s["spec"].get("ports") or []}]
    if any(is_drafter(t) for _, t in workloads) and not client_svcs:
        errs.append("no Service selects the drafter pods with ports named grpc and zmq")
    envs = [env for *_, env in drafter_containers(objs)]
    for s in client_svcs:
        if s["spec"].get("clusterIP") != "None":
            errs.append(f"{ident(s)}: not headless (clusterIP: None) - clients balance themselves")
        if s["spec"].get("publishNotReadyAddresses"):
            errs.append(f"{ident(s)}: publishNotReadyAddresses would route to draining pods")
        for p in s["spec"]["ports"]:
            key = PORT_ENV.get(p.get("name"))
            for env in envs:
                if key and key in env and int(env[key]) != p["port"]:
                    errs.append(f"{ident(s)}: port {p['name']}={p['port']} != {key}={env[key]}")
    return errs


def check_pdbs(objs) -> list[str]:
    errs = []
    workloads = pods(objs)
    drafters = [(w, t) for w, t in workloads if is_drafter(t)]
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for pdb in pdbs:
        hit = [(w, t) for w, t in workloads
               if ns_of(w) == ns_of(pdb) and selector_matches(pdb["spec"].get("selector"), pod_labels(t))]
        if not hit:
            errs.append(f"{ident(pdb)}: selector matches no rendered pods")
        if any(not is_drafter(t) for _, t in hit) and any(is_drafter(t) for _, t in hit):
            errs.append(f"{ident(pdb)}: selects drafter and non-drafter pods together")
        min_av = pdb["spec"].get("minAvailable")
        for w, _ in hit:
            if isinstance(min_av, int) and min_av >= w["spec"].get("replicas", 1):
                errs.append(f"{ident(pdb)}: minAvailable {min_av} >= replicas of {ident(w)}: "
                            "no node could ever be drained")
    for w, t in drafters:
        if not any(ns_of(p) == ns_of(w) and selector_matches(p["spec"].get("selector"), pod_labels(t))
                   for p in pdbs):
            errs.append(f"{ident(w)}: no PodDisruptionBudget selects the drafter pods")
    return errs


def _peer_admits(peer: dict, policy_ns: str, pod_ns: str, labels: dict) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod_ns}):
            return False
    elif pod_ns != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], labels)


def _rule_ports(rule: dict, c: dict) -> set[int]:
    if not rule.get("ports"):
        return {p["containerPort"] for p in c.get("ports") or []}  # all ports
    return {container_port(c, p.get("port")) for p in rule["ports"]} - {None}


def check_network_policies(objs) -> list[str]:
    errs = []
    nps = of_kind(objs, "NetworkPolicy")
    targets = clients(objs)
    for w, spec, c, env in drafter_containers(objs):
        tpl_labels = pod_labels(w["spec"]["template"])
        mine = [np for np in nps if ns_of(np) == ns_of(w)
                and selector_matches(np["spec"].get("podSelector"), tpl_labels)
                and "Ingress" in np["spec"].get("policyTypes", ["Ingress"])]
        if not mine:
            errs.append(f"{ident(w)}: no NetworkPolicy podSelector selects the drafter pods")
            continue
        serving = {int(env[PORT_ENV[n]]) for n in ("grpc", "zmq") if PORT_ENV[n] in env}
        metrics = int(env["DRAFTER_METRICS_PORT"]) if "DRAFTER_METRICS_PORT" in env else None
        for np in mine:
            for rule in np["spec"].get("ingress") or []:
                peers, ports = rule.get("from"), _rule_ports(rule, c)
                if not peers:
                    errs.append(f"{ident(np)}: an ingress rule without `from` admits every source")
                    continue
                for peer in peers:
                    if "ipBlock" in peer:
                        errs.append(f"{ident(np)}: ipBlock peer on drafter pods")
                    if ports & serving and not (peer.get("podSelector") or {}).get("matchLabels", {}) \
                            and not (peer.get("podSelector") or {}).get("matchExpressions"):
                        errs.append(f"{ident(np)}: drafter ports {sorted(ports & serving)} are open to "
                                    "every pod of the peer namespaces (empty or no podSelector)")
        rules = [(np, r) for np in mine for r in np["spec"].get("ingress") or [] if r.get("from")]
        for tw, tt in targets:
            for port in sorted(serving):
                if not any(port in _rule_ports(r, c) and any(
                        _peer_admits(p, ns_of(np), ns_of(tw), pod_labels(tt)) for p in r["from"])
                        for np, r in rules):
                    errs.append(f"{ident(w)}: NetworkPolicy does not admit target {ident(tw)} "
                                f"(labels {pod_labels(tt)}) on port {port}")
        if metrics is not None and not any(
                metrics in _rule_ports(r, c) and any("namespaceSelector" in p for p in r["from"])
                for _, r in rules):
            errs.append(f"{ident(w)}: NetworkPolicy does not let a monitoring namespace scrape "
                        f"port {metrics}")
    return errs


def check_target_wiring(objs) -> list[str]:
    errs = []
    svcs = of_kind(objs, "Service")
    for w, tpl in clients(objs):
        for c in tpl["spec"]["containers"]:
            n, env = f"{ident(w)}/{c['name']}", container_env(c, objs, ns_of(w))
            transport = env.get("DRAFTER_TRANSPORT")
            if transport not in ("zmq", "grpc"):
                errs.append(f"{n}: DRAFTER_TRANSPORT={transport!r}, want zmq or grpc")
                continue
            if not re.fullmatch(r"[1-9][0-9]*", str(env.get("DRAFTER_DEADLINE_MS", ""))):
                errs.append(f"{n}: DRAFTER_DEADLINE_MS={env.get('DRAFTER_DEADLINE_MS')!r} "
                            "is not a positive integer")
            endpoints = [e for e in str(env.get("DRAFTER_ENDPOINTS", "")).split(",") if e]
            if not endpoints:
                errs.append(f"{n}: DRAFTER_ENDPOINTS is empty")
            for ep in endpoints:
                host, _, port = ep.rpartition(":")
                svc = next((s for s in svcs if s["spec"].get("clusterIP") == "None" and host in (
                    f"{s['metadata']['name']}.{ns_of(s)}.svc.cluster.local",
                    f"{s['metadata']['name']}.{ns_of(s)}.svc")), None)
                if svc is None:
                    errs.append(f"{n}: endpoint {ep!r} names no rendered headless Service "
                                "(<svc>.<namespace>.svc.cluster.local)")
                    continue
                want = next((p["port"] for p in svc["spec"]["ports"] if p.get("name") == transport), None)
                if not port.isdigit() or int(port) != want:
                    errs.append(f"{n}: endpoint {ep!r}: port is not {ident(svc)}'s {transport} port {want}")
    return errs


def check_hpas(objs) -> list[str]:
    errs = []
    for h in of_kind(objs, "HorizontalPodAutoscaler"):
        ref = h["spec"]["scaleTargetRef"]
        w = find(objs, ref["kind"], ref["name"], ns_of(h))
        if w is None:
            errs.append(f"{ident(h)}: scaleTargetRef {ref['kind']}/{ref['name']} is not rendered")
        elif "replicas" in w["spec"]:
            errs.append(f"{ident(h)}: {ident(w)} still sets replicas; every apply would "
                        "fight the autoscaler")
        if h["spec"].get("minReplicas", 1) > h["spec"]["maxReplicas"]:
            errs.append(f"{ident(h)}: minReplicas > maxReplicas")
        if not any(m["type"] in ("Pods", "External", "Object") for m in h["spec"].get("metrics") or []):
            errs.append(f"{ident(h)}: does not scale on a drafter metric (Pods/External/Object)")
    return errs


def check_service_monitors(objs) -> list[str]:
    """Semantics of the CRD objects (their fields are checked in check_schemas)."""
    errs = []
    for sm in of_kind(objs, "ServiceMonitor"):
        spec = sm.get("spec") or {}
        nss = spec.get("namespaceSelector") or {}
        svcs = [s for s in of_kind(objs, "Service")
                if selector_matches(spec.get("selector"), s["metadata"].get("labels") or {})
                and (nss.get("any") or ns_of(s) in (nss.get("matchNames") or [ns_of(sm)]))]
        if not svcs:
            errs.append(f"{ident(sm)}: selector matches no rendered Service")
        for ep in spec.get("endpoints") or []:
            for s in svcs:
                p = next((p for p in s["spec"]["ports"] if p.get("name") == ep.get("port")), None)
                if p is None:
                    errs.append(f"{ident(sm)}: {ident(s)} has no port named {ep.get('port')!r}")
                    continue
                for w, _, c, env in drafter_containers(objs):
                    if selector_matches({"matchLabels": s["spec"].get("selector") or {"-": "-"}},
                                        pod_labels(w["spec"]["template"])):
                        got = container_port(c, p.get("targetPort", p["port"]))
                        if str(got) != str(env.get("DRAFTER_METRICS_PORT")):
                            errs.append(f"{ident(sm)}: scrapes port {got} of {ident(w)}, "
                                        f"not DRAFTER_METRICS_PORT {env.get('DRAFTER_METRICS_PORT')}")
            if ep.get("path", "/metrics") != "/metrics":
                errs.append(f"{ident(sm)}: path {ep.get('path')!r} is not /metrics")
    return errs


POLICY_CHECKS = (check_images, check_resources, check_security, check_service_accounts,
                 check_probes, check_ports, check_drain, check_services, check_pdbs,
                 check_network_policies, check_target_wiring, check_hpas, check_service_monitors)


def all_errors(objs) -> list[str]:
    errs = check_schemas(objs) + check_config_refs(objs, example_objects())
    for check in POLICY_CHECKS:
        errs += check(objs)
    return errs


# -------------------------------------------------------------------- tests

DIRS = kustomization_dirs() if yaml else []


@pytest.fixture(scope="module")
def kvmod():
    if kv is None:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[test]' "
                    "(or pip install kubernetes-validate)")
    return kv


def test_discovers_base_and_overlays(kvmod):
    for d in ("k8s/base", "k8s/overlays/eagle3-llama", "k8s/overlays/monitoring",
              "k8s/overlays/target-wiring", "k8s/overlays/mtls"):
        assert d in DIRS, f"{d} not found among {DIRS}"


@pytest.mark.parametrize("rel", DIRS)
def test_renders_validates_and_passes_policies(rel, kvmod):
    objs = render(rel)
    assert objs, f"{rel} rendered nothing"
    errs = all_errors(objs)
    assert not errs, f"{rel}:\n" + "\n".join(errs)


def test_example_secrets_validate(kvmod):
    objs = example_objects()
    assert any(o["kind"] == "Secret" for o in objs)
    assert not check_schemas(objs)


def test_overlays_cover_what_they_promise(kvmod):
    drafter_env = lambda objs: drafter_containers(objs)[0][3]  # noqa: E731
    e3 = drafter_env(render("k8s/overlays/eagle3-llama"))
    assert e3["DRAFTER_METHOD"] == "eagle3" and "llama-3.1-8b" in e3["DRAFTER_MODEL"].lower()
    assert "Llama-3.1-8B" in e3["DRAFTER_TARGET_MODEL"]
    mon = render("k8s/overlays/monitoring")
    assert of_kind(mon, "ServiceMonitor") and of_kind(mon, "HorizontalPodAutoscaler")
    tw = render("k8s/overlays/target-wiring")
    assert any(is_target(t) for _, t in pods(tw)) and any(is_drafter(t) for _, t in pods(tw))
    # the target asks vLLM for the head and k that its drafters serve
    spec_args = [a for a in _target(tw)["spec"]["template"]["spec"]["containers"][0]["args"]
                 if a.startswith("--speculative-config=")]
    assert len(spec_args) == 1
    spec = json.loads(spec_args[0].split("=", 1)[1])
    served = drafter_env(tw)
    assert spec["model"] == served["DRAFTER_MODEL"] and spec["method"] == served["DRAFTER_METHOD"]
    assert spec["num_speculative_tokens"] == int(served.get("DRAFTER_NUM_SPECULATIVE_TOKENS", 3))
    mt = drafter_env(render("k8s/overlays/mtls"))
    for key in ("DRAFTER_TLS_CERT", "DRAFTER_TLS_KEY", "DRAFTER_TLS_CLIENT_CA",
                "DRAFTER_CURVE_SERVER_CERT", "DRAFTER_CURVE_CLIENTS_DIR"):
        assert key in mt
    assert "DRAFTER_TLS_CERT" not in drafter_env(render("k8s/base"))


# ---- negative tests: break one rendered object, the checks must say so.

def _one(objs, kind, pred=lambda o: True):
    return next(o for o in objs if o.get("kind") == kind and pred(o))


def _drafter(objs):
    return _one(objs, "Deployment", lambda o: is_drafter(o["spec"]["template"]))


def _target(objs):
    return _one(objs, "Deployment", lambda o: is_target(o["spec"]["template"]))


def _dc(objs):
    return _drafter(objs)["spec"]["template"]["spec"]["containers"][0]


def _cm(objs):
    name = _dc(objs)["envFrom"][0]["configMapRef"]["name"]
    return _one(objs, "ConfigMap", lambda o: o["metadata"]["name"] == name)


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


BASE, MON, TW, MTLS = ("k8s/base", "k8s/overlays/monitoring",
                       "k8s/overlays/target-wiring", "k8s/overlays/mtls")
NEGATIVE = [
    # (id, overlay, mutation, expected fragment of an error)
    ("schema-unknown-field", BASE, lambda o: _dc(o).update(imagePullPolicyy="Always"), "imagePullPolicyy"),
    ("schema-bad-type", BASE, lambda o: _set(_drafter(o), ["spec", "replicas"], "two"), "schema"),
    ("schema-unknown-kind", BASE, lambda o: _drafter(o).update(apiVersion="apps/v9"), "no schema"),
    ("crd-unknown-field", MON, lambda o: _one(o, "ServiceMonitor")["spec"].update(endpoint=[]), "CRD schema"),
    ("crd-missing-selector", MON, lambda o: _one(o, "ServiceMonitor")["spec"].pop("selector"), "CRD schema"),
    ("image-latest", BASE, lambda o: _dc(o).update(image="ghcr.io/drafter/drafter:latest"), "latest tag"),
    ("image-untagged", BASE, lambda o: _dc(o).update(image="ghcr.io/drafter/drafter"), "no tag"),
    ("no-memory-request", BASE, lambda o: _dc(o)["resources"]["requests"].pop("memory"), "requests.memory"),
    ("no-cpu-limit", TW, lambda o: _target(o)["spec"]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].pop("cpu"), "limits.cpu"),
    ("no-gpu", BASE, lambda o: _dc(o)["resources"]["limits"].pop("nvidia.com/gpu"), "nvidia.com/gpu"),
    ("no-readiness", BASE, lambda o: _dc(o).pop("readinessProbe"), "no readinessProbe"),
    ("no-startup", TW, lambda o: _target(o)["spec"]["template"]["spec"]["containers"][0]
     .pop("startupProbe"), "no startupProbe"),
    ("probe-http", BASE, lambda o: _dc(o).update(livenessProbe={"tcpSocket": {"port": 50052}}),
     "not a grpc health probe"),
    ("probe-main-port", BASE, lambda o: _set(_dc(o), ["readinessProbe", "grpc", "port"], 50051),
     "not the health port"),
    ("health-eq-grpc", BASE, lambda o: _cm(o)["data"].update(DRAFTER_HEALTH_PORT="50051"), "must be set and differ"),
    ("root", BASE, lambda o: _dc(o)["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    ("rw-rootfs", BASE, lambda o: _dc(o)["securityContext"].update(readOnlyRootFilesystem=False),
     "readOnlyRootFilesystem"),
    ("keep-caps", BASE, lambda o: _dc(o)["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
     "drop ALL"),
    ("escalation", BASE, lambda o: _dc(o)["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    ("no-seccomp", BASE, lambda o: (_dc(o)["securityContext"].pop("seccompProfile"),
                                    _drafter(o)["spec"]["template"]["spec"]["securityContext"]
                                    .pop("seccompProfile")), "seccompProfile"),
    ("sa-token", BASE, lambda o: _drafter(o)["spec"]["template"]["spec"]
     .update(automountServiceAccountToken=True), "automountServiceAccountToken"),
    ("service-links", BASE, lambda o: _drafter(o)["spec"]["template"]["spec"].pop("enableServiceLinks"),
     "enableServiceLinks"),
    ("short-grace", BASE, lambda o: _drafter(o)["spec"]["template"]["spec"]
     .update(terminationGracePeriodSeconds=10), "terminationGracePeriodSeconds"),
    ("no-prestop", BASE, lambda o: _dc(o).pop("lifecycle"), "no preStop"),
    ("pdb-selector", BASE, lambda o: _set(_one(o, "PodDisruptionBudget"),
                                          ["spec", "selector", "matchLabels"], {"app": "drafter"}),
     "no PodDisruptionBudget selects"),
    ("np-selector", BASE, lambda o: _set(_one(o, "NetworkPolicy"),
                                         ["spec", "podSelector", "matchLabels"], {"app": "drafter"}),
     "no NetworkPolicy podSelector"),
    ("np-open", BASE, lambda o: _one(o, "NetworkPolicy")["spec"]["ingress"][0].pop("from"),
     "admits every source"),
    ("np-any-pod", BASE, lambda o: _one(o, "NetworkPolicy")["spec"]["ingress"][0]
     .update({"from": [{"namespaceSelector": {}}]}), "open to every pod"),
    ("np-wrong-target", TW, lambda o: _set(_target(o)["spec"]["template"]["metadata"]["labels"],
                                           ["app.kubernetes.io/component"], "engine"),
     "does not admit target"),
    ("np-target-other-ns", TW, lambda o: _target(o)["metadata"].update(namespace="other"),
     "does not admit target"),
    ("np-no-scrape", BASE, lambda o: _one(o, "NetworkPolicy")["spec"]["ingress"].pop(1),
     "scrape"),
    ("svc-selector", BASE, lambda o: _set(_one(o, "Service"), ["spec", "selector"], {"app": "x"}),
     "matches no rendered pods"),
    ("svc-port-name", BASE, lambda o: _one(o, "Service")["spec"]["ports"][1].pop("name"), "has no name"),
    ("svc-not-headless", BASE, lambda o: _one(o, "Service")["spec"].pop("clusterIP"), "not headless"),
    ("svc-port-mismatch", BASE, lambda o: _cm(o)["data"].update(DRAFTER_ZMQ_PORT="5556"), "DRAFTER_ZMQ_PORT"),
    ("cm-missing", BASE, lambda o: _dc(o)["envFrom"][0]["configMapRef"].update(name="nope"),
     "envFrom ConfigMap 'nope' not found"),
    ("cm-key-missing", BASE, lambda o: _cm(o)["data"].pop("DRAFTER_METHOD"), "DRAFTER_METHOD missing"),
    ("cm-keyref", BASE, lambda o: _dc(o).update(env=[{"name": "X", "valueFrom": {"configMapKeyRef": {
        "name": _cm(o)["metadata"]["name"], "key": "NOPE"}}}]), "key 'NOPE'"),
    ("model-not-mounted", BASE, lambda o: _cm(o)["data"].update(DRAFTER_MODEL="/opt/models/head"),
     "DRAFTER_MODEL=/opt/models/head is under no volumeMount"),
    ("tmp-readonly", BASE, lambda o: next(m for m in _dc(o)["volumeMounts"] if m["name"] == "tmp")
     .update(readOnly=True), "HOME=/tmp is on a read-only mount"),
    ("pvc-missing", BASE, lambda o: o.remove(_one(o, "PersistentVolumeClaim")), "PVC"),
    ("secret-missing", MTLS, lambda o: _set(next(v for v in _drafter(o)["spec"]["template"]["spec"]["volumes"]
                                                 if v["name"] == "grpc-tls"), ["secret", "secretName"], "nope"),
     "Secret 'nope' not found"),
    ("secret-rw", MTLS, lambda o: next(m for m in _dc(o)["volumeMounts"] if m["name"] == "grpc-tls")
     .update(readOnly=False), "not mounted readOnly"),
    ("secret-file-missing", MTLS, lambda o: _cm(o)["data"].update(DRAFTER_TLS_KEY="/etc/drafter/tls/key.pem"),
     "provides no 'key.pem'"),
    ("target-endpoint-ns", TW, lambda o: _one(o, "ConfigMap", lambda c: "DRAFTER_ENDPOINTS" in c.get("data", {}))
     ["data"].update(DRAFTER_ENDPOINTS="drafter.default.svc.cluster.local:5555"), "names no rendered headless"),
    ("target-endpoint-port", TW, lambda o: _one(o, "ConfigMap", lambda c: "DRAFTER_ENDPOINTS" in c.get("data", {}))
     ["data"].update(DRAFTER_TRANSPORT="grpc"), "grpc port"),
    ("target-deadline", TW, lambda o: _one(o, "ConfigMap", lambda c: "DRAFTER_ENDPOINTS" in c.get("data", {}))
     ["data"].update(DRAFTER_DEADLINE_MS="0"), "DRAFTER_DEADLINE_MS"),
    ("hpa-target", MON, lambda o: _set(_one(o, "HorizontalPodAutoscaler"), ["spec", "scaleTargetRef", "name"], "x"),
     "is not rendered"),
    ("hpa-replicas", MON, lambda o: _drafter(o)["spec"].update(replicas=2), "still sets replicas"),
    ("sm-selector", MON, lambda o: _set(_one(o, "ServiceMonitor"), ["spec", "selector", "matchLabels"],
                                        {"app": "x"}), "matches no rendered Service"),
    ("sm-port", MON, lambda o: _set(_one(o, "ServiceMonitor")["spec"]["endpoints"][0], ["port"], "http"),
     "no port named 'http'"),
]


@pytest.mark.parametrize("rel,mutate,expected", [n[1:] for n in NEGATIVE], ids=[n[0] for n in NEGATIVE])
def test_checks_catch_broken_manifests(rel, mutate, expected, kvmod):
    objs = render(rel)
    assert not all_errors(objs)  # the unbroken rendering passes...
    mutate(objs)
    errs = all_errors(objs)  # ...and the broken one is named
    assert any(expected in e for e in errs), f"expected {expected!r} in:\n" + "\n".join(errs)
