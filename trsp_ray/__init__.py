"""trsp_ray: TRSP layer pruning (Feng et al., ACL 2026) with Ray, DeepSpeed, lm-eval and MLflow.

Importing this package is cheap: torch, transformers, ray, deepspeed, mlflow and lm_eval are
imported lazily by the modules that need them.
"""

__version__ = "0.1.0"
