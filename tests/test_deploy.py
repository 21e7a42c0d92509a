"""deploy/: the Kustomize overlays render (`kubectl kustomize`), every rendered document validates
offline (KubeRay's CRD for the RayCluster, Kubernetes' own schemas for the core kinds and for the
pod templates inside the RayCluster), and what they say is consistent: Ray token authentication,
private Ray ports, placement, /dev/shm, monitoring, and the CLI flags the pods run."""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from router.cli import build_parser
from router.launcher import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay-crds"
OVERLAYS = ("cpu", "gpu")
KUBERNETES = "1.32"  # the schema version kubernetes-validate checks the core kinds against
# Ray ports every node fixes (so that the NetworkPolicy can name them), and those only the head has.
NODE_PORTS = ("node-manager-port", "object-manager-port", "runtime-env-agent-port", "dashboard-agent-grpc-port",
              "dashboard-agent-listen-port", "metrics-export-port")
HEAD_PORTS = ("port", "ray-client-server-port", "dashboard-port")
# The prometheus-operator's PodMonitor CRD is not available offline: the fields deploy/ uses, strictly.
POD_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": {"type": "object"}}},
                     "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "required": ["port"],
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                        "authorization": {
                                            "type": "object", "additionalProperties": False,
                                            "properties": {"type": {"type": "string"},
                                                           "credentials": {"type": "object", "required": ["key"],
                                                                           "additionalProperties": False,
                                                                           "properties": {"name": {"type": "string"},
                                                                                          "key": {"type": "string"}}}}}}}}}}}}


@functools.cache
def rendered(overlay: str) -> dict[str, dict]:
    """The overlay as `kubectl kustomize` renders it: {kind/name: document}."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl absent: it renders the Kustomize overlays")
    done = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(done.stdout)}


def cluster_of(overlay: str) -> dict:
    return rendered(overlay)["RayCluster/pdserve"]


@functools.cache
def raycluster_schema() -> dict:
    if not (CRDS / "ray.io_rayclusters.yaml").is_file():
        pytest.skip("../shared/kuberay-crds absent (a user's clone lacks ../shared)")
    crd = yaml.safe_load((CRDS / "ray.io_rayclusters.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def pods(cluster: dict) -> dict[str, dict]:
    """{"head" or group name: group spec}."""
    return {"head": cluster["spec"]["headGroupSpec"]} | {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def router_argv(cluster: dict, group: str = "head") -> list[str]:
    """The `pdserve` command the head (or the worker group `group`) runs after Ray starts."""
    command = pods(cluster)[group]["template"]["spec"]["containers"][0]["lifecycle"]["postStart"]
    script = command["exec"]["command"][-1]
    words = shlex.split(re.search(r"pdserve [^;>']+", script).group(0))
    assert words[0] == "pdserve"
    return words[1:]


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity (512Mi, 16Gi) or a plain byte count."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text).groups()
    return int(number) * units.get(unit, 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_document_validates(overlay):
    import kubernetes_validate

    docs = rendered(overlay)
    assert sorted(docs) == ["ConfigMap/pdserve-grafana-dashboard", "NetworkPolicy/pdserve-ray-internal",
                            "NetworkPolicy/pdserve-router-api", "PodMonitor/pdserve-routers", "RayCluster/pdserve",
                            "Service/pdserve-router"]
    for doc in docs.values():
        if doc["kind"] == "RayCluster":
            jsonschema.validate(doc, raycluster_schema())
            for group, pod in pods(doc).items():  # the pod templates, against Kubernetes' own schema
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group},
                            "template": pod["template"]}
                kubernetes_validate.validate(template, KUBERNETES, strict=True)
        elif doc["kind"] == "PodMonitor":
            jsonschema.validate(doc, POD_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validation_has_teeth():
    import kubernetes_validate

    policy = json.loads(json.dumps(rendered("gpu")["NetworkPolicy/pdserve-ray-internal"]))
    policy["spec"]["ingress"][0]["ports"][0]["prot"] = "TCP"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, KUBERNETES, strict=True)
    cluster = json.loads(json.dumps(cluster_of("gpu")))
    del cluster["spec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, raycluster_schema())
    cluster = json.loads(json.dumps(cluster_of("gpu")))
    cluster["spec"]["authOptions"]["mode"] = "password"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, raycluster_schema())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_token_authentication_for_every_ray_process(overlay):
    """KubeRay puts RAY_AUTH_MODE=token and the Secret's token into every Ray container, so the head,
    both worker groups and every router join with it; no container overrides either."""
    cluster = cluster_of(overlay)
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "pdserve-ray-token"}
    for group, pod in pods(cluster).items():
        for container in pod["template"]["spec"]["containers"]:
            assert not {e["name"] for e in container.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_clusters_pods_reach_rays_ports_and_clients_only_the_routers(overlay):
    docs = rendered(overlay)
    cluster = docs["RayCluster/pdserve"]
    own = {"ray.io/cluster": cluster["metadata"]["name"]}  # KubeRay's label on every pod of the cluster
    wanted: set[tuple[int, int | None]] = set()
    for group, pod in pods(cluster).items():
        params = pod["rayStartParams"]
        names = NODE_PORTS + (HEAD_PORTS if group == "head" else ())
        assert set(names) <= set(params), (group, set(names) - set(params))  # no port left to chance
        wanted |= {(int(params[name]), None) for name in names}
        wanted.add((int(params["min-worker-port"]), int(params["max-worker-port"])))
    internal = docs["NetworkPolicy/pdserve-ray-internal"]["spec"]
    assert internal["podSelector"] == {"matchLabels": own} and internal["policyTypes"] == ["Ingress"]
    (rule,) = internal["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": own}}]
    assert {(p["port"], p.get("endPort")) for p in rule["ports"]} == wanted
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    args = build_parser().parse_args(router_argv(cluster))
    api = docs["NetworkPolicy/pdserve-router-api"]["spec"]
    router_labels = own | {"app.kubernetes.io/component": "router"}
    assert api["podSelector"] == {"matchLabels": router_labels}
    assert api["ingress"] == [{"ports": [{"protocol": "TCP", "port": args.port}]}]
    service = docs["Service/pdserve-router"]["spec"]
    assert [p["targetPort"] for p in service["ports"]] == [args.port] and service["selector"] == router_labels
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_placement_gpus_shared_memory_and_the_pod_monitor(overlay):
    docs = rendered(overlay)
    cluster = docs["RayCluster/pdserve"]
    for group, pod in pods(cluster).items():
        spec = pod["template"]["spec"]
        (container,) = spec["containers"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        gpus = limits.get("nvidia.com/gpu")
        assert requests.get("nvidia.com/gpu") == gpus, group  # GPU requests equal limits
        if group in ("head", "router"):  # CPU nodes only: the CPU pool, never a GPU node
            assert gpus is None and spec["nodeSelector"] == {"pdserve/pool": "cpu"}
            (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"]
            assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "NotIn",
                                                 "values": ["true"]}]
            assert {"key": "pdserve/pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"} in \
                spec["tolerations"]
        elif overlay == "gpu":  # prefill and decode on their GPU pools, one GPU per tensor-parallel rank
            args = build_parser().parse_args(router_argv(cluster))
            assert int(gpus) == getattr(args, f"{group}_tensor_parallel_size"), group
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            product = {"prefill": "NVIDIA-H100-80GB-HBM3", "decode": "NVIDIA-H200"}[group]
            assert spec["nodeSelector"] == {"nvidia.com/gpu.product": product}
        else:
            assert gpus is None and spec["nodeSelector"] == {"pdserve/pool": "cpu"}
        # /dev/shm: a memory volume at least as large as the node's object store.
        (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == shm["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        assert quantity(volume["emptyDir"]["sizeLimit"]) >= int(pod["rayStartParams"]["object-store-memory"]), group
        assert quantity(volume["emptyDir"]["sizeLimit"]) <= quantity(limits["memory"]), group
    monitor = docs["PodMonitor/pdserve-routers"]["spec"]
    assert monitor["selector"] == {"matchLabels": docs["Service/pdserve-router"]["spec"]["selector"]}
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for group in ("head", "router"):  # the port it names is the routers' API port
        (port,) = [p for p in pods(cluster)[group]["template"]["spec"]["containers"][0]["ports"]
                   if p["name"] == endpoint["port"]]
        assert port["containerPort"] == build_parser().parse_args(router_argv(cluster)).port
    key = pods(cluster)["head"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    if overlay == "gpu":  # the key is required, and Prometheus sends it
        assert key["optional"] is False
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": key["name"], "key": key["key"]}}
    else:
        assert key["optional"] is True and "authorization" not in endpoint


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_groups_advertise_what_the_router_command_selects(overlay):
    cluster = cluster_of(overlay)
    args = build_parser().parse_args(router_argv(cluster))
    groups = pods(cluster)
    spec = ClusterSpec(model="/models/llm", num_prefill=args.prefill, num_decode=args.decode)
    assert groups["prefill"]["resources"] == {spec.prefill_resource: "1"}
    assert groups["decode"]["resources"] == {spec.decode_resource: "1"}
    assert args.prefill_labels.items() <= groups["prefill"]["labels"].items()
    assert args.decode_labels.items() <= groups["decode"]["labels"].items()
    assert (groups["prefill"]["replicas"], groups["decode"]["replicas"]) == (args.prefill, args.decode)
    assert args.address == "auto" and args.host == "0.0.0.0"
    assert (args.request_timeout, args.max_pending) == (600.0, 1024)  # a cluster bounds what it accepts
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"
    if overlay == "gpu":
        assert (args.prefill, args.decode, args.prefill_quantization, args.decode_quantization) == (2, 4, None, "int8")
        assert (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) == (2, 1)
    else:
        assert (args.prefill, args.decode, args.model) == (1, 1, "/opt/pdserve/models/tiny")
        dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
        assert f"pdserve make-model --preset tiny --out {args.model}" in dockerfile  # the image carries it


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_group_attaches_routers_like_the_heads(overlay):
    cluster = cluster_of(overlay)
    head, extra = (build_parser().parse_args(argv) for argv in (router_argv(cluster), router_argv(cluster, "router")))
    assert extra.command == "router" and extra.address == "auto" and extra.wait >= 600
    assert head.command == "serve"
    for flag in ("host", "port", "served_model_name", "request_timeout", "max_pending", "api_key",
                 "local_prefill_tokens", "model"):
        assert getattr(extra, flag) == getattr(head, flag), flag
    router = pods(cluster)["router"]
    # No model worker can land there: it offers none of the role resources or labels they select.
    assert "resources" not in router and "labels" not in router
    container = router["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": extra.port}
    script = container["lifecycle"]["postStart"]["exec"]["command"][-1]
    assert "until pdserve router" in script  # started again whenever it exits


def test_the_documented_scale_down_names_the_emptied_pods():
    """deploy/README.md's scale-down patch applies to the rendered cluster and still validates."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    (patch,) = re.findall(r"kubectl patch raycluster pdserve --type json -p '([^']+)'", readme)
    cluster = json.loads(json.dumps(cluster_of("gpu")))
    for op in json.loads(patch):
        *parents, last = op["path"].strip("/").split("/")
        target = cluster
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "test":
            assert target[last] == op["value"], op
        else:
            assert op["op"] in ("add", "replace"), op
            target[last] = op["value"]
    decode = pods(cluster)["decode"]
    assert decode["replicas"] == 3 and decode["scaleStrategy"]["workersToDelete"] == ["pdserve-decode-worker-x7k2p"]
    jsonschema.validate(cluster, raycluster_schema())


def test_grafana_dashboard_queries_only_series_the_router_exports():
    from services.metrics import METRICS

    dashboard = json.loads((ROOT / "deploy" / "base" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", e)}
    exported = set(METRICS.registry._names_to_collectors)
    assert len(dashboard["panels"]) == 13 and used and used <= exported, used - exported
    assert json.loads(rendered("gpu")["ConfigMap/pdserve-grafana-dashboard"]["data"]["grafana-dashboard.json"]) \
        == dashboard
