"""06: the benchmark stage: the sweep (sweep), its HTTP load generator (client) and its plots (plot)."""
