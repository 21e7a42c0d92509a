"""deploy/ manifests: valid against KubeRay's real CRD schema, and consistent with the CLI."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from router.cli import build_parser
from router.launcher import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay-crds"


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / name).read_text())


@functools.cache
def raycluster_schema() -> dict:
    if not (CRDS / "ray.io_rayclusters.yaml").is_file():
        pytest.skip("../shared/kuberay-crds absent (a user's clone lacks ../shared)")
    crd = yaml.safe_load((CRDS / "ray.io_rayclusters.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def router_argv(cluster: dict, group: str | None = None) -> list[str]:
    """The `pdserve` command the head (or the worker group `group`) runs after Ray starts."""
    pod = cluster["spec"]["headGroupSpec"] if group is None else \
        {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}[group]
    command = pod["template"]["spec"]["containers"][0]["lifecycle"]["postStart"]
    script = command["exec"]["command"][-1]
    words = shlex.split(re.search(r"pdserve [^;>']+", script).group(0))
    assert words[0] == "pdserve"
    return words[1:]


def test_raycluster_matches_the_kuberay_schema():
    cluster = load("raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    jsonschema.validate(cluster, raycluster_schema())
    with pytest.raises(jsonschema.ValidationError):  # the check has teeth: a required field missing
        broken = yaml.safe_load((ROOT / "deploy" / "raycluster.yaml").read_text())
        del broken["spec"]["workerGroupSpecs"][0]["groupName"]
        jsonschema.validate(broken, raycluster_schema())


def test_groups_advertise_what_the_router_command_selects():
    cluster = load("raycluster.yaml")
    args = build_parser().parse_args(router_argv(cluster))
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    spec = ClusterSpec(model="/models/llm", num_prefill=args.prefill, num_decode=args.decode)
    assert groups["prefill"]["resources"] == {spec.prefill_resource: "1"}
    assert groups["decode"]["resources"] == {spec.decode_resource: "1"}
    assert args.prefill_labels.items() <= groups["prefill"]["labels"].items()
    assert args.decode_labels.items() <= groups["decode"]["labels"].items()
    assert groups["prefill"]["replicas"] >= args.prefill and groups["decode"]["replicas"] >= args.decode
    assert args.address == "auto" and args.host == "0.0.0.0"
    assert (args.request_timeout, args.max_pending) == (600.0, 1024)  # a cluster bounds what it accepts
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert head["dashboard-host"] == "127.0.0.1" and head["num-cpus"] == "0"


def test_router_service_exposes_only_the_routers_port():
    cluster, service = load("raycluster.yaml"), load("router-service.yaml")
    args = build_parser().parse_args(router_argv(cluster))
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [args.port]
    assert service["spec"]["selector"] == {"ray.io/cluster": "pdserve", "app.kubernetes.io/component": "router"}
    selected = [name for name, pod in [("head", cluster["spec"]["headGroupSpec"])]
                + [(g["groupName"], g) for g in cluster["spec"]["workerGroupSpecs"]]
                if pod["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]
    assert selected == ["head", "router"]  # the router pods, never a model worker's


def test_the_router_group_attaches_routers_like_the_heads():
    cluster = load("raycluster.yaml")
    head, extra = (build_parser().parse_args(argv) for argv in (router_argv(cluster), router_argv(cluster, "router")))
    assert extra.command == "router" and extra.address == "auto" and extra.wait >= 600
    assert head.command == "serve"
    for flag in ("host", "port", "served_model_name", "request_timeout", "max_pending", "api_key",
                 "local_prefill_tokens"):
        assert getattr(extra, flag) == getattr(head, flag), flag
    assert extra.model == head.model
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    router = groups["router"]
    # No model worker can land there: it offers none of the role resources or labels they select,
    # nor a GPU.
    assert "resources" not in router and "labels" not in router
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in router["template"]["spec"]["containers"])
    assert router["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/health",
                                                                                         "port": extra.port}
    script = router["template"]["spec"]["containers"][0]["lifecycle"]["postStart"]["exec"]["command"][-1]
    assert "until pdserve router" in script  # started again whenever it exits


def test_grafana_dashboard_queries_only_series_the_router_exports():
    import json
    import re

    from services.metrics import METRICS

    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", e)}
    exported = set(METRICS.registry._names_to_collectors)
    assert len(dashboard["panels"]) == 13 and used and used <= exported, used - exported
