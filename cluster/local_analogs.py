"""Local stand-ins for what a cluster job meets, so cluster/README.md's commands run on one CPU machine.

    python cluster/local_analogs.py hub --hf-home runs/hf          # a hub id in a Hugging Face cache
    python cluster/local_analogs.py bucket --endpoint http://127.0.0.1:9000 trsp   # a bucket on an S3 server
    python cluster/local_analogs.py cluster --dashboard-port 8266   # head + 2 one-CPU nodes, until killed

`hub` caches a 6-layer tiny Llama (with SmolLM2's tokenizer) as hub id `trsp-test/tiny-llama`, laid
out as `hf download` leaves it (refs/main -> snapshots/<commit>/), so `--model trsp-test/tiny-llama`
with HF_HOME set and HF_HUB_OFFLINE=1 goes through huggingface_hub exactly as
`meta-llama/Llama-2-70b-hf` does on a cluster. `bucket` creates a bucket on an S3-compatible server
(e.g. `moto_server -H 127.0.0.1 -p 9000`, from the dev extra), with the AWS_* credentials of the
environment. `cluster` starts a Ray head that runs nothing (0 CPUs, the dashboard for `ray job
submit`) and two 1-CPU nodes on this machine (ray.cluster_utils), so two workers land on two
nodes; it stops exactly those when killed (SIGTERM / Ctrl-C), never another Ray on the machine.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HUB_ID = "trsp-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_tiny_model(hf_home: Path, repo_id: str = HUB_ID) -> Path:
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.models.tiny import tiny_model

    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model("llama", layers=6, vocab=49152).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(tmp)
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in Path(tmp).iterdir():
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports() -> dict:
    """Agent ports of one more raylet on this machine (the defaults are taken by the first one)."""
    return {"dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port()}


def run_cluster(*, nodes: int, dashboard_port: int) -> None:
    import signal
    import time

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port,
        "gcs_server_port": free_port(), **node_ports()})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, **node_ports())
    cluster.wait_for_nodes()
    print(f"Ray cluster: head {cluster.address} (0 CPUs) + {nodes} x 1-CPU nodes; "
          f"RAY_ADDRESS=http://127.0.0.1:{dashboard_port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    finally:
        cluster.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    hub = sub.add_parser("hub")
    hub.add_argument("--hf-home", required=True, type=Path)
    bucket = sub.add_parser("bucket")
    bucket.add_argument("--endpoint", required=True)
    bucket.add_argument("name")
    cluster = sub.add_parser("cluster")
    cluster.add_argument("--nodes", type=int, default=2)
    cluster.add_argument("--dashboard-port", type=int, default=8266)
    args = p.parse_args(argv)
    if args.what == "cluster":
        run_cluster(nodes=args.nodes, dashboard_port=args.dashboard_port)
    elif args.what == "hub":
        print(f"cached {HUB_ID} at {cache_tiny_model(args.hf_home.resolve())}")
    else:
        import boto3

        boto3.client("s3", endpoint_url=args.endpoint).create_bucket(Bucket=args.name)
        print(f"bucket {args.name} at {args.endpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
