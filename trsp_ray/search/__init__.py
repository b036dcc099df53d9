"""Ray Tune search over lambda1, lambda2 and the pruning ratio with stage-1 reuse and MLflow lineage.

Heavy imports (ray, mlflow, optuna) happen inside the functions that need them."""
