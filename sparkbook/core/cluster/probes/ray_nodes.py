"""What Ray's GCS knows about nodes and placement groups (runs in the head's container).

usage: python3 -c SOURCE RAY_ADDRESS   (SOURCE = probes.source("ray_nodes")) -> its document
"""
import sys


def main():
    import ray
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False, configure_logging=False)
    from ray.util import placement_group_table
    nodes = [{"ip": n["NodeManagerAddress"], "alive": n["Alive"], "hostname": n["NodeManagerHostname"],
              "resources": n["Resources"]} for n in ray.nodes()]
    pgs = [{"id": k, "state": v["state"], "name": v.get("name", "")} for k, v in placement_group_table().items()]
    return {"nodes": nodes, "placement_groups": pgs}
