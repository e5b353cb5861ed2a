"""01: inventory what the old deployment holds (inventory.py), plan its stop, dependents first, with what a unit
or managed process owns under its owner (planning.py, ownership.py), write the restore plan (restore.py), act and
verify (act.py); `sparkbook restore` brings it back (restore.py)."""
