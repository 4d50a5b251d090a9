"""deploy/kubernetes/mtpwrap.yaml: valid for the Kubernetes API (kubernetes-validate, strict), its
ConfigMap accepted by mtpwrap's own config loader and front, and its probes and grace period
consistent with that configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

MANIFEST = REPO / "deploy" / "kubernetes" / "mtpwrap.yaml"


def documents() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


@pytest.mark.parametrize("version", ["1.28.0", "1.32.0"])
def test_manifest_is_valid_kubernetes(version: str) -> None:
    import kubernetes_validate

    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the field path


def test_kubernetes_validate_catches_a_wrong_field() -> None:
    import kubernetes_validate

    sts = documents()["StatefulSet"]
    sts["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, "1.32.0", strict=True)


def _settings(tmp_path: Path) -> Any:
    from mtpwrap import settings
    from mtpwrap.proxy_policy import ProxyConfig

    data = yaml.safe_load(documents()["ConfigMap"]["data"]["mtpwrap.yaml"])
    keys = tmp_path / "api-keys"
    keys.write_text("a-client-key-0001\n")
    data["proxy"]["api_keys_file"] = str(keys)
    cfg = tmp_path / "mtpwrap.yaml"
    cfg.write_text(yaml.safe_dump(data))
    s = settings.load_settings({}, env={}, config=cfg)
    proxy = ProxyConfig.from_mapping({"listen_host": s.host, **s.proxy,
                                      "api_keys": list(s.api_keys)}, str(cfg))
    return s, proxy


def test_probes_and_grace_period_match_the_config(tmp_path: Path) -> None:
    from mtpwrap.proxy_policy import derive_allowed_hosts

    s, proxy = _settings(tmp_path)
    pod = documents()["StatefulSet"]["spec"]["template"]["spec"]
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
