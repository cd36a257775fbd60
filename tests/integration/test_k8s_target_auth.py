"""k8s/overlays/target-wiring under auth (issue 19 item 3): the target's client auth settings.

The overlay runs its drafters with components/mtls (CURVE on ZMQ), so its target must present a
CURVE client certificate.  check_target_auth, on the rendered objects (tests.integration.
test_k8s_manifests renders them with `kubectl kustomize`):
* every DRAFTER_* variable of a target container is one that drafter_vllm's PluginSettings reads
  (found by recording what PluginSettings.from_env looks up, so renaming either side fails);
* where its drafters require CURVE (DRAFTER_CURVE_SERVER_CERT) and it speaks zmq, both
  DRAFTER_CURVE_SERVER_PUBLIC and DRAFTER_CURVE_CLIENT_SECRET are set;
* each auth file lies under a read-only Secret mount whose Secret (rendered, or in a
  *.example.yaml) provides it.
Then the target's environment, its files replaced by real zmq.auth certificates, is accepted by
PluginSettings.from_env and gives the zmq client its CurveConfig.  Negative tests break one
rendered object each.
"""

from __future__ import annotations

import pytest

from tests.integration.test_k8s_manifests import (KUBECTL, clients, container_env, drafter_containers, example_objects,
                                                  ident, ns_of, of_kind, render)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see tests/integration/test_k8s_manifests)")

OVERLAY = "k8s/overlays/target-wiring"
AUTH_PATHS = {"zmq": ("DRAFTER_CURVE_SERVER_PUBLIC", "DRAFTER_CURVE_CLIENT_SECRET"),
              "grpc": ("DRAFTER_TLS_ROOT_CA", "DRAFTER_TLS_CERT", "DRAFTER_TLS_KEY")}


class _Recorder(dict):
    """An environment that remembers every name looked up in it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)


def plugin_env_names() -> set[str]:
    """The DRAFTER_* names drafter_vllm's settings read from the environment."""
    from drafter_vllm.settings import PluginSettings

    env = _Recorder()
    PluginSettings.from_env(env)
    return {k for k in env.asked if k.startswith("DRAFTER_")}


def _file_source(w: dict, tpl: dict, c: dict, path: str, secrets: list[dict]) -> str | None:
    """Why path is not a file from a read-only Secret mount of the container (None when it is)."""
    mounts = [m for m in c.get("volumeMounts") or [] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return "is under no volumeMount"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    vol = next((v for v in tpl["spec"].get("volumes") or [] if v["name"] == m["name"]), {})
    sec = vol.get("secret")
    if sec is None or m.get("readOnly") is not True:
        return f"is not on a read-only Secret mount ({m['name']})"
    rel = path[len(m["mountPath"].rstrip("/")) + 1:]
    items = sec.get("items")
    data = next(({**(s.get("data") or {}), **(s.get("stringData") or {})} for s in secrets
                 if s["metadata"]["name"] == sec["secretName"] and ns_of(s) == ns_of(w)), None)
    if data is None:
        return f"needs Secret {sec['secretName']!r}, rendered nowhere and in no *.example.yaml"
    keys = {i["path"]: i["key"] for i in items} if items else {k: k for k in data}
    if rel not in keys or keys[rel] not in data:
        return f"Secret {sec['secretName']!r} provides no {rel!r}"
    return None


def check_target_auth(objs, examples=()) -> list[str]:
    errs = []
    known = plugin_env_names()
    secrets = of_kind(objs, "Secret") + [o for o in examples if o.get("kind") == "Secret"]
    curve_on = any("DRAFTER_CURVE_SERVER_CERT" in env for *_, env in drafter_containers(objs))
    tls_on = any("DRAFTER_TLS_CLIENT_CA" in env for *_, env in drafter_containers(objs))
    for w, tpl in clients(objs):
        for c in tpl["spec"]["containers"]:
            n, env = f"{ident(w)}/{c['name']}", container_env(c, objs, ns_of(w))
            for name in sorted(k for k in env if k.startswith("DRAFTER_") and k not in known):
                errs.append(f"{n}: {name} is no setting drafter_vllm reads")
            transport = env.get("DRAFTER_TRANSPORT", "zmq")
            if (transport == "zmq" and curve_on) or (transport == "grpc" and tls_on):
                for name in AUTH_PATHS[transport]:
                    if not env.get(name):
                        errs.append(f"{n}: its drafters require auth on {transport} but {name} is not set")
            for name in (k for ks in AUTH_PATHS.values() for k in ks if env.get(k)):
                why = _file_source(w, tpl, c, env[name], secrets)
                if why:
                    errs.append(f"{n}: {name}={env[name]} {why}")
    return errs


def _target_configmap(objs) -> dict:
    return next(o for o in of_kind(objs, "ConfigMap") if "DRAFTER_ENDPOINTS" in (o.get("data") or {}))


def test_the_env_names_are_what_the_plugin_reads():
    names = plugin_env_names()
    assert {"DRAFTER_ENDPOINTS", "DRAFTER_TRANSPORT", *AUTH_PATHS["zmq"], *AUTH_PATHS["grpc"]} <= names, names


def test_target_wiring_presents_its_curve_client_certificate():
    objs = render(OVERLAY)
    assert not check_target_auth(objs, example_objects())
    [(w, tpl)] = clients(objs)
    env = container_env(tpl["spec"]["containers"][0], objs, ns_of(w))
    assert env["DRAFTER_TRANSPORT"] == "zmq" and all(env.get(k) for k in AUTH_PATHS["zmq"])
    assert any("DRAFTER_CURVE_CLIENTS_DIR" in e for *_, e in drafter_containers(objs)), "the drafters require CURVE"


def test_the_plugin_accepts_the_targets_settings(tmp_path):
    """The rendered target environment, its files written as real zmq.auth certificates under a temp
    root: PluginSettings.from_env takes it and hands the zmq client a CurveConfig with those keys."""
    import zmq.auth

    from drafter_vllm.settings import PluginSettings
    from tests.support.auth_material import curve_certificates

    objs = render(OVERLAY)
    [(w, tpl)] = clients(objs)
    env = dict(container_env(tpl["spec"]["containers"][0], objs, ns_of(w)))
    keys = curve_certificates(tmp_path)
    files = {"DRAFTER_CURVE_SERVER_PUBLIC": keys["server"][0], "DRAFTER_CURVE_CLIENT_SECRET": keys["client"][1]}
    for name, src in files.items():
        dst = tmp_path / "root" / env[name].lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(src, "rb").read())
        env[name] = str(dst)
    s = PluginSettings.from_env(env)
    assert s.transport == "zmq" and s.endpoints
    server, public, secret = s.curve_config().keys()
    assert server == zmq.auth.load_certificate(keys["server"][0])[0]
    assert (public, secret) == zmq.auth.load_certificate(keys["client"][1])


@pytest.mark.parametrize("fault, word", [
    ("rename", "DRAFTER_CURVE_CLIENT_KEY is no setting drafter_vllm reads"),
    ("drop", "DRAFTER_CURVE_CLIENT_SECRET is not set"),
    ("unmount", "is under no volumeMount"),
    ("secret-key", "provides no 'client.key_secret'"),
])
def test_a_broken_target_auth_is_named(fault, word):
    objs = render(OVERLAY)
    cm = _target_configmap(objs)["data"]
    [(w, tpl)] = clients(objs)
    c = tpl["spec"]["containers"][0]
    if fault == "rename":
        cm["DRAFTER_CURVE_CLIENT_KEY"] = cm.pop("DRAFTER_CURVE_CLIENT_SECRET")
    elif fault == "drop":
        del cm["DRAFTER_CURVE_CLIENT_SECRET"]
    elif fault == "unmount":
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "drafter-client-curve"]
    else:
        vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "drafter-client-curve")
        vol["secret"]["items"][0]["path"] = "other.key_secret"
    errs = check_target_auth(objs, example_objects())
    assert any(word in e for e in errs), errs
