"""deploy/kubernetes/mtpwrap.yaml: valid for the Kubernetes API (kubernetes-validate, strict; the
ServiceMonitor against the prometheus-operator CRD's schema), its ConfigMap accepted by mtpwrap's
own config loader and front, its probes and grace period consistent with that configuration,
and its selectors, ports and profiles pointing at what exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO

MANIFEST = REPO / "deploy" / "kubernetes" / "mtpwrap.yaml"
SERVICE_MONITOR_SCHEMA = REPO / "tests" / "data" / "servicemonitor-v1.schema.json"


def all_documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def documents() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in all_documents()}


def deployments() -> list[dict[str, Any]]:
    return [d for d in all_documents() if d["kind"] == "Deployment"]


@pytest.mark.parametrize("version", ["1.28.0", "1.32.0"])
def test_manifest_is_valid_kubernetes(version: str) -> None:
    import kubernetes_validate

    for doc in all_documents():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD's kind: the next test
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the field path


def test_service_monitor_is_valid_for_its_crd() -> None:
    import jsonschema

    schema = json.loads(SERVICE_MONITOR_SCHEMA.read_text())
    monitor = documents()["ServiceMonitor"]
    jsonschema.validate(monitor, schema)
    for path, value in ((("spec", "endpoints", 0, "intervl"), "15s"),
                        (("spec", "endpoints", 0, "interval"), "15 seconds"),
                        (("spec", "endpoints", 0, "relabelings", 0, "action"), "rename")):
        bad = json.loads(json.dumps(monitor))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_kubernetes_validate_catches_a_wrong_field() -> None:
    import kubernetes_validate

    dep = deployments()[0]
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, "1.32.0", strict=True)


def test_selectors_ports_and_profiles_point_at_what_exists() -> None:
    from mtpwrap.decide import profiles

    docs = documents()
    service, monitor, pdb = docs["Service"], docs["ServiceMonitor"], docs["PodDisruptionBudget"]
    seen = set()
    for dep in deployments():
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for selector in (service["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
            assert selector.items() <= labels.items(), dep["metadata"]["name"]
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        profile = c["command"][c["command"].index("--profile") + 1]
        profiles.load_profile(profile)  # a shipped profile
        assert labels["mtpwrap.io/profile"] == profile
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU
        seen.add(profile)
    assert len(seen) == len(deployments())  # one Deployment per profile
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    # The shipped rules and dashboard group by `node`.
    targets = {r["targetLabel"] for e in monitor["spec"]["endpoints"] for r in e["relabelings"]}
    assert "node" in targets


def _settings(tmp_path: Path) -> Any:
    from mtpwrap.config import settings
    from mtpwrap.config.objects import ProxyConfig

    data = yaml.safe_load(documents()["ConfigMap"]["data"]["mtpwrap.yaml"])
    keys = tmp_path / "api-keys"
    keys.write_text("a-client-key-0001\n")
    data["api_key_file"] = str(keys)
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text(yaml.safe_dump(data))
    s = settings.load_settings({}, env={}, config=cfg)
    proxy = ProxyConfig.from_mapping({"listen_host": s.host, **s.proxy,
                                      "api_keys": list(s.api_keys)}, str(cfg))
    return s, proxy


def test_probes_and_grace_period_match_the_config(tmp_path: Path) -> None:
    s, proxy = _settings(tmp_path)
    for dep in deployments():
        check_pod(dep["spec"]["template"]["spec"], s, proxy)


def check_pod(pod: dict[str, Any], s: Any, proxy: Any) -> None:
    from mtpwrap.front.access import derive_allowed_hosts

    (c,) = pod["containers"]
    assert c["ports"][0]["containerPort"] == s.port
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/readyz"
    allowed = derive_allowed_hosts(proxy)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        (host,) = [h["value"] for h in c[probe]["httpGet"]["httpHeaders"] if h["name"] == "Host"]
        assert allowed is None or host in allowed, f"{probe}: the front answers Host {host} 421"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    needed = pre_stop + s.drain_s + s.supervisor["stop_grace_s"]
    assert pod["terminationGracePeriodSeconds"] > needed  # SIGKILL never cuts the drain short
    assert c["command"][-1] == "/etc/mtpwrap/mtpwrap.yaml"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= s.ready_timeout_s > 0
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    model_dir = str(Path(s.model).parent) if s.model else ""
    assert "persistentVolumeClaim" in volumes[mounts[model_dir]]  # the model on a volume
    # the document store on the volume every pod shares, writable
    store = volumes[mounts[s.persist["dir"]]]["persistentVolumeClaim"]
    assert store["claimName"] == "mtpwrap-documents" and not store.get("readOnly")
    shipped = yaml.safe_load(documents()["ConfigMap"]["data"]["mtpwrap.yaml"])
    keys_dir = str(Path(shipped["api_key_file"]).parent)
    assert volumes[mounts[keys_dir]]["secret"]["secretName"]  # the keys from a Secret
