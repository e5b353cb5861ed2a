#!/bin/sh
# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.
# Or: sparkbook restore RUN_DIR
set -e
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts-1 -p 22 root@10.77.1.11 'docker start old-reranker'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts-1 -p 22 root@10.77.1.11 'docker start old-embeddings'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts-1 -p 22 root@10.77.1.10 'cd / && { setsid python3 /var/lib/sparkbook-lab/services/old_cluster_manager.py --pidfile /run/old-cluster-manager.pid --log /tmp/old-cluster-manager.log --name vllm_node --image sparkbook-lab/base:bookworm --service /var/lib/sparkbook-lab/services/old_service.py --member local,ray-head,8003 --member ssh://root@10.77.1.11,ray-worker,8004 </dev/null >/dev/null 2>&1 & }'
# lab-0 vllm_node: comes back with lab-0/python3[163]
# lab-1 vllm_node: comes back with lab-0/python3[163]
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts-1 -p 22 root@10.77.1.10 'docker start old-vllm'
ssh -i /var/lib/sparkbook-lab/ssh/id_ed25519 -o UserKnownHostsFile=/var/lib/sparkbook-lab/ssh/known_hosts-1 -p 22 root@10.77.1.10 'docker start old-proxy'
