"""cluster/: the files parse, follow their schemas, name entrypoints that exist, and request the
GPUs the memory planner says the jobs need."""

import json
import math
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
KUBERAY = CLUSTER / "kuberay"
LLAMA2_70B = {"vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}
GPUS_PER_NODE = 8


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _gpus(group: dict) -> int:
    containers = group["template"]["spec"]["containers"]
    per_pod = sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in containers)
    return per_pod * int(group.get("replicas", 0))


def _cluster_gpus(spec: dict) -> int:
    return sum(_gpus(g) for g in spec["workerGroupSpecs"])


def _script(entrypoint: str) -> Path:
    args = shlex.split(entrypoint)
    assert args[0] == "python", entrypoint
    return ROOT / args[1]


def test_launcher_yaml_validates_against_rays_schema():
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = _load(CLUSTER / "ray-cluster.yaml")
    jsonschema.validate(config, schema)
    assert config["head_node_type"] in config["available_node_types"]
    assert ray.__version__ in config["docker"]["image"]
    gpu_nodes = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    total = sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_nodes)
    assert total == _prune_70b_gpus()


def test_runtime_env_is_a_valid_ray_runtime_env():
    from ray.runtime_env import RuntimeEnv

    env = _load(CLUSTER / "runtime_env.yaml")
    RuntimeEnv(**env)  # raises on unknown fields or wrong types
    assert env["working_dir"] == "."


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob-prune-70b.yaml", "rayjob-reproduce.yaml"])
def test_kuberay_manifests_have_the_v1_shape_and_rays_version(name):
    import ray

    doc = _load(KUBERAY / name)
    assert doc["apiVersion"] == "ray.io/v1"
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    assert doc["kind"] in ("RayCluster", "RayJob")
    assert spec["rayVersion"] == ray.__version__
    assert spec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    if doc["kind"] == "RayJob":
        assert _script(doc["spec"]["entrypoint"]).is_file()
        env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
        assert "env_vars" in env and "working_dir" in env


def _prune_70b_gpus() -> int:
    """What jobs/prune_70b.py needs for Llama-2-70B with its cluster defaults, per the planner."""
    import sys

    from trsp_ray.plan import zero3_plan, zero3_setup
    from trsp_ray.reproduce.presets import ModelSpec
    from trsp_ray.reproduce.work import planner_shape

    sys.path.insert(0, str(ROOT / "jobs"))
    import prune_70b

    args = prune_70b.parse_args(["--model", "meta-llama/Llama-2-70b-hf"])
    cfg = prune_70b.job_config(args)
    shape = planner_shape(ModelSpec("llama2-70b", "x", LLAMA2_70B))
    need = zero3_plan.min_workers(shape, zero3_setup.setup_for_run(cfg))
    assert need is not None
    return need


def test_prune_70b_job_requests_what_the_planner_needs():
    doc = _load(KUBERAY / "rayjob-prune-70b.yaml")
    need = _prune_70b_gpus()
    assert _cluster_gpus(doc["spec"]["rayClusterSpec"]) == need == 16
    workers = shlex.split(doc["spec"]["entrypoint"])
    assert int(workers[workers.index("--workers") + 1]) == need
    assert _cluster_gpus(_load(KUBERAY / "raycluster.yaml")["spec"]) == need


def test_reproduce_job_requests_what_the_planner_needs():
    from trsp_ray.reproduce.presets import PAPER
    from trsp_ray.reproduce.work import gpus_needed

    doc = _load(KUBERAY / "rayjob-reproduce.yaml")
    args = shlex.split(doc["spec"]["entrypoint"])
    assert args[args.index("--preset") + 1] == "paper"
    need = gpus_needed(PAPER)
    have = _cluster_gpus(doc["spec"]["rayClusterSpec"])
    # Enough for the largest cell, in whole nodes, and not a node more.
    assert have == math.ceil(need / GPUS_PER_NODE) * GPUS_PER_NODE and need <= have


def test_readme_commands_name_existing_files():
    text = (CLUSTER / "README.md").read_text()
    for path in ("cluster/ray-cluster.yaml", "cluster/runtime_env.yaml", "jobs/prune_70b.py", "jobs/reproduce.py",
                 "cluster/kuberay/raycluster.yaml", "cluster/kuberay/rayjob-prune-70b.yaml",
                 "cluster/kuberay/rayjob-reproduce.yaml"):
        assert path in text and (ROOT / path).is_file(), path
    for command in ("ray up", "ray job submit", "mlflow ui", "kubectl apply", "ray dashboard"):
        assert command in text, command


def _containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    out = [c for g in groups for c in g["template"]["spec"]["containers"]]
    if doc["kind"] == "RayJob":
        out += doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return out


def test_dashboard_and_mlflow_are_not_open_to_the_network():
    """Job submission through the dashboard runs code: localhost only (cluster launcher) or a token
    on every Ray container (KubeRay, where the submitter and the operator reach the head)."""
    launcher = _load(CLUSTER / "ray-cluster.yaml")
    head = " ".join(launcher["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "mlflow ui --host 127.0.0.1" in head
    for name in ("raycluster.yaml", "rayjob-prune-70b.yaml", "rayjob-reproduce.yaml"):
        doc = _load(KUBERAY / name)
        for container in _containers(doc):
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["RAY_AUTH_MODE"]["value"] == "token", (name, container["name"])
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "trsp-ray-auth"
    text = " ".join(p.read_text() for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".md"))
    assert "--host 0.0.0.0" not in text and "containerPort: 5000" not in text
    assert "kubectl create secret generic trsp-ray-auth" in (CLUSTER / "README.md").read_text()


def test_no_checkpoint_is_unpickled(tmp_path):
    """Checkpoints load with torch.load(weights_only=True) (or safetensors / JSON), never a pickle."""
    import re

    for path in list((ROOT / "trsp_ray").rglob("*.py")) + list((ROOT / "jobs").glob("*.py")):
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            # torch >= 2.6 defaults to weights_only=True; an explicit False would unpickle
            assert "weights_only=False" not in call and "pickle_module" not in call, (path, call)
    # ... and this torch's default refuses a pickled object indeed.
    import pickle

    import torch

    path = tmp_path / "evil.pt"
    torch.save({"obj": Path(".")}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
