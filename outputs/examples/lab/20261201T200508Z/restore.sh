#!/bin/sh
# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.
# Or: sparkbook restore RUN_DIR
set -e
