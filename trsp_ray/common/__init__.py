"""Plumbing every floor uses: one-line errors, atomic writes, progress logs, the run log, tables,
plots and the one process exit. Imports nothing of trsp_ray."""
