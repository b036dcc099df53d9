"""The comparison behind `trsp-ray benchmark` (SPEC section 5): its jobs, paired statistics, the
report, and the same work as a Ray workload on a local or remote cluster."""
