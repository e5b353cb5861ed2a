"""05: the commands from params (commands.py), launch and readiness (launch.py), a server kept when it already
serves this plan (reuse.py), the bring-up with its remediated retries (bringup.py, failures.py), the smoke test
(smoke.py)."""
