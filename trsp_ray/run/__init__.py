"""One run in one process: the pipeline resolved once, the workbench, every method through one code
path, the stage-1 store, the compute budget, the export and MLflow tracking."""
