"""The runbook driver: the notebooks run in order by papermill under the cluster's run lock (`sparkbook run`)."""
