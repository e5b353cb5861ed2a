"""04: the node containers (containers.py), Ray started in them, the join wait and the gate (formation.py), a
running cluster kept when it is still right (reuse.py), and the all_reduce test of the fabric under it
(allreduce.py)."""
