#!/bin/sh
# Brings back what 01-cleanup stopped (reverse order). Or: sparkbook restore RUN_DIR
set -e
ssh lab-1 docker start old-reranker
ssh lab-1 docker start old-embeddings
ssh lab-0 docker start old-vllm
ssh lab-0 docker start old-proxy
