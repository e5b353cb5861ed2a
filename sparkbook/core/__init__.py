"""The core every stage stands on: params, nodes, runtimes, records, the runbook, shared host and cluster facts."""
