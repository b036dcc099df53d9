"""Ray Tune search over pruning pipelines (`method`), the ratio and any stage setting, at an optional
total compute budget, with shared selections and MLflow lineage.

Heavy imports (ray, mlflow, optuna) happen inside the functions that need them."""
