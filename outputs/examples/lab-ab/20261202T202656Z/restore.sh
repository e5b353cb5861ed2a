#!/bin/sh
# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.
# It FIRST STOPS THE NEW DEPLOYMENT (this runbook's node containers: their Ray and vLLM server), as
# `sparkbook restore RUN_DIR --stop-new` does: they hold the ports, memory and GPUs the old services
# need.
# Or: sparkbook restore RUN_DIR (refuses while the new deployment runs; --stop-new stops it first)
set -e
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.10 'docker stop sparkbook-lab-ab-lab-0 || true'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.11 'docker stop sparkbook-lab-ab-lab-1 || true'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.11 'docker start old-reranker'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.11 'docker start old-embeddings'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.10 'cd / && { setsid python3 /var/lib/sparkbook-lab/services/old_cluster_manager.py --pidfile /run/old-cluster-manager.pid --log /tmp/old-cluster-manager.log --name vllm_node --image sparkbook-lab/base:bookworm --service /var/lib/sparkbook-lab/services/old_service.py --member local,ray-head,8003 --member ssh://root@10.77.0.11,ray-worker,8004 </dev/null >/dev/null 2>&1 & }'
# lab-0 vllm_node: comes back with lab-0/python3[22155]
# lab-1 vllm_node: comes back with lab-0/python3[22155]
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.10 'docker start old-vllm'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts -p 22 root@10.77.0.10 'docker start old-proxy'
