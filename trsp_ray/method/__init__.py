"""The method as plain torch (no Ray, MLflow or DeepSpeed): gates, stage 1, stage 2, the heal and its
recipes, the selectors, the fits (compensation) and layer surgery."""
