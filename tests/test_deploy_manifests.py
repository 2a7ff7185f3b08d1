"""The deployment files parse, fit the Kubernetes API, pass vLLM's own `vllm serve` parser and
name only metrics vLLM defines. No cluster, no server, no network."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_peagle import monitor
from vllm_peagle.config import MAX_SPECULATIVE_TOKENS

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "peagle-alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "peagle-dashboard.json"
PRODUCTION_STACK_VALUES = K8S / "production-stack-values.yaml"
KUBERNETES_VERSION = "1.30"

# Where vLLM defines its Prometheus metrics (SpecDecodingProm; PrometheusStatLogger). Read as
# text, so the check costs no vLLM import.
VLLM_DIR = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
METRIC_SOURCES = [
    VLLM_DIR / "v1" / "spec_decode" / "metrics.py",
    VLLM_DIR / "v1" / "metrics" / "loggers.py",
]

MANIFEST_FILES = sorted(
    [*(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.json"), *K8S.rglob("*.yaml")]
)


def load(path: Path) -> list[Any]:
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load(path):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
                yield path, doc


def objects_of_kind(kind: str) -> list[dict[str, Any]]:
    return [obj for _, obj in k8s_objects() if obj["kind"] == kind]


def is_training(obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {})
    return labels.get("app.kubernetes.io/component") == "training"


def the(kind: str) -> dict[str, Any]:
    """The one serving object of ``kind`` (training-job.yaml has its own Service)."""
    (obj,) = [o for o in objects_of_kind(kind) if not is_training(o)]
    return obj


# ---------------------------------------------------------------------------- parsing


def test_there_is_something_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in MANIFEST_FILES}
    assert {
        "deploy/prometheus/peagle-alerts.yaml",
        "deploy/grafana/peagle-dashboard.json",
        "examples/kubernetes/deployment.yaml",
        "examples/kubernetes/service.yaml",
        "examples/kubernetes/pvc.yaml",
        "examples/kubernetes/keda-scaledobject.yaml",
        "examples/kubernetes/kserve-inferenceservice.yaml",
        "examples/kubernetes/production-stack-values.yaml",
    } <= names


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_parses(path):
    assert load(path), f"{path} is empty"


# ------------------------------------------------------------------ Kubernetes schema

# Objects whose schema ships with Kubernetes; custom resources are checked by hand below.
BUILTIN_KINDS = {
    "Deployment",
    "Service",
    "PersistentVolumeClaim",
    "HorizontalPodAutoscaler",
    "Job",
}


@pytest.mark.parametrize(
    "path,obj",
    [(p, o) for p, o in k8s_objects() if o["kind"] in BUILTIN_KINDS],
    ids=lambda v: v.name if isinstance(v, Path) else v["kind"],
)
def test_builtin_objects_match_the_kubernetes_schema(path, obj):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    # strict: unknown fields (a misspelt key Kubernetes would silently drop) fail too.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_only_known_custom_resources():
    kinds = {(o["apiVersion"], o["kind"]) for _, o in k8s_objects()} - {
        (o["apiVersion"], o["kind"]) for _, o in k8s_objects() if o["kind"] in BUILTIN_KINDS
    }
    assert kinds <= {
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
    }


def test_kustomization_lists_existing_builtin_files():
    for resource in the("Kustomization")["resources"]:
        for obj in load(K8S / resource):
            assert obj["kind"] in BUILTIN_KINDS, f"{resource}: needs a CRD, keep it optional"


# ------------------------------------------------------------ deployment conventions


def pod_spec() -> dict[str, Any]:
    return the("Deployment")["spec"]["template"]["spec"]


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return found


def check_gpu_pod(spec: dict[str, Any], container: dict[str, Any]) -> None:
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in container["env"]}
    cache_mount = next(path for path in mounts if env["HF_HOME"].startswith(path))
    claim = volumes[mounts[cache_mount]]["persistentVolumeClaim"]["claimName"]
    assert claim == the("PersistentVolumeClaim")["metadata"]["name"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and port_number(container, get["port"]) == 8000, probe
    startup = container["startupProbe"]
    # Weights download and load on the first start: at least 10 minutes before a restart.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_deployment_conventions():
    deployment = the("Deployment")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    template = deployment["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"
    (container,) = pod_spec()["containers"]
    check_gpu_pod(pod_spec(), container)


def test_service_reaches_the_pods():
    service = the("Service")
    labels = the("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod_spec()["containers"]
    (port,) = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == 8000


def test_keda_scales_the_deployment_on_queue_length():
    scaled = the("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == the("Deployment")["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    float(trigger["metadata"]["threshold"])  # KEDA wants the number as a string
    assert scaled["spec"]["minReplicaCount"] >= 1  # no scale to zero: loading takes minutes


def test_kserve_inference_service():
    isvc = the("InferenceService")
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["prometheus.kserve.io/port"] == "8000"
    predictor = isvc["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    check_gpu_pod(predictor, container)


# ------------------------------------------------------------------- training job


def test_training_job_runs_torchrun_on_every_pod():
    (job,) = objects_of_kind("Job")
    (service,) = [o for o in objects_of_kind("Service") if is_training(o)]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    # Pod 0 gets a DNS name through the headless Service: the rendezvous endpoint.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "torchrun"
    flags = dict(
        a.removeprefix("--").split("=", 1) for a in command if a.startswith("--") and "=" in a
    )
    assert int(flags["nnodes"]) == spec["parallelism"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert (
        int(flags["nproc-per-node"]) == gpus == container["resources"]["requests"]["nvidia.com/gpu"]
    )
    host, port = flags["rdzv-endpoint"].split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"]
    # The trainer's arguments pass our own parser, and the global batch splits over ranks.
    from vllm_peagle.cli import build_parser

    train = command[command.index("vllm_peagle.cli") + 1 :]
    args = build_parser().parse_args(train)
    assert args.command == "train"
    assert args.batch_size % (int(flags["nnodes"]) * gpus) == 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    data = next(m for m in mounts if args.out.startswith(m + "/"))
    assert "persistentVolumeClaim" in volumes[mounts[data]]  # every rank sees the checkpoint


# ---------------------------------------------------------------- vLLM's own parser


def helm_chart_argv(spec: dict[str, Any]) -> list[str]:
    """The `vllm serve` argv the production-stack chart builds from one modelSpec
    (helm/templates/deployment-vllm-multi.yaml); an unknown vllmConfig key fails, since the
    chart would silently ignore it."""
    config = dict(spec.get("vllmConfig", {}))
    argv = ["serve", spec["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
    if "enableChunkedPrefill" in config:
        chunked = config.pop("enableChunkedPrefill")
        argv.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
    prefix = config.pop("enablePrefixCaching", False)
    argv.append("--enable-prefix-caching" if prefix else "--no-enable-prefix-caching")
    flags = {
        "maxModelLen": "--max-model-len",
        "dtype": "--dtype",
        "tensorParallelSize": "--tensor-parallel-size",
        "maxNumSeqs": "--max-num-seqs",
        "gpuMemoryUtilization": "--gpu_memory_utilization",
        "maxLoras": "--max_loras",
    }
    extra = config.pop("extraArgs", [])
    for key in list(config):
        assert key in flags, f"vllmConfig.{key} is not passed to vLLM by the chart"
        argv += [flags[key], str(config.pop(key))]
    return argv + [str(a) for a in extra]


def container_argv(container: dict[str, Any]) -> list[str]:
    command = container.get("command", [])
    assert command == ["vllm", "serve"], "run vLLM's CLI directly, not through a shell"
    return ["serve", *container["args"]]


def serve_commands() -> list[tuple[str, list[str]]]:
    found = [("Deployment", container_argv(c)) for c in pod_spec()["containers"]] + [
        ("InferenceService", container_argv(c))
        for c in the("InferenceService")["spec"]["predictor"]["containers"]
    ]
    values = load(PRODUCTION_STACK_VALUES)[0]
    found += [
        (f"production-stack {spec['name']}", helm_chart_argv(spec))
        for spec in values["servingEngineSpec"]["modelSpec"]
    ]
    return found


@pytest.fixture(scope="module")
def vllm_cli():
    """`vllm`'s own top-level parser with its `serve` subcommand, built as vllm's CLI main
    builds it (vllm/entrypoints/cli/main.py). Importing it takes ~15 s on CPU."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser", required=True))
    return parser


@pytest.mark.parametrize(
    "where,argv", serve_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_serve_arguments_pass_vllms_parser(vllm_cli, where, argv):
    try:
        args = vllm_cli.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"{where}: `vllm {' '.join(argv)}` is rejected by vLLM's parser ({err})")
    assert args.model_tag == argv[1]
    spec = args.speculative_config
    assert isinstance(spec, dict), f"{where}: --speculative-config must be a JSON object"
    assert spec["method"] == "peagle"
    assert isinstance(spec["model"], str) and spec["model"]
    k = spec["num_speculative_tokens"]
    assert type(k) is int, f"{where}: num_speculative_tokens {k!r} is not an integer"
    assert k in range(1, MAX_SPECULATIVE_TOKENS + 1), (
        f"{where}: num_speculative_tokens {k} is outside 1..{MAX_SPECULATIVE_TOKENS}"
    )


def test_parser_catches_a_flag_typo(vllm_cli):
    argv = helm_chart_argv(load(PRODUCTION_STACK_VALUES)[0]["servingEngineSpec"]["modelSpec"][0])
    with pytest.raises(SystemExit):
        vllm_cli.parse_args([*argv, "--max-modle-len", "4096"])


# ------------------------------------------------------------------ metric names

METRIC = re.compile(r"vllm:[a-z_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def promql_expressions() -> dict[str, str]:
    exprs: dict[str, str] = {}
    for group in load(ALERTS)[0]["groups"]:
        for rule in group["rules"]:
            exprs[rule.get("alert") or rule["record"]] = rule["expr"]

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    exprs[f"{where}.{key}"] = value
                else:
                    walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    walk(load(DASHBOARD)[0], "dashboard")
    exprs["keda"] = the("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    return exprs


def vllm_metric_kinds() -> dict[str, str]:
    """vLLM's metric names mapped to counter/gauge/histogram, read from METRIC_SOURCES: each
    name takes the kind of the nearest metric class mentioned before it."""
    kinds: dict[str, str] = {}
    cls = re.compile(
        r"_(counter|gauge|histogram)_cls\b|prometheus_client\.(Counter|Gauge|Histogram)"
    )
    for source in METRIC_SOURCES:
        text = source.read_text()
        for match in re.finditer(r"\"(vllm:[a-z_]+)\"", text):
            before = list(cls.finditer(text, 0, match.start()))
            if before:
                kind = (before[-1].group(1) or before[-1].group(2)).lower()
                kinds.setdefault(match.group(1), kind)
    return kinds


def test_metric_sources_are_where_expected():
    kinds = vllm_metric_kinds()
    assert kinds["vllm:spec_decode_num_drafts"] == "counter"
    assert kinds["vllm:generation_tokens"] == "counter"
    assert kinds["vllm:num_requests_waiting"] == "gauge"


def test_every_referenced_metric_exists_in_vllm():
    kinds = vllm_metric_kinds()
    for where, expr in promql_expressions().items():
        for name in METRIC.findall(expr):
            base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            assert base in kinds, f"{where}: {name} is not defined in {METRIC_SOURCES}"
            if kinds[base] == "counter":
                # prometheus_client exposes counter `x` as `x_total`; `x` alone matches nothing.
                assert name == base + "_total", f"{where}: use {base}_total"
                assert re.search(rf"(rate|increase)\({re.escape(name)}\b", expr) or (
                    "label_values" in expr
                ), f"{where}: a counter is cumulative; take rate() of {name}"
            elif kinds[base] == "gauge":
                assert name == base, f"{where}: gauge {base} has no suffix"


def test_monitor_reads_metrics_vllm_defines():
    kinds = vllm_metric_kinds()
    for name in (monitor.GENERATION_TOKENS, monitor.PER_POSITION, monitor.RUNNING, monitor.WAITING):
        assert name in kinds
    for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert kinds[monitor.COUNTER_PREFIX + counter] == "counter"


def test_alert_threshold_matches_the_monitor_default():
    (rule,) = [
        r
        for g in load(ALERTS)[0]["groups"]
        for r in g["rules"]
        if r.get("alert") == "PEagleAcceptanceRateLow"
    ]
    assert f"< {monitor.DEFAULT_THRESHOLD}" in rule["expr"]
