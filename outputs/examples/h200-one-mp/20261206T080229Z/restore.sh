#!/bin/sh
# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.
# It FIRST STOPS THE NEW DEPLOYMENT (this runbook's node containers: their Ray and vLLM server), as
# `sparkbook restore RUN_DIR --stop-new` does: they hold the ports, memory and GPUs the old services
# need.
# Or: sparkbook restore RUN_DIR (refuses while the new deployment runs; --stop-new stops it first)
set -e
# the new deployment runs as processes of a Python environment (no container): stop them first
