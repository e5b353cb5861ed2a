"""06: the benchmark stage: the sweep (sweep), its HTTP load generator (client), its tables and its plots (plot)."""
