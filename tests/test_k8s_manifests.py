"""jetson/k8s renders with `kubectl kustomize` and every rendered object validates against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail); the InferencePool, a CRD those schemas do not cover, is checked
against its v1 API fields by hand. Also the wiring the schemas cannot see: probes on /health, the drain fitting
inside terminationGracePeriodSeconds, the ConfigMap being a config `serve --config` reads, the pool selecting the
serving pods and pointing at the picker's Service."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = os.path.join(os.path.dirname(__file__), "..", "jetson", "k8s")
KUBE_VERSION = "1.31"  # k3s releases for JetPack 6 boards are 1.28+; strict validation at a recent minor
CRD_KINDS = {"InferencePool"}  # Gateway API Inference Extension: not in the Kubernetes schemas


def _kubectl() -> str:
    path = shutil.which("kubectl") or ("/usr/bin/kubectl" if os.access("/usr/bin/kubectl", os.X_OK) else None)
    if path is None:
        pytest.skip("kubectl is not installed here: `kubectl kustomize jetson/k8s` cannot be checked")
    return path


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", K8S], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def test_renders_every_object(rendered):
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == sorted(["Namespace", "ConfigMap", "ConfigMap", "DaemonSet", "Service", "Service", "Deployment",
                            "ServiceAccount", "Role", "RoleBinding", "InferencePool"])
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {"oval-edge"}


def test_rendered_objects_validate_against_kubernetes_schemas(rendered):
    checked = 0
    for doc in rendered:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    assert checked == len(rendered) - 1
    # The validator does reject what is wrong (so a pass above means something): an unknown field, a bad type.
    daemonset = copy.deepcopy(_one(rendered, "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBE_VERSION, strict=True)
    daemonset = copy.deepcopy(_one(rendered, "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "sixty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBE_VERSION, strict=True)


def _arg(args: list[str], flag: str) -> str | None:
    for arg in args:
        if arg == flag:
            return ""
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def test_daemonset_serves_one_pod_per_labelled_board(rendered):
    spec = _one(rendered, "DaemonSet")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"oval-edge.io/serve": "true"}
    (container,) = spec["containers"]
    with open(os.path.join(os.path.dirname(__file__), "..", "Dockerfile.l4t"), encoding="utf-8") as handle:
        assert f"-t {container['image']} ." in handle.read()  # the tag the Dockerfile's build line gives
    args = container["args"]
    assert _arg(args, "--config") == "/config/oval-edge.toml" and _arg(args, "--metrics-public") == ""
    for probe in ("readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a long load is not a failure
    # The drain fits: preStop sleep + --shutdown-grace + uvicorn's 10 s connection close < the kubelet's SIGKILL.
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = float(_arg(args, "--shutdown-grace"))
    assert spec["terminationGracePeriodSeconds"] > sleep + grace + 10


def test_configmap_is_a_config_serve_reads(rendered, tmp_path):
    from oval_edge.runtime.config_file import load_config_file

    spec = _one(rendered, "DaemonSet")["spec"]["template"]["spec"]
    config_volume = next(v for v in spec["volumes"] if v["name"] == "config")
    configmap = _one(rendered, "ConfigMap", config_volume["configMap"]["name"])  # the hashed generated name
    path = tmp_path / "oval-edge.toml"
    path.write_text(configmap["data"]["oval-edge.toml"], encoding="utf-8")
    sections = load_config_file(str(path))
    assert sections["oval"]["page_size"] in (16, 32, 64, 128, 256) and sections["server"]["max_batch"] >= 1


def test_inference_pool_matches_the_v1_api_and_the_pods(rendered):
    pool = _one(rendered, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert set(spec["selector"]) == {"matchLabels"}
    labels = _one(rendered, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (port,) = spec["targetPorts"]  # the v1 API allows exactly one
    container = _one(rendered, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert port == {"number": container["ports"][0]["containerPort"]}
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "portNumber", "failureMode"}
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    service = _one(rendered, "Service", ref["name"])
    assert ref["portNumber"] in [p["port"] for p in service["spec"]["ports"]]
    picker = _one(rendered, "Deployment", "oval-edge-epp")["spec"]["template"]
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    args = picker["spec"]["containers"][0]["args"]
    assert _arg(args, "--pool-name") == pool["metadata"]["name"]
    assert _arg(args, "--pool-namespace") == pool["metadata"]["namespace"]


def test_picker_config_reads_our_pods(rendered):
    picker = _one(rendered, "Deployment", "oval-edge-epp")["spec"]["template"]["spec"]
    volume = next(v for v in picker["volumes"] if v["name"] == "config")
    config_file = os.path.basename(_arg(picker["containers"][0]["args"], "--config-file"))
    config = yaml.safe_load(_one(rendered, "ConfigMap", volume["configMap"]["name"])["data"][config_file])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["name"]: p for p in config["plugins"]}
    refs = [r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["data"]["sources"]]
    refs += [e["pluginRef"] for s in config["data"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins), f"unknown pluginRef: {set(refs) - set(plugins)}"
    extractor = plugins["model-server-protocol-metrics"]["parameters"]
    engine_label = extractor["engineLabelKey"]
    pod_labels = _one(rendered, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[engine_label] in [e["name"] for e in extractor["engineConfigs"]]
    # The prefix model hashes in blocks of the pods' page size (the plan's page_size in the ConfigMap).
    toml = _one(rendered, "ConfigMap", next(v for v in _one(rendered, "DaemonSet")["spec"]["template"]["spec"][
        "volumes"] if v["name"] == "config")["configMap"]["name"])["data"]["oval-edge.toml"]
    page_size = int(re.search(r"^page_size = (\d+)$", toml, re.M).group(1))
    assert plugins["prefix-cache-scorer"]["parameters"]["blockSize"] == page_size
